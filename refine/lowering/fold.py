"""Constant folding for lowering: the values of a graph's static tensors.

Exported models compute masks, position ids and reshape targets from constants and from
shapes (HF's causal-mask code is a few dozen Range/CumSum/Equal/Where nodes). Those values
depend on no input, so two graphs that compute equal ones agree there; lowering hashes them
(the `const` relation) and lemmas treat equal hashes as a replica. Here we find the static
tensors and evaluate them: one ReferenceEvaluator run over the static subgraph, with each
`Shape`/`Size` of a statically shaped tensor replaced by its value.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
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
                  small_init: int, ranges: dict[str, Values] | None = None) -> dict[str, np.ndarray]:
    """Values of every static tensor: small undeclared initializers, Constant outputs, and
    outputs of standard-domain nodes whose inputs are all static (each output at most
    FOLD_LIMIT elements, by inferred shape). With `ranges` (refine.json's declared value ranges
    of integer inputs: every value the input may take), a comparison of such an input (through
    views and shifts by a constant) with a constant that the range decides is static too: token
    ids declared in [0, vocab) are never the ignore index -100, so `labels != -100` is all true
    and the count of valid labels is the number of labels (a precondition the simulator keeps:
    it draws every input within its declared values)."""
    values: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.name not in declared and _numel(list(init.dims)) <= small_init:
            values[init.name] = numpy_helper.to_array(init)
    static: set[str] = set(values)
    known_values: dict[str, Values] = dict(ranges or {})
    fold_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in NONDETERMINISTIC:
            continue
        outs = [o for o in node.output if o]
        if not outs or any((s := shape_of(o)) is None or _numel(s) > FOLD_LIMIT for o in outs):
            if known_values and outs:
                _carry_values(node, known_values, values)
            continue
        if known_values and node.op_type == "Constant":  # (its value now: a comparison below may read it)
            found = constant_value(node)
            if found is not None:
                values[outs[0]] = found
                static.add(outs[0])
                continue
        if known_values and not all(not i or i in static for i in node.input):
            decided = _carry_values(node, known_values, values)
            if decided is not None:
                values[outs[0]] = np.full(shape_of(outs[0]) or [], decided)
                static.add(outs[0])
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


Values = tuple[int, int, frozenset[int]]  # an integer tensor's possible values: [lo, hi) and these others
VALUE_VIEWS = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Expand", "Slice", "Cast"}
_COMPARE = {"Equal": lambda v, c: v == c, "Less": lambda v, c: v < c, "LessOrEqual": lambda v, c: v <= c,
            "Greater": lambda v, c: v > c, "GreaterOrEqual": lambda v, c: v >= c}
_MIRROR = {"Less": "Greater", "LessOrEqual": "GreaterOrEqual", "Greater": "Less", "GreaterOrEqual": "LessOrEqual",
           "Equal": "Equal"}


def _scalar_int(values: dict[str, np.ndarray], name: str) -> int | None:
    found = values.get(name)
    if found is None or np.asarray(found).size != 1 or np.asarray(found).dtype.kind not in "iu":
        return None
    return int(np.asarray(found).reshape(()))


def _carry_values(node: onnx.NodeProto, known: dict[str, Values], values: dict[str, np.ndarray]) -> bool | None:
    """Carry an integer tensor's possible values through `node` (a view, a Cast to an integer
    type, a shift by a constant) into `known`; for a comparison with a constant that every
    possible value answers alike, return that answer (the output is then static), else None."""
    op = node.op_type
    first = known.get(node.input[0]) if node.input else None
    if op in VALUE_VIEWS and first is not None:
        if op == "Cast":
            to = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "to"), None)
            if to is None or np.dtype(helper.tensor_dtype_to_np_dtype(to)).kind not in "iu":
                return None
        known[node.output[0]] = first
        return None
    if op in ("Add", "Sub") and len(node.input) == 2:
        for k in (0, 1):
            v, c = known.get(node.input[k]), _scalar_int(values, node.input[1 - k])
            if v is not None and c is not None and (op == "Add" or k == 0):
                shift = c if op == "Add" else -c
                known[node.output[0]] = (v[0] + shift, v[1] + shift, frozenset(e + shift for e in v[2]))
                return None
        return None
    if op in _COMPARE and len(node.input) == 2:
        for k in (0, 1):
            v, c = known.get(node.input[k]), _scalar_int(values, node.input[1 - k])
            if v is None or c is None:
                continue
            test = _COMPARE[op if k == 0 else _MIRROR[op]]
            lo, hi, extra = v
            # over [lo, hi) a comparison with c is decided by the ends and by c itself
            samples = {lo, hi - 1, *extra} | ({c - 1, c, c + 1} & set(range(lo, hi)))
            answers = {bool(test(x, c)) for x in samples}
            return answers.pop() if len(answers) == 1 else None
    return None


def constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """A Constant node's value, from whichever attribute holds it."""
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if attr.name == "value":
            return numpy_helper.to_array(value)
        if attr.name in ("value_int", "value_ints"):
            return np.asarray(value, dtype=np.int64)
        if attr.name in ("value_float", "value_floats"):
            return np.asarray(value, dtype=np.float32)
    return None


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


class _FoldCache:
    """Results of static subgraphs already run, by their exact content (nodes with their names,
    the values they read, opsets). The ranks of a TP program trace the same code, so their
    static subgraphs repeat node for node (about half of the 405B step's folded nodes): each is
    run once per process. Static nodes are deterministic (NONDETERMINISTIC is never folded), so
    equal content gives equal values; the values are kept read-only, as every caller shares them."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._results: OrderedDict[bytes, dict[str, np.ndarray]] = OrderedDict()

    @staticmethod
    def key(nodes: list[onnx.NodeProto], needed: list[str], known: dict[str, np.ndarray],
            opsets: list[onnx.OperatorSetIdProto]) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        for o in opsets:
            h.update(f"{o.domain}:{o.version};".encode())
        for n in nodes:
            h.update(n.SerializeToString(deterministic=True))
        for name in needed:
            a = np.ascontiguousarray(known[name])
            h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        return h.digest()

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        found = self._results.get(key)
        if found is not None:
            self._results.move_to_end(key)
        return found

    def put(self, key: bytes, result: dict[str, np.ndarray]) -> None:
        for value in result.values():
            value.flags.writeable = False
        self._results[key] = result
        if len(self._results) > self.size:
            self._results.popitem(last=False)


_FOLDED = _FoldCache()


def _run(nodes: list[onnx.NodeProto], known: dict[str, np.ndarray],
         opsets: list[onnx.OperatorSetIdProto]) -> dict[str, np.ndarray]:
    needed = sorted({i for n in nodes for i in n.input if i} - {o for n in nodes for o in n.output})
    key = _FoldCache.key(nodes, needed, known, opsets)
    found = _FOLDED.get(key)
    if found is not None:
        return dict(found)
    result = _run_uncached(nodes, needed, known, opsets)
    _FOLDED.put(key, result)
    return dict(result)


def _run_uncached(nodes: list[onnx.NodeProto], needed: list[str], known: dict[str, np.ndarray],
                  opsets: list[onnx.OperatorSetIdProto]) -> dict[str, np.ndarray]:
    inits = [numpy_helper.from_array(np.asarray(known[name]), name) for name in needed]
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
