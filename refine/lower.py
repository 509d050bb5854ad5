"""Lowering: a model directory (seq.onnx, rank*.onnx, refine.json) -> facts (refine/facts.py).

Linear in graph size: one pass over nodes per graph, plus ONNX shape inference. Weight bytes
are never read: declared inputs and large initializers stay opaque. Static tensors (small
undeclared initializers, Constant outputs, and what is computed from them and from static
shapes: masks, position ids, reshape targets; see refine/fold.py) are evaluated and hashed,
so equal values on both sides can be recognised; integer ones with at most SMALL_INTS
elements are spelled out (reshape shapes, slice bounds, axes).

Some per-node facts are normalized here rather than in the rules because they need ONNX
knowledge the rules should not repeat: negative axes, Slice/Split bounds, Reduce axes.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from refine import canonical, cse, dist, fold, layers
from refine.config import (
    SEQ_NAME,
    ModelConfig,
    PartialLayout,
    RepLayout,
    ShardLayout,
    load_config,
    rank_file_name,
    shard_bounds,
)
from refine.errors import InputError
from refine.facts import FactSet

SMALL_CONST = 4096
SMALL_INTS = 64
SEQ = "seq"

# Attributes whose values legitimately differ between the sequential and a rank program
# (they restate shapes): they are left out of the pairing signature and read by lemmas.
SHAPE_ATTRS = {"Split": {"split"}}
AXIS_ATTRS = {"axis", "axes", "split_axis", "concat_axis"}  # normalized to >= 0
REDUCE_OPS = {
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
}


def rank_graph_id(rank: int) -> str:
    return f"r{rank}"


@dataclass
class LoadedModels:
    """The parsed model directory."""

    config: ModelConfig
    seq: onnx.ModelProto
    ranks: list[onnx.ModelProto]
    paths: dict[str, Path]  # graph id -> file


# --- loading and validation ----------------------------------------------------------------


def load_model_file(path: Path) -> onnx.ModelProto:
    """Load one ONNX file (no external weight data), checked; problems are InputErrors."""
    if not path.exists():
        raise InputError(path, "missing")
    if not path.is_file():
        raise InputError(path, "not a file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise InputError(path, f"not a readable ONNX model ({type(exc).__name__})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise InputError(path, "not a readable ONNX model (no graph)")
    for node in _all_nodes(model):
        if node.domain == dist.DIST_DOMAIN and node.op_type not in dist.KNOWN_OPS:
            raise InputError(
                path, f"unknown collective dist.{node.op_type} in node {node.name!r} "
                f"(known: {', '.join(dist.KNOWN_OPS)})"
            )
    _topological_order(model.graph, path)  # a cycle gets its own message, before the checker's
    dist.register_schemas()
    try:
        onnx.checker.check_model(model, full_check=False)
    except (onnx.checker.ValidationError, ValueError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else "invalid"
        if "topologically sorted" in text:
            first = "nodes are not in topological order"
        raise InputError(path, f"invalid ONNX model: {first}") from None
    return model


def _all_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The main graph's nodes and those of every local function."""
    return list(model.graph.node) + [n for fn in model.functions for n in fn.node]


def load_model_dir(model_dir: Path, inline: bool = True) -> LoadedModels:
    """Load and cross-check a model directory: config, sequential model, every rank.

    Layers stored as local functions (docs/layers.md) are inlined unless `inline` is False
    (the memoized lowering, refine/memo.py, keeps the calls).

    Whatever can be checked per file is checked here, so that the error names that file:
    the file set against refine.json's world_size, `world_size`/`rank` metadata, and every
    collective's attributes (a known reduce_op; a group of distinct ranks in 0..world_size-1
    that contains the calling rank; no collectives in seq.onnx).
    """
    if not model_dir.exists():
        raise InputError(model_dir, "no such model directory")
    if not model_dir.is_dir():
        raise InputError(model_dir, "not a model directory (expected seq.onnx, rank*.onnx, refine.json)")
    config = load_config(model_dir)
    n = config.world_size
    seq_path = model_dir / SEQ_NAME
    if not seq_path.exists():
        raise InputError(seq_path, "missing (a model directory needs seq.onnx)")
    for r in range(n):  # stops at the first missing file, so a huge world_size fails fast
        path = model_dir / rank_file_name(r)
        if not path.exists():
            raise InputError(path, f"missing (refine.json says world_size {n}: rank0.onnx .. rank{n - 1}.onnx)")
    extra = model_dir / rank_file_name(n)
    if extra.exists():
        raise InputError(extra, f"present, but refine.json says world_size {n}")
    paths = {SEQ: seq_path}
    paths.update({rank_graph_id(r): model_dir / rank_file_name(r) for r in range(n)})
    models: dict[str, onnx.ModelProto] = {}
    for g, path in paths.items():
        model = load_model_file(path)
        rank = None if g == SEQ else int(g[1:])
        meta = {p.key: p.value for p in model.metadata_props}
        if "world_size" in meta and meta["world_size"].strip() != str(n):
            raise InputError(path, f"metadata says world_size {meta['world_size']!r}, refine.json says {n}")
        if "rank" in meta and rank is not None and meta["rank"].strip() != str(rank):
            raise InputError(path, f"metadata says rank {meta['rank']!r}, file name says rank {rank}")
        for node in _all_nodes(model):
            if node.domain != dist.DIST_DOMAIN:
                continue
            what = f"collective {node.name or node.op_type!r}"
            if rank is None:
                raise InputError(path, f"{what}: the sequential model must not contain collectives")
            attrs = dist.node_attrs(node)
            if attrs.get("reduce_op", "sum") not in dist.REDUCE_OPS:
                raise InputError(
                    path, f"{what}: unknown reduce_op {attrs['reduce_op']!r} (known: {', '.join(dist.REDUCE_OPS)})"
                )
            group = attrs.get("group")
            if not isinstance(group, list) or not group:
                raise InputError(path, f"{what} has no group")
            if len(set(group)) != len(group):
                raise InputError(path, f"{what}: group {group} names a rank twice")
            outside = [m for m in group if not 0 <= m < n]
            if outside:
                raise InputError(path, f"{what}: group {group} names rank {outside[0]}, outside 0..{n - 1} (world_size {n})")
            if rank not in group:
                raise InputError(path, f"{what}: rank {rank} calls it but is not in its group {group}")
        models[g] = layers.inline_calls(model, path) if inline else model
    return LoadedModels(config, models[SEQ], [models[rank_graph_id(r)] for r in range(n)], paths)


