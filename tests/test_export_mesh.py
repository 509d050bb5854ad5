"""TP x DP exports on a 2-D mesh (`refine export --tp T --dp D [--sp] [--train]`, exporters/strategies/mesh.py)
and their wrong-process-group twins, through the CLI in-process: the forward, and the training
step (TP within each mesh row, the data-parallel step over each column).

Each export is made once per module (tiny config, 1 or 2 layers) with `--check`, whose exit code
and output the tests read; `refine.exporters.check` (what `--check` calls) is also called directly.
The default run exports Llama's forward, its wrong-group twin and its training step; the sweep
(REFINE_TEST_SWEEP=1, benchmarks/sweep.py) adds GPT-2's SP forward twin, its SP training step, the
training step's mesh_grad_over_tp twin (refuted by default through `refine zoo` in
tests/test_zoo.py) and the zoo's forward mesh twin.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

import onnx  # noqa: E402

from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402

import refine.exporters  # noqa: E402
from refine.exporters.strategies import mesh  # noqa: E402
from refine.exporters.zoo import entries as zoo_gen
from refine.config import load_config, rank_file_name  # noqa: E402
from refine.dist import DIST_DOMAIN, node_attrs  # noqa: E402

TP, DP = 2, 2
EXPORTS: dict[str, tuple[str, ...]] = {
    "llama": ("--model", "llama", "--layers", "2"),
    "llama_bug": ("--model", "llama", "--layers", "2", "--bug", "mesh_wrong_group"),
    "gpt2_sp_bug": ("--model", "gpt2", "--layers", "1", "--sp", "--bug", "mesh_wrong_group"),
    "llama_train": ("--model", "llama", "--layers", "1", "--train"),
    "llama_train_bug": ("--model", "llama", "--layers", "1", "--train", "--bug", "mesh_grad_over_tp"),
    "gpt2_sp_train": ("--model", "gpt2", "--layers", "1", "--sp", "--train", "--flat"),
}


@pytest.fixture(scope="module")
def mesh_dir(tmp_path_factory):
    """name -> (its export directory, the CLI's exit code and output with --check), made on first use."""
    runs: dict[str, tuple[int, str]] = {}

    def export(name: str, out: Path) -> None:
        result = invoke("export", "--config", "tiny", "--tp", TP, "--dp", DP, *EXPORTS[name], "--check", "--out", out)
        runs[name] = (result.exit_code, result.output)

    get = exports_on_first_use(tmp_path_factory.mktemp("mesh"), export)
    return lambda name: (get(name), *runs[name])


def sweep_only(*values, why: str):
    """A parameter set that runs under harness.SWEEP only (REFINE_TEST_SWEEP=1, benchmarks/sweep.py)."""
    return pytest.param(*values, marks=pytest.mark.skipif(not SWEEP, reason=f"sweep only (REFINE_TEST_SWEEP=1): {why}"))


# the SP twin: the same mesh group moved, on a reduce-scatter (GPT-2's SP on the mesh: the sweep's)
SP_TWIN = "the wrong-group twin runs by default on Llama's all-reduce"
# the training step's twin: tests/test_zoo.py refutes `refine zoo`'s mesh_grad_over_tp twin (GPT-2) by default
TRAIN_TWIN = "tests/test_zoo.py refutes the zoo's mesh_grad_over_tp twin by default"


def programs(out: Path) -> list[onnx.ModelProto]:
    return [onnx.load(str(out / rank_file_name(r))) for r in range(TP * DP)]


def collectives(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return list(mesh._dist_nodes(model))


def test_mesh_export_declares_the_mesh_and_its_layouts(mesh_dir) -> None:
    """D*T rank files; refine.json: the mesh, the batch over dp, the TP layouts over tp (replicas
    stay replicas); export.json: the logits' batch rows over dp, the recipe with dp and tp."""
    out, code, output = mesh_dir("llama")
    assert code == 0, output
    assert sorted(p.name for p in out.glob("rank*.onnx")) == sorted(rank_file_name(r) for r in range(TP * DP))
    raw = json.loads((out / "refine.json").read_text())
    assert raw["world_size"] == TP * DP
    assert raw["mesh"] == {"shape": [DP, TP], "dims": ["dp", "tp"]}
    assert raw["inputs"]["input_ids"] == {"layout": "shard", "axis": 0, "over": "dp", "range": [0, 128]}
    weights = {n: lay for n, lay in raw["inputs"].items() if n != "input_ids"}
    assert all(lay == {"layout": "rep"} or lay["over"] == "tp" for lay in weights.values()), weights
    assert weights["model.layers.0.self_attn.q_proj.weight"] == {"layout": "shard", "axis": 0, "over": "tp"}
    assert weights["model.layers.1.mlp.down_proj.weight"] == {"layout": "shard", "axis": 1, "over": "tp"}
    assert weights["model.norm.weight"] == {"layout": "rep"}
    assert raw["outputs"] == {"logits": {"layout": "shard", "axis": 0, "over": "dp"}}  # each row's batch rows
    assert f"TP {TP} x DP {DP} on a {DP} x {TP} mesh" in raw["description"]
    load_config(out)
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["outputs"]["logits"] == {"layout": "shard", "axis": 0, "over": "dp"}
    assert manifest["zoo"]["mesh"] == {"dp": DP, "tp": TP} and "tp" not in manifest["zoo"]  # (refine/diagnose/reduced.py)
    seq = onnx.load(str(out / "seq.onnx"))
    assert [d.dim_value for d in seq.graph.input[0].type.tensor_type.shape.dim] == [2, 8]  # the whole batch
    assert [d.dim_value for d in programs(out)[3].graph.input[0].type.tensor_type.shape.dim] == [1, 8]


def test_every_collective_runs_over_its_mesh_row(mesh_dir) -> None:
    """Rank d*T + t: every group is {d*T .. d*T+T-1}; its metadata names its global rank."""
    out, _, _ = mesh_dir("llama")
    for r, model in enumerate(programs(out)):
        calls = collectives(model)
        assert calls and all(node_attrs(n)["group"] == mesh.row_group(r // TP, TP) for n in calls), r
        meta = {p.key: p.value for p in model.metadata_props}
        assert (meta["rank"], meta["world_size"]) == (str(r), str(TP * DP))


def test_correct_export_passes_check(mesh_dir) -> None:
    """refine.exporters.check itself reads the mesh (nothing of exporters/capture/numeric.py is replaced while it
    runs): the logits are rebuilt per line of ranks along dp, and the TP replicas agree exactly."""
    out, code, output = mesh_dir("llama")
    assert code == 0 and output.rstrip().endswith("check: PASSED"), output
    assert not hasattr(mesh, "check") and "unittest" not in Path(mesh.__file__).read_text()
    result = refine.exporters.check(out)
    assert result.ok, result.render()
    rendered = result.render()
    assert "logits: each of the 2 lines of ranks along dp (shard) reconstructed vs seq.onnx" in rendered, rendered
    assert "logits: the 2 copies of each piece over dp agree exactly" in rendered, rendered


def test_correct_export_verifies(mesh_dir) -> None:
    """The declared logits (each row's batch rows, on every rank of the row) are what refine proves:
    the exporter copies row 0's programs to the other row, so row 0 is verified and the other by
    symmetry (docs/rows.md), the copies recognised byte for byte."""
    out, _, _ = mesh_dir("llama")
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    assert "rows: the 2 rows along dp run the same programs" in result.output, result.output
    assert "logits = concat of 2 row chunks along axis 0: chunk 0 = r0:logits (replicated on r0..r1)" in result.output, \
        result.output


@pytest.mark.parametrize(("name", "model", "all_reduce"), [("llama_bug", "llama", True),
                                                           sweep_only("gpt2_sp_bug", "gpt2", False, why=SP_TWIN)])
def test_wrong_group_twin_is_refuted_in_mesh_coordinates(mesh_dir, name: str, model: str, all_reduce: bool) -> None:
    """REFUTED (exit 1) at the node the zoo's twins expect; the moved all-reduce is named by its
    mesh group (`the dp group of tp=0`, for the SP twin the reduce-scatter's), and the group that
    holds the pieces too (`the tp group of dp=0`)."""
    out, _, _ = mesh_dir(name)
    result = invoke("verify", out)
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "the dp group of tp=" in result.output and "(the tp group of dp=0), not on this group" in result.output, \
        result.output
    node = zoo_gen.MESH_BUG_NODES["mesh_wrong_group"][model]
    assert f"first failure: node {node} " in result.output, result.output


@pytest.mark.skipif(not SWEEP, reason="a sweep case (benchmarks/sweep.py): tests/test_zoo.py runs the zoo's mesh twins")
def test_zoo_mesh_twin_gets_its_expected_verdict_at_its_node(tmp_path: Path) -> None:
    """`refine zoo --plans dp` writes the twin with its failing node; `refine batch` agrees; a rerun
    keeps it (the zoo's cache)."""
    assert tuple(n for n, b in mesh.MESH_BUGS.items() if not b.train) == zoo_gen.MESH_BUG_NAMES  # (forward twins)
    args = ("zoo", "--out", tmp_path / "zoo", "--models", "llama", "--tp", TP, "--plans", "dp", "--bugs", "mesh_wrong_group")
    result = invoke(*args)
    assert result.exit_code == 0 and "1 written" in result.stdout, result.output
    entry = tmp_path / "zoo" / f"llama_tp{TP}_dp{DP}__mesh_wrong_group"
    raw = json.loads((entry / "refine.json").read_text())
    assert raw["expect"] == {"verdict": "refuted", "node": "model.layers.0/Add_2"}
    assert raw["outputs"] == {"logits": {"layout": "shard", "axis": 0, "over": "dp"}}
    assert json.loads((entry / "export.json").read_text())["zoo"]["mesh"] == {"dp": DP, "tp": TP}
    assert "1 already current" in invoke(*args).stdout
    batch = invoke("batch", tmp_path / "zoo", "--jobs", 1, "--cache-dir", tmp_path / "cache")
    assert batch.exit_code == 0 and "all as expected" in batch.output, batch.output


@pytest.mark.parametrize(("name", "op"), [("llama_bug", "AllReduce"), sweep_only("gpt2_sp_bug", "ReduceScatter", why=SP_TWIN)])
def test_wrong_group_twin_fails_check(mesh_dir, name: str, op: str) -> None:
    """Every rank's first-block down projection reduces over its mesh column instead of its row
    (the all-reduce; the reduce-scatter under SP), keeping its source metadata; --check exits 1."""
    out, code, output = mesh_dir(name)
    assert code == 1 and output.rstrip().endswith("check: FAILED"), output
    assert not refine.exporters.check(out).ok
    for r, model in enumerate(programs(out)):
        d, t = divmod(r, TP)
        moved = [n for n in collectives(model) if node_attrs(n)["group"] != mesh.row_group(d, TP)]
        assert len(moved) == 1, r
        node = moved[0]
        assert node.op_type == op and node_attrs(node)["group"] == mesh.column_group(t, TP, DP)
        assert "down_proj" in node.name or "c_proj" in node.name, node.name
        assert any(p.key == "pkg.torch.onnx.stack_trace" for p in node.metadata_props)


def test_wrong_group_twin_moves_one_block(mesh_dir) -> None:
    """Layers share one function: block 0 calls a copy of its own, which alone holds the bug."""
    out, _, _ = mesh_dir("llama_bug")
    model = programs(out)[0]
    calls = {n.name: n.op_type for n in model.graph.node if n.domain == "refine.layer"}
    assert calls["model.layers.0"] != calls["model.layers.1"]
    bodies = {f.name: f for f in model.functions}
    fine = [n for n in bodies[calls["model.layers.1"]].node if n.domain == DIST_DOMAIN]
    assert all(node_attrs(n)["group"] == mesh.row_group(0, TP) for n in fine)


@pytest.mark.parametrize(("args", "words"), [
    (("--model", "llama", "--tp", "2", "--dp", "2", "--train", "--bug", "mesh_wrong_group"), "in the forward: drop --train"),
    (("--model", "llama", "--tp", "2", "--dp", "2", "--bug", "mesh_grad_over_tp"), "in the training step: pass --train"),
    (("--model", "llama", "--tp", "2", "--dp", "2", "--train", "--fsdp"), "(without --tp)"),
    (("--model", "llama", "--tp", "2", "--dp", "4"), "DP 4 does not divide the batch 2"),
    (("--model", "gpt2", "--tp", "2", "--dp", "4", "--batch", "6"), "DP 4 does not divide the batch 6"),
    (("--model", "mixtral", "--tp", "2", "--dp", "2"), "not mixtral"),
    (("--model", "llama", "--tp", "2", "--dp", "2", "--micro-batches", "2"), "not a TP x DP mesh"),
    (("--model", "gpt2", "--tp", "2", "--dp", "4", "--batch", "4", "--sp", "--bug", "mesh_wrong_group"),
     "needs --dp equal to --tp"),
    (("--model", "llama", "--tp", "2", "--dp", "2", "--bug", "dp_grad_avg"), "unknown TP x DP mesh bug"),
])
def test_mesh_usage_errors(tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--config", "tiny", *args)


# --- the training step ---------------------------------------------------------------------------


def test_mesh_training_step_declares_its_layouts(mesh_dir) -> None:
    """The batch (ids and labels, which may be the ignore index) over dp, the weights' TP layouts
    over tp, the loss a replica, each gradient laid out as its parameter."""
    out, code, output = mesh_dir("llama_train")
    assert code == 0, output
    assert sorted(p.name for p in out.glob("rank*.onnx")) == sorted(rank_file_name(r) for r in range(TP * DP))
    raw = json.loads((out / "refine.json").read_text())
    assert (raw["world_size"], raw["mesh"]) == (TP * DP, {"shape": [DP, TP], "dims": ["dp", "tp"]})
    batch = {"layout": "shard", "axis": 0, "over": "dp", "range": [0, 128]}
    assert raw["inputs"]["input_ids"] == batch
    assert raw["inputs"]["labels"] == {**batch, "also": [-100]}
    weights = {n: lay for n, lay in raw["inputs"].items() if n not in ("input_ids", "labels")}
    assert weights["model.layers.0.mlp.down_proj.weight"] == {"layout": "shard", "axis": 1, "over": "tp"}
    assert weights["model.norm.weight"] == {"layout": "rep"}
    assert all(lay == {"layout": "rep"} or lay["over"] == "tp" for lay in weights.values()), weights
    grads = {n.removeprefix("grad."): lay for n, lay in raw["outputs"].items() if n != "loss"}
    assert raw["outputs"]["loss"] == {"layout": "rep"} and set(weights) - set(grads) == {"model.rotary_emb.inv_freq"}
    assert all(lay == weights[n] for n, lay in grads.items()), grads  # (the buffer has no gradient)
    load_config(out)
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["train"] and manifest["zoo"]["train"] and manifest["zoo"]["mesh"] == {"dp": DP, "tp": TP}
    assert manifest["inputs"]["labels"]["shape"] == [2, 8] and manifest["inputs"]["labels"]["also"] == [-100]


@pytest.mark.parametrize(("name", "grads_over_dp"), [("llama_train", True), *([("gpt2_sp_train", True)] if SWEEP else []),
                                                     sweep_only("llama_train_bug", False, why=TRAIN_TWIN)])
def test_training_step_reduces_over_columns_and_rows(mesh_dir, name: str, grads_over_dp: bool) -> None:
    """Rank (d, t): the token count, the loss and (unless the twin moved them to the row) every
    gradient are all-reduced over its DP group, the column {t, T+t}; every other collective (the TP
    step's) runs within its row {d*T .. d*T+T-1}."""
    out, _, _ = mesh_dir(name)
    n_grads = sum(o.startswith("grad.") for o in json.loads((out / "refine.json").read_text())["outputs"])
    for r, model in enumerate(programs(out)):
        d, t = divmod(r, TP)
        calls = collectives(model)
        column = [n for n in calls if node_attrs(n)["group"] == mesh.column_group(t, TP, DP)]
        assert all(n.op_type == "AllReduce" for n in column), r
        assert len(column) == 2 + (n_grads if grads_over_dp else 0), (r, len(column))
        assert all(node_attrs(n)["group"] == mesh.row_group(d, TP) for n in calls if n not in column), r
        meta = {p.key: p.value for p in model.metadata_props}
        assert (meta["rank"], meta["world_size"]) == (str(r), str(TP * DP))


@pytest.mark.parametrize("name", ["llama_train", *(["gpt2_sp_train"] if SWEEP else [])])
def test_training_step_passes_check(mesh_dir, name: str) -> None:
    """torch's sequential step (mean over the whole batch's counted tokens) is what every line of
    ranks rebuilds, on labels that ignore tokens."""
    _, code, output = mesh_dir(name)
    assert code == 0 and output.rstrip().endswith("check: PASSED"), output
    assert "copies of each piece over tp agree exactly" in output, output  # (the TP-sharded gradients' rows)


@pytest.mark.skipif(not SWEEP, reason=f"sweep only (REFINE_TEST_SWEEP=1): {TRAIN_TWIN}")
def test_grad_over_tp_twin_fails_check(mesh_dir) -> None:
    """The gradients summed over the row instead of the column: --check exits 1 on them (the loss,
    reduced over the column, still matches)."""
    _, code, output = mesh_dir("llama_train_bug")
    assert code == 1 and output.rstrip().endswith("check: FAILED"), output
    assert "ok    loss: seq.onnx vs torch" in output and "FAIL  grad.model.norm.weight" in output, output


def test_training_step_verifies(mesh_dir) -> None:
    """Each rank's TP shard of its DP row's gradient (a sum over the row's tokens: rules/windows.lp's
    chunk terms), all-reduced over its DP column, is its shard of the whole batch's gradient: the
    loss and every gradient are proven as declared."""
    out, _, _ = mesh_dir("llama_train")
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    assert "grad.model.layers.0.self_attn.q_proj.weight = concat(r0..r1:grad.model.layers.0.self_attn.q_proj.weight, " \
        "axis=0)" in result.output, result.output


@pytest.mark.skipif(not SWEEP, reason=f"sweep only (REFINE_TEST_SWEEP=1): {TRAIN_TWIN}")
def test_grad_over_tp_twin_is_refuted_naming_both_groups(mesh_dir) -> None:
    """Class 11: the gradients' DP all-reduce over the TP group (the mesh row) is REFUTED, the report
    naming the group used and the one whose ranks hold the other pieces, in mesh coordinates."""
    out, _, _ = mesh_dir("llama_train_bug")
    result = invoke("verify", out)
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "reduces over ranks 0, 1 (the tp group of dp=0) only: the collective is over the wrong group" in result.output
    assert "whose pieces are on [0, 2] (the dp group of tp=0), not on this group" in result.output, result.output
