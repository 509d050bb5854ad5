"""Pipeline-parallel training steps (`refine export --pp N --micro-batches M --train`,
exporters/strategies/pipeline_train.py) and their bug twins, through the CLI in-process.

Each export is made once per module (tiny: 2 layers, batch 2; GPT-2 unless named) and shared by
the tests. The default run verifies GPT-2's step at PP 2 on 2 micro-batches (GPipe and 1F1B) and
refutes the tied-gradient and 1F1B deadlock twins; the sweep (REFINE_TEST_SWEEP=1,
benchmarks/sweep.py) adds one micro-batch, Llama, 3 stages, and the loss-scaling and accumulation
twins.
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
from refine.exporters.strategies import pipeline, pipeline_train  # noqa: E402
from refine.config import load_config  # noqa: E402

EXPORTS: dict[str, tuple[str, ...]] = {
    "m1": ("--pp", "2"),
    "m2": ("--pp", "2", "--micro-batches", "2"),
    "pp3_m2": ("--pp", "3", "--micro-batches", "2", "--layers", "3"),  # the embedding group [0, 2]
    "llama_m2": ("--model", "llama", "--pp", "2", "--micro-batches", "2"),
    "pp_tied_grad_not_reduced": ("--pp", "2", "--micro-batches", "2", "--bug", "pp_tied_grad_not_reduced"),
    "pp_loss_not_scaled": ("--pp", "2", "--micro-batches", "2", "--bug", "pp_loss_not_scaled"),
    "pp_grad_not_accumulated": ("--pp", "2", "--micro-batches", "2", "--bug", "pp_grad_not_accumulated"),
    # 1F1B: a few forwards ahead, then one forward and one backward in turn
    "m2_1f1b": ("--pp", "2", "--micro-batches", "2", "--schedule", "1f1b"),
    "pp3_1f1b": ("--pp", "3", "--micro-batches", "2", "--layers", "3", "--schedule", "1f1b"),
    "pp_1f1b_send_first": ("--pp", "2", "--micro-batches", "2", "--schedule", "1f1b", "--bug", "pp_1f1b_send_first"),
}


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    """name -> its export directory (refine export --model gpt2 --config tiny ... --train), made on first use."""
    def export(name: str, out: Path) -> None:
        args = EXPORTS[name] if "--model" in EXPORTS[name] else ("--model", "gpt2", *EXPORTS[name])
        result = invoke("export", "--config", "tiny", *args, "--train", "--out", out)
        assert result.exit_code == 0, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("pipeline_train"), export)


def source_line(module: object, text: str) -> int:
    """The line of `module`'s file holding `text` (once)."""
    lines = Path(inspect.getfile(module)).read_text().splitlines()  # type: ignore[arg-type]
    hits = [i for i, line in enumerate(lines, start=1) if text in line]
    assert len(hits) == 1, hits
    return hits[0]


# (one micro-batch, llama and 3 stages in the sweep only: REFINE_TEST_SWEEP=1, benchmarks/sweep.py;
# the default run reads the 3-stage export's programs in test_stages_pass_activations_on_and_gradients_back)
@pytest.mark.parametrize("name", ["m2", "m2_1f1b"] + (["m1", "llama_m2", "pp3_m2", "pp3_1f1b"] if SWEEP else []))
def test_pipeline_training_step_verifies_and_matches_torch(step_dir, name: str) -> None:
    """Every stage's forward and backward per micro-batch, the activations and input gradients
    passed by Send/Recv, the gradients accumulated and (GPT-2) the tied embedding's all-reduced
    over the first and last stage rebuild the sequential step's loss and every gradient: VERIFIED,
    and torch agrees numerically (refine.exporters.check, what --check runs)."""
    import refine.exporters

    out = step_dir(name)
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    last = load_config(out).world_size - 1
    assert f"loss = r{last}:loss (replicated on r{last})" in result.output, result.output
    if not name.startswith("llama"):
        held = "r0..r1" if last == 1 else f"r0,r{last}"
        assert f"grad.wte.weight = r0:grad.wte.weight (replicated on {held})" in result.output, result.output
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


