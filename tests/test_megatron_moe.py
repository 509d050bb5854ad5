"""Megatron-Core's MoE (config tiny-moe: GPTModel with `num_moe_experts=4`, top-2 routing, the
local spec's `MoELayer` with its own TopKRouter and SequentialMLP experts), exported by
`refine export --framework megatron-core --config tiny-moe [--ep N]`.

- TP 2, no EP: Megatron's allgather token dispatcher (routing map, probs and tokens all-gathered
  over TP, each expert's FFN split over expert TP = TP, outputs reduce-scattered);
- TP 2 with EP 2 (EP borrowing the TP ranks, expert TP 1): its alltoall dispatcher (counts
  all-gathered, tokens and probs exchanged by dist.AllToAllV with the count tensors as inputs,
  the combine the reverse exchange).

Megatron's code runs unmodified but for the CPU shims and static-shape forms of
exporters/frameworks/megatron_shims.py; `--check` compares the programs with torch's numbers.
The verdict is UNPROVEN today (no lemma reads the routes' static-size selection or the chunks).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import refine.exporters  # noqa: E402
from harness import assert_export_refused  # noqa: E402
from refine.exporters.frameworks.megatron import export_megatron  # noqa: E402

EXPORTS = {
    "tp2": dict(tp=2),
    "ep2": dict(tp=2, ep=2),
    "tp2_sp_train": dict(tp=2, sp=True, train=True),
    "ep2_sp_train": dict(tp=2, ep=2, sp=True, train=True),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """name -> its export directory (config tiny-moe), exported on first use."""
    root = tmp_path_factory.mktemp("megatron_moe")
    made = {}

    def get(name: str):
        if name not in made:
            kwargs = dict(EXPORTS[name])
            made[name] = export_megatron("tiny-moe", kwargs.pop("tp"), kwargs.pop("sp", False), root / name,
                                         **kwargs).out_dir
        return made[name]

    return get


def _rank_ops(out, rank: int = 0) -> list[str]:
    import onnx

    model = onnx.load(str(out / f"rank{rank}.onnx"), load_external_data=False)
    return [n.op_type for n in list(model.graph.node) + [n for f in model.functions for n in f.node]]


@pytest.mark.parametrize("name", ["tp2", "ep2"])
def test_moe_forward_matches_torch(moe_dir, name: str) -> None:
    result = refine.exporters.check(moe_dir(name))
    assert result.ok, result


def test_allgather_dispatch_keeps_its_collectives(moe_dir) -> None:
    ops = _rank_ops(moe_dir("tp2"))
    assert "AllToAllV" not in ops and ops.count("ReduceScatter") == 2  # per layer (each layer its own function)
    assert ops.count("AllGather") == 6  # per layer: routing map, probs, tokens


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


@pytest.mark.parametrize("args, words", [
    (("--config", "tiny", "--ep", "2", "--tp", "2"), "for a Megatron MoE config (tiny-moe)"),
    (("--config", "tiny-moe", "--ep", "2", "--tp", "4"), "--ep 2 is exported with --tp 2"),
    (("--config", "tiny-moe", "--ep", "2", "--tp", "1"), "must divide --tp 1"),
    (("--config", "tiny-moe", "--ep", "4", "--tp", "4"), "at least 2 experts per rank"),
    (("--config", "tiny-moe", "--tp", "2", "--train"), "without sequence parallelism: pass --sp"),
    (("--config", "tiny-moe", "--ep", "2", "--pp", "2"), "drop --pp"),
])
def test_bad_moe_arguments_are_one_line(tmp_path, args, words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--framework", "megatron-core", *args)
