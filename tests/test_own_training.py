"""Your own training step (refine.exporters.export_train, exporters/README.md): the guide's example
runs verbatim, DDP's and FSDP's own semantics are never refuted on a correct loss (and are
proven once the lemma library expresses a mean as a sum over a count), `refine export --module`
exports a module of one's own, `refine.testing.assert_refines` is used as a user would, and a
hand-written model that reads an undefined tensor is one line of bad input.
"""

from __future__ import annotations

import re
import runpy
import shutil
from pathlib import Path

import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import own_models as om  # noqa: E402
from harness import invoke  # noqa: E402

import refine.exporters  # noqa: E402
from refine.exporters.errors import ExportError  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402
from refine.testing import assert_refines  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "exporters" / "README.md"
EXAMPLE = REPO / "examples" / "own_training.py"


def guide_example() -> str:
    """The python block of the guide's section on your own training step."""
    section = GUIDE.read_text().split("## Your own training step", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S)[1]


@pytest.fixture(scope="module")
def guide_run(tmp_path_factory):
    """The guide's example run verbatim, as `python examples/own_training.py` runs it: step -> verdict."""
    here = tmp_path_factory.mktemp("guide")
    script = here / "own_training.py"
    script.write_text(guide_example())
    old = Path.cwd()
    printed: list[str] = []
    try:
        import builtins

        real_print = builtins.print
        builtins.print = lambda *a, **k: printed.append(" ".join(map(str, a)))  # type: ignore[assignment]
        import os

        os.chdir(here)
        runpy.run_path(str(script), run_name="__main__")
    finally:
        builtins.print = real_print  # type: ignore[assignment]
        os.chdir(old)
    return dict(line.split() for line in printed), here


def test_the_guide_example_is_the_example_file():
    assert guide_example() == EXAMPLE.read_text()


def test_the_guide_example_runs_and_its_tp_step_verifies(guide_run):
    verdicts, _ = guide_run
    assert set(verdicts) == {"tp", "ddp", "fsdp", "ddp_accumulate"}
    assert verdicts["tp"] == "verified"


@pytest.mark.parametrize("step", ["ddp", "fsdp", "ddp_accumulate"])
def test_ddp_and_fsdp_semantics_of_a_mean_loss_verify(guide_run, step):
    """DDP (local mean, avg all-reduce), FSDP (reduce-scatter avg) and accumulation (1/M) of a mean
    loss compute the sequential step: each rank's gradients carry its factor K (1/(n/K) against
    1/n) through the backward's linear ops to the avg that cancels it (rules/scales.lp)."""
    verdicts, here = guide_run
    report = verify_dir(here / "out" / f"own_{step}")
    assert report.verdict == verdicts[step] == "verified", render_text(report)
    assert report.diagnosis is None, report.diagnosis


def test_ddp_collectives_are_at_the_call_site_under_the_parameter_module(guide_run):
    """DDP's gradient all-reduce is located at the user's export_train call (the guide's script),
    named after the parameter's module; the loss's ops after `loss`."""
    _, here = guide_run
    model = onnx.load(str(here / "out" / "own_ddp" / "rank0.onnx"))
    reduces = [n for n in model.graph.node if n.op_type == "AllReduce"]
    assert {n.name for n in reduces} >= {"up (backward)/AllReduce", "down (backward)/AllReduce", "AllReduce"}
    line = next(i for i, text in enumerate(guide_example().splitlines(), 1) if "export_train(" in text)
    for node in reduces:
        trace = {p.key: p.value for p in node.metadata_props}["pkg.torch.onnx.stack_trace"]
        assert trace.startswith(f'  File "{here / "own_training.py"}", line {line},'), trace
    assert any(n.name.startswith("loss/") for n in model.graph.node)


def test_the_module_cli_exports_and_checks_a_module_of_ones_own(tmp_path):
    out = tmp_path / "own_tp"
    done = invoke("export", "--module", f"{EXAMPLE}:example", "--tp", "2", "--train", "--out", out, "--check")
    assert done.exit_code == 0, done.output
    assert "check: PASSED" in done.stdout
    assert verify_dir(out).verdict == "verified"


