"""Algebraic normal forms: where two spellings compute one value, both sides are rewritten into
one of them before lowering, so that the lemmas meet one spelling (canonical.py's Gemm
expansion is the first such form; this module holds the rest).

Each rule rewrites one node, reading the nodes that produce its inputs, into nodes that compute
the same value exactly (over the reals; the identity is in the rule's docstring), and its test
checks that identity on random values (tests/test_normal_forms.py). The rules:

- log-softmax as Megatron's vocab-parallel cross-entropy computes it, `(x - m) - log sum exp(x - m)`
  with m = max x (the form every vocab-parallel cross-entropy shares with its TP 1 run), and its
  readers taken apart: the target's pick `log_softmax(x)[i] = (x - m)[i] - log sum exp` and label
  smoothing's sum over the vocabulary `sum log_softmax(x) = sum (x - m) - n log sum exp`
  (`F.cross_entropy`, `F.nll_loss(log_softmax)`);
- `squeeze(p - q) = squeeze(p) - squeeze(q)` (both of the full shape), `squeeze(unsqueeze(x)) = x`;
- `-(a - b) = b - a`;
- `x + (y - x) = y` (a value kept and its gradient changed: `b + (b / k - b).detach()`);
- `squeeze(reduce(x, keepdims=1)) = reduce(x, keepdims=0)` over the same axes;
- `mean(x) = sum(x) * (1 / n)` over n statically known elements ("mean as sum over a count");
- `GatherND(data, ids[..., None])` (torch's `table[ids]`) as `Gather(data, ids, axis 0)`;
- `ScatterElements(data, ids[:, None].expand(-1, H), rows, axis 0)` (torch's `scatter_add_` of
  whole rows, an index_add) as `ScatterND(data, ids[:, None], rows)`, and its backward
  `GatherElements(data, ids[:, None].expand(-1, H), axis 0)` as `Gather(data, ids, axis 0)`;
- rows split into [T, K] late: `op(reshape(a, [T, K, ..]), b) = reshape(op(a, flat(b)), [T, K, ..])`,
  `reshape(op(a, b), [T K, ..]) = op(flat(a), flat(b))` for elementwise ops, and reductions and
  squeezes of the other axes alike (HF's AllToAllEP weights and sums its routes split per token, its
  experts on flat rows);
- `CastLike(x, like)` as `Cast(x, to=like's type)` (a static x stays static: `ones_like(labels)`);
- a division by a constant as a product: `x / c = x * (1/c)`, the factor snapped to the ratio or
  square root it stands for; c is a constant of the file, never an initializer refine.json declares
  or a graph input's default (any value may come). Factors stay where they are: the rules carry
  them (rank_scale, seq_scale, scaled relations). Hoisting them past views, products and linear
  collectives was tried and left out: a rank's factor cannot cross a collective (each rank may
  scale by its own), so hoisting on one side only leaves the two sides' factors meeting nowhere,
  and a factor a rank adds by mistake must stay at the user's line for the diagnosis (composing
  two transposes into one was left out for the same reason: a rank's pair may have a call
  between them, as context parallelism gathers k between its split into heads and k^T);
- SDPA's split scale: `views(a c1) @ views(b c2) = (views(a) @ views(b)) (c1 c2)` when both
  operands of a MatMul carry a scalar factor (never one alone: that is the hoisting left out);
- masks: `x + where(c, 0, -inf) = where(c, x, -inf)`,
  `not (a <= b) = a > b` (and <, >, >=) on integers,
- `x op expand(s) = x op s` for a one-element s when x alone gives the output its shape;
  `(where(c, x, -inf) == -inf) = not c` for finite x;
- axes given as an input (Reduce*, Squeeze, Unsqueeze, Slice) non-negative: `x.max(dim=-1)` and
  `x.max(dim=1)` of a 2-D x are one reduction, and reduce.lp pairs reductions whose axes
  tensors are equal.

Invariants (as canonical.py's): every tensor of the input graph keeps its name and value; the
node computing an original node's output takes its name and metadata (reports name the user's
node and line); nodes that stand for no original node are marked inserted. New tensors are
typed from the known shapes. A node whose shapes are unknown is left alone (sound: no lemma
relates what it does not understand).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from math import prod

import numpy as np
import onnx
from onnx import helper, numpy_helper

from refine.lowering import canonical
from refine.lowering.canonical import FLOAT_TYPES, INSERTED_KEY, Types, static_shape
from refine.lowering.fold import constant_value
from refine.lowering.shapes import value_types

_ONNX = ("", "ai.onnx")
_INT_TYPES = {onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
              onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}


@dataclass
class _Rewrite:
    """The graph being rewritten: nodes so far, who makes each value, the known types."""

    graph: onnx.GraphProto
    types: Types
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    producer: dict[str, onnx.NodeProto] = field(default_factory=dict)
    value_info: list[onnx.ValueInfoProto] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    log_softmax: dict[str, tuple[str, str, str, int]] = field(default_factory=dict)  # y -> (z, ls, unsqueezed ls, axis)
    late_splits: set[str] = field(default_factory=set)  # row splits split_rows_late moved past an op

    def source(self, name: str) -> onnx.NodeProto | None:
        """The node making `name`, through Identity nodes (torch's `.detach()`, `wait_tensor`)."""
        node = self.producer.get(name)
        while node is not None and node.op_type == "Identity" and node.domain in _ONNX:
            node = self.producer.get(node.input[0])
        return node

    def value(self, name: str) -> str:
        """`name` itself, or what the Identity chain that makes it reads."""
        node = self.producer.get(name)
        while node is not None and node.op_type == "Identity" and node.domain in _ONNX:
            name = node.input[0]
            node = self.producer.get(name)
        return name

    def shape(self, name: str) -> list[int] | None:
        return static_shape(self.types.get(name))

    def elem(self, name: str) -> int | None:
        tp = self.types.get(name)
        return tp.tensor_type.elem_type if tp is not None and tp.HasField("tensor_type") else None

    def ints(self, name: str) -> list[int] | None:
        """The values of a small integer constant (axes given as an input)."""
        found = self.constants.get(name)
        return None if found is None or found.dtype.kind not in "iu" else [int(v) for v in found.reshape(-1)]

    def fresh(self, base: str, elem: int, shape: list[int]) -> str:
        name, k = base, 1
        while name in self.names:
            name, k = f"{base}#{k}", k + 1
        self.names.add(name)
        self.value_info.append(helper.make_tensor_value_info(name, elem, shape))
        self.types[name] = self.value_info[-1].type
        return name

    def make(self, like: onnx.NodeProto, op: str, inputs: list[str], output: str, suffix: str | None,
             **attrs: object) -> onnx.NodeProto:
        """A node with `like`'s metadata: named `LIKE/suffix` and marked inserted, or (suffix
        None) named as `like`, standing for it."""
        name = like.name if suffix is None or not like.name else f"{like.name}/{suffix}"
        node = helper.make_node(op, inputs, [output], name=name, **attrs)
        node.doc_string = like.doc_string
        node.metadata_props.extend(p for p in like.metadata_props if p.key != INSERTED_KEY)
        if suffix is not None or any(p.key == INSERTED_KEY for p in like.metadata_props):
            node.metadata_props.add(key=INSERTED_KEY, value="inserted")
        return node

    def axes_const(self, like: onnx.NodeProto, axes: list[int]) -> str:
        name = self.fresh(f"{like.output[0]}/axes", onnx.TensorProto.INT64, [len(axes)])
        self.constants[name] = np.array(axes, dtype=np.int64)
        return name

    def scalar_const(self, like: onnx.NodeProto, value: float, elem: int) -> str:
        name = self.fresh(f"{like.output[0]}/scale", elem, [])
        self.constants[name] = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(elem))
        return name


