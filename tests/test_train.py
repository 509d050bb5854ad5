"""Training steps (`refine export --train`, exporters/capture/train.py): loss and every gradient.

Each case is exported once per session (tiny configs, two layers, TP 2; about 20 s each): the
correct step of each zoo model, the three backward bug classes injected in PyTorch
(exporters/zoo/bugs.py) and the same injection machinery with the bug taken out. A correct step
must pass `refine.exporters.check` (loss and every gradient against torch's autograd) and verify; a
bug must be real numerically and refuted at the node where its gradient goes wrong, in the
backward, with its module and source line. The full train zoo (TP 2/4/8) is a benchmark
(`refine zoo --steps train`, then `refine batch`). The default run leaves Qwen2's SP step, both
controls, GPT-2's grad_avg_allreduce twin, the forward export of a backward bug and the flat step
(--flat) to the sweep (REFINE_TEST_SWEEP=1, benchmarks/sweep.py: SWEEP_ONLY).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
from torch import nn  # noqa: E402

import refine.exporters  # noqa: E402
from refine.exporters.zoo import bugs  # noqa: E402
from refine.exporters.errors import ExportError  # noqa: E402
from refine.exporters.capture.train import GRAD_PREFIX, LOSS, grad_name  # noqa: E402
from harness import SWEEP, exports_on_first_use, invoke  # noqa: E402
from refine.config import load_config  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

# case -> (model, sp, bug or control name, None for the correct step)
CASES = {
    "llama_tp2": ("llama", False, None),
    "qwen2_sp2": ("qwen2", True, None),
    "gpt2_sp2": ("gpt2", True, None),
    "llama_tp2__missing_grad_allreduce": ("llama", False, "missing_grad_allreduce"),
    "gpt2_tp2__grad_avg_allreduce": ("gpt2", False, "grad_avg_allreduce"),
    "llama_sp2__sp_norm_grad_unreduced": ("llama", True, "sp_norm_grad_unreduced"),
    "llama_tp2__faulty_colwise_sum": ("llama", False, "faulty_colwise_sum"),
    "llama_sp2__sp_norm_grad_reduced": ("llama", True, "sp_norm_grad_reduced"),
    "gpt2_tp2_flat": ("gpt2", False, None),
}
# the sweep's (benchmarks/sweep.py): Qwen2's SP step (the default run verifies GPT-2's, whose
# column-parallel projections have biases as Qwen2's q/k/v do); the controls (the injection machinery
# with the bug taken out: Llama's SP step sp_norm_grad_reduced and faulty_colwise_sum; the default run
# verifies Llama's TP step and GPT-2's SP step, and refutes the SP twin sp_norm_grad_unreduced);
# GPT-2's grad_avg twin (a backward all-reduce wrong where Llama's missing_grad_allreduce runs by
# default; class 14's extra factor in a backward all-reduce: tests/test_own_bugs.py
# row_autograd_allreduce_train)
SWEEP_ONLY = {"qwen2_sp2", "llama_sp2__sp_norm_grad_reduced", "llama_tp2__faulty_colwise_sum",
              "gpt2_tp2__grad_avg_allreduce"}
CORRECT = [c for c, (_, _, bug) in CASES.items() if (bug is None or bug in bugs.CONTROLS) and not c.endswith("_flat")
           and (SWEEP or c not in SWEEP_ONLY)]
BUGGY = [c for c, (_, _, bug) in CASES.items() if bug in bugs.BUGS and (SWEEP or c not in SWEEP_ONLY)]


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """case -> its model directory (llama_tp2 through the CLI, with --check)."""
    def export(case: str, out: Path) -> None:
        model, sp, bug = CASES[case]
        if case == "llama_tp2":
            result = invoke("export", "--model", model, "--tp", "2", "--train", "--check", "--out", str(out))
            assert result.exit_code == 0, result.output
            assert "check: PASSED" in result.stdout
            return
        injected = (bugs.BUGS.get(bug) or bugs.CONTROLS[bug]) if bug else None
        refine.exporters.export_model(model, "tiny", 2, sp, out, train=True, bug=injected, flat=case.endswith("_flat"))

    return exports_on_first_use(tmp_path_factory.mktemp("train"), export)


@pytest.fixture(scope="session")
def verified(exported):
    """case -> its report (refine verify, with the counterexample search)."""
    reports: dict = {}

    def get(case: str):
        if case not in reports:
            reports[case] = verify_dir(exported(case))
        return reports[case]

    return get


def test_outputs_are_the_loss_and_one_gradient_per_parameter(exported):
    out = exported("llama_tp2")
    seq = onnx.load(str(out / "seq.onnx"))
    inputs = {i.name for i in seq.graph.input} - {i.name for i in seq.graph.initializer}
    assert inputs == {"input_ids", "labels"}
    params = [name for name, _ in refine.exporters.zoo.models.build("llama", "tiny").named_parameters()]
    assert [o.name for o in seq.graph.output] == [LOSS, *(grad_name(p) for p in params)]
    config = load_config(out)
    # every gradient is declared with its parameter's layout: shards alike, replicas as replicas
    for p in params:
        assert config.outputs[grad_name(p)] == config.inputs[p], p
    assert config.outputs[LOSS].layout == "rep"
    layouts = {config.outputs[grad_name(p)].layout for p in params}
    assert layouts == {"rep", "shard"}
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["train"] is True and manifest["inputs"]["labels"]["high"] == 128


def test_backward_collectives_are_the_implementations(exported):
    """DTensor's backward redistributions are in the program: at TP 2 every column-parallel
    input gradient is all-reduced (3 attention + 2 MLP projections' inputs per layer, summed
    per module input), and SP adds all-gathers and reduce-scatters in both directions."""
    tp = refine.exporters.capture.export.op_counts(onnx.load(str(exported("llama_tp2") / "rank0.onnx")))
    sp = refine.exporters.capture.export.op_counts(onnx.load(str(exported("gpt2_sp2") / "rank0.onnx")))
    forward_allreduces = 2 * 2  # two row-parallel outputs per layer, two layers
    assert tp["dist.AllReduce"] > forward_allreduces
    assert sp["dist.AllGather"] > 0 and sp["dist.ReduceScatter"] > 0


def test_backward_nodes_say_so_and_keep_the_source_line(exported):
    seq = onnx.load(str(exported("llama_tp2") / "seq.onnx"))
    nodes = [*seq.graph.node, *(n for f in seq.functions if f.name.endswith("_backward") for n in f.node)]
    backward = [n for n in nodes
                if "refine.backward" in {p.key: p.value for p in n.metadata_props}.get("pkg.torch.onnx.class_hierarchy", "")]
    assert len(backward) > len(nodes) / 3
    traces = [{p.key: p.value for p in n.metadata_props}.get("pkg.torch.onnx.stack_trace", "") for n in backward]
    assert sum("modeling_llama.py" in t for t in traces) > len(backward) / 2


@pytest.mark.parametrize("case", CORRECT)
def test_correct_steps_pass_the_numeric_check_and_verify(exported, verified, case):
    check = refine.exporters.check(exported(case))
    assert check.ok, check.render()
    assert any(line.startswith("ok    grad.") for line in check.lines)
    report = verified(case)
    assert report.verdict == "verified", render_text(report)


# bug -> (module whose backward must be named, what the report must say)
WHERE = {
    "missing_grad_allreduce": ("model.layers.0", "(backward)"),
    "grad_avg_allreduce": ("h.0", "(backward)"),
    "sp_norm_grad_unreduced": ("model.layers.0.post_attention_layernorm", "grad.model.layers.0.post_attention_layernorm.weight"),
}
# bug -> what is wrong, in plain words (refine/diagnose/plain.py): (pattern, docs/bugs.md class, words)
WHAT = {
    "missing_grad_allreduce": ("missing_allreduce", 1, "an all-reduce (sum) is missing after `model.layers.0 (backward)/"),
    "grad_avg_allreduce": ("wrong_collective", 14, "reduce them with avg"),
    "sp_norm_grad_unreduced": ("unreduced_gradient", 4, "modeling_llama.py:67"),  # class 4: the SP norm weight gradient
}


@pytest.mark.parametrize("case", BUGGY)
def test_backward_bugs_are_real_and_refuted_where_the_gradient_goes_wrong(exported, verified, case):
    check = refine.exporters.check(exported(case))
    assert not check.ok, "the bug does not change any gradient"
    assert any(line.startswith("FAIL  grad.") for line in check.lines)
    report = verified(case)
    assert report.verdict == "refuted", render_text(report)
    text = render_text(report)
    module, words = WHERE[CASES[case][2]]
    first = text.split("first failure:", 1)[1].splitlines()[0]
    assert module in first and ".py:" in first, first
    assert words in text
    pattern, bug_class, said = WHAT[CASES[case][2]]
    assert report.diagnosis is not None and (report.diagnosis.pattern, report.diagnosis.bug_class) == (pattern, bug_class)
    assert said in text.splitlines()[1], text.splitlines()[1]  # the second line says what is wrong


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): a forward export of Llama at TP 2, "
                                        "with the injection that leaves it alone")
def test_a_forward_export_of_a_backward_bug_verifies(tmp_path):
    """The backward bugs leave the forward alone: the same injection verifies without --train."""
    out = tmp_path / "fwd"
    refine.exporters.export_model("llama", "tiny", 2, False, out, bug=bugs.BUGS["missing_grad_allreduce"])
    assert verify_dir(out).verdict == "verified"


class _Branchy(nn.Module):
    """A forward that branches on a value: no single program computes its training step."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y if y.sum() > 0 else -y


