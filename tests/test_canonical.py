"""refine/lowering/canonical.py: every rewrite is exact, keeps every original tensor's name and value,
names the user's node, and leaves alone what it cannot restate exactly.

Each case runs the original and the canonical model on the same random feeds (onnx's reference
evaluator) and compares every value the original graph computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from harness import Graph
from refine.lowering import canonical
from refine.lowering.shapes import infer_shapes, value_types

C_SHAPES = ["none", "empty", "scalar", "one", "row", "row2d", "col", "full"]


def _inferred(g: Graph) -> onnx.ModelProto:
    return infer_shapes(g.model(), Path("<canonical>"), 1)


def _canonical(model: onnx.ModelProto) -> onnx.ModelProto:
    return canonical.canonicalize(model, value_types(model.graph))


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in ReferenceEvaluator(model).run(None, feeds, intermediate=True).items() if k}


def _feeds(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feeds[vi.name] = (rng.standard_normal(shape) + 0.5).astype(dtype) if np.issubdtype(dtype, np.floating) \
            else rng.integers(-3, 4, size=shape).astype(dtype)
    return feeds


def _same_values(original: onnx.ModelProto, rewritten: onnx.ModelProto, seed: int, gone: int = 0) -> None:
    """Both models on the same feeds: every value of the original is in the rewrite, equal,
    except `gone` Gemm outputs (a bias moved after the view leaves no tensor equal to Y)."""
    feeds = _feeds(original, np.random.default_rng(seed))
    before, after = _run(original, feeds), _run(rewritten, feeds)
    missing = [name for name in before if name not in after]
    assert len(missing) == gone and all(n.startswith("gemm") for n in missing), missing
    for name, value in before.items():
        if name in after:
            np.testing.assert_allclose(after[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def _gemm_graph(rng: np.random.Generator, ta: int, tb: int, c: str, alpha: float, beta: float,
                view: str, dtype: int = TensorProto.FLOAT) -> tuple[Graph, str]:
    m, k, n = (int(v) for v in rng.integers(2, 6, size=3))
    m *= 2  # the view splits M into [2, M/2]
    g = Graph()
    a = g.input("a", [k, m] if ta else [m, k], dtype)
    b = g.input("b", [n, k] if tb else [k, n], dtype)
    inputs = [a, b]
    c_shape = {"scalar": [], "one": [1], "row": [n], "row2d": [1, n], "col": [m, 1], "full": [m, n]}.get(c)
    if c_shape is not None:
        inputs.append(g.input("c", c_shape, dtype))
    elif c == "empty":
        inputs.append("")
    attrs: dict[str, object] = {"transA": ta, "transB": tb}
    if alpha != 1.0:
        attrs["alpha"] = alpha
    if beta != 1.0:
        attrs["beta"] = beta
    y = g.op("Gemm", *inputs, **attrs)
    if view == "keep_last":      # torch's linear on [2, M/2, in]: view back keeping N last
        y = g.op("Reshape", y, g.ints([2, m // 2, n]))
    elif view == "other":        # a view that does not keep the last axis
        y = g.op("Reshape", y, g.ints([n, m]))
    g.output(y)
    return g, y


@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("c", C_SHAPES)
@pytest.mark.parametrize("view", ["none", "keep_last", "other"])
def test_gemm_rewrite_is_exact(ta: int, tb: int, c: str, view: str) -> None:
    rng = np.random.default_rng(ta * 100 + tb * 10 + C_SHAPES.index(c))
    alpha, beta = float(rng.choice([1.0, 0.5, -2.0])), float(rng.choice([1.0, 0.25, 3.0]))
    g, _ = _gemm_graph(rng, ta, tb, c, alpha, beta, view)
    original = _inferred(g)
    rewritten = _canonical(original)
    onnx.checker.check_model(rewritten)
    assert not [n for n in rewritten.graph.node if n.op_type == "Gemm"]
    # a single value commutes with any view; a row bias with a view that keeps the last axis
    moved = view != "none" and c in ("scalar", "one") or view == "keep_last" and c in ("row", "row2d")
    _same_values(original, rewritten, seed=ta + tb, gone=int(moved))
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("Transpose") == ta + tb
    if moved:  # the bias is added after the view: Reshape, then Add
        assert ops.index("Reshape") < ops.index("Add"), ops
    elif c in C_SHAPES[2:]:
        assert view == "none" or ops.index("Add") < ops.index("Reshape"), ops


def test_names_and_metadata_follow_the_gemm() -> None:
    """The node that ends the Gemm takes its name; every new node carries its metadata; one node
    per original position is left unmarked."""
    g, _ = _gemm_graph(np.random.default_rng(0), 0, 1, "row", 2.0, 0.5, "keep_last")
    model = _inferred(g)
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    gemm.name = "node_addmm"
    gemm.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="['', 'down_proj', 'addmm']")
    rewritten = _canonical(model)
    by_name = {n.name: n for n in rewritten.graph.node}
    assert by_name["node_addmm"].op_type == "Add"
    assert by_name["node_addmm"].output[0] == model.graph.output[0].name  # the view's output, same value
    new = [n for n in rewritten.graph.node if n.name.startswith("node_addmm")]
    assert {n.op_type for n in new} >= {"Transpose", "MatMul", "Mul", "Constant", "Add"}
    for n in new:
        assert any(p.key == "pkg.torch.onnx.name_scopes" for p in n.metadata_props), n.name
    kept = [n for n in rewritten.graph.node if not canonical.inserted(n)]
    assert len(kept) == len(model.graph.node)


def test_the_bias_stays_before_a_view_with_other_readers() -> None:
    """Y read by the view and by another node: Y keeps its value, so the Add stays before."""
    g = Graph()
    a, b, c = g.input("a", [4, 3]), g.input("b", [3, 5]), g.input("c", [5])
    y = g.op("Gemm", a, b, c)
    g.output(g.op("Reshape", y, g.ints([2, 2, 5])))
    g.output(g.op("Relu", y))
    model = _inferred(g)
    rewritten = _canonical(model)
    _same_values(model, rewritten, 0)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.index("Add") < ops.index("Reshape")


@pytest.mark.parametrize("dtype,alpha,rewritten", [(TensorProto.INT64, 1.0, True), (TensorProto.INT64, 2.0, False),
                                                   (TensorProto.DOUBLE, 2.0, True)])
def test_integer_gemm_scaled_by_a_float_stays(dtype: int, alpha: float, rewritten: bool) -> None:
    g, _ = _gemm_graph(np.random.default_rng(1), 0, 0, "row", alpha, 1.0, "none", dtype)
    model = _inferred(g)
    out = _canonical(model)
    assert any(n.op_type == "Gemm" for n in out.graph.node) != rewritten
    if rewritten:
        _same_values(model, out, 1)


def test_legacy_broadcast_gemm_stays() -> None:
    """Gemm before opset 7 had a `broadcast` attribute: not restated, left to no lemma."""
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], broadcast=1)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(x, TensorProto.FLOAT, s)
                                            for x, s in (("a", [2, 3]), ("b", [3, 4]), ("c", [2, 4]))], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
    assert list(_canonical(model).graph.node) == [node]


def test_layer_calls_after_a_gemm_keep_their_ids(tmp_path: Path) -> None:
    """A main graph whose Gemm (rewritten into several nodes) comes before its layer calls: the
    memoized lowering still names each call node correctly, and memoized and plain runs agree."""
    import json

    from test_lemmas_layers import layered

    from refine.lowering.program import lower_program
    from refine.pipeline import verify_dir

    d = layered.write(tmp_path / "m", 3, 2)
    b, s, h = layered.B, layered.S, layered.H
    for name in ["seq.onnx", "rank0.onnx", "rank1.onnx"]:
        model = onnx.load(d / name)
        graph = model.graph
        graph.input.extend([helper.make_tensor_value_info("wi", TensorProto.FLOAT, [h, h]),
                            helper.make_tensor_value_info("bi", TensorProto.FLOAT, [h])])
        graph.initializer.extend([numpy_helper.from_array(np.array([b * s, h], np.int64), "flat_shape"),
                                  numpy_helper.from_array(np.array([b, s, h], np.int64), "back_shape")])
        pre = [helper.make_node("Reshape", ["x", "flat_shape"], ["x2d"], name="flatten"),
               helper.make_node("Gemm", ["x2d", "wi", "bi"], ["proj"], name="in_proj", transB=1),
               helper.make_node("Reshape", ["proj", "back_shape"], ["x_in"], name="unflatten")]
        graph.node[0].input[0] = "x_in"
        nodes = pre + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
        onnx.save(model, d / name)
    config = json.loads((d / "refine.json").read_text())
    config["inputs"].update({"wi": {"layout": "rep"}, "bi": {"layout": "rep"}})
    (d / "refine.json").write_text(json.dumps(config))

    program = lower_program(d)
    calls = {(g, n) for _c, g, n in program.main.rows["call_node"]}
    assert calls == {(g, f"{g}:layers.{i}") for g in ("seq", "r0", "r1") for i in range(3)}
    memo, plain = verify_dir(d), verify_dir(d, memo=False)
    assert memo.verdict == plain.verdict == "verified", memo.failure
