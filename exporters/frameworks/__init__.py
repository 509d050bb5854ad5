"""Frameworks: models exported as their own framework ships them and parallelizes them.

`megatron` (Megatron-Core's GPTModel), with `megatron_shims` (its CUDA-only helpers replaced on
the CPU, listed) and `megatron_bugs` (historical TP mistakes reintroduced into its modules).
`torchtitan` (torchtitan's Llama 3 through its own parallelize path), with `torchtitan_shims`
(where it assumes CUDA, listed), `torchtitan_bugs` (its twins) and `torchtitan_zoo` (`refine zoo
--framework torchtitan`).

May import: exporters.capture, exporters.zoo.configs, exporters.errors, refine's base modules.
"""
