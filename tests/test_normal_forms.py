"""The normal forms (refine/lowering/normal_forms.py) rewrite a program into one that computes
every tensor of the original exactly as the original does: each rule is applied to a small
program with random inputs, and the rewritten program (what lowering reads, and what the
witnesses simulate) is run beside the original; every original tensor must agree. A rule that
does not fire leaves the program as it was (each case asserts that its rule fired)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from refine.diagnose.simulate import evaluate
from refine.lowering.canonical import INSERTED_KEY
from refine.lowering.normal_forms import lowered_form, snapped
from refine.lowering.shapes import infer_shapes

RNG = np.random.default_rng(5)
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(value), name))


def model(nodes: list[onnx.NodeProto], inputs: dict[str, tuple[int, list[int]]], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return infer_shapes(m, Path("<test>"), 1)


def every_value(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o for n in m.graph.node for o in n.output if o]
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return dict(zip(names, evaluate(probe, feeds)))


def assert_same_values(m: onnx.ModelProto, feeds: dict[str, np.ndarray], fired: str) -> onnx.ModelProto:
    """The lowered form computes every tensor of `m` as `m` does, and the rule named `fired`
    rewrote something (its new nodes carry the original's name)."""
    lowered = lowered_form(m)
    assert lowered is not m, f"no rule fired ({fired})"
    before, after = every_value(m, feeds), every_value(lowered, feeds)
    for name, value in before.items():
        assert name in after, name
        np.testing.assert_allclose(after[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(n.op_type == fired for n in lowered.graph.node if not any(p.key == INSERTED_KEY for p in n.metadata_props)) \
        or any(p.key == INSERTED_KEY for n in lowered.graph.node for p in n.metadata_props), fired
    return lowered


def ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def test_log_softmax_its_pick_and_its_sum() -> None:
    """log_softmax(x) = (x - m) - log sum exp(x - m); its target pick and its sum over the axis
    taken apart (cross-entropy, label smoothing)."""
    x = RNG.standard_normal((4, 7)).astype(np.float32)
    labels = RNG.integers(0, 7, (4, 1))
    m = model([helper.make_node("LogSoftmax", ["x"], ["lp"], axis=-1),
               helper.make_node("GatherElements", ["lp", "idx"], ["picked"], axis=1),
               const("ax", np.array([1])), helper.make_node("ReduceSum", ["lp", "ax"], ["total"], keepdims=0),
               helper.make_node("Squeeze", ["picked", "ax"], ["sq"]), helper.make_node("Neg", ["sq"], ["nll"])],
              {"x": (F, [4, 7]), "idx": (I64, [4, 1])}, ["nll", "total"])
    lowered = assert_same_values(m, {"x": x, "idx": labels}, "Sub")
    assert "LogSoftmax" not in ops(lowered) and "Neg" not in ops(lowered)


def test_reductions_means_and_squeezes() -> None:
    """mean = sum * (1/n); squeeze(reduce(keepdims=1)) = reduce(keepdims=0); negative axes made
    non-negative."""
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    m = model([helper.make_node("ReduceMean", ["x"], ["mean_all"], keepdims=1),
               helper.make_node("Squeeze", ["mean_all"], ["scalar"]),
               const("neg", np.array([-1])), helper.make_node("ReduceMax", ["x", "neg"], ["rowmax"], keepdims=0)],
              {"x": (F, [3, 5])}, ["scalar", "rowmax"])
    lowered = assert_same_values(m, {"x": x}, "Mul")
    assert "ReduceMean" not in ops(lowered)


@pytest.mark.parametrize("noop", [0, 1])
def test_a_mean_over_an_empty_axes_list(noop: int) -> None:
    """An empty axes input means every axis (noop_with_empty_axes 0: a loss's mean over its tokens,
    torch's `.mean()`), or none (1: the input itself): never a mean over nothing divided by 1."""
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    m = model([const("none", np.array([], dtype=np.int64)),
               helper.make_node("ReduceMean", ["x", "none"], ["mean"], keepdims=0, noop_with_empty_axes=noop),
               helper.make_node("Relu", ["mean"], ["y"])], {"x": (F, [3, 5])}, ["y"])
    lowered = lowered_form(m)
    before, after = every_value(m, {"x": x}), every_value(lowered, {"x": x})
    np.testing.assert_allclose(after["y"], before["y"], rtol=1e-5, atol=1e-6)
    assert ("ReduceMean" in ops(lowered)) == bool(noop)


def test_differences_added_back_and_negated() -> None:
    """x + (y - x) = y (b + (b / k - b).detach()), -(a - b) = b - a, squeeze of a difference."""
    x, y = RNG.standard_normal((2, 3)).astype(np.float32), RNG.standard_normal((2, 3)).astype(np.float32)
    m = model([helper.make_node("Sub", ["y", "x"], ["d"]), helper.make_node("Identity", ["d"], ["detached"]),
               helper.make_node("Add", ["x", "detached"], ["back"]), helper.make_node("Neg", ["d"], ["neg"])],
              {"x": (F, [2, 3]), "y": (F, [2, 3])}, ["back", "neg"])
    lowered = assert_same_values(m, {"x": x, "y": y}, "Identity")
    assert "Neg" not in ops(lowered)


def test_scalar_factors_gathered_after_products() -> None:
    """(q c1) @ view(k c2) = (q @ view(k)) (c1 c2), x / c = x (1/c): SDPA's split scale and an
    explicit attention's division meet as one factor."""
    q, k = RNG.standard_normal((2, 4, 3)).astype(np.float32), RNG.standard_normal((2, 4, 3)).astype(np.float32)
    half = math.sqrt(1 / math.sqrt(3))
    m = model([const("c", np.float32(half)), helper.make_node("Mul", ["q", "c"], ["qs"]),
               helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), helper.make_node("Mul", ["kt", "c"], ["kts"]),
               helper.make_node("MatMul", ["qs", "kts"], ["scores"]),
               const("d", np.float32(math.sqrt(3))), helper.make_node("MatMul", ["q", "kt"], ["raw"]),
               helper.make_node("Div", ["raw", "d"], ["explicit"])],
              {"q": (F, [2, 4, 3]), "k": (F, [2, 4, 3])}, ["scores", "explicit"])
    lowered = assert_same_values(m, {"q": q, "k": k}, "Mul")
    factors = {n.output[0]: float(numpy_helper.to_array(a.t)) for n in lowered.graph.node if n.op_type == "Constant"
               for a in n.attribute if a.name == "value" and n.output[0].endswith("/scale")}
    makers = {n.output[0]: n for n in lowered.graph.node}
    for out in ("scores", "explicit"):  # each a product of an unscaled MatMul and one factor, 1/sqrt(3) snapped
        node = makers[out]
        assert node.op_type == "Mul" and makers[node.input[0]].op_type == "MatMul", out
        assert factors[node.input[1]] == float(np.float32(1 / math.sqrt(3))) or \
            np.float32(factors[node.input[1]]) == np.float32(1 / math.sqrt(3)), out
    assert {factors[makers[o].input[1]] for o in ("scores", "explicit")} == {factors[makers["scores"].input[1]]}


def test_declared_initializers_are_not_constants() -> None:
    """A scalar initializer refine.json declares (a parameter, a buffer: gemma's embed_scale) or
    that is also a graph input is an input whatever the file holds: no rule reads its value (a
    rank's factor hoisted out of a collective while the other side's value is unknown)."""
    c = numpy_helper.from_array(np.asarray(8.0, dtype=np.float32), "scale")
    for declared, as_input in ((["scale"], False), ([], True)):
        inputs = {"x": (F, [2, 3]), **({"scale": (F, [])} if as_input else {})}
        m = model([helper.make_node("Mul", ["x", "scale"], ["y"]), helper.make_node("Transpose", ["y"], ["z"], perm=[1, 0])],
                  inputs, ["z"])
        m.graph.initializer.append(c)
        lowered = lowered_form(m, declared)
        assert [n.op_type for n in lowered.graph.node] == ["Mul", "Transpose"], (declared, as_input)


def test_masks() -> None:
    """x + where(c, 0, -inf) = where(c, x, -inf); (where(c, x, -inf) == -inf) = not c. (Two
    transposes stay two and where(not c, ..) keeps its Not: a rank's pair may sit across a call.)"""
    x = RNG.standard_normal((2, 3, 3)).astype(np.float32)
    mask = np.tril(np.ones((3, 3), dtype=bool))
    m = model([const("zero", np.float32(0)), const("ninf", np.float32(-np.inf)), const("mask", mask),
               helper.make_node("Where", ["mask", "zero", "ninf"], ["bias"]), helper.make_node("Add", ["x", "bias"], ["masked"]),
               helper.make_node("Equal", ["masked", "ninf"], ["gone"]), helper.make_node("Not", ["mask"], ["nm"]),
               helper.make_node("Where", ["nm", "ninf", "x"], ["filled"]),
               helper.make_node("Transpose", ["x"], ["t1"], perm=[2, 0, 1]), helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 2, 0])],
              {"x": (F, [2, 3, 3])}, ["masked", "gone", "filled", "t2"])
    lowered = assert_same_values(m, {"x": x}, "Where")
    assert "Add" not in ops(lowered) and ops(lowered).count("Transpose") == 2 and "Not" in ops(lowered)


