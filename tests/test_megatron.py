"""Megatron-Core's own GPTModel through `refine export --framework megatron-core` (issue 14).

Skipped without the `megatron` extra (megatron-core, installed with --no-deps). Each export is
made once per session (small configs, 2 layers); the tests read them. The default run verifies GPT
style at TP 2 + SP, Llama style at TP 2 and at TP 4 + SP (a query group repeated over ranks), GPT
style's training step, and refutes a twin of each kind; the sweep (REFINE_TEST_SWEEP=1,
benchmarks/sweep.py) adds Llama TP 2 + SP, GPT TP 4, Llama TP 8, Llama's training step, and the
same twins at another place (SWEEP_ONLY).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("torch")

import refine.exporters  # noqa: E402
from harness import SWEEP, assert_verified_and_matches_torch  # noqa: E402
from refine.exporters.errors import ExportError  # noqa: E402
from refine.exporters.frameworks.megatron import export_megatron  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

MEGATRON_SITE = "/megatron/core/"

EXPORTS = {
    "tiny_tp2_sp": dict(config="tiny", tp=2, sp=True),
    "llama_tp2": dict(config="tiny-llama", tp=2, sp=False),
    "llama_tp2_sp": dict(config="tiny-llama", tp=2, sp=True),
    "tiny_tp4": dict(config="tiny", tp=4, sp=False),
    "llama_tp4_sp": dict(config="tiny-llama", tp=4, sp=True),  # 2 query groups < 4 ranks
    "llama_tp8": dict(config="tiny-llama", tp=8, sp=False),  # one query head per rank: no repeat
    "bias_before_allreduce": dict(config="tiny", tp=2, sp=False, bug="bias_before_allreduce"),
    "bias_before_allreduce_sp": dict(config="tiny", tp=2, sp=True, bug="bias_before_allreduce"),
    "bias_after_allreduce": dict(config="tiny", tp=2, sp=False, bug="bias_after_allreduce"),
    "missing_allreduce": dict(config="tiny-llama", tp=2, sp=False, bug="missing_allreduce"),
    "glu_stride_1": dict(config="tiny-llama", tp=2, sp=False, bug="glu_stride_1"),
    "qkv_stride_3": dict(config="tiny", tp=2, sp=False, bug="qkv_stride_3"),
    "train_tp2_sp": dict(config="tiny", tp=2, sp=True, train=True),
    "train_llama_tp2": dict(config="tiny-llama", tp=2, sp=False, train=True),
    "ce_gathered_logits": dict(config="tiny", tp=2, sp=False, train=True, bug="ce_gathered_logits"),
    "ce_unmasked_backward": dict(config="tiny", tp=2, sp=False, train=True, bug="ce_unmasked_backward"),
    "ce_label_smoothing": dict(config="tiny", tp=2, sp=False, train=True, bug="ce_label_smoothing"),
    "sp_scatter_as_slice": dict(config="tiny", tp=2, sp=True, train=True, bug="sp_scatter_as_slice"),
    "sp_norm_grad_unreduced": dict(config="tiny", tp=2, sp=True, train=True, bug="sp_norm_grad_unreduced"),
}


# the sweep's (REFINE_TEST_SWEEP=1, benchmarks/sweep.py): the same exporter paths at another size or plan
# (Llama TP 2 + SP: GPT style's SP and Llama's TP 2 run by default; GPT TP 4; Llama TP 8: TP 4 + SP's
# repeat of a query group runs by default), the same twins at another place (the SP bias twin, the
# fused QKV's stride twin: the SwiGLU stride twin runs by default; the injected cross-entropy backward:
# Megatron's own two class-5 paths run by default) and Llama's training step (GPT's runs by default)
SWEEP_ONLY = {"llama_tp2_sp", "tiny_tp4", "llama_tp8", "bias_before_allreduce_sp", "qkv_stride_3", "train_llama_tp2",
              "ce_unmasked_backward"}


def cases(*params):
    """The parametrize values, those of SWEEP_ONLY (the first value of a tuple) marked to run under harness.SWEEP only."""
    def name(p):
        return p[0] if isinstance(p, tuple) else p

    return [pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.skipif(
        not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): SWEEP_ONLY")) if name(p) in SWEEP_ONLY else p for p in params]


@pytest.fixture(scope="session")
def megatron_dir(tmp_path_factory):
    """name -> its export directory, exported on first use."""
    root = tmp_path_factory.mktemp("megatron")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = export_megatron(out=root / name, **EXPORTS[name]).out_dir
        return made[name]

    return get


@pytest.mark.parametrize("name", cases("tiny_tp2_sp", "llama_tp2", "llama_tp2_sp", "tiny_tp4", "llama_tp4_sp", "llama_tp8"))
def test_stock_megatron_verifies_and_matches_torch(megatron_dir, name: str) -> None:
    """Megatron's TP N ranks refine its TP 1 model (GPT style: LayerNorm, GeLU, biases, learned
    positions; Llama style: RMSNorm, SwiGLU, RoPE, 2 query groups, also at TP 4 and 8 where
    Megatron gathers the fused QKV and each rank repeats its one group for its own heads), and
    the programs compute what torch computes."""
    assert_verified_and_matches_torch(megatron_dir(name))


def test_relations_come_from_megatron_partition_attributes(megatron_dir) -> None:
    """refine.json: TP parameters sharded along their partition_dim (SwiGLU's fc1 with its
    partition_stride 2), everything else replicated, token ids declared in [0, vocab), logits
    vocab-parallel."""
    config = json.loads((megatron_dir("llama_tp2") / "refine.json").read_text())
    inputs = config["inputs"]
    assert inputs["input_ids"] == {"layout": "rep", "range": [0, 128]}
    assert inputs["decoder.layers.0.mlp.linear_fc1.weight"] == {"layout": "shard", "axis": 0, "stride": 2}
    assert inputs["decoder.layers.0.mlp.linear_fc2.weight"] == {"layout": "shard", "axis": 1}
    assert inputs["decoder.layers.0.self_attention.linear_qkv.weight"] == {"layout": "shard", "axis": 0}
    assert inputs["embedding.word_embeddings.weight"] == {"layout": "shard", "axis": 0}
    assert inputs["decoder.final_layernorm.weight"] == {"layout": "rep"}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 2}}


def test_the_megatron_version_is_the_installed_one(megatron_dir) -> None:
    """refine.json's description and the manifest name the Megatron-Core (and torch) installed,
    read off the packages' metadata, not a version written down in refine."""
    from importlib import metadata

    d = megatron_dir("llama_tp2")
    config = json.loads((d / "refine.json").read_text())
    manifest = json.loads((d / "export.json").read_text())
    assert f"Megatron-Core {metadata.version('megatron-core')} GPTModel" in config["description"]
    assert manifest["megatron-core"] == metadata.version("megatron-core")
    assert manifest["torch"] == metadata.version("torch")


