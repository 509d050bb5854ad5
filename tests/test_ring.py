"""Ring attention (exporters/strategies/context.py, `export_context_parallel(..., ring=True)`; rules/ring.lp):
the zoo GPT-2 with its sequence split over 2 ranks, the key/value blocks passed round the ring
with dist.Send / dist.Recv and merged by the online-softmax rule, verifies and matches torch; its
bug twins (a block masked with the rank's own columns, a merge without the exp(m_old - m_new)
rescale, the first block merged twice) are refuted by a numeric counterexample, the report
naming the attention of layer 0 and rank nodes at lines of exporters/strategies/context.py.

Each export is made once per session (exports_on_first_use) and shared by the tests reading it.
The lemmas themselves have their numeric witnesses in tests/test_lemmas_context.py. CP 4 and the
ring_no_rescale twin run under harness.SWEEP (REFINE_TEST_SWEEP=1, benchmarks/sweep.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from harness import SWEEP, exports_on_first_use, invoke  # noqa: E402

CONTEXT_PY = str(Path(__file__).resolve().parent.parent / "exporters" / "strategies" / "context.py")
BUGS = ("ring_mask_not_offset", "ring_no_rescale", "ring_block_twice")


@pytest.fixture(scope="session")
def ring_dir(tmp_path_factory):
    """name -> the GPT-2 tiny CP 2 ring-attention export of that name ("ring", "ring_cp4" at CP 4,
    or a bug of RING_BUGS), made through refine.exporters.strategies.context.export_context_parallel(ring=True)."""
    from refine.exporters.strategies.context_export import export_context_parallel

    def export(name: str, out: Path) -> None:
        cp = 4 if name == "ring_cp4" else 2
        export_context_parallel("gpt2", "tiny", cp, out, bug=None if name in ("ring", "ring_cp4") else name, ring=True)

    return exports_on_first_use(tmp_path_factory.mktemp("ring"), export)


def test_ring_programs_pass_blocks_point_to_point(ring_dir) -> None:
    """No gather: every rank sends and receives its keys and values once per layer (CP 2: one
    exchange), even ranks sending first and odd ranks receiving first; refine.json as variant (a)."""
    import onnx

    out = ring_dir("ring")
    config = json.loads((out / "refine.json").read_text())
    assert config["world_size"] == 2 and config["outputs"] == {"logits": {"layout": "shard", "axis": 1}}
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 1, "range": [0, 128]}
    for r in range(2):
        model = onnx.load(out / f"rank{r}.onnx")
        ops = [n.op_type for f in model.functions for n in f.node] + [n.op_type for n in model.graph.node]
        assert ops.count("Send") == 2 and ops.count("Recv") == 2 and "AllGather" not in ops, r
        order = [op for op in ops if op in ("Send", "Recv")]
        assert order == (["Send", "Send", "Recv", "Recv"] if r == 0 else ["Recv", "Recv", "Send", "Send"])


def test_ring_attention_gpt2_verifies(ring_dir) -> None:
    result = invoke("verify", ring_dir("ring"))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    assert "logits = concat(r0..r1:logits, axis=1)" in result.output


def test_ring_attention_gpt2_matches_torch(ring_dir) -> None:
    """The exported ranks, fed their slices of the tokens, rebuild what the torch model computes
    (the exporter's check path, `refine export --check`)."""
    import refine.exporters

    checked = refine.exporters.check(ring_dir("ring"))
    assert checked.ok, checked.render()


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the ring at CP 4, the same exporter code as CP 2's")
def test_ring_attention_cp4_verifies_and_matches_torch(ring_dir) -> None:
    """Four ranks (two tokens each): the key intervals wrap round the ring (rank 1 merges blocks
    1, 0, 3, 2), the odd ranks receive before they send, and the programs run together."""
    import refine.exporters

    result = invoke("verify", ring_dir("ring_cp4"))
    assert result.exit_code == 0, result.output
    assert "logits = concat(r0..r3:logits, axis=1)" in result.output
    checked = refine.exporters.check(ring_dir("ring_cp4"))
    assert checked.ok, checked.render()


# bug -> (what is wrong: pattern, rank node op, source line's text in exporters/strategies/context.py)
WHERE = {"ring_mask_not_offset": ("ring_block_operand", "Where", "masked_fill"),
         "ring_no_rescale": ("ring_merge", "Add", "+"),
         "ring_block_twice": ("ring_merge", "Add", "+")}


# (the default run: a twin per diagnosis pattern; ring_no_rescale, a merge wrong as ring_block_twice's is, in the sweep)
@pytest.mark.parametrize("bug", [pytest.param(bug, marks=pytest.mark.skipif(
    not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): ring_block_twice's merge runs by default"))
    if bug == "ring_no_rescale" else bug for bug in BUGS])
def test_ring_bug_twin_refuted(ring_dir, tmp_path: Path, bug: str) -> None:
    """Refuted (exit 1) by a counterexample; the first failure is layer 0's attention scores (the
    first sequential node the ring computes otherwise: its blocks are facts of rules/ring.lp, not
    relations), computed on the ranks at a line of exporters/strategies/context.py; what is wrong names the
    rank node where the merge stops (ring_stuck), at its line: the mask's Where, the merge's Add."""
    report = tmp_path / "report.json"
    result = invoke("verify", ring_dir(bug), "--json", report)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output.splitlines()[0]
    assert "counterexample" in result.output
    data = json.loads(report.read_text())
    failure = data["failure"]
    assert failure["node"].startswith("h.0") and "attn" in failure["node"]
    sites = {(n["location"]["file"], n["location"]["line"]) for n in failure["rank_nodes"]}
    assert sites and all(file == CONTEXT_PY for file, _ in sites), sites
    pattern, op, text = WHERE[bug]
    diagnosis = data["diagnosis"]
    assert diagnosis["pattern"] == pattern and diagnosis["rank_node"].startswith("h.0/attn/" + op), diagnosis
    where = diagnosis["location"]
    assert where["file"] == CONTEXT_PY and text in Path(CONTEXT_PY).read_text().splitlines()[where["line"] - 1], where


def test_ring_bugs_only_with_ring() -> None:
    """The ring twins are refused (ExportError) for the all-gather variant, and named for the ring."""
    from refine.exporters.strategies.context import context_bug
    from refine.exporters.errors import ExportError

    assert context_bug("ring_no_rescale", ring=True).bug_class == 9
    assert context_bug("cp_mask_not_offset", ring=True).name == "cp_mask_not_offset"
    with pytest.raises(ExportError, match="ring_no_rescale"):
        context_bug("ring_no_rescale")
