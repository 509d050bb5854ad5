"""torchtitan's Llama 3 through `refine export --framework torchtitan` (issue 41).

Skipped without the `torchtitan` extra. Each export is made once per session (config tiny: 2
layers, dim 64, 8 heads, 4 key/value heads, vocabulary 128, batch 2 x 8) and read by the tests:
TP 2 + SP, forward and one training step on the default backend (spmd_types), the forward on
full_dtensor; PP 2 with 2 micro-batches (forward and training step); PP 2 x TP 2 + SP's forward;
CP 2 (config tiny-cp: 256 tokens, forward) and CP 2 x TP 2's forward, the training steps of CP 2 and
CP 2 x TP 2 on full_dtensor (FSDP over cp); every one VERIFIED with
`--check` passing; the twins REFUTED at torchtitan's own line; the silent export (the spmd_types
backend outside the trainer's mesh region: no collective) warned of at export and in the report;
bad arguments one line, exit 2. Qwen3-MoE (torchtitan's token dispatcher: a stable argsort,
grouped GEMMs in bfloat16, the combine's scatter-add) at TP 2 + SP, VERIFIED with `--check`, and
its twin (the experts' partial output typed R) REFUTED.

Under harness.SWEEP (REFINE_TEST_SWEEP=1, benchmarks/sweep.py) also: full_dtensor's training step,
PP 2's loss normalisation twin, PP 2 x TP 2's training steps, CP 2's and CP 2 x TP 2's training
steps, Qwen3-MoE's training step and its plain TP 2, the other twins (under PP 2 x TP 2 and CP 2 x
TP 2, the rowwise bias's) with the rowwise bias's correct variant, and plain TP 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

import refine.exporters  # noqa: E402
from harness import SWEEP, assert_export_refused, invoke  # noqa: E402
from refine.exporters.frameworks.torchtitan import export_torchtitan  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

TORCHTITAN_SITE = "/torchtitan/models/"

EXPORTS = {
    "tp2sp": dict(tp=2, sp=True),
    "tp2sp_train": dict(tp=2, sp=True, train=True),
    "tp2sp_fd": dict(tp=2, sp=True, backend="full_dtensor"),
    "tp2sp_fd_train": dict(tp=2, sp=True, backend="full_dtensor", train=True),
    "sp_norm_invariant": dict(tp=2, sp=True, train=True, bug="sp_norm_invariant"),
    "rowwise_plain_bias": dict(tp=2, sp=True, bug="rowwise_plain_bias"),
    "pp2_mb2": dict(pp=2, micro_batches=2),
    "pp2_mb2_train": dict(pp=2, micro_batches=2, train=True),
    "pp_loss_micro_batch_tokens": dict(pp=2, micro_batches=2, train=True, bug="pp_loss_micro_batch_tokens"),
    "pp2_tp2_mb2": dict(pp=2, tp=2, micro_batches=2),
    "pp2_tp2_sp_mb2": dict(pp=2, tp=2, sp=True, micro_batches=2),
    "pp2_tp2_sp_mb2_train": dict(pp=2, tp=2, sp=True, micro_batches=2, train=True),
    "pp2_tp2_mb2_train": dict(pp=2, tp=2, micro_batches=2, train=True),
    "pp2_tp2_mb2_fd": dict(pp=2, tp=2, micro_batches=2, backend="full_dtensor"),
    "pp2_tp2_mb2_fd_train": dict(pp=2, tp=2, micro_batches=2, backend="full_dtensor", train=True),
    "pp2_tp2_loss_micro_batch_tokens": dict(pp=2, tp=2, micro_batches=2, train=True, bug="pp_loss_micro_batch_tokens"),
    "pp_peer_stage_leader": dict(pp=2, tp=2, micro_batches=2, bug="pp_peer_stage_leader"),
    "pp2_tp2_rowwise_plain_bias": dict(pp=2, tp=2, micro_batches=2, bug="rowwise_plain_bias"),
    "cp2": dict(config="tiny-cp", cp=2),
    "cp_positions_dropped": dict(config="tiny-cp", cp=2, bug="cp_positions_dropped"),
    "cp2_tp2": dict(config="tiny-cp", cp=2, tp=2),
    "cp2_tp2_positions_dropped": dict(config="tiny-cp", cp=2, tp=2, bug="cp_positions_dropped"),
    "cp2_tp2_train": dict(config="tiny-cp", cp=2, tp=2, train=True),
    "moe_tp2sp": dict(model="qwen3_moe", tp=2, sp=True),
    "moe_tp2sp_train": dict(model="qwen3_moe", tp=2, sp=True, train=True),
    "moe_experts_output_replicate": dict(model="qwen3_moe", tp=2, sp=True, bug="moe_experts_output_replicate"),
    "moe_router_grad_invariant": dict(model="qwen3_moe", tp=2, sp=True, train=True, bug="moe_router_grad_invariant"),
    "fsdp2_tp2": dict(tp=2, fsdp=2, backend="full_dtensor"),
    "fsdp2_tp2_train": dict(tp=2, fsdp=2, backend="full_dtensor", train=True),
    "fsdp2_tp2_sp_train": dict(tp=2, sp=True, fsdp=2, backend="full_dtensor", train=True),
    "fsdp_grad_divided": dict(tp=2, fsdp=2, backend="full_dtensor", train=True, bug="fsdp_grad_divided"),
    "fsdp2_tp2_spmd_train": dict(tp=2, fsdp=2, train=True),
    "cp2_fd_train": dict(config="tiny-cp", cp=2, backend="full_dtensor", train=True),
    "cp2_tp2_fd_train": dict(config="tiny-cp", cp=2, tp=2, backend="full_dtensor", train=True),
    # harness.SWEEP
    "tp2": dict(tp=2),
    "tp2_train": dict(tp=2, train=True),
    "rowwise_bias_invariant": dict(tp=2, sp=True, train=True, bug="rowwise_bias_invariant"),
    "rowwise_scaled_bias": dict(tp=2, sp=True, train=True, bug="rowwise_scaled_bias"),
    "cp2_train": dict(config="tiny-cp", cp=2, train=True),
    "moe_tp2": dict(model="qwen3_moe", tp=2),
    "moe_tp2_train": dict(model="qwen3_moe", tp=2, train=True),
    "cp2_fd": dict(config="tiny-cp", cp=2, backend="full_dtensor"),
    "cp2_tp2_fd": dict(config="tiny-cp", cp=2, tp=2, backend="full_dtensor"),
    "cp_fsdp_grad_divided": dict(config="tiny-cp", cp=2, backend="full_dtensor", train=True, bug="fsdp_grad_divided"),
    "fsdp2_tp2_spmd": dict(tp=2, fsdp=2),
    "fsdp2_tp2_sp_spmd_train": dict(tp=2, sp=True, fsdp=2, train=True),
    "fsdp_grad_divided_spmd": dict(tp=2, fsdp=2, train=True, bug="fsdp_grad_divided"),
}


@pytest.fixture(scope="module")
def titan_dir(tmp_path_factory):
    """name -> its export directory, exported on first use."""
    root = tmp_path_factory.mktemp("torchtitan")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            options = dict(EXPORTS[name])
            made[name] = export_torchtitan(str(options.pop("config", "tiny")), root / name, **options).out_dir
        return made[name]

    return get


@pytest.fixture(scope="module")
def verdict(titan_dir):
    """name -> the report of `refine verify` on its export, computed once."""
    reports: dict[str, object] = {}

    def get(name: str):
        if name not in reports:
            reports[name] = verify_dir(titan_dir(name))
        return reports[name]

    return get


def sweep_only(name: str, why: str):
    """`name` as a parameter that runs under harness.SWEEP only (REFINE_TEST_SWEEP=1, benchmarks/sweep.py)."""
    return pytest.param(name, marks=pytest.mark.skipif(not SWEEP, reason=f"sweep only (REFINE_TEST_SWEEP=1): {why}"))


# (the default run: TP 2 + SP's forward and training step on spmd_types, the forward on full_dtensor;
# full_dtensor's training step in the sweep: the same backward capture as spmd_types' step)
@pytest.mark.parametrize("name", ["tp2sp", "tp2sp_train", "tp2sp_fd", sweep_only(
    "tp2sp_fd_train", "full_dtensor's step, the backward of spmd_types' step on the forward of full_dtensor's")])
def test_tp_sp_verifies_and_checks(titan_dir, verdict, name):
    """TP 2 + SP, forward and training step, spmd_types and full_dtensor: VERIFIED, and torch
    agrees with the programs (`--check`)."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    assert not report.warnings
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


