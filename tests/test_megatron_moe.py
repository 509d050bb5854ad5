"""Megatron-Core's MoE (config tiny-moe: GPTModel with `num_moe_experts=4`, top-2 routing, the
local spec's `MoELayer` with its own TopKRouter and SequentialMLP experts), exported by
`refine export --framework megatron-core --config tiny-moe [--sp] [--ep N]`.

- TP 2 (+ SP), no EP: Megatron's allgather token dispatcher (routing map, probs and tokens
  all-gathered over TP, each expert's FFN split over expert TP = TP, outputs reduce-scattered).
  Under SP the gathered tokens are the sequence's, so its static-size masked_select and
  SequentialMLP's chunk windows run on replicas, each expert's hidden units over TP: forward and
  training step VERIFY; the router's weight left out of finalize_model_grads' all-reduce (a twin)
  is REFUTED at the router.
- TP 2 with EP 2 (EP borrowing the TP ranks, expert TP 1): its alltoall dispatcher (counts
  all-gathered, tokens and probs exchanged by dist.AllToAllV with the count tensors as inputs,
  the combine the reverse exchange). It exports and passes `--check`; its verdict is UNPROVEN (no
  lemma reads its sender's masked_select order or sort_chunks_by_idxs' windows yet:
  docs/moe.md).

Megatron's code runs unmodified but for the CPU shims and static-shape forms of
exporters/frameworks/megatron_shims.py; `--check` compares the programs with torch's numbers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import refine.exporters  # noqa: E402
from harness import assert_export_refused  # noqa: E402
from refine.exporters.frameworks.megatron import export_megatron  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

EXPORTS = {
    "tp2_sp": dict(tp=2, sp=True),
    "ep2": dict(tp=2, ep=2),
    "tp2_sp_train": dict(tp=2, sp=True, train=True),
    "ep2_sp_train": dict(tp=2, ep=2, sp=True, train=True),
    "tp2_sp_router_grad": dict(tp=2, sp=True, train=True, bug="moe_router_grad_unreduced"),
    "shared_tp2_sp_train": dict(config="tiny-moe-shared", tp=2, sp=True, train=True),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """name -> its export directory (config tiny-moe), exported on first use."""
    root = tmp_path_factory.mktemp("megatron_moe")
    made = {}

    def get(name: str):
        if name not in made:
            kwargs = dict(EXPORTS[name])
            made[name] = export_megatron(kwargs.pop("config", "tiny-moe"), kwargs.pop("tp"), kwargs.pop("sp", False),
                                         root / name, **kwargs).out_dir
        return made[name]

    return get


def _rank_ops(out, rank: int = 0) -> list[str]:
    import onnx

    model = onnx.load(str(out / f"rank{rank}.onnx"), load_external_data=False)
    return [n.op_type for n in list(model.graph.node) + [n for f in model.functions for n in f.node]]


@pytest.mark.parametrize("name", ["tp2_sp", "ep2"])
def test_moe_forward_matches_torch(moe_dir, name: str) -> None:
    result = refine.exporters.check(moe_dir(name))
    assert result.ok, result


def test_allgather_dispatch_keeps_its_collectives(moe_dir) -> None:
    ops = _rank_ops(moe_dir("tp2_sp"))
    assert "AllToAllV" not in ops
    # per layer function (two): SP's QKV all-gather and projection reduce-scatter; the MoE's routing
    # map, probs and tokens all-gathered, its output reduce-scattered; in the main graph the
    # embeddings' reduce-scatter and the output layer's all-gather
    assert ops.count("ReduceScatter") == 1 + 2 * 2 and ops.count("AllGather") == 1 + 2 * 4


def test_allgather_dispatch_forward_verifies(moe_dir) -> None:
    """The gathered tokens are the sequence's: the routing, masked_select and chunk windows as
    replicas, each expert's hidden units a TP shard, their rows joined as a partial sum
    (rules/shape.lp partial_concat), scattered back and reduce-scattered."""
    report = verify_dir(moe_dir("tp2_sp"))
    assert report.verdict == "verified", render_text(report)


def test_alltoall_dispatch_is_a_ragged_exchange_with_count_inputs(moe_dir) -> None:
    import onnx

    out = moe_dir("ep2")
    model = onnx.load(str(out / "rank0.onnx"), load_external_data=False)
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    exchanges = [n for n in nodes if n.op_type == "AllToAllV"]
    assert len(exchanges) == 6  # per layer: tokens and probs dispatched, outputs combined
    assert all(len(n.input) == 3 for n in exchanges)  # x, send_counts, recv_counts
    assert sum(n.op_type == "AllGather" for n in nodes) == 2  # per layer: the per-expert counts


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2_sp_train", "ep2_sp_train"])
def test_moe_training_step_matches_torch(moe_dir, name: str) -> None:
    result = refine.exporters.check(moe_dir(name))
    assert result.ok, result


@pytest.mark.slow
def test_allgather_dispatch_training_step_verifies(moe_dir) -> None:
    """The loss and every gradient: the experts' weight gradients TP shards, the router's
    all-reduced by finalize_model_grads (its weight marked sequence_parallel)."""
    report = verify_dir(moe_dir("tp2_sp_train"))
    assert report.verdict == "verified", render_text(report)


@pytest.mark.slow
def test_shared_expert_training_step_verifies_and_matches_torch(moe_dir) -> None:
    """config tiny-moe-shared: Megatron's SharedExpertMLP beside the routed experts (its own TP
    MLP under SP, added to the combined output)."""
    out = moe_dir("shared_tp2_sp_train")
    assert refine.exporters.check(out).ok
    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)


@pytest.mark.slow
def test_router_gradient_left_unreduced_is_refuted_at_the_router(moe_dir) -> None:
    report = verify_dir(moe_dir("tp2_sp_router_grad"))
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert "decoder.layers.0.mlp.router.weight" in text and "partial sum" in text, text


@pytest.mark.slow
def test_alltoall_dispatch_is_unproven_not_refuted(moe_dir) -> None:
    """The alltoall dispatcher's programs are correct (--check): no lemma reads its sender's order
    yet, so the verdict is UNPROVEN, never REFUTED (docs/moe.md)."""
    report = verify_dir(moe_dir("ep2_sp_train"))
    assert report.verdict == "unproven", render_text(report)


@pytest.mark.parametrize("args, words", [
    (("--config", "tiny", "--ep", "2", "--tp", "2"), "for a Megatron MoE config (tiny-moe)"),
    (("--config", "tiny-moe", "--ep", "2", "--tp", "4"), "--ep 2 is exported with --tp 2"),
    (("--config", "tiny-moe", "--ep", "2", "--tp", "1"), "must divide --tp 1"),
    (("--config", "tiny-moe", "--ep", "4", "--tp", "4"), "at least 2 experts per rank"),
    (("--config", "tiny-moe", "--tp", "2", "--train"), "without sequence parallelism: pass --sp"),
    (("--config", "tiny", "--tp", "2", "--sp", "--train", "--bug", "moe_router_grad_unreduced"), "--config tiny-moe"),
    (("--config", "tiny-moe", "--ep", "2", "--pp", "2"), "drop --pp"),
])
def test_bad_moe_arguments_are_one_line(tmp_path, args, words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--framework", "megatron-core", *args)


def test_zoo_holds_megatrons_moe_entries_and_each_validates() -> None:
    """`refine zoo --framework megatron-core`: every plan forward and training step, each twin on its
    plan and step (a training-step twin only in the training step), the MoE's among them."""
    from refine.exporters.frameworks.megatron_zoo import select

    entries = {e.name: e for e in select()}
    assert entries["mc_moe_tp2sp"].expectation() == entries["mc_moe_tp2sp_train"].expectation() == {"verdict": "verified"}
    assert entries["mc_moe_tp2sp_train__moe_router_grad_unreduced"].expectation() == {"verdict": "refuted"}
    assert "mc_moe_tp2sp__moe_router_grad_unreduced" not in entries and "mc_gpt_tp2__sp_norm_grad_unreduced" not in entries
    assert entries["mc_gpt_tp2__bias_after_allreduce"].expectation() == {"verdict": "verified"}
    for entry in entries.values():
        entry.validate()
