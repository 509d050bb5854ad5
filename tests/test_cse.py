"""Lowering merges repeated computations (refine/lowering/cse.py), and pairing seeds from one input per
node (rules/core.lp), so that a flat stack of layers reading shared tensors (rotary tables,
masks) costs linear work in depth. Merging must be exact: only identical deterministic nodes,
never collectives or random ops, and what it merges must still hold on the numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
from onnx import TensorProto, helper, numpy_helper

from harness import Case, Graph, run_case, shard
from refine import dist
from refine.lowering import cse
from refine.run.engine import Probe
from refine.lowering.graphs import lower_models

B, H, W, LAYERS = 2, 3, 8, 4


def _stack(rank: int | None, tp: int = 2, scale_of: dict[int, float] | None = None, layers: int = LAYERS) -> Graph:
    """h = x; per layer: u = Unsqueeze(c, Constant[0]) * Constant(scale); h = h + h * u, where c
    is shared by every layer (each layer makes its own axes and scale Constant nodes, as
    exporters do). Ranks hold x and c sharded on the last axis."""
    g = Graph()
    width = W if rank is None else W // tp
    h = g.input("x", [B, H, width])
    c = g.input("c", [H, width])
    for layer in range(layers):
        axes = g.op("Constant", value=numpy_helper.from_array(np.array([0], np.int64)))
        scale = (scale_of or {}).get(layer, 1.5)
        k = g.op("Constant", value=numpy_helper.from_array(np.array(scale, np.float32)))
        u = g.op("Mul", g.op("Unsqueeze", c, axes), k)
        h = g.op("Add", h, g.op("Mul", h, u))
    g.output(h)
    return g


def _case(name: str, ranks: list[Graph], layers: int = LAYERS) -> Case:
    return Case(name, _stack(None, layers=layers), ranks, {"x": shard(2), "c": shard(1)}, outputs={})


def test_repeated_computations_merge_and_every_relation_holds():
    case = _case("cse", [_stack(r) for r in range(2)])
    outcome = run_case(case)
    assert outcome.report.verdict == "verified"
    assert outcome.checked.ok, outcome.checked.violations[:3]
    facts = lower_models(case.loaded())
    unsqueezes = [(g, n) for g, n, op in facts.rows["node"] if op == "Unsqueeze"]
    assert sorted(g for g, _ in unsqueezes) == ["r0", "r1", "seq"]  # one per graph, not one per layer


def test_a_node_reading_a_shared_tensor_pairs_with_its_own_layer_only():
    """Past 8 readers (rules/core.lp) a shared tensor seeds no pair."""
    deep = 12
    facts = lower_models(_case("cse", [_stack(r, layers=deep) for r in range(2)], layers=deep).loaded())
    pairs = Probe(facts).ask("", "pair", 3)
    ops = {n: op for _g, n, op in facts.rows["node"]}
    muls = [(str(n.value), str(g.value)) for n, _m, g in pairs if ops[str(n.value)] == "Mul"]
    seq_muls = {n for g, n, op in facts.rows["node"] if g == "seq" and op == "Mul"}
    # every seq Mul pairs exactly once per rank: h * u with its own layer's h, never another
    # layer's (seeding from the shared u would pair each with all LAYERS of them)
    assert len(seq_muls) > deep and len(muls) == len(set(muls)) == 2 * len(seq_muls)


def test_a_layer_whose_constant_differs_on_one_rank_is_not_merged_and_not_verified():
    """Rank 1's layer 2 scales by 2.0 where every other layer scales by 1.5: its Constant node is
    not identical, so it is not merged into layer 0's, and the stack must not verify."""
    case = _case("cse_bug", [_stack(0), _stack(1, scale_of={2: 2.0})])
    outcome = run_case(case)
    assert outcome.report.verdict != "verified"
    assert outcome.checked.ok, outcome.checked.violations[:3]


def _model(nodes: list[onnx.NodeProto], outputs: list[str]) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                 for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), dist.dist_opset()])


def _merged(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in cse.merge_duplicates(model).graph.node if cse.merged(n)]


def _const(name: str, value: object, dtype: type = np.float32) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name,
                            value=numpy_helper.from_array(np.asarray(value, dtype=dtype), f"{name}_value"))


def test_identical_nodes_merge_and_readers_move_to_the_first():
    nodes = [_const("k1", 2.0), _const("k2", 2.0), helper.make_node("Mul", ["x", "k1"], ["a"], name="a"),
             helper.make_node("Mul", ["x", "k2"], ["b"], name="b"), helper.make_node("Add", ["a", "b"], ["y"], name="y")]
    model = _model(nodes, ["y"])
    merged = cse.merge_duplicates(model)
    assert [n.name for n in merged.graph.node if cse.merged(n)] == ["k2", "b"]
    assert list(merged.graph.node[-1].input) == ["a", "a"]
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    before = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x})[0]
    after = onnx.reference.ReferenceEvaluator(merged).run(None, {"x": x})[0]
    np.testing.assert_array_equal(before, after)


def test_what_is_never_merged():
    group = [0, 1]
    cases = {
        "collectives": [dist.all_reduce("x", "a", group, name="a"), dist.all_reduce("x", "b", group, name="b")],
        "random": [helper.make_node("RandomNormalLike", ["x"], ["a"], name="a", seed=1.0),
                   helper.make_node("RandomNormalLike", ["x"], ["b"], name="b", seed=1.0)],
        "other constant value": [_const("k1", 2.0), _const("k2", 3.0)],
        "other dtype": [_const("k1", 2, np.int64), _const("k2", 2, np.int32)],
        "other attribute": [helper.make_node("LeakyRelu", ["x"], ["a"], name="a", alpha=0.1),
                            helper.make_node("LeakyRelu", ["x"], ["b"], name="b", alpha=0.2)],
        "other input order": [helper.make_node("Sub", ["x", "x2"], ["a"], name="a"),
                              helper.make_node("Sub", ["x2", "x"], ["b"], name="b")],
    }
    for what, nodes in cases.items():
        reader = helper.make_node("Sum", [o for n in nodes for o in n.output], ["y"], name="y")
        assert _merged(_model([*nodes, reader], ["y"])) == [], what
    # a copy that writes a graph output keeps it
    same = [helper.make_node("Relu", ["x"], ["a"], name="a"), helper.make_node("Relu", ["x"], ["b"], name="b")]
    assert _merged(_model(same, ["a", "b"])) == []
    assert _merged(_model(same + [helper.make_node("Add", ["a", "b"], ["y"], name="y")], ["y"])) == ["b"]