def test_pipeline_stages_verify_and_check(titan_dir, verdict):
    """PP 2, 2 micro-batches: torchtitan's own split (stage 0 the embedding and layer 0, stage 1 layer 1,
    the norm and the head), each stage's chunk run by torchtitan's forward, Send / Recv between them."""
    report = verdict("pp2_mb2")
    assert report.verdict == "verified", render_text(report)
    config = json.loads((titan_dir("pp2_mb2") / "refine.json").read_text())
    assert config["outputs"] == {"logits": {"layout": "rep"}}
    outcome = refine.exporters.check(titan_dir("pp2_mb2"))
    assert outcome.ok, outcome.render()


def test_pipeline_training_step_verifies_and_checks(titan_dir, verdict):
    """PP 2, 2 micro-batches, one training step in torchtitan's 1F1B order: each micro-batch's loss
    is torchtitan's CrossEntropyLoss over the step's valid-token count on the last stage, the
    gradients sent back stage to stage and summed over the micro-batches; the loss is on the last
    stage, each parameter's gradient on the stage that holds it."""
    report = verdict("pp2_mb2_train")
    assert report.verdict == "verified", render_text(report)
    config = json.loads((titan_dir("pp2_mb2_train") / "refine.json").read_text())
    assert config["outputs"]["loss"] == {"layout": "rep"}
    assert {"grad.tok_embeddings.weight", "grad.lm_head.weight"} <= set(config["outputs"])
    outcome = refine.exporters.check(titan_dir("pp2_mb2_train"))
    assert outcome.ok, outcome.render()