def infer_shapes(model: onnx.ModelProto, path: Path, world_size: int) -> onnx.ModelProto:
    """Strict ONNX shape inference, with the output shapes of `dist` collectives filled in.

    Only graph inputs and initializers are taken as given. Every type the model merely
    declares (value_info, graph output types) is removed first, so that no lemma reads a shape
    that only an annotation asserts; a declared shape that disagrees with the inferred one, and
    a node whose operand types or shapes its op cannot take, are bad input (InputError).

    ONNX cannot infer through our custom ops, so inference runs on a proxy copy in which each
    collective is replaced by standard ops with the same shape rule (Identity, Concat, Split),
    and the inferred types are copied back: one pass, whatever the number of collectives.
    Where a proxy is not available (Split by count needs opset 18), the collectives' output
    types are filled in pass by pass instead.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    declared = take_declared_types(model.graph)
    inferred = _infer_undeclared(model, path)
    check_declared_types(declared, value_types(inferred.graph), path)
    return inferred


def take_declared_types(graph: onnx.GraphProto) -> list[tuple[str, onnx.TypeProto]]:
    """Remove the types `graph` declares of computed values (value_info, graph outputs) and
    return them, to be checked against inference (`check_declared_types`)."""
    declared = [(vi.name, vi.type) for vi in graph.value_info]
    for vi in graph.output:
        declared.append((vi.name, onnx.TypeProto.FromString(vi.type.SerializeToString())))
        vi.ClearField("type")
    del graph.value_info[:]
    return [(name, tp) for name, tp in declared if tp.WhichOneof("value") is not None]


def check_declared_types(declared: list[tuple[str, onnx.TypeProto]], inferred: dict[str, onnx.TypeProto],
                         path: Path) -> None:
    """A declared type that contradicts the inferred one is bad input. Where inference knows
    less (no type, no shape, a symbolic dimension), the declaration is ignored, never adopted."""
    for name, tp in declared:
        got = inferred.get(name)
        if got is None or not tp.HasField("tensor_type") or not got.HasField("tensor_type"):
            continue
        want_elem, got_elem = tp.tensor_type.elem_type, got.tensor_type.elem_type
        if want_elem and got_elem and want_elem != got_elem:
            raise InputError(path, f"tensor {name!r} is declared {onnx.TensorProto.DataType.Name(want_elem)} "
                             f"but its node computes {onnx.TensorProto.DataType.Name(got_elem)}")
        if not tp.tensor_type.HasField("shape") or not got.tensor_type.HasField("shape"):
            continue
        want, have = _dims_text(tp), _dims_text(got)
        if len(want) != len(have) or any(a != b for a, b in zip(want, have) if isinstance(a, int) and isinstance(b, int)):
            raise InputError(path, f"tensor {name!r} is declared with shape {_shape_words(want)} but its node "
                             f"computes {_shape_words(have)} (a stale shape annotation?)")


def _dims_text(tp: onnx.TypeProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tp.tensor_type.shape.dim]


def _shape_words(dims: list[int | str]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def _infer_undeclared(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """`infer_shapes` on a model whose declared types are already taken out."""
    proxy = _shape_proxy(model)
    if proxy is not None:
        inferred = _with_folded_constants(_run_inference(proxy, path), path)
        del model.graph.value_info[:]
        model.graph.value_info.extend(inferred.graph.value_info)
        known = value_types(inferred.graph)
        for vi in model.graph.output:
            if vi.name in known:
                vi.type.CopyFrom(known[vi.name])
        _check_collective_shapes(model, path)
        return model
    done: set[str] = set()
    while True:
        model = _run_inference(model, path)
        types = value_types(model.graph)
        progressed = False
        for node in model.graph.node:
            if node.domain != dist.DIST_DOMAIN or node.output[0] in done:
                continue
            src = types.get(node.input[0])
            shape = _static_shape(src) if src is not None else None
            if shape is None:
                continue
            attrs = dist.node_attrs(node)
            try:
                out_shape = dist.output_shape(node.op_type, attrs, shape, len(attrs.get("group", [])))
            except ValueError as exc:
                raise InputError(path, f"collective {node.name!r}: {exc}") from None
            elem = src.tensor_type.elem_type
            model.graph.value_info.append(helper.make_tensor_value_info(node.output[0], elem, out_shape))
            done.add(node.output[0])
            progressed = True
        if not progressed:
            return model


def _with_folded_constants(inferred: onnx.ModelProto, path: Path, rounds: int = 3) -> onnx.ModelProto:
    """Re-run inference with static values folded in, where some value is still unshaped.

    ONNX propagates constant values only through a few shape ops, so a shape or axes input
    computed from Constant nodes (Reshape of a Constant: what a layer function holds where
    the flat export had an initializer) leaves the consumer's output unshaped. refine's own
    folding (refine/fold.py) evaluates such static subgraphs; their values become
    initializers of a proxy copy, which inference then reads."""
    for _ in range(rounds):
        types = value_types(inferred.graph)
        unshaped = [o for n in inferred.graph.node for o in n.output
                    if o and (o not in types or _static_shape(types[o]) is None)]
        if not unshaped:
            return inferred

        def shape_of(name: str) -> list[int] | None:
            return _static_shape(types[name]) if name in types else None

        statics = fold.static_values(inferred.graph, list(inferred.opset_import), shape_of, set(), SMALL_CONST)
        produced = {o for n in inferred.graph.node for o in n.output if o in statics}
        if not produced:
            return inferred
        proxy = onnx.ModelProto()
        proxy.CopyFrom(inferred)
        keep = [n for n in inferred.graph.node if not (n.output and all(not o or o in statics for o in n.output))]
        del proxy.graph.node[:]
        proxy.graph.node.extend(keep)
        needed = {i for n in keep for i in n.input} | {vi.name for vi in inferred.graph.output}
        proxy.graph.initializer.extend(numpy_helper.from_array(np.asarray(statics[name]), name)
                                       for name in sorted(produced & needed))
        again = _run_inference(proxy, path)
        if sum(1 for vi in again.graph.value_info if _static_shape(vi.type) is not None) <= \
                sum(1 for vi in inferred.graph.value_info if _static_shape(vi.type) is not None) - len(produced):
            return inferred
        merged = onnx.ModelProto()
        merged.CopyFrom(inferred)
        del merged.graph.value_info[:]
        known = value_types(again.graph)
        for vi in inferred.graph.value_info:
            tp = known.get(vi.name, vi.type)
            merged.graph.value_info.append(helper.make_value_info(vi.name, tp))
        have = {vi.name for vi in merged.graph.value_info} | {vi.name for vi in merged.graph.input} \
            | {vi.name for vi in merged.graph.output} | {i.name for i in merged.graph.initializer}
        for name, tp in known.items():
            if name not in have:
                merged.graph.value_info.append(helper.make_value_info(name, tp))
        inferred = merged
    return inferred


def _check_collective_shapes(model: onnx.ModelProto, path: Path) -> None:
    """A collective whose input shape its op cannot take (a chunk count that does not divide)."""
    types = value_types(model.graph)
    for node in model.graph.node:
        if node.domain != dist.DIST_DOMAIN or node.input[0] not in types:
            continue
        shape = _static_shape(types[node.input[0]])
        if shape is None:
            continue
        attrs = dist.node_attrs(node)
        try:
            dist.output_shape(node.op_type, attrs, shape, len(attrs.get("group", [])))
        except ValueError as exc:
            raise InputError(path, f"collective {node.name!r}: {exc}") from None


_INFERENCE_ERROR = re.compile(r"\(op_type:([\w.]+)(?:, node name: ([^)]*))?\): (?:\[\w+\] )?(.*)")
_UNTYPED = "expected to have type but instead is null"


_INFERENCE_FAILED = (onnx.shape_inference.InferenceError, RuntimeError)


def _run_inference(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """Strict inference: an op that cannot take its operands' types or shapes is bad input.

    Two kinds of complaint of ONNX's strict mode are not the model's fault, and then the model
    is inferred again less strictly (nothing it declares is adopted either way):
    - a value with no type at all (the output of an op ONNX cannot infer, e.g. of an unknown
      domain, and what follows from it): unknown, not wrong;
    - an error of data propagation alone (it evaluates small integer tensors as shapes, and
      fails on an arange multiplied by a vector, say): an error counts only if strict inference
      without data propagation reports it too."""
    for check_type in (True, False):
        try:
            return onnx.shape_inference.infer_shapes(model, check_type=check_type, strict_mode=True, data_prop=True)
        except _INFERENCE_FAILED as exc:
            if _model_errors(exc):
                _raise_if_ill_typed(model, path)
                break
    return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)


def _raise_if_ill_typed(model: onnx.ModelProto, path: Path) -> None:
    """Strict inference without data propagation: its errors are the model's own."""
    for check_type in (True, False):
        try:
            onnx.shape_inference.infer_shapes(model, check_type=check_type, strict_mode=True, data_prop=False)
            return
        except _INFERENCE_FAILED as exc:
            errors = _model_errors(exc)
            if errors:
                raise InputError(path, _inference_error(errors[0])) from None


