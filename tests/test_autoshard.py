"""The Megatron-style sharder behind `refine batch --plan tp:N`: it proposes, the verifier decides.

A hand-built MLP is sharded (column then row parallel, an all-reduce inserted) and verifies,
evenly and unevenly, with MatMul+Add or Gemm biases. Wrong proposals (the all-reduce dropped, a
softmax across the sharded features treated as elementwise) must not verify. A handful of the
models the onnx package ships are run through `refine batch --plan`: each is reported, with
what was sharded and what was left replicated, and none stops the batch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from harness import invoke
from refine.batch import autoshard, entries as batch_entries, verify_entry
from refine.errors import InputError
from refine.pipeline import verify_dir

ONNX_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
REPO = Path(__file__).resolve().parent.parent


def mlp(kind: str = "matmul", hidden: int = 8, ffn: int = 16, middle: str = "Relu", seed: int = 0) -> onnx.ModelProto:
    """y = act(x @ W1 + b1) @ W2 + b2 with weights as initializers (MatMul+Add or Gemm)."""
    rng = np.random.default_rng(seed)
    arrays = {"w1": (hidden, ffn), "b1": (ffn,), "w2": (ffn, hidden), "b2": (hidden,)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in arrays.items()]
    act = [helper.make_node(middle, ["h2"], ["h3"], name="act", **({"axis": -1} if middle == "Softmax" else {}))]
    if kind == "matmul":
        nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="up"),
                 helper.make_node("Add", ["h1", "b1"], ["h2"], name="up_bias"), *act,
                 helper.make_node("MatMul", ["h3", "w2"], ["h4"], name="down"),
                 helper.make_node("Add", ["h4", "b2"], ["y"], name="down_bias")]
    else:
        nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h2"], name="up"), *act,
                 helper.make_node("Gemm", ["h3", "w2", "b2"], ["y"], name="down", beta=0.5)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _shard(tmp_path: Path, model: onnx.ModelProto, tp: int, name: str = "mlp") -> tuple[autoshard.ShardPlan, Path]:
    src = tmp_path / f"{name}.onnx"
    onnx.save(model, str(src))
    out = tmp_path / f"{name}_tp{tp}"
    return autoshard.shard_file(src, tp, out), out


@pytest.mark.parametrize("kind, tp", [("matmul", 2), ("matmul", 3), ("gemm", 2), ("gemm", 4)])
def test_mlp_is_sharded_megatron_style_and_verifies(tmp_path, kind, tp):
    plan, out = _shard(tmp_path, mlp(kind), tp)
    assert [(p.column, p.row) for p in plan.pairs] == [("up", "down")]
    sharded = {s.name: (s.role, s.axis) for s in plan.sharded}
    assert sharded == {"w1": ("column", 1), "b1": ("column-elementwise", 0), "w2": ("row", 0)}
    assert not plan.replicated
    uneven = 16 % tp != 0
    assert all((s.sizes is not None) == uneven for s in plan.sharded)
    config = json.loads((out / "refine.json").read_text())
    assert config["inputs"]["w1"]["layout"] == "shard" and config["outputs"] == {"y": {"layout": "rep"}}
    ranks = [onnx.load(str(out / f"rank{r}.onnx")) for r in range(tp)]
    assert all(sum(n.op_type == "AllReduce" and n.domain == "dist" for n in m.graph.node) == 1 for m in ranks)
    local = [numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "w1")).shape[1] for m in ranks]
    assert sum(local) == 16
    report = verify_dir(out)
    assert report.verdict == "verified", report.failure


def test_unpaired_matmuls_stay_replicated_with_a_reason(tmp_path):
    model = mlp(middle="Softmax")  # a softmax across the features breaks the column split
    plan, out = _shard(tmp_path, model, 2)
    assert not plan.pairs and not plan.sharded
    reasons = {r.node: r.reason for r in plan.replicated}
    assert "feeds Softmax act, not elementwise" in reasons["up"]
    assert "graph output" in reasons["down"] or "y" in reasons["down"]
    assert plan.summary.startswith("nothing sharded")


# --- soundness: the verifier, not the sharder, decides ------------------------------------------------


def test_dropping_the_allreduce_is_not_verified(tmp_path):
    _plan, out = _shard(tmp_path, mlp(), 2)
    for r in range(2):
        path = out / f"rank{r}.onnx"
        m = onnx.load(str(path))
        (ar,) = [n for n in m.graph.node if n.op_type == "AllReduce"]
        for n in m.graph.node:  # the consumer reads the partial sum directly
            n.input[:] = [ar.input[0] if i == ar.output[0] else i for i in n.input]
        m.graph.node.remove(ar)
        onnx.save(m, str(path))
    report = verify_dir(out)
    assert report.verdict == "refuted", report.verdict


def test_a_wrong_proposal_is_not_verified(tmp_path, monkeypatch):
    """A sharder that took softmax for elementwise proposes a wrong split; it must not verify."""
    monkeypatch.setattr(autoshard, "UNARY", autoshard.UNARY | {"Softmax"})
    plan, out = _shard(tmp_path, mlp(middle="Softmax"), 2)
    assert [(p.column, p.row) for p in plan.pairs] == [("up", "down")]  # the (wrong) proposal
    report = verify_dir(out)
    assert report.verdict != "verified"
    assert report.verdict == "refuted"  # the numbers show it


# --- plain ONNX models through `refine batch --plan` ----------------------------------------------------

SHIPPED = {  # a handful of the models the onnx package ships
    "pytorch-converted/test_Linear_no_bias": "MatMul",
    "pytorch-converted/test_Linear": "Gemm",
    "pytorch-operator/test_operator_addmm": "shared weight",
    "pytorch-converted/test_Tanh": None,
    "simple/test_sequence_model1": None,
}


@pytest.fixture
def plain_zoo(tmp_path) -> Path:
    root = tmp_path / "plain"
    for rel in SHIPPED:
        shutil.copytree(ONNX_DATA / rel, root / rel)
    (root / "mine").mkdir()
    onnx.save(mlp("gemm"), str(root / "mine" / "mlp.onnx"))
    (root / "mine" / "broken.onnx").write_bytes(b"\x12\x34 not an onnx model")
    shutil.copytree(REPO / "examples" / "mlp_tp2", root / "mlp_tp2")  # an ordinary entry alongside
    return root


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if verify_entry.CACHE_DIR_NAME not in p.parts}


def test_batch_plan_reports_every_plain_model(plain_zoo, tmp_path):
    before = _listing(plain_zoo)
    out_json = tmp_path / "r.json"
    result = invoke("batch", plain_zoo, "--plan", "tp:2", "--jobs", 2, "--json", out_json)
    assert result.exit_code in (0, 1), result.output
    assert _listing(plain_zoo) == before  # scratch entries went elsewhere
    report = batch_entries.BatchReport.model_validate_json(out_json.read_text())
    got = {e.entry: e for e in report.entries}
    assert set(got) == {f"{rel}/model.onnx" for rel in SHIPPED} | {"mine/mlp.onnx", "mine/broken.onnx", "mlp_tp2"}
    assert report.plan == "tp:2"
    mine = got["mine/mlp.onnx"]
    assert mine.status == "verified" and mine.ok and mine.kind == "onnx"
    assert mine.plan.summary.startswith("1 column/row pair sharded") and mine.plan.pairs[0].row == "down"
    assert "1 column/row pair sharded" in result.stdout
    assert got["mlp_tp2"].status == "verified" and got["mlp_tp2"].kind == "dir"
    broken = got["mine/broken.onnx"]
    assert broken.status == "error" and broken.error.startswith(str(plain_zoo / "mine" / "broken.onnx") + ": not a readable ONNX model")
    addmm = got["pytorch-operator/test_operator_addmm/model.onnx"]
    assert addmm.plan is not None and {r.reason for r in addmm.plan.replicated} == {"weight 1 is shared with another node"}
    linear = got["pytorch-converted/test_Linear_no_bias/model.onnx"]
    assert linear.plan.replicated[0].reason.startswith("no row-parallel partner")
    # nothing sharded: not a vacuous "verified", a status of its own that fails the batch
    assert linear.status == "nothing_sharded" and not linear.ok and linear.report.verdict == "verified"
    assert result.exit_code == 1 and "nothing_sharded" in result.stdout
    # the core's one-line error for a model it cannot read as a plain tensor program
    seqm = got["simple/test_sequence_model1/model.onnx"]
    assert seqm.status == "error" and "\n" not in seqm.error and seqm.error.startswith(str(plain_zoo))
    # whatever the verdicts, no entry crashed the batch and every one has a row
    assert all(e.status in ("verified", "refuted", "unproven", "nothing_sharded", "error") for e in report.entries), \
        [(e.entry, e.status, e.error) for e in report.entries]
    assert not any(e.ok is False and e.status == "verified" for e in report.entries)


def test_a_transposed_weight_is_sharded_on_its_stored_axes(tmp_path):
    """torch exports Linear as MatMul(x, Transpose(W)): W [out, in] splits along 0, then 1."""
    model = mlp()
    graph = model.graph
    for node in graph.node:
        if node.op_type == "MatMul":
            w = next(i for i in graph.initializer if i.name == node.input[1])
            w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).T.copy(), w.name))
            graph.node.append(helper.make_node("Transpose", [w.name], [f"{w.name}_t"], name=f"{w.name}/T", perm=[1, 0]))
            node.input[1] = f"{w.name}_t"
    nodes = list(graph.node)  # producers first
    del graph.node[:]
    graph.node.extend([n for n in nodes if n.op_type == "Transpose"] + [n for n in nodes if n.op_type != "Transpose"])
    plan, out = _shard(tmp_path, model, 2)
    assert {s.name: (s.role, s.axis) for s in plan.sharded if s.role != "column-elementwise"} == {
        "w1": ("column", 0), "w2": ("row", 1)}
    assert verify_dir(out).verdict == "verified"


def test_a_malformed_plain_model_is_bad_input_not_a_crash(tmp_path):
    """The sharder reads a plain model as refine reads every model (checked), so a node that
    lacks its input is one line naming the file, not a crash inside the planner."""
    model = mlp()
    up = next(n for n in model.graph.node if n.name == "up")
    model.graph.node.insert(0, helper.make_node("Transpose", [], ["wt"], name="broken"))
    up.input[1] = "wt"
    with pytest.raises(InputError) as err:
        _shard(tmp_path, model, 2)
    assert str(tmp_path / "mlp.onnx") in str(err.value) and "invalid ONNX model" in str(err.value)