@pytest.mark.parametrize("name", ["pp2_tp2_sp_mb2", pytest.param("pp2_tp2_mb2", marks=pytest.mark.skipif(
    not SWEEP, reason="harness.SWEEP: the SP export covers the same path and more"))])
def test_pipeline_of_tensor_parallel_stages_verifies_and_checks(titan_dir, verdict, name):
    """PP 2 x TP 2 (+ SP) on torchtitan's (pp, tp) mesh, 2 micro-batches: each stage's chunk
    parallelized by torchtitan's TP plan on its own tp group, activations sent between the same TP
    position of the two stages (peers read off torchtitan's pp mesh; under SP each rank's run of
    the sequence). The layouts are read off spmd_types' per-axis types: split over `tp`, copied
    over `pp`; the logits, a vocab shard on each rank of the last stage, are rebuilt from those two
    ranks."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    config = json.loads((titan_dir(name) / "refine.json").read_text())
    assert config["mesh"] == {"shape": [2, 2], "dims": ["pp", "tp"]}
    assert config["inputs"]["layers.0.attention.wo.weight"] == {"layout": "shard", "axis": 1, "over": "tp"}
    assert config["inputs"]["layers.1.attention.wo.weight"] == {"layout": "shard", "axis": 1, "over": "tp"}
    assert config["inputs"]["tok_embeddings.weight"]["over"] == "tp"
    assert "logits = concat(r2..r3:logits, axis=2)" in render_text(report)
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


@pytest.mark.parametrize("name", ["pp2_tp2_mb2_fd", "pp2_tp2_mb2_fd_train"])
def test_pipeline_of_tensor_parallel_stages_on_full_dtensor_verifies_and_checks(titan_dir, verdict, name):
    """PP 2 x TP 2 on full_dtensor, forward and training step: the stage boundary as torch's PipelineStage
    crosses it (the local tensor sent, a DTensor rebuilt on the receiving stage's mesh with the residual
    stream's placements; the gradient back the same way)."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


@pytest.mark.parametrize("name", [
    sweep_only("pp2_tp2_sp_mb2_train", "the PP 2 x TP 2 forward and PP 2's training step run by default"),
    sweep_only("pp2_tp2_mb2_train", "the SP step covers the same path and more")])
def test_pipeline_of_tensor_parallel_stages_training_step(titan_dir, verdict, name):
    """PP 2 x TP 2 (+ SP), 2 micro-batches, one training step: VERIFIED (the last stage's
    vocab-parallel loss of each micro-batch, a vocab shard of a window of the batch; each gradient
    a TP shard on the stage that holds it, summed over the micro-batches, the embedding's lookup
    gradient among them; under SP the norms' gradients each rank's piece of the sum over its run of
    the sequence, left to FSDP as torchtitan leaves them), and torch agrees."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    assert not report.sanity_violations, report.sanity_violations
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


def test_pipeline_peer_by_stage_leader_is_refuted_as_calls_that_cannot_run(verdict):
    """Each rank sending to the neighbouring stage's first rank, not its own TP position there:
    the calls cannot run together (class 13), and the report names the unmatched sends."""
    report = verdict("pp_peer_stage_leader")
    assert report.verdict == "refuted", render_text(report)
    text = render_text(report)
    assert "cannot run together" in text and "the sends from rank 1 to rank 2" in text, text


@pytest.mark.skipif(not SWEEP, reason="harness.SWEEP: twins refuted by default without TP inside the stages")
@pytest.mark.parametrize("name,words", [("pp2_tp2_loss_micro_batch_tokens", "torchtitan_pipeline.py:"),
                                        ("pp2_tp2_rowwise_plain_bias", "layers.0.attention.wo.bias")])
def test_twins_inside_pipeline_of_tensor_parallel_stages_are_refuted(verdict, name, words):
    """The class-10 PP twin (each micro-batch's loss over its own token count) and a TP twin
    (rowwise_plain_bias in stage 0's TP ranks) under PP 2 x TP 2: refuted at their lines, as
    without TP inside the stages (or without PP)."""
    report = verdict(name)
    assert report.verdict == "refuted", render_text(report)
    assert words in render_text(report)


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): PP 2's correct training step verifies "
                                        "by default, the PP twin refuted by default is pp_peer_stage_leader")
def test_pipeline_loss_over_micro_batch_tokens_is_refuted_at_its_line(verdict):
    """Each micro-batch's loss over its own count of valid tokens: the step's loss and gradients
    are the sum of the micro-batches' means. Refuted at the count's line, named as the class-10
    mistake it is."""
    report = verdict("pp_loss_micro_batch_tokens")
    assert report.verdict == "refuted", render_text(report)
    text = render_text(report)
    assert "torchtitan_pipeline.py:" in text and "class 10" in text, text


def test_context_parallel_verifies_and_checks(titan_dir, verdict):
    """CP 2 through torchtitan's own path (FlexAttention, its K/V all-gathers typed by its sharding
    config): each rank holds its run of the tokens, of their positions and of the block mask's
    query rows, as the trainer's cp_shard cuts them; the logits are the ranks' runs."""
    report = verdict("cp2")
    assert report.verdict == "verified", render_text(report)
    config = json.loads((titan_dir("cp2") / "refine.json").read_text())
    inputs = config["inputs"]
    assert inputs["tokens"] == {"layout": "shard", "axis": 1, "range": [0, 128]}
    assert inputs["positions"] == {"layout": "shard", "axis": 1, "range": [0, 256]}
    assert inputs["attention_masks"] == {"layout": "shard", "axis": 2}
    assert inputs["layers.0.attention.qkv_linear.wqkv.weight"] == {"layout": "rep"}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 1}}
    outcome = refine.exporters.check(titan_dir("cp2"))
    assert outcome.ok, outcome.render()


def test_context_and_tensor_parallel_forward_verifies_and_checks(titan_dir, verdict):
    """CP 2 x TP 2 on torchtitan's (cp, tp) mesh: each rank's run of the sequence through its TP
    shards; the logits a two-dim shard (refine.json `then`): the sequence over cp, then the
    vocabulary over tp."""
    report = verdict("cp2_tp2")
    assert report.verdict == "verified", render_text(report)
    config = json.loads((titan_dir("cp2_tp2") / "refine.json").read_text())
    assert config["mesh"] == {"shape": [2, 2], "dims": ["cp", "tp"]}
    assert config["inputs"]["tokens"]["over"] == "cp"
    assert config["outputs"]["logits"] == {"layout": "shard", "axis": 1, "over": "cp", "then": {"axis": 2, "over": "tp"}}
    outcome = refine.exporters.check(titan_dir("cp2_tp2"))
    assert outcome.ok, outcome.render()


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): CP x TP's forward and TP + SP's "
                                        "training step verify by default")
def test_context_and_tensor_parallel_training_step_verifies(titan_dir, verdict):
    """CP 2 x TP 2's training step: torch agrees with the programs (each TP shard's gradient a
    partial sum over cp, export.json's two-dim `partial ... then`), and refine proves it: the K/V
    all-gathers over cp of each rank's heads and their gradients' reduce-scatters back
    (rules/windows.lp), each gradient the concatenation over tp of sums over cp
    (rules/report.lp slsum)."""
    outcome = refine.exporters.check(titan_dir("cp2_tp2_train"))
    assert outcome.ok, outcome.render()
    report = verdict("cp2_tp2_train")
    text = render_text(report)
    assert report.verdict == "verified", text
    assert "grad.tok_embeddings.weight = concat(sum(r0:grad.tok_embeddings.weight, r2:" in text, text


@pytest.mark.skipif(not SWEEP, reason="harness.SWEEP: the CP twin under CP x TP")
def test_cp_positions_dropped_under_cp_and_tp_is_refuted_at_torchtitan_rope(verdict):
    """The positions not handed over under CP 2 x TP 2: refuted at torchtitan's RoPE, the
    counterexample rebuilt as the two-dim shard declared."""
    report = verdict("cp2_tp2_positions_dropped")
    assert report.verdict == "refuted", render_text(report)
    assert "rope.py:" in render_text(report) and "blocks(" in render_text(report)


@pytest.mark.parametrize("name", ["cp2_tp2_fd_train", "cp2_fd_train",
                                  sweep_only("cp2_fd", "CP 2's forward on full_dtensor (the steps run its forward)"),
                                  sweep_only("cp2_tp2_fd", "CP 2 x TP 2's forward on full_dtensor")])
def test_context_parallel_on_full_dtensor_verifies_and_checks(titan_dir, verdict, name):
    """CP 2 (and CP 2 x TP 2) on full_dtensor: the tokens, positions and labels DTensors split over cp
    (`parallelize_inputs`), FSDP sharding every parameter over cp as `resolve_fsdp_mesh` has it (each
    one all-gathered for its use, its gradient reduce-scattered with sum), DTensor's K/V all-gather
    over cp along the batch-1 axis read back by a Reshape and its gradient's reduce-scatter of blocks
    stacked along it (rules/windows.lp `allgather_windows_unit_axis`, `reduce_scatter_windows_stacked`),
    the loss each rank's share summed over the loss mesh (the trainer's `dist_sum` of `to_local`)."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    config = json.loads((titan_dir(name) / "refine.json").read_text())
    if "tp2" in name:
        assert config["mesh"] == {"shape": [2, 2], "dims": ["cp", "tp"]}
        assert config["inputs"]["layers.0.attention.wo.weight"] == {  # (FSDP's rows of the TP rank's columns)
            "layout": "shard", "axis": 0, "over": "cp", "then": {"axis": 1, "over": "tp"}}
    else:
        assert config["inputs"]["layers.0.attention.wo.weight"] == {"layout": "shard", "axis": 0}
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


@pytest.mark.skipif(not SWEEP, reason="harness.SWEEP: FSDP's division twin under CP (its FSDP x TP form runs by default)")
def test_fsdp_division_under_context_parallelism_is_refuted(verdict):
    """FSDP's gradient division left on, where FSDP shards over cp: every gradient half the step's,
    the reduce-scatter named as the class-14 mistake."""
    report = verdict("cp_fsdp_grad_divided")
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert "class 14" in text, text


def test_cp_positions_dropped_is_refuted_at_torchtitan_rope(verdict):
    """The positions not handed to the model under CP: every rank rotates by positions 0 .. S/CP - 1."""
    report = verdict("cp_positions_dropped")
    assert report.verdict == "refuted", render_text(report)
    assert report.failure.location.file.endswith("torchtitan/models/common/rope.py"), report.failure


def test_dense_flex_attention_is_flex_attention():
    """Shim 8's FlexAttention in plain ops computes what torch's flex_attention computes (eager,
    its reference path): a causal block mask, grouped-query heads, the log-sum-exp too."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    from refine.exporters.frameworks.torchtitan_shims import _dense_flex_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 256, 16, generator=gen) for heads in (8, 4, 4))
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, None, 256, 256, device="cpu")
    want, want_aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    got, got_aux = _dense_flex_attention(q, k, v, score_mod=None, block_mask=mask, scale=None, enable_gqa=True,
                                         return_aux=AuxRequest(lse=True), kernel_options={})
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got_aux.lse, want_aux.lse, atol=1e-5)


def test_spmd_types_layouts_are_read_off_the_local_tensors(titan_dir):
    """No Megatron attribute, no DTensor: spmd_types' annotations say which weights are split."""
    config = json.loads((titan_dir("tp2sp") / "refine.json").read_text())
    inputs = config["inputs"]
    assert inputs["tok_embeddings.weight"] == {"layout": "shard", "axis": 0}  # vocab-parallel
    assert inputs["layers.0.attention.qkv_linear.wqkv.weight"] == {"layout": "shard", "axis": 0}  # colwise
    assert inputs["layers.0.attention.wo.weight"] == {"layout": "shard", "axis": 1}  # rowwise
    assert inputs["layers.0.attention_norm.weight"] == {"layout": "rep"}
    assert inputs["layers.0.attention.rope.cache"] == {"layout": "rep"}  # complex: real pairs
    assert inputs["tokens"] == {"layout": "rep", "range": [0, 128]}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 2}}
    manifest = json.loads((titan_dir("tp2sp") / "export.json").read_text())
    assert manifest["zoo"]["framework"] == "torchtitan" and manifest["zoo"]["backend"] == "spmd_types"


