"""Collectives over the windows of a tensor (rules/windows.lp: `allgather_windows`,
`reduce_scatter_windows`, their transposed forms, and `window_need`, the chunks a reduce-scatter
hands out that refine/run/engine.py seeds in a second solve): CP x TP's attention, where a rank's
keys are its sequence chunk (a window over cp) of its heads (a slice over tp), all-gathered over
cp, and their gradients, sums over the query chunks, reduce-scattered back.

The witness, on a (cp, tp) = 2 x 2 mesh, rank r = 2c + t:

    P = A @ B        A [S, Q] split on Q over cp, B [Q, O] on Q over cp then on O over tp
    Y = tanh(P)      each rank: its term A_c @ B_ct (chunk c's term of the contraction, columns t),
                     reduce-scattered (sum) over its cp group along S: chunk c of P, columns t;
                     tanh; all-gathered over the cp group along S: columns t of Y

its transposed form (S the last axis, the collectives on `movedim`ed copies, as torch code
writes them), and its unit-axis form (`allgather_windows_unit_axis`,
`reduce_scatter_windows_stacked`: a leading axis of 1, the term's chunks of S stacked along it
before the scatter and the gathered stack reshaped back, as DTensor runs a batch-1 sequence shard's
collectives: torchtitan's CP x TP keys on its full_dtensor backend). Refused twins: the
reduce-scatter with avg, the gather's group in the wrong order.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import run_case, simulate
from refine.kit.cases import Case, Graph
from refine.report.render import render_text

FLOAT = TensorProto.FLOAT
S, Q, O = 4, 6, 4  # rows, contraction, columns (each splits in 2)
MESH = {"shape": [2, 2], "dims": ["cp", "tp"]}


FORMS = ("plain", "transposed", "unit")
LEMMAS = {"plain": {"reduce_scatter_windows", "allgather_windows"},
          "transposed": {"reduce_scatter_windows_transposed", "allgather_windows_transposed"},
          "unit": {"reduce_scatter_windows_stacked", "allgather_windows_unit_axis"}}


def window_case(form: str, bug: str | None = None) -> Case:
    """The witness (module doc) in one of three forms: "plain"; "transposed"; "unit" (a leading
    axis of 1, collectives along it as DTensor runs them for a batch-1 sequence shard: the term
    split along S and its blocks stacked along the unit axis before the scatter, the gathered
    stack reshaped back). `bug`: "avg" (the scatter averages), "order" (the gather's group
    reversed), "blocks" (unit form: the blocks stacked in reverse, member J gets chunk 1 - J)."""
    seq, ranks = Graph(), [Graph() for _ in range(4)]

    def side(g: Graph, r: int | None) -> str:
        c, t = (0, 0) if r is None else divmod(r, 2)
        whole = r is None
        if form == "transposed":  # Y^T = tanh(B^T A^T): B^T [O, Q] on Q over cp then O over tp, A^T [Q, S] on Q over cp
            bt = g.input("bt", [O, Q] if whole else [O // 2, Q // 2], FLOAT)
            at = g.input("at", [Q, S] if whole else [Q // 2, S], FLOAT)
            p = g.op("MatMul", bt, at)
        else:
            lead = [1] if form == "unit" else []
            a = g.input("a", [*lead, S, Q] if whole else [*lead, S, Q // 2], FLOAT)
            b = g.input("b", [Q, O] if whole else [Q // 2, O // 2], FLOAT)
            p = g.op("MatMul", a, b)
        if whole:
            return g.output(g.op("Tanh", p))
        group = [t, 2 + t]
        order = list(reversed(group)) if bug == "order" else group
        op = "avg" if bug == "avg" else "sum"
        if form == "transposed":  # the sequence is axis 1: move it to the front and back
            front = g.op("Transpose", p, perm=[1, 0])
            chunk = g.op("Transpose", g.coll("ReduceScatter", front, group, axis=0, reduce_op=op), perm=[1, 0])
            y = g.op("Tanh", chunk)
            gathered = g.coll("AllGather", g.op("Transpose", y, perm=[1, 0]), order, axis=0)
            return g.output(g.op("Transpose", gathered, perm=[1, 0]))
        if form == "unit":  # [1, S, O/2]: blocks of S stacked on the unit axis, scattered along it
            blocks = g.op_n("Split", p, g.ints([S // 2, S // 2]), outputs=2, axis=1)
            blocks = blocks[::-1] if bug == "blocks" else blocks
            chunk = g.coll("ReduceScatter", g.op("Concat", *blocks, axis=0), group, axis=0, reduce_op=op)
            gathered = g.coll("AllGather", g.op("Tanh", chunk), order, axis=0)
            return g.output(g.op("Reshape", gathered, g.ints([1, S, O // 2])))
        chunk = g.coll("ReduceScatter", p, group, axis=0, reduce_op=op)
        return g.output(g.coll("AllGather", g.op("Tanh", chunk), order, axis=0))

    out = side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    split = {"layout": "shard", "axis": 0, "over": "cp"}
    if form == "transposed":
        inputs = {"bt": {"layout": "shard", "axis": 1, "over": "cp", "then": {"axis": 0, "over": "tp"}},
                  "at": split}
        outputs = {out: {"layout": "shard", "axis": 0, "over": "tp"}}
    else:
        last = 2 if form == "unit" else 1
        inputs = {"a": {"layout": "shard", "axis": last, "over": "cp"},
                  "b": {**split, "then": {"axis": 1, "over": "tp"}}}
        outputs = {out: {"layout": "shard", "axis": last, "over": "tp"}}
    return Case(f"window-collectives-{form}-{bug or 'ok'}", seq, ranks, inputs, outputs=outputs, mesh=MESH)


@pytest.mark.parametrize("form", FORMS)
def test_gradient_chunks_scattered_and_gathered_over_cp_verify(form: str) -> None:
    """VERIFIED, each lemma fired and checked on the numbers."""
    case = window_case(form)
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    assert LEMMAS[form] <= out.lemmas_fired(), sorted(out.lemmas_fired())
    assert LEMMAS[form] <= out.checked.lemmas_checked
    assert out.report.verdict == "verified", render_text(out.report)


@pytest.mark.parametrize(("form", "bug"), [(form, bug) for form in FORMS for bug in ("avg", "order")] + [("unit", "blocks")])
def test_averaged_or_misordered_window_collectives_are_not_verified(form: str, bug: str) -> None:
    """A real numeric difference, no relation derived that the numbers contradict, not VERIFIED."""
    case = window_case(form, bug)
    sim = simulate(case, 0)
    want = sim.seq[case.seq.outputs[0]]
    got = sim.ranks[0][case.ranks[0].outputs[0]]
    mine = want[:2] if form == "transposed" else want[..., :2]
    assert not (got.shape == mine.shape and np.allclose(got, mine, atol=1e-4))
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified", render_text(out.report)


def partial_slices_case(flaw: str | None = None) -> Case:
    """P = A @ B left unreduced (the module doc's terms, before the scatter): rank (c, t) outputs
    chunk c's term of P on columns t, an output no refine.json declares (torchtitan's gradients
    under CP x TP, which FSDP reduces). `flaw`: "neg" (rank 3's term negated), "dropped" (rank 2
    outputs zeros: a term missing from the sum)."""
    seq, ranks = Graph(), [Graph() for _ in range(4)]

    def side(g: Graph, r: int | None) -> str:
        whole = r is None
        a = g.input("a", [S, Q] if whole else [S, Q // 2], FLOAT)
        b = g.input("b", [Q, O] if whole else [Q // 2, O // 2], FLOAT)
        p = g.op("MatMul", a, b)
        if flaw == "dropped" and r == 2:  # (chunk 1's term on columns 0 left out of the sum)
            p = g.op("Sub", p, p)
        if flaw == "neg" and r == 3:
            p = g.op("Neg", p)
        return g.output(p)

    side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    inputs = {"a": {"layout": "shard", "axis": 1, "over": "cp"},
              "b": {"layout": "shard", "axis": 0, "over": "cp", "then": {"axis": 1, "over": "tp"}}}
    return Case(f"partial-slices-{flaw or 'ok'}", seq, ranks, inputs, mesh=MESH)


def test_an_output_left_partial_over_cp_and_sliced_over_tp_is_rebuilt() -> None:
    """Each rank's output is its chunk's term of P on its columns: P = concat over the columns of
    the sum over the chunks (rules/report.lp slsum, scope own): VERIFIED, and the report says so."""
    out = run_case(partial_slices_case(), 0)
    assert out.checked.ok, out.checked.violations
    text = render_text(out.report)
    assert out.report.verdict == "verified", text
    assert "= concat(sum(r0:" in text and ", axis=1)" in text, text


@pytest.mark.parametrize("flaw", ["neg", "dropped"])
def test_a_rank_outside_the_partial_slices_is_not_verified(flaw: str) -> None:
    """A rank whose output is not its term (negated, or zeros): not VERIFIED, and nothing derived
    contradicts the numbers."""
    out = run_case(partial_slices_case(flaw), 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified", render_text(out.report)
