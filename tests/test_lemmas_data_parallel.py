"""Numeric witnesses for the lemmas a data-parallel training step needs: each rank holds a slice
of the batch, so the loss picks along the vocabulary of sliced rows, the embedding gradients
scatter sliced rows into zeros, and the partial sums of two lemmas count their pieces in
different units (rules/routing.lp, rules/elementwise.lp, rules/core.lp).

Each witness runs under random shapes and world sizes 2..4 and asserts that the lemma fired,
that everything derived held in the multi-rank simulator, and the verdict; each negative is a
program the lemma must not take (numbers that differ where the program is wrong).

Covered: pick_sliced (GatherElements and ScatterElements with rows sliced, the scatter's zeros
a ConstantOfShape of the rank's own shape: constants equal along an axis, core.lp's bc inrel),
partial_where_zero (both branch orders), scatter_add_rows, scatter_add_partial (ScatterND and
ScatterElements), partial_add_adjacent
and whole_piece (a rank summing its own pieces: gradient accumulation),
partial_add_partial and the all-reduce over pieces counted in two units; refused: a gather whose data is not sliced with its indices, a gather
along the sliced axis, a where choosing a partial against ones, a scatter-add into ones, a
scatter without a reduction, pieces of different fractions, a constant whose rows differ.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import Case, Graph, partial, rep, run_case, shard, simulate
from test_lemmas_backward import In, build, dim, kinds, refused, rng_for, witness

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
WORLDS = [(2, 0), (3, 1), (4, 2)]


def ids(v: int, layout: dict) -> dict:
    return {**layout, "range": [0, v]}


def rows(world: int, rng: np.random.Generator) -> int:
    return world * dim(rng, 1, 3)


# --- picks along the vocabulary of sliced rows (routing.lp pick_sliced) ---------------------

@pytest.mark.parametrize("world,seed", WORLDS)
def test_gather_elements_of_sliced_rows(world: int, seed: int) -> None:
    """A loss's log-probability of each row's label: GatherElements(L[n, v], I[n, 1], axis 1), the
    rows sliced alike on L and I, is the sliced pick."""
    rng = rng_for("pick_gather", world, seed)
    n, v = rows(world, rng), dim(rng, 3, 6)
    inputs: dict[str, In] = {"l": ([n, v], shard(0), FLOAT), "i": ([n, 1], ids(v, shard(0)), INT64)}
    case, y = build(f"pick_gather-{seed}", world, inputs,
                    lambda g, x, r: g.output(g.op("GatherElements", g.op("Tanh", x["l"]), x["i"], axis=1)))
    assert kinds(witness(case, seed, "pick_sliced"), y) == {"sl"}


@pytest.mark.parametrize("world,seed", WORLDS)
def test_scatter_elements_into_zeros_of_sliced_rows(world: int, seed: int) -> None:
    """The loss gradient: ScatterElements(zeros [n, v], I[n, 1], U[n, 1], axis 1), the zeros a
    ConstantOfShape of each side's own row count (constant along the rows: bc), I and U sliced."""
    rng = rng_for("pick_scatter", world, seed)
    n, v = rows(world, rng), dim(rng, 3, 6)
    inputs: dict[str, In] = {"i": ([n, 1], ids(v, shard(0)), INT64), "u": ([n, 1], shard(0), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        zeros = g.op("ConstantOfShape", g.op("Concat", g.op("Shape", x["i"], end=1), g.ints([v]), axis=0))
        return g.output(g.op("ScatterElements", zeros, x["i"], x["u"], axis=1))

    case, y = build(f"pick_scatter-{seed}", world, inputs, body)
    assert kinds(witness(case, seed, "pick_sliced"), y) == {"sl"}


def test_gather_with_other_data_rows_is_refused() -> None:
    """Indices sliced, but every rank cuts the data's first rows: rank 1 picks its labels from
    rank 0's rows (right on rank 0 only)."""
    rng = rng_for("pick_rep_data", 0)
    n, v = rows(2, rng), dim(rng, 3, 6)
    inputs: dict[str, In] = {"l": ([n, v], rep(), FLOAT), "i": ([n, 1], ids(v, shard(0)), INT64)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        data = x["l"] if r is None else g.op("Slice", x["l"], g.ints([0]), g.ints([n // 2]), g.ints([0]))
        return g.output(g.op("GatherElements", data, x["i"], axis=1))

    case, y = build("pick_rep_data", 2, inputs, body)
    wrong_on_rank_1(case, y, n // 2)


def wrong_on_rank_1(case: Case, y: str, start: int) -> None:
    """Rank 1 of 2 (holding rows start.. of y) computes other numbers, and nothing relates its
    tensors to y; whatever was derived holds; not verified."""
    sim = simulate(case, 0)
    assert not np.allclose(sim.ranks[1][case.ranks[1].outputs[0]], sim.seq[y][start:])
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    assert not [t for t, _ in out.relations_of(y) if t.startswith("r1:")]


def test_gather_along_the_sliced_axis_is_refused() -> None:
    """GatherElements along axis 0 of data sliced along axis 0: the indices address the whole axis."""
    rng = rng_for("pick_same_axis", 1)
    n, v = rows(2, rng), dim(rng, 3, 6)
    inputs: dict[str, In] = {"l": ([n, v], shard(0), FLOAT), "i": ([n, v], ids(n // 2, shard(0)), INT64)}
    case, y = build("pick_same_axis", 2, inputs,
                    lambda g, x, r: g.output(g.op("GatherElements", x["l"], x["i"], axis=0)))
    refused(case, 1, y, buggy=True)


def test_constant_with_other_rows_is_refused() -> None:
    """A rank constant whose row is not the sequential constant's row does not stand for it."""
    rng = rng_for("const_rows", 0)
    n, v = rows(2, rng), dim(rng, 3, 6)
    row = rng.standard_normal(v)
    inputs: dict[str, In] = {"x": ([n, v], shard(0), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        rows_here = n if r is None else n // 2
        c = np.tile(row + (0.5 if r == 1 else 0.0), (rows_here, 1))
        return g.output(g.op("Add", x["x"], g.const(c)))

    case, y = build("const_rows", 2, inputs, body)
    wrong_on_rank_1(case, y, n // 2)


# --- partials chosen against zeros (elementwise.lp partial_where_zero) ---------------------

@pytest.mark.parametrize("world,seed", WORLDS)
@pytest.mark.parametrize("branch", [1, 2])
def test_where_partial_or_zero(world: int, seed: int, branch: int) -> None:
    """where(C, P, 0) / where(C, 0, P) of a partial P by a replicated C, all-reduced."""
    rng = rng_for("where_zero", world, seed, branch)
    m, k = dim(rng), dim(rng)
    inputs: dict[str, In] = {"p": ([m, k], partial(), FLOAT), "c": ([m, k], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        cond = g.op("Less", x["c"], g.const(0.0))
        args = (x["p"], g.const(0.0)) if branch == 1 else (g.const(0.0), x["p"])
        y = g.op("Where", cond, *args)
        return g.output(y if r is None else g.coll("AllReduce", y, list(range(world)), reduce_op="sum"))

    case, y = build(f"where_zero-{branch}-{seed}", world, inputs, body)
    assert kinds(witness(case, seed, "partial_where_zero"), y) >= {"rep"}


def test_where_partial_or_one_is_refused() -> None:
    """where(C, P, 1): every rank's piece chooses 1, which the sum counts world times."""
    rng = rng_for("where_one", 0)
    m, k = dim(rng), dim(rng)
    inputs: dict[str, In] = {"p": ([m, k], partial(), FLOAT), "c": ([m, k], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = g.op("Where", g.op("Less", x["c"], g.const(0.0)), x["p"], g.const(1.0))
        return g.output(y if r is None else g.coll("AllReduce", y, [0, 1], reduce_op="sum"))

    case, y = build("where_one", 2, inputs, body)
    refused(case, 0, y, buggy=True)


# --- scatter-adds into zeros (routing.lp scatter_add_rows, scatter_add_partial) -------------

def embedding_grad(g: Graph, v: int, h: int, i: str, u: str, zero: float = 0.0, reduction: str = "add") -> str:
    """ScatterND of U's rows at I into a [v, h] constant (zeros: an embedding table's gradient)."""
    return g.op("ScatterND", g.const(np.full((v, h), zero)), i, u, reduction=reduction)


@pytest.mark.parametrize("world,seed", WORLDS)
def test_scatter_add_of_sliced_rows(world: int, seed: int) -> None:
    """Each rank scatters its tokens' rows into the whole table: a partial sum over the ranks.
    Token ids repeat (n > v), so rows of different ranks land on one id."""
    rng = rng_for("scatter_rows", world, seed)
    v, h = dim(rng, 2, 3), dim(rng)
    n = world * dim(rng, 2, 3)
    inputs: dict[str, In] = {"i": ([n, 1], ids(v, shard(0)), INT64), "u": ([n, h], shard(0), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = embedding_grad(g, v, h, x["i"], x["u"])
        return g.output(y if r is None else g.coll("AllReduce", y, list(range(world)), reduce_op="sum"))

    case, y = build(f"scatter_rows-{seed}", world, inputs, body)
    out = witness(case, seed, "scatter_add_rows")
    assert kinds(out, y) >= {"rep"}


@pytest.mark.parametrize("world,seed", WORLDS)
def test_scatter_add_of_a_partial(world: int, seed: int) -> None:
    """Replicated ids, a partial gradient: scatter-adding into zeros is linear in the updates."""
    rng = rng_for("scatter_partial", world, seed)
    v, h, n = dim(rng, 2, 3), dim(rng), dim(rng, 3, 6)
    inputs: dict[str, In] = {"i": ([n, 1], ids(v, rep()), INT64), "u": ([n, h], partial(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = embedding_grad(g, v, h, x["i"], x["u"])
        return g.output(y if r is None else g.coll("AllReduce", y, list(range(world)), reduce_op="sum"))

    case, y = build(f"scatter_partial-{seed}", world, inputs, body)
    assert kinds(witness(case, seed, "scatter_add_partial"), y) >= {"rep"}


def combine_rows(g: Graph, t: int, h: int, i: str, u: str, zero: float = 0.0) -> str:
    """ScatterElements(add) along axis 0 of U's rows at I (each index repeated along the row)
    into a [t, h] constant: an MoE combine adding each routed row back to its token."""
    return g.op("ScatterElements", g.const(np.full((t, h), zero)), i, u, axis=0, reduction="add")


@pytest.mark.parametrize("world,seed", WORLDS)
def test_scatter_elements_add_of_a_partial(world: int, seed: int) -> None:
    """Replicated token ids (repeating: a token routed to several experts), partial expert rows:
    ScatterElements(add) into zeros is linear in the updates, as ScatterND is."""
    rng = rng_for("scatter_elements_partial", world, seed)
    t, h = dim(rng, 2, 3), dim(rng)
    n = t * dim(rng, 2, 3)
    inputs: dict[str, In] = {"i": ([n, h], ids(t, rep()), INT64), "u": ([n, h], partial(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = combine_rows(g, t, h, x["i"], x["u"])
        return g.output(y if r is None else g.coll("AllReduce", y, list(range(world)), reduce_op="sum"))

    case, y = build(f"scatter_elements_partial-{seed}", world, inputs, body)
    assert kinds(witness(case, seed, "scatter_add_partial"), y) >= {"rep"}


def test_scatter_elements_add_into_ones_refused() -> None:
    """Into ones, every rank's partial carries the ones, summed world times: refused."""
    rng = rng_for("scatter_elements_ones", 2)
    t, h = dim(rng, 2, 3), dim(rng)
    n = t * 2
    inputs: dict[str, In] = {"i": ([n, h], ids(t, rep()), INT64), "u": ([n, h], partial(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = combine_rows(g, t, h, x["i"], x["u"], 1.0)
        return g.output(y if r is None else g.coll("AllReduce", y, [0, 1], reduce_op="sum"))

    case, y = build("scatter_elements_ones", 2, inputs, body)
    refused(case, 0, y, buggy=True)


@pytest.mark.parametrize("zero,reduction,buggy", [(1.0, "add", True), (0.0, "none", False)])
def test_scatter_of_sliced_rows_refused(zero: float, reduction: str, buggy: bool) -> None:
    """Into ones, every rank's table carries the ones, summed world times (wrong); without a
    reduction, duplicate ids overwrite each other in no defined order (not taken)."""
    rng = rng_for("scatter_rows_bad", int(zero))
    v, h, n = dim(rng, 2, 3), dim(rng), 2 * dim(rng, 2, 3)
    inputs: dict[str, In] = {"i": ([n, 1], ids(v, shard(0)), INT64), "u": ([n, h], shard(0), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = embedding_grad(g, v, h, x["i"], x["u"], zero, reduction)
        return g.output(y if r is None else g.coll("AllReduce", y, [0, 1], reduce_op="sum"))

    case, y = build(f"scatter_rows_bad-{reduction}", 2, inputs, body)
    refused(case, 0, y, buggy=buggy)


# --- pieces counted in different units (elementwise.lp partial_add_partial, the all-reduce) ---

def two_partials(g: Graph, x: dict, r: int | None, per: int, batch_first: bool = False) -> str:
    """A contraction over K = per * world split evenly (pieces of K) plus a sum over a batch of
    world rows, one per rank (pieces of world): one fraction per rank, two units (the finer one
    first, or second with `batch_first`)."""
    contraction = g.op("MatMul", x["a"], x["w"])
    batch_sum = g.op("ReduceSum", x["b"], g.ints([0]), keepdims=0)
    return g.op("Add", *((batch_sum, contraction) if batch_first else (contraction, batch_sum)))


@pytest.mark.parametrize("world,seed", WORLDS)
@pytest.mark.parametrize("batch_first", [False, True])
def test_pieces_of_one_fraction_in_two_units(world: int, seed: int, batch_first: bool) -> None:
    rng = rng_for("two_units", world, seed)
    m, n, per = dim(rng), dim(rng), dim(rng, 2, 3)
    inputs: dict[str, In] = {"a": ([m, per * world], shard(1), FLOAT), "w": ([per * world, n], shard(0), FLOAT),
                             "b": ([world, m, n], shard(0), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = two_partials(g, x, r, per, batch_first)
        return g.output(y if r is None else g.coll("AllReduce", y, list(range(world)), reduce_op="sum"))

    case, y = build(f"two_units-{batch_first}-{seed}", world, inputs, body)
    assert kinds(witness(case, seed, "partial_add_partial"), y) >= {"rep"}


def test_pieces_of_different_fractions_do_not_add() -> None:
    """Uneven contraction pieces (1 and 2 of 3) with even batch pieces (1 of 2 each): rank 0's
    summands are a third of one sum and half of the other, which no single piece describes. The
    all-reduce still adds up (a proof missed, not a bug), so only the relation is checked."""
    inputs: dict[str, In] = {"a": ([3, 3], shard(1, [1, 2]), FLOAT), "w": ([3, 4], shard(0, [1, 2]), FLOAT),
                             "b": ([2, 3, 4], shard(0), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = two_partials(g, x, r, 0)
        return g.output(y)

    case, y = build("lowest_terms_differ", 2, inputs, body)
    refused(case, 0, y, buggy=False)


# --- a rank summing its own pieces (elementwise.lp partial_add_adjacent, core.lp whole_piece) --

def contraction_in_two(g: Graph, x: dict, r: int | None, cuts: tuple[int, int, int, int]) -> str:
    """x @ w as the sequence computes it; a rank sums x[:, a:b] @ w[a:b] and x[:, c:d] @ w[c:d]
    (gradient accumulation: two micro-batches' contributions, added on the rank)."""
    if r is None:
        return g.op("MatMul", x["x"], x["w"])
    a, b, c, d = cuts

    def piece(lo: int, hi: int) -> str:
        xs = g.op("Slice", x["x"], g.ints([lo]), g.ints([hi]), g.ints([1]))
        ws = g.op("Slice", x["w"], g.ints([lo]), g.ints([hi]), g.ints([0]))
        return g.op("MatMul", xs, ws)

    return g.op("Add", piece(a, b), piece(c, d))


@pytest.mark.parametrize("world,seed", WORLDS)
def test_rank_adds_adjacent_pieces(world: int, seed: int) -> None:
    """Rank r's share [2pr, 2p(r+1)) of the contraction, summed as two halves, all-reduced."""
    rng = rng_for("adjacent", world, seed)
    m, n, p = dim(rng), dim(rng), dim(rng, 1, 3)
    k = 2 * p * world
    inputs: dict[str, In] = {"x": ([m, k], rep(), FLOAT), "w": ([k, n], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            return g.output(contraction_in_two(g, x, r, (0, 0, 0, 0)))
        lo = 2 * p * r
        y = contraction_in_two(g, x, r, (lo, lo + p, lo + p, lo + 2 * p))
        return g.output(g.coll("AllReduce", y, list(range(world)), reduce_op="sum"))

    case, y = build(f"adjacent-{seed}", world, inputs, body)
    assert kinds(witness(case, seed, "partial_add_adjacent"), y) >= {"rep"}


@pytest.mark.parametrize("seed", [0, 1])
def test_one_rank_sums_every_piece(seed: int) -> None:
    """World size 1: the two halves span the whole contraction, which is the product itself."""
    rng = rng_for("whole", seed)
    m, n, k = dim(rng), dim(rng), dim(rng, 3, 6)
    cut = int(rng.integers(1, k))
    inputs: dict[str, In] = {"x": ([m, k], rep(), FLOAT), "w": ([k, n], rep(), FLOAT)}
    case, y = build(f"whole-{seed}", 1, inputs,
                    lambda g, x, r: g.output(contraction_in_two(g, x, r, (0, cut, cut, k))))
    out = witness(case, seed, "whole_piece")
    assert "partial_add_adjacent" in out.checked.lemmas_checked


@pytest.mark.parametrize("cuts", [(0, 2, 0, 2), (0, 2, 1, 4), (0, 1, 2, 4)], ids=["same", "overlap", "gap"])
def test_pieces_that_do_not_meet_are_refused(cuts: tuple[int, int, int, int]) -> None:
    """The same piece twice, overlapping pieces, or a gap between them: not the product."""
    inputs: dict[str, In] = {"x": ([3, 4], rep(), FLOAT), "w": ([4, 2], rep(), FLOAT)}
    case, y = build(f"not_adjacent-{cuts}", 1, inputs,
                    lambda g, x, r: g.output(contraction_in_two(g, x, r, cuts)))
    sim = simulate(case, 0)
    total = case.ranks[0].outputs[0]
    assert not np.allclose(sim.ranks[0][total], sim.seq[y], atol=1e-5)
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    assert not [lay for t, lay in out.relations_of(y) if t == f"r0:{total}"]  # (the pieces themselves do relate)


# --- pieces name their decomposition (soundness) -------------------------------------------

@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax"])
def test_pieces_of_two_axes_do_not_add(op: str) -> None:
    """A reduction over axes 0 and 1: rank 0 reduces row 0 (a slice of axis 0), rank 1 column 1
    (a slice of axis 1). Each is a piece of a decomposition of the total, [0:1) and [1:2) of 2,
    but of two different ones: together they count x[0, 1] twice and miss x[1, 0]."""
    inputs: dict[str, In] = {"x": ([2, 2], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            return g.output(g.op(op, x["x"], g.ints([0, 1]), keepdims=0))
        piece = g.op("Slice", x["x"], g.ints([r]), g.ints([r + 1]), g.ints([r]))  # row 0, column 1
        reduced = g.op(op, piece, g.ints([0, 1]), keepdims=0)
        return g.output(g.coll("AllReduce", reduced, [0, 1], reduce_op="sum" if op == "ReduceSum" else "max"))

    case, y = build(f"two_axes_{op}", 2, inputs, body)
    sim = simulate(case, 0)
    assert not np.allclose(sim.ranks[0][case.ranks[0].outputs[0]], sim.seq[y])
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"


# --- sums over rows sliced along the sequence (reduce.lp reduce_sum_blocks) -------------------
# A context-parallel rank holds tokens [X, Y) of every sequence; its [batch, seq/N, ...] tensors
# flattened into rows hold the inner indices [X, Y) of every block of seq rows (blk), and a loss
# sums over those rows.

def seq_rows(g: Graph, x: str, shape: list[int]) -> str:
    """x [b, s, v] (a rank: [b, s_k, v]) flattened into rows [b*s, v], through an odd function
    (asymmetric values)."""
    return g.op("Reshape", g.op("Tanh", x), g.ints([-1, shape[2]]))


@pytest.mark.parametrize("world,seed", WORLDS)
@pytest.mark.parametrize("uneven", [False, True])
def test_sum_over_rows_sliced_along_the_sequence(world: int, seed: int, uneven: bool) -> None:
    """sum over the rows of reshape(x [b, s, v], [b*s, v]) with x sliced along the sequence: each
    rank's sum is a piece of the total (pieces [Xk, Yk) of s, style blocks), all-reduced: the
    token-loss sum of a CP rank. Also with the rows' axis kept, and over every axis of the rows
    (1-D: a per-token loss flattened)."""
    rng = rng_for("sum_seq_rows", world, seed, uneven)
    b, v = dim(rng, 2, 3), dim(rng, 2, 4)
    sizes = [dim(rng, 1, 3) for _ in range(world)] if uneven else None
    s = sum(sizes) if sizes else world * dim(rng, 1, 2)
    inputs: dict[str, In] = {"x": ([b, s, v], shard(1, sizes), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> list[str]:
        rows_ = seq_rows(g, x["x"], [b, s, v])
        sums = [g.op("ReduceSum", rows_, g.ints([0]), keepdims=int(seed % 2)),
                g.op("ReduceSum", g.op("Reshape", rows_, g.ints([-1])), keepdims=0)]
        if r is not None:
            sums = [g.coll("AllReduce", t, list(range(world)), reduce_op="sum") for t in sums]
        return [g.output(t) for t in sums]

    case, ys = build(f"sum_seq_rows-{seed}-{uneven}", world, inputs, body)
    out = witness(case, seed, "reduce_sum_blocks")
    for y in ys:
        assert kinds(out, y) >= {"rep"}


@pytest.mark.parametrize("world,seed", WORLDS)
def test_token_loss_over_sequence_slices(world: int, seed: int) -> None:
    """The CP loss's shape: log-softmax of sequence-sliced logits flattened into rows, each row's
    label picked (GatherElements along the vocabulary of rows held as blocks: pick_sliced), summed
    over the rows and all-reduced."""
    rng = rng_for("seq_token_loss", world, seed)
    b, v, s = dim(rng, 2, 3), dim(rng, 3, 5), world * dim(rng, 1, 2)
    inputs: dict[str, In] = {"l": ([b, s, v], shard(1), FLOAT), "i": ([b, s], ids(v, shard(1)), INT64)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        logp = g.op("LogSoftmax", seq_rows(g, x["l"], [b, s, v]), axis=1)
        picked = g.op("GatherElements", logp, g.op("Reshape", x["i"], g.ints([-1, 1])), axis=1)
        total = g.op("ReduceSum", g.op("Reshape", picked, g.ints([-1])), keepdims=0)  # (squeezed, as torch's)
        return g.output(total if r is None else g.coll("AllReduce", total, list(range(world)), reduce_op="sum"))

    case, y = build(f"seq_token_loss-{seed}", world, inputs, body)
    out = witness(case, seed, "reduce_sum_blocks")
    assert "pick_sliced" in out.checked.lemmas_checked
    assert "rep" in kinds(out, y)  # (and the ranks' sums before the all-reduce: psum pieces)


def test_rows_of_the_wrong_sequence_slice_are_refused() -> None:
    """Every rank sums the rows of the FIRST sequence slice (rank 0's tokens) of a replicated x:
    right on rank 0, the all-reduced sum counts rank 0's tokens twice and misses rank 1's."""
    rng = rng_for("sum_seq_rows_wrong", 0)
    b, v, s = 2, dim(rng, 2, 4), 4
    inputs: dict[str, In] = {"x": ([b, s, v], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        data = x["x"] if r is None else g.op("Slice", x["x"], g.ints([0]), g.ints([s // 2]), g.ints([1]))
        total = g.op("ReduceSum", seq_rows(g, data, [b, s, v]), g.ints([0]), keepdims=0)
        return g.output(total if r is None else g.coll("AllReduce", total, [0, 1], reduce_op="sum"))

    case, y = build("sum_seq_rows_wrong", 2, inputs, body)
    sim = simulate(case, 0)
    assert not np.allclose(sim.ranks[0][case.ranks[0].outputs[0]], sim.seq[y])
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations  # (each rank's sum is piece [0:2) of 4: the same piece twice)
    assert out.report.verdict != "verified"
    assert {lay[1:3] for _, lay in out.relations_of(y)} == {(0, 2)}
    assert not [t for t, _ in out.relations_of(y) if t in {f"r{r}:{g.outputs[0]}" for r, g in enumerate(case.ranks)}]


def test_blocks_of_two_axes_do_not_add() -> None:
    """A sum over both axes of y = reshape(x [a, 2, c, 2], [2a, 2c]): rank 0 holds the blocks of
    inner index 0 along y's axis 0 (x[:, 0:1]), rank 1 those of inner index 1 along axis 1
    (x[..., 1:2]). Pieces [0:1) and [1:2) of 2 blocks, but of two decompositions: together they
    count x[:, 0, :, 1] twice and miss x[:, 1, :, 0]. reduce_sum_blocks takes one axis only."""
    a, c = 2, 3
    inputs: dict[str, In] = {"x": ([a, 2, c, 2], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        t = g.op("Tanh", x["x"])
        if r is None:
            return g.output(g.op("ReduceSum", g.op("Reshape", t, g.ints([2 * a, 2 * c])), g.ints([0, 1]), keepdims=0))
        axis = 1 if r == 0 else 3
        piece = g.op("Slice", t, g.ints([r]), g.ints([r + 1]), g.ints([axis]))
        rows_ = g.op("Reshape", piece, g.ints([a, 2 * c]) if r == 0 else g.ints([2 * a, c]))
        return g.output(g.coll("AllReduce", g.op("ReduceSum", rows_, g.ints([0, 1]), keepdims=0), [0, 1],
                               reduce_op="sum"))

    case, y = build("blocks_two_axes", 2, inputs, body)
    sim = simulate(case, 0)
    assert not np.allclose(sim.ranks[0][case.ranks[0].outputs[0]], sim.seq[y])
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    assert "reduce_sum_blocks" not in out.lemmas_fired()


# --- the backward of a transposed all-gather (collectives.lp reduce_scatter_transposed) -------
# CP ranks gather K and V along the sequence as `all_gather(k.movedim(2, 0), 0).movedim(0, 2)`;
# its backward reduce-scatters each rank's partial gradient of the gathered keys the same way:
# `reduce_scatter(g.movedim(2, 0), 0).movedim(0, 2)`.

def moved_to_front(axis: int, ndim: int) -> list[int]:
    """The perm of x.movedim(axis, 0)."""
    return [axis, *(a for a in range(ndim) if a != axis)]


def inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for j, p in enumerate(perm):
        inv[p] = j
    return inv


def transposed_reduce_scatter(g: Graph, x: str, world: int, perm: list[int], back: list[int], *, identity: bool = False,
                              op: str = "sum") -> str:
    moved = g.op("Transpose", x, perm=perm)
    if identity:
        moved = g.op("Identity", moved)
    chunk = g.coll("ReduceScatter", moved, list(range(world)), axis=0, reduce_op=op)
    if identity:
        chunk = g.op("Identity", chunk)
    return g.op("Transpose", chunk, perm=back)


@pytest.mark.parametrize("world,seed", WORLDS)
def test_reduce_scatter_between_transposes(world: int, seed: int) -> None:
    """Partial sums (declared, and made by a ReduceSum over a sharded axis) moved to the front
    along axis B, reduce-scattered along 0 and moved back: member j holds chunk j of the sum along
    B (then through an odd function: asymmetric values)."""
    rng = rng_for("rs_transposed", world, seed)
    ndim = 3 + seed % 2
    b_axis = int(rng.integers(ndim))
    shape = [dim(rng, 1, 3) for _ in range(ndim)]
    shape[b_axis] = world * dim(rng, 1, 2)
    k = world * dim(rng, 1, 2)
    inputs: dict[str, In] = {"p": (shape, partial(), FLOAT), "x": ([*shape, k], shard(ndim), FLOAT)}
    perm = moved_to_front(b_axis, ndim)

    def body(g: Graph, x: dict, r: int | None) -> list[str]:
        s = g.op("ReduceSum", x["x"], g.ints([ndim]), keepdims=0)
        if r is None:
            return [g.output(g.op("Tanh", x["p"])), g.output(g.op("Tanh", s))]
        return [g.output(g.op("Tanh", transposed_reduce_scatter(g, t, world, perm, inverse(perm), identity=seed > 0)))
                for t in (x["p"], s)]

    case, ys = build(f"rs_transposed-{seed}", world, inputs, body)
    out = witness(case, seed, "reduce_scatter_transposed")
    c = shape[b_axis] // world
    for y in ys:
        held = {lay for t, lay in out.relations_of(y) if t.split(":")[0] != "seq"}
        assert {("sl", b_axis, r * c, (r + 1) * c) for r in range(world)} <= held, held


def refused_transposed_rs(name: str, world: int, perm_of_rank, back: list[int], op: str = "sum") -> None:
    """p [n, n, world*n] a declared partial; each rank transposes it by perm_of_rank(r),
    reduce-scatters along 0 with `op` and transposes by `back`: a bug, and nothing relates the
    ranks' results to the sum (square side axes: every axis order is a valid shape)."""
    n = dim(rng_for(name, world), 2, 3)
    inputs: dict[str, In] = {"p": ([n, n, world * n], partial(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            return g.output(g.op("Tanh", x["p"]))
        return g.output(g.op("Tanh", transposed_reduce_scatter(g, x["p"], world, perm_of_rank(r), back, op=op)))

    case, y = build(name, world, inputs, body)
    sim = simulate(case, 0)
    c = n
    want = sim.seq[y]
    got = [sim.ranks[r][g.outputs[0]] for r, g in enumerate(case.ranks)]
    assert not all(v.shape == want[..., r * c:(r + 1) * c].shape and np.allclose(v, want[..., r * c:(r + 1) * c], atol=1e-5)
                   for r, v in enumerate(got)), "not buggy"
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    results = {f"r{r}:{g.outputs[0]}" for r, g in enumerate(case.ranks)}
    assert not [t for t, _ in out.relations_of(y) if t in results]
    assert "reduce_scatter_transposed" not in out.lemmas_fired()


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_between_transposes_that_do_not_undo_each_other_is_refused(world: int) -> None:
    """Moved back by the same perm again (not its inverse): the result's axes are in the wrong order."""
    perm = moved_to_front(2, 3)  # [2, 0, 1]
    refused_transposed_rs(f"neg_rs_not_undone-{world}", world, lambda r: perm, perm)


def test_reduce_scatter_between_transposes_with_different_perms_is_refused() -> None:
    """Member 0 moves axis 2 to the front as [2, 0, 1], member 1 as [2, 1, 0]: the summed pieces
    are not one transpose of the sum."""
    refused_transposed_rs("neg_rs_mixed", 2, lambda r: [2, 0, 1] if r == 0 else [2, 1, 0], inverse([2, 0, 1]))


def test_reduce_scatter_between_transposes_with_avg_is_refused() -> None:
    """Reduce-scattered with avg: each chunk is 1/K of the sum's."""
    perm = moved_to_front(2, 3)
    refused_transposed_rs("neg_rs_avg", 2, lambda r: perm, inverse(perm), op="avg")