def test_layers_are_memoized(megatron_dir) -> None:
    """The two TransformerLayers share one function per program; a bug in layer 0 splits them."""
    stock = json.loads((megatron_dir("tiny_tp2_sp") / "export.json").read_text())["layers"]
    buggy = json.loads((megatron_dir("bias_before_allreduce") / "export.json").read_text())["layers"]
    assert stock["stack"] == "decoder.layers"
    for program in (stock["seq"], *stock["ranks"]):
        assert list(program["functions"].values()) == [["decoder.layers.0", "decoder.layers.1"]]
    assert buggy["seq"] == stock["seq"]
    assert len(buggy["ranks"][0]["functions"]) == 2


@pytest.mark.parametrize("name,node,pattern", cases(
    ("bias_before_allreduce", "decoder.layers.0/", "replica_before_allreduce"),
    ("bias_before_allreduce_sp", "decoder.layers.0/", "replica_before_allreduce"),
    ("missing_allreduce", "decoder.layers.0/", "missing_allreduce"),
    ("glu_stride_1", "decoder.layers.0/mlp/", None),
    ("qkv_stride_3", "decoder.layers.0/self_attention/", None),
))
def test_megatron_bug_twins_are_refuted_in_layer_0_with_megatron_lines(megatron_dir, name: str, node: str,
                                                                       pattern: str | None) -> None:
    """Refuted at layer 0 (the residual add after the MLP; SwiGLU's gate activation; the fused
    QKV's split into heads), with a line of Megatron-Core; where a known pattern fits, the plain
    diagnosis names linear_fc2 and its Megatron line."""
    report = verify_dir(megatron_dir(name))
    text = render_text(report)
    assert report.verdict == "refuted", text
    first = report.failure
    assert first is not None and first.node.startswith(node), text
    assert first.location is not None and MEGATRON_SITE in first.location.file, text
    if pattern:
        assert report.diagnosis is not None and report.diagnosis.pattern == pattern, text
        assert (report.diagnosis.rank_node or "").startswith("decoder.layers.0/mlp.linear_fc2/"), text
        assert report.diagnosis.location is not None and MEGATRON_SITE in report.diagnosis.location.file, text


def test_the_correct_twin_of_the_injection_verifies(megatron_dir) -> None:
    report = verify_dir(megatron_dir("bias_after_allreduce"))
    assert report.verdict == "verified", render_text(report)


