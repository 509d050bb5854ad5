"""PP x TP training steps (`refine export --pp P --tp T --micro-batches M --train`,
exporters/strategies/pipeline_mesh_train.py) and their bug twins, through the CLI in-process.

Each export is made once per module (GPT-2 tiny: 2 layers, batch 2; PP 2 x TP 2, 2 micro-batches
unless named) and shared by the tests; 1F1B, Llama, PP 3 and the other twins run in the sweep only
(REFINE_TEST_SWEEP=1, benchmarks/sweep.py).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402

from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402

from refine.exporters.capture import pipeline_step  # noqa: E402
from refine.exporters.strategies import pipeline  # noqa: E402
from refine.config import load_config  # noqa: E402

PPTP = ("--pp", "2", "--tp", "2", "--micro-batches", "2")
EXPORTS: dict[str, tuple[str, ...]] = {
    "m2": PPTP,
    "m2_1f1b": (*PPTP, "--schedule", "1f1b"),
    "llama_m2": ("--model", "llama", *PPTP),
    "pp3": ("--pp", "3", "--tp", "2", "--micro-batches", "2", "--layers", "3"),  # embedding groups {0, 4}, {1, 5}
    "pp_tied_grad_not_reduced": (*PPTP, "--bug", "pp_tied_grad_not_reduced"),
    "pp_loss_not_scaled": (*PPTP, "--bug", "pp_loss_not_scaled"),
    "pp_grad_not_accumulated": (*PPTP, "--bug", "pp_grad_not_accumulated"),
    "pp_1f1b_send_first": (*PPTP, "--schedule", "1f1b", "--bug", "pp_1f1b_send_first"),
}


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    """name -> its export directory (refine export --config tiny ... --train), made on first use."""
    def export(name: str, out: Path) -> None:
        args = EXPORTS[name] if "--model" in EXPORTS[name] else ("--model", "gpt2", *EXPORTS[name])
        result = invoke("export", "--config", "tiny", *args, "--train", "--out", out)
        assert result.exit_code == 0, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("pipeline_mesh_train"), export)


def source_line(module: object, text: str) -> int:
    lines = Path(inspect.getfile(module)).read_text().splitlines()  # type: ignore[arg-type]
    hits = [i for i, line in enumerate(lines, start=1) if text in line]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.mark.parametrize("name", ["m2"] + (["m2_1f1b", "llama_m2", "pp3"] if SWEEP else []))
def test_pptp_training_step_verifies_and_matches_torch(step_dir, name: str) -> None:
    """Each stage's TP plan with its backward, activations and their gradients passed by Send/Recv
    between the same TP position of adjacent stages, gradients accumulated over the micro-batches
    and (GPT-2) the tied embedding's all-reduced over the first and last stage at each TP position
    rebuild the sequential step's loss and every gradient: VERIFIED (a TP-sharded weight's gradient
    the concatenation of its stage's TP ranks'), and torch agrees numerically (refine.exporters.check)."""
    import refine.exporters

    out = step_dir(name)
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    world = load_config(out).world_size
    assert f"loss = r{world - 2}:loss (replicated on r{world - 2}..r{world - 1})" in result.output, result.output
    if not name.startswith("llama"):
        held = "r0..r3" if world == 4 else f"r0,r1,r{world - 2},r{world - 1}"
        assert f"grad.wte.weight = r0:grad.wte.weight (replicated on {held})" in result.output, result.output
        assert ("grad.h.0.attn.q_proj.weight = concat(r0..r1:grad.h.0.attn.q_proj.weight, axis=0)"
                in result.output), result.output
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


def test_stages_pass_on_between_the_same_tp_position(step_dir) -> None:
    """Rank s*2 + t sends its 2 micro-batches' activations to (s+1)*2 + t and receives their
    gradients back (and the reverse on the last stage); TP collectives over the stage's own group,
    the tied embedding's all-reduce over {t, 2 + t}; refine.json's mesh is pp x tp, a TP-sharded
    weight split over tp, its gradient declared where every rank holds a piece only (export.json
    keeps every gradient's layout)."""
    from refine.dist import node_attrs

    out = step_dir("m2")
    config = json.loads((out / "refine.json").read_text())
    manifest = json.loads((out / "export.json").read_text())
    assert config["mesh"] == {"shape": [2, 2], "dims": ["pp", "tp"]}
    assert config["inputs"]["h.0.attn.q_proj.weight"] == {"layout": "shard", "axis": 0, "over": "tp"}
    assert config["outputs"]["grad.wte.weight"] == {"layout": "rep"}
    assert "grad.h.0.attn.q_proj.weight" not in config["outputs"]
    assert manifest["outputs"]["grad.h.0.attn.q_proj.weight"] == {"layout": "shard", "axis": 0, "over": "tp"}
    for r in range(4):
        stage, t = divmod(r, 2)
        peer = (1 - stage) * 2 + t
        program = onnx.load(str(out / f"rank{r}.onnx"))  # (the layers' collectives are in their functions)
        calls = [(n.op_type, node_attrs(n)) for n in [*program.graph.node, *(n for f in program.functions for n in f.node)]
                 if n.domain == "dist"]
        assert [a["peer"] for op, a in calls if op in ("Send", "Recv")] == [peer] * 4, calls
        groups = {tuple(a["group"]) for op, a in calls if op == "AllReduce"}
        assert groups == {(2 * stage, 2 * stage + 1), (t, 2 + t)}, groups
        names = [o.name for o in onnx.load(str(out / f"rank{r}.onnx")).graph.output]
        assert ("loss" in names) == (stage == 1) and "grad.wte.weight" in names


def rank_sites(report_path: Path) -> dict[int, set[str]]:
    report = json.loads(report_path.read_text())
    sites: dict[int, set[str]] = {}
    for g in report["failure"]["neighbourhood"]:
        if g["rank"] >= 0:
            sites.setdefault(g["rank"], set()).update(n["location"] for n in g["nodes"] if n.get("location"))
    return sites


def refuted(step_dir, tmp_path: Path, bug: str) -> tuple[str, dict[int, set[str]]]:
    report_path = tmp_path / "report.json"
    result = invoke("verify", step_dir(bug), "--json", report_path)
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "counterexample (seed" in result.output, result.output
    return result.output, rank_sites(report_path)


def test_tied_gradient_not_reduced_is_refuted_at_the_tied_sum(step_dir, tmp_path) -> None:
    """The embedding groups' all-reduce left out (class 13): TP rank t of the first and of the last
    stage each keep their own term of the tied weight's gradient. REFUTED at the sequential sum of
    the two terms (wte's backward Add), the first stage's ranks at their embedding lookup, the last
    stage's at their LM head (exporters/strategies/pipeline.py)."""
    output, sites = refuted(step_dir, tmp_path, "pp_tied_grad_not_reduced")
    assert "no reconstruction of output grad.wte.weight" in output, output
    assert "first failure: node wte (backward)/Add" in output, output
    embed = f"exporters/strategies/pipeline.py:{source_line(pipeline, 'return self.wte(ids) + self.wpe(pos)')}"
    head = f"exporters/strategies/pipeline.py:{source_line(pipeline, 'return self.lm_head(self.ln_f(x))')}"
    for r in (0, 1):
        assert any(s.endswith(embed) for s in sites.get(r, ())), sites
    for r in (2, 3):
        assert any(s.endswith(head) for s in sites.get(r, ())), sites


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1)")
def test_loss_not_scaled_is_refuted_at_the_loss_division(step_dir, tmp_path) -> None:
    output, sites = refuted(step_dir, tmp_path, "pp_loss_not_scaled")
    assert "first failure: node Div (Div)" in output, output
    line = source_line(pipeline_step, "return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)")
    assert any(s.endswith(f"exporters/capture/pipeline_step.py:{line}") for s in sites.get(2, ())), sites


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1)")
def test_grad_not_accumulated_is_refuted(step_dir, tmp_path) -> None:
    output, _ = refuted(step_dir, tmp_path, "pp_grad_not_accumulated")
    assert "no reconstruction of output grad." in output, output


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1)")
def test_1f1b_sending_before_receiving_deadlocks(step_dir) -> None:
    result = invoke("verify", step_dir("pp_1f1b_send_first"))
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "cannot run together" in result.output and "deadlock" in result.output, result.output
    assert "waits in Send call #1 of the sends from rank 0 to rank 2" in result.output, result.output


@pytest.mark.parametrize("args,words", [
    (("--pp", "2", "--tp", "2", "--train", "--sp"), "no --sp yet"),
    (("--pp", "2", "--tp", "2", "--micro-batches", "2", "--train", "--bug", "pp_wrong_tp_peer"),
     "a forward bug: drop --train"),
    (("--pp", "2", "--tp", "2", "--micro-batches", "2", "--train", "--bug", "pp_1f1b_send_first"),
     "pass --schedule 1f1b"),
    (("--pp", "2", "--tp", "3", "--train"), "tp"),
])
def test_bad_pptp_training_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "gpt2", "--config", "tiny", *args)