def test_stages_pass_activations_on_and_gradients_back(step_dir) -> None:
    """Stage s sends M activations to s+1 and receives M gradients from it; receives M activations
    from s-1 and sends M gradients back; the first and last stage all-reduce the tied embedding's
    gradient over [0, P-1] (the middle stage runs no collective); outputs: the loss on the last
    stage, each stage's own parameters' gradients, declared replicas."""
    from refine.dist import node_attrs

    out = step_dir("pp3_m2")
    config = load_config(out)
    assert config.outputs["loss"].layout == "rep" and config.outputs["grad.wte.weight"].layout == "rep"
    assert config.inputs["labels"].model_dump(exclude_none=True)["also"] == [-100]
    for r in range(3):
        model = onnx.load(str(out / f"rank{r}.onnx"))
        calls = [(n.op_type, node_attrs(n)) for n in model.graph.node if n.domain == "dist"]
        sends = [a["peer"] for op, a in calls if op == "Send"]
        recvs = [a["peer"] for op, a in calls if op == "Recv"]
        assert sorted(sends) == sorted(([r + 1] * 2 if r < 2 else []) + ([r - 1] * 2 if r > 0 else [])), calls
        assert sorted(recvs) == sorted(([r - 1] * 2 if r > 0 else []) + ([r + 1] * 2 if r < 2 else [])), calls
        groups = [tuple(a["group"]) for op, a in calls if op == "AllReduce"]
        assert groups == ([] if r == 1 else [(0, 2)]), calls
        names = [o.name for o in model.graph.output]
        assert ("loss" in names) == (r == 2)
        grads = {n.removeprefix("grad.") for n in names if n.startswith("grad.")}
        assert ("wte.weight" in grads) == (r in (0, 2)) and ("wpe.weight" in grads) == (r == 0)
        assert {n.split(".")[1] for n in grads if n.startswith("h.")} == {str(r)}


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
    """The embedding group's all-reduce left out (class 13): each of the first and last stage keeps
    its own term of the tied weight's gradient. REFUTED at the sequential sum of the two terms
    (the engine's Add in wte's backward), the first stage's term at its embedding lookup, the last
    stage's at its LM head (exporters/strategies/pipeline.py)."""
    output, sites = refuted(step_dir, tmp_path, "pp_tied_grad_not_reduced")
    assert "first failure: node wte (backward)/Add" in output, output
    embed = f"exporters/strategies/pipeline.py:{source_line(pipeline, 'return self.wte(ids) + self.wpe(pos)')}"
    head = f"exporters/strategies/pipeline.py:{source_line(pipeline, 'return self.lm_head(self.ln_f(x))')}"
    assert any(s.endswith(embed) for s in sites.get(0, ())), sites
    assert any(s.endswith(head) for s in sites.get(1, ())), sites


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the class-13 twin refuted by default "
                                        "is pp_tied_grad_not_reduced")
def test_loss_not_scaled_is_refuted_at_the_loss_division(step_dir, tmp_path) -> None:
    """Each micro-batch's loss the mean over its own tokens, not divided by M (class 13): REFUTED
    at the sequential loss's division (the mean), the last stage's mean at the bug's line."""
    output, sites = refuted(step_dir, tmp_path, "pp_loss_not_scaled")
    assert "first failure: node Div (Div)" in output, output
    line = source_line(pipeline_step, "return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)")
    assert any(s.endswith(f"exporters/capture/pipeline_step.py:{line}") for s in sites.get(1, ())), sites


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the twin refuted by default is "
                                        "pp_tied_grad_not_reduced")
def test_grad_not_accumulated_is_refuted(step_dir, tmp_path) -> None:
    """Only the last micro-batch's parameter gradients kept: REFUTED by a counterexample on the
    gradients (each stage's is one micro-batch's piece of the sequential sum over the batch). The
    first failure is stage 0's first node whose backward values are gone: nothing reads micro-batch
    0's gradients, so the program keeps no backward for it, and h.0.ln_1's statistics saved for the
    backward (the LayerNormalization's mean and inverse deviation) exist for micro-batch 1 only."""
    output, _ = refuted(step_dir, tmp_path, "pp_grad_not_accumulated")
    assert "no reconstruction of output grad." in output, output
    assert "first failure: node h.0.ln_1/LayerNormalization" in output, output


def test_1f1b_sending_before_receiving_deadlocks(step_dir) -> None:
    """1F1B's steady state with the forward's send before the backward's receive: with blocking
    point-to-point calls each stage waits in a send to the other. REFUTED whatever the values:
    the calls cannot run together, the two sends named."""
    result = invoke("verify", step_dir("pp_1f1b_send_first"))
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "cannot run together" in result.output and "deadlock" in result.output, result.output
    assert "waits in Send call #1 of the sends from rank 0 to rank 1" in result.output, result.output


def test_schedules_order_each_stage() -> None:
    """GPipe: every forward, then every backward; 1F1B: stages - 1 - stage forwards ahead, then
    one forward and one backward in turn; each micro-batch's backward after its forward."""
    assert pipeline_train.schedule("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert pipeline_train.schedule("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                                        ("B", 2), ("B", 3)]
    assert pipeline_train.schedule("1f1b", 2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                                        ("F", 3), ("B", 3)]
    for stage in range(3):
        order = pipeline_train.schedule("1f1b", stage, 3, 2)
        assert sorted(order) == sorted(pipeline_train.schedule("gpipe", stage, 3, 2))
        assert all(order.index(("F", k)) < order.index(("B", k)) for k in range(2))


@pytest.mark.parametrize("args,words", [
    (("--pp", "2", "--train", "--meta"), "drop --meta"),
    (("--pp", "2", "--schedule", "1f1b"), "pass --pp N --train"),
    (("--pp", "2", "--train", "--schedule", "zigzag"), "one of gpipe, 1f1b"),
    (("--pp", "2", "--micro-batches", "2", "--train", "--bug", "pp_1f1b_send_first"), "pass --schedule 1f1b"),
    (("--pp", "2", "--bug", "pp_tied_grad_not_reduced"), "in the training step: pass --train"),
    (("--pp", "2", "--micro-batches", "2", "--train", "--bug", "pp_micro_batch_order"), "a forward bug: drop --train"),
    (("--pp", "2", "--train", "--bug", "pp_loss_not_scaled"), "needs --micro-batches 2 or more"),
    (("--pp", "2", "--tp", "2", "--train", "--sp"), "no --sp yet"),  # (PP x TP steps: test_pipeline_mesh_train.py)
])
def test_bad_pipeline_training_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "gpt2", "--config", "tiny", *args)
