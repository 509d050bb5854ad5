"""Pipeline meshes with data and context parallelism (`refine export --pp P --tp T --dp D [--cp C]
--train`, exporters/strategies/mesh4d.py, docs/layout4d.md), through the CLI in-process.

Llama tiny (2 layers): PP 2 x DP 2 x TP 2 on batch 4 in 2 micro-batches, made once per module and
shared; its twins in the data group's reductions (mesh_grad_avg by default, the local token count
in the sweep); PP 2 x DP 2 x CP 2 x TP 2 on one row per DP rank (16 ranks), and in the sweep
(REFINE_TEST_SWEEP=1) on two micro-batches of a row each, and PP 2 x CP 2 x TP 2 on one sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402

from refine.exporters.strategies.mesh4d import MeshShape  # noqa: E402

PDT = ("--pp", "2", "--dp", "2", "--tp", "2", "--batch", "4", "--micro-batches", "2")
EXPORTS: dict[str, tuple[str, ...]] = {
    "pdt": PDT,
    "mesh_grad_avg": (*PDT, "--bug", "mesh_grad_avg"),
    "mesh_local_token_count": (*PDT, "--bug", "mesh_local_token_count"),
    "pdct": ("--pp", "2", "--dp", "2", "--cp", "2", "--tp", "2"),
    **{bug: ("--pp", "2", "--dp", "2", "--cp", "2", "--tp", "2", "--bug", bug)
       for bug in ("mesh_cp_gather_over_dp", "mesh_cp_positions_not_offset", "mesh_tp_reduce_missing")},
    "pdct_micro": ("--pp", "2", "--dp", "2", "--cp", "2", "--tp", "2", "--batch", "4", "--micro-batches", "2"),
    # (every layer inline, two per stage: each layer's K/V gradient scatter needs the chunks it hands out
    # seeded; the first layer's need seeds every layer's, refine/run/window_seeds.py)
    "pct": ("--pp", "2", "--cp", "2", "--tp", "2", "--batch", "1", "--layers", "4", "--flat"),
    # (layers as functions, a micro-batch of one sequence each: a template's key names the micro-batch
    # window, and its sequence chunks over cp are all there: rules/windows.lp whole_second_level)
    "pct_micro": ("--pp", "2", "--cp", "2", "--tp", "2", "--batch", "2", "--micro-batches", "2", "--layers", "2"),
}


@pytest.fixture(scope="module")
def mesh_dir(tmp_path_factory):
    """name -> its export directory (refine export --model llama --config tiny ... --train)."""
    def export(name: str, out: Path) -> None:
        result = invoke("export", "--model", "llama", "--config", "tiny", *EXPORTS[name], "--train", "--out", out)
        assert result.exit_code == 0, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("mesh4d"), export)


def test_mesh_shape_numbers_ranks_row_major_with_tp_innermost() -> None:
    """Rank ((s*D + d)*C + c)*T + t; lines along dims; dims of size 1 left out of the mesh."""
    mesh = MeshShape(pp=2, dp=2, cp=2, tp=2)
    assert mesh.coordinates(13) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}
    assert mesh.rank({"pp": 1, "dp": 1, "cp": 0, "tp": 1}) == 13
    assert mesh.line(13, "tp") == [12, 13]
    assert mesh.line(13, "dp", "cp") == [9, 11, 13, 15]
    assert mesh.line(13, "pp") == [5, 13]
    assert MeshShape(pp=2, tp=2, dp=3).json() == {"shape": [2, 3, 2], "dims": ["pp", "dp", "tp"]}
    assert MeshShape(pp=2, tp=2).json() == {"shape": [2, 2], "dims": ["pp", "tp"]}


def test_pp_dp_tp_training_step_verifies_and_matches_torch(mesh_dir) -> None:
    """Each DP row's stages (TP inside) on its batch rows, the token count, the loss and every
    gradient all-reduced over the data group {(s, *, t)}: VERIFIED on row dp=0 (the data group a
    column call, the other rows copies of row 0), and torch agrees."""
    import refine.exporters

    out = mesh_dir("pdt")
    config = json.loads((out / "refine.json").read_text())
    assert config["mesh"] == {"shape": [2, 2, 2], "dims": ["pp", "dp", "tp"]}
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 0, "over": "dp", "range": [0, 128]}
    assert config["inputs"]["model.layers.0.mlp.up_proj.weight"] == {"layout": "shard", "axis": 0, "over": "tp"}
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    assert "loss = r4:loss (replicated on r4..r5)" in result.output, result.output
    assert "row dp=0 (ranks [0, 1, 4, 5]) verified" in result.output and "joined by calls over each column" in result.output
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


def test_collectives_name_their_mesh_groups(mesh_dir) -> None:
    """Rank (s, d, t) = 4s + 2d + t: TP collectives over {4s + 2d, 4s + 2d + 1}, the data group's
    all-reduces over {4s + t, 4s + 2 + t}, sends and receives with (1 - s, d, t). Row dp=1 is not
    written: refine.json declares it row 0's copy."""
    import onnx

    from refine.dist import node_attrs

    from refine.config import load_config
    from refine.lowering.row_copies import RankPrograms

    out = mesh_dir("pdt")
    config = load_config(out)
    assert config.row_copies is not None and config.row_copies.dim == "dp"
    assert sorted(p.name for p in out.glob("rank*.onnx")) == ["rank0.onnx", "rank1.onnx", "rank4.onnx", "rank5.onnx"]
    programs = RankPrograms(out, config, load=lambda path: onnx.load(str(path)))
    for r in range(8):
        s, d, t = r // 4, (r // 2) % 2, r % 2
        program = programs.program(r)  # (row dp=1 made from row 0's files; the layers' collectives are in functions)
        calls = [(n.op_type, node_attrs(n)) for n in [*program.graph.node, *(n for f in program.functions for n in f.node)]
                 if n.domain == "dist"]
        groups = {tuple(a["group"]) for op, a in calls if op == "AllReduce"}
        assert groups == {(4 * s + 2 * d, 4 * s + 2 * d + 1), (4 * s + t, 4 * s + 2 + t)}, (r, groups)
        assert {a["peer"] for op, a in calls if op in ("Send", "Recv")} == {4 * (1 - s) + 2 * d + t}, r