def test_the_module_cli_exports_the_forward_of_a_factory_made_for_training(tmp_path):
    """The guide's factory (a loss and labels beside the model's input) without --train: the
    forward takes the entries it names, the labels are the loss's."""
    out = tmp_path / "own_forward"
    done = invoke("export", "--module", f"{EXAMPLE}:example", "--tp", "2", "--out", out)
    assert done.exit_code == 0, done.output
    assert [i.name for i in onnx.load(out / "seq.onnx").graph.input if not i.name.startswith(("up.", "down."))] == ["x"]
    assert verify_dir(out).verdict == "verified"


@pytest.mark.parametrize("args, words", [
    (["--module", "nowhere.py:example", "--tp", "2"], "is not a Python file"),
    (["--module", f"{EXAMPLE}", "--tp", "2"], "expected path/to/file.py:factory"),
    (["--module", f"{EXAMPLE}:nothing", "--tp", "2"], "has no function 'nothing'"),
    (["--module", f"{EXAMPLE}:example", "--tp", "2", "--model", "llama"], "drop --model"),
    (["--module", f"{EXAMPLE}:example", "--tp", "2", "--dp", "2"], "--tp with --dp"),  # (a mesh: training steps)
    (["--module", f"{EXAMPLE}:example", "--tp", "2", "--dp", "2", "--fsdp", "--train"], "no --fsdp"),
])
def test_module_cli_bad_input_is_one_line(tmp_path, args, words):
    done = invoke("export", *args, "--out", tmp_path / "x")
    assert done.exit_code == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refine: error: ") and words in lines[0], done.stderr


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=0), "world_size"),
    (dict(world_size=2, data_parallel="zero"), "data_parallel"),
    (dict(world_size=2), "neither parallelize nor data_parallel"),
    (dict(world_size=3, data_parallel="ddp"), "cannot be cut evenly into 3"),
    (dict(world_size=2, data_parallel="ddp", micro_batches=0), "micro_batches"),
    (dict(world_size=2, data_parallel="ddp", ranges={"y": 4}), "ranges: ['y']"),
])
def test_export_train_bad_options_are_one_export_error(tmp_path, kwargs, words):
    spec = om.Classifier(), om.token_ce, {"x": torch.randn(8, 16), "labels": torch.randint(0, 4, (8,))}
    world = kwargs.pop("world_size")
    with pytest.raises(ExportError, match=re.escape(words)):
        refine.exporters.export_train(*spec, world, tmp_path / "x", **kwargs)


# --- refine.testing.assert_refines, as a user's test suite calls it ------------------------------------


def test_my_tensor_parallel_mlp_refines():
    """A user's test: their MLP under their TP plan, forward and training step."""
    torch.manual_seed(0)
    assert_refines(om.MLP(), om.tp_plan, (torch.randn(4, 16),), world_size=2)
    batch = {"x": torch.randn(4, 16), "target": torch.randn(4, 16)}
    assert_refines(om.MLP(), om.tp_plan, batch, world_size=2, train=True, loss_fn=om.mse)


def test_torch_fused_attention_refines_forward_and_training_step():
    """`F.scaled_dot_product_attention` (causal) in a user's attention, heads split by their plan:
    captured by its math backend (exporters/capture/tracing.py math_attention), whose backward
    torch.onnx translates, where the CPU's fused kernel's backward op has no translation."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    assert_refines(om.Attention(sdpa=True), om.attn_plan(None), (x,), world_size=2)
    batch = {"x": x, "target": torch.randn(2, 6, 16)}
    assert_refines(om.Attention(sdpa=True), om.attn_plan(None), batch, world_size=2, train=True, loss_fn=om.mse)


def test_per_head_constants_cut_by_rank_refine_and_the_first_heads_on_every_rank_do_not():
    """ALiBi's slopes, a constant per head, each rank cutting its own heads' (rules/core.lp: a rank
    constant that is a chunk of the sequential one, by value); the twin where every rank takes the
    first heads' slopes is refuted at the bias's add, with a counterexample."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    assert_refines(om.Attention(alibi=True), om.attn_plan(None), (x,), world_size=2)
    with pytest.raises(pytest.fail.Exception, match="REFUTED") as failed:
        assert_refines(om.Attention(alibi=True), om.attn_plan("alibi_first"), (x,), world_size=2)
    assert "first failure: node Add" in str(failed.value), failed.value


