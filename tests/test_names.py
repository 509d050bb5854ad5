"""Readable node names (exporters/capture/rename.py `readable_node_names`): exported nodes are named
after the module that ran them and their op, so that reports say which layer a node is in.

A hand-built model checks the naming rules; one zoo twin (Llama tiny at TP 2 with the
all-reduce after the MLP left out: `refine zoo`'s `llama_tp2__missing_allreduce`, the cheapest
buggy export) checks an export end to end, and that the names change no verdict.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import helper

from refine.exporters.capture.rename import readable_node_names
from refine.config import load_config
from refine.lowering.layers import local_functions
from refine.pipeline import verify_dir
from refine.report.render import render_text

LAYER = "refine.layer"


def _node(op: str, inputs: list[str], output: str, scopes: list[str] | None, backward: bool = False) -> onnx.NodeProto:
    node = helper.make_node(op, inputs, [output], name=f"node_{op}_{output}")
    if scopes is not None:
        node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=repr(scopes))
        hierarchy = ["m.Model", "m.Layer", *(["refine.backward"] if backward else [])]
        node.metadata_props.add(key="pkg.torch.onnx.class_hierarchy", value=repr(hierarchy))
    return node


def test_names_follow_module_path_and_op():
    """Main graph: absolute module paths; a layer's body: paths relative to the layer (whichever
    layer torch numbered it after); repeats numbered; calls keep their names."""
    body = [
        _node("MatMul", ["x", "w"], "a", ["", "model", "model.layers.1", "model.layers.1.mlp", "model.layers.1.mlp.down_proj", "mm"]),
        _node("MatMul", ["a", "w"], "b", ["", "model", "model.layers.0", "model.layers.0.mlp", "model.layers.0.mlp.down_proj", "mm_1"]),
        _node("Add", ["b", "x"], "c", ["", "model", "model.layers.0", "add"]),
        _node("Neg", ["c"], "d", ["", "model", "model.layers.0", "model.layers.0.mlp", "model.layers.0.mlp.down_proj", "neg"], backward=True),
        _node("Identity", ["d"], "y", None),
        _node("Constant", [], "k", ["", "model", "arange"]),
    ]
    fn = helper.make_function(LAYER, "Layer", ["x", "w"], ["y"], body, [helper.make_opsetid("", 18)])
    main = [
        _node("Gather", ["e", "i"], "h", ["", "model", "model.embed_tokens", "embedding"]),
        helper.make_node("Layer", ["h", "w0"], ["h1"], name="model.layers.0", domain=LAYER),
        helper.make_node("Layer", ["h1", "w1"], ["h2"], name="model.layers.1 (backward)", domain=LAYER),
        _node("Add", ["h2", "h2"], "s", ["", "add"]),
        _node("Add", ["s", "s"], "t", ["add_1"]),
        _node("Add", ["t", "t"], "o", None),
    ]
    graph = helper.make_graph(main, "g", [], [])
    model = helper.make_model(graph, functions=[fn])
    readable_node_names(model)
    assert [n.name for n in model.graph.node] == [
        "model.embed_tokens/Gather", "model.layers.0", "model.layers.1 (backward)", "Add", "Add_2", "Add_3"]
    assert [n.name for n in model.functions[0].node] == [
        "mlp.down_proj/MatMul", "mlp.down_proj/MatMul_2", "Add", "mlp.down_proj (backward)/Neg", "Identity",
        "model/Constant"]


@pytest.fixture(scope="module")
def twin(zoo_slice) -> Path:
    """The zoo's llama_tp2__missing_allreduce (layers as functions), exported once per session
    (conftest.zoo_slice, shared with tests/test_zoo.py: copy it before writing into it)."""
    return zoo_slice / "llama_tp2__missing_allreduce"


def _programs(d: Path) -> dict[str, onnx.ModelProto]:
    names = ["seq.onnx", *(f"rank{r}.onnx" for r in range(load_config(d).world_size))]
    return {name: onnx.load(str(d / name)) for name in names}


def test_exported_names_are_readable_and_unique(twin):
    for file, model in _programs(twin).items():
        functions = local_functions(model)
        graphs = [("main", list(model.graph.node))] + [(f.name, list(f.node)) for f in model.functions]
        for graph, nodes in graphs:
            names = [n.name for n in nodes]
            assert len(set(names)) == len(names), (file, graph)
            assert not [n for n in names if n.startswith("node_")], (file, graph)
            if graph != "main":  # a body is named relative to its layer: no layer index in it
                assert not [n for n in names if n.startswith("model.layers.")], (file, graph)
        calls = [n.name for n in model.graph.node if (n.domain, n.op_type) in functions]
        assert calls == [f"model.layers.{k}" for k in range(len(calls))] and calls, file
        main = {n.name for n in model.graph.node}
        assert {"model.embed_tokens/Gather", "lm_head/MatMul"} <= main, (file, sorted(main)[:20])
        body = {n.name for f in model.functions for n in f.node}
        assert {"self_attn.o_proj/MatMul", "mlp.down_proj/MatMul", "input_layernorm/Pow"} <= body, file


def test_the_twin_report_names_the_culprit_by_module_path(twin):
    report = verify_dir(twin)
    assert report.verdict == "refuted" and report.diagnosis is not None
    assert report.diagnosis.rank_node == "model.layers.0/mlp.down_proj/MatMul"
    text = render_text(report)
    assert "an all-reduce (sum) is missing after `model.layers.0/mlp.down_proj/MatMul`" in text.splitlines()[1]
    first = text.split("first failure: node ", 1)[1].split(" ", 1)[0]
    assert first == report.failure.node and first.startswith("model.layers.0/"), first
    assert not re.search(r"\bnode_[A-Za-z]", text), text


def test_names_change_no_verdict(twin, tmp_path):
    """The same programs with their nodes named anyhow: the same verdict, memo statistics,
    diagnosis and first failure (the report merely names them differently)."""
    named = verify_dir(twin, simulate=False)
    anon = tmp_path / twin.name
    shutil.copytree(twin, anon)
    for file, model in _programs(twin).items():
        for k, node in enumerate([*model.graph.node, *(n for f in model.functions for n in f.node)]):
            if node.domain != LAYER:
                node.name = f"n{k}"
        onnx.save(model, str(anon / file))
    other = verify_dir(anon, simulate=False)
    assert (other.verdict, other.memo) == (named.verdict, named.memo)
    assert other.memo is not None and other.memo["templates"] >= 1
    assert (other.diagnosis.pattern, other.diagnosis.bug_class) == (named.diagnosis.pattern, named.diagnosis.bug_class)
    assert other.failure.op == named.failure.op and other.failure.location == named.failure.location


def test_tensor_names_are_the_users_and_never_meet_an_inlined_layer_body():
    """readable_value_names: a view is named after what it views (`w (transposed)`, `x (view)`),
    other tensors after their node (`mlp.down/MatMul`); graph inputs, outputs and a function's
    formals keep their names; and no main-graph name is one that inlining a layer call's body
    (`CALL/NAME`, refine/lowering/layers.py) makes: a node of module `h.0` at the main graph and a
    root node of the layer h.0's body would both be `h.0/Constant`."""
    from refine.lowering.layers import body_nodes

    body = [_node("Constant", [], "c0", ["", "h.0", "c"]), _node("Add", ["x", "c0"], "y", ["", "h.0", "add"])]
    for n in body:
        n.ClearField("input") if n.op_type == "Constant" else None
    body[0].attribute.append(helper.make_attribute("value", helper.make_tensor("v", onnx.TensorProto.FLOAT, [], [1.0])))
    fn = helper.make_function(LAYER, "Layer", ["x"], ["y"], body, [helper.make_opsetid("", 18)])
    main = [
        _node("Transpose", ["w"], "t0", ["", "mlp", "mlp.down", "t"]),
        _node("MatMul", ["x", "t0"], "mm", ["", "mlp", "mlp.down", "mm"]),
        _node("Reshape", ["mm", "shape"], "view_3", ["", "mlp", "view"]),
        _node("Constant", [], "val_1", ["", "h.0", "c"]),
        helper.make_node("Layer", ["view_3"], ["h1"], name="h.0", domain=LAYER),
        _node("Add", ["h1", "val_1"], "out", ["", "add"]),
    ]
    main[3].ClearField("input")
    main[3].attribute.append(helper.make_attribute("value", helper.make_tensor("v", onnx.TensorProto.FLOAT, [], [2.0])))
    graph = helper.make_graph(main, "g", [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                                          for n in ("x", "w", "shape")],
                              [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, functions=[fn])
    readable_node_names(model)
    made = {n.name: list(n.output) for n in model.graph.node}
    assert made["mlp.down/Transpose"] == ["w (transposed)"] and made["mlp.down/MatMul"] == ["mlp.down/MatMul"]
    assert made["mlp/Reshape"] == ["mlp.down/MatMul (view)"] and made["Add"] == ["out"]
    assert list(model.functions[0].output) == ["y"] and list(model.functions[0].input) == ["x"]
    inlined = {t for n in body_nodes(model.functions[0], {}, ["mlp.down/MatMul (view)"], ["h1"], "h.0/", Path("m"))
               for t in n.output}
    assert made["h.0/Constant"][0] not in inlined and "h.0/Constant" in inlined, (made, inlined)
