"""torchtitan's Qwen3-MoE under expert parallelism: `refine export --framework torchtitan --model
qwen3_moe --tp 2 --sp --ep 2` (EP 2 borrowing the TP ranks, as torchtitan's
`expert_parallel_degree=2` with `tensor_parallel_degree=2`).

torchtitan's own `AllToAllTokenDispatcher` runs unmodified, at static capacity
(exporters/frameworks/torchtitan_shims.py shim 11, exporters/capture/ragged.py): its count
exchange is a dist.AllToAll, its two ragged exchanges (dispatch, combine) dist.AllToAllV with the
count tensors as inputs, its `_permute` / `_unpermute` gathers and scatters at the static size.
The forward (and, in the slow tier, the training step: the exchanges' backward is the reverse
exchange) computes what torch computes (`--check`), and both VERIFY (rules/expert_major.lp,
docs/moe.md "Expert-major rows"): for a batch of two sequences (config tiny: under SP each rank's
routes are each sequence's window) and for one (config tiny-seq: a slice of the routes).
"""

from __future__ import annotations

import random
import types

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

import refine.exporters  # noqa: E402
from harness import assert_export_refused  # noqa: E402
from refine.exporters.frameworks.torchtitan import export_torchtitan  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

EXPORTS = {  # name -> (config, options)
    "ep2": ("tiny", dict(tp=2, sp=True, ep=2)),
    "ep2_seq": ("tiny-seq", dict(tp=2, sp=True, ep=2)),
    "ep2_train": ("tiny", dict(tp=2, sp=True, ep=2, train=True)),
    "ep2_seq_train": ("tiny-seq", dict(tp=2, sp=True, ep=2, train=True)),
    "ep2_router_grad": ("tiny", dict(tp=2, sp=True, ep=2, train=True, bug="moe_router_grad_invariant")),
}


@pytest.fixture(scope="module")
def ep_dir(tmp_path_factory):
    """name -> its export directory (Qwen3-MoE, config tiny), exported on first use."""
    root = tmp_path_factory.mktemp("torchtitan_ep")
    made = {}

    def get(name: str):
        if name not in made:
            config, options = EXPORTS[name]
            made[name] = export_torchtitan(config, root / name, model="qwen3_moe", **options).out_dir
        return made[name]

    return get


def _nodes(path):
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return list(model.graph.node) + [n for f in model.functions for n in f.node]


def _exchanges(out, rank: int):
    """The rank's AllToAll and AllToAllV nodes, in program order, with their out_rows."""
    import onnx

    found = []
    for node in _nodes(out / f"rank{rank}.onnx"):
        if node.op_type in ("AllToAll", "AllToAllV"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            found.append((node.op_type, attrs.get("out_rows")))
    return found


def test_expert_parallel_forward_checks_and_holds_the_exchanges(ep_dir):
    """Each MoE layer on each rank: the count exchange (AllToAll), the dispatch (AllToAllV into
    the receive buffer, 2 peers x 8 tokens x min(K=2, 2 local experts) rows) and the combine
    (AllToAllV back to the 8 x 2 routes); torch agrees with the programs."""
    out = ep_dir("ep2")
    outcome = refine.exporters.check(out)
    assert outcome.ok, outcome.render()
    for rank in (0, 1):
        assert _exchanges(out, rank) == [("AllToAll", None), ("AllToAllV", 32), ("AllToAllV", 16)] * 2


def checked_and_verified(out) -> None:
    outcome = refine.exporters.check(out)
    assert outcome.ok, outcome.render()
    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)
    assert not report.sanity_violations and not report.collective_mismatches


def test_expert_parallel_forward_verifies(ep_dir):
    """A batch of two sequences under SP: each rank's routes each sequence's window (a blocked
    window); torchtitan's dispatcher, its expert-major `_permute` and its combine proven, the
    counts' exchanges among them."""
    checked_and_verified(ep_dir("ep2"))


@pytest.mark.slow
def test_expert_parallel_training_step_verifies(ep_dir):
    """The training step: each exchange's backward is the reverse exchange (the counts swapped;
    the count exchange, under no_grad, has none), `_permute`'s backward a scatter-add at its
    index, `_unpermute`'s a gather there, each expert's weight gradient over the expert-major
    rows, the scores' gradient scattered back at the order."""
    out = ep_dir("ep2_train")
    ops = [n.op_type for n in _nodes(out / "rank0.onnx")]
    assert (ops.count("AllToAll"), ops.count("AllToAllV")) == (2, 8), ops
    checked_and_verified(out)


