"""What torchtitan assumes of a GPU cluster, replaced so that its own code runs on this CPU.

torchtitan (the `torchtitan` extra) is exported as it ships: its model code, its sharding
configs and its parallelize path. These shims are the glue a user would otherwise write, each as
small as it can be, active only while exporting (context managers; everything is restored on
exit), and none computing a model value differently:

1. **Triton kernels.** `torchtitan.models.common` imports its expert-parallel token dispatcher,
   whose kernels module imports Triton at the top (a GPU compiler the CPU build of torch does not
   have). Where Triton is absent, that one module (`minimal_async_ep.kernels`) is a stand-in whose
   functions raise; the kernels run only under that MoE dispatcher, which no export here uses.
2. **Device type.** torchtitan picks its device type once at import (`"cuda"` when no accelerator
   is found) and builds its meshes with it; the meshes are built on `"cpu"`.
3. **Attention.** Llama 3's configs use FlexAttention, which has no CPU backward, and whose
   block mask needs `aten.sort.stable` (which the ONNX translation rejects). Each layer's inner
   attention is torchtitan's own `ScaledDotProductAttention` (causal, the same function of q, k,
   v: `exporters/frameworks/torchtitan.py` builds the config with it), its kernel choice narrowed
   to the MATH backend (`math_attention`): the CPU flash kernel's backward has no ONNX
   translation; MATH computes softmax(q k^T / sqrt(d), causal) v in plain ops.
4. **The SPMD mesh region.** The trainer runs every forward inside `get_spmd_context`
   (`set_current_spmd_mesh` of the dense mesh); outside it the spmd_types backend issues no
   collective at all. The exported model's forward runs inside it (`spmd_region`).
5. **Collectives.** spmd_types calls torch.distributed's in-place collectives (all_reduce,
   all_gather_into_tensor, reduce_scatter_tensor) through a patchable handle
   (`spmd_types.set_dist`); while exporting, they run as their functional forms copied into the
   tensor they write (torch.export rejects the process-group object the in-place ops carry), the
   same values (the forms of `exporters/capture/functional.py` and `exporters/frameworks/megatron_shims.py`).
6. **spmd_types' conversion ops.** `replicate_to_varying` (keep the rank's chunk),
   `varying_to_partial` (the rank's chunk placed in zeros) and `replicate_to_partial` (the value
   on rank 0, zeros elsewhere) are custom ops, opaque to the ONNX translation; while exporting,
   their Python bodies run in their place, so that the programs hold the slices and pads they are.
7. **Weights under the fake process group.** torchtitan's DTensor backends distribute each weight
   with `distribute_tensor`, which scatters rank 0's values; the fake process group moves no
   data, so the other ranks would keep whatever it left. Every rank builds the same full weights
   (one seed), so `distribute_tensor(..., src_data_rank=None)`, each rank keeping its own chunk,
   is what the scatter gives (`own_chunks`).
8. **FlexAttention under context parallelism.** torchtitan's CP on its spmd_types and
   full_dtensor backends needs FlexAttention, which it runs through `torch.compile` (Inductor's
   kernels: its block mask made by a compiled `create_block_mask`, in torchtitan and in torch's
   CP cut of the mask, its attention by a compiled `flex_attention`). While exporting, the masks
   are made by the same `create_block_mask` uncompiled, and the attention is the value
   flex_attention computes, in plain ops (`_dense_flex_attention`): softmax(q k^T * scale) over
   the keys the block mask keeps, times v. What it keeps is the mask's own `mask_mod` evaluated
   at every (batch, head, query, key) index (`dense_mask`; under CP the rank's rewritten one, its
   query indices moved to the rank's rows). The block mask is built outside the forward, as the
   trainer builds it (`post_dataloading_process`), so `aten.sort` (which ONNX rejects) never
   enters a program; the programs take its values as an input, as the forward takes the mask.
9. **The MoE combine's scatter-add.** torchtitan's token dispatcher adds the experts' rows back
   with `torchtitan::deterministic_scatter_add`, a custom op (opaque to the ONNX translation)
   whose body is `out.scatter_add(0, index, src)` run with deterministic algorithms on (a GPU
   kernel choice); while exporting, that body runs in its place (`plain_scatter_add`), its
   backward torch's own of `scatter_add` (the op's registered one: the gradient, and its
   gather at the index).
10. **A replica labelled partial.** Under torch.export (not in eager runs: the tracing path of
   DTensor's sharding propagation, uncached, breaks a cost tie the other way) an op whose inputs
   are all `Replicate` on a mesh dim may come out `Partial(avg)` there: `aten.index`'s strategy
   passes a partial through from its values, and turning a replica into `Partial(avg)` costs
   nothing (RoPE's cache at the positions, under CP). torchtitan's sharding config then refuses
   the query where it expects `Replicate`. Every rank of that dim ran the op on the same local
   inputs, so the outputs agree: an avg, max or min of equal values is each one, a replica.
   While exporting, such an output is placed `Replicate` (`replicas_stay_replicated`); a `sum`
   partial, or any dim where an input was not `Replicate`, is left as DTensor chose it.
11. **Expert parallelism's split sizes.** torchtitan's `AllToAllTokenDispatcher` (EP > 1) exchanges
   the per-expert counts (an equal-split `all_to_all_single`), reads the split sizes back to the
   host (`.to("cpu").tolist()`) and hands them to two ragged `all_to_all_single`s (dispatch,
   combine); its `_permute` sorts the received rows expert-major with
   `repeat_interleave(segment_lens, output_size=total)`. torch.export cannot trace sizes that
   depend on values (on a GPU the host sync is real). While its `dispatch` and `combine` run,
   they run at static capacity (exporters/capture/ragged.py's `static_splits`, as HF's AllToAllEP
   is exported): the split sizes stay the count tensors, each ragged exchange is a
   `dist.AllToAllV` with them as inputs, sized for `T * min(K, local experts)` rows from each peer
   (the receive capacity torchtitan's own MinimalAsyncEP dispatcher allocates: a token's K experts
   are distinct), and `_permute`'s `repeat_interleave` is written at that size, its rows past the
   routes padded with the last segment (whose gather index is then the row itself, `input_starts
   == output_starts` there: in range, never sent back). The count exchange stays torch's
   functional all-to-all (`dist.AllToAll`). torchtitan takes its functional all-to-alls (and not
   spmd_types' `all_to_all`, whose uneven form splits the rows by the host's split sizes) when
   `torch.compiler._is_non_strict_tracing()`: torch.export sets that flag, the training step's
   `make_fx` capture (exporters/capture/train.py) does not, so it is set while dispatch and combine
   run (the same branch in the forward and in the training step; `refine::all_to_all_v` has its own
   backward: the reverse exchange). No value of a route is computed differently
   (`static_capacity_dispatch`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)


def _needs_triton(name: str) -> Callable[..., Any]:
    def kernel(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"torchtitan's {name} is a Triton GPU kernel (Triton is not installed)")

    return kernel


def import_torchtitan() -> None:
    """Import torchtitan's Llama 3 (shim 1: its Triton kernels module stood in for where Triton
    is absent). An ImportError if torchtitan itself is missing."""
    if "torchtitan.models.llama3" in sys.modules:
        return
    if importlib.util.find_spec("torchtitan") is None:
        raise ImportError("No module named 'torchtitan'")
    if importlib.util.find_spec("triton") is None and _KERNELS not in sys.modules:
        stand_in = types.ModuleType(_KERNELS, "torchtitan's Triton kernels, absent on this CPU (refine's shim)")
        for name in _KERNEL_NAMES:
            setattr(stand_in, name, _needs_triton(name))
        sys.modules[_KERNELS] = stand_in
    import torchtitan.models.llama3  # noqa: F401
    import torchtitan.trainer  # noqa: F401  (Decoder.Config.update_from_config imports it)


@contextlib.contextmanager
def cpu_device() -> Iterator[None]:
    """Shim 2: torchtitan's meshes built on the CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tools

    saved = (tools.device_type, parallel_dims.device_type)
    tools.device_type = parallel_dims.device_type = "cpu"
    try:
        yield
    finally:
        tools.device_type, parallel_dims.device_type = saved