def test_sequence_parallel_norm_gradients_are_partial_sums(titan_dir, verdict):
    """Under spmd_types an SP norm weight is typed R, whose gradient is a partial sum left for the
    data-parallel wrapper to reduce: refine.json leaves it open, export.json lays it out partial,
    and the report rebuilds it as the ranks' sum (under full_dtensor a replica: the next test)."""
    config = json.loads((titan_dir("tp2sp_train") / "refine.json").read_text())
    manifest = json.loads((titan_dir("tp2sp_train") / "export.json").read_text())
    name = "grad.layers.0.attention_norm.weight"
    assert name not in config["outputs"] and manifest["outputs"][name] == {"layout": "partial", "op": "sum"}
    assert config["outputs"]["grad.layers.0.attention.wo.weight"] == {"layout": "shard", "axis": 1}
    rebuilt = {o.name: o.reconstruction for o in verdict("tp2sp_train").outputs}
    assert rebuilt[name].startswith(f"{name} = sum(")


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): full_dtensor's training step")
def test_sequence_parallel_norm_gradients_are_replicas_under_full_dtensor(verdict):
    """Under full_dtensor DTensor reduces an SP norm weight's gradient: a replica."""
    name = "grad.layers.0.attention_norm.weight"
    fd = {o.name: o.reconstruction for o in verdict("tp2sp_fd_train").outputs}
    assert "replicated" in fd[name] or f"{name} = r0:{name}" in fd[name], fd[name]


