"""torch module -> ONNX, and the fake process group a rank is captured under.

Every rank is captured in this one process: for rank r a "fake" process group of the real
world size is initialized (collectives are recorded, never executed), the rank's module is
built and parallelized, exported, and the group is destroyed again.

Both sides go through the same path, torch.export -> run_decompositions() (the default
table) -> torch.onnx.export(dynamo=True, optimize=False):
- DTensor cannot go straight through torch.onnx.export: its decomposition step keeps
  CompositeImplicitAutograd ops such as aten.linear, for which DTensor has no sharding rule
  (AssertionError in sharding propagation). The default table decomposes them while the
  DTensor subclass is unwrapped into local tensors and c10d functional collectives.
- Running the sequential model through the same decompositions keeps the two graphs
  structurally parallel (the same Reshape/MatMul for a linear on both sides), which is
  what the verifier's lemmas match on.
optimize=False keeps parameter FQNs as initializer names and node metadata_props
(`pkg.torch.onnx.name_scopes`, `pkg.torch.onnx.stack_trace`) on every node.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import onnx
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from refine.exporters.capture import complex_ops, dispatch_ops
from refine.exporters.errors import ExportError, capture_error

_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch.distributed", "onnx_ir")


def prepare_tracing() -> None:
    """One-time set-up torch.export needs for DTensor and ONNX needs for `dist` ops."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    from refine.dist import register_schemas

    register_schemas()  # else onnxscript fails with "No schema registered for 'AllReduce'"
    if DTensorSpec not in pytree.SUPPORTED_NODES:
        pytree.register_constant(DTensorSpec)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence exporter chatter (progress lines, torchvision and deprecation warnings)."""
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    try:
        for name in _LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def reset_dtensor_caches() -> None:
    """Forget everything DTensor cached about device meshes.

    DeviceMesh equality ignores which rank the mesh belongs to, so when rank r+1 builds its
    mesh in the same process, DTensor's caches (sharding propagation, redistribution plans)
    hand back specs holding rank r's mesh: rank r+1's parameters then claim rank r's
    coordinate. Clearing them between ranks keeps each rank's capture its own.
    """
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A process group in which this process is `rank` of `world_size`, collectives not executed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ExportError("a torch.distributed process group is already initialized; export needs to create its own")
    reset_dtensor_caches()
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank{r}]" to every traceback line
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        reset_dtensor_caches()


def _drop_metadata_asserts(ep: torch.export.ExportedProgram) -> None:
    """Remove aten._assert_tensor_metadata (a no-op check emitted for `.to(dtype)`): DTensor has
    no sharding rule for it, so run_decompositions would fail on a sharded activation."""
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
    ep.graph_module.recompile()


def to_onnx(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    output_names: Sequence[str],
    translation_table: dict[Callable[..., Any], Callable[..., Any]] | None = None,
    *,
    layers: str | None = None,
    info: dict[str, Any] | None = None,
) -> onnx.ModelProto:
    """Export `module(*args)` to ONNX along the path described in the module docstring.

    `layers` names a ModuleList of `module` whose distinct layers become local functions, each
    captured once (refine.exporters.capture.layers). Parameters on the meta device become typed graph inputs
    without data. `info`, if given, receives the seconds of each step and the layers' summary."""
    from refine.exporters.capture import layers as layer_functions
    from refine.exporters.capture.vocab_lookup import vocab_parallel_lookup

    seconds: dict[str, float] = {}
    table = dict(translation_table or {})
    tracer = None
    if layers is not None:
        start = time.perf_counter()
        tracer = layer_functions.Tracer(module, layers)
        table.update(layer_functions.translation_table())
        seconds["signatures"] = time.perf_counter() - start
    try:
        with quiet(), vocab_parallel_lookup(), math_attention():  # (a row-sharded DTensor lookup in one op: capture/vocab_lookup.py)
            start = time.perf_counter()
            while True:
                try:
                    # (torch.export prints its partial graph to stderr on a data-dependent failure: the
                    # failure itself becomes one line below)
                    with tracer.active() if tracer else contextlib.nullcontext(), \
                            contextlib.redirect_stderr(io.StringIO()):
                        ep = torch.export.export(module, tuple(args), strict=False)
                    break
                except ExportError:
                    raise
                except Exception as exc:  # noqa: BLE001 - torch may wrap it
                    retrace = layer_functions.retrace_of(exc)
                    if tracer is None or retrace is None:
                        raise capture_error(f"{type(module).__name__} (torch.export)", exc) from None
                    tracer.visible.add(retrace.index)
            _drop_metadata_asserts(ep)
            seconds["export"] = time.perf_counter() - start
            start = time.perf_counter()
            try:
                ep = ep.run_decompositions(export_decompositions())
            except ExportError:
                raise
            except Exception as exc:  # noqa: BLE001 - a decomposition torch cannot run on this program
                raise capture_error(f"{type(module).__name__} (torch.export's decompositions)", exc) from None
            seconds["decompose"] = time.perf_counter() - start
            start = time.perf_counter()
            program = translate(ep, tuple(args), list(output_names), table)
            meta_weights_to_inputs(program)
            model = program.model_proto
            seconds["onnx"] = time.perf_counter() - start
            summary = None
            if tracer is not None:
                start = time.perf_counter()
                summary = layer_functions.outline(model, tracer)
                seconds["outline"] = time.perf_counter() - start
    finally:
        if tracer is not None:
            tracer.close()
    if info is not None:
        info["seconds"] = seconds
        if summary is not None:
            info["layers"] = summary
    return model


