"""Shape inference for lowering: every type a lemma reads is inferred here, never adopted from
the model's own annotations (value_info, graph outputs), which are taken out first and checked
against the inference afterwards (issue 11: a stale annotation is bad input, not a fact).
ONNX's strict inference does the work, on a proxy where each `dist` collective is a standard
op with the same shape rule, and with static values folded in (refine/lowering/fold.py) where
ONNX cannot propagate them."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from refine import dist
from refine.errors import InputError
from refine.lowering import fold
from refine.lowering.fold import SMALL_CONST


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
    _check_expand_targets(inferred, path)
    check_declared_types(declared, value_types(inferred.graph), path)
    return inferred


def _check_expand_targets(model: onnx.ModelProto, path: Path) -> None:
    """An Expand whose target shape is static must broadcast with its input (numpy's rule) to
    the shape inference gave it. ONNX's inference lets some through (a target dimension of 0
    against one of 2), and the expand lemmas read the output's inferred shape, not the target:
    a program that cannot run must not reach them."""
    expands = [n for n in model.graph.node if n.op_type == "Expand" and n.domain in ("", "ai.onnx") and len(n.input) > 1]
    if not expands:
        return
    types = value_types(model.graph)

    def shape_of(name: str) -> list[int] | None:
        return static_shape(types[name]) if name in types else None

    statics = fold.static_values(model.graph, list(model.opset_import), shape_of, set(), SMALL_CONST)
    for node in expands:
        target, in_shape = statics.get(node.input[1]), shape_of(node.input[0])
        if target is None or in_shape is None:
            continue
        wanted = [int(v) for v in np.asarray(target).reshape(-1)]
        where = f"ill-typed: node {node.name or node.output[0]!r} (Expand)"
        try:
            result = list(np.broadcast_shapes(tuple(in_shape), tuple(wanted)))
        except ValueError:
            raise InputError(path, f"{where}: input shape {in_shape} does not broadcast to {wanted}") from None
        out_shape = shape_of(node.output[0])
        if out_shape is not None and out_shape != result:
            raise InputError(path, f"{where}: input shape {in_shape} expanded to {wanted} is {result}, "
                                   f"shape inference gave {out_shape}")


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
            shape = static_shape(src) if src is not None else None
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
    folding (refine/lowering/fold.py) evaluates such static subgraphs; their values become
    initializers of a proxy copy, which inference then reads."""
    for _ in range(rounds):
        types = value_types(inferred.graph)
        unshaped = [o for n in inferred.graph.node for o in n.output
                    if o and (o not in types or static_shape(types[o]) is None)]
        if not unshaped:
            return inferred

        def shape_of(name: str) -> list[int] | None:
            return static_shape(types[name]) if name in types else None

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
        if sum(1 for vi in again.graph.value_info if static_shape(vi.type) is not None) <= \
                sum(1 for vi in inferred.graph.value_info if static_shape(vi.type) is not None) - len(produced):
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
        for vi in merged.graph.output:  # (a result the folding shaped: an Identity of a folded-shape value)
            if vi.name in known:
                vi.type.CopyFrom(known[vi.name])
        inferred = merged
    return inferred


