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

Megatron's MoE layer (config tiny-moe: MoELayer, TopKRouter, SequentialMLP experts, its
allgather and alltoall token dispatchers) needs three more CPU shims (`moe_cpu_shims`, also
around the torch reference of `--check`), none computing a model value:

- `moe_utils.te_general_gemm` is defined as None when Transformer Engine is absent: Megatron's
  RouterGatingLinearFunction tests `te_general_gemm is not None`, a name only its TE import
  defines (a NameError otherwise); with None it takes its own torch.mm path.
- `Router.gating` moves a weight on the CPU to `torch.cuda.current_device()` by assigning
  `weight.data` on every call; on the CPU that assigns the data to itself, which torch.export
  captures as a fake constant. `_gating_in_place` is gating without those two statements.
- `torch.cuda.Stream`, `current_stream`, `stream` (the alltoall dispatcher's device-to-host
  copies of its counts on a side stream, an event and a synchronize): `_CpuStream`, which does
  nothing (nothing is asynchronous here; the counts are not on CUDA, so Megatron's
  `maybe_move_tensor_to_cpu` leaves them as the tensors they are).
- `TopKRouter._apply_expert_bias` is wrapped by Megatron's `jit_fuser` (torch.compile), which
  make_fx cannot trace in a training step: its original function is called (same values; it
  updates nothing unless expert bias is enabled).

While an MoE is captured (`moe_static_shapes`), its data-dependent sizes are written at static
sizes, each in a form equal in value on the rows a real run has (checked by `--check`), and every
count, offset and index stays computed in the program from Megatron's own tensors:

- `masked_select` of a [experts, tokens] routing mask (moe_utils.permute's token indices and
  probs, the allgather dispatcher's local probs): `masked_select_at_size`, at tokens *
  min(topk, experts) elements (exactly the routes when all experts are local: no padding),
  the selected values first, then zeros (a zero prob: the padded rows scale to nothing).
- `tokens_per_expert.tolist()` + `torch.split` + `torch.cat` (SequentialMLP.forward, and
  sort_chunks_by_idxs of the alltoall dispatcher with several local experts):
  `chunks_at_static_size`: each chunk a window of R rows (R the rows split) from its offset (the
  exclusive cumsum of the counts), the experts run on their windows, and the cat gathers each
  row r back from the window of the chunk holding it (the count of chunk ends <= r).
- the alltoall dispatcher's `all_to_all(group, x, output_splits, input_splits)` with count
  tensors: exporters/capture/ragged.py's `dist.AllToAllV` with the counts as inputs
  (`ragged_exchanges`).
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


# --- Megatron's MoE layer (MoELayer, TopKRouter, its token dispatchers, SequentialMLP) ------------------

def masked_select_at_size(values: torch.Tensor, mask: torch.Tensor, size: int) -> torch.Tensor:
    """`values.masked_select(mask)` (same shapes) at the static size `size` (no more than `size`
    elements selected): element i is the value at the (i+1)-th True of the flattened mask, the
    position j with #{Trues up to j} = i + 1, i.e. the number of positions whose running count
    of Trues is at most i; past the count of Trues, zero."""
    flat, selected = values.reshape(-1), mask.reshape(-1).to(torch.long)
    running = torch.cumsum(selected, 0)
    slot = torch.arange(size, device=values.device)
    position = (running.unsqueeze(0) <= slot.unsqueeze(1)).sum(dim=1)
    picked = flat[torch.clamp(position, max=flat.shape[0] - 1)]
    return torch.where(slot < running[-1], picked, torch.zeros_like(picked))


_MASKED_SELECT = torch.Tensor.masked_select


@contextlib.contextmanager
def routes_at_static_size(topk: int) -> Iterator[None]:
    """While the block runs, `Tensor.masked_select` of a 2-D [experts, tokens] mask of routes (each
    token column holding at most `topk` Trues, as a top-k routing map does) at the static size
    tokens * min(topk, experts) (`masked_select_at_size`); any other masked_select as torch's."""
    def masked_select(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.dim() != 2 or tuple(self.shape) != tuple(mask.shape):
            return _MASKED_SELECT(self, mask)
        experts, tokens = int(mask.shape[0]), int(mask.shape[1])
        return masked_select_at_size(self, mask, tokens * min(topk, experts))

    torch.Tensor.masked_select = masked_select  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.masked_select = _MASKED_SELECT  # type: ignore[method-assign]


class _Chunks:
    """The chunks `torch.split(x, counts.tolist())` cuts (SequentialMLP.forward, moe_utils.
    sort_chunks_by_idxs), at a static size: chunk c is R rows of x (R = x's rows, which no chunk
    exceeds) from its offset on, clamped to the last row."""

    def __init__(self, counts: torch.Tensor) -> None:
        self.counts = counts
        self.windows: dict[int, int] = {}  # id of a cut window -> its chunk

    def cut(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = int(x.shape[0])
        starts = torch.cumsum(self.counts, 0) - self.counts
        window = torch.arange(rows, device=x.device)
        cut = tuple(x[torch.clamp(starts[c] + window, max=rows - 1)] for c in range(int(self.counts.shape[0])))
        self.windows.update({id(w): c for c, w in enumerate(cut)})
        return cut

    def order(self, tensors: Any) -> list[int] | None:
        """The chunk each of `tensors` stands for: the windows cut, in any order (sort_chunks_by_idxs
        concatenates them permuted), or one output per chunk in chunk order (SequentialMLP's
        experts' outputs); None for anything else."""
        if len(tensors) and all(id(t) in self.windows for t in tensors):
            return [self.windows[id(t)] for t in tensors]
        if len(tensors) == int(self.counts.shape[0]) and len({int(t.shape[0]) for t in tensors}) == 1:
            return list(range(len(tensors)))
        return None

    def join(self, tensors: Any, order: list[int]) -> torch.Tensor:
        """torch.cat of the chunks `order` each cut back to its own rows: row r is row r - start(p)
        of the p-th tensor, p the one whose rows hold r (clamped past the last)."""
        rows = int(tensors[0].shape[0])
        stacked = _CAT(list(tensors), 0)
        counts = self.counts[torch.tensor(order, device=self.counts.device)]
        ends = torch.cumsum(counts, 0)
        starts = ends - counts
        row = torch.arange(rows, device=stacked.device)
        part = torch.clamp((ends.unsqueeze(0) <= row.unsqueeze(1)).sum(dim=1), max=len(order) - 1)
        local = torch.clamp(row - starts[part], min=0, max=rows - 1)
        return stacked[part * rows + local]


_SPLIT, _CAT = torch.split, torch.cat


@contextlib.contextmanager
def chunks_at_static_size() -> Iterator[None]:
    """While the block runs: `.tolist()` of a traced integer tensor is exporters/capture/ragged.py's
    SplitSizes (the count tensor kept; a concrete tensor, such as the dispatcher's constant chunk
    order, gives its values), `torch.split` by them cuts `_Chunks` and `torch.cat` of those chunks
    (or of one output per chunk: each expert MLP is row-wise) joins them back: row for row what
    torch's split and cat give, at the static row count of the tensor split. Any other split or
    cat is torch's."""
    from refine.exporters.capture.ragged import SplitSizes, _defining

    cut: list[_Chunks] = []

    def tolist(self: torch.Tensor) -> Any:
        if self.dtype.is_floating_point or self.dtype == torch.bool or self.dim() != 1:
            raise TypeError(f"`.tolist()` of a traced {self.dtype} tensor of {self.dim()} dims in Megatron's MoE: "
                            "only a 1-D count tensor can be read back at a static size")
        return SplitSizes(self, 0)

    def split(tensor: torch.Tensor, split_size_or_sections: Any, dim: int = 0) -> Any:
        if not isinstance(split_size_or_sections, SplitSizes) or dim != 0:
            return _SPLIT(tensor, split_size_or_sections, dim)
        if not cut or cut[-1].counts is not split_size_or_sections.counts:
            cut.append(_Chunks(split_size_or_sections.counts))
        return cut[-1].cut(tensor)

    def cat(tensors: Any, dim: int = 0, **kwargs: Any) -> torch.Tensor:
        order = cut[-1].order(tensors) if cut and dim == 0 and not kwargs else None
        return _CAT(tensors, dim, **kwargs) if order is None else cut[-1].join(tensors, order)

    traced = [(c, vars(c)["tolist"]) for c in _defining(torch.Tensor, "tolist")]  # FakeTensor, FunctionalTensor
    torch.split, torch.cat = split, cat  # type: ignore[assignment]
    for c, _ in traced:
        c.tolist = tolist  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.split, torch.cat = _SPLIT, _CAT  # type: ignore[assignment]
        for c, original in traced:
            c.tolist = original  # type: ignore[attr-defined]


class _CpuStream:
    """torch.cuda.Stream on this CPU: nothing runs asynchronously, so waiting, recording an event
    and synchronizing with it do nothing."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return self

    def synchronize(self) -> None:
        pass


_CURRENT_STREAM = _CpuStream()


def _current_stream(device: Any = None) -> _CpuStream:
    return _CURRENT_STREAM


def _stream(stream: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@contextlib.contextmanager
def ragged_exchanges() -> Iterator[None]:
    """While the block runs, the token dispatcher's `all_to_all(group, x, output_splits,
    input_splits)` with count tensors (MoEAlltoAllTokenDispatcher's, its counts left on the
    device) is exporters/capture/ragged.py's ragged all-to-all at static capacity: a dist.AllToAllV
    with the count tensors as inputs, no peer sending more than the rows of the dispatch's input
    (the combine, with the counts swapped, returns exactly the rows the dispatch sent). Split
    sizes per count tensor are kept for the block (the combine reuses the dispatch's)."""
    from megatron.core.transformer.moe import token_dispatcher

    from refine.exporters.capture.ragged import SplitSizes, ragged_all_to_all

    original = token_dispatcher.all_to_all
    sizes: dict[int, Any] = {}

    def all_to_all(group: Any, input_: torch.Tensor, output_split_sizes_: Any = None,
                   input_split_sizes: Any = None) -> torch.Tensor:
        if not (isinstance(output_split_sizes_, torch.Tensor) and isinstance(input_split_sizes, torch.Tensor)) \
                or group.size() == 1:
            return original(group, input_, output_split_sizes_, input_split_sizes)
        bound = int(input_.shape[0])
        out = sizes.setdefault(id(output_split_sizes_), SplitSizes(output_split_sizes_, bound))
        inp = sizes.setdefault(id(input_split_sizes), SplitSizes(input_split_sizes, bound))
        return ragged_all_to_all(input_, out, inp, group)

    token_dispatcher.all_to_all = all_to_all  # type: ignore[attr-defined]
    try:
        yield
    finally:
        token_dispatcher.all_to_all = original  # type: ignore[attr-defined]


def _gating_in_place(self: Any, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - Megatron's name
    """Megatron's Router.gating without its first two statements, which move a weight on the CPU
    to `torch.cuda.current_device()` by assigning `weight.data` (here the CPU already: the
    assignment only replaces the parameter's data by itself, which torch.export would capture as
    a constant): the router dtype chosen and `router_gating_linear` called as Megatron does."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    router_dtype = input.dtype
    if self.config.moe_router_dtype == "fp32":
        router_dtype = torch.float32
    elif self.config.moe_router_dtype == "fp64":
        router_dtype = torch.float64
    return router_gating_linear(input, self.weight, self.bias, router_dtype)


@contextlib.contextmanager
def moe_cpu_shims() -> Iterator[None]:
    """Megatron's MoE layer on this CPU (module doc): TE's router GEMM name defined (None), the
    router's move of its weight to CUDA left out (`_gating_in_place`), CUDA streams `_CpuStream`,
    TopKRouter._apply_expert_bias without its torch.compile wrapper (Megatron's `jit_fuser`)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import Router

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron.core.transformer.moe.router import TopKRouter

    saved_gemm = vars(moe_utils).get("te_general_gemm", _ABSENT)
    saved_gating, saved_bias = vars(Router)["gating"], vars(TopKRouter)["_apply_expert_bias"]
    TopKRouter._apply_expert_bias = getattr(saved_bias, "_torchdynamo_orig_callable", saved_bias)  # type: ignore[method-assign]
    saved_cuda = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, MoEAlltoAllTokenDispatcher.cuda_dtoh_stream)
    if saved_gemm is _ABSENT:
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    Router.gating = _gating_in_place  # type: ignore[method-assign]
    torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = _CpuStream, _current_stream, _stream  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved_cuda  # type: ignore[assignment, misc]
        Router.gating, TopKRouter._apply_expert_bias = saved_gating, saved_bias  # type: ignore[method-assign]
        if saved_gemm is _ABSENT:
            del moe_utils.te_general_gemm


@contextlib.contextmanager
def moe_static_shapes() -> Iterator[None]:
    """Megatron's MoE layer at static shapes while it is captured (module doc): MoELayer.forward
    under `routes_at_static_size` and `ragged_exchanges`, SequentialMLP.forward and
    sort_chunks_by_idxs under `chunks_at_static_size`."""
    import functools

    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer_forward, experts_forward = MoELayer.forward, SequentialMLP.forward
    sort_chunks = token_dispatcher.sort_chunks_by_idxs

    @functools.wraps(layer_forward)
    def layer(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with routes_at_static_size(self.config.moe_router_topk), ragged_exchanges():
            return layer_forward(self, hidden_states, *args, **kwargs)

    @functools.wraps(experts_forward)
    def experts(self: Any, *args: Any, **kwargs: Any) -> Any:
        with chunks_at_static_size():
            return experts_forward(self, *args, **kwargs)

    @functools.wraps(sort_chunks)
    def sorted_chunks(*args: Any, **kwargs: Any) -> Any:
        with chunks_at_static_size():
            return sort_chunks(*args, **kwargs)

    MoELayer.forward, SequentialMLP.forward = layer, experts  # type: ignore[method-assign]
    token_dispatcher.sort_chunks_by_idxs = sorted_chunks  # type: ignore[attr-defined]
    try:
        yield
    finally:
        MoELayer.forward, SequentialMLP.forward = layer_forward, experts_forward  # type: ignore[method-assign]
        token_dispatcher.sort_chunks_by_idxs = sort_chunks  # type: ignore[attr-defined]


_ABSENT = object()
