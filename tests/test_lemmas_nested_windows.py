"""Windows of windows (rules/windows.lp): a rank that holds an even cut along one axis of its batch
chunk (the sequence over cp of a DP row's rows) holds a chunk of that chunk,
win(win(S, 0, d, D), 1, c, C); the chunk's virtual program and its terms of sums are chunked again
(`real` for them once nested seeds exist), a piece of a chunk's term is a piece of the whole sum
(`chunk_term_piece`: along the same axis, or as a grid of atoms along another reduced axis), and a
reduce-scatter inside a DP row asks for the chunks of a chunk it hands out (`window_need`, seeded by
refine/run/engine.py from the needs' clingo text).

The witnesses, on a (dp, cp, tp) = 2 x 2 x 2 mesh, rank r = (2d + c) * 2 + t, X [2, 4, 3] split
on the batch over dp then on the sequence over cp:

  the flat projection (a Llama projection of a PP x DP x CP x TP step)
    P = reshape(flat(X) @ W, [2, 4, 4])    W column-split over tp; each rank its [1, 2, 2] piece,
                                           all-gathered over tp
    G = flat(X)^T @ (flat(X) @ W)          a weight gradient: each rank its rows' term on its
                                           columns, all-reduced over the data group (dp x cp)
    R = ReduceSum(tanh(X), axes [0, 1])    a norm weight's gradient: each rank its tokens' sum,
                                           all-reduced over the data group
    E = ScatterND(0, ids, tanh(X), add)    an embedding's gradient: each rank scatters its
                                           tokens' rows, all-reduced over the data group
    and R and E again over the flat rows (a bias's gradient; the embedding's of flat tokens)
  the keys' gradient inside a DP row (CP x TP attention's backward, batched)
    K = tanh(A @ B)                        A [2, 4, 4] on the batch over dp then its contraction
                                           axis over cp; B [4, 4] on rows over cp then columns
                                           over tp; each rank its term, reduce-scattered (sum)
                                           over cp along the sequence, tanh, all-gathered back
                                           over cp, then over tp

  micro-batches (each rank cuts its three rows into three micro-batches and adds their terms up:
  `window_recut`, the finer windows asked for; `blocks_accumulated`; a chunk's term summed by
  blocks, `chunk_term_piece`), X [6, 4, 3]:
    G = flat(X)^T @ (flat(X) @ W)          per micro-batch, added up, all-reduced over the data group
    L = ReduceSum(tanh(flat(X)), [0])      per micro-batch, added up, all-reduced (a loss)
    C = ReduceSum(tanh(flat(X)), axes [0]) over the rank's whole rows at once (a token count)

  and on a (cp, tp) mesh alone, a rank's micro-batches of its sequence chunk (a window cut along
  another axis: the finer windows are micro-batches of windows).

Refused twins: the data group's all-reduce over cp alone, or with avg; the tp gather reversed;
the reduce-scatter with avg; a micro-batch's term added twice (the other left out).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from onnx import TensorProto

from harness import run_case
from refine.kit.cases import Case, Graph
from refine.report.render import render_text

FLOAT = TensorProto.FLOAT
B, S, H, O, V = 2, 4, 3, 4, 5
MESH = {"shape": [2, 2, 2], "dims": ["dp", "cp", "tp"]}
BATCH_THEN_SEQUENCE = {"layout": "shard", "axis": 0, "over": "dp", "then": {"axis": 1, "over": "cp"}}


def coordinates(r: int) -> tuple[int, int, int]:
    """(d, c, t) of rank r."""
    return r // 4, (r // 2) % 2, r % 2


def flat_projection_case(bug: str | None = None) -> Case:
    """The flat projection witness (module doc). `bug`: "cp_only" (the data group's all-reduces
    over the cp group alone), "avg" (they average), "tp_order" (the tp gather's group reversed)."""
    seq, ranks = Graph(), [Graph() for _ in range(8)]

    def side(g: Graph, r: int | None) -> None:
        b, s, o = (B, S, O) if r is None else (B // 2, S // 2, O // 2)
        x = g.input("x", [b, s, H], FLOAT)
        w = g.input("w", [H, o], FLOAT)
        flat = g.op("Reshape", x, g.ints([b * s, H]))
        cols = g.op("MatMul", flat, w)
        proj = g.op("Reshape", cols, g.ints([b, s, o]))
        grad = g.op("MatMul", g.op("Transpose", flat, perm=[1, 0]), cols)
        norm = g.op("ReduceSum", g.op("Tanh", x), g.ints([0, 1]), keepdims=0)
        ids = g.input("ids", [b, s, 1], TensorProto.INT64)
        table = g.op("ScatterND", g.const(np.zeros([V, H])), ids, g.op("Tanh", x), reduction="add")
        rows = g.op("Tanh", flat)
        bias = g.op("ReduceSum", rows, g.ints([0]), keepdims=0)
        flat_ids = g.op("Reshape", ids, g.ints([b * s, 1]))
        flat_table = g.op("ScatterND", g.const(np.zeros([V, H])), flat_ids, rows, reduction="add")
        if r is not None:
            d, c, t = coordinates(r)
            tp = [4 * d + 2 * c, 4 * d + 2 * c + 1]
            data = [2 * c + t, 4 + 2 * c + t] if bug == "cp_only" else [t, 2 + t, 4 + t, 6 + t]
            op = "avg" if bug == "avg" else "sum"
            proj = g.coll("AllGather", proj, list(reversed(tp)) if bug == "tp_order" else tp, axis=2)
            grad = g.coll("AllReduce", grad, data, reduce_op=op)
            norm = g.coll("AllReduce", norm, data, reduce_op=op)
            table, bias, flat_table = (g.coll("AllReduce", v, data, reduce_op=op) for v in (table, bias, flat_table))
        for value in (proj, grad, norm, table, bias, flat_table):
            g.output(value)

    side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    outs = seq.outputs
    inputs = {"x": BATCH_THEN_SEQUENCE, "w": {"layout": "shard", "axis": 1, "over": "tp"},
              "ids": {**BATCH_THEN_SEQUENCE, "range": [0, V]}}
    outputs = {outs[0]: BATCH_THEN_SEQUENCE, outs[1]: {"layout": "shard", "axis": 1, "over": "tp"},
               **{out: {"layout": "rep"} for out in outs[2:]}}
    return Case(f"nested-windows-flat-{bug or 'ok'}", seq, ranks, inputs, outputs=outputs, mesh=MESH)


def keys_gradient_case(bug: str | None = None) -> Case:
    """The keys' gradient witness (module doc). `bug`: "avg" (the reduce-scatter averages)."""
    seq, ranks = Graph(), [Graph() for _ in range(8)]

    def side(g: Graph, r: int | None) -> None:
        whole = r is None
        a = g.input("a", [B, S, O] if whole else [B // 2, S, O // 2], FLOAT)
        b = g.input("b", [O, O] if whole else [O // 2, O // 2], FLOAT)
        k = g.op("MatMul", a, b)
        if not whole:
            d, c, t = coordinates(r)
            cp, tp = [4 * d + t, 4 * d + 2 + t], [4 * d + 2 * c, 4 * d + 2 * c + 1]
            chunk = g.coll("ReduceScatter", k, cp, axis=1, reduce_op="avg" if bug == "avg" else "sum")
            k = g.coll("AllGather", g.coll("AllGather", g.op("Tanh", chunk), cp, axis=1), tp, axis=2)
        else:
            k = g.op("Tanh", k)
        g.output(k)

    side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    inputs = {"a": {"layout": "shard", "axis": 0, "over": "dp", "then": {"axis": 2, "over": "cp"}},
              "b": {"layout": "shard", "axis": 0, "over": "cp", "then": {"axis": 1, "over": "tp"}}}
    outputs = {seq.outputs[0]: {"layout": "shard", "axis": 0, "over": "dp"}}
    return Case(f"nested-windows-keys-{bug or 'ok'}", seq, ranks, inputs, outputs=outputs, mesh=MESH)


def micro_batches_case(bug: str | None = None, dp: int = 2) -> Case:
    """The micro-batches witness (module doc); `dp` 1: the (cp, tp) mesh alone, a rank's three
    micro-batches of its sequence chunk. `bug`: "avg" (the data group averages), "twice"
    (micro-batch 0's terms added twice, micro-batch 1's left out)."""
    seq, ranks = Graph(), [Graph() for _ in range(4 * dp)]
    rows = 3 * dp  # (three per DP row: three micro-batches)

    def terms(g: Graph, x: str, w: str, b: int, s: int) -> tuple[str, str]:
        flat = g.op("Reshape", x, g.ints([b * s, H]))
        grad = g.op("MatMul", g.op("Transpose", flat, perm=[1, 0]), g.op("MatMul", flat, w))
        return grad, g.op("ReduceSum", g.op("Tanh", flat), g.ints([0]), keepdims=0)

    def side(g: Graph, r: int | None) -> None:
        b, s, o = (rows, S, O) if r is None else (rows // dp, S // 2, O // 2)
        x = g.input("x", [b, s, H], FLOAT)
        w = g.input("w", [H, o], FLOAT)
        count = g.op("ReduceSum", g.op("Tanh", g.op("Reshape", x, g.ints([b * s, H]))), g.ints([0]), keepdims=0)
        if r is None:
            grad, norm = terms(g, x, w, b, s)
        else:
            t = r % 2
            parts = [terms(g, g.op("Slice", x, g.ints([k]), g.ints([k + 1]), g.ints([0])), w, 1, s) for k in range(b)]
            if bug == "twice":
                parts[1] = parts[0]
            grad, norm = parts[0]
            for more in parts[1:]:
                grad, norm = g.op("Add", grad, more[0]), g.op("Add", norm, more[1])
            data, op = [2 * j + t for j in range(2 * dp)], "avg" if bug == "avg" else "sum"
            grad, norm, count = (g.coll("AllReduce", v, data, reduce_op=op) for v in (grad, norm, count))
        for value in (grad, norm, count):
            g.output(value)

    side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    outs = seq.outputs
    x = BATCH_THEN_SEQUENCE if dp > 1 else {"layout": "shard", "axis": 1, "over": "cp"}
    inputs = {"x": x, "w": {"layout": "shard", "axis": 1, "over": "tp"}}
    outputs = {outs[0]: {"layout": "shard", "axis": 1, "over": "tp"}, outs[1]: {"layout": "rep"},
               outs[2]: {"layout": "rep"}}
    mesh = MESH if dp > 1 else {"shape": [2, 2], "dims": ["cp", "tp"]}
    return Case(f"nested-windows-micro-batches-dp{dp}-{bug or 'ok'}", seq, ranks, inputs, outputs=outputs, mesh=mesh)

cp_micro_batches_case = partial(micro_batches_case, dp=1)


@pytest.mark.parametrize("make,lemmas", [
    (flat_projection_case, {"chunk_term_piece", "allreduce_sum"}),
    (keys_gradient_case, {"reduce_scatter_windows", "allgather_windows"}),
    (micro_batches_case, {"window_recut", "blocks_accumulated", "chunk_term_piece"}),
    (cp_micro_batches_case, {"window_recut", "blocks_accumulated"}),
])
def test_windows_of_windows_verify(make, lemmas: set[str]) -> None:
    """VERIFIED, each lemma fired and checked on the numbers."""
    out = run_case(make(), 0)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    assert out.report.verdict == "verified", render_text(out.report)
    assert lemmas <= out.lemmas_fired(), sorted(out.lemmas_fired())
    assert lemmas <= out.checked.lemmas_checked


@pytest.mark.parametrize("make,bug", [
    (flat_projection_case, "cp_only"),
    (flat_projection_case, "avg"),
    (flat_projection_case, "tp_order"),
    (keys_gradient_case, "avg"),
    (micro_batches_case, "avg"),
    (micro_batches_case, "twice"),
    (cp_micro_batches_case, "twice"),
])
def test_a_wrong_group_or_reduction_inside_a_dp_row_is_not_verified(make, bug: str) -> None:
    """A real numeric difference (the simulator's check finds no derived relation it breaks), not
    VERIFIED."""
    out = run_case(make(bug), 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified", render_text(out.report)
