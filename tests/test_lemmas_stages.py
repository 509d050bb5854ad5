"""Numeric witnesses for rules/stages.lp: a sequential Add whose two terms are computed on two
different ranks and summed by an all-reduce over just those two (a pipeline's tied embedding:
the first stage's lookup gradient plus the last stage's LM head gradient, all-reduced over the
embedding group {first, last}; exporters/strategies/pipeline_train.py).

Each witness runs under random shapes, world sizes 2..4 and both orders (of the Add's inputs,
and of the terms in the group), with the two ranks adjacent or not; it asserts that `add_terms`
fired, that everything derived held in the multi-rank simulator, and the verdict. Each negative
is a program whose numbers differ and which must not verify: one term held twice, a third
member adding its term again, Sub where the ranks add, a term broadcast into the sum.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import Case, Graph, rep, run_case, simulate
from test_lemmas_backward import dim, rng_for, witness

FLOAT = TensorProto.FLOAT


def terms(g: Graph, x: str, w: str) -> tuple[str, str]:
    """Two different terms of x (asymmetric values): tanh(x @ w) and x * sigmoid(x)."""
    return g.op("Tanh", g.op("MatMul", x, w)), g.op("Mul", x, g.op("Sigmoid", x))


def build(name: str, world: int, pair: tuple[int, int], seq_order: int, rank_terms: dict[int, int],
          n: int, h: int, seq_op: str = "Add") -> tuple[Case, str]:
    """Seq: y = seq_op(term seq_order, term 1 - seq_order). Rank r in `rank_terms` computes its
    term (0 or 1) and all-reduces it with sum over `group` (the ranks of rank_terms, in order);
    the other ranks compute nothing."""
    seq = Graph()
    x, w = seq.input("x", [n, h], FLOAT), seq.input("w", [h, h], FLOAT)
    t = terms(seq, x, w)
    y = seq.output(seq.op(seq_op, t[seq_order], t[1 - seq_order]))
    group = sorted(rank_terms)
    ranks = []
    for r in range(world):
        g = Graph()
        xr, wr = g.input("x", [n, h], FLOAT), g.input("w", [h, h], FLOAT)
        if r in rank_terms:
            g.output(g.coll("AllReduce", terms(g, xr, wr)[rank_terms[r]], group, reduce_op="sum"))
        ranks.append(g)
    return Case(name, seq, ranks, {"x": rep(), "w": rep()}), y


PAIRS = [(2, (0, 1), 0), (3, (0, 2), 1), (4, (1, 3), 2), (4, (0, 3), 0), (3, (1, 2), 1)]


@pytest.mark.parametrize("world,pair,seed", PAIRS)
@pytest.mark.parametrize("seq_order", [0, 1])
@pytest.mark.parametrize("first_holds", [0, 1])
def test_terms_on_two_ranks_all_reduced(world: int, pair: tuple[int, int], seed: int, seq_order: int,
                                        first_holds: int) -> None:
    """seq y = X_I + X_(1-I); rank a holds one term, rank b the other, AllReduce(sum) over [a, b]:
    y = r_a:out = r_b:out (replicated on a and b), whichever term the first member holds and in
    whichever order the sequential Add takes them."""
    rng = rng_for("add_terms", world, seed, seq_order, first_holds)
    n, h = dim(rng), dim(rng)
    a, b = pair
    case, y = build(f"add_terms-{world}-{seed}", world, pair, seq_order, {a: first_holds, b: 1 - first_holds}, n, h)
    out = witness(case, seed, "add_terms")
    holders = {t.split(":")[0] for t, lay in out.relations_of(y) if lay == "rep"}
    assert {f"r{a}", f"r{b}"} <= holders, out.relations_of(y)


def not_verified(case: Case, y: str, seed: int) -> None:
    """The numbers differ (no member's all-reduced output is y), whatever was derived holds, and
    the case does not verify."""
    sim = simulate(case, seed)
    want = sim.seq[case.seq.outputs[0]]
    got = [sim.ranks[r][g.outputs[0]] for r, g in enumerate(case.ranks) if g.outputs]
    assert got and not any(np.allclose(v, want, atol=1e-5) for v in got), "not buggy"
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified", out.report.verdict
    assert not [t for t, lay in out.relations_of(y) if lay == "rep"], out.relations_of(y)


@pytest.mark.parametrize("held", [0, 1])
def test_one_term_twice_is_refused(held: int) -> None:
    """Both ranks hold the same term (the other term is nobody's): 2 X_I is not X_0 + X_1."""
    rng = rng_for("add_terms_twice", held)
    case, y = build("add_terms_twice", 2, (0, 1), 0, {0: held, 1: held}, dim(rng), dim(rng))
    not_verified(case, y, 0)


def test_a_third_member_adding_a_term_again_is_refused() -> None:
    """A group of three: ranks 0 and 2 hold the two terms, rank 1 the first again (its sum counts
    it twice)."""
    rng = rng_for("add_terms_third", 0)
    case, y = build("add_terms_third", 3, (0, 2), 0, {0: 0, 1: 0, 2: 1}, dim(rng), dim(rng))
    not_verified(case, y, 1)


def test_sub_is_not_a_sum_of_its_terms() -> None:
    """seq y = X_0 - X_1, the ranks add X_0 and X_1: not y."""
    rng = rng_for("add_terms_sub", 0)
    case, y = build("add_terms_sub", 2, (0, 1), 0, {0: 0, 1: 1}, dim(rng), dim(rng), seq_op="Sub")
    not_verified(case, y, 2)


def test_a_broadcast_term_is_not_a_piece() -> None:
    """seq y = X [n, h] + b [h] (b broadcast over the rows); rank 0 holds X, rank 1 holds b
    expanded to [1, h] and padded with zero rows: the all-reduce gives X plus b in the first row
    only, not y. Nothing relates b's replica to y as a piece (it does not have y's shape)."""
    rng = rng_for("add_terms_broadcast", 0)
    n, h = dim(rng, 3, 5), dim(rng)
    seq = Graph()
    x, bias = seq.input("x", [n, h], FLOAT), seq.input("b", [h], FLOAT)
    y = seq.output(seq.op("Add", seq.op("Tanh", x), bias))
    ranks = []
    for r in range(2):
        g = Graph()
        xr, br = g.input("x", [n, h], FLOAT), g.input("b", [h], FLOAT)
        term = g.op("Tanh", xr) if r == 0 else g.op("Pad", g.op("Unsqueeze", br, g.ints([0])),
                                                     g.ints([0, 0, n - 1, 0]), mode="constant")
        g.output(g.coll("AllReduce", term, [0, 1], reduce_op="sum"))
        ranks.append(g)
    case = Case("add_terms_broadcast", seq, ranks, {"x": rep(), "b": rep()})
    not_verified(case, y, 0)


# --- pieces of the terms (add_term_pieces): a data-parallel row inside each stage ----------

def build_rows(name: str, rows: int, tp: int, seq_order: int, stage_terms: tuple[int, int], m: int, h: int,
               pair_op: str = "sum", seq_op: str = "Add") -> tuple[Case, str]:
    """Seq: y = seq_op(X_order, X_(1-order)) with X_0 = x^T u and X_1 = tanh(x)^T sigmoid(u), both
    contractions over n = rows * m rows. Rank (d, s, t) of a rows x 2 x tp mesh takes row block
    d of x and u, computes its stage's term stage_terms[s] there (a summand of that term's
    contraction; its column block t when tp > 1), all-reduces it with pair_op over
    its pair [(d, 0, t), (d, 1, t)], then with sum over its data-parallel group
    [(k, s, t) for every k]: y on every rank (its column block t)."""
    n = rows * m
    seq = Graph()
    x, u = seq.input("x", [n, h], FLOAT), seq.input("u", [n, h], FLOAT)
    y = seq.output(seq.op(seq_op, *rows_terms(seq, x, u, (seq_order, 1 - seq_order))))
    rank_of = {(d, s, t): (d * 2 + s) * tp + t for d in range(rows) for s in range(2) for t in range(tp)}
    ranks = []
    for (d, s, t), r in sorted(rank_of.items(), key=lambda item: item[1]):
        g = Graph()
        xr, ur = g.input("x", [n, h], FLOAT), g.input("u", [n, h], FLOAT)
        xr = g.op("Slice", xr, g.ints([d * m]), g.ints([(d + 1) * m]), g.ints([0]))
        ur = g.op("Slice", ur, g.ints([d * m]), g.ints([(d + 1) * m]), g.ints([0]))
        term = rows_terms(g, xr, ur, (stage_terms[s],))[0]
        if tp > 1:
            term = g.op("Slice", term, g.ints([t * h // tp]), g.ints([(t + 1) * h // tp]), g.ints([1]))
        paired = g.coll("AllReduce", term, [rank_of[(d, 0, t)], rank_of[(d, 1, t)]], reduce_op=pair_op)
        g.output(g.coll("AllReduce", paired, [rank_of[(k, s, t)] for k in range(rows)], reduce_op="sum"))
        ranks.append(g)
    return Case(name, seq, ranks, {"x": rep(), "u": rep()}), y


def rows_terms(g: Graph, x: str, u: str, which: tuple[int, ...]) -> list[str]:
    """The terms `which` of (x^T u, tanh(x)^T sigmoid(u))."""
    made = {0: lambda: g.op("MatMul", g.op("Transpose", x, perm=[1, 0]), u),
            1: lambda: g.op("MatMul", g.op("Transpose", g.op("Tanh", x), perm=[1, 0]), g.op("Sigmoid", u))}
    return [made[k]() for k in which]


@pytest.mark.parametrize("rows,tp,seed", [(2, 1, 0), (3, 1, 1), (2, 2, 2)])
@pytest.mark.parametrize("seq_order", [0, 1])
@pytest.mark.parametrize("first_stage_term", [0, 1])
def test_pieces_of_terms_on_two_stages_all_reduced(rows: int, tp: int, seed: int, seq_order: int,
                                                   first_stage_term: int) -> None:
    """A tied weight's gradient with data parallelism inside the stages: each stage rank holds
    its row's summand of its term, the pair all-reduce adds the two terms' summands of one row
    (add_term_pieces), the data-parallel all-reduce adds the rows: y on every rank (its column
    block of y under tp 2, a slice of the pieces)."""
    rng = rng_for("add_term_pieces", rows, tp, seed, seq_order, first_stage_term)
    m, h = dim(rng), 2 * dim(rng, 1, 3)
    case, y = build_rows(f"add_term_pieces-{rows}-{tp}-{seed}", rows, tp, seq_order,
                         (first_stage_term, 1 - first_stage_term), m, h)
    out = witness(case, seed, "add_term_pieces")
    holders = {t.split(":")[0] for t, lay in out.relations_of(y) if lay == "rep" or lay[0] == "sl"}
    assert holders == {f"r{r}" for r in range(len(case.ranks))}, out.relations_of(y)


@pytest.mark.parametrize("variant", ["one_term_twice", "pair_averaged", "sub"])
def test_pieces_of_terms_refused(variant: str) -> None:
    """Twins whose numbers differ: both stages hold the same term's summands (2 X_0 is not
    X_0 + X_1); the pair all-reduce averages (the terms' half-sum); the sequential step
    subtracts the terms the ranks add."""
    rng = rng_for("add_term_pieces_refused", len(variant))
    m, h = dim(rng), dim(rng)
    stage_terms = (0, 0) if variant == "one_term_twice" else (0, 1)
    case, y = build_rows(f"add_term_pieces-{variant}", 2, 1, 0, stage_terms, m, h,
                         pair_op="avg" if variant == "pair_averaged" else "sum",
                         seq_op="Sub" if variant == "sub" else "Add")
    not_verified(case, y, 3)