@pytest.mark.parametrize("test,negated", [("LessOrEqual", "Greater"), ("Less", "GreaterOrEqual"),
                                           ("Greater", "LessOrEqual"), ("GreaterOrEqual", "Less")])
def test_negated_integer_comparison(test: str, negated: str) -> None:
    """not (a <= b) = a > b (and <, >, >=) on integers, ties included; a float comparison's Not
    stays (a NaN fails every test)."""
    a, b = RNG.integers(-3, 4, (4, 5)), RNG.integers(-3, 4, (4, 5))
    m = model([helper.make_node(test, ["a", "b"], ["t"]), helper.make_node("Not", ["t"], ["n"]),
               helper.make_node(test, ["x", "y"], ["tf"]), helper.make_node("Not", ["tf"], ["nf"])],
              {"a": (I64, [4, 5]), "b": (I64, [4, 5]), "x": (F, [4, 5]), "y": (F, [4, 5])}, ["n", "nf"])
    x = RNG.standard_normal((4, 5)).astype(np.float32)
    lowered = assert_same_values(m, {"a": a, "b": b, "x": x, "y": x[::-1].copy()}, negated)
    assert [n.op_type for n in lowered.graph.node if n.output[0] == "n"] == [negated]
    assert [n.op_type for n in lowered.graph.node if n.output[0] == "nf"] == ["Not"]