def test_sp_norm_invariant_is_refuted_at_torchtitan_norm(verdict):
    """The SP norm's weight typed I: its partial gradient is taken as complete (class 4)."""
    report = verdict("sp_norm_invariant")
    assert report.verdict == "refuted", render_text(report)
    assert report.failure.location.file.endswith("torchtitan/models/llama3/model.py"), report.failure
    assert report.diagnosis is not None and "class 4" in render_text(report)
    assert any(o.name == "grad.layers.0.attention_norm.weight" and not o.ok for o in report.outputs)


def test_rowwise_plain_bias_is_refuted_as_bias_before_the_reduction(verdict):
    """A plain Linear with a bias under rowwise_config: every rank adds it (class 3), named at
    torchtitan's attention code."""
    report = verdict("rowwise_plain_bias")
    assert report.verdict == "refuted", render_text(report)
    text = render_text(report)
    assert "layers.0.attention.wo.bias" in text and "class 3" in text and TORCHTITAN_SITE in text


@pytest.mark.parametrize("name", ["fsdp2_tp2_train", "fsdp2_tp2_spmd_train"])
def test_fsdp_and_tensor_parallel_training_step_verifies_and_checks(titan_dir, verdict, name):
    """FSDP 2 x TP 2 on full_dtensor and on spmd_types: each weight a two-dim shard (its TP shard cut again
    over dp_shard, as fully_shard cuts it; on spmd_types read off the partition spec the shim records),
    all-gathered for use, its gradient reduce-scattered (on spmd_types the pending sums of an SP norm's
    gradient all-reduced first): VERIFIED, torch agrees, the same layouts on both backends."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    config = json.loads((titan_dir(name) / "refine.json").read_text())
    assert config["mesh"] == {"shape": [2, 2], "dims": ["dp_shard", "tp"]}
    inputs = config["inputs"]
    assert inputs["layers.0.feed_forward.w1.weight"] == {"layout": "shard", "axis": 0, "over": "tp",
                                                         "then": {"axis": 0, "over": "dp_shard"}}
    assert inputs["layers.0.feed_forward.w2.weight"] == {"layout": "shard", "axis": 1, "over": "tp",
                                                         "then": {"axis": 0, "over": "dp_shard"}}
    assert inputs["layers.0.ffn_norm.weight"] == {"layout": "shard", "axis": 0, "over": "dp_shard"}
    assert inputs["tokens"]["over"] == "dp_shard" and inputs["labels"]["over"] == "dp_shard"
    assert config["outputs"]["grad.layers.0.feed_forward.w2.weight"] == inputs["layers.0.feed_forward.w2.weight"]
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


@pytest.mark.parametrize("name", ["fsdp2_tp2", sweep_only("fsdp2_tp2_sp_train", "FSDP x TP's step verifies by default"),
                                  sweep_only("fsdp2_tp2_spmd", "spmd_types' FSDP forward (its step runs it)"),
                                  sweep_only("fsdp2_tp2_sp_spmd_train", "spmd_types' FSDP step with SP")])
def test_fsdp_and_tensor_parallel_forward_and_sp_step_verify_and_check(titan_dir, verdict, name):
    """The forward on the unsharded parameters (FSDP's pre-forward all-gather), its logits each rank's batch
    rows then its vocab shard; and the training step with SP."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): FSDP x TP's correct step verifies by default")
