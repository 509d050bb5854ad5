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

On spmd_types (plain local tensors carrying per-axis types and a partition spec), torch 2.13's
`fully_shard` refuses the parameters outright; `shard_spmd_like_fully_shard` does the same on the
annotations: the rank's chunk along dim 0 recorded as the layout FSDP gives it (V on dp_shard,
dp_shard after the TP axis in dim 0's spec), all-gathered for use with the original annotation
set on the result, and the gradient's pending sums (spmd_types' P for a parameter typed R: the
SP norms) all-reduced before the reduce-scatter, as FSDP2 redistributes every non-data dim first.
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


class UnshardLocal(torch.autograd.Function):
    """`Unshard` for a plain local tensor (the spmd_types backend): forward, the rank's FSDP chunk
    all-gathered over dp_shard along dim 0 (the rank's whole TP-local parameter); backward, the
    gradient's pending sums over the axes the parameter is typed R on (spmd_types' P gradient, left
    "to FSDP": torchtitan's norm_config) all-reduced, then the summand over dp_shard
    reduce-scattered with sum along dim 0."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, dp_group: Any, pending: tuple[Any, ...], reduce_op: str) -> torch.Tensor:  # noqa: D102
        import torch.distributed._functional_collectives as funcol

        ctx.dp_group, ctx.pending, ctx.reduce_op = dp_group, pending, reduce_op
        return funcol.all_gather_tensor(shard.contiguous(), 0, dp_group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: D102
        import torch.distributed._functional_collectives as funcol

        for group in ctx.pending:
            grad = funcol.all_reduce(grad, "sum", group)
        return funcol.reduce_scatter_tensor(grad.contiguous(), ctx.reduce_op, 0, ctx.dp_group), None, None, None


def shard_spmd_like_fully_shard(model: nn.Module, dims: Any, divide: bool) -> dict[str, Any]:
    """Every spmd_types parameter (a plain local tensor typed R on dp_shard) replaced by the rank's
    chunk of it along dim 0, as `fully_shard` would make it from the annotation: typed V on dp_shard
    (dim 0's partition spec gains dp_shard after what already splits it: FSDP cuts the rank's TP
    shard) and I where it was R (its gradient, once FSDP has reduced it, the same on every rank);
    returns FQN -> a function of the stored parameter giving the one the forward uses (`UnshardLocal`,
    the original type and spec set on it)."""
    import spmd_types as spmd

    from refine.exporters.capture.layouts import spmd_axis_run

    def run(mesh: Any) -> tuple[int, int]:
        """(size, stride) of a 1-D DeviceMesh's ranks, as spmd_axis_run reads a spmd_types axis."""
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        return len(ranks), (ranks[1] - ranks[0] if len(ranks) > 1 else 1)

    dp_mesh = dims.get_mesh(DP_SHARD)
    size, coordinate = dp_mesh.size(), dp_mesh.get_local_rank()
    meshes = {name: dims.get_mesh(name) for name in (DP_SHARD, "cp", "tp") if getattr(dims, name) > 1}
    reduce_op = "avg" if divide else "sum"
    unshard: dict[str, Any] = {}
    sharded: dict[int, nn.Parameter] = {}
    for fqn, p in list(model.named_parameters(remove_duplicate=False)):
        if not spmd.has_local_type(p):
            raise ExportError(f"FSDP: parameter {fqn} carries no spmd_types annotation")
        types, spec = dict(spmd.get_local_type(p)), spmd.get_partition_spec(p)
        named = {name: axis for axis in types for name, mesh in meshes.items() if spmd_axis_run(axis) == run(mesh)}
        dp_axis = named.get(DP_SHARD)
        groups = {named[name]: mesh.get_group() for name, mesh in meshes.items() if name != DP_SHARD and name in named}
        if types.get(dp_axis) is not spmd.R:
            raise ExportError(f"FSDP: parameter {fqn} typed {types.get(dp_axis)} on {DP_SHARD}, not R")
        if p.shape[0] % size:
            raise ExportError(f"FSDP: parameter {fqn}'s local dim 0 ({p.shape[0]}) does not split evenly over "
                              f"{DP_SHARD} ({size}); FSDP2 would pad it, which refine.json cannot say")
        pending = tuple(groups[axis] for axis, kind in types.items() if kind is spmd.R and axis in groups)
        if id(p) not in sharded:
            entries = list(spec) if spec is not None else [None] * p.dim()
            first = entries[0]
            entries[0] = dp_axis if first is None else (*(first if isinstance(first, tuple) else (first,)), dp_axis)
            stored = nn.Parameter(p.detach().chunk(size, 0)[coordinate].clone(), requires_grad=p.requires_grad)
            spmd.assert_type(stored, {axis: spmd.V if axis == dp_axis else spmd.I if kind is spmd.R else kind
                                      for axis, kind in types.items()}, partition_spec=spmd.PartitionSpec(*entries))
            sharded[id(p)] = stored
        owner, _, leaf = fqn.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, sharded[id(p)])

        def gather(stored: torch.Tensor, types: dict[Any, Any] = types, spec: Any = spec,
                   pending: tuple[Any, ...] = pending) -> torch.Tensor:
            whole = UnshardLocal.apply(stored, dp_mesh.get_group(), pending, reduce_op)
            spmd.assert_type(whole, types, partition_spec=spec)
            return whole

        unshard[fqn] = gather
    return unshard


def apply_fsdp(model: nn.Module, *, train: bool, cp: bool = False, divide: bool = False, dims: Any = None) -> None:
    """FSDP2's layout and its hooks on a full_dtensor model (module docstring), or, with `dims` (the
    spmd_types backend: plain local tensors), on its annotated parameters: for a training step
    the step's `unshard_params` hook (exporters/capture/train.py runs the forward on what it
    returns); for a forward, the forward itself runs on the unsharded parameters (as FSDP's
    pre-forward hook all-gathers them). `cp`: FSDP shards over the CP axis too. `divide`: the twin
    `fsdp_grad_divided` (FSDP's own gradient division left on: the reduce-scatter averages)."""
    if dims is not None:
        unshard = shard_spmd_like_fully_shard(model, dims, divide)
    else:
        used = shard_like_fully_shard(model, cp)
        reduce_op = "avg" if divide else "sum"
        unshard = {fqn: (lambda p, u=u: Unshard.apply(p, u, reduce_op, shard_axes(p.device_mesh, cp)))
                   for fqn, u in used.items()}

    def unshard_params(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each parameter as its module's forward uses it."""
        return {fqn: unshard[fqn](p) for fqn, p in params.items()}

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