Rule = Callable[[_Rewrite, onnx.NodeProto], list[onnx.NodeProto] | None]


def _axis_attr(node: onnx.NodeProto, default: int) -> int:
    return next((int(helper.get_attribute_value(a)) for a in node.attribute if a.name == "axis"), default)


def _reduce_axes(rw: _Rewrite, node: onnx.NodeProto, rank: int) -> list[int] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    given = len(node.input) > 1 and bool(node.input[1])
    axes = list(attrs["axes"]) if "axes" in attrs else (rw.ints(node.input[1]) if given else None)
    if axes is None and given:  # an axes input that is not a known constant: which axes is unknown
        return None
    if not axes:  # none given, or an empty list: every axis (or, with noop_with_empty_axes, none at all)
        return None if attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return sorted({a % rank for a in axes}) if all(-rank <= a < rank for a in axes) else None


# --- the rules ---------------------------------------------------------------------------------


def log_softmax_parts(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """LogSoftmax(x, a) as Megatron's vocab-parallel cross-entropy computes it, which every
    vocab-parallel loss shares with its TP 1 run:
        log_softmax(x) = z - log sum_a exp z,   z = x - max_a x
    as [m, z = x - unsqueeze(m), s = sum exp z, z - unsqueeze(log s)]; its readers then take the
    parts apart (log_softmax_pick, log_softmax_sum)."""
    if node.op_type != "LogSoftmax" or node.domain not in _ONNX:
        return None
    x, y = node.input[0], node.output[0]
    xs, elem = rw.shape(x), rw.elem(x)
    if xs is None or elem not in FLOAT_TYPES or not xs:
        return None
    a = _axis_attr(node, -1) % len(xs)
    kept, unit = [d for k, d in enumerate(xs) if k != a], [1 if k == a else d for k, d in enumerate(xs)]
    axes = rw.axes_const(node, [a])
    m, um = rw.fresh(f"{y}/max", elem, kept), rw.fresh(f"{y}/max_kept", elem, unit)
    z, e = rw.fresh(f"{y}/shifted", elem, xs), rw.fresh(f"{y}/exp", elem, xs)
    s_, ls = rw.fresh(f"{y}/sum_exp", elem, kept), rw.fresh(f"{y}/log_sum_exp", elem, kept)
    uls = rw.fresh(f"{y}/log_sum_exp_kept", elem, unit)
    rw.log_softmax[y] = (z, ls, uls, a)
    return [rw.make(node, "ReduceMax", [x, axes], m, "max", keepdims=0, noop_with_empty_axes=0),
            rw.make(node, "Unsqueeze", [m, axes], um, "max_kept"),
            rw.make(node, "Sub", [x, um], z, "shifted"),
            rw.make(node, "Exp", [z], e, "exp"),
            rw.make(node, "ReduceSum", [e, axes], s_, "sum_exp", keepdims=0, noop_with_empty_axes=0),
            rw.make(node, "Log", [s_], ls, "log_sum_exp"),
            rw.make(node, "Unsqueeze", [ls, axes], uls, "log_sum_exp_kept"),
            rw.make(node, "Sub", [z, uls], y, None)]


def log_softmax_pick(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """GatherElements(log_softmax(x), idx, a), idx of size 1 along a and of x's sizes elsewhere
    (cross-entropy's pick of the target):  (z - c)[i] = z[i] - c, c = log sum exp z constant along a."""
    if node.op_type != "GatherElements" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    parts = rw.log_softmax.get(rw.value(node.input[0]))
    if parts is None:
        return None
    z, _ls, uls, a = parts
    idx, y, xs, ids = node.input[1], node.output[0], rw.shape(z), rw.shape(node.input[1])
    if xs is None or ids is None or len(ids) != len(xs) or _axis_attr(node, 0) % len(xs) != a or ids[a] != 1 \
            or any(i != d for k, (i, d) in enumerate(zip(ids, xs)) if k != a):
        return None
    g = rw.fresh(f"{y}/picked", rw.elem(z) or 1, ids)
    return [rw.make(node, "GatherElements", [z, idx], g, "picked", axis=a),
            rw.make(node, "Sub", [g, uls], y, None)]


def log_softmax_sum(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """ReduceSum(log_softmax(x), [a]) (label smoothing's sum of -log p over the vocabulary):
        sum_a (z - c) = sum_a z - n c,   n = the size of axis a."""
    if node.op_type != "ReduceSum" or node.domain not in _ONNX:
        return None
    parts = rw.log_softmax.get(rw.value(node.input[0]))
    if parts is None:
        return None
    z, ls, uls, a = parts
    xs, out, elem = rw.shape(z), rw.shape(node.output[0]), rw.elem(z)
    if xs is None or out is None or elem is None or _reduce_axes(rw, node, len(xs)) != [a]:
        return None
    keep = next((int(helper.get_attribute_value(t)) for t in node.attribute if t.name == "keepdims"), 1)
    y = node.output[0]
    zs, nc = rw.fresh(f"{y}/sum_shifted", elem, out), rw.fresh(f"{y}/n_log_sum_exp", elem, out)
    attrs = {t.name: helper.get_attribute_value(t) for t in node.attribute}
    return [rw.make(node, "ReduceSum", [z, *node.input[1:]], zs, "sum_shifted", **attrs),
            rw.make(node, "Mul", [uls if keep else ls, rw.scalar_const(node, float(xs[a]), elem)], nc, "n_log_sum_exp"),
            rw.make(node, "Sub", [zs, nc], y, None)]


def squeeze_difference(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Squeeze(p - q, axes), p and q of the difference's own shape:
        squeeze(p - q) = squeeze(p) - squeeze(q),   squeeze(unsqueeze(v, axes), axes) = v."""
    if node.op_type != "Squeeze" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    diff = rw.source(node.input[0])
    axes = rw.ints(node.input[1])
    if diff is None or diff.op_type != "Sub" or diff.domain not in _ONNX or axes is None:
        return None
    full, out, elem = rw.shape(node.input[0]), rw.shape(node.output[0]), rw.elem(node.output[0])
    if full is None or out is None or elem is None or any(rw.shape(v) != full for v in diff.input):
        return None
    norm = sorted(a % len(full) for a in axes)
    parts = []
    for k, v in enumerate(diff.input):
        src = rw.source(v)
        if src is not None and src.op_type == "Unsqueeze" and len(src.input) == 2 and src.domain in _ONNX \
                and sorted(a % len(full) for a in (rw.ints(src.input[1]) or [-999])) == norm:
            parts.append((rw.value(src.input[0]), None))
            continue
        name = rw.fresh(f"{node.output[0]}/{'ab'[k]}", elem, out)
        parts.append((name, rw.make(node, "Squeeze", [v, node.input[1]], name, f"squeeze_{'ab'[k]}")))
    made = [n for _, n in parts if n is not None]
    return made + [rw.make(node, "Sub", [parts[0][0], parts[1][0]], node.output[0], None)]


def negated_difference(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Neg(a - b) = b - a."""
    if node.op_type != "Neg" or node.domain not in _ONNX:
        return None
    diff = rw.source(node.input[0])
    if diff is None or diff.op_type != "Sub" or diff.domain not in _ONNX:
        return None
    return [rw.make(node, "Sub", [diff.input[1], diff.input[0]], node.output[0], None)]


def added_back(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """x + (y - x) = y and (y - x) + x = y, x the same tensor (through Identity: `.detach()`),
    all three of one shape (no broadcasting hides a difference)."""
    if node.op_type != "Add" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    for k in (0, 1):
        diff = rw.source(node.input[1 - k])
        if diff is None or diff.op_type != "Sub" or diff.domain not in _ONNX:
            continue
        if rw.value(diff.input[1]) == rw.value(node.input[k]):
            shapes = {tuple(s) if s is not None else None for s in map(rw.shape, [*node.input, *diff.input, node.output[0]])}
            if len(shapes) == 1 and None not in shapes:
                return [rw.make(node, "Identity", [diff.input[0]], node.output[0], None)]
    return None


def mean_as_sum(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """ReduceMean(x, axes) = ReduceSum(x, axes) * (1 / n), n the number of reduced elements
    (floating point only: an integer mean truncates)."""
    if node.op_type != "ReduceMean" or node.domain not in _ONNX:
        return None
    xs, elem, out = rw.shape(node.input[0]), rw.elem(node.output[0]), rw.shape(node.output[0])
    if xs is None or out is None or elem not in FLOAT_TYPES:
        return None
    axes = _reduce_axes(rw, node, len(xs))
    if axes is None:
        return None
    n = prod(xs[a] for a in axes)
    if n == 0:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "axes"}
    summed = rw.fresh(f"{node.output[0]}/sum", elem, out)
    axes_in = rw.axes_const(node, axes)
    return [rw.make(node, "ReduceSum", [node.input[0], axes_in], summed, "sum", **attrs),
            rw.make(node, "Mul", [summed, rw.scalar_const(node, 1.0 / n, elem)], node.output[0], None)]


_AXES_INPUT = {"Squeeze": 1, "Unsqueeze": 1, "Slice": 3, **{op: 1 for op in (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare")}}


def nonnegative_axes(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """axes a (given as a constant input) of a rank-R tensor as a mod R: the same axes (Unsqueeze's
    count in its output's rank)."""
    slot = _AXES_INPUT.get(node.op_type)
    if slot is None or node.domain not in _ONNX or len(node.input) <= slot or not node.input[slot]:
        return None
    axes = rw.ints(node.input[slot])
    ref = rw.shape(node.output[0] if node.op_type == "Unsqueeze" else node.input[0])
    if axes is None or ref is None or all(a >= 0 for a in axes) or not all(-len(ref) <= a < len(ref) for a in axes):
        return None
    fixed = onnx.NodeProto()
    fixed.CopyFrom(node)
    fixed.input[slot] = rw.axes_const(node, [a % len(ref) for a in axes])
    return [fixed]


def squeezed_reduction(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Squeeze(Reduce(x, axes, keepdims=1), axes) = Reduce(x, axes, keepdims=0) (torch's `x.mean()`
    exports the first, `x.sum(dim)` the second)."""
    if node.op_type != "Squeeze" or node.domain not in _ONNX:
        return None
    red = rw.source(node.input[0])
    if red is None or red.domain not in _ONNX or not red.op_type.startswith("Reduce"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in red.attribute}
    xs, kept_shape = rw.shape(red.input[0]), rw.shape(node.input[0])
    if len(node.input) > 1 and node.input[1]:
        squeezed = rw.ints(node.input[1])
    else:  # (no axes: every axis of size 1)
        squeezed = [a for a, d in enumerate(kept_shape)] if kept_shape is not None and all(d == 1 for d in kept_shape) \
            else None if kept_shape is None else [a for a, d in enumerate(kept_shape) if d == 1]
    if xs is None or squeezed is None or attrs.get("keepdims", 1) != 1:
        return None
    axes = _reduce_axes(rw, red, len(xs))
    if axes is None or sorted(a % len(xs) for a in squeezed) != axes:
        return None
    kept = {k: v for k, v in attrs.items() if k not in ("keepdims", "axes")}
    inputs = [red.input[0]] + ([rw.axes_const(node, axes)] if "axes" not in attrs else [])
    if "axes" in attrs:
        kept["axes"] = axes
    return [rw.make(node, red.op_type, inputs, node.output[0], None, keepdims=0, **kept)]


# --- rows split into [T, K] late ----------------------------------------------------------------
# The ranks of a token-moving dispatch hold their routes' rows flat [N, ...] and split them into
# [T, K, ...] to weight and sum each token's slots (HF's AllToAllEP combine and its backward); the
# sequential experts work on the flat rows and split them last.  One spelling: a split of the
# rows (axis 0 into two axes) moves past the elementwise products, sums and squeezes of the other
# axes, and a merge of the two axes moves before them, so that both sides work on flat rows.

_ROW_BINARY = ("Mul", "Add", "Sub", "Div")
_ROW_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin")


def _row_split(rw: _Rewrite, name: str) -> tuple[str, int, int] | None:
    """(a, T, K) when `name` is Reshape(a, [T, K, *rest]) of an a of shape [T K, *rest]."""
    node = rw.source(name)
    if node is None or node.op_type != "Reshape" or node.domain not in _ONNX:
        return None
    xs, ys = rw.shape(node.input[0]), rw.shape(name)
    if xs is None or ys is None or len(ys) != len(xs) + 1 or len(ys) < 2 or ys[0] * ys[1] != xs[0] or ys[2:] != xs[1:]:
        return None
    return node.input[0], ys[0], ys[1]


def _route_operand(rw: _Rewrite, name: str, t: int, k: int) -> bool:
    """`name` is per-route: `v[..., None]` of a [T, K] v (each route's weight), or a token's row
    copied to its K slots, `expand(u[:, None], [T, K, ...])`."""
    node = rw.source(name)
    if node is None or node.domain not in _ONNX or len(node.input) != 2:
        return False
    out = rw.shape(name)
    if node.op_type == "Unsqueeze":
        return rw.shape(node.input[0]) == [t, k] and out is not None \
            and [a % len(out) for a in (rw.ints(node.input[1]) or [-99])] == [len(out) - 1]
    if node.op_type == "Expand":
        inner = rw.source(node.input[0])
        u = None if inner is None or inner.op_type != "Unsqueeze" or len(inner.input) != 2 else rw.shape(inner.input[0])
        return out is not None and u is not None and out[:2] == [t, k] and u[:1] == [t] and out[2:] == u[1:] \
            and rw.ints(inner.input[1]) == [1]
    return False


def _flat_rows(rw: _Rewrite, like: onnx.NodeProto, name: str, t: int, k: int, rank: int,
               made: list[onnx.NodeProto], reshape: dict[str, object]) -> str | None:
    """`name` (an operand of a rank-`rank` op on split rows [T, K, ...]) on flat rows [T K, ...]:
    a shorter operand broadcasts over the rows and stays; `v[..., None]` of a [T, K] v is
    `reshape(v, [T K])[:, None]` (the spelling of HF's experts); any other [T, K, ...] operand is
    reshaped; an operand broadcast over T or K has no flat form (None)."""
    shape = rw.shape(name)
    if shape is None:
        return None
    if len(shape) < rank - 1:
        return name
    if len(shape) != rank or shape[:2] != [t, k]:
        return None
    split = _row_split(rw, name)
    if split is not None:
        return split[0]
    elem = rw.elem(name)
    node = rw.source(name)
    if elem is None:
        return None
    if node is not None and node.op_type == "Unsqueeze" and node.domain in _ONNX and len(node.input) == 2 \
            and rank == 3 and rw.shape(node.input[0]) == [t, k] \
            and [a % rank for a in (rw.ints(node.input[1]) or [-99])] == [rank - 1]:
        flat = rw.fresh(f"{like.output[0]}/flat operand", elem, [t * k])
        column = rw.fresh(f"{like.output[0]}/flat column", elem, [t * k, 1])
        made += [rw.make(like, "Reshape", [node.input[0], rw.axes_const(like, [t * k])], flat, "flat operand", **reshape),
                 rw.make(like, "Unsqueeze", [flat, rw.axes_const(like, [1])], column, "flat column")]
        return column
    flat = rw.fresh(f"{like.output[0]}/flat operand", elem, [t * k, *shape[2:]])
    made.append(rw.make(like, "Reshape", [name, rw.axes_const(like, [t * k, *shape[2:]])], flat, "flat operand", **reshape))
    return flat


def _split_back(rw: _Rewrite, like: onnx.NodeProto, flat: str, out: list[int], reshape: dict[str, object]) -> onnx.NodeProto:
    shape = rw.fresh(f"{like.output[0]}/split shape", onnx.TensorProto.INT64, [len(out)])
    rw.constants[shape] = np.array(out, dtype=np.int64)
    return rw.make(like, "Reshape", [flat, shape], like.output[0], None, **reshape)


def _reshape_attrs(rw: _Rewrite, name: str) -> dict[str, object]:
    """The attributes of the Reshape making `name` (allowzero: part of the pairing signature, so the
    new reshapes are written as the program writes its own)."""
    node = rw.source(name)
    return {} if node is None else {a.name: helper.get_attribute_value(a) for a in node.attribute}


def split_rows_late(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """op(reshape(a, [T, K, ...]), b) = reshape(op(a, b'), [T, K, ...]) for an elementwise op and a
    per-route b (_route_operand), b' its flat rows (a [T K, ...] a: each row of the split is a row
    of a, and b's row (t, k) is b' row t K + k); the other operand order alike."""
    if node.op_type not in _ROW_BINARY or node.domain not in _ONNX or len(node.input) != 2:
        return None
    out, elem = rw.shape(node.output[0]), rw.elem(node.output[0])
    for i in (0, 1):
        split = _row_split(rw, node.input[i])
        if split is None or out is None or elem is None or rw.shape(node.input[i]) != out:
            continue
        a, t, k = split
        if not _route_operand(rw, node.input[1 - i], t, k):
            continue
        made: list[onnx.NodeProto] = []
        attrs = _reshape_attrs(rw, node.input[i])
        other = _flat_rows(rw, node, node.input[1 - i], t, k, len(out), made, attrs)
        if other is None:
            continue
        rows = rw.fresh(f"{node.output[0]}/rows", elem, [t * k, *out[2:]])
        made.append(rw.make(node, node.op_type, [a, other] if i == 0 else [other, a], rows, "rows"))
        back = _split_back(rw, node, rows, out, attrs)
        rw.late_splits.add(back.output[0])
        return made + [back]
    return None


def _past_same_shape_views(rw: _Rewrite, name: str) -> str:
    """`name`, or the tensor a chain of Reshapes to its own shape views (a DTensor program's view
    of a local tensor as itself, which the sequential program does not have)."""
    for _ in range(8):
        node = rw.source(name)
        if node is None or node.op_type != "Reshape" or node.domain not in _ONNX \
                or rw.shape(node.input[0]) is None or rw.shape(node.input[0]) != rw.shape(name):
            return name
        name = node.input[0]
    return name


def merge_rows_early(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """reshape(op(a, b), [T K, ...]) = op(a', b') for an elementwise op of [T, K, ...] operands, one
    of them per-route (a merge of the first two axes), a' and b' their flat rows."""
    if node.op_type != "Reshape" or node.domain not in _ONNX:
        return None
    inner = rw.source(_past_same_shape_views(rw, node.input[0]))
    xs, ys, elem = rw.shape(node.input[0]), rw.shape(node.output[0]), rw.elem(node.output[0])
    if inner is None or inner.op_type not in _ROW_BINARY or inner.domain not in _ONNX or len(inner.input) != 2 \
            or xs is None or ys is None or elem is None or len(xs) < 2 or ys != [xs[0] * xs[1], *xs[2:]]:
        return None
    if not any(_route_operand(rw, name, xs[0], xs[1]) for name in inner.input):
        return None
    made: list[onnx.NodeProto] = []
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    flat = [_flat_rows(rw, node, name, xs[0], xs[1], len(xs), made, attrs) for name in inner.input]
    if any(f is None for f in flat) or all(f == name for f, name in zip(flat, inner.input)):
        return None
    return made + [rw.make(node, inner.op_type, flat, node.output[0], None)]  # type: ignore[list-item]


def split_rows_reduced(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """reduce(reshape(a, [T, K, ...]), axes >= 2) = reshape(reduce(a, axes - 1), [T, K, ...]) (a sum,
    mean, max or min within each row), and a squeeze of axes >= 2 alike, for a split that
    split_rows_late moved (no other: each step of the move is one such split)."""
    if node.domain not in _ONNX or node.op_type not in (*_ROW_REDUCTIONS, "Squeeze"):
        return None
    split = _row_split(rw, node.input[0]) if rw.value(node.input[0]) in rw.late_splits else None
    out, elem = rw.shape(node.output[0]), rw.elem(node.output[0])
    if split is None or out is None or elem is None or len(node.input) < 2 or not node.input[1]:
        return None
    a, t, k = split
    rank = len(rw.shape(node.input[0]) or [])
    axes = rw.ints(node.input[1])
    if axes is None or not axes or any(not 2 <= x % rank < rank for x in axes) or out[:2] != [t, k]:
        return None
    rows = rw.fresh(f"{node.output[0]}/rows", elem, [t * k, *out[2:]])
    attrs = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    inner = rw.make(node, node.op_type, [a, rw.axes_const(node, [x % rank - 1 for x in axes])], rows, "rows", **attrs)
    back = _split_back(rw, node, rows, out, _reshape_attrs(rw, node.input[0]))
    rw.late_splits.add(back.output[0])
    return [inner, back]


def gather_nd_rows(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """GatherND(data, idx) with batch_dims 0 and idx's last axis of size 1 (torch's `table[ids]`
    for an index tensor: ids unsqueezed and concatenated into idx) is Gather(data, idx[..., 0],
    axis 0):  GatherND(data, idx)[p] = data[idx[p, 0]] = take(data, idx[..., 0])[p]."""
    if node.op_type != "GatherND" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    if any(a.name == "batch_dims" and helper.get_attribute_value(a) != 0 for a in node.attribute):
        return None
    ids = rw.shape(node.input[1])
    if ids is None or not ids or ids[-1] != 1:
        return None
    last = len(ids) - 1
    concat = rw.source(node.input[1])  # (the index built as concat([ids.unsqueeze(-1)], -1): read ids)
    if concat is not None and concat.op_type == "Concat" and len(concat.input) == 1:
        unsq = rw.source(concat.input[0])
        if unsq is not None and unsq.op_type == "Unsqueeze" and len(unsq.input) == 2 \
                and [a % len(ids) for a in (rw.ints(unsq.input[1]) or [-999])] == [last]:
            return [rw.make(node, "Gather", [node.input[0], unsq.input[0]], node.output[0], None, axis=0)]
    elem = rw.elem(node.input[1])
    if elem is None:
        return None
    flat = rw.fresh(f"{node.output[0]}/ids", elem, ids[:-1])
    return [rw.make(node, "Squeeze", [node.input[1], rw.axes_const(node, [last])], flat, "ids"),
            rw.make(node, "Gather", [node.input[0], flat], node.output[0], None, axis=0)]


_INDEX_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def _row_index_column(rw: _Rewrite, node: onnx.NodeProto, index: str, rows: list[int] | None,
                      width: int | None) -> str | None:
    """c, where `index` is expand(c, [N, width]) of a column c [N, 1] and the rows read or written
    are [N, width] (`rows`): the index of an element-wise scatter or gather along axis 0 of a
    2-D tensor that moves whole rows (torch's `idx[:, None].expand(-1, H)`)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("axis", 0) not in (0, -2) or rows is None or len(rows) != 2 or rows[1] != width:
        return None
    expand = rw.source(index)
    while expand is not None and expand.op_type == "Cast" and rw.elem(expand.input[0]) in _INDEX_TYPES:
        expand = rw.source(expand.input[0])  # (an index cast between integer types: the autograd backward's)
    if expand is None or expand.op_type != "Expand" or expand.domain not in _ONNX \
            or rw.shape(expand.output[0]) != rows or rw.shape(expand.input[0]) != [rows[0], 1]:
        return None
    return expand.input[0]


def scatter_rows(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """ScatterElements(data, expand(c, [N, H]), upd, axis 0) of a 2-D data [T, H], c [N, 1] and
    upd [N, H] (torch's `zeros.scatter_add_(0, idx[:, None].expand(-1, H), rows)`, an index_add)
    is ScatterND(data, c, upd) with the same reduction: element (n, h) of upd goes to
    data[c[n], h], so row n goes whole to row c[n]."""
    if node.op_type != "ScatterElements" or node.domain not in _ONNX or len(node.input) != 3:
        return None
    data = rw.shape(node.input[0])
    column = _row_index_column(rw, node, node.input[1], rw.shape(node.input[2]), data[1] if data and len(data) == 2 else None)
    if column is None:
        return None
    reduction = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "reduction"), b"none")
    return [rw.make(node, "ScatterND", [node.input[0], column, node.input[2]], node.output[0], None,
                    reduction=reduction.decode() if isinstance(reduction, bytes) else reduction)]


def gather_rows(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """GatherElements(data, expand(c, [N, H]), axis 0) of a 2-D data [T, H] and c [N, 1] (the
    backward of scatter_rows' scatter: torch's `grad.gather(0, idx[:, None].expand(-1, H))`) is
    Gather(data, c[:, 0], axis 0): element (n, h) is data[c[n], h], so row n is row c[n]."""
    if node.op_type != "GatherElements" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    data = rw.shape(node.input[0])
    column = _row_index_column(rw, node, node.input[1], rw.shape(node.output[0]), data[1] if data and len(data) == 2 else None)
    elem = rw.elem(column) if column else None
    if column is None or elem is None:
        return None
    rows = rw.shape(column)
    assert rows is not None
    flat = rw.fresh(f"{node.output[0]}/ids", elem, rows[:1])
    return [rw.make(node, "Squeeze", [column, rw.axes_const(node, [1])], flat, "ids"),
            rw.make(node, "Gather", [node.input[0], flat], node.output[0], None, axis=0)]


def castlike_as_cast(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """CastLike(x, like) = Cast(x, to=like's element type): the value depends on x alone, so a
    static x gives a static result (torch's `ones_like(labels)`: a constant CastLike'd to the
    labels' type, then expanded to their shape)."""
    if node.op_type != "CastLike" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    elem = rw.elem(node.input[1])
    if not elem:
        return None
    return [rw.make(node, "Cast", [node.input[0]], node.output[0], None, to=elem)]


# --- scalar factors: gathered after the products they scale ------------------------------------



def snapped(value: float) -> float:
    """A scalar factor as the number it stands for, where it is within 4 float32 ulps of a ratio
    p/q (q <= 256) or of sqrt(p/q) (p <= 16, q <= 65536): a division by sqrt(8) on one side and a
    product by 1/sqrt(8) on the other are one factor, though 1/x rounds differently from the
    constant written; the search is deterministic, so two spellings of one factor find the same number. (A number that close to such a simple
    one changes by less than its rounding error; one that is not keeps its value.)"""
    from fractions import Fraction

    if value == 0 or not np.isfinite(value):
        return value
    tol = 4 * float(np.spacing(np.float32(abs(value))))
    frac = Fraction(value).limit_denominator(256)
    if abs(float(frac) - value) <= tol:
        return float(frac)
    for p in range(1, 17):
        q = round(p / (value * value))
        if 0 < q <= 65536:
            root = float(np.sign(value)) * float(np.sqrt(p / q))
            if abs(root - value) <= tol:
                return root
    return value


def division_as_product(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """x / c = x * (1 / c) for a one-element float constant c (an attention's 1 / sqrt(d) written
    as a division on one side and a product on the other)."""
    if node.op_type != "Div" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    c, elem = rw.constants.get(node.input[1]), rw.elem(node.output[0])
    if c is None or c.size != 1 or c.dtype.kind != "f" or float(c.reshape(())) == 0 or elem not in FLOAT_TYPES \
            or rw.shape(node.input[0]) != rw.shape(node.output[0]):
        return None
    return [rw.make(node, "Mul", [node.input[0], rw.scalar_const(node, snapped(1.0 / float(c.reshape(()))), elem)],
                    node.output[0], None)]


# --- masks -------------------------------------------------------------------------------------


_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Where", "And", "Or", "Xor", "Equal",
                 "Less", "LessOrEqual", "Greater", "GreaterOrEqual")
_SHAPE_VIEWS = ("Expand", "Unsqueeze", "Reshape", "Squeeze", "Flatten", "Identity")


_FACTOR_VIEWS = (*_SHAPE_VIEWS, "Transpose")  # (a scalar factor commutes with each)


def _scaled_views(rw: _Rewrite, name: str) -> tuple[str, list[onnx.NodeProto], float] | None:
    """(x, views, c) when `name` is views(x * c): a chain of _FACTOR_VIEWS over a Mul of x by a
    one-element float constant c that keeps x's shape."""
    views: list[onnx.NodeProto] = []
    node = rw.producer.get(name)
    while node is not None and node.op_type in _FACTOR_VIEWS and node.domain in _ONNX:
        views.append(node)
        node = rw.producer.get(node.input[0])
    if node is None or node.op_type != "Mul" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    for k in (0, 1):
        c, x = rw.constants.get(node.input[1 - k]), node.input[k]
        if c is not None and c.size == 1 and c.dtype.kind == "f" and rw.shape(x) is not None \
                and rw.shape(x) == rw.shape(node.output[0]):
            return x, views[::-1], float(c.reshape(()))
    return None


def split_scale_product(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """views(a c1) @ views(b c2) = (views(a) @ views(b)) (c1 c2), c1 c2 snapped: SDPA scales q and k
    each by the square root of its scale before their product, where explicit attention divides
    the product once. Only where both operands carry a factor (SDPA's signature, the same on every
    side that calls it); the views are rebuilt over the unscaled operands (the scaled ones stay
    for their other readers)."""
    if node.op_type != "MatMul" or node.domain not in _ONNX or (out := rw.shape(node.output[0])) is None \
            or (elem := rw.elem(node.output[0])) not in FLOAT_TYPES:
        return None
    found = [_scaled_views(rw, name) for name in node.input]
    if any(f is None for f in found):
        return None
    made: list[onnx.NodeProto] = []
    operands: list[str] = []
    for x, views, _c in found:  # type: ignore[misc]
        for view in views:
            shape = rw.shape(view.output[0])
            if shape is None:
                return None
            y = rw.fresh(f"{view.output[0]} (unscaled)", elem, shape)
            attrs = {a.name: helper.get_attribute_value(a) for a in view.attribute}
            made.append(rw.make(view, view.op_type, [x, *view.input[1:]], y, "unscaled", **attrs))
            x = y
        operands.append(x)
    product = rw.fresh(f"{node.output[0]} (unscaled)", elem, out)
    made.append(rw.make(node, "MatMul", operands, product, "unscaled"))
    factor = snapped(found[0][2] * found[1][2])  # type: ignore[index]
    made.append(rw.make(node, "Mul", [product, rw.scalar_const(node, factor, elem)], node.output[0], None))
    return made


def _one_element_root(rw: _Rewrite, name: str) -> str | None:
    """The one-element tensor that `name` is a view or broadcast of (through Expand, Unsqueeze,
    Reshape, Squeeze, Flatten, Identity), if any."""
    at = name
    while (node := rw.producer.get(at)) is not None and node.op_type in _SHAPE_VIEWS and node.domain in _ONNX:
        at = node.input[0]
        if (shape := rw.shape(at)) is not None and prod(shape) == 1:
            return at
    return None


def scalar_operand(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """x op expand(s) = x op s for a one-element s, where the other operands already give the
    output its shape (a broadcast scalar has its one value everywhere): a sum's gradient
    expanded to the rank's rows and then masked, against the sequential mean's gradient, a
    scalar, masked directly (`F.cross_entropy(..., reduction="none").sum()` vs its mean)."""
    if node.op_type not in _BROADCASTING or node.domain not in _ONNX or (out := rw.shape(node.output[0])) is None:
        return None
    inputs = list(node.input)
    for k, name in enumerate(node.input):
        root = _one_element_root(rw, name)
        trial = [*inputs[:k], root, *inputs[k + 1:]]
        shapes = [rw.shape(x) for x in trial] if root is not None else [None]
        if any(shape is None for shape in shapes):
            continue
        try:
            if list(np.broadcast_shapes(*(tuple(shape) for shape in shapes))) == out:
                inputs = trial
        except ValueError:
            continue
    if inputs == list(node.input):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return [rw.make(node, node.op_type, inputs, node.output[0], None, **attrs)]


_NEGATED = {"Less": "GreaterOrEqual", "LessOrEqual": "Greater", "Greater": "LessOrEqual", "GreaterOrEqual": "Less"}


def negated_comparison(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """not (a <= b) = a > b, and likewise for <, >, >= (integers only: a NaN fails every test,
    so over floats not(a <= b) is not a > b). A mask spelled `~(cols - rows <= k)` on one side
    and `cols - rows > k` on the other is one comparison, which the mask forms relate."""
    if node.op_type != "Not" or node.domain not in _ONNX:
        return None
    test = rw.source(node.input[0])
    if test is None or test.op_type not in _NEGATED or test.domain not in _ONNX or len(test.input) != 2 \
            or any(rw.elem(x) not in _INT_TYPES for x in test.input):
        return None
    return [rw.make(node, _NEGATED[test.op_type], list(test.input), node.output[0], None)]


def additive_mask(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """x + where(c, 0, -inf) = where(c, x, -inf) for finite x (an attention mask added as a bias,
    SDPA's, against one applied by masked_fill). (`where(not c, a, b) = where(c, b, a)` was left
    out: the ring attention's rules read its mask as written, with the Not.)"""
    if node.domain not in _ONNX:
        return None
    if node.op_type != "Add" or len(node.input) != 2 or rw.elem(node.output[0]) not in FLOAT_TYPES:
        return None
    for k in (0, 1):
        bias = rw.source(node.input[1 - k])
        if bias is None or bias.op_type != "Where" or bias.domain not in _ONNX or len(bias.input) != 3:
            continue
        zero, ninf = rw.constants.get(bias.input[1]), rw.constants.get(bias.input[2])
        if zero is None or ninf is None or zero.size != 1 or ninf.size != 1 or float(zero.reshape(())) != 0.0 \
                or float(ninf.reshape(())) != -np.inf or rw.shape(node.input[k]) != rw.shape(node.output[0]):
            continue
        return [rw.make(node, "Where", [bias.input[0], node.input[k], bias.input[2]], node.output[0], None)]
    return None


def masked_test(rw: _Rewrite, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Equal(where(c, x, k), k) = not c for k = +-inf and finite x (values are real numbers):
    SDPA's test for a fully masked row reads the mask back off the masked scores, so with a
    static mask the test is static too (and folds)."""
    if node.op_type != "Equal" or node.domain not in _ONNX or len(node.input) != 2:
        return None
    for k in (0, 1):
        masked, inf = rw.source(node.input[k]), rw.constants.get(node.input[1 - k])
        if masked is None or masked.op_type != "Where" or masked.domain not in _ONNX or inf is None or inf.size != 1 \
                or not np.isinf(float(inf.reshape(()))):
            continue
        fill = rw.constants.get(masked.input[2])
        cond, out = rw.shape(masked.input[0]), rw.shape(node.output[0])
        if fill is None or fill.size != 1 or float(fill.reshape(())) != float(inf.reshape(())) or cond is None \
                or out is None or rw.shape(masked.input[1]) != out or rw.elem(masked.input[0]) is None:
            continue
        if cond == out:
            return [rw.make(node, "Not", [masked.input[0]], node.output[0], None)]
        # (the mask broadcast to the scores' shape first, as the Where broadcast it)
        wide = rw.fresh(f"{node.output[0]}/mask", rw.elem(masked.input[0]) or 9, out)
        shape = rw.fresh(f"{node.output[0]}/shape", onnx.TensorProto.INT64, [len(out)])
        rw.constants[shape] = np.array(out, dtype=np.int64)
        return [rw.make(node, "Expand", [masked.input[0], shape], wide, "mask"),
                rw.make(node, "Not", [wide], node.output[0], None)]
    return None


# Passes in order: a later pass sees what the earlier one made (the keepdims of a reduction is
# settled before a mean becomes a sum, so that the Squeeze after it still meets the reduction).
PASSES: tuple[tuple[Rule, ...], ...] = (
    (nonnegative_axes, squeezed_reduction, gather_nd_rows, scatter_rows, gather_rows, castlike_as_cast, negated_comparison,
     scalar_operand, split_rows_late, merge_rows_early, split_rows_reduced),
    (log_softmax_parts, log_softmax_pick, log_softmax_sum, squeeze_difference, negated_difference, added_back,
     mean_as_sum, division_as_product, additive_mask, masked_test, split_scale_product),
)


def _carry_constant(rw: _Rewrite, node: onnx.NodeProto) -> None:
    """The value of a cast or a view of a small constant (`torch.tensor(0.0)` cast to the scores'
    type; axes [0] reshaped to [1]), for the rules that read constants."""
    value = rw.constants[node.input[0]]
    if node.op_type == "Cast":
        to = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "to"), None)
        if to:
            rw.constants[node.output[0]] = value.astype(helper.tensor_dtype_to_np_dtype(to))
    elif node.op_type == "Identity":
        rw.constants[node.output[0]] = value
    elif node.op_type in ("Reshape", "Squeeze", "Unsqueeze", "Flatten"):
        shape = rw.shape(node.output[0])
        if shape is not None and int(np.prod(shape)) == value.size:
            rw.constants[node.output[0]] = value.reshape(shape)


def normalize(model: onnx.ModelProto, types: Types, passes: tuple[tuple[Rule, ...], ...] = PASSES,
              declared: frozenset[str] = frozenset()) -> onnx.ModelProto:
    """`model` with every pass's rules applied wherever they match; `model` itself when nothing
    matches. No rule reads the value of a `declared` initializer (or of a graph input's default)."""
    for rules in passes:
        rewritten = _apply(model, types, rules, declared)
        if rewritten is not model:
            model, types = rewritten, {**types, **{vi.name: vi.type for vi in rewritten.graph.value_info}}
    return model


def _apply(model: onnx.ModelProto, types: Types, rules: tuple[Rule, ...], declared: frozenset[str]) -> onnx.ModelProto:
    """One pass: nodes in order, each rewritten by the first rule that matches, each new node
    offered to every rule again."""
    graph = model.graph
    rw = _Rewrite(graph, dict(types))
    rw.names = {vi.name for vi in [*graph.input, *graph.output, *graph.value_info]} | {i.name for i in graph.initializer}
    rw.names |= {o for n in graph.node for o in n.output}
    inputs = {i.name for i in graph.input} | declared  # (an input's initializer is a default: any value may come)
    for init in graph.initializer:
        if prod(init.dims) <= 64 and init.name not in inputs:
            rw.constants[init.name] = numpy_helper.to_array(init)
    changed = False

    def emit(node: onnx.NodeProto) -> None:
        nonlocal changed
        if node.op_type == "Constant" and node.domain in _ONNX and node.output:
            value = constant_value(node)
            if value is not None and value.size <= 64:
                rw.constants[node.output[0]] = value
        elif node.domain in _ONNX and node.input and node.input[0] in rw.constants:
            _carry_constant(rw, node)
        for rule in rules:
            made = rule(rw, node)
            if made:
                changed = True
                for new in made:
                    emit(new)
                return
        rw.nodes.append(node)
        for out in node.output:
            rw.producer[out] = node

    for node in graph.node:
        emit(node)
    if not changed:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    present = {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}
    consts = [helper.make_node("Constant", [], [name], name=f"{name}/const", value=numpy_helper.from_array(value, name))
              for name, value in rw.constants.items() if name not in present]
    for c in consts:
        c.metadata_props.add(key=INSERTED_KEY, value="inserted")
    out.graph.node.extend(consts + rw.nodes)
    out.graph.value_info.extend(rw.value_info)
    return out


def lowered_form(model: onnx.ModelProto, declared: Iterable[str] = ()) -> onnx.ModelProto:
    """The program lowering reads, from a shape-inferred model: Gemm expanded (canonical.py),
    then the normal forms above. The witnesses simulate this form (refine/kit/cases.py), so that
    a relation of a tensor a rewrite made is checked on numbers too, and tests/test_normal_forms.py
    checks that it computes every tensor of the input model as the input model does. `declared`:
    the initializers refine.json declares (parameters, buffers): inputs, whatever value the file holds."""
    expanded = canonical.canonicalize(model, value_types(model.graph))
    return normalize(expanded, value_types(expanded.graph), declared=frozenset(declared))
