"""Strategies: the parallelisms beyond a 1-D TP/SP plan, each applied to the zoo's models.

`data_parallel` (DP, FSDP, accumulation), `mesh` (TP x DP), `pipeline`, `pipeline_train`,
`pipeline_mesh`, `pipeline_mesh_train` (PP, PP x TP), `context`, `context_llama` (CP: all-gather,
ring, zig-zag), `expert`, `expert_mesh` (EP, EP x TP).

May import: exporters.capture, exporters.zoo, exporters.errors, refine's base modules.
"""
