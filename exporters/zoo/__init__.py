"""The zoo: small models built from configs, their TP/SP plans, bug twins and `refine zoo`.

`models` (tiny Llama, Qwen2, GPT-2, Mixtral with random weights), `moe` (the dense MoE block),
`configs` (sizes, presets, the check that a plan divides them), `plans` (DTensor
`parallelize_module` plans), `bugs` (bugs injected into plans and modules), `tensor_parallel`
(`export_model`: a zoo model under its TP or TP+SP plan), `entries` (`refine zoo`: a directory
of entries and their twins).

May import: exporters.capture (tensor_parallel, entries), the strategies and frameworks
(entries only: it exports every plan), exporters.errors, refine's base modules.
"""
