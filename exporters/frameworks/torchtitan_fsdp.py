"""FSDP2 on torchtitan's full_dtensor backend, as `fully_shard` lays the parameters out, in a form
torch can trace.

`parallelize_llama` applies `fully_shard` (torchtitan's `apply_fsdp_to_decoder`) after the TP
sharding config: each parameter, a DTensor on the dense storage mesh `(dp_shard, tp)` replicated
on `dp_shard`, is kept sharded along dim 0 over `dp_shard` (`_StridedShard(0, split_factor)` where
TP splits dim 0 too: FSDP cuts the rank's TP shard, `_fsdp_param._init_sharding_spec_spmd`), is
all-gathered before its module's forward, and its gradient reduce-scattered after the backward
with no division (torchtitan's `disable_fsdp_gradient_division`: its loss is already over the
global token count). Under CP torchtitan shards over `cp` too (`resolve_fsdp_mesh`: the shard axes
`(dp_shard, cp)`, FSDP's flattened data-parallel dim; `fully_shard` runs even where dp_shard is 1):
each axis cuts dim 0 in turn, and the gradient, a summand over both (each CP rank's share is its
own sequence chunk's), is reduce-scattered over each. FSDP2 does this in module hooks around its own flat buffers, which
torch.export cannot trace, so this module does the same on DTensors: the parameters become their
FSDP placements (a local cut, as `fully_shard` makes it), and the training step's
`unshard_params` hook (exporters/capture/train.py) redistributes each to its TP placement for the
forward (an all-gather over `dp_shard`) and reduces its gradient as FSDP2 does (`Unshard`). Not
DTensor's own backward of that redistribution: FSDP2 reduce-scatters the rank's local gradient
whatever DTensor's placement of it on dp_shard says (the vocab-parallel embedding's gradient comes
out `Replicate` there, each rank's value its own batch shard's). A CPU shim, listed in
docs/frameworks.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from refine.exporters.errors import ExportError

DP_SHARD = "dp_shard"


def shard_axes(mesh: Any, cp: bool) -> tuple[int, ...]:
    """The storage mesh's dims FSDP shards over, as `resolve_fsdp_mesh` names them: `dp_shard`
    (kept in the mesh even at size 1), and `cp` under CP."""
    names = list(mesh.mesh_dim_names or ())
    wanted = (DP_SHARD, "cp") if cp else (DP_SHARD,)
    missing = [name for name in wanted if name not in names]
    if missing:
        raise ExportError(f"FSDP: a parameter on the mesh {names} has no {missing[0]!r} dim")
    return tuple(names.index(name) for name in wanted)


def fsdp_placements(param: Any, axes: tuple[int, ...], shard_dim: int = 0) -> tuple[Any, ...]:
    """`fully_shard`'s placements for a DTensor parameter on the storage mesh: each shard axis's
    Replicate becomes Shard(dim 0), or `_StridedShard(0, split_factor)` where mesh dims to its
    right shard dim 0 in the parameter's own placements (split_factor: their sizes' product), as
    torch's FSDP2 computes them (`_init_sharding_spec_spmd`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = param.device_mesh
    original = tuple(param.placements)
    placements = list(original)
    for index in axes:
        if not isinstance(original[index], Replicate):
            raise ExportError(f"FSDP: a parameter placed {original[index]} on {mesh.mesh_dim_names[index]!r}, "
                              "not Replicate")
        factor = 1
        for j in range(index + 1, mesh.ndim):
            p = original[j]
            if isinstance(p, (Shard, _StridedShard)) and p.dim == shard_dim:
                factor *= mesh.size(j)
        placements[index] = _StridedShard(shard_dim, split_factor=factor) if factor > 1 else Shard(shard_dim)
    return tuple(placements)