def test_a_step_that_cannot_be_captured_is_one_error_and_writes_nothing(tmp_path):
    out = tmp_path / "branchy"
    example = (torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3)))
    with pytest.raises(ExportError) as err:
        refine.exporters.export(_Branchy(), lambda rank: _Branchy(), example, 2, out, train=True)
    message = str(err.value)
    assert "_Branchy" in message and "\n" not in message
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_forward_that_cannot_be_captured_is_one_error_naming_the_line(tmp_path):
    """The same model exported forward only, its ranks in forked workers: one line naming the
    module, torch's reason and the model's own source line, not a traceback."""
    out = tmp_path / "branchy"
    with pytest.raises(ExportError) as err:
        refine.exporters.export(_Branchy(), lambda rank: _Branchy(), (torch.randn(2, 3, 8),), 2, out, workers=2)
    message = str(err.value)
    assert message.startswith("_Branchy (torch.export) cannot be captured: ") and "\n" not in message
    assert f"{Path(__file__).name}:" in message, message  # the line of `y.sum() > 0`
    assert not out.exists()


def test_each_distinct_layer_is_a_forward_and_a_backward_function(exported, verified):
    """Two identical layers: one forward and one backward function per program, a forward and
    a backward call per layer (backward calls in reverse order), and the verifier solves each
    template once (exporters/capture/train_layers.py, refine/run/memo.py)."""
    out = exported("llama_tp2")
    for name in ("seq.onnx", "rank0.onnx", "rank1.onnx"):
        model = onnx.load(str(out / name))
        assert sorted(f.name for f in model.functions) == ["LlamaDecoderLayer", "LlamaDecoderLayer_backward"]
        calls = [n.name for n in model.graph.node if n.domain == "refine.layer"]
        assert calls == ["model.layers.0", "model.layers.1", "model.layers.1 (backward)", "model.layers.0 (backward)"]
        backward = next(f for f in model.functions if f.name.endswith("_backward"))
        assert backward.input[0] == "grad" and "grad.hidden_states" in backward.output
        assert not [n for n in model.graph.node if n.domain == "refine.export"]  # no marker left
        weights = {i.name for i in model.graph.initializer}
        for call in (n for n in model.graph.node if n.domain == "refine.layer"):  # its 9 weights, not views
            assert sum(v in weights for v in call.input) == 9, call.name
        assert {o.name for o in model.graph.output if o.name.startswith(GRAD_PREFIX + "model.layers.")} <= {
            v for n in model.graph.node if n.domain == "refine.layer" for v in n.output}  # gradients straight out
    memo = verified("llama_tp2").memo
    # each template solved once; the whole solve leaves out layer 0's forward (layer 1's reads
    # it) and layer 1's backward (layer 0's backward reads it, the rest are gradient outputs)
    assert memo["layer_calls"] == 4 and memo["template_solves"] <= 3 and memo["elided_calls"] == 2, memo


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): a flat training step verifies by default "
                                        "in tests/test_transformers.py (qwen3's, exported flat)")
