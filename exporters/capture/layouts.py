"""refine.json from a parallel plan: how each rank's tensor relates to the sequential one.

The relation is read off what DTensor actually did on every rank (the placement, local shape
and global offset of each parameter and buffer), never off the plan's intent, so a plan that
shards something other than its author believed is exported as what it is; `refine.exporters.check`
then runs the programs and any mismatch shows numerically.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from refine.config import Mesh
from refine.exporters.errors import ExportError

LayoutJson = dict[str, Any]
REP: LayoutJson = {"layout": "rep"}


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one tensor."""

    kind: str  # "plain" (an ordinary tensor), "rep", "shard", "partial"
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    axis: int | None = None
    reduce_op: str | None = None
    placement: str = ""
    stride: int = 1  # Megatron's partition_stride: chunk `rank` of each of `stride` equal blocks
    digest: str | None = None  # of a plain tensor's values: replicas must agree across ranks
    # how the rank's gradient of this parameter relates, where not as the parameter does: "partial"
    # for an spmd_types R (replicate) parameter, whose gradient type is P (a summand per rank, left
    # for the data-parallel wrapper to all-reduce: torchtitan's sequence-parallel norms)
    grad: str | None = None
    # the export mesh's dim the tensor is split along (a shard or partial over the ranks of each line
    # along that dim, copied along the others; for a replica whose `grad` is partial, the dim of
    # that sum); None: the whole world
    over: str | None = None
    # for a shard parameter spmd_types types R on another mesh axis (a TP shard under CP): the dim
    # its gradient's partial sum runs over (the gradient a summand there of a shard over `over`)
    grad_over: str | None = None
    # a tensor split over two mesh dims (a DTensor on a mesh of two dims of several ranks): its
    # refine.json layout, checked against DTensor's own cut of every rank's piece (`_two_dim_piece`)
    layout: LayoutJson | None = None


