"""Bugs people write when they parallelize a model, injected into the zoo models in PyTorch.

Each bug is a change to the rank side only, made where such bugs are made: a wrong entry in the
DTensor plan (a `ParallelStyle` whose reduction is wrong), or a module whose forward computes
with the wrong head count. The sequential model and refine.json are those of the correct
export, read off DTensor as usual (exporters/capture/layouts.py), so a buggy twin differs from its
correct sibling only in the rank programs, and the verifier must find the difference itself.

The bugs touch the first block (`model.layers.0` / `h.0`). Classes refer to BUGS.md. The last
three are bugs of the backward pass, refuted in training steps (`train=True`); their forward is
correct, so a forward export of them verifies:

| bug | class | what the ranks do |
|---|---|---|
| `missing_allreduce` | 1 | MLP down projection: the partial sums are used as if complete (SP: each rank keeps its sequence chunk of its partial sum, no reduce-scatter) |
| `wrong_reduce_op` | 2 | attention output projection: the partial sums are reduced with max instead of sum |
| `bias_before_allreduce` | 3 | GPT-2 MLP c_proj: every rank adds the full bias to its partial sum |
| `kv_wrong_offset` | 7 | k/v projections replicated, and every rank takes the *first* local-head-count heads instead of its own |
| `global_head_count` | 8 | GPT-2 attention: the local q/k/v are viewed with the global head count (every head, a slice of its dims) |
| `wrong_group` | 11 | MLP down projection: the all-reduce runs over half the ranks (another group's shape) |
| `avg_allreduce` | 14 | attention output projection: reduced with avg, an extra 1/TP factor |
| `missing_grad_allreduce` | 1 (backward) | MLP column-parallel projections, Megatron-style: the input's gradient is not all-reduced (copy-to-region backward is an identity) |
| `grad_avg_allreduce` | 14 | the same gradient all-reduced with avg: an extra 1/TP in the backward |
| `sp_norm_grad_unreduced` | 4 | SP: the norm before the MLP runs on the local sequence chunk with a plain weight whose gradient is never all-reduced |

`FaultyRowwise(None)`, `HeadSlice(own=True)`, `FaultyColwise("sum")` and
`LocalSequenceNorm(reduce_grad=True)` are the correct forms of the same code, so a test can show
that the injection machinery itself verifies.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from refine.exporters.zoo.plans import Plan, first_block_sites, first_block_train_sites

RowFault = str  # "missing_allreduce" | "wrong_reduce_op" | "bias_before_allreduce" | "wrong_group" | "avg_allreduce"


def _site(model: str, what: str) -> str:
    return first_block_sites(model)[what]


# --- row-parallel linear with a faulty reduction ------------------------------------------------


def _half_group(world: int) -> Any:
    """The process group of this rank's half of the world (every rank creates both halves, in
    order, as torch.distributed requires); a group of one at world size 2."""
    half = max(1, world // 2)
    groups = [dist.new_group(list(range(lo, min(world, lo + half)))) for lo in range(0, world, half)]
    return groups[dist.get_rank() // half]


class FaultyRowwise(RowwiseParallel):
    """RowwiseParallel on an nn.Linear, written Megatron-style with local tensors, whose reduction
    of the partial sums is `fault`'s (None: the correct one, a sum over all ranks, bias after)."""

    def __init__(self, fault: RowFault | None, *, output_layouts: Any = None, use_local_output: bool = True) -> None:
        super().__init__(output_layouts=output_layouts, use_local_output=use_local_output)
        self.fault = fault

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FaultyRowwise needs an nn.Linear, got {type(module).__name__}")
        distribute_module(module, device_mesh, self._partition_linear_fn)  # weights only, no hooks
        group = _half_group(device_mesh.size()) if self.fault == "wrong_group" else None
        module.forward = types.MethodType(
            partial(_row_forward, fault=self.fault, mesh=device_mesh, group=group,
                    output_layouts=self.output_layouts, use_local_output=self.use_local_output), module)
        return module


def _row_forward(self: nn.Linear, x: torch.Tensor, *, fault: RowFault | None, mesh: Any, group: Any,
                 output_layouts: tuple[Any, ...], use_local_output: bool) -> torch.Tensor:
    """y = reduce(x_r @ W_r^T) + b, with the reduction (and the bias) as `fault` has them."""
    x = x.to_local() if isinstance(x, DTensor) else x
    bias = None if self.bias is None else self.bias.to_local()
    y = F.linear(x, self.weight.to_local())  # this rank's partial sum
    placement: Any = Partial("sum")
    if fault == "bias_before_allreduce":
        y, bias = y + bias, None  # BUG: the full bias on every rank, summed TP times
    elif fault == "missing_allreduce":
        placement = Replicate()  # BUG: the partial sum taken for the complete one
    elif fault == "wrong_reduce_op":
        placement = Partial("max")  # BUG: max where the sum belongs
    elif fault == "avg_allreduce":
        placement = Partial("avg")  # BUG: avg, an extra 1/TP
    elif fault == "wrong_group":
        y = funcol.all_reduce(y, "sum", group)  # BUG: summed over half the ranks only
        placement = Replicate()
    elif fault is not None:
        raise ValueError(f"unknown row-parallel fault {fault!r}")
    out = DTensor.from_local(y, mesh, [placement], run_check=False).redistribute(mesh, output_layouts)
    if bias is not None:
        out = out + DTensor.from_local(bias, mesh, [Replicate()], run_check=False)
    return out.to_local() if use_local_output else out