def spmd_region(model: torch.nn.Module, parallel_dims: Any, methods: tuple[str, ...] = ("forward",)) -> None:
    """Shim 4: `model`'s forward (and its other `methods`: a pipeline stage's training step, whose
    loss on the last stage asks the region for the TP mesh) runs inside the trainer's SPMD context
    (the dense mesh current), as torchtitan's Trainer runs it (`self.train_context()` around the
    forward and the loss)."""
    from torchtitan.distributed.utils import get_spmd_context

    if not parallel_dims._single_axis_meshes:
        parallel_dims.build_mesh()  # now, not while torch.export traces the forward
    context = get_spmd_context(parallel_dims=parallel_dims)
    for name in methods:
        method = getattr(model, name)

        @functools.wraps(method)  # the same signature: the programs' inputs keep torchtitan's names (`tokens`)
        def in_region(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            with context():
                return _method(*args, **kwargs)

        setattr(model, name, in_region)


class _FunctionalDist(types.ModuleType):
    """torch.distributed with its in-place collectives run as functional ones (shim 5)."""

    def __init__(self) -> None:
        super().__init__("refine_functional_dist")
        from refine.exporters.capture.functional import all_reduce_in_place
        from refine.exporters.frameworks import megatron_shims as forms

        self.all_reduce = all_reduce_in_place
        self.all_gather_into_tensor = forms._functional_all_gather
        self.reduce_scatter_tensor = forms._functional_reduce_scatter

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


def _replicate_to_varying(x: torch.Tensor, world_size: int, split_dim: int, rank: int, stack: bool) -> torch.Tensor:
    """spmd_types::replicate_to_varying's body: the rank's chunk (or its index when stacked)."""
    if stack:
        return x.select(split_dim, rank).clone()
    return torch.chunk(x, world_size, dim=split_dim)[rank].clone()


def _varying_to_partial(x: torch.Tensor, world_size: int, split_dim: int, rank: int, stack: bool) -> torch.Tensor:
    """spmd_types::varying_to_partial's body: the rank's chunk at its place, zeros elsewhere."""
    if stack:
        x = x.unsqueeze(split_dim)
    size = x.shape[split_dim]
    dim = split_dim % x.dim()
    pad = [0, 0] * (x.dim() - 1 - dim) + [rank * size, (world_size - 1 - rank) * size]
    return torch.nn.functional.pad(x, pad)


def _replicate_to_partial(x: torch.Tensor, rank: int) -> torch.Tensor:
    """spmd_types::replicate_to_partial's body: the value on rank 0, zeros elsewhere."""
    return x.clone() if rank == 0 else torch.zeros_like(x)


@contextlib.contextmanager
def traceable_spmd() -> Iterator[None]:
    """Shims 5 and 6 while the block runs."""
    import spmd_types
    from spmd_types import _dist, _local

    saved = (_dist.dist, _local._replicate_to_varying, _local._varying_to_partial, _local._replicate_to_partial)
    spmd_types.set_dist(_FunctionalDist())
    _local._replicate_to_varying = _replicate_to_varying
    _local._varying_to_partial = _varying_to_partial
    _local._replicate_to_partial = _replicate_to_partial
    try:
        yield
    finally:
        spmd_types.set_dist(saved[0])
        _local._replicate_to_varying, _local._varying_to_partial, _local._replicate_to_partial = saved[1:]


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """Shim 3: torchtitan's ScaledDotProductAttention built while the block runs picks the MATH
    kernel (its class default, read when a module is built, is CUDNN, FLASH, then MATH)."""
    from torch.nn.attention import SDPBackend
    from torchtitan.models.common.attention import ScaledDotProductAttention

    saved = ScaledDotProductAttention.sdpa_backends
    ScaledDotProductAttention.sdpa_backends = [SDPBackend.MATH]
    try:
        yield
    finally:
        ScaledDotProductAttention.sdpa_backends = saved


@contextlib.contextmanager
def own_chunks() -> Iterator[None]:
    """Shim 7: torchtitan's `distribute_tensor` (of its Module's states) keeps each rank's own chunk."""
    import torchtitan.protocols.module as module

    saved = module.distribute_tensor
    module.distribute_tensor = functools.partial(saved, src_data_rank=None)  # type: ignore[assignment]
    try:
        yield
    finally:
        module.distribute_tensor = saved  # type: ignore[assignment]


def dense_mask(block_mask: Any) -> torch.Tensor:
    """The block mask's `mask_mod` at every (batch, head, query, key) index it covers, a boolean
    tensor, kept on the mask (`refine_dense`): computed where the mask is made, outside the traced
    forward, which replaces it by its program input of these values (shim 8)."""
    dense = getattr(block_mask, "refine_dense", None)
    if dense is None:
        q_len, kv_len = block_mask.seq_lengths
        index = [torch.arange(n).reshape([n if i == axis else 1 for i in range(4)])
                 for axis, n in enumerate((*block_mask.shape[:2], q_len, kv_len))]
        dense = block_mask.refine_dense = block_mask.mask_mod(*index)
    return dense


def _dense_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any, block_mask: Any,
                          scale: float | None, enable_gqa: bool, return_aux: Any, kernel_options: dict) -> tuple[Any, Any]:
    """flex_attention(q, k, v, block_mask=...) in plain ops (shim 8): q, k, v are (B, N, L, H)."""
    from torch.nn.attention.flex_attention import AuxOutput

    if score_mod is not None:
        raise NotImplementedError("refine's dense FlexAttention takes no score_mod")
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if block_mask is not None:
        scores = scores.masked_fill(~dense_mask(block_mask), float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    lse = torch.logsumexp(scores.float(), dim=-1) if return_aux is not None and return_aux.lse else None
    return weights @ v, AuxOutput(lse=lse)


@contextlib.contextmanager
def eager_flex() -> Iterator[None]:
    """Shim 8: torchtitan's compiled block mask and FlexAttention, uncompiled and in plain ops."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    saved = (attention._compiled_create_block_mask, cp_attention._compiled_create_block_mask,
             attention.FlexAttention._compiled_flex_attn)
    attention._compiled_create_block_mask = cp_attention._compiled_create_block_mask = create_block_mask
    attention.FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)  # type: ignore[assignment]
    try:
        yield
    finally:
        (attention._compiled_create_block_mask, cp_attention._compiled_create_block_mask,
         attention.FlexAttention._compiled_flex_attn) = saved


def _scatter_add_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """torchtitan::deterministic_scatter_add's body (shim 9)."""
    return out.scatter_add(0, index, src)


@contextlib.contextmanager
def plain_scatter_add() -> Iterator[None]:
    """Shim 9: the token dispatcher's combine adds its rows with the custom op's own body."""
    from torchtitan.models.common import token_dispatcher

    saved = token_dispatcher.deterministic_scatter_add
    token_dispatcher.deterministic_scatter_add = _scatter_add_rows
    try:
        yield
    finally:
        token_dispatcher.deterministic_scatter_add = saved


@contextlib.contextmanager
def replicas_stay_replicated() -> Iterator[None]:
    """DTensor's sharding propagation with an output `Partial(avg|max|min)` on a mesh dim
    where every tensor input is `Replicate` placed `Replicate` (shim 10: the same values)."""
    import dataclasses

    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._dispatch import OpDispatcher
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OutputSharding
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator.propagate
    dispatch_slow_path = OpDispatcher._propagate_op_sharding_dispatch_slow_path

    def replica(spec: Any, replicated: set[int]) -> Any:
        if isinstance(spec, (list, tuple)):
            return type(spec)(replica(s, replicated) for s in spec)
        if not isinstance(spec, DTensorSpec):
            return spec
        placements = tuple(Replicate() if i in replicated and isinstance(p, Partial) and p.reduce_op in ("avg", "max", "min")
                           else p for i, p in enumerate(spec.placements))
        return spec if placements == spec.placements else DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)

    def specs(args: Any) -> Iterator[Any]:
        """The DTensorSpecs among an op's arguments, in lists too (aten.index's indices); not
        through torch's pytree, where refine's tracing registers DTensorSpec as a constant."""
        for arg in args:
            if isinstance(arg, DTensorSpec):
                yield arg
            elif isinstance(arg, (list, tuple)):
                yield from specs(arg)

    def replicated(op_schema: Any, result: Any) -> Any:
        inputs = list(specs((op_schema.args_schema, tuple(op_schema.kwargs_schema.values()))))
        if not inputs or not isinstance(result, OutputSharding) or result.output_spec is None \
                or any(a.mesh != inputs[0].mesh for a in inputs):
            return result
        dims = {i for i in range(inputs[0].mesh.ndim) if all(isinstance(a.placements[i], Replicate) for a in inputs)}
        output = replica(result.output_spec, dims)
        return result if output == result.output_spec else dataclasses.replace(result, output_spec=output)

    def slow_path(self: Any, op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool) -> Any:
        return replicated(op_info.schema, dispatch_slow_path(self, op_call, args, kwargs, op_info, try_cache))

    def propagate_replicas(self: Any, op_info: Any) -> None:
        propagate(self, op_info)
        op_info.output_sharding = replicated(op_info.schema, op_info.output_sharding)

    OpDispatcher._propagate_op_sharding_dispatch_slow_path = slow_path  # type: ignore[method-assign]
    ShardingPropagator.propagate = propagate_replicas  # type: ignore[method-assign]
    try:
        yield
    finally:
        OpDispatcher._propagate_op_sharding_dispatch_slow_path = dispatch_slow_path  # type: ignore[method-assign]
        ShardingPropagator.propagate = propagate  # type: ignore[method-assign]