@pytest.mark.parametrize("name", ["fsdp_grad_divided", "fsdp_grad_divided_spmd"])
def test_fsdp_gradient_division_left_on_is_refuted(verdict, name):
    """FSDP's own division left on (class 14): every gradient half the step's, refuted on the numbers
    and named at the reduce-scatter that averages (the shim's line: the twin's own)."""
    report = verdict(name)
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert "class 14" in text and "averages over" in text and "torchtitan_fsdp.py:" in text, text


# (the default run: the forward, whose dispatch the twin below breaks; the training step in the sweep)
@pytest.mark.parametrize("name", ["moe_tp2sp", sweep_only("moe_tp2sp_train", "the forward's dispatch verifies by default")])
def test_moe_token_dispatch_verifies_and_checks(titan_dir, verdict, name):
    """Qwen3-MoE as torchtitan writes it (argsort by expert, the rows gathered, grouped GEMMs over
    the per-expert counts, the scores and scatter-add back to the tokens), each expert's hidden
    units over TP under SP: VERIFIED, and torch agrees with the programs at bfloat16's tolerance."""
    report = verdict(name)
    assert report.verdict == "verified", render_text(report)
    outcome = refine.exporters.check(titan_dir(name))
    assert outcome.ok, outcome.render()


def test_moe_experts_output_replicate_is_refuted_as_a_missing_all_reduce(verdict):
    """The routed experts' output typed R: each rank's partial sum over its slice of the experts
    is taken as whole (class 1), named at torchtitan's grouped experts."""
    report = verdict("moe_experts_output_replicate")
    assert report.verdict == "refuted", render_text(report)
    text = render_text(report)
    assert "class 1" in text and "routed_experts" in text and TORCHTITAN_SITE in text