# --- key/value heads replicated, sliced per rank -------------------------------------------------


class HeadSlice(ParallelStyle):
    """A projection left replicated (all heads on every rank) whose output each rank slices to
    its share of the heads: its own share (`own`, correct), or the first share (the bug)."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        self.own = own

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        world, rank = device_mesh.size(), device_mesh.get_local_rank()
        width = module.out_features // world
        start = rank * width if self.own else 0  # BUG unless own: every rank takes heads 0..
        module.register_forward_hook(lambda _m, _args, out: out[..., start : start + width])
        return module


# --- GPT-2 attention with the global head count ----------------------------------------------------


def _global_head_count_forward(self: nn.Module, x: torch.Tensor, *, heads: int) -> torch.Tensor:
    """zoo.GPT2Attention.forward, except that the local q/k/v [b, s, h/tp] are viewed as the
    global number of heads (each with head_dim/tp dims) rather than h/tp/head_dim whole heads."""
    b, s, _ = x.shape
    q, k, v = (p(x).view(b, s, heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))  # BUG
    scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5)
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    out = torch.matmul(scores.softmax(dim=-1), v)
    return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))


# --- Megatron-style column-parallel linear: the all-reduce of its input's gradient --------------

GradReduce = str  # "sum" (correct), "none" (class 1, backward), "avg" (class 14)


class _CopyToRegion(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: the identity forward, and the backward
    all-reduce that sums the partial input gradients of a column-parallel layer (or, in the
    bugs, does not, or averages them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, reduce: GradReduce, group: Any) -> torch.Tensor:
        ctx.reduce, ctx.group = reduce, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if ctx.reduce == "none":
            return grad, None, None  # BUG: this rank's partial gradient taken for the whole one
        return funcol.all_reduce(grad, ctx.reduce, ctx.group), None, None  # "avg" is the BUG: 1/TP


class FaultyColwise(ColwiseParallel):
    """ColwiseParallel on an nn.Linear, written Megatron-style with local tensors: the input goes
    through _CopyToRegion with the given gradient reduction ("sum" is the correct one)."""

    def __init__(self, reduce: GradReduce) -> None:
        super().__init__()
        self.reduce = reduce

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FaultyColwise needs an nn.Linear, got {type(module).__name__}")
        distribute_module(module, device_mesh, self._partition_linear_fn)  # weights only, no hooks
        module.forward = types.MethodType(partial(_column_forward, reduce=self.reduce, group=device_mesh.get_group()),
                                          module)
        return module


def _column_forward(self: nn.Linear, x: torch.Tensor, *, reduce: GradReduce, group: Any) -> torch.Tensor:
    """y_r = copy_to_region(x) @ W_r^T + b_r: this rank's columns of the output."""
    x = _CopyToRegion.apply(x.to_local() if isinstance(x, DTensor) else x, reduce, group)
    bias = None if self.bias is None else self.bias.to_local()
    return F.linear(x, self.weight.to_local(), bias)


# --- a sequence-parallel norm with a plain (not DTensor) weight -----------------------------------


class LocalSequenceNorm(ParallelStyle):
    """A norm run on the rank's sequence chunk, Megatron-style: its weights stay plain replicated
    tensors (not DTensors), so their gradients are sums over the local tokens only unless
    `reduce_grad` all-reduces them (the BUG is reduce_grad=False: BUGS.md class 4)."""

    def __init__(self, reduce_grad: bool) -> None:
        super().__init__()
        self.reduce_grad = reduce_grad

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.forward = types.MethodType(
            partial(_local_norm_forward, cls=type(module), mesh=device_mesh, reduce_grad=self.reduce_grad), module)
        return module


def _local_norm_forward(self: nn.Module, x: torch.Tensor, *, cls: type, mesh: Any, reduce_grad: bool) -> torch.Tensor:
    """The norm's own forward on the local sequence chunk (Shard(1) in, Shard(1) out)."""
    from torch.nn.utils.stateless import _reparametrize_module

    local = x.to_local() if isinstance(x, DTensor) else x
    weights = dict(self.named_parameters(recurse=False))
    if reduce_grad:
        # the identity forward, the gradient summed over the TP group in the backward (Megatron
        # all-reduces the gradients of sequence-parallel norm weights so)
        weights = {name: _CopyToRegion.apply(w, "sum", mesh.get_group()) for name, w in weights.items()}
    with _reparametrize_module(self, weights):
        out = cls.forward(self, local)
    return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)