def math_attention() -> contextlib.AbstractContextManager[None]:
    """`F.scaled_dot_product_attention` by its math backend while a program is captured: its
    matmuls and softmax, op by op, whose backward autograd writes op by op too. The CPU's fused
    kernel has a backward op of its own (`_scaled_dot_product_flash_attention_for_cpu_backward`)
    that torch.onnx cannot translate, and an output layout that DTensor's linear cannot view; the
    math backend computes the same values (checked by `--check`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def masked_fill_index_put(self: torch.Tensor, indices: Sequence[torch.Tensor | None], values: torch.Tensor,
                          accumulate: bool = False) -> Any:
    """`x[mask] = v` (one boolean mask over leading axes of x, one value) as the `where` it is.

    torch exports it as ScatterND at NonZero(mask) positions, a data-dependent shape no lemma
    can read (Megatron's VocabParallelEmbedding zeroes the ids and rows a rank does not own this
    way). Any other index_put is left as it is (NotImplemented: not decomposed)."""
    if accumulate or len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.bool:
        return NotImplemented
    mask = indices[0]
    if values.numel() != 1 or tuple(mask.shape) != tuple(self.shape[:mask.dim()]):
        return NotImplemented
    for _ in range(self.dim() - mask.dim()):
        mask = mask.unsqueeze(-1)
    return torch.where(mask, values.reshape(()).to(self.dtype), self)


def empty_permuted(size: Sequence[int], physical_layout: Sequence[int], **kwargs: Any) -> torch.Tensor:
    """`aten.empty_permuted` (`torch.empty_like` of a tensor with a permuted layout: HF's inverse
    permutation buffer) as `torch.empty` of that size: an ONNX tensor has no memory layout."""
    return torch.empty(list(size), **kwargs)


def integer_isnan(self: torch.Tensor) -> Any:
    """aten.isnan of integers (torch's clamp reference tests `isnan(a)` whatever a's type: an
    in-place `ids.clamp_(max=...)` in a training step's trace) is all false; ONNX's IsNaN takes
    floats only. A float's isnan is kept (NotImplemented: no decomposition)."""
    if self.dtype.is_floating_point or self.dtype.is_complex:
        return NotImplemented
    return torch.zeros_like(self, dtype=torch.bool)


def own_decompositions() -> dict[Any, Callable[..., Any]]:
    """This package's decompositions, for the forward's export and the training step's trace
    alike: boolean-mask assignments as `where`, uninitialized buffers of a permuted layout as
    plain ones, a pad that crops as a slice, integers' isnan as false."""
    return {torch.ops.aten.index_put.default: masked_fill_index_put, torch.ops.aten.empty_permuted.default: empty_permuted,
            torch.ops.aten.constant_pad_nd.default: cropping_pad, torch.ops.aten.isnan.default: integer_isnan}


def export_decompositions() -> dict[Any, Callable[..., Any]]:
    """torch.export's default decompositions, this package's (`own_decompositions`), and
    aten.squeeze.dims as torch.onnx would decompose it (its translation has none: a forward
    that computes a cross-entropy, exporters/strategies/context.py's CP loss, reaches it; the training
    step's table decomposes it the same way, exporters/capture/train.py)."""
    from torch._decomp import decomposition_table

    table = torch.export.default_decompositions()
    table.update(own_decompositions())
    table[torch.ops.aten.squeeze.dims] = decomposition_table[torch.ops.aten.squeeze.dims]
    return table


def translate(ep: torch.export.ExportedProgram, args: tuple, output_names: list[str],
              table: dict[Callable[..., Any], Callable[..., Any]]) -> Any:
    """torch.onnx.export(ep, dynamo=True, optimize=False), less its own decomposition pass.

    torch.onnx.export re-runs run_decompositions with its ONNX-friendly table, a subset of the
    default table `ep` was just decomposed with: on such a program it changes nothing, and it
    is a full retrace, most of the translation's cost. With torch 2.13 (the pinned version)
    the remaining steps are called directly: type promotion, assertion removal, translation,
    opset conversion, output naming (as torch.onnx.export does them). An op the translation cannot handle still fails loudly. Any other torch
    takes the public path."""
    try:
        from torch.onnx import _constants as onnx_constants
        from torch.onnx._internal._lazy_import import onnxscript_apis
        from torch.onnx._internal.exporter import _core, _fx_passes, _ir_passes
    except ImportError:
        _core = None
    if _core is None or not torch.__version__.startswith("2.13."):
        try:
            return torch.onnx.export(ep, args, dynamo=True, optimize=False, verbose=False, output_names=output_names,
                                     custom_translation_table=table or None)
        except Exception as exc:  # noqa: BLE001 - one line, whatever the translation raised
            raise translation_error(exc) from None
    registry = torchlib_registry(tuple(table.items()))
    graph_module = ep.graph_module
    _fx_passes.insert_type_promotion_nodes(graph_module)
    ep._graph_module = _fx_passes.remove_assertion_nodes(graph_module)
    try:
        program = _core._exported_program_to_onnx_program(ep, registry=registry)
    except Exception as exc:  # noqa: BLE001 - one line, whatever the translation raised
        raise translation_error(exc) from None
    program.model = onnxscript_apis.convert_version(program.model, onnx_constants.ONNX_DEFAULT_OPSET)
    _ir_passes.rename_outputs(program.model, output_names)
    return program


def translation_error(exc: BaseException) -> ExportError:
    """One line for a traced program the ONNX translation refuses: the node it stopped at (the
    translation's own first line names it) and the innermost reason (an ExportError of this
    package's translations passes through as it is)."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    if isinstance(root, ExportError):
        return root
    first = (str(exc).strip().splitlines() or [""])[0]
    reason = (str(root).strip().splitlines() or [""])[0]
    return ExportError(f"the ONNX translation failed: {first[:300]}" + (f" ({type(root).__name__}: {reason[:300]})"
                                                                      if root is not exc else ""))


@functools.cache
def torchlib_base() -> Any:
    """torchlib's translation registry, built once per process: building it reads the signature
    of every torchlib function (about a second). The exporter's parent process builds it
    before forking its rank workers, so they inherit it."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_index
    from torch.onnx._internal.exporter import _registration

    registry = _registration.ONNXRegistry.from_torchlib()
    # A complex tensor is real pairs (a last axis of 2): indexing its leading axes is the same
    # op on them (torchtitan's complex RoPE cache at the given positions), which torchlib lacks.
    registry.register_op(torch.ops.aten.index.Tensor, aten_index, is_complex=True)
    for op, fn in complex_ops.translations():  # the views of complex RoPE frequencies (DeepSeek-V2, Llama 4)
        registry.register_op(op, fn, is_complex=True)
    # MoE dispatch's stable sort and grouped GEMM as the static ops of equal values they are
    # (capture/dispatch_ops.py).
    registry.register_op(torch.ops.aten.sort.stable, dispatch_ops.sort_stable, is_complex=False)
    registry.register_op(torch.ops.aten._grouped_mm.default, dispatch_ops.grouped_mm, is_complex=False)
    return registry


def _transformers_ops() -> tuple[tuple[Any, Callable[..., Any]], ...]:
    """HF's custom experts ops with their translations, those that exist in this process: they are
    registered when transformers is imported, which may come after the base registry was built
    (a torchtitan export first, in the same process)."""
    found = []
    for name, fn in (("grouped_mm_fallback", dispatch_ops.hf_grouped_mm),
                     ("grouped_mm_fallback_backward", dispatch_ops.hf_grouped_mm_backward)):
        op = getattr(getattr(torch.ops, "transformers", None), name, None)
        if op is not None:
            found.append((op.default, fn))
    return tuple(found)


def torchlib_registry(table: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...]) -> Any:
    """torchlib's registry plus `table` and HF's experts ops where transformers is loaded."""
    return _registry(table + _transformers_ops())


