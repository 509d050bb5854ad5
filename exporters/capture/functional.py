"""In-place torch.distributed collectives as their functional forms, while a step is traced.

A training step is traced by make_fx over eager autograd (refine.exporters.capture.train). Code
that calls `torch.distributed.all_reduce(t)` in place (Megatron's region mappings and
cross-entropy, HF's `_AllReduceForward` / `_AllReduceBackward` and its gradient hooks) would be
recorded as c10d's in-place op, which holds its process group as an opaque object no
translation reads. Written as the functional collective copied back into `t`, it is recorded
as `_c10d_functional.all_reduce` (a `dist.AllReduce`): the same values, and what torch.export's
functionalization makes of the in-place call in a forward export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Done:
    """The handle of an asynchronous collective that has already run (its wait does nothing)."""

    def wait(self) -> None:
        return None


def all_reduce_in_place(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    """torch.distributed.all_reduce in place, written as its functional form copied back. An
    asynchronous one runs at once (its result is read only after the handle's wait); over a
    group of one rank it is the identity."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = group if group is not None else dist.group.WORLD
    if dist.get_world_size(group) > 1:
        name = getattr(op if op is not None else dist.ReduceOp.SUM, "name", str(op)).lower()
        tensor.copy_(funcol.all_reduce(tensor, name, group))
    return Done() if async_op else None


def all_to_all_single_in_place(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,  # noqa: A002
                               input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
    """torch.distributed.all_to_all_single in place with equal splits (a count exchange), written
    as its functional form copied back into `output` (as `all_reduce_in_place`)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if output_split_sizes is not None or input_split_sizes is not None:
        raise TypeError("an in-place all_to_all_single with split sizes has no functional form here")
    group = group if group is not None else dist.group.WORLD
    output.copy_(funcol.all_to_all_single(input, None, None, group))
    return Done() if async_op else None


@contextlib.contextmanager
def functional_all_reduce() -> Iterator[None]:
    """`torch.distributed.all_reduce` is `all_reduce_in_place` while the block runs (every caller
    that looks it up as `dist.all_reduce` at call time)."""
    import torch.distributed as dist

    saved = dist.all_reduce
    dist.all_reduce = all_reduce_in_place  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_reduce = saved  # type: ignore[assignment]