# --- the catalogue ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bug:
    """One injectable bug: its BUGS.md class, which models it applies to, and the injection."""

    name: str
    bug_class: int
    title: str
    models: tuple[str, ...]
    edit_plan: Callable[[str, Plan, bool], None]  # (model, plan, sp) -> None, in place
    edit_module: Callable[[str, nn.Module], None] | None = None  # after parallelize_module
    plans: tuple[str, ...] = ("tp", "sp")  # the plans it can be injected into
    train_only: bool = False  # a backward bug: its forward is correct

    def applies(self, model: str, sp: bool | None = None) -> bool:
        return model in self.models and (sp is None or ("sp" if sp else "tp") in self.plans)


def _row(site: str, fault: RowFault | None) -> Callable[[str, Plan, bool], None]:
    def edit(model: str, plan: Plan, sp: bool) -> None:
        name = _site(model, site)
        old = plan[name]
        assert isinstance(old, RowwiseParallel), f"{name} is not row-parallel in the plan"
        plan[name] = FaultyRowwise(fault, output_layouts=old.output_layouts[0], use_local_output=old.use_local_output)

    return edit


def _kv(own: bool) -> Callable[[str, Plan, bool], None]:
    def edit(model: str, plan: Plan, sp: bool) -> None:
        for what in ("k_proj", "v_proj"):
            plan[_site(model, what)] = HeadSlice(own)

    return edit


def _columns(reduce: GradReduce) -> Callable[[str, Plan, bool], None]:
    def edit(model: str, plan: Plan, sp: bool) -> None:
        for name in first_block_train_sites(model)["mlp_columns"]:
            assert isinstance(plan[name], ColwiseParallel), f"{name} is not column-parallel in the plan"
            plan[name] = FaultyColwise(reduce)

    return edit


def _sp_norm(reduce_grad: bool) -> Callable[[str, Plan, bool], None]:
    def edit(model: str, plan: Plan, sp: bool) -> None:
        if not sp:
            raise ValueError("a sequence-parallel norm bug needs the SP plan")
        for name in first_block_train_sites(model)["mlp_norm"]:
            plan[name] = LocalSequenceNorm(reduce_grad)

    return edit


def _no_plan_change(model: str, plan: Plan, sp: bool) -> None:
    return None


def _gpt2_global_heads(model: str, module: nn.Module) -> None:
    attn = module.get_submodule(_site(model, "attn"))
    heads = attn.q_proj.weight.shape[0] // attn.head_dim  # the sequential head count
    attn.forward = types.MethodType(partial(_global_head_count_forward, heads=heads), attn)


ALL_MODELS = ("llama", "qwen2", "gpt2")

BUGS: dict[str, Bug] = {b.name: b for b in (
    Bug("missing_allreduce", 1, "missing all-reduce after the row-parallel MLP down projection", ALL_MODELS,
        _row("down", "missing_allreduce")),
    Bug("wrong_reduce_op", 2, "attention output projection reduced with max instead of sum", ALL_MODELS,
        _row("o_proj", "wrong_reduce_op")),
    Bug("bias_before_allreduce", 3, "every rank adds the full MLP c_proj bias before the all-reduce", ("gpt2",),
        _row("down", "bias_before_allreduce")),
    Bug("kv_wrong_offset", 7, "k/v replicated, every rank attends with the first heads instead of its own",
        ALL_MODELS, _kv(own=False)),
    Bug("global_head_count", 8, "local q/k/v viewed with the global head count after sharding", ("gpt2",),
        _no_plan_change, _gpt2_global_heads),
    Bug("wrong_group", 11, "MLP down projection all-reduced over half the ranks", ALL_MODELS,
        _row("down", "wrong_group")),
    Bug("avg_allreduce", 14, "attention output projection all-reduced with avg (an extra 1/TP)", ALL_MODELS,
        _row("o_proj", "avg_allreduce")),
    Bug("missing_grad_allreduce", 1, "the column-parallel MLP input's gradient is not all-reduced in the backward",
        ALL_MODELS, _columns("none"), train_only=True),
    Bug("grad_avg_allreduce", 14, "the column-parallel MLP input's gradient all-reduced with avg (an extra 1/TP)",
        ALL_MODELS, _columns("avg"), train_only=True),
    Bug("sp_norm_grad_unreduced", 4, "SP norm weight gradient not all-reduced across the TP group", ALL_MODELS,
        _sp_norm(False), plans=("sp",), train_only=True),
)}

# the correct forms of the injected code (tests: the machinery alone must verify)
CONTROLS: dict[str, Bug] = {b.name: b for b in (
    Bug("faulty_rowwise_none", 0, "FaultyRowwise with the correct reduction", ALL_MODELS, _row("down", None)),
    Bug("kv_own_offset", 0, "k/v replicated, every rank slices its own heads", ALL_MODELS, _kv(own=True)),
    Bug("faulty_colwise_sum", 0, "Megatron-style column-parallel MLP, input gradient all-reduced", ALL_MODELS,
        _columns("sum"), train_only=True),
    Bug("sp_norm_grad_reduced", 0, "SP norm with a plain weight whose gradient is all-reduced", ALL_MODELS,
        _sp_norm(True), plans=("sp",), train_only=True),
)}