def ep_receive_bound(dispatcher: Any, x_TD: torch.Tensor) -> int:  # noqa: N803 - torchtitan's name
    """The most rows one EP peer can send this rank (shim 11): each of its T tokens goes to at most
    min(K, e) of this rank's e local experts (MinimalAsyncEP's `num_receive_rows_per_source_rank`)."""
    local_experts = dispatcher.num_experts // dispatcher.ep_mesh.size()
    return int(x_TD.shape[0]) * min(dispatcher.top_k, local_experts)


@contextlib.contextmanager
def static_capacity_dispatch() -> Iterator[None]:
    """Shim 11: torchtitan's AllToAllTokenDispatcher's dispatch and combine (EP > 1) at static capacity."""
    from torchtitan.models.common import token_dispatcher

    from refine.exporters.capture.ragged import static_splits

    cls = token_dispatcher.AllToAllTokenDispatcher
    saved = (vars(cls)["dispatch"], vars(cls)["combine"])

    @functools.wraps(saved[0])
    def dispatch(self: Any, x_TD: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: N803
        if self.ep_mesh is None:
            return saved[0](self, x_TD, *args, **kwargs)
        with static_splits(ep_receive_bound(self, x_TD), token_dispatcher), torch.compiler._non_strict_tracing_context():
            return saved[0](self, x_TD, *args, **kwargs)

    @functools.wraps(saved[1])
    def combine(self: Any, routed_output_RD: torch.Tensor, metadata: Any, x_TD: torch.Tensor) -> Any:  # noqa: N803
        if self.ep_mesh is None:
            return saved[1](self, routed_output_RD, metadata, x_TD)
        with static_splits(ep_receive_bound(self, x_TD), token_dispatcher), torch.compiler._non_strict_tracing_context():
            return saved[1](self, routed_output_RD, metadata, x_TD)

    cls.dispatch, cls.combine = dispatch, combine  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.dispatch, cls.combine = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Every shim of this module while the block runs (torchtitan imported first)."""
    import_torchtitan()
    with cpu_device(), math_attention(), traceable_spmd(), own_chunks(), eager_flex(), plain_scatter_add(), \
            replicas_stay_replicated(), static_capacity_dispatch():
        yield