def shard_like_fully_shard(model: nn.Module, cp: bool) -> dict[str, tuple[Any, ...]]:
    """Every DTensor parameter replaced by its FSDP-sharded DTensor (the rank's cut of its own
    TP shard, no collective); returns FQN -> the placements the forward uses (its TP ones)."""
    from torch.distributed.tensor import DTensor

    used: dict[str, tuple[Any, ...]] = {}
    sharded: dict[int, nn.Parameter] = {}
    for fqn, p in list(model.named_parameters(remove_duplicate=False)):
        if not isinstance(p.data, DTensor):
            raise ExportError(f"FSDP: parameter {fqn} is not a DTensor on the storage mesh (full_dtensor backend only)")
        used[fqn] = tuple(p.placements)
        if id(p) not in sharded:
            axes = shard_axes(p.device_mesh, cp)
            size = math.prod(p.device_mesh.size(i) for i in axes)
            if p.to_local().shape[0] % size:
                raise ExportError(f"FSDP: parameter {fqn}'s local dim 0 ({p.to_local().shape[0]}) does not split "
                                  f"evenly over FSDP's {size} shards; FSDP2 would pad it, which refine.json cannot say")
            with torch.no_grad():
                cut = p.data.redistribute(p.device_mesh, fsdp_placements(p.data, axes))
            sharded[id(p)] = nn.Parameter(cut, requires_grad=p.requires_grad)
        owner, _, leaf = fqn.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, sharded[id(p)])
    return used


class Unshard(torch.autograd.Function):
    """FSDP2's unshard and its gradient reduction for one DTensor parameter on the storage mesh:
    forward, the sharded parameter redistributed to its TP placements (an all-gather over
    the shard axes); backward, what `FSDPParam._get_grad_inner_tensor` and the reduce-scatter do:
    the gradient redistributed to the parameter's placements on every dim but the shard axes, its
    local tensor (a summand over them, however DTensor placed it there) reduce-scattered with sum
    along dim 0 over each shard axis in mesh order, the cut `fully_shard` made (torchtitan sets
    FSDP's gradient divide factor to 1)."""

    @staticmethod
    def forward(ctx: Any, sharded: Any, used: tuple[Any, ...], reduce_op: str, axes: tuple[int, ...]) -> Any:  # noqa: D102
        ctx.sharded_spec = (sharded.device_mesh, sharded.placements, sharded.shape, sharded.stride())
        ctx.used, ctx.reduce_op, ctx.axes = used, reduce_op, axes
        return sharded.redistribute(sharded.device_mesh, used)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None]:  # noqa: D102
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.sharded_spec
        target = tuple(grad.placements[i] if i in ctx.axes else ctx.used[i] for i in range(mesh.ndim))
        if target != tuple(grad.placements):
            grad = grad.redistribute(mesh, target)
        reduced = grad.to_local().contiguous()
        for axis in ctx.axes:
            if mesh.size(axis) > 1:
                reduced = funcol.reduce_scatter_tensor(reduced, ctx.reduce_op, 0, (mesh, axis))
        return DTensor.from_local(reduced, mesh, placements, run_check=False, shape=shape, stride=stride), None, None, None


def apply_fsdp(model: nn.Module, *, train: bool, cp: bool = False, divide: bool = False) -> None:
    """FSDP2's layout and its hooks on a full_dtensor model (module docstring): for a training step
    the step's `unshard_params` hook (exporters/capture/train.py runs the forward on what it
    returns); for a forward, the forward itself runs on the unsharded parameters (as FSDP's
    pre-forward hook all-gathers them). `cp`: FSDP shards over the CP axis too. `divide`: the twin `fsdp_grad_divided` (FSDP's own gradient
    division left on: the reduce-scatter averages)."""
    used = shard_like_fully_shard(model, cp)
    reduce_op = "avg" if divide else "sum"

    def unshard_params(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each parameter as its module's forward uses it (`Unshard`)."""
        return {fqn: Unshard.apply(p, used[fqn], reduce_op, shard_axes(p.device_mesh, cp)) for fqn, p in params.items()}

    if train:
        model.unshard_params = unshard_params  # type: ignore[assignment]
        return
    from torch.nn.utils.stateless import _reparametrize_module

    forward = model.forward

    @functools.wraps(forward)
    def forward_unsharded(*args: Any, **kwargs: Any) -> Any:
        with _reparametrize_module(model, unshard_params(dict(model.named_parameters()))):
            return forward(*args, **kwargs)

    model.forward = forward_unsharded  # type: ignore[method-assign]
