"""Torch collectives -> `dist` ONNX ops: the custom translation table for torch.onnx.export.

torch.export traces DTensor redistributions and legacy `torch.distributed.*` calls alike into
`torch.ops._c10d_functional.*` ops (an in-place legacy call becomes the functional op plus a
copy). Each is translated into the one `dist` node with the same semantics (docs/model-dir.md).
The group is resolved to its global ranks at translation time, so this must run while the
(fake) process group of the rank being exported is still initialized.

Point-to-point calls have no traceable torch form (`torch.distributed.send`/`recv` are eager,
blocking calls that torch.export cannot capture), so stage code calls `send` / `recv` below:
two custom ops, `refine::send` and `refine::recv`, that exist to be traced and become
`dist.Send` / `dist.Recv`. A send's output must be used (a graph output, say): the ONNX
translation's clean-up drops every node whose output nothing reads, side effect or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnxscript
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from refine.exporters.errors import ExportError
from refine.dist import DIST_DOMAIN, DIST_VERSION, REDUCE_OPS
from refine.exporters.capture import ragged  # noqa: F401 - registers refine::all_to_all_v

_dist = onnxscript.values.Opset(DIST_DOMAIN, DIST_VERSION)
_op18 = onnxscript.opset18
_c10d = torch.ops._c10d_functional


@torch.library.custom_op("refine::send", mutates_args=())
def _send(x: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
    """Hand `x` to global rank `peer`; returns a copy of `x` (the value handed on, so that the
    call has an output later work, or the program's outputs, can depend on)."""
    return x.clone()


@_send.register_fake
def _send_fake(x: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("refine::recv", mutates_args=())
def _recv(buffer: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
    """What global rank `peer` sends with `tag`: only traced, never run (no process group moves
    the data while exporting)."""
    raise RuntimeError(
        f"refine::recv (from rank {peer}, tag {tag}) only exists to be traced by torch.export: "
        "export the stage (refine.exporters.export) instead of running it"
    )


@_recv.register_fake
def _recv_fake(buffer: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
    return torch.empty_like(buffer)


def send(x: torch.Tensor, peer: int, tag: int = 0) -> torch.Tensor:
    """Send `x` to global rank `peer` (the k-th send on a (sender, receiver, tag) channel meets
    the receiver's k-th `recv` on it); returns `x`, which the caller must use (see module doc)."""
    return torch.ops.refine.send(x, int(peer), int(tag))


def recv(buffer: torch.Tensor, peer: int, tag: int = 0) -> torch.Tensor:
    """What global rank `peer` sends with `tag`; `buffer` only gives its shape and element type."""
    return torch.ops.refine.recv(buffer, int(peer), int(tag))


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of a registered process group, in group order."""
    return [int(r) for r in dist.get_process_group_ranks(_resolve_process_group(group_name))]


def _reduce_op(reduce_op: str) -> str:
    op = str(reduce_op).lower()
    if op not in REDUCE_OPS:
        raise ExportError(f"collective reduce_op {reduce_op!r} has no dist equivalent (known: {', '.join(REDUCE_OPS)})")
    return op


def all_reduce(input: Any, reduce_op: str, group_name: str) -> Any:  # noqa: A002 - torch's schema names
    """_c10d_functional.all_reduce -> dist.AllReduce."""
    return _dist.AllReduce(input, reduce_op=_reduce_op(reduce_op), group=group_ranks(group_name))


def all_gather_into_tensor(input: Any, group_size: int, group_name: str) -> Any:  # noqa: A002
    """_c10d_functional.all_gather_into_tensor -> dist.AllGather(axis=0): torch stacks along dim 0
    (DTensor gathers of other dims appear as this plus split/concat ops, exported as such)."""
    ranks = _checked(group_name, group_size)
    return _dist.AllGather(input, axis=0, group=ranks)


def reduce_scatter_tensor(input: Any, reduce_op: str, group_size: int, group_name: str) -> Any:  # noqa: A002
    """_c10d_functional.reduce_scatter_tensor -> dist.ReduceScatter(axis=0) (torch scatters dim 0)."""
    ranks = _checked(group_name, group_size)
    return _dist.ReduceScatter(input, axis=0, reduce_op=_reduce_op(reduce_op), group=ranks)


def all_to_all_single(
    input: Any, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int], group_name: str  # noqa: A002
) -> Any:
    """_c10d_functional.all_to_all_single with equal splits -> dist.AllToAll(split_axis=0, concat_axis=0)."""
    ranks = group_ranks(group_name)
    for what, sizes in (("input", input_split_sizes), ("output", output_split_sizes)):
        sizes = [int(s) for s in sizes or []]
        if len(set(sizes)) > 1 or (sizes and len(sizes) != len(ranks)):
            raise ExportError(f"all_to_all_single with uneven {what} splits {sizes} has no dist equivalent")
    return _dist.AllToAll(input, split_axis=0, concat_axis=0, group=ranks)


def all_to_all_v(x: Any, send_counts: Any, recv_counts: Any, out_rows: int, group_name: str) -> Any:
    """refine::all_to_all_v (exporters/capture/ragged.py) -> dist.AllToAllV."""
    return _dist.AllToAllV(x, send_counts, recv_counts, out_rows=int(out_rows), group=group_ranks(group_name))


def p2p_send(x: Any, peer: int, tag: int) -> Any:
    """refine::send -> dist.Send (Y = X)."""
    return _dist.Send(x, peer=int(peer), tag=int(tag))


def p2p_recv(buffer: Any, peer: int, tag: int) -> Any:
    """refine::recv -> dist.Recv (Y = the peer's matching Send; X only a buffer)."""
    return _dist.Recv(buffer, peer=int(peer), tag=int(tag))


def wait_tensor(tensor: Any) -> Any:
    """_c10d_functional.wait_tensor: the ONNX program is synchronous, so an Identity."""
    return _op18.Identity(tensor)


def _checked(group_name: str, group_size: int) -> list[int]:
    ranks = group_ranks(group_name)
    if int(group_size) != len(ranks):
        raise ExportError(f"collective on group {group_name!r} claims {group_size} members, the group has {ranks}")
    return ranks


def translation_table() -> dict[Callable[..., Any], Callable[..., Any]]:
    """The custom_translation_table for torch.onnx.export (in-place variants are functionalized
    by torch.export into these ops, so they need no entry of their own)."""
    return {
        _c10d.all_reduce.default: all_reduce,
        _c10d.all_gather_into_tensor.default: all_gather_into_tensor,
        _c10d.reduce_scatter_tensor.default: reduce_scatter_tensor,
        _c10d.all_to_all_single.default: all_to_all_single,
        _c10d.wait_tensor.default: wait_tensor,
        torch.ops.refine.all_to_all_v.default: all_to_all_v,
        torch.ops.refine.send.default: p2p_send,
        torch.ops.refine.recv.default: p2p_recv,
    }
