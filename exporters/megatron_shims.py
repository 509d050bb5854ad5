"""The CUDA-only helpers of Megatron-Core replaced, so that its models run on this CPU.

Applied only while exporting (`cpu_shims()` is a context manager; the originals are restored on
exit) and neither replacement computes a value the model reads:

- `GlobalMemoryBuffer.get_tensor` allocates its scratch buffers with
  `device=torch.cuda.current_device()`. Megatron uses them as the `input` of
  `torch.baddbmm(..., beta=0.0)` (attention scores: with beta 0 the input is ignored) and as
  the output buffer of all-gathers (written whole before it is read). The shim returns a fresh
  tensor of zeros of the requested shape and dtype, on the export's device (the CPU, or the
  meta device for a model without weight data).
- `torch.cuda.current_device()` is where Megatron places the output buffers of its
  collectives (`torch.empty(..., device=torch.cuda.current_device())` before an all-gather
  or reduce-scatter writes them whole). The shim answers the export's device.
- `CudaRNGStatesTracker.fork` switches to a separate CUDA generator so that dropout inside
  tensor-parallel regions draws different masks per rank. An export traces the model in eval
  mode, where dropout draws nothing, so the shim is a context that does nothing.

Megatron also builds its default causal mask on CUDA (`get_default_causal_mask`); that is not
shimmed: exporters.megatron passes the mask explicitly, as Megatron's training loop does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


_DEVICE = [torch.device("cpu")]  # the export's device, while cpu_shims() is active


def _scratch(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None) -> torch.Tensor:
    """A scratch buffer on the export's device (its contents are never read before they are written)."""
    return torch.zeros(tuple(tensor_shape), dtype=dtype, device=_DEVICE[0])


def _device() -> torch.device:
    """Where Megatron's collective output buffers go: the export's device."""
    return _DEVICE[0]


def _no_rng_fork(self: Any, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
    """No generator switch: in eval mode dropout draws no random numbers."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def cpu_shims(device: str = "cpu") -> Iterator[None]:
    """Megatron-Core's CUDA-only scratch buffers, buffer device and RNG fork replaced while the
    block runs; buffers go to `device` (cpu, or meta for an export without weight data)."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.utils import GlobalMemoryBuffer

    saved = (GlobalMemoryBuffer.get_tensor, CudaRNGStatesTracker.fork, torch.cuda.current_device, _DEVICE[0])
    GlobalMemoryBuffer.get_tensor = _scratch  # type: ignore[method-assign]
    CudaRNGStatesTracker.fork = _no_rng_fork  # type: ignore[method-assign]
    torch.cuda.current_device = _device  # type: ignore[assignment]
    _DEVICE[0] = torch.device(device)
    try:
        yield
    finally:
        GlobalMemoryBuffer.get_tensor, CudaRNGStatesTracker.fork, torch.cuda.current_device, _DEVICE[0] = saved  # type: ignore[method-assign, assignment]
