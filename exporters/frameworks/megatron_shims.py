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
shimmed: refine.exporters.frameworks.megatron passes the mask explicitly, as Megatron's training loop does.
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


# (over one rank all_reduce is the identity: Megatron's TP 1 model calls it too)
from refine.exporters.capture.functional import Done as _Done  # noqa: E402
from refine.exporters.capture.functional import all_reduce_in_place as _functional_all_reduce  # noqa: E402


def _functional_all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None,  # noqa: A002 - torch's names
                           async_op: bool = False) -> Any:
    """all_gather_into_tensor (dim 0) into `output`, written as its functional form copied in."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = group if group is not None else dist.group.WORLD
    output.copy_(funcol.all_gather_tensor(input, 0, group) if dist.get_world_size(group) > 1 else input)
    return _Done() if async_op else None


def _functional_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = None, group: Any = None,  # noqa: A002
                               async_op: bool = False) -> Any:
    """reduce_scatter_tensor (dim 0) into `output`, written as its functional form copied in."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = group if group is not None else dist.group.WORLD
    name = getattr(op if op is not None else dist.ReduceOp.SUM, "name", str(op)).lower()
    output.copy_(funcol.reduce_scatter_tensor(input, name, 0, group) if dist.get_world_size(group) > 1 else input)
    return _Done() if async_op else None


@contextlib.contextmanager
def functional_collectives() -> Iterator[None]:
    """While a training step is traced (make_fx over eager autograd, exporters/capture/train.py), the
    in-place collectives Megatron calls (`torch.distributed.all_reduce` in its cross-entropy and
    region mappings; its `dist_all_gather_func` / `dist_reduce_scatter_func` under sequence
    parallelism, forward and backward) run as their functional forms copied into the tensor
    they write (nothing over a group of one rank): the same values, and what torch.export's
    functionalization makes of them in a forward export. make_fx would otherwise record c10d's
    in-place ops, which hold the process group as an opaque object."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers, mappings

    names = ("dist_all_gather_func", "dist_reduce_scatter_func")
    saved = (dist.all_reduce, *(getattr(m, n) for m in (mappings, layers) for n in names))
    dist.all_reduce = _functional_all_reduce  # type: ignore[assignment]
    for module in (mappings, layers):
        module.dist_all_gather_func = _functional_all_gather  # type: ignore[attr-defined]
        module.dist_reduce_scatter_func = _functional_reduce_scatter  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.all_reduce = saved[0]  # type: ignore[assignment]
        mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func = saved[1:3]  # type: ignore[attr-defined]
        layers.dist_all_gather_func, layers.dist_reduce_scatter_func = saved[3:5]  # type: ignore[attr-defined]