def _digest(value: torch.Tensor) -> str | None:
    """A fingerprint of a plain tensor's values (None on the meta device)."""
    if value.device.type == "meta":
        return None
    data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _megatron_piece(param: torch.Tensor, value: torch.Tensor, rank: int, world_size: int) -> Piece | None:
    """What a rank holds of a parameter Megatron marked tensor-parallel (`tensor_model_parallel`,
    `partition_dim`, `partition_stride`, set by megatron.core.tensor_parallel on every TP
    parameter): the local tensor is part `rank` of `world_size` along partition_dim, cut in
    `partition_stride` interleaved blocks. None for a tensor without the attributes."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim, stride = int(getattr(param, "partition_dim", -1)), int(getattr(param, "partition_stride", 1))
    local = tuple(value.shape)
    if not 0 <= dim < len(local) or stride < 1 or local[dim] % stride:
        raise ExportError(f"Megatron partition attributes partition_dim={dim}, partition_stride={stride} do not fit "
                          f"a local tensor of shape {list(local)}")
    global_shape = tuple(d * world_size if i == dim else d for i, d in enumerate(local))
    offset = tuple(rank * local[dim] if i == dim and stride == 1 else 0 for i in range(len(local)))
    return Piece("shard", global_shape, local, offset, axis=dim, stride=stride,
                 placement=f"megatron(partition_dim={dim}, partition_stride={stride})")


def _real_shape(value: torch.Tensor) -> tuple[int, ...]:
    """The shape of `value` as ONNX holds it: a complex tensor is real pairs (a last axis of 2)."""
    return tuple(value.shape) + ((2,) if value.is_complex() else ())


def _spmd_piece(value: torch.Tensor, rank: int, world_size: int, mesh: Mesh | None = None) -> Piece | None:
    """What a rank holds of a plain local tensor that spmd_types annotated (torchtitan's default
    backend records, per mesh axis, R / I (a replica), P (a summand), S(d) or V with a partition
    spec naming the axes that shard each dim), split over the whole world or, on the export's
    `mesh`, along one of its dims. None for a tensor without an annotation, or when spmd_types was
    never imported (then no tensor carries one)."""
    spmd = sys.modules.get("spmd_types")
    if spmd is None or not spmd.has_local_type(value):
        return None
    local = _real_shape(value)
    sharded: dict[int, list[Any]] = {}
    partial: list[Any] = []
    varying: list[Any] = []
    for axis, kind in spmd.get_local_type(value).items():
        if axis.size() == 1:
            continue
        if isinstance(kind, spmd.Shard):
            sharded.setdefault(kind.dim % max(1, value.dim()), []).append(axis)
        elif kind is spmd.P:
            partial.append(axis)
        elif kind is spmd.V:
            varying.append(axis)
    spec = spmd.get_partition_spec(value)
    for dim, entry in enumerate(spec or ()):
        for axis in entry if isinstance(entry, tuple) else (() if entry is None else (entry,)):
            axis = spmd.normalize_axis(axis)
            if axis.size() > 1:
                sharded.setdefault(dim, []).append(axis)
                varying = [a for a in varying if a != axis]
    if varying:
        raise ExportError(f"an spmd_types tensor varies over mesh axis {varying[0]} with no partition spec "
                          "saying how: it has no refine.json layout")
    axes = [a for group in sharded.values() for a in group] + partial
    placement = f"spmd_types({dict(spmd.get_local_type(value))}, {spec})"
    if len(axes) == 2 and not partial:
        return _spmd_two_dim_piece(sharded, local, placement, world_size, mesh)
    if len(axes) > 1:
        raise ExportError(f"an spmd_types tensor is split over several mesh axes {axes}: no refine.json layout")
    over = None
    if axes:
        size, stride = spmd_axis_run(axes[0])
        over = mesh_dim(size, stride, world_size, mesh, f"spmd_types mesh axis {axes[0]}")
    if partial:
        return Piece("partial", local, local, (0,) * len(local), reduce_op="sum", placement=placement, over=over)
    replicated = [axis for axis, kind in spmd.get_local_type(value).items() if kind is spmd.R and axis.size() > 1]
    if not sharded:
        if not replicated or not isinstance(value, torch.nn.Parameter):
            return Piece("plain", local, local, (0,) * len(local), placement=placement, digest=_digest(value))
        if len(replicated) > 1:
            raise ExportError(f"an spmd_types parameter typed R over several mesh axes {replicated}: its gradient, "
                              "a sum over all of them, has no refine.json layout")
        size, stride = spmd_axis_run(replicated[0])
        return Piece("plain", local, local, (0,) * len(local), placement=placement, digest=_digest(value),
                     grad="partial", over=mesh_dim(size, stride, world_size, mesh, f"spmd_types mesh axis {replicated[0]}"))
    ((dim, (axis,)),) = sharded.items()
    size, stride = spmd_axis_run(axis)
    coordinate = (rank // stride) % size
    global_shape = tuple(d * size if i == dim else d for i, d in enumerate(local))
    offset = tuple(coordinate * local[dim] if i == dim else 0 for i in range(len(local)))
    grad_over = None
    if replicated and isinstance(value, torch.nn.Parameter):  # its gradient: a summand over the R axis
        if len(replicated) > 1:
            raise ExportError(f"an spmd_types parameter typed R over several mesh axes {replicated}: its gradient, "
                              "a sum over all of them, has no refine.json layout")
        r_size, r_stride = spmd_axis_run(replicated[0])
        grad_over = mesh_dim(r_size, r_stride, world_size, mesh, f"spmd_types mesh axis {replicated[0]}")
    return Piece("shard", global_shape, local, offset, axis=dim, placement=placement, over=over,
                 grad="partial" if grad_over is not None else None, grad_over=grad_over)


def _spmd_two_dim_piece(sharded: dict[int, list[Any]], local: tuple[int, ...], placement: str, world_size: int,
                        mesh: Mesh | None) -> Piece:
    """What a rank holds of a plain local tensor spmd_types types as split over two mesh axes (FSDP's
    dp_shard chunk of a TP shard, exporters/frameworks/torchtitan_fsdp.py): refine.json's two-dim
    shard, in the order `_two_dim_piece` gives a DTensor: one dim cut by both axes in its partition
    spec's order (the major axis first), two dims with dp_shard's cut second (a block either way)."""
    what = f"an spmd_types tensor split over two mesh axes ({placement})"
    splits = []
    for dim, group in sorted(sharded.items()):
        for axis in group:
            size, stride = spmd_axis_run(axis)
            over = mesh_dim(size, stride, world_size, mesh, f"spmd_types mesh axis {axis}")
            if over is None or mesh is None:
                raise ExportError(f"{what}: one axis holds every rank, so no second mesh dim can cut it")
            splits.append((dim, over))
    if len(sharded) == 2 and splits[0][1] == "dp_shard":
        splits.reverse()
    (axis0, over0), (axis1, over1) = splits
    if over0 == over1:
        raise ExportError(f"{what}: both cuts over mesh dim {over0}")
    layout: LayoutJson = {"layout": "shard", "axis": axis0, "over": over0, "then": {"axis": axis1, "over": over1}}
    parts = dict(zip(mesh.dims, mesh.shape))  # type: ignore[union-attr]
    global_shape = list(local)
    for dim, over in splits:
        global_shape[dim] *= parts[over]
    return Piece("shard", tuple(global_shape), local, (0,) * len(local), axis=axis0, placement=placement, layout=layout)


def mesh_dim(size: int, stride: int, world_size: int, mesh: Mesh | None, what: str) -> str | None:
    """The dim of the export's `mesh` whose lines are runs of `size` ranks `stride` apart (None:
    the whole world, one run of every rank); an ExportError for a run that is neither."""
    if size == world_size and stride == 1:
        return None
    if mesh is not None:
        for d, (name, n) in enumerate(zip(mesh.dims, mesh.shape)):
            if n == size and stride == prod(mesh.shape[d + 1:]):
                return name
    shape = f"the mesh {dict(zip(mesh.dims, mesh.shape))}" if mesh is not None else "no mesh (one dim of every rank)"
    raise ExportError(f"{what} runs over {size} of the {world_size} ranks, {stride} apart: it is no dim of {shape}")


def mesh_line(mesh: Mesh, rank: int, dim: str) -> list[int]:
    """The ranks of `rank`'s line along mesh dim `dim` (its other coordinates fixed), in order."""
    d = mesh.dims.index(dim)
    stride = prod(mesh.shape[d + 1:])
    first = rank - mesh.coordinates(rank)[dim] * stride
    return [first + k * stride for k in range(mesh.shape[d])]