def test_a_plain_parameter_that_differs_across_ranks_is_an_export_error(tmp_path) -> None:
    """A parameter without partition attributes is declared a replica: values that differ on a
    rank are an export error naming it (here rank 1's final norm weight is moved)."""
    from refine.exporters.frameworks import megatron
    from refine.exporters.capture.export import export
    from refine.exporters.capture.tracing import quiet
    from refine.exporters.zoo.configs import validate_megatron
    from refine.exporters.frameworks.megatron_shims import cpu_shims

    cfg = validate_megatron("tiny", 2, False)
    stock = megatron.rank_factory(cfg, 2, False, 0)

    def factory(rank: int):
        module = stock(rank)
        if rank == 1:
            module.decoder.final_layernorm.weight.data += 1.0
        return module

    with quiet(), cpu_shims(), pytest.raises(ExportError, match=r"decoder.final_layernorm.weight: a plain tensor .* "
                                                                r"differ on rank\(s\) \[1\]"):
        export(lambda: megatron.build(cfg, 1, False, 0), factory, megatron.example_inputs(cfg, 0), 2, tmp_path / "d",
               seq_context=megatron.sequential_world, output_names=["logits"], workers=0)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("name", cases("train_tp2_sp", "train_llama_tp2"))
def test_training_step_verifies(megatron_dir, name: str) -> None:
    """One training step: Megatron's own vocab-parallel cross-entropy (forward and its custom
    backward), every gradient after its finalize_model_grads (under SP the norms' gradients
    all-reduced), as torch computes them; the loss a replica, each gradient as Megatron's
    partition attributes say."""
    out = megatron_dir(name)
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()
    config = json.loads((out / "refine.json").read_text())
    assert config["outputs"]["grad.decoder.layers.0.mlp.linear_fc1.weight"]["layout"] == "shard"
    assert config["outputs"]["grad.decoder.layers.0.input_layernorm.weight"] == {"layout": "rep"}
    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)


@pytest.mark.parametrize("name,output,line", cases(("ce_gathered_logits", "loss", None),
                                                   ("ce_label_smoothing", "loss", 181),
                                                   ("ce_unmasked_backward", "grad.", None)))
def test_cross_entropy_bug_twins_are_refuted_in_megatrons_cross_entropy(megatron_dir, name: str, output: str,
                                                                         line: int | None) -> None:
    """Class 5 through Megatron's loss. Two are Megatron's own code paths, unmodified: the
    logits gathered by GPTModel.forward(runtime_gather_output=True) before the vocab-parallel
    loss (loss + log TP), and its label smoothing, which averages the log-probabilities over the
    local vocabulary (line 181, `log_probs.mean(dim=-1)`; Megatron-LM issues 737 and 7464). The
    third is injected: a backward that subtracts 1 at the target on every rank. Each is refuted
    by a counterexample on an output, the first failure in Megatron's cross_entropy.py."""
    report = verify_dir(megatron_dir(name))
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert report.numeric is not None and report.numeric.output is not None, text
    assert report.numeric.output.seq_tensor.startswith(output), text
    assert report.failure is not None and report.failure.location is not None, text
    assert report.failure.location.file.endswith("megatron/core/tensor_parallel/cross_entropy.py"), text
    if line is not None:
        assert report.failure.location.line == line, text


def test_sequence_parallel_scatter_done_by_a_plain_slice_is_refuted_in_its_backward(megatron_dir) -> None:
    """The embeddings cut to the rank's sequence chunk by a plain slice instead of Megatron's
    scatter_to_sequence_parallel_region: the same forward (the loss verifies), but the backward
    pads the gradient with zeros where the scatter's backward all-gathers it, so the embedding
    gradients are wrong; the first failure is the embedding's backward."""
    report = verify_dir(megatron_dir("sp_scatter_as_slice"))
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert report.numeric is not None and report.numeric.output is not None, text
    assert report.numeric.output.seq_tensor.startswith("grad.embedding."), text
    assert report.failure is not None and report.failure.location is not None, text
    assert report.failure.location.file.endswith("embeddings/language_model_embedding.py"), text


def test_unreduced_sequence_parallel_norm_gradients_are_refuted(megatron_dir) -> None:
    """finalize_model_grads without the norms' all-reduce: every rank keeps a partial gradient of
    each norm weight, which the counterexample shows on a norm weight's gradient."""
    report = verify_dir(megatron_dir("sp_norm_grad_unreduced"))
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert report.numeric is not None and report.numeric.output is not None, text
    assert not report.numeric.output.matches
    assert report.numeric.output.seq_tensor.startswith("grad.decoder.") and "layernorm" in report.numeric.output.seq_tensor, text