@pytest.mark.skipif(not SWEEP, reason="harness.SWEEP: an MoE training step (the experts' twin runs by default)")
def test_moe_router_gradient_left_partial_is_refuted_at_the_router(verdict):
    """The router gate's weight typed I on TP (its gradient a partial sum, the experts split over TP):
    refuted as the class-4 mistake at torchtitan's router."""
    report = verdict("moe_router_grad_invariant")
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert "class 4" in text and "router.gate" in text and "moe.py:" in text, text


@pytest.mark.skipif(not SWEEP, reason="harness.SWEEP: the other twins, plain TP 2 and CP 2's training step")
@pytest.mark.parametrize("name,expected", [("tp2", "verified"), ("tp2_train", "verified"),
                                           ("rowwise_bias_invariant", "refuted"), ("rowwise_scaled_bias", "verified"),
                                           ("cp2_train", "verified"), ("moe_tp2", "verified"),
                                           ("moe_tp2_train", "verified")])
def test_sweep(titan_dir, verdict, name, expected):
    report = verdict(name)
    assert report.verdict == expected, render_text(report)
    if expected == "verified":
        outcome = refine.exporters.check(titan_dir(name))
        assert outcome.ok, outcome.render()
    else:
        assert report.failure.location.file.endswith("torchtitan/models/common/linear.py"), report.failure