def spmd_axis_run(axis: Any) -> tuple[int, int]:
    """(size, stride) of an spmd_types mesh axis whose ranks are one arithmetic progression."""
    layout = axis.layout
    sizes, strides = layout.shape, layout.stride
    sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
    strides = (strides,) if isinstance(strides, int) else tuple(strides)
    if len(sizes) != 1 or len(strides) != 1:
        raise ExportError(f"spmd_types mesh axis {axis} is not one run of ranks: no refine.json layout")
    return int(sizes[0]), int(strides[0])


def _piece(value: torch.Tensor, rank: int, world_size: int, export_mesh: Mesh | None = None) -> Piece:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not isinstance(value, DTensor):
        shape = _real_shape(value)
        return Piece("plain", shape, shape, (0,) * len(shape), placement="tensor", digest=_digest(value))
    mesh = value.device_mesh
    # Dims of one rank split nothing (Shard: one chunk, the whole axis; Partial: a sum of one
    # summand; Replicate: a copy), so a mesh whose other dims are all of size 1 lays the tensor
    # out as a 1-D mesh along its one dim of several ranks (torchtitan keeps dp_shard alive at
    # size 1 beside tp); a mesh of several such dims has no single placement to read.
    wide = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
    if len(wide) > 1:
        return _two_dim_piece(value, rank, world_size, export_mesh)
    if not wide:  # a mesh of this rank alone (a pipeline stage's TP mesh of one): the local tensor is the tensor
        local = value.to_local()
        shape = _real_shape(local)
        return Piece("plain", shape, shape, (0,) * len(shape), placement=f"{value.placements} on one rank",
                     digest=_digest(local))
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    step = ranks[1] - ranks[0]
    if step < 1 or ranks != list(range(ranks[0], ranks[0] + step * len(ranks), step)):
        raise ExportError(f"DTensor mesh {mesh.mesh.tolist()} is not one run of ranks in order")
    over = mesh_dim(len(ranks), step, world_size, export_mesh, f"DTensor mesh {mesh.mesh.tolist()}")
    if rank not in ranks or (over is not None and export_mesh is not None and ranks != mesh_line(export_mesh, rank, over)):
        raise ExportError(f"rank {rank}: a DTensor on mesh {mesh.mesh.tolist()}, not its own line along mesh dim {over}")
    coordinate = tuple(int(c) for c in torch.unravel_index(torch.tensor(ranks.index(rank)), tuple(mesh.mesh.shape)))
    if tuple(mesh.get_coordinate() or ()) != coordinate:
        raise ExportError(f"rank {rank}: a DTensor's device mesh places it at {mesh.get_coordinate()} (a stale mesh)")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    global_shape = tuple(value.shape)
    local_shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
    local_shape, offset = tuple(int(d) for d in local_shape), tuple(int(o) for o in offset)
    if local_shape != tuple(value.to_local().shape):
        raise ExportError(f"DTensor local shape {tuple(value.to_local().shape)} differs from its placement's {local_shape}")
    placement = value.placements[wide[0]] if wide else value.placements[0]
    if value.is_complex():  # real pairs in ONNX: a last axis of 2, never split
        global_shape, local_shape, offset = global_shape + (2,), local_shape + (2,), offset + (0,)
    common = dict(global_shape=global_shape, local_shape=local_shape, offset=offset, placement=str(placement), over=over)
    if isinstance(placement, Replicate):
        return Piece("rep", **common)
    if isinstance(placement, Shard):
        return Piece("shard", axis=placement.dim % max(1, len(global_shape)), **common)
    if isinstance(placement, Partial):
        return Piece("partial", reduce_op=str(placement.reduce_op), **common)
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return _strided_piece(placement, mesh, ranks.index(rank), len(ranks), common)
    raise ExportError(f"DTensor placement {placement} has no refine.json layout")


