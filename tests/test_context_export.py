"""Context parallelism (exporters/strategies/context.py): the zoo GPT-2 with its sequence split over 2 ranks,
keys and values all-gathered in every attention layer, verifies; its bug twins (docs/bugs.md
class 9: positions or causal mask not offset by the rank's slice) are refuted by a numeric
counterexample, the report naming where in exporters/strategies/context.py the ranks compute the failing node.
Zig-zag CP (`--cp N --zigzag`: rank r computes chunks r and 2N-1-r of 2N) verifies and matches
torch at CP 2 and 4, its logits a stride-2 shard; its twins (second chunk's mask or positions
offset as chunk r's, second chunks' K/V gathered in rank order) are refuted the same way.
The forward training loss (`--cp N --loss`: labels shifted before the split, sliced alongside the
token ids, each rank's token-loss sum over the all-reduced token count) verifies and matches torch
at CP 2 and 4, and so does the training step (`--cp N --train`: loss and every gradient, the K/V
all-gathers' backward reduce-scatters, gradients all-reduced); the twin cp_labels_shifted_after_split
(each rank shifts its own slice of the token ids: the boundary token's label is lost) is refuted by
a counterexample at the labels' flatten, in both.

Each export is made once per session through the CLI (exports_on_first_use) and shared by the tests reading it.
The default run verifies CP 2 (all-gather, zig-zag, the forward loss) and refutes the mask twin, the
zig-zag chunk order twin and the labels twin on the forward loss; the sweep (REFINE_TEST_SWEEP=1,
benchmarks/sweep.py) adds CP 4, the training steps and the other twins.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402

CONTEXT_PY = str(Path(__file__).resolve().parent.parent / "exporters" / "strategies" / "context.py")
EXPORTS = {"cp2": None, "positions": "cp_positions_not_offset", "mask": "cp_mask_not_offset"}
# zig-zag exports (`--cp N --zigzag [--bug B]`): name -> (N, bug)
ZIGZAG = {"zz2": (2, None), "zz4": (4, None), "zz_mask": (2, "zigzag_mask_not_offset"),
          "zz_positions": (2, "zigzag_positions_not_offset"), "zz_order": (2, "zigzag_chunk_order")}
# forward-loss and training-step exports (`--cp N --loss|--train [--bug B]`): name -> (N, bug, flag)
LOSS = {"loss2": (2, None, "--loss"), "loss4": (4, None, "--loss"),
        "loss_shifted": (2, "cp_labels_shifted_after_split", "--loss"),
        "train2": (2, None, "--train"), "train4": (4, None, "--train"), "train_shifted": (2, "cp_labels_shifted_after_split", "--train")}


@pytest.fixture(scope="session")
def cp_dir(tmp_path_factory):
    """name -> the GPT-2 tiny CP 2 export of that name (EXPORTS: its bug, if any; ZIGZAG: a
    zig-zag export, its CP degree and bug; LOSS: a forward-loss or training-step export, its CP
    degree, bug and flag), made through the CLI (`refine export --cp N [--zigzag | --loss | --train]
    [--bug B]`, which must exit 0)."""
    def export(name: str, out: Path) -> None:
        cp, bug_name = ZIGZAG[name] if name in ZIGZAG else LOSS[name][:2] if name in LOSS else (2, EXPORTS[name])
        bug = ("--bug", bug_name) if bug_name else ()
        variant = ("--zigzag",) if name in ZIGZAG else (LOSS[name][2],) if name in LOSS else ()
        result = invoke("export", "--model", "gpt2", "--config", "tiny", "--cp", str(cp), *variant, *bug, "--out", out)
        assert result.exit_code == 0, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("context"), export)


def test_refine_json_declares_the_sequence_split(cp_dir) -> None:
    """input_ids sharded along the sequence (ids in [0, vocab)), logits sequence-sharded, every
    weight replicated; every rank all-gathers k and v once per layer."""
    out = cp_dir("cp2")
    config = json.loads((out / "refine.json").read_text())
    assert config["world_size"] == 2
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 1, "range": [0, 128]}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 1}}
    assert all(v == {"layout": "rep"} for k, v in config["inputs"].items() if k != "input_ids")
    assert "wpe.weight" in config["inputs"] and "h.1.attn.k_proj.weight" in config["inputs"]


def test_context_parallel_gpt2_verifies(cp_dir) -> None:
    result = invoke("verify", cp_dir("cp2"))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    assert "logits = concat(r0..r1:logits, axis=1)" in result.output


def test_context_parallel_gpt2_matches_torch(cp_dir) -> None:
    """The exported ranks, fed their slices of the tokens, rebuild what the torch model computes."""
    import refine.exporters

    checked = refine.exporters.check(cp_dir("cp2"))
    assert checked.ok, checked.render()


def sweep_only(*values, why: str):
    """A parameter set that runs under harness.SWEEP only (REFINE_TEST_SWEEP=1, benchmarks/sweep.py)."""
    return pytest.param(*values, marks=pytest.mark.skipif(not SWEEP, reason=f"sweep only (REFINE_TEST_SWEEP=1): {why}"))


# (the positions twin in the sweep: tests/test_zoo.py refutes `refine zoo`'s export of it at wpe/Gather by default)
@pytest.mark.parametrize("name,node", [sweep_only("positions", "wpe/Gather", why="the zoo's CP slice refutes it"),
                                       ("mask", "attn/Where")])
def test_context_parallel_bug_twin_refuted(cp_dir, tmp_path: Path, name: str, node: str) -> None:
    """Refuted (exit 1) by a counterexample; the first failure is the lookup of the positions or
    the masked fill of layer 0, computed on the ranks at a line of exporters/strategies/context.py."""
    assert_refuted_in_context_py(cp_dir(name), tmp_path, node, in_layer0=name != "positions")


def assert_refuted_in_context_py(out: Path, tmp_path: Path, node: str, in_layer0: bool) -> None:
    """REFUTED by a counterexample, the first failure at `node` (in layer 0 if `in_layer0`), its
    rank nodes at lines of exporters/strategies/context.py."""
    report = tmp_path / "report.json"
    result = invoke("verify", out, "--json", report)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output.splitlines()[0]
    assert "counterexample" in result.output
    failure = json.loads(report.read_text())["failure"]
    assert failure["node"].endswith(node) and (not in_layer0 or failure["node"].startswith("h.0"))
    sites = {(n["location"]["file"], n["location"]["line"]) for n in failure["rank_nodes"]}
    assert sites and all(file == CONTEXT_PY for file, _ in sites), sites


@pytest.mark.parametrize("args,words", [
    (("--cp", "1"), "at least 2 ranks"),
    (("--cp", "3"), "does not divide the sequence length"),
    (("--cp", "2", "--pp", "2"), "--pp and --cp together"),
    (("--cp", "2", "--tp", "2"), "not supported yet"),
    (("--cp", "2", "--bug", "nope"), "unknown context-parallel bug 'nope'"),
])
def test_bad_context_parallel_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "gpt2", "--config", "tiny", *args)


def test_cli_exports_a_context_parallel_plan(cp_dir) -> None:
    """`refine export --cp 2 --bug cp_mask_not_offset` (cp_dir's CLI run, which exited 0) writes the
    twin's programs and refine.json; `refine verify` refutes it with exit 1 in
    test_context_parallel_bug_twin_refuted[mask]."""
    out = cp_dir("mask")
    assert sorted(p.name for p in out.glob("*.onnx")) == ["rank0.onnx", "rank1.onnx", "seq.onnx"]
    assert json.loads((out / "refine.json").read_text())["world_size"] == 2


# --- zig-zag (load-balanced) chunks: rank r computes chunks r and 2N-1-r of 2N ----------------


def test_zigzag_refine_json_declares_a_stride_2_logits_shard(cp_dir) -> None:
    """The token ids replicated (each rank cuts its two chunks), the logits a stride-2 shard along
    the sequence (rank r: chunks r and N + r, after trading its second chunk with rank N-1-r);
    every rank gathers k and v twice per layer (first and second chunks) and trades once."""
    out = cp_dir("zz2")
    config = json.loads((out / "refine.json").read_text())
    assert config["world_size"] == 2
    assert config["inputs"]["input_ids"] == {"layout": "rep", "range": [0, 128]}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 1, "stride": 2}}
    assert all(v == {"layout": "rep"} for k, v in config["inputs"].items() if k != "input_ids")


# (CP 4 in the sweep only: REFINE_TEST_SWEEP=1, benchmarks/sweep.py)
@pytest.mark.parametrize("name,ranks", [("zz2", "r0..r1")] + ([("zz4", "r0..r3")] if SWEEP else []))
def test_zigzag_context_parallel_verifies(cp_dir, name: str, ranks: str) -> None:
    result = invoke("verify", cp_dir(name))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    assert f"logits = interleave({ranks}:logits, axis=1" in result.output


@pytest.mark.parametrize("name", ["zz2"] + (["zz4"] if SWEEP else []))
def test_zigzag_context_parallel_matches_torch(cp_dir, name: str) -> None:
    """What `refine export --check` runs: the ranks' logits, rebuilt by the stride-2 layout, are
    what the torch model computes."""
    import refine.exporters

    checked = refine.exporters.check(cp_dir(name))
    assert checked.ok, checked.render()


# (the default run: the zig-zag-only twin; the mask and positions twins, CP 2's at another place, in the sweep)
@pytest.mark.parametrize("name,node", [sweep_only("zz_mask", "attn/Where", why="CP 2's mask twin runs by default"),
                                       sweep_only("zz_positions", "wpe/Gather", why="CP 2's positions twin is refuted "
                                                  "by default in tests/test_zoo.py"),
                                       ("zz_order", "attn/Transpose_4")])
def test_zigzag_bug_twin_refuted(cp_dir, tmp_path: Path, name: str, node: str) -> None:
    """Refuted (exit 1) by a counterexample; the first failure is layer 0's masked fill, the
    position lookup, or the keys gathered out of order (their transpose for the scores), computed
    on the ranks at a line of exporters/strategies/context.py."""
    assert_refuted_in_context_py(cp_dir(name), tmp_path, node, in_layer0=name != "zz_positions")


@pytest.mark.parametrize("args,words", [
    (("--zigzag",), "pass --cp N too"),
    (("--cp", "2", "--ring", "--zigzag"), "is not built"),
    (("--cp", "8", "--zigzag"), "16 does not divide the sequence length 8"),
    (("--cp", "2", "--bug", "zigzag_chunk_order"), "unknown context-parallel bug 'zigzag_chunk_order'"),
])
def test_bad_zigzag_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "gpt2", "--config", "tiny", *args)


# --- the forward training loss over sequence slices (--loss) ---------------------------------


def test_loss_refine_json_slices_labels_alongside_the_tokens(cp_dir) -> None:
    """input_ids and labels sliced along the sequence (labels may be the ignore index), the loss a
    replica; every rank all-reduces its token count and its loss share."""
    out = cp_dir("loss2")
    config = json.loads((out / "refine.json").read_text())
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 1, "range": [0, 128]}
    assert config["inputs"]["labels"] == {"layout": "shard", "axis": 1, "range": [0, 128], "also": [-100]}
    assert config["outputs"] == {"loss": {"layout": "rep"}}


# (CP 4 and the training steps: sweep only; a CP training step runs by default in tests/test_mesh4d.py)
@pytest.mark.parametrize("name,ranks", [("loss2", "r0..r1")]
                         + ([("train2", "r0..r1"), ("loss4", "r0..r3"), ("train4", "r0..r3")] if SWEEP else []))
def test_context_parallel_loss_verifies(cp_dir, name: str, ranks: str) -> None:
    result = invoke("verify", cp_dir(name))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    assert f"loss = r0:loss (replicated on {ranks})" in result.output
    if name.startswith("train"):
        assert f"grad.wpe.weight = r0:grad.wpe.weight (replicated on {ranks})" in result.output


@pytest.mark.parametrize("name", ["loss2"] + (["train2", "loss4", "train4"] if SWEEP else []))
def test_context_parallel_loss_matches_torch(cp_dir, name: str) -> None:
    """The ranks' loss is torch's token cross-entropy (mean over the counted tokens) of the whole
    sequence, on random token ids and labels (some of them the ignore index); a training step's
    gradients are torch's too."""
    import refine.exporters

    checked = refine.exporters.check(cp_dir(name))
    assert checked.ok, checked.render()


@pytest.mark.parametrize("name", ["loss_shifted"] + (["train_shifted"] if SWEEP else []))  # (the same twin)
def test_labels_shifted_after_the_split_refuted(cp_dir, tmp_path: Path, name: str) -> None:
    """cp_labels_shifted_after_split: each rank shifts its own slice of the token ids to make its
    labels. Refuted (exit 1) by a counterexample; the first failure is the sequential loss's
    flatten of the labels (the forward loss: at its line of exporters/strategies/context.py), which no rank
    computes on its labels."""
    import refine.exporters

    assert not refine.exporters.check(cp_dir(name)).ok  # torch's own numbers differ too
    report = tmp_path / "report.json"
    result = invoke("verify", cp_dir(name), "--json", report)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output.splitlines()[0]
    assert "counterexample" in result.output
    data = json.loads(report.read_text())
    failure = data["failure"]
    assert failure["op"] == "Reshape" and {i["input"] for i in failure["inputs"]} == {"labels"}, failure
    assert data["diagnosis"] is None, data["diagnosis"]  # (not the attention's: its masked scores relate)
    if name == "loss_shifted":
        assert failure["location"]["file"] == CONTEXT_PY, failure["location"]


@pytest.mark.parametrize("args,words", [
    (("--loss",), "pass --cp N too"),
    (("--cp", "2", "--loss", "--ring"), "--loss with --ring or --zigzag is not built"),
    (("--cp", "2", "--loss", "--zigzag"), "--loss with --ring or --zigzag is not built"),
    (("--cp", "2", "--bug", "cp_labels_shifted_after_split"), "unknown context-parallel bug"),
    (("--cp", "2", "--loss", "--train"), "pass one of them"),
    (("--cp", "2", "--train", "--ring"), "--train with --ring or --zigzag is not built"),
    (("--cp", "2", "--train", "--zigzag"), "--train with --ring or --zigzag is not built"),
])
def test_bad_loss_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "gpt2", "--config", "tiny", *args)
