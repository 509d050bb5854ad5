"""A tiny Mixtral: HF's MixtralForCausalLM whose sparse MoE blocks compute densely, and its
tensor-parallel plans.

Why not HF's block as it is: `MixtralExperts` loops over the experts some token picked
(`nonzero`, a Python loop over a data-dependent set: torch.export cannot trace it), and its
`batched_mm` variant gathers expert weights by routed index from one fused [gate; up] tensor,
which a DTensor Shard cannot cut into per-rank [gate_r; up_r] halves (BUGS.md class 6).
`DenseDispatchMoE` is the same block written the way a TP implementation can: the router,
softmax and top-k as in HF, the top-k weights scattered into a dense [tokens, experts] routing
matrix (zero for experts not picked), every expert run on every token, and the outputs summed
with their routing weights. Experts not picked get weight 0, so the sum is HF's (checked
against HF's block by tests/test_moe.py). Each expert is the original Mixtral MLP, w2(silu(w1 x)
* w3 x), with separate nn.Linear w1/w3/w2 (HF's fused gate_up_proj split at load).

Plans (DTensor, one 1-D mesh): attention as for Llama (q/k/v column-, o row-parallel); the
router replicated (every rank routes every token the same way); each expert's w1/w3 column-
and w2 row-parallel, w2's output kept a local partial sum, and ONE all-reduce of the MoE
block's output (Megatron's pattern: the routing-weighted sum of partials is a partial).
Variants (`PLANS`): `router_rowwise` cuts the router along the hidden axis and all-reduces its
logits (correct too); the bugs `router_partial` (the router's logits from a hidden shard,
never reduced: each rank routes on its own partial sums) and `missing_allreduce` (the block's
partial sums go into the residual stream).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleOutput, RowwiseParallel

from refine.exporters.errors import ExportError

EXPERTS, TOP_K = 4, 2  # experts per MoE block, experts each token is routed to
PLANS = ("tp", "router_rowwise", "router_partial", "missing_allreduce")

Plan = dict[str, ParallelStyle]


class ExpertMLP(nn.Module):
    """One Mixtral expert: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)  # gate
        self.w3 = nn.Linear(hidden, intermediate, bias=False)  # up
        self.w2 = nn.Linear(intermediate, hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DenseDispatchMoE(nn.Module):
    """Mixtral's sparse MoE block with dense dispatch (see the module docstring)."""

    def __init__(self, hidden: int, intermediate: int, experts: int = EXPERTS, top_k: int = TOP_K) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.experts = nn.ModuleList(ExpertMLP(hidden, intermediate) for _ in range(experts))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (all in forward: torch's stack traces keep forward frames only, so that reports can
        # name each line)
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        # [tokens, experts]: the renormalized weight of each picked expert, 0 for the others
        weights = torch.zeros_like(probs).scatter(1, top_i, top_w).to(x.dtype)
        out = weights[:, 0, None] * self.experts[0](x)
        for e in range(1, len(self.experts)):
            out = out + weights[:, e, None] * self.experts[e](x)
        return out.view(b, s, h)

    @classmethod
    def from_hf(cls, block: nn.Module) -> DenseDispatchMoE:
        """The same block as HF's MixtralSparseMoeBlock `block` (its weights, split per expert)."""
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj  # [E, 2I, H], [E, H, I]
        n, two_i, h = gate_up.shape
        ours = cls(h, two_i // 2, n, block.top_k).to(gate_up.device)
        with torch.no_grad():
            ours.gate.weight.copy_(block.gate.weight)
            for e, expert in enumerate(ours.experts):
                expert.w1.weight.copy_(gate_up[e, : two_i // 2])
                expert.w3.weight.copy_(gate_up[e, two_i // 2 :])
                expert.w2.weight.copy_(down[e])
        return ours


def use_dense_moe(model: nn.Module) -> nn.Module:
    """Replace every decoder layer's HF MoE block (`mlp`) by its DenseDispatchMoE twin."""
    for layer in model.model.layers:
        layer.mlp = DenseDispatchMoE.from_hf(layer.mlp)
    return model


# --- plans -----------------------------------------------------------------------------------------


def make_plan(module: nn.Module, sp: bool = False, variant: str = "tp") -> Plan:
    """The TP plan `variant` (see PLANS) for a model built by refine.exporters.zoo.models.build("mixtral", ...)."""
    if sp:
        raise ExportError("mixtral: only the TP plan exists (no sequence parallelism)")
    if variant not in PLANS:
        raise ExportError(f"unknown mixtral plan {variant!r} (known: {', '.join(PLANS)})")
    plan: Plan = {}
    for i, layer in enumerate(module.model.layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        for e in range(len(layer.mlp.experts)):
            plan[f"{p}.mlp.experts.{e}.w1"] = ColwiseParallel()
            plan[f"{p}.mlp.experts.{e}.w3"] = ColwiseParallel()
            # each expert's output stays this rank's partial sum (no all-reduce per expert)
            plan[f"{p}.mlp.experts.{e}.w2"] = RowwiseParallel(output_layouts=Partial())
        if variant != "missing_allreduce":  # one all-reduce of the block's routing-weighted sum
            plan[f"{p}.mlp"] = PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())
        if variant == "router_rowwise":  # the router cut along the hidden axis, its logits all-reduced
            plan[f"{p}.mlp.gate"] = RowwiseParallel(input_layouts=Replicate())
        elif variant == "router_partial":  # BUG: the same cut, the logits never reduced
            plan[f"{p}.mlp.gate"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Partial())
    return plan