def _check_collective_shapes(model: onnx.ModelProto, path: Path) -> None:
    """A collective whose input shape its op cannot take (a chunk count that does not divide)."""
    types = value_types(model.graph)
    for node in model.graph.node:
        if node.domain != dist.DIST_DOMAIN or node.input[0] not in types:
            continue
        shape = static_shape(types[node.input[0]])
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
    """A copy of `model` whose collectives are standard ops with the same output shape, and
    whose chunks of a split sequence are the Slices they are (`_sequence_chunks`)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graph = model.graph
    chunks = _sequence_chunks(graph)
    if not chunks and not any(n.domain == dist.DIST_DOMAIN for n in graph.node):
        return model
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if index in chunks:
            nodes.extend(chunks[index])
            continue
        if node.domain != dist.DIST_DOMAIN:
            nodes.append(node)
            continue
        attrs = dist.node_attrs(node)
        n = len(attrs.get("group", [])) or 1
        x, y = node.input[0], node.output[0]
        if node.op_type in ("AllReduce", "Broadcast", "Send", "Recv"):  # (a Recv's X is its buffer)
            nodes.append(helper.make_node("Identity", [x], [y]))
        elif node.op_type == "AllGather":
            nodes.append(helper.make_node("Concat", [x] * n, [y], axis=attrs["axis"]))
        elif node.op_type == "AllToAllV":
            nodes.extend(_rows_proxy(x, y, attrs, node.name))
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


def _rows_proxy(x: str, y: str, attrs: dict, name: str) -> list[onnx.NodeProto]:
    """AllToAllV's shape: out_rows rows of x's row shape (a Gather of out_rows row indices; the
    counts do not enter the shape). A missing or negative out_rows is left to call_problem."""
    rows = attrs.get("out_rows")
    rows = rows if isinstance(rows, int) and rows >= 0 else 0
    count, index = f"{y}__proxy_rows", f"{y}__proxy_index"
    return [
        helper.make_node("Constant", [], [count], value=numpy_helper.from_array(np.array([rows], dtype=np.int64))),
        helper.make_node("ConstantOfShape", [count], [index], value=numpy_helper.from_array(np.array([0], dtype=np.int64))),
        helper.make_node("Gather", [x, index], [y], name=name, axis=0),  # (named: an error names the node)
    ]


def chunk_bounds(sizes: list[int], k: int, size: int | None = None) -> tuple[int, int] | None:
    """[start, end) of chunk `k` of SplitToSequence(x, sizes) along an axis of `size` (None: the
    sizes' sum), or None if there is no such chunk; one size is a chunk length (equal chunks,
    the last one shorter)."""
    if len(sizes) == 1:
        if size is None or sizes[0] <= 0:
            return None
        sizes = [min(sizes[0], size - i) for i in range(0, size, sizes[0])]
    if (size is not None and sum(sizes) != size) or not -len(sizes) <= k < len(sizes):
        return None
    k %= len(sizes)
    start = sum(sizes[:k])
    return start, start + sizes[k]


def int_constants(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The integer scalars and 1-D tensors the graph states outright (initializers and Constant
    nodes of the default domain), by value name, flattened."""
    consts: dict[str, list[int]] = {}
    for init in graph.initializer:
        if init.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and len(init.dims) <= 1:
            consts[init.name] = [int(v) for v in numpy_helper.to_array(init).reshape(-1)]
    for node in graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type == "Constant" and node.attribute \
                and node.attribute[0].name in ("value", "value_int", "value_ints"):
            value = np.asarray(helper.get_attribute_value(node.attribute[0]) if node.attribute[0].name != "value"
                               else numpy_helper.to_array(node.attribute[0].t))
            if value.dtype.kind in "iu" and value.ndim <= 1:
                consts[node.output[0]] = [int(v) for v in value.reshape(-1)]
    return consts


def _sequence_chunks(graph: onnx.GraphProto) -> dict[int, list[onnx.NodeProto]]:
    """`SequenceAt(SplitToSequence(x, sizes, axis), k)` with constant sizes and k, as a Slice of x
    (plus the Constants it reads). ONNX infers a sequence of unequal chunks with the split axis
    unknown (torch.split(x, [32, 8, 8]): a fused QKV), though each chunk's size is known."""
    consts = int_constants(graph)
    splits: dict[str, onnx.NodeProto] = {}
    out: dict[int, list[onnx.NodeProto]] = {}  # node index -> its replacement
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "SplitToSequence" and len(node.input) > 1 and node.input[1] in consts:
            splits[node.output[0]] = node
        elif node.op_type == "SequenceAt" and node.input[0] in splits and node.input[1] in consts:
            split = splits[node.input[0]]
            sizes, which = consts[split.input[1]], consts[node.input[1]]
            found = chunk_bounds(sizes, which[0]) if len(sizes) > 1 and len(which) == 1 else None
            if found is None:
                continue  # one chunk size (equal chunks): ONNX infers those itself
            axis = next((helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0)
            y = node.output[0]
            bounds = {"starts": found[0], "ends": found[1], "axes": axis}
            made = [helper.make_node("Constant", [], [f"{y}__proxy_{key}"], value_ints=[v]) for key, v in bounds.items()]
            made.append(helper.make_node("Slice", [split.input[0], *(m.output[0] for m in made)], [y]))
            out[index] = made
    return out


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


def static_shape(tp: onnx.TypeProto) -> list[int] | None:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims = tp.tensor_type.shape.dim
    if any(not d.HasField("dim_value") for d in dims):
        return None
    return [d.dim_value for d in dims]


