"""Numeric witnesses for the lemmas a PP x TP training step needs (exporters/strategies/pipeline_mesh_train.py):
a tensor-parallel rank accumulating its shard of a weight's gradient over micro-batches adds, on
the rank, the same columns of two adjacent pieces of the sequential contraction
(rules/elementwise.lp partial_slice_add_adjacent), and the columns of the piece spanning the whole
decomposition are the columns of the whole (rules/core.lp whole_piece_slice).

Each witness runs under random shapes, cuts and world sizes 2..4 (asymmetric random values, through
the multi-rank simulator: every derived relation checked on numbers) and asserts that the lemma
fired and the verdict; each negative is a program the lemmas must not take (numbers that differ):
pieces that do not meet (the same twice, overlapping, a gap), adjacent pieces of different
columns, one piece short of the whole.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import Graph, rep, run_case, simulate
from test_lemmas_backward import In, build, dim, rng_for, witness

FLOAT = TensorProto.FLOAT
WORLDS = [(2, 0), (3, 1), (4, 2)]


def columns_of_pieces(g: Graph, x: dict, pieces: list[tuple[int, int, int, int]]) -> str:
    """sum over (lo, hi, c0, c1) of (x[:, lo:hi] @ w[lo:hi])[:, c0:c1], added on the rank in that
    order: a TP rank's columns of each micro-batch's term of a weight's gradient, accumulated."""
    total = None
    for lo, hi, c0, c1 in pieces:
        xs = g.op("Slice", x["x"], g.ints([lo]), g.ints([hi]), g.ints([1]))
        ws = g.op("Slice", x["w"], g.ints([lo]), g.ints([hi]), g.ints([0]))
        term = g.op("Slice", g.op("MatMul", xs, ws), g.ints([c0]), g.ints([c1]), g.ints([1]))
        total = term if total is None else g.op("Add", total, term)
    assert total is not None
    return total


@pytest.mark.parametrize("world,seed", WORLDS)
def test_rank_adds_the_same_columns_of_adjacent_pieces(world: int, seed: int) -> None:
    """y = x @ w; rank r holds columns [r q, (r+1) q) of y as the sum of those columns of the
    contraction's pieces [0, b) and [b, k) (in a random order): the ranks' outputs concatenate to y."""
    rng = rng_for("slice_adjacent", world, seed)
    m, k, q = dim(rng), dim(rng, 3, 6), dim(rng, 1, 3)
    cut = int(rng.integers(1, k))
    inputs: dict[str, In] = {"x": ([m, k], rep(), FLOAT), "w": ([k, world * q], rep(), FLOAT)}
    swap = bool(rng.integers(0, 2))

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            return g.output(g.op("MatMul", x["x"], x["w"]))
        pieces = [(0, cut, r * q, (r + 1) * q), (cut, k, r * q, (r + 1) * q)]
        return g.output(columns_of_pieces(g, x, pieces[::-1] if swap else pieces))

    case, y = build(f"slice_adjacent-{world}-{seed}", world, inputs, body)
    out = witness(case, seed, "partial_slice_add_adjacent")
    assert "whole_piece_slice" in out.checked.lemmas_checked
    assert {str(lay[0]) for t, lay in out.relations_of(y) if t == f"r0:{case.ranks[0].outputs[0]}"
            and not isinstance(lay, str)} >= {"sl"}


@pytest.mark.parametrize("seed", [0, 1])
def test_three_pieces_add_up(seed: int) -> None:
    """Three micro-batches: pieces [0, a), [a, b), [b, k), each rank's columns, added in turn."""
    rng = rng_for("slice_three", seed)
    m, q = dim(rng), dim(rng, 1, 3)
    k = dim(rng, 4, 7)
    a, b = sorted(int(v) for v in rng.choice(np.arange(1, k), 2, replace=False))
    inputs: dict[str, In] = {"x": ([m, k], rep(), FLOAT), "w": ([k, 2 * q], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            return g.output(g.op("MatMul", x["x"], x["w"]))
        cols = (r * q, (r + 1) * q)
        return g.output(columns_of_pieces(g, x, [(0, a, *cols), (a, b, *cols), (b, k, *cols)]))

    case, _ = build(f"slice_three-{seed}", 2, inputs, body)
    witness(case, seed, "whole_piece_slice")


def not_rebuilt(case, y: str) -> None:
    """The rank's output is not y's columns (numbers), nothing relates it to y, not verified,
    and whatever was derived holds."""
    sim = simulate(case, 0)
    got = sim.ranks[0][case.ranks[0].outputs[0]]
    assert not np.allclose(got, sim.seq[y][:, : got.shape[1]], atol=1e-5)
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    # (pieces short of the whole relate as what they are, a piece: psl(C, X, Y, A, B, D, St) with B - A < D)
    held = [lay for t, lay in out.relations_of(y) if t == f"r0:{case.ranks[0].outputs[0]}"]
    assert all(not isinstance(lay, str) and lay[0] == "psl" and lay[5] - lay[4] < lay[6] for lay in held), held


@pytest.mark.parametrize("cuts", [(0, 2, 0, 2), (0, 2, 1, 4), (0, 1, 2, 4), (0, 2, 2, 3)],
                         ids=["same", "overlap", "gap", "short"])
def test_columns_of_pieces_that_do_not_meet_are_refused(cuts: tuple[int, int, int, int]) -> None:
    """The same piece twice, overlapping pieces, a gap between them, or pieces short of the whole
    contraction ([0, 3) of 4): the sum's columns are not y's."""
    a, b, c, d = cuts
    inputs: dict[str, In] = {"x": ([3, 4], rep(), FLOAT), "w": ([4, 4], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            return g.output(g.op("MatMul", x["x"], x["w"]))
        return g.output(columns_of_pieces(g, x, [(a, b, 0, 2), (c, d, 0, 2)]))

    case, y = build(f"slice_not_adjacent-{cuts}", 1, inputs, body)
    not_rebuilt(case, y)


def test_adjacent_pieces_of_other_columns_are_refused() -> None:
    """Pieces [0, 2) and [2, 4) that meet, but of columns [0, 2) and [2, 4): their sum is no
    columns of y."""
    inputs: dict[str, In] = {"x": ([3, 4], rep(), FLOAT), "w": ([4, 4], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            return g.output(g.op("MatMul", x["x"], x["w"]))
        return g.output(columns_of_pieces(g, x, [(0, 2, 0, 2), (2, 4, 2, 4)]))

    case, y = build("slice_other_columns", 1, inputs, body)
    not_rebuilt(case, y)