@pytest.mark.parametrize("name", [
    pytest.param("pct", marks=pytest.mark.skipif(
        not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): CP inside the pipeline stages verifies by default on "
        "the 4-D mesh (test_four_dim_mesh_training_step_verifies_and_matches_torch) and with layer functions (pct_micro)")),
    "pct_micro",
])
def test_pp_cp_tp_training_step_verifies(mesh_dir, name: str) -> None:
    """PP 2 x CP 2 x TP 2 on one sequence, 4 layers inline (or on two, one micro-batch each, 2 layers
    as functions): each rank's keys and values (its sequence chunk of its heads) all-gathered over
    its cp group, their gradients (sums over the query chunks) reduce-scattered back, the weights'
    gradients all-reduced over the data group: VERIFIED (rules/windows.lp's collectives of
    windows), and torch agrees."""
    import refine.exporters

    out = mesh_dir(name)
    config = json.loads((out / "refine.json").read_text())
    assert config["mesh"] == {"shape": [2, 2, 2], "dims": ["pp", "cp", "tp"]}
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 1, "over": "cp", "range": [0, 128]}
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


@pytest.mark.parametrize("bug,words", [
    ("mesh_grad_avg", "averages over ranks 0, 2 (the dp group of pp=0, tp=0) where it must sum"),
    *([("mesh_local_token_count", "divides its own sum")] if SWEEP else []),
])
def test_data_group_twins_are_refuted(mesh_dir, bug: str, words: str) -> None:
    """The gradients averaged over the data group after the global normalisation (class 14), and
    each rank's loss over its own token count (class 10): REFUTED with a counterexample."""
    result = invoke("verify", mesh_dir(bug))
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert words in result.output and "counterexample (seed" in result.output, result.output


def test_four_dim_mesh_training_step_verifies_and_matches_torch(mesh_dir) -> None:
    """PP 2 x DP 2 x CP 2 x TP 2, one row per DP rank: the batch rows over dp, then the sequence over
    cp. A rank's activations are a window (cp) of a window (dp) of the sequential program, cut over
    tp (rules/windows.lp's windows of windows): VERIFIED, and torch agrees with the rank programs."""
    import refine.exporters

    out = mesh_dir("pdct")
    config = json.loads((out / "refine.json").read_text())
    assert config["mesh"] == {"shape": [2, 2, 2, 2], "dims": ["pp", "dp", "cp", "tp"]}
    assert config["inputs"]["labels"]["then"] == {"axis": 1, "over": "cp"}
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): 16 ranks, several solves")
def test_four_dim_mesh_with_micro_batches_verifies(mesh_dir) -> None:
    """The same mesh on batch 4 in 2 micro-batches: each rank cuts its two rows (a micro-batch is a
    finer window: window_recut) and adds its micro-batches' pieces up (blocks_accumulated): VERIFIED."""
    result = invoke("verify", mesh_dir("pdct_micro"))
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output