def _model_errors(exc: Exception) -> list[str]:
    """The errors of a strict inference failure, less those about values with no type."""
    return [line.strip() for line in str(exc).splitlines() if line.strip() and _UNTYPED not in line]


def _inference_error(line: str) -> str:
    """One ONNX inference error, as `ill-typed: node 'NAME' (OP): why`."""
    found = _INFERENCE_ERROR.search(line)
    if found is None:
        return f"shape inference failed: {line}"
    op, node, why = found.groups()
    where = f"node {node!r} ({op})" if node else f"a {op} node"
    return f"ill-typed: {where}: {why.strip()}"


def _shape_proxy(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of `model` whose collectives are standard ops with the same output shape."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graph = model.graph
    if not any(n.domain == dist.DIST_DOMAIN for n in graph.node):
        return model
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain != dist.DIST_DOMAIN:
            nodes.append(node)
            continue
        attrs = dist.node_attrs(node)
        n = len(attrs.get("group", [])) or 1
        x, y = node.input[0], node.output[0]
        if node.op_type == "AllReduce":
            nodes.append(helper.make_node("Identity", [x], [y]))
        elif node.op_type == "AllGather":
            nodes.append(helper.make_node("Concat", [x] * n, [y], axis=attrs["axis"]))
        elif opset < 18:
            return None
        elif node.op_type == "ReduceScatter":
            parts = [y] + [f"{y}__proxy{i}" for i in range(1, n)]
            nodes.append(helper.make_node("Split", [x], parts, axis=attrs["axis"], num_outputs=n))
        else:  # AllToAll: split, then concatenate n chunks
            chunk = f"{y}__proxy_chunk"
            parts = [chunk] + [f"{y}__proxy{i}" for i in range(1, n)]
            nodes.append(helper.make_node("Split", [x], parts, axis=attrs["split_axis"], num_outputs=n))
            nodes.append(helper.make_node("Concat", [chunk] * n, [y], axis=attrs["concat_axis"]))
    proxy = onnx.ModelProto()
    proxy.CopyFrom(model)
    del proxy.graph.node[:]
    proxy.graph.node.extend(nodes)
    return proxy


def value_types(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    """Every typed value of the graph (an untyped output does not hide its inferred type)."""
    types = {vi.name: vi.type for vi in list(graph.input) + list(graph.value_info) + list(graph.output)
             if vi.type.WhichOneof("value") is not None}
    for init in graph.initializer:
        if init.name not in types:
            types[init.name] = _tensor_type(init.data_type, tuple(init.dims))
    return types


@functools.lru_cache(maxsize=4096)
def _tensor_type(elem_type: int, dims: tuple[int, ...]) -> onnx.TypeProto:
    """One shared (read-only) TypeProto per element type and shape: a deep model's layers
    repeat a handful of weight shapes, typed again at every shape-inference pass."""
    return helper.make_tensor_type_proto(elem_type, list(dims))


def _static_shape(tp: onnx.TypeProto) -> list[int] | None:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims = tp.tensor_type.shape.dim
    if any(not d.HasField("dim_value") for d in dims):
        return None
    return [d.dim_value for d in dims]


def _topological_order(graph: onnx.GraphProto, path: Path) -> list[onnx.NodeProto]:
    """Nodes in a topological order (Kahn); a cycle, or a tensor assigned twice, is bad input."""
    sources = {vi.name for vi in graph.input} | {init.name for init in graph.initializer}
    produced_by: dict[str, int] = {}
    for i, n in enumerate(graph.node):
        for out in n.output:
            if not out:
                continue
            if out in produced_by:
                first = graph.node[produced_by[out]]
                raise InputError(path, f"tensor {out!r} is the output of two nodes "
                                 f"({first.name or first.op_type!r} and {n.name or n.op_type!r})")
            if out in sources:
                raise InputError(path, f"tensor {out!r} is a graph input or initializer and "
                                 f"also the output of node {n.name or n.op_type!r}")
            produced_by[out] = i
    deps = [{produced_by[t] for t in n.input if t in produced_by} for n in graph.node]
    users: list[list[int]] = [[] for _ in graph.node]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    pending = [len(ds) for ds in deps]
    ready = [i for i, p in enumerate(pending) if p == 0]
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    if len(order) != len(graph.node):
        stuck = next(n for i, n in enumerate(graph.node) if pending[i] > 0)
        raise InputError(path, f"the graph has a cycle through node {stuck.name or stuck.op_type!r}")
    order.sort()  # keep the file's order where it is already topological (it must be, by ONNX)
    return [graph.node[i] for i in order]


# --- per-graph lowering --------------------------------------------------------------------


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _location(node: onnx.NodeProto) -> tuple[str, str, int] | None:
    """(module path, file, line) from the exporter's node metadata, if any.

    The torch exporter writes `pkg.torch.onnx.name_scopes` (module paths, outermost first, the
    op last) and a stack trace; the line worth showing is the innermost frame outside torch
    itself (the model's code, e.g. transformers' modeling file, or the user's own).
    """
    meta = {p.key: p.value for p in node.metadata_props}
    module = meta.get("namespace", "")
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            parts = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            parts = []
        module = parts[-2] if isinstance(parts, list) and len(parts) >= 2 else ""
    frames = _FRAME.findall(meta.get("pkg.torch.onnx.stack_trace", ""))
    outside_torch = [f for f in frames if "/torch/" not in f[0].replace("\\", "/")]
    file, line = (outside_torch or frames or [("", "0")])[-1]
    if not module and not file:
        return None
    return module, file, int(line)


def _numel(dims: object) -> int:
    return int(np.prod(list(dims), dtype=np.int64))  # type: ignore[call-overload]


def _exact_fraction(x: float | int, dtype: np.dtype) -> Fraction | None:
    """The simple rational a scalar constant stands for (0.125 -> 1/8, 1/3 in float32 -> 1/3)."""
    if isinstance(x, (int, np.integer)):
        return Fraction(int(x))
    if not np.isfinite(x):
        return None
    frac = Fraction(float(x)).limit_denominator(1 << 20)
    return frac if np.asarray(float(frac), dtype=dtype) == np.asarray(x, dtype=dtype) else None


class GraphLowering:
    """Lowers one graph (sequential or one rank) into facts."""

    def __init__(
        self, g: str, model: onnx.ModelProto, path: Path, declared: set[str], facts: FactSet,
        groups: set[tuple[int, ...]],
    ) -> None:
        types = value_types(model.graph)
        canonical_model = canonical.canonicalize(model, types)  # Gemm -> MatMul/Add (refine/canonical.py)
        if canonical_model is not model:  # (its new intermediates are typed in its value_info)
            model, types = canonical_model, value_types(canonical_model.graph)
        model = cse.merge_duplicates(model)  # each repeated computation once (refine/cse.py); renames inputs only
        self.g, self.model, self.path, self.facts = g, model, path, facts
        self.groups = groups  # collective groups seen in any rank program (shared)
        self.calls: dict[str, int] = {}  # group id -> calls on it so far in this graph
        self.opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
        self.versions: dict[tuple[str, str], int] = {}
        self.producers = {out: node for node in model.graph.node for out in node.output if out}
        self.chunks: dict[str, tuple[int, int, int]] = {}  # SequenceAt output -> (axis, start, end)
        self.graph = model.graph
        self.declared = declared
        self.types = types
        self.shapes: dict[str, list[int] | None] = {}
        self.ints: dict[str, list[int]] = {}
        self.node_ids: list[str] = []  # node id of graph.node[i] (file order is topological)

    def tid(self, name: str) -> str:
        return f"{self.g}:{name}"

    def shape(self, name: str) -> list[int] | None:
        if name not in self.shapes:
            tp = self.types.get(name)
            self.shapes[name] = _static_shape(tp) if tp is not None else None
        return self.shapes[name]

    def rank_of(self, name: str) -> int | None:
        tp = self.types.get(name)
        if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
            return None
        return len(tp.tensor_type.shape.dim)

    def lower(self) -> None:
        add, g = self.facts.add, self.g
        for t in self.types:
            self._tensor(t)
        for init in self.graph.initializer:
            if init.name in self.declared:
                add("graph_input", g, self.tid(init.name), init.name)
        statics = fold.static_values(self.graph, list(self.model.opset_import), self.shape, self.declared, SMALL_CONST)
        for name, value in statics.items():
            self._constant(name, value)
        for vi in self.graph.input:
            add("graph_input", g, self.tid(vi.name), vi.name)
        for vi in self.graph.output:
            add("graph_output", g, self.tid(vi.name), vi.name)
        names: dict[str, int] = {}
        for node in self.graph.node:
            names[node.name] = names.get(node.name, 0) + 1
        for index, node in enumerate(_topological_order(self.graph, self.path)):
            label = node.name if node.name and names[node.name] == 1 else f"{node.name or node.op_type}#{index}"
            if not canonical.inserted(node):  # node_ids follow the input graph's positions
                self.node_ids.append(f"{g}:{label}")
            if not cse.merged(node):
                self._node(f"{g}:{label}", index, node)

    def _tensor(self, name: str) -> None:
        tp = self.types[name]
        if not tp.HasField("tensor_type"):
            return
        t = self.tid(name)
        elem = onnx.helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type) if tp.tensor_type.elem_type else None
        if elem is not None:
            self.facts.add("dtype", self.g, t, "float" if elem == np.float32 else str(elem))
        if tp.tensor_type.HasField("shape"):
            dims = tp.tensor_type.shape.dim
            self.facts.add("ndim", self.g, t, len(dims))
            for axis, d in enumerate(dims):
                if d.HasField("dim_value"):
                    self.facts.add("dim", self.g, t, axis, d.dim_value)

    def _constant(self, name: str, value: np.ndarray) -> None:
        t = self.tid(name)
        digest = hashlib.sha1(f"{value.dtype}|{value.shape}|".encode() + np.ascontiguousarray(value).tobytes())
        self.facts.add("const", self.g, t, digest.hexdigest()[:16])
        if value.dtype.kind in "iu" and value.size <= SMALL_INTS:
            flat = [int(v) for v in value.reshape(-1)]
            self.ints[name] = flat
            for i, v in enumerate(flat):
                self.facts.add("const_int", self.g, t, i, v)
        if value.size == 1 and value.dtype.kind in "iuf":
            frac = _exact_fraction(value.reshape(-1)[0].item(), value.dtype)
            if frac is not None:
                self.facts.add("const_num", self.g, t, frac.numerator, frac.denominator)

    def _node(self, n: str, index: int, node: onnx.NodeProto) -> None:
        add, g = self.facts.add, self.g
        chunk = self._sequence_chunk(node)
        if chunk is not None:  # SequenceAt(SplitToSequence(x), k): lowered as the Slice it is
            node = chunk
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        add("node", g, n, op)
        add("topo", g, n, index)
        add("arity", g, n, len(node.input))
        for i, t in enumerate(node.input):
            if t:
                add("node_in", g, n, i, self.tid(t))
        for i, t in enumerate(node.output):
            if t:
                add("node_out", g, n, i, self.tid(t))
        loc = _location(node)
        if loc:
            add("loc", g, n, *loc)
        sig = self._attributes(n, node, op)
        version = self._since_version(node)
        add("since", g, n, version)
        add("sig", g, n, f"{op}@{version}/{len(node.input)}/{len(node.output)}|{sig}")
        if chunk is not None:
            self.facts.add("slice_spec", g, n, 0, *self.chunks[node.output[0]])
        elif node.op_type == "Slice":
            self._slice(n, node)
        elif node.op_type == "Split":
            self._split(n, node)
        elif node.op_type in REDUCE_OPS:
            self._reduce(n, node)
        elif node.domain == dist.DIST_DOMAIN:
            self._collective(n, node)

    def _sequence_chunk(self, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """`SequenceAt(SplitToSequence(x, sizes, axis), k)` with constant sizes and k is
        x[start:end] along axis (how sequence-parallel code takes its chunk): return an
        equivalent Slice node (same name, metadata, output) and remember its bounds."""
        if node.op_type != "SequenceAt" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            return None
        split = self.producers.get(node.input[0])
        if split is None or split.op_type != "SplitToSequence" or len(split.input) < 2:
            return None
        shape, sizes, index = self.shape(split.input[0]), self._const_ints(split.input[1]), self._const_ints(node.input[1])
        if shape is None or sizes is None or index is None or len(index) != 1:
            return None
        axis = next((helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0) % len(shape)
        size = shape[axis]
        if len(sizes) == 1:  # a chunk size: equal chunks, the last one shorter
            sizes = [min(sizes[0], size - i) for i in range(0, size, sizes[0])] if sizes[0] > 0 else []
        if sum(sizes) != size or not -len(sizes) <= index[0] < len(sizes):
            return None
        k = index[0] % len(sizes)
        start = sum(sizes[:k])
        self.chunks[node.output[0]] = (axis, start, start + sizes[k])
        chunk = onnx.NodeProto()
        chunk.CopyFrom(node)
        chunk.op_type = "Slice"
        del chunk.input[:]
        chunk.input.append(split.input[0])
        return chunk

    def _since_version(self, node: onnx.NodeProto) -> int:
        """Which version of the op's semantics this node has (two nodes with the same op and
        since_version mean the same thing, whatever opset their models import)."""
        domain = "" if node.domain == "ai.onnx" else node.domain
        key = (node.op_type, domain)
        if key not in self.versions:
            opset = self.opsets.get(domain, 0)
            try:
                self.versions[key] = onnx.defs.get_schema(node.op_type, opset, domain).since_version
            except onnx.defs.SchemaError:
                self.versions[key] = 0
        return self.versions[key]

    def _attributes(self, n: str, node: onnx.NodeProto, op: str) -> str:
        """Emit attribute facts; return the canonical signature of the pairing attributes."""
        add, g = self.facts.add, self.g
        parts = []
        in_rank = self.rank_of(node.input[0]) if node.input and node.input[0] else None
        out_rank = self.rank_of(node.output[0]) if node.output else None
        for attr in sorted(node.attribute, key=lambda a: a.name):
            value = helper.get_attribute_value(attr)
            ref_rank = out_rank if node.op_type == "Unsqueeze" else in_rank
            if attr.name in AXIS_ATTRS and ref_rank is not None:
                value = [v % ref_rank if -ref_rank <= v < 0 else v for v in value] if isinstance(value, list) \
                    else (value % ref_rank if -ref_rank <= value < 0 else value)
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
                add("attr_str", g, n, attr.name, value)
            elif isinstance(value, bool) or isinstance(value, int):
                add("attr_int", g, n, attr.name, int(value))
            elif isinstance(value, float):
                add("attr_float", g, n, attr.name, repr(value))
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                for i, v in enumerate(value):
                    add("attr_ints", g, n, attr.name, i, v)
            elif isinstance(value, onnx.TensorProto):
                arr = numpy_helper.to_array(value) if _numel(value.dims) <= SMALL_CONST else None
                value = hashlib.sha1(arr.tobytes()).hexdigest()[:16] if arr is not None else f"<tensor:{n}>"
            elif isinstance(value, onnx.GraphProto) or (isinstance(value, list) and value and not isinstance(value[0], (int, float, bytes))):
                value = f"<graph:{n}>"  # subgraphs are not lowered: never pair such nodes
            if attr.name not in SHAPE_ATTRS.get(node.op_type, ()):
                parts.append(f"{attr.name}={value}")
        return ";".join(parts)

    def _const_ints(self, name: str) -> list[int] | None:
        return self.ints.get(name) if name else None

    def _slice(self, n: str, node: onnx.NodeProto) -> None:
        shape = self.shape(node.input[0])
        if len(node.input) < 3:  # Slice-1 (before opset 10): starts, ends and axes are attributes
            attrs = {a.name: list(helper.get_attribute_value(a)) for a in node.attribute}
            starts, ends, axes, steps = attrs.get("starts"), attrs.get("ends"), attrs.get("axes"), None
        else:
            starts, ends = self._const_ints(node.input[1]), self._const_ints(node.input[2])
            axes = self._const_ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            steps = self._const_ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if shape is None or starts is None or ends is None:
            return
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
        if (axes is None or steps is None) or not (len(starts) == len(ends) == len(axes) == len(steps)):
            return
        cut = []
        for start, end, axis, step in zip(starts, ends, axes, steps):
            axis = axis + len(shape) if axis < 0 else axis
            if step != 1 or not 0 <= axis < len(shape):
                return
            size = shape[axis]
            start = min(max(start + size if start < 0 else start, 0), size)
            end = min(max(end + size if end < 0 else end, 0), size)
            if (start, end) != (0, size):
                cut.append((axis, start, max(end, start)))
        if len(cut) == 1:
            self.facts.add("slice_spec", self.g, n, 0, *cut[0])
        elif not cut:
            self.facts.add("slice_spec", self.g, n, 0, 0, 0, shape[0] if shape else 0)

    def _split(self, n: str, node: onnx.NodeProto) -> None:
        shape = self.shape(node.input[0])
        if shape is None:
            return
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis = attrs.get("axis", 0)
        axis = axis + len(shape) if axis < 0 else axis
        size = shape[axis]
        sizes = self._const_ints(node.input[1]) if len(node.input) > 1 and node.input[1] else attrs.get("split")
        if sizes is None:
            parts = attrs.get("num_outputs", len(node.output))
            chunk = -(-size // parts)
            sizes = [min(chunk, max(size - i * chunk, 0)) for i in range(parts)]
        if len(sizes) != len(node.output) or sum(sizes) != size:
            return
        start = 0
        for i, s in enumerate(sizes):
            self.facts.add("slice_spec", self.g, n, i, axis, start, start + s)
            start += s

    def _reduce(self, n: str, node: onnx.NodeProto) -> None:
        rank = self.rank_of(node.input[0])
        if rank is None:
            return
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axes = attrs.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = self._const_ints(node.input[1])
            if axes is None:
                return  # axes computed at run time: no reduce facts, no lemma applies
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return
            axes = list(range(rank))
        for a in sorted({a % rank for a in axes}):
            self.facts.add("reduce_axis", self.g, n, a)
        self.facts.add("keepdims", self.g, n, int(attrs.get("keepdims", 1)))

    def _collective(self, n: str, node: onnx.NodeProto) -> None:
        attrs = dist.node_attrs(node)
        group = list(attrs.get("group", []))
        meta_rank = int(self.g[1:])
        if not group:
            raise InputError(self.path, f"collective {node.name!r} has no group")
        if meta_rank not in group:
            raise InputError(self.path, f"collective {node.name!r}: rank {meta_rank} calls it but is not in its group {group}")
        gid = ",".join(map(str, group))
        seq = self.calls.get(gid, 0)
        self.calls[gid] = seq + 1
        self.facts.add("coll", self.g, n, node.op_type, gid, seq)
        self.groups.add(tuple(group))


def lower_models(models: LoadedModels) -> FactSet:
    """Lower a loaded model directory into one fact set (all graphs + declared relations)."""
    config, facts = models.config, FactSet()
    graphs = [(SEQ, models.seq)] + [(rank_graph_id(r), m) for r, m in enumerate(models.ranks)]
    inferred = [(g, infer_shapes(m, models.paths[g], config.world_size), models.paths[g]) for g, m in graphs]
    lowered = lower_graphs(inferred, config.world_size, set(config.inputs), facts, models.paths[SEQ].parent)
    _declared_relations(config, lowered, models, facts)
    return facts


def lower_graphs(graphs: list[tuple[str, onnx.ModelProto, Path]], world_size: int, declared: set[str],
                 facts: FactSet, where: Path) -> dict[str, GraphLowering]:
    """Lower shape-inferred graphs (the sequential one and one per rank) into `facts`, with
    the world size and the collective groups they use. `where` names the model directory."""
    facts.add("world_size", world_size)
    groups: set[tuple[int, ...]] = set()
    lowered: dict[str, GraphLowering] = {}
    for g, model, path in graphs:
        facts.add("graph", g, "seq" if g == SEQ else "rank", -1 if g == SEQ else int(g[1:]))
        low = GraphLowering(g, model, path, declared, facts, groups)
        low.lower()
        lowered[g] = low
    for group in sorted(groups):
        gid = ",".join(map(str, group))
        if len(set(group)) != len(group) or any(not 0 <= r < world_size for r in group):
            raise InputError(where, f"collective group [{gid}] names ranks outside 0..{world_size - 1} or twice")
        facts.add("group_size", gid, len(group))
        for index, rank in enumerate(group):
            facts.add("group_member", gid, index, rank)
    return lowered


def _declared_relations(config: ModelConfig, lowered: dict[str, GraphLowering], models: LoadedModels, facts: FactSet) -> None:
    """input_rel and output_rel facts from refine.json, checked against the shapes on both sides
    (and every sequential output must be an output of some rank program).

    Inputs: only graph inputs and initializers can be declared (a relation assumed of an
    intermediate tensor would be an unchecked claim about the computation); ranks lacking one
    are skipped. Outputs: a required layout must hold on every rank, so every rank has it."""
    inputs = {g: {vi.name for vi in low.graph.input} | {init.name for init in low.graph.initializer}
              for g, low in lowered.items()}
    outputs = {g: {vi.name for vi in low.graph.output} for g, low in lowered.items()}
    for vi in lowered[SEQ].graph.output:  # outputs correspond by name (docs/model-dir.md)
        if not any(vi.name in outputs[g] for g in lowered if g != SEQ):
            raise InputError(models.paths[SEQ], f"output {vi.name!r} is an output of no rank program "
                             "(a sequential output is rebuilt from the ranks' outputs of the same name)")
    for name, layout in config.inputs.items():
        _declare("input", name, layout, inputs, config, lowered, models, facts)
    for name, layout in config.outputs.items():
        _declare("output", name, layout, outputs, config, lowered, models, facts)


def _declare(kind: str, name: str, layout: ShardLayout | RepLayout | PartialLayout, sources: dict[str, set[str]],
             config: ModelConfig, lowered: dict[str, GraphLowering], models: LoadedModels, facts: FactSet) -> None:
    """One declared tensor: where it must exist, its per-rank layout term, and shape checks."""
    cfg_path = models.paths[SEQ].parent / "refine.json"
    seq = lowered[SEQ]
    n = config.world_size
    on_seq = name in sources[SEQ]
    ranks = [r for r in range(n) if name in sources[rank_graph_id(r)]]
    where = "a graph input or initializer" if kind == "input" else "a graph output"
    if not on_seq and not ranks:
        if any(name in low.types for low in lowered.values()):
            raise InputError(cfg_path, f"{kind} {name!r} is an intermediate tensor, not {where}")
        raise InputError(cfg_path, f"{kind} {name!r} exists neither in seq.onnx nor in any rank program")
    if not on_seq:
        raise InputError(cfg_path, f"{kind} {name!r} exists in rank programs but not in seq.onnx")
    if not ranks:
        raise InputError(cfg_path, f"{kind} {name!r} exists in seq.onnx but in no rank program")
    if kind == "output" and len(ranks) != n:
        missing = next(r for r in range(n) if r not in ranks)
        raise InputError(models.paths[rank_graph_id(missing)], f"has no output {name!r}, which refine.json requires")
    s_shape = seq.shape(name)
    if s_shape is None:
        raise InputError(models.paths[SEQ], f"{kind} {name!r} has no static shape")
    if layout.range is not None:
        _value_range(name, layout.range, seq, cfg_path, facts)
    bounds = None
    if isinstance(layout, ShardLayout):
        axis = layout.axis + len(s_shape) if layout.axis < 0 else layout.axis
        if not 0 <= axis < len(s_shape):
            raise InputError(cfg_path, f"{kind} {name!r}: shard axis {layout.axis} out of range for shape {s_shape}")
        try:
            bounds = shard_bounds(layout, s_shape[axis], n)
        except ValueError as exc:
            raise InputError(cfg_path, f"{kind} {name!r}: {exc}") from None
    for r in ranks:
        g = rank_graph_id(r)
        r_shape = lowered[g].shape(name)
        expected = list(s_shape)
        if isinstance(layout, (RepLayout, PartialLayout)):
            term = "rep" if isinstance(layout, RepLayout) else (
                f"psum({r},{r + 1},{n},pure)" if layout.op == "sum" else f"pmax({r},{r + 1},{n})")
        else:
            assert bounds is not None
            start, end = bounds[r]
            expected[axis] = end - start
            term = "rep" if (start, end) == (0, s_shape[axis]) else f"sl({axis},{start},{end})"
        if kind == "output":  # a rank output that cannot have this layout fails verification, not input
            facts.add("output_rel", seq.tid(name), lowered[g].tid(name), term)
            continue
        if r_shape is None:
            raise InputError(models.paths[g], f"{kind} {name!r} has no static shape, refine.json implies {expected}")
        s_elem, r_elem = seq.types[name].tensor_type.elem_type, lowered[g].types[name].tensor_type.elem_type
        if s_elem != r_elem:
            raise InputError(models.paths[g], f"{kind} {name!r} has element type "
                             f"{onnx.TensorProto.DataType.Name(r_elem)}, seq.onnx has {onnx.TensorProto.DataType.Name(s_elem)}")
        if r_shape != expected:
            raise InputError(models.paths[g], f"{kind} {name!r} has shape {r_shape}, refine.json implies {expected}")
        facts.add("input_rel", seq.tid(name), lowered[g].tid(name), term)


def _value_range(name: str, bounds: tuple[int, int], seq: GraphLowering, cfg_path: Path, facts: FactSet) -> None:
    """value_range of a declared input: what its values can be (integer inputs only)."""
    elem = seq.types[name].tensor_type.elem_type
    if np.dtype(helper.tensor_dtype_to_np_dtype(elem)).kind not in "iu":
        raise InputError(cfg_path, f"input {name!r}: a value range is declared of integer inputs only, "
                         f"seq.onnx has {onnx.TensorProto.DataType.Name(elem)}")
    facts.add("value_range", seq.tid(name), *bounds)


def lower_dir(model_dir: Path) -> FactSet:
    """Load, check and lower a model directory."""
    return lower_models(load_model_dir(model_dir))