def test_broadcast_scalar_operand() -> None:
    """where(c, unsqueeze(expand(s, [n])), 0) = where(c, s, 0) for a one-element s when c gives
    the output its shape; an expanded operand that shapes the output is left alone."""
    s = np.float32(0.37)
    c = RNG.standard_normal((4, 1)) > 0
    m = model([const("s", s), const("zero", np.float32(0)), const("n", np.array([4])), const("ax", np.array([1])),
               helper.make_node("Expand", ["s", "n"], ["e"]), helper.make_node("Unsqueeze", ["e", "ax"], ["u"]),
               helper.make_node("Where", ["c", "u", "zero"], ["masked"]),
               const("wide", np.array([3, 4, 1])), helper.make_node("Expand", ["s", "wide"], ["w"]),
               helper.make_node("Mul", ["w", "c_f"], ["shaped"])],
              {"c": (BOOL, [4, 1]), "c_f": (F, [4, 1])}, ["masked", "shaped"])
    lowered = assert_same_values(m, {"c": c, "c_f": c.astype(np.float32)}, "Where")
    where = next(n for n in lowered.graph.node if n.output[0] == "masked")
    assert list(where.input) == ["c", "s", "zero"]
    assert next(n for n in lowered.graph.node if n.output[0] == "shaped").input[0] == "w"


def test_indexing_and_cast_like() -> None:
    """table[ids] (GatherND of ids[..., None]) = Gather(table, ids); CastLike(x, like) = Cast(x)."""
    table = RNG.standard_normal((6, 4)).astype(np.float32)
    ids = RNG.integers(0, 6, (2, 3))
    m = model([const("last", np.array([-1])), helper.make_node("Unsqueeze", ["ids", "last"], ["u"]),
               helper.make_node("Concat", ["u"], ["idx"], axis=-1), helper.make_node("GatherND", ["table", "idx"], ["rows"]),
               const("one", np.int64(1)), helper.make_node("CastLike", ["one", "table"], ["onef"])],
              {"table": (F, [6, 4]), "ids": (I64, [2, 3])}, ["rows", "onef"])
    lowered = assert_same_values(m, {"table": table, "ids": ids}, "Gather")
    assert "GatherND" not in ops(lowered) and "CastLike" not in ops(lowered)


@pytest.mark.parametrize("reduction", ["add", "none"])
def test_whole_rows_scattered(reduction: str) -> None:
    """zeros.scatter_add_(0, ids[:, None].expand(-1, H), rows) = ScatterND(zeros, ids[:, None], rows)."""
    rows = RNG.standard_normal((5, 3)).astype(np.float32)
    ids = RNG.permutation(6)[:5] if reduction == "none" else RNG.integers(0, 6, 5)
    m = model([const("col", np.array([1])), helper.make_node("Unsqueeze", ["ids", "col"], ["c"]),
               const("shape", np.array([5, 3])), helper.make_node("Expand", ["c", "shape"], ["idx"]),
               const("zeros", np.zeros((6, 3), np.float32)),
               helper.make_node("ScatterElements", ["zeros", "idx", "rows"], ["out"], axis=0, reduction=reduction)],
              {"rows": (F, [5, 3]), "ids": (I64, [5])}, ["out"])
    lowered = assert_same_values(m, {"rows": rows, "ids": ids}, "ScatterND")
    assert "ScatterElements" not in ops(lowered)


