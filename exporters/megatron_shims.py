"""The CUDA-only helpers of Megatron-Core replaced, so that its models run on this CPU.

Applied only while exporting (`cpu_shims()` is a context manager; the originals are restored on
exit) and neither replacement computes a value the model reads:

- `GlobalMemoryBuffer.get_tensor` allocates its scratch buffers with
  `device=torch.cuda.current_device()`. Megatron uses them as the `input` of
  `torch.baddbmm(..., beta=0.0)` (attention scores: with beta 0 the input is ignored) and as
  the output buffer of all-gathers (written whole before it is read). The shim returns a fresh
  CPU tensor of zeros of the requested shape and dtype.
- `torch.cuda.current_device()` is where Megatron places the output buffers of its
  collectives (`torch.empty(..., device=torch.cuda.current_device())` before an all-gather
  or reduce-scatter writes them whole). The shim answers the CPU device.
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


def _cpu_scratch(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None) -> torch.Tensor:
    """A scratch buffer on the CPU (its contents are never read before they are written)."""
    return torch.zeros(tuple(tensor_shape), dtype=dtype)


def _cpu_device() -> torch.device:
    """Where Megatron's collective output buffers go: the CPU."""
    return torch.device("cpu")


def _no_rng_fork(self: Any, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
    """No generator switch: in eval mode dropout draws no random numbers."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Megatron-Core's CUDA-only scratch buffers, buffer device and RNG fork replaced while the block runs."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.utils import GlobalMemoryBuffer

    saved = (GlobalMemoryBuffer.get_tensor, CudaRNGStatesTracker.fork, torch.cuda.current_device)
    GlobalMemoryBuffer.get_tensor = _cpu_scratch  # type: ignore[method-assign]
    CudaRNGStatesTracker.fork = _no_rng_fork  # type: ignore[method-assign]
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    try:
        yield
    finally:
        GlobalMemoryBuffer.get_tensor, CudaRNGStatesTracker.fork, torch.cuda.current_device = saved  # type: ignore[method-assign, assignment]