def test_a_conv_net_under_ddp_and_fsdp_refines_forward_and_training_step():
    """Convolutions, batch norm, a max-pool and a grouped strided convolution, each rank on its own
    images (rules/samples.lp: per-sample ops; a max-pool's backward at its indices within each
    plane; the weight gradient's grouped convolution over the batch, a run of groups a rank)."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 3, 8, 8), "labels": torch.randint(0, 6, (4,))}
    assert_refines(om.ConvNet(), None, (batch["x"],), world_size=2, data_parallel="ddp")
    for how in ("ddp", "fsdp"):
        assert_refines(om.ConvNet(), None, batch, world_size=2, train=True, loss_fn=om.token_ce, data_parallel=how,
                       ranges={"labels": 6})


def test_a_loss_on_a_shard_of_the_classes_is_refuted_as_a_rank_that_cannot_run():
    """The cross-entropy of each rank's shard of the classes with the global labels: a label past
    the shard indexes out of range on the rank (the sequential step runs), so a real job fails."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(8, 16), "labels": torch.tensor([0, 3, 1, 2, 3, 0, 2, 1])}
    with pytest.raises(pytest.fail.Exception, match="REFUTED") as failed:
        assert_refines(om.Classifier(), om.sharded_logits_plan, batch, world_size=2, train=True,
                       loss_fn=om.token_ce, ranges={"labels": 4})
    assert "cannot run on inputs satisfying the declared relations" in str(failed.value), failed.value


def test_activation_checkpointing_refines():
    """torch.utils.checkpoint around each block: the backward recomputes the forward, reading the
    model's constant twice (one program input), and the step refines."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 16), "target": torch.randn(4, 16)}
    assert_refines(om.CheckpointedMLPs(), om.checkpointed_plan, batch, world_size=2, train=True, loss_fn=om.mse)


def test_a_mean_over_the_tokens_a_padding_mask_keeps_refines():
    """The pooled mean's backward (each sequence's gradient copied to its tokens, times the mask)
    before a row-parallel projection, whose DTensor output the ranks view as itself once more:
    both sides meet in one normal form (refine/lowering/normal_forms.py merge_rows_early)."""
    torch.manual_seed(0)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    batch = {"x": torch.randn(2, 6, 16), "attention_mask": mask, "labels": torch.tensor([0, 2])}
    assert_refines(om.MaskedPool(), om.masked_pool_plan, batch, world_size=2, train=True, loss_fn=om.token_ce,
                   ranges={"attention_mask": 2, "labels": 3})


def test_a_frozen_parameter_has_a_zero_gradient_and_the_step_refines():
    """A parameter made with requires_grad=False (AFMoE's expert bias, a frozen layer) gets no
    gradient from torch; the step's output for it is zeros on both sides, a replica."""
    torch.manual_seed(0)
    model = om.MLP()
    model.up.weight.requires_grad_(False)
    batch = {"x": torch.randn(4, 16), "target": torch.randn(4, 16)}
    report = assert_refines(model, om.tp_plan, batch, world_size=2, train=True, loss_fn=om.mse)
    frozen = next(o for o in report.outputs if o.name == "grad.up.weight")
    assert frozen.ok and "concat" in (frozen.reconstruction or ""), render_text(report)


def test_assert_refines_fails_the_test_with_the_diagnosis():
    torch.manual_seed(0)
    with pytest.raises(pytest.fail.Exception) as failed:
        assert_refines(om.MLP(), om.row_plan("bias_first"), (torch.randn(4, 16),), world_size=2)
    message = str(failed.value)
    assert message.splitlines()[1].startswith("MLP: REFUTED"), message
    assert "what is wrong: `down.bias` is added on every rank before the all-reduce" in message
    assert "[docs/bugs.md class 3]" in message and "own_models.py:" in message
    assert "first failure:" in message and len(message.splitlines()) <= 10


# --- bad input: a hand-written model reading an undefined tensor ----------------------------------------


def test_a_node_reading_an_undefined_tensor_is_bad_input(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(REPO / "examples" / "mlp_tp2", d)
    model = onnx.load(str(d / "rank1.onnx"))
    node = model.graph.node[1]
    node.input[0] = "nowhere"
    (d / "rank1.onnx").write_bytes(model.SerializeToString())
    done = invoke("verify", d)
    assert done.exit_code == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0] == (f"refine: error: {d / 'rank1.onnx'}: node {node.name!r} reads 'nowhere', which nothing "
                        "defines (no node's output, graph input or initializer has that name)"), lines[0]
    assert "topolog" not in lines[0]
