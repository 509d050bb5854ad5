"""Parallel plans for the zoo models, as DTensor `parallelize_module` plans.

TP (Megatron): q/k/v and the MLP's up projections column-parallel, the attention output and
MLP down projections row-parallel (their output all-reduced); embeddings, norms and the LM head
replicated.

SP (TP + sequence parallel, after torchtitan's llama plan): between the blocks the residual
stream is sharded along the sequence (Shard(1)); norms run on the local sequence chunk
(SequenceParallel); each attention/MLP gathers the sequence (all-gather) before its
column-parallel projections and its row-parallel output projection reduce-scatters back to
sequence shards; the final norm is sequence-parallel and the LM head gathers the sequence.
Differences from torchtitan, both forced by exporting HF code:
- the token embedding stays replicated and the first block slices the sequence
  (Replicate -> Shard(1), no communication): a vocab-parallel embedding (RowwiseParallel)
  leaves a mask buffer that torch.export rejects ("fake tensor in the exported program
  constant's list"), and a sequence-sharded *local* embedding output would make HF compute
  position ids and the causal mask from the local sequence length;
- row-parallel outputs stay DTensors (use_local_output=False) so that HF's shape-dependent
  code between the blocks sees global shapes.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

Plan = dict[str, ParallelStyle]

# model -> (blocks prefix, attention, its column-/row-parallel children, mlp, its children,
#           per-block norms, final norm, lm head); names relative to the zoo module's root.
_NAMES = {
    "hf": ("model.layers", "self_attn", ("q_proj", "k_proj", "v_proj"), ("o_proj",),
           "mlp", ("gate_proj", "up_proj"), ("down_proj",),
           ("input_layernorm", "post_attention_layernorm"), "model.norm", "lm_head"),
    "gpt2": ("h", "attn", ("q_proj", "k_proj", "v_proj"), ("c_proj",),
             "mlp", ("c_fc",), ("c_proj",), ("ln_1", "ln_2"), "ln_f", "lm_head"),
}


def _names(model: str) -> tuple:
    return _NAMES["gpt2" if model == "gpt2" else "hf"]


def layer_stack(model: str) -> str:
    """The FQN of the ModuleList holding a zoo model's decoder layers (`model.layers`, `h`)."""
    return _names(model)[0]


def first_block_sites(model: str) -> dict[str, str]:
    """FQNs of the first block's modules a bug rewrites: attention, its output projection, its
    k and v projections, and the MLP's down projection."""
    blocks, attn, attn_col, attn_row, mlp, _mlp_col, mlp_row, *_ = _names(model)
    block = f"{blocks}.0"
    return {"attn": f"{block}.{attn}", "o_proj": f"{block}.{attn}.{attn_row[0]}",
            "k_proj": f"{block}.{attn}.{attn_col[1]}", "v_proj": f"{block}.{attn}.{attn_col[2]}",
            "down": f"{block}.{mlp}.{mlp_row[0]}"}


def first_block_train_sites(model: str) -> dict[str, list[str]]:
    """FQNs of the first block's modules a training-step bug rewrites: the MLP's
    column-parallel projections, and the norm before the MLP."""
    blocks, _attn, _attn_col, _attn_row, mlp, mlp_col, _mlp_row, norms, *_ = _names(model)
    block = f"{blocks}.0"
    return {"mlp_columns": [f"{block}.{mlp}.{name}" for name in mlp_col], "mlp_norm": [f"{block}.{norms[1]}"]}


def _num_blocks(module: nn.Module, prefix: str) -> int:
    return len(module.get_submodule(prefix))


def make_plan(model: str, module: nn.Module, sp: bool = False) -> Plan:
    """The TP (or TP+SP) plan for a zoo module built by refine.exporters.zoo.models.build(model, ...)."""
    if model == "mixtral":  # its MoE blocks have a plan of their own
        from refine.exporters.zoo import moe

        return moe.make_plan(module, sp)
    blocks, attn, attn_col, attn_row, mlp, mlp_col, mlp_row, norms, final_norm, head = _names(model)
    plan: Plan = {}
    out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    for i in range(_num_blocks(module, blocks)):
        block = f"{blocks}.{i}"
        for sub, col, row in ((attn, attn_col, attn_row), (mlp, mlp_col, mlp_row)):
            for name in col:
                plan[f"{block}.{sub}.{name}"] = ColwiseParallel()
            for name in row:
                plan[f"{block}.{sub}.{name}"] = RowwiseParallel(**out)
        if sp:
            for norm in norms:
                plan[f"{block}.{norm}"] = SequenceParallel()
            # hidden_states is a keyword argument of HF's attention call, positional elsewhere
            kw = model != "gpt2"
            plan[f"{block}.{attn}"] = _gather_sequence(kw)
            plan[f"{block}.{mlp}"] = _gather_sequence(False)
    if sp:
        plan[f"{blocks}.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
        )
        plan[final_norm] = SequenceParallel()
        if model == "gpt2":  # the LM head is tied to the (replicated) token embedding
            plan[head] = _gather_sequence(False)
        else:
            plan[head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def _gather_sequence(keyword: bool) -> PrepareModuleInput:
    """Sequence shards in, the whole sequence (a local tensor) to the module."""
    if keyword:
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
