"""Split sizes that depend on values, at a static capacity, while a rank is captured (issue 42).

A token-moving dispatcher counts the routes per peer, exchanges the counts, reads them back to
the host (`.tolist()`) and hands them to a ragged all-to-all as split sizes. torch.export cannot
trace a size that depends on values (`GuardOnDataDependentSymNode`). Inside `static_splits(bound)`
(docs/moe.md, "Static shapes without losing the data"):

- `Tensor.tolist()` of an integer tensor returns `SplitSizes` (one per row of a 2-D tensor): a
  list holding the static `bound` once per entry (no peer sends more rows than `bound`), which
  carries the count tensor itself, so that no count leaves the program;
- `all_to_all_single_autograd(x, out_splits, in_splits, group)` with `SplitSizes` becomes
  `refine::all_to_all_v`, translated as `dist.AllToAllV` with the counts as its inputs: the counts'
  computation stays in the program, and the simulator checks that what each member sends is what
  its peer expects. Its output has the rows `out_splits` last sent (the reverse exchange returns
  exactly the rows sent), else their capacity `sum(out_splits)`, zero past the rows received;
- a module's `all_to_all_single` name holding torch's functional (non-autograd) one, as
  torchtitan's token dispatcher imports it: with `SplitSizes`, the same `refine::all_to_all_v`
  (which has its own backward, so a training step differentiates through it); without split
  sizes (an equal-split count exchange), torch's own;
- `Tensor.repeat_interleave(repeats, output_size=n)` with a tensor of repeats is written at its
  static size n: element i is `self[#{j : cumsum(repeats)[j] <= i}]`, clamped to the last element
  (the padding rows past the total take it: a valid value no exchange sends back).

On the rows a real run has, each is the value torch computes; `--check` compares them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_AUTOGRAD_ALL_TO_ALL = "all_to_all_single_autograd"
_FUNCTIONAL_ALL_TO_ALL = "all_to_all_single"


class SplitSizes(list):
    """Split sizes read back from `counts` (a 1-D integer tensor of the program): the static bound
    once per entry. `sent`: the rows an all-to-all sent with these as its input splits."""

    def __init__(self, counts: torch.Tensor, bound: int) -> None:
        super().__init__([bound] * int(counts.shape[0]))
        self.counts = counts
        self.sent: int | None = None


@torch.library.custom_op("refine::all_to_all_v", mutates_args=())
def _all_to_all_v(x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, out_rows: int,
                  group_name: str) -> torch.Tensor:
    """The ragged all-to-all of refine/dist.py's AllToAllV: only traced, never run."""
    raise RuntimeError("refine::all_to_all_v only exists to be traced while a rank is exported")


@_all_to_all_v.register_fake
def _all_to_all_v_fake(x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, out_rows: int,
                       group_name: str) -> torch.Tensor:
    return x.new_empty((out_rows, *x.shape[1:]))


def _all_to_all_v_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """The gradient goes back the way the rows came: the exchange with the counts swapped."""
    send_counts, recv_counts = ctx.saved_tensors
    back = torch.ops.refine.all_to_all_v(grad.contiguous(), recv_counts, send_counts, ctx.rows, ctx.group_name)
    return back, None, None, None, None


def _all_to_all_v_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, send_counts, recv_counts, _out_rows, group_name = inputs
    ctx.save_for_backward(send_counts, recv_counts)
    ctx.rows, ctx.group_name = int(x.shape[0]), group_name


_all_to_all_v.register_autograd(_all_to_all_v_backward, setup_context=_all_to_all_v_context)


def ragged_all_to_all(x: torch.Tensor, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None, group: Any, tag: str = "") -> torch.Tensor:
    """`all_to_all_single_autograd` whose split sizes are `SplitSizes`: `refine::all_to_all_v`."""
    from torch.distributed._functional_collectives import _resolve_group_name

    if not isinstance(output_split_sizes, SplitSizes) or not isinstance(input_split_sizes, SplitSizes):
        raise TypeError("a ragged all-to-all at static capacity needs both split sizes read back by `.tolist()` "
                        "inside refine's static_splits")
    input_split_sizes.sent = int(x.shape[0])
    out_rows = output_split_sizes.sent if output_split_sizes.sent is not None else sum(output_split_sizes)
    return torch.ops.refine.all_to_all_v(x.contiguous(), input_split_sizes.counts, output_split_sizes.counts, out_rows,
                                         _resolve_group_name(group, tag))