def _two_dim_piece(value: Any, rank: int, world_size: int, export_mesh: Mesh | None) -> Piece:
    """What a rank holds of a DTensor on a mesh of two dims of several ranks (torchtitan's storage
    mesh `(dp_shard, tp)` under FSDP x TP): refine.json's shard over one mesh dim (the other a
    replica) or two-dim shard (`then`). Which split comes first: FSDP's dim (`dp_shard`) cuts what
    the other dim's split left (FSDP shards the rank's TP shard), and so does a `_StridedShard`
    whose split factor is the other dim's size; otherwise DTensor's order, left to right. The
    layout is then checked against DTensor's own cut of an index tensor on this rank (as
    `_strided_piece` checks its blocks): a placement refine.json cannot state is an ExportError."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = value.device_mesh
    names = list(mesh.mesh_dim_names or ())
    wide = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
    what = f"DTensor on mesh ({', '.join(f'{names[d] if names else d}={mesh.size(d)}' for d in wide)}), placements {value.placements}"
    if (export_mesh is None or [names[d] for d in wide] != list(export_mesh.dims)
            or [mesh.size(d) for d in wide] != list(export_mesh.shape)
            or [int(r) for r in mesh.mesh.flatten().tolist()] != list(range(world_size))):
        shape = dict(zip(export_mesh.dims, export_mesh.shape)) if export_mesh is not None else "no mesh"
        raise ExportError(f"{what}: not the export's mesh ({shape}) in rank order, so no refine.json layout says it")
    splits = []
    for d in wide:
        placement = value.placements[d]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ExportError(f"{what}: {placement} on mesh dim {names[d]!r} has no refine.json layout")
        splits.append((d, placement))
    shape = tuple(value.shape)
    pair = (2,) if value.is_complex() else ()  # (real pairs in ONNX: a last axis of 2, never split)
    if not splits:
        return Piece("rep", shape + pair, shape + pair, (0,) * (len(shape) + len(pair)), placement=str(value.placements))
    (d0, p0), *rest = splits
    layout: LayoutJson = {"layout": "shard", "axis": p0.dim % len(shape), "over": names[d0]}
    if rest:
        (d1, p1), = rest
        first, then = (d1, d0) if names[d0] == "dp_shard" or (p0.dim == p1.dim and isinstance(p0, _StridedShard)) else (d0, d1)
        pf, pt = value.placements[first], value.placements[then]
        layout = {"layout": "shard", "axis": pf.dim % len(shape), "over": names[first],
                  "then": {"axis": pt.dim % len(shape), "over": names[then]}}
    index = torch.arange(value.numel()).reshape(shape)
    held = distribute_tensor(index, mesh, list(value.placements), src_data_rank=None).to_local()
    coords = export_mesh.coordinates(rank)
    wanted = index
    for axis, over in [(layout["axis"], layout["over"]), *([(layout["then"]["axis"], layout["then"]["over"])] if "then" in layout else [])]:
        parts = export_mesh.shape[export_mesh.dims.index(over)]
        if wanted.shape[axis] % parts:
            wanted = None
            break
        wanted = wanted.chunk(parts, dim=axis)[coords[over]]
    if wanted is None or not torch.equal(held, wanted):
        raise ExportError(f"{what}: rank {rank}'s piece is not what refine.json's {layout} cuts for it")
    return Piece("shard", shape + pair, tuple(held.shape) + pair, (0,) * (len(shape) + len(pair)), axis=layout["axis"],
                 placement=str(value.placements), layout=layout)


def _strided_piece(placement: Any, mesh: Any, rank: int, world_size: int, common: dict[str, Any]) -> Piece:
    # (rank, world_size: the rank's place in its mesh line, and the line's length)
    """What a rank holds under DTensor's `_StridedShard(dim, split_factor)` (HF's packed_colwise /
    packed_rowwise: a fused `[gate; up]` or `[q; k; v]` weight whose `split_factor` blocks are
    each split over the ranks): refine.json's strided shard (`stride` = split_factor). Which rows
    the rank holds is read off DTensor's own split of an index vector, not assumed: if they are
    not chunk `rank` of every block, in block order, the placement has no refine.json layout."""
    from torch.distributed.tensor import distribute_tensor

    from refine.config import ShardLayout, shard_indices

    shape = common["global_shape"]
    dim, stride = placement.dim % max(1, len(shape)), int(placement.split_factor)
    size = shape[dim]
    index = torch.arange(size).reshape([size if i == dim else 1 for i in range(len(shape))])
    from torch.distributed.tensor import Replicate

    placements = [placement if mesh.size(d) > 1 else Replicate() for d in range(mesh.ndim)]  # (dims of one rank: copies)
    held = distribute_tensor(index, mesh, placements, src_data_rank=None).to_local().reshape(-1).tolist()
    try:
        wanted = shard_indices(ShardLayout(layout="shard", axis=dim, stride=stride), size, world_size)[rank]
    except ValueError:
        wanted = None
    if held != wanted:
        raise ExportError(f"DTensor placement {placement} gives rank {rank} rows {held} of axis {dim} ({size}): not "
                          f"chunk {rank} of each of {stride} equal blocks, so no refine.json layout says it")
    return Piece("shard", axis=dim, stride=stride, **{**common, "offset": (0,) * len(shape)})


def rank_pieces(module: torch.nn.Module, rank: int, world_size: int, mesh: Mesh | None = None) -> dict[str, Piece]:
    """FQN -> what rank `rank` holds, for every parameter and buffer of its module (split over the
    whole world, or along one dim of the export's `mesh`)."""
    out: dict[str, Piece] = {}
    for name, value in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        data = value.data if isinstance(value, torch.nn.Parameter) else value
        out[name] = (_megatron_piece(value, data, rank, world_size) or _spmd_piece(value, rank, world_size, mesh)
                     or _piece(data, rank, world_size, mesh))
    return out


def derive_layout(name: str, pieces: Sequence[Piece]) -> LayoutJson:
    """The refine.json layout of a tensor held by every rank as `pieces` (index = rank); a plain
    tensor (declared a replica) whose values differ across ranks is an ExportError naming it."""
    world = len(pieces)
    kinds = {"rep" if p.kind == "plain" else p.kind for p in pieces}
    shapes = {p.global_shape for p in pieces}
    if len(kinds) != 1 or len(shapes) != 1:
        raise ExportError(f"{name}: ranks disagree on its placement ({', '.join(p.placement for p in pieces)})")
    kind, (shape,) = kinds.pop(), shapes
    if kind == "rep":
        if any(p.local_shape != shape for p in pieces):
            raise ExportError(f"{name}: replicated, but some rank holds a different shape")
        digests = {p.digest for p in pieces if p.kind == "plain"}
        if len(digests) > 1:
            differ = [r for r, p in enumerate(pieces) if p.digest != pieces[0].digest]
            raise ExportError(f"{name}: a plain tensor (so declared a replica) whose values differ on rank(s) {differ} "
                              "from rank 0's; a tensor-parallel parameter must be a DTensor or carry Megatron's "
                              "partition attributes (tensor_model_parallel, partition_dim, partition_stride)")
        return dict(REP)
    if kind == "partial":
        ops = {p.reduce_op for p in pieces}
        if ops not in ({"sum"}, {"max"}):
            raise ExportError(f"{name}: Partial({ops}) has no refine.json layout (sum or max only)")
        return {"layout": "partial", "op": ops.pop()}
    axes = {p.axis for p in pieces}
    if len(axes) != 1:
        raise ExportError(f"{name}: ranks shard it along different axes {sorted(axes)}")
    axis = axes.pop()
    assert axis is not None
    strides = {p.stride for p in pieces}
    if strides != {1}:
        if len(strides) != 1 or len({p.local_shape for p in pieces}) != 1 or shape[axis] % (world * min(strides)):
            raise ExportError(f"{name}: ranks hold unequal or differently strided parts along axis {axis}")
        return {"layout": "shard", "axis": axis, "stride": strides.pop()}
    sizes, start = [], 0
    for rank, p in enumerate(pieces):
        others = [d for i, d in enumerate(p.local_shape) if i != axis]
        if others != [d for i, d in enumerate(shape) if i != axis] or p.offset[axis] != start:
            raise ExportError(f"{name}: rank {rank}'s shard is not chunk {rank} along axis {axis} in rank order")
        sizes.append(p.local_shape[axis])
        start += p.local_shape[axis]
    if start != shape[axis]:
        raise ExportError(f"{name}: shards along axis {axis} cover {start} of {shape[axis]}")
    layout: LayoutJson = {"layout": "shard", "axis": axis}
    if shape[axis] % world or len(set(sizes)) != 1:
        layout["sizes"] = sizes
    return layout


def held_layout(name: str, by_rank: dict[int, Piece], world_size: int, mesh: Mesh | None = None) -> LayoutJson:
    """The refine.json layout of a tensor held by the ranks `by_rank` (rank -> its piece): split
    over the whole world (every rank holds a piece), a replica (ranks that lack it are skipped,
    docs/model-dir.md), or split along one dim of `mesh`: each line along that dim that holds it
    holds every piece, and all such lines lay it out alike (a stage's TP group of a pipeline)."""
    explicit = [p.layout for p in by_rank.values() if p.layout is not None]
    if explicit:  # (split over two mesh dims: each rank's piece checked against its layout already)
        if len(explicit) != world_size or any(lay != explicit[0] for lay in explicit):
            raise ExportError(f"{name}: the ranks lay it out differently over the mesh: {explicit[0]} on some")
        return dict(explicit[0])
    overs = {p.over for p in by_rank.values() if p.kind not in ("plain", "rep")}
    if len(by_rank) == world_size and overs <= {None}:
        return derive_layout(name, [by_rank[r] for r in range(world_size)])
    if not overs:  # a replica on some ranks: they must agree
        return derive_layout(name, list(by_rank.values()))
    if overs == {None}:
        raise ExportError(f"{name}: sharded on ranks {sorted(by_rank)} and absent on the others")
    if len(overs) > 1 or mesh is None:
        raise ExportError(f"{name}: ranks split it over different mesh dims ({', '.join(sorted(map(str, overs)))})")
    (dim,) = overs
    lines: dict[int, list[int]] = {}
    for rank in by_rank:
        line = mesh_line(mesh, rank, dim)
        lines[line[0]] = line
    layouts = []
    for line in lines.values():
        if any(r not in by_rank for r in line):
            raise ExportError(f"{name}: held by ranks {[r for r in line if r in by_rank]} of the line {line} along mesh "
                              f"dim {dim!r}, not by all of them")
        layouts.append(derive_layout(name, [by_rank[r] for r in line]))
    if any(lay != layouts[0] for lay in layouts):
        raise ExportError(f"{name}: the lines along mesh dim {dim!r} holding it lay it out differently: {layouts}")
    return layouts[0] if layouts[0]["layout"] == "rep" else {**layouts[0], "over": dim}


_PARAMETRIZED = re.compile(r"^(?:(?P<owner>.+)\.)?parametrizations\.(?P<attr>[^.]+)\.original0$")


def module_fqn(onnx_name: str) -> str:
    """The module FQN of an exported initializer: run_decompositions unwraps a DTensor
    parameter `a.b.weight` through a parametrization named `a.b.parametrizations.weight.original0`."""
    m = _PARAMETRIZED.match(onnx_name)
    if not m:
        return onnx_name
    return f"{m['owner']}.{m['attr']}" if m["owner"] else m["attr"]


def match_name(rank_fqn: str, seq_names: Iterable[str]) -> str | None:
    """The sequential FQN of a rank FQN: the same name, else the unique name equal to it up to
    a wrapper prefix on either side (`module.model.x` <-> `model.x`)."""
    seq_names = set(seq_names)
    if rank_fqn in seq_names:
        return rank_fqn
    best: list[str] = []
    best_len = -1
    for s in seq_names:
        if rank_fqn.endswith("." + s) or s.endswith("." + rank_fqn):
            common = min(len(s), len(rank_fqn))
            if common > best_len:
                best, best_len = [s], common
            elif common == best_len:
                best.append(s)
    if len(best) > 1:
        raise ExportError(f"rank tensor {rank_fqn!r} matches several sequential tensors: {sorted(best)}")
    return best[0] if best else None