@functools.lru_cache(maxsize=8)
def _registry(table: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...]) -> Any:
    """torchlib's registry plus `table`, per process and table: a copy of `torchlib_base()`'s
    function lists (the registry keeps nothing else) with the table's entries registered."""
    from torch.onnx._internal.exporter import _registration

    base = torchlib_base()
    registry = _registration.ONNXRegistry()
    registry._opset_version = base.opset_version
    registry.functions = {target: list(entries) for target, entries in base.functions.items()}
    for op, fn in table:
        registry.register_op(op, fn, is_complex=False)
    return registry


def meta_weights_to_inputs(program: Any) -> None:
    """Initializers holding meta tensors (no data) become graph inputs of the same type, so
    that the model serializes: a `--meta` export declares its weights without their values."""
    graph = program.model.graph
    for name, value in list(graph.initializers.items()):
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.device.type == "meta":
            graph.initializers.pop(name)
            value.const_value = None
            graph.inputs.append(value)


def set_metadata(model: onnx.ModelProto, **values: object) -> None:
    """Set (replace) model-level metadata_props."""
    keep = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for key, value in values.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, str(value)


def cropping_pad(self: torch.Tensor, pad: Sequence[int], value: float = 0) -> Any:
    """`aten.constant_pad_nd` with negative amounts (a pad's backward: `F.pad(x, (k - 1, 0))` in a
    causal convolution differentiates into the pad by `(1 - k, 0)`) as the slice that crops, then
    the pad by what is left: ONNX's Pad allows negative pads, but refine's simulator and ONNX's
    reference runtime (numpy's pad) do not. A pad without negative amounts is left as it is."""
    if all(p >= 0 for p in pad):
        return NotImplemented
    out = self
    for i in range(len(pad) // 2):
        dim, before, after = self.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        if before < 0 or after < 0:
            size = out.shape[dim]
            out = torch.ops.aten.slice.Tensor(out, dim, max(0, -before), size - max(0, -after))
    kept = [max(0, p) for p in pad]
    return torch.ops.aten.constant_pad_nd.default(out, kept, value) if any(kept) else out