def _functional_or_ragged(functional: Any) -> Any:
    """torch's functional `all_to_all_single`, with `SplitSizes` the ragged exchange (module doc)."""
    def all_to_all_single(x: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, group: Any = None, tag: str = "") -> torch.Tensor:
        if isinstance(output_split_sizes, SplitSizes) or isinstance(input_split_sizes, SplitSizes):
            return ragged_all_to_all(x, output_split_sizes, input_split_sizes, group, tag)
        return functional(x, output_split_sizes, input_split_sizes, group, tag)

    return all_to_all_single


def _is_functional_all_to_all(value: Any) -> bool:
    import torch.distributed._functional_collectives as funcol

    return value is funcol.all_to_all_single


def _split_sizes(tensor: torch.Tensor, bound: int) -> Any:
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.dim() not in (1, 2):
        raise TypeError(f"`.tolist()` of a {tensor.dtype} tensor of {tensor.dim()} dims while split sizes are read "
                        "back: only the integer counts of a ragged exchange can be")
    return SplitSizes(tensor, bound) if tensor.dim() == 1 else [SplitSizes(row, bound) for row in tensor.unbind(0)]


def repeated_at_size(values: torch.Tensor, repeats: torch.Tensor | int, dim: int | None = None, *,
                     output_size: int | None = None) -> torch.Tensor:
    """`values.repeat_interleave(repeats, output_size=n)` for a 1-D tensor of repeats, at the static
    size n: element i is values[#{j : cumsum(repeats)[j] <= i}], the last one past the total."""
    if not isinstance(repeats, torch.Tensor) or output_size is None or values.dim() != 1 or dim not in (None, 0):
        return _REPEAT_INTERLEAVE(values, repeats, dim, output_size=output_size)
    ends = torch.cumsum(repeats, 0)
    positions = torch.arange(output_size, device=values.device)
    which = (ends.unsqueeze(0) <= positions.unsqueeze(1)).sum(dim=1)
    return values[torch.clamp(which, max=values.shape[0] - 1)]


_REPEAT_INTERLEAVE = torch.Tensor.repeat_interleave


def _defining(cls: type, name: str) -> list[type]:
    """The subclasses of `cls` that define `name` themselves (the tensor subclasses a capture
    traces with, fake and functional tensors among them, each have their own `tolist`)."""
    found = []
    for sub in cls.__subclasses__():
        found += ([sub] if name in vars(sub) else []) + _defining(sub, name)
    return found


@contextlib.contextmanager
def static_splits(bound: int, *modules: Any) -> Iterator[None]:
    """While the block runs: `.tolist()`, each module's `all_to_all_single_autograd` (and its
    `all_to_all_single` where that is torch's functional one) and `repeat_interleave` at static
    capacity (module doc), no peer sending more than `bound` rows."""
    # (torch.Tensor's own: None where it inherits the method from TensorBase, restored by deleting)
    saved: list[tuple[Any, str, Any]] = [(torch.Tensor, n, vars(torch.Tensor).get(n)) for n in ("tolist", "repeat_interleave")]
    saved += [(c, "tolist", vars(c)["tolist"]) for c in _defining(torch.Tensor, "tolist")]
    saved += [(m, _AUTOGRAD_ALL_TO_ALL, getattr(m, _AUTOGRAD_ALL_TO_ALL)) for m in modules if hasattr(m, _AUTOGRAD_ALL_TO_ALL)]
    # (only where the name holds torch's functional one: HF's module has c10d's in-place one there)
    saved += [(m, _FUNCTIONAL_ALL_TO_ALL, getattr(m, _FUNCTIONAL_ALL_TO_ALL)) for m in modules
              if _is_functional_all_to_all(getattr(m, _FUNCTIONAL_ALL_TO_ALL, None))]
    for owner, name, original in saved:
        if name == _FUNCTIONAL_ALL_TO_ALL:
            setattr(owner, name, _functional_or_ragged(original))
            continue
        setattr(owner, name, {"tolist": lambda self: _split_sizes(self, bound), "repeat_interleave": repeated_at_size,
                              _AUTOGRAD_ALL_TO_ALL: ragged_all_to_all}[name])
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
