"""Constant folding for lowering: the values of a graph's static tensors.

Exported models compute masks, position ids and reshape targets from constants and from
shapes (HF's causal-mask code is a few dozen Range/CumSum/Equal/Where nodes). Those values
depend on no input, so two graphs that compute equal ones agree there; lowering hashes them
(the `const` relation) and lemmas treat equal hashes as a replica. Here we find the static
tensors and evaluate them: one ReferenceEvaluator run over the static subgraph, with each
`Shape`/`Size` of a statically shaped tensor replaced by its value.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

FOLD_LIMIT = 1 << 16  # largest static tensor (elements) we evaluate
SMALL_CONST = 4096  # largest initializer (elements) read as a constant rather than an opaque weight
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                    "Multinomial", "Bernoulli", "Dropout"}

Shape = list[int] | None


def _numel(shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def static_values(graph: onnx.GraphProto, opsets: list[onnx.OperatorSetIdProto],
                  shape_of: Callable[[str], Shape], declared: set[str],
                  small_init: int) -> dict[str, np.ndarray]:
    """Values of every static tensor: small undeclared initializers, Constant outputs, and
    outputs of standard-domain nodes whose inputs are all static (each output at most
    FOLD_LIMIT elements, by inferred shape)."""
    values: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.name not in declared and _numel(list(init.dims)) <= small_init:
            values[init.name] = numpy_helper.to_array(init)
    static: set[str] = set(values)
    fold_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in NONDETERMINISTIC:
            continue
        outs = [o for o in node.output if o]
        if not outs or any((s := shape_of(o)) is None or _numel(s) > FOLD_LIMIT for o in outs):
            continue
        if node.op_type in ("Shape", "Size"):
            in_shape = shape_of(node.input[0])
            if in_shape is None:
                continue
            values[outs[0]] = _shape_value(node, in_shape)
            static.add(outs[0])
            continue
        if all(not i or i in static for i in node.input):
            fold_nodes.append(node)  # includes Constant (no inputs): its value is static
            static.update(outs)
    if fold_nodes:
        values.update(_evaluate(fold_nodes, values, opsets))
    return values


def _shape_value(node: onnx.NodeProto, shape: list[int]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(_numel(shape), dtype=np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.array(shape[slice(start, end)], dtype=np.int64)


def _evaluate(nodes: list[onnx.NodeProto], known: dict[str, np.ndarray],
              opsets: list[onnx.OperatorSetIdProto]) -> dict[str, np.ndarray]:
    """Run the static nodes once (falling back to one node at a time if the batch fails)."""
    try:
        return _run(nodes, known, opsets)
    except Exception:  # noqa: BLE001 - a node the reference evaluator cannot run: go one by one
        pass
    values = dict(known)
    out: dict[str, np.ndarray] = {}
    for node in nodes:
        if not all(not i or i in values for i in node.input):
            continue
        try:
            result = _run([node], values, opsets)
        except Exception:  # noqa: BLE001 - not foldable; the tensor simply stays unknown
            continue
        values.update(result)
        out.update(result)
    return out


def _run(nodes: list[onnx.NodeProto], known: dict[str, np.ndarray],
         opsets: list[onnx.OperatorSetIdProto]) -> dict[str, np.ndarray]:
    needed = {i for n in nodes for i in n.input if i} - {o for n in nodes for o in n.output}
    inits = [numpy_helper.from_array(np.asarray(known[name]), name) for name in sorted(needed)]
    outputs = [helper.make_empty_tensor_value_info(o) for n in nodes for o in n.output if o]
    graph = helper.make_graph(nodes, "static", [], outputs, inits)
    model = helper.make_model(graph, opset_imports=[o for o in opsets if o.domain in ("", "ai.onnx")])
    results = ReferenceEvaluator(model).run(None, {})
    return {vi.name: np.asarray(v) for vi, v in zip(outputs, results)}


SPLAT_VIEWS = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand"}


def splat_values(graph: onnx.GraphProto, shape_of: Callable[[str], Shape],
                 values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Static tensors too large to fold that hold one value everywhere: a ConstantOfShape, and
    an Expand, a view or a Cast of a one-element static tensor or of another such tensor (the
    zeros a training step accumulates an embedding's gradient into: vocab x hidden). Each is a
    zero-stride numpy view of its one value, so nothing is allocated; only their hashes are used
    (never folded further, never written back as initializers)."""
    scalars: dict[str, np.ndarray] = {}  # name -> its one value, as a 0-d array

    def one_value(name: str) -> np.ndarray | None:
        if name in scalars:
            return scalars[name]
        value = values.get(name)
        return np.asarray(value).reshape(()) if value is not None and np.asarray(value).size == 1 else None

    out: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1 or not node.output[0]:
            continue
        name, shape = node.output[0], shape_of(node.output[0])
        if name in values or shape is None or _numel(shape) <= FOLD_LIMIT:
            continue
        scalar = None
        if node.op_type == "ConstantOfShape":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            scalar = numpy_helper.to_array(attrs["value"]).reshape(()) if "value" in attrs else np.asarray(np.float32(0))
        elif node.op_type in SPLAT_VIEWS and node.input:
            scalar = one_value(node.input[0]) if node.op_type == "Expand" else scalars.get(node.input[0])
        elif node.op_type == "Cast" and node.input and node.input[0] in scalars:
            to = helper.tensor_dtype_to_np_dtype(helper.get_attribute_value(next(a for a in node.attribute if a.name == "to")))
            scalar = scalars[node.input[0]].astype(to)
        if scalar is not None:
            scalars[name] = scalar
            out[name] = np.broadcast_to(scalar, shape)
    return out


def is_splat(value: np.ndarray) -> bool:
    """A zero-stride view of one value (splat_values): hash it without materializing it."""
    return value.ndim > 0 and value.size > 1 and all(s == 0 for s in value.strides)