def test_a_flat_training_step_verifies_too(exported, verified):
    """--flat: the same step with every layer inline."""
    assert not onnx.load(str(exported("gpt2_tp2_flat") / "seq.onnx")).functions
    assert verified("gpt2_tp2_flat").verdict == "verified", render_text(verified("gpt2_tp2_flat"))


def test_gradient_outputs_name_the_sequential_parameters(exported):
    out = exported("llama_sp2__sp_norm_grad_unreduced")
    seq_outputs = [o.name for o in onnx.load(str(out / "seq.onnx")).graph.output]
    for r in range(2):
        rank_outputs = [o.name for o in onnx.load(str(out / f"rank{r}.onnx")).graph.output]
        assert sorted(rank_outputs) == sorted(seq_outputs)
    assert all(name == LOSS or name.startswith(GRAD_PREFIX) for name in seq_outputs)


@pytest.mark.parametrize("shape, dim, start, end", [
    ((2, 3, 8), -1, 0, 4), ((2, 3, 8), -1, 4, 2**62), ((2, 3, 8), 2, -3, 2**62), ((4, 5), 0, 1, 3),
    ((4, 5), 1, 0, 5), ((3, 6, 2), 1, 2, -1),
])
def test_slice_backward_as_pad_is_slice_backward(shape, dim, start, end):
    """The Pad the exporter writes for slice_backward is exactly the gradient of x[start:end] on dim."""
    from refine.exporters.capture.train import _slice_backward_as_pad

    x = torch.randn(shape)
    size = shape[dim]
    sliced = x.narrow(dim, *(lambda s: (s.start, s.stop - s.start))(range(size)[slice(start, end)]))
    grad = torch.randn(sliced.shape)
    want = torch.ops.aten.slice_backward(grad, list(shape), dim, start, end, 1)
    assert torch.equal(_slice_backward_as_pad(grad, list(shape), dim, start, end, 1), want)
