"""Translations of aten view ops on complex tensors, which torchlib lacks.

torch.onnx writes a complex tensor as its real pairs: a real tensor with a last axis of 2 (real,
imaginary). A view that moves or adds leading axes is the same op on that tensor, its axes
counted from the front (a negative axis counts from before the pair axis). Models that keep
their rotary frequencies complex (DeepSeek-V2's and Llama 4's `freqs_cis`, unsqueezed and
expanded to the heads) reach these; each is checked against torch by `refine export --check`
and by tests/test_complex_ops.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _axis(dim: int) -> int:
    """A complex tensor's axis `dim` on its real pairs: a negative one moves past the pair axis."""
    return dim - 1 if dim < 0 else dim


def unsqueeze(self: Any, dim: int) -> Any:
    """aten.unsqueeze of a complex tensor."""
    from onnxscript import opset18 as op

    return op.Unsqueeze(self, op.Constant(value_ints=[_axis(dim)]))


def expand(self: Any, size: Any, implicit: bool = False) -> Any:
    """aten.expand of a complex tensor to `size`, the pair axis kept. ONNX's Expand broadcasts
    both ways, so an axis kept (-1) is a 1 in its shape."""
    from onnxscript import opset18 as op

    if not all(isinstance(s, int) for s in size):
        raise NotImplementedError("a complex tensor expanded to a symbolic size")
    return op.Expand(self, op.Constant(value_ints=[1 if s == -1 else s for s in size] + [2]))


def to_copy(self: Any, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
            non_blocking: bool = False, memory_format: Any = None) -> Any:
    """aten._to_copy of a complex tensor to its own dtype (a move between devices): the identity."""
    from onnxscript import opset18 as op

    if dtype is not None and dtype not in (torch.complex64, torch.complex128):
        raise NotImplementedError(f"a complex tensor cast to {dtype}")
    return op.Identity(self)


def translations() -> tuple[tuple[Any, Callable[..., Any]], ...]:
    """(aten op, its complex translation) pairs, for the registry (exporters/capture/tracing.py)."""
    return ((torch.ops.aten.unsqueeze.default, unsqueeze),
            (torch.ops.aten.expand.default, expand),
            (torch.ops.aten._to_copy.default, to_copy))