def test_one_rank_loss_is_torchtitans_cross_entropy():
    """The sequential program's loss (torchtitan's _LossParallelCrossEntropy over one rank) is the
    F.cross_entropy torchtitan's one-rank run takes: the same loss and the same gradients."""
    import torch
    from torchtitan.components.loss import CrossEntropyLoss

    from refine.exporters.capture.tracing import quiet
    from refine.exporters.frameworks import torchtitan as tt
    from refine.exporters.frameworks.torchtitan_shims import cpu_shims
    from refine.exporters.zoo.configs import TORCHTITAN_CONFIGS

    cfg = TORCHTITAN_CONFIGS["tiny"]
    tokens, labels = tt.example_inputs(cfg, 3, labels=True)
    with quiet(), cpu_shims(), tt.sequential_world():
        model = tt.build(cfg, train=True, seed=3)
        ours = model(tokens, labels=labels)
        mine = torch.autograd.grad(ours, list(model.parameters()))
        plain = tt.build(cfg, train=False, seed=3)
        logits = plain(tokens)
        theirs, _ = CrossEntropyLoss.Config(global_vocab_size=cfg.vocab_size).build()(logits, labels, labels.numel())
        their_grads = torch.autograd.grad(theirs, list(plain.parameters()))
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    for a, b in zip(mine, their_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_silent_export_is_warned_of(tmp_path, monkeypatch, capsys):
    """Without the trainer's SPMD mesh region the spmd_types ranks run no collective at all: the
    export warns, and so does the report (whatever the verdict)."""
    from refine.exporters.frameworks import torchtitan_shims

    monkeypatch.setattr(torchtitan_shims, "spmd_region", lambda model, dims, methods=(): None)
    result = export_torchtitan("tiny", tmp_path / "silent", tp=2, sp=True)
    assert result.warnings() and "set_current_spmd_mesh" in result.warnings()[0]
    report = verify_dir(tmp_path / "silent")
    assert report.verdict != "verified"
    assert report.warnings and "no rank's program has a collective" in report.warnings[0]
    assert "warning: " in render_text(report)


@pytest.mark.parametrize("args,words", [
    (("--config", "nosuch"), "unknown torchtitan config 'nosuch'"),
    (("--tp", "3"), "not divisible by 3"),
    (("--tp", "2", "--cp", "2", "--pp", "2"), "context parallelism alone or with --tp is supported yet"),
    (("--dp", "2", "--fsdp", "--cp", "2", "--backend", "full_dtensor"), "no --cp or --pp with it"),
    (("--cp", "2"), "must be a multiple of 256, not 8"),
    (("--tp", "2", "--bug", "cp_positions_dropped"), "pass --cp 2"),
    (("--pp", "2", "--micro-batches", "2", "--bug", "rowwise_plain_bias"), "drop --pp, or pass --tp 2"),
    (("--pp", "2", "--micro-batches", "2", "--bug", "pp_peer_stage_leader"), "needs TP ranks inside the stages"),
    (("--tp", "2", "--dp", "2", "--fsdp", "--pp", "2"), "no --cp or --pp with it"),
    (("--tp", "2", "--dp", "2"), "replicated data parallelism (torchtitan's dp_replicate) is not supported yet"),
    (("--tp", "2", "--fsdp"), "pass the FSDP degree as --dp N"),
    (("--tp", "2", "--dp", "2", "--fsdp", "--backend", "full_dtensor", "--train", "--bug", "sp_norm_invariant"),
     "not an FSDP one"),
    (("--tp", "2", "--train", "--bug", "fsdp_grad_divided"), "an FSDP one"),
    ((), "needs at least 2 ranks"),
    (("--tp", "2", "--bug", "nosuch"), "unknown torchtitan bug 'nosuch'"),
    (("--tp", "2", "--bug", "sp_norm_invariant", "--train"), "pass --sp"),
    (("--tp", "2", "--backend", "partial_dtensor"), "partial_dtensor is not supported yet"),
    (("--tp", "2", "--backend", "nosuch"), "unknown torchtitan backend 'nosuch'"),
    (("--tp", "2", "--model", "gpt2"), "--model 'gpt2' is neither"),
    (("--tp", "2", "--pp", "2", "--model", "qwen3_moe"), "only TP (with or without --sp)"),
    (("--tp", "2", "--bug", "moe_experts_output_replicate"), "pass --model qwen3_moe"),
    (("--tp", "2", "--meta"), "drop --meta"),
])
def test_bad_arguments_are_one_line(tmp_path, args, words):
    assert_export_refused(tmp_path / "out", words, "--framework", "torchtitan", *args)


def test_config_file(tmp_path):
    """--config FILE: the sizes of a JSON object (the rest tiny's); a bad one is one line."""
    from refine.exporters.errors import ExportError
    from refine.exporters.zoo.configs import validate_torchtitan

    good = tmp_path / "llama.json"
    good.write_text(json.dumps({"dim": 32, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 64}))
    cfg = validate_torchtitan(str(good), tp=2, sp=True)
    assert (cfg.dim, cfg.n_heads, cfg.n_layers) == (32, 4, 2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dim": 32, "heads": 4}))
    with pytest.raises(ExportError, match="not \\['heads'\\]"):
        validate_torchtitan(str(bad), tp=2)


def test_backend_needs_torchtitan(tmp_path):
    result = invoke("export", "--tp", "2", "--model", "llama", "--backend", "spmd_types", "--out", tmp_path / "x")
    assert result.exit_code == 2 and "--framework torchtitan" in result.output


def test_zoo_entries_each_validate():
    """`refine zoo --framework torchtitan`'s entries: each plan on the backends it supports, each twin
    only where it applies (a pipeline twin needs micro-batches, a PP x TP one TP inside the stages, FSDP's
    division one FSDP, over cp too on full_dtensor), CP x TP's training step among them, and every
    entry passes the export's own argument checks."""
    from refine.exporters.frameworks.torchtitan_zoo import select

    entries = select()
    names = {e.name for e in entries}
    assert {"tt_llama3_pp2tp2__pp_peer_stage_leader", "tt_llama3_pp2tp2_train__pp_loss_micro_batch_tokens",
            "tt_llama3_cp2tp2", "tt_llama3_cp2tp2__cp_positions_dropped"} <= names
    assert "tt_llama3_cp2tp2_train" in names and "tt_llama3_pp2__pp_peer_stage_leader" not in names
    assert {"tt_llama3_cp2tp2_full_dtensor_train", "tt_llama3_cp2_full_dtensor_train__fsdp_grad_divided"} <= names
    assert "tt_llama3_cp2_full_dtensor__cp_positions_dropped" not in names  # (a spmd_types twin: see torchtitan_bugs)
    by_name = {e.name: e for e in entries}  # (expert parallelism: a batch of sequences and one sequence)
    for name in ("tt_qwen3_moe_tp2sp_ep2", "tt_qwen3_moe_tp2sp_ep2_train", "tt_qwen3_moe_tp2sp_ep2_seq",
                 "tt_qwen3_moe_tp2sp_ep2_seq_train"):
        assert by_name[name].expectation() == {"verdict": "verified"}
    assert by_name["tt_qwen3_moe_tp2sp"].expectation() == {"verdict": "verified"}
    for entry in entries:
        entry.validate()