def test_whole_rows_gathered() -> None:
    """grad.gather(0, ids[:, None].expand(-1, H)) = Gather(grad, ids, axis 0)."""
    grad = RNG.standard_normal((6, 3)).astype(np.float32)
    ids = RNG.integers(0, 6, 5)
    m = model([const("col", np.array([1])), helper.make_node("Unsqueeze", ["ids", "col"], ["c"]),
               const("shape", np.array([5, 3])), helper.make_node("Expand", ["c", "shape"], ["idx"]),
               helper.make_node("GatherElements", ["grad", "idx"], ["rows"], axis=0)],
              {"grad": (F, [6, 3]), "ids": (I64, [5])}, ["rows"])
    lowered = assert_same_values(m, {"grad": grad, "ids": ids}, "Gather")
    assert "GatherElements" not in ops(lowered)


@pytest.mark.parametrize("value,expected", [(0.125, 0.125), (1 / 6, 1 / 6), (float(np.float32(1 / math.sqrt(8))), 1 / math.sqrt(8)),
                                            (float(np.float32(math.sqrt(1 / math.sqrt(8))) ** 2), 1 / math.sqrt(8)),
                                            (0.0314159265, 0.0314159265), (1e-5, 1e-5), (float(np.float32(1 / math.sqrt(4096))), 1 / 64)])
def test_factors_snap_to_the_number_they_stand_for(value: float, expected: float) -> None:
    """Within 4 float32 ulps of p/q or sqrt(p/q) (q <= 4096): that number; else the value itself."""
    assert snapped(value) == pytest.approx(expected, rel=1e-12)


def test_rows_weighted_after_their_split() -> None:
    """reshape(x, [T, K, H]) * w[..., None] = reshape(x * reshape(w, [T K])[:, None], [T, K, H]),
    either operand order; a reshape that is no split of the rows, or weights of another shape, are
    left alone."""
    x, w = RNG.standard_normal((6, 4)).astype(np.float32), RNG.standard_normal((3, 2)).astype(np.float32)
    shape, last = np.array([3, 2, 4]), np.array([-1])
    m = model([const("shape", shape), const("last", last), helper.make_node("Reshape", ["x", "shape"], ["xs"]),
               helper.make_node("Unsqueeze", ["w", "last"], ["wc"]), helper.make_node("Mul", ["xs", "wc"], ["y"]),
               helper.make_node("Mul", ["wc", "xs"], ["y2"])],
              {"x": (F, [6, 4]), "w": (F, [3, 2])}, ["y", "y2"])
    lowered = assert_same_values(m, {"x": x, "w": w}, "Reshape")
    made = {o: n.op_type for n in lowered.graph.node for o in n.output}
    assert made["y"] == made["y2"] == "Reshape"
    other = model([const("shape", shape), const("last", last), helper.make_node("Reshape", ["x", "shape"], ["xs"]),
                   helper.make_node("Unsqueeze", ["w", "last"], ["wc"]), helper.make_node("Mul", ["xs", "wc"], ["y"])],
                  {"x": (F, [4, 6]), "w": (F, [3, 2])}, ["y"])  # (x's rows are not split: its columns are)
    assert {n.output[0]: n.op_type for n in lowered_form(other).graph.node}["y"] == "Mul"


def test_rows_split_late_merged_early_and_reduced_flat() -> None:
    """A merge of [T, K] rows moves before an elementwise op; a reduction and a squeeze of the
    other axes move past a split; a sum over K itself stays after it."""
    x, g, w = (RNG.standard_normal(s).astype(np.float32) for s in ((6, 4), (3, 4), (3, 2)))
    m = model([const("split", np.array([3, 2, 4])), const("flat", np.array([6, 4])), const("last", np.array([2])),
               const("one", np.array([1])), const("full", np.array([3, 2, 4])),
               helper.make_node("Unsqueeze", ["g", "one"], ["gu"]), helper.make_node("Expand", ["gu", "full"], ["ge"]),
               helper.make_node("Unsqueeze", ["w", "last"], ["wc"]),
               helper.make_node("Mul", ["ge", "wc"], ["gw"]), helper.make_node("Reshape", ["gw", "flat"], ["merged"]),
               helper.make_node("Reshape", ["x", "split"], ["xs"]), helper.make_node("Mul", ["ge", "xs"], ["prod"]),
               helper.make_node("ReduceSum", ["prod", "last"], ["red"], keepdims=1),
               helper.make_node("Squeeze", ["red", "last"], ["sq"]),
               helper.make_node("ReduceSum", ["xs", "one"], ["tokens"], keepdims=0)],
              {"x": (F, [6, 4]), "g": (F, [3, 4]), "w": (F, [3, 2])}, ["merged", "sq", "tokens"])
    lowered = assert_same_values(m, {"x": x, "g": g, "w": w}, "Mul")
    made = {o: n.op_type for n in lowered.graph.node for o in n.output}
    assert made["merged"] == "Mul" and made["red"] == "Reshape" and made["sq"] == "Reshape", made
    assert made["tokens"] == "ReduceSum", made