@pytest.mark.parametrize("bug,words", [
    ("mesh_cp_gather_over_dp", "AllGather call #0 on group [0, 4] (the dp group of pp=0, cp=0, tp=0)"),
    *([("mesh_cp_positions_not_offset", "first failure: node model.rotary_emb/Mul"),
       ("mesh_tp_reduce_missing", "(the dp x cp x tp group of pp=1) holds a part of the sum")] if SWEEP else []),
])
def test_four_dim_mesh_stage_twins_are_refuted(mesh_dir, bug: str, words: str) -> None:
    """On the 4-D mesh: keys and values all-gathered over the dp line instead of the cp line (class
    11, the group named in mesh coordinates); rotary positions from 0 on every cp rank (class 9);
    the last stage's first attention output left partial over tp (class 1, refuted at the norm
    that reads it): REFUTED with a counterexample."""
    result = invoke("verify", mesh_dir(bug))
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert words in result.output and "counterexample (seed" in result.output, result.output


@pytest.mark.parametrize("args,words", [
    (("--pp", "2", "--tp", "2", "--dp", "2"), "pass --train"),
    (("--pp", "2", "--tp", "2", "--dp", "3", "--train"), "does not divide the batch"),
    (("--pp", "2", "--tp", "2", "--dp", "2", "--train", "--fsdp"), "not built yet"),
    (("--pp", "2", "--tp", "2", "--cp", "3", "--train"), "does not divide the sequence"),
    (("--pp", "2", "--tp", "2", "--train", "--bug", "mesh_grad_avg"), "pass --dp or --cp"),
    (("--pp", "2", "--tp", "2", "--cp", "2", "--train", "--bug", "mesh_cp_gather_over_dp"), "--dp of the same size"),
    (("--pp", "2", "--tp", "2", "--dp", "2", "--train", "--bug", "pp_tied_grad_not_reduced"), "needs a tied embedding"),
])
def test_bad_mesh_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "llama", "--config", "tiny", *args)


def test_cp_on_a_pipeline_mesh_is_llama_only(tmp_path) -> None:
    assert_export_refused(tmp_path / "out", "llama only", "--model", "gpt2", "--config", "tiny", "--pp", "2",
                          "--tp", "2", "--cp", "2", "--train")



@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the tied twin's class-13 diagnosis runs by "
                                        "default in tests/test_pipeline_train.py")
def test_tied_gradient_not_reduced_on_a_dp_row_names_the_pp_group(tmp_path) -> None:
    """Issue 43's pp twin on PP 2 x DP 2 x TP 2: GPT-2's tied embedding gradient left out of the
    all-reduce over the first and last stage: REFUTED, the group to reduce over named in mesh
    coordinates (the pp group of each dp, tp position)."""
    out = tmp_path / "tied"
    exported = invoke("export", "--model", "gpt2", "--config", "tiny", "--pp", "2", "--tp", "2", "--dp", "2", "--train",
                      "--bug", "pp_tied_grad_not_reduced", "--out", out)
    assert exported.exit_code == 0, exported.output
    result = invoke("verify", out)
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "(ranks 0 and 4, the pp group of dp=0, tp=0, and the same at each other position)" in result.output, result.output


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): tests/test_lemmas_stages.py witnesses the "
                                        "lemma on small programs")
def test_tied_embedding_on_a_dp_row_verifies(tmp_path) -> None:
    """GPT-2's tied embedding on PP 2 x DP 2 x TP 2, the correct twin of the test above: on each dp
    row the pp group adds the embedding's and the LM head's summands of that row
    (rules/stages.lp add_term_pieces), and the dp all-reduce adds the rows."""
    out = tmp_path / "gpt2"
    exported = invoke("export", "--model", "gpt2", "--config", "tiny", "--pp", "2", "--tp", "2", "--dp", "2", "--train",
                      "--out", out)
    assert exported.exit_code == 0, exported.output
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