@pytest.mark.slow
def test_router_gradient_left_partial_is_refuted_under_expert_parallelism(ep_dir):
    """The router gate's weight typed I on TP (torchtitan types it R): under EP too its gradient is
    each rank's partial sum over its own tokens' routes, refuted at the router's backward."""
    report = verify_dir(ep_dir("ep2_router_grad"))
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert "router.gate" in text and "moe.py:" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2_seq", "ep2_seq_train"])
def test_expert_parallel_of_one_sequence_verifies(ep_dir, name):
    """One sequence (config tiny-seq): each rank's routes a slice, forward and training step."""
    checked_and_verified(ep_dir(name))


def test_permute_at_static_capacity_is_a_permutation():
    """torchtitan's `_permute` at the static size (the receive capacity): its indices are torch's
    on the received rows and the row itself past them (the padding repeats the last segment, whose
    input and output starts agree), so every gather index is in range and `_unpermute`'s scatter
    writes each row once."""
    import torch

    from refine.exporters.capture.ragged import static_splits
    from refine.exporters.frameworks.torchtitan_shims import import_torchtitan

    import_torchtitan()
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    rng = random.Random(0)
    for _ in range(200):
        ep, experts, tokens = rng.choice([2, 3, 4]), rng.choice([1, 2, 3]), rng.randint(1, 6)
        bound = tokens * min(rng.randint(1, experts), experts)
        counts = torch.zeros(ep, experts, dtype=torch.int64)
        for peer in range(ep):  # (at most `bound` rows from each peer)
            left = bound
            for e in rng.sample(range(experts), experts):
                counts[peer, e] = rng.randint(0, min(tokens, left))
                left -= int(counts[peer, e])
        flat, total = counts.reshape(-1), ep * bound
        received = int(flat.sum())
        me = types.SimpleNamespace(ep_mesh=types.SimpleNamespace(size=lambda ep=ep: ep))
        rows = torch.arange(total, dtype=torch.float32).unsqueeze(1)
        with static_splits(bound):
            _, _, index, _ = AllToAllTokenDispatcher._permute(me, rows, flat)
        _, _, exact, _ = AllToAllTokenDispatcher._permute(me, rows[:received], flat)
        assert torch.equal(index[:received], exact)
        assert torch.equal(index[received:], torch.arange(received, total))
        assert sorted(index.tolist()) == list(range(total))


def test_static_splits_patches_only_functional_all_to_all():
    """A module's `all_to_all_single` is replaced (and restored) only where it is torch's
    functional one, as torchtitan imports it; without split sizes it stays torch's."""
    import torch.distributed._functional_collectives as funcol

    from refine.exporters.capture.ragged import static_splits

    def in_place(*args, **kwargs):  # (HF's module holds c10d's in-place one there)
        raise AssertionError

    titan = types.SimpleNamespace(all_to_all_single=funcol.all_to_all_single)
    hf = types.SimpleNamespace(all_to_all_single=in_place)
    with static_splits(4, titan, hf):
        assert titan.all_to_all_single is not funcol.all_to_all_single
        assert hf.all_to_all_single is in_place
    assert titan.all_to_all_single is funcol.all_to_all_single


@pytest.mark.parametrize("args,words", [
    (("--tp", "2", "--sp", "--ep", "3", "--model", "qwen3_moe"), "it must divide --tp (2)"),
    (("--tp", "4", "--sp", "--ep", "2", "--model", "qwen3_moe"), "EP over part of the TP ranks is not supported yet"),
    (("--tp", "2", "--ep", "2"), "expert parallelism needs experts, pass --model qwen3_moe"),
    (("--tp", "2", "--ep", "2", "--dp", "2", "--fsdp", "--model", "qwen3_moe"), "no --fsdp with it"),
    (("--tp", "2", "--sp", "--ep", "2", "--model", "qwen3_moe", "--bug", "moe_experts_output_replicate"),
     "about the experts split over TP: drop --ep"),
])
def test_bad_expert_parallel_arguments_are_one_line(tmp_path, args, words):
    assert_export_refused(tmp_path / "out", words, "--framework", "torchtitan", *args)
