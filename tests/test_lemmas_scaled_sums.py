"""Numeric witnesses for the lemmas of scales and sums written the way frameworks write them
(issue 38): a constant factor on one side only (`seq_scale`, elementwise.lp), equally scaled
operands added (`scaled_additive`), a sum of a scaled replica (`reduce_scaled`, reduce.lp),
scaled partial sums all-reduced with sum or avg (`allreduce_sum_scaled`, `allreduce_avg_scaled`,
collectives.lp, and rank_scale's clause on partial-sum pieces), a count all-reduced and divided
by (kval through AllReduce, rank_scale's clause on a Div by a known count), one row of a stacked
weight picked by a constant index on the rank that owns it (`gather_owned_row`, shape.lp), and
a chain of Adds summing terms (`chain_terms`: each rank sums the experts it holds), and the
gradient of a stacked expert weight, each expert's row written into zeros at its row
(`onehot_rows`, experts.lp) and the other experts' rows, zero on the rank's, added
(`add_zero_rows`).

The end-to-end shape each witness checks is the spelling it stands for: DDP's local mean loss
averaged over ranks, a mean written as a sum over a count, the loss over the all-reduced
number of samples, a per-expert loop over a stacked expert weight.

Refused twins (a real numeric difference, no relation of the wrong kind for the sequential
tensor, not verified): a rank scale that does not cancel the sequential one, a chain missing a
term or holding one twice, the global expert index used as the local row, the next local row,
and a count not all-reduced.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import rep, shard, world_seed_grid
from test_lemmas_structure import In, everyone, kind, make_case, refused, rng_for, size, witness

grid = pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1, 2)))


def fraction(rng: np.random.Generator) -> tuple[int, int]:
    """A random scale p/q < 1 (what a constant like 0.125 or 2/3 snaps to)."""
    p = int(rng.integers(1, 4))
    return p, p + int(rng.integers(1, 6))


@grid
def test_scale_on_one_side_cancels(world: int, seed: int) -> None:
    """y = (x + w) * (p/q) sequentially; each rank divides its shards by q/p before the sum and
    gathers (or does so on replicas): the rank's scale (rank_scale, carried by scaled_additive)
    meets the sequential one at another node and cancels it (seq_scale) -- a mean written as a
    sum times 1/n on one side and as a sum of terms over n on the other. (Where both sides scale
    the same tensor by the same factor, the two nodes simply pair: no scaled relation is made.)"""
    rng = rng_for("seq_scale", world, seed)
    p, q = fraction(rng)
    a, b = world * size(rng, 1, 3), size(rng)
    inputs = {"x": In([a, b], shard(0)), "w": In([a, b], shard(0)), "r": In([a, b], rep()), "v": In([a, b], rep())}

    def body(g, x, r):
        if r is None:
            g.output(g.op("Mul", g.op("Add", x["x"], x["w"]), g.const(np.float32(p / q))))
            g.output(g.op("Div", g.op("Add", x["r"], x["v"]), g.const(np.float32(q / p))))
            return
        scaled = g.op("Add", g.op("Div", x["x"], g.const(np.float32(q / p))), g.op("Div", x["w"], g.const(np.float32(q / p))))
        g.output(g.coll("AllGather", scaled, everyone(world), axis=0))
        g.output(g.op("Add", g.op("Mul", g.const(np.float32(p / q)), x["r"]), g.op("Mul", x["v"], g.const(np.float32(p / q)))))

    case, _, _ = make_case("seq_scale", world, inputs, body)
    witness(case, seed, "rank_scale:scaled", "scaled_additive:scaled", "seq_scale")


@grid
def test_scale_that_does_not_cancel_is_refused(world: int, seed: int) -> None:
    """The sequential factor p/q against a rank factor p/(q+1) (a count off by one)."""
    rng = rng_for("seq_scale_refused", world, seed)
    p, q = fraction(rng)
    a, b = world * size(rng, 1, 3), size(rng)
    inputs = {"x": In([a, b], shard(0))}

    def body(g, x, r):
        if r is None:
            y = g.op("Mul", x["x"], g.const(np.float32(p / q)))
            return y, g.output(y)
        y = g.coll("AllGather", g.op("Mul", x["x"], g.const(np.float32(p / (q + 1)))), everyone(world), axis=0)
        return y, g.output(y)

    case, (s, out), ranks = make_case("seq_scale_refused", world, inputs, body)
    refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) != "scaled")


@grid
def test_sum_of_scaled_operands_and_of_a_scaled_replica(world: int, seed: int) -> None:
    """c a + c b = c (a + b), c a - c b = c (a - b), and sum(c a) = c sum(a): each rank scales
    its replicas first (a loss term by term), the sequential program after."""
    rng = rng_for("scaled_additive", world, seed)
    p, q = fraction(rng)
    a, b = size(rng), size(rng)
    inputs = {"u": In([a, b], rep()), "v": In([a, b], rep())}

    def body(g, x, r):
        c = g.const(np.float32(p / q))
        if r is None:
            for op in ("Add", "Sub"):
                g.output(g.op("Mul", g.op(op, x["u"], x["v"]), c))
            g.output(g.op("Mul", g.op("ReduceSum", x["u"], g.ints([1]), keepdims=0), c))
            return
        cu, cv = g.op("Mul", x["u"], c), g.op("Mul", x["v"], c)
        g.output(g.op("Add", cu, cv))
        g.output(g.op("Sub", cu, cv))
        g.output(g.op("ReduceSum", cu, g.ints([1]), keepdims=0))

    case, _, _ = make_case("scaled_additive", world, inputs, body)
    witness(case, seed, "scaled_additive:scaled", "reduce_scaled", "seq_scale", "unit_scale")


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@grid
def test_local_mean_all_reduced(world: int, seed: int, reduce_op: str) -> None:
    """DDP's loss: each rank's mean over its own rows (an equal share), all-reduced with avg; or
    each rank's sum over the global count n, all-reduced with sum. The sequential program takes
    the mean over every row."""
    rng = rng_for(f"local_mean_{reduce_op}", world, seed)
    rows, b = world * size(rng, 1, 3), size(rng)
    inputs = {"x": In([rows, b], shard(0))}

    def body(g, x, r):
        if r is None:
            g.output(g.op("ReduceMean", x["x"], g.ints([0]), keepdims=0))
            return
        if reduce_op == "avg":
            g.output(g.coll("AllReduce", g.op("ReduceMean", x["x"], g.ints([0]), keepdims=0), everyone(world),
                            reduce_op="avg"))
        else:
            local = g.op("ReduceSum", x["x"], g.ints([0]), keepdims=0)
            g.output(g.coll("AllReduce", g.op("Div", local, g.const(np.float32(rows))), everyone(world)))

    case, _, _ = make_case(f"local_mean_{reduce_op}", world, inputs, body)
    if reduce_op == "avg":  # (the rank's mean over rows/K against the sequential one over rows)
        witness(case, seed, "rank_scale:scaled", "allreduce_avg_scaled:scaled", "seq_scale", "unit_scale")
    else:  # (both sides scale their sums by 1/rows: the two scales pair, the rank's is a piece)
        witness(case, seed, "partial_mul_rep:psum", "allreduce_sum:rep")


@pytest.mark.parametrize("variant", ["count_all_reduced", "count_local"])
@grid
def test_sum_over_an_all_reduced_count(world: int, seed: int, variant: str) -> None:
    """HF's loss over `num_items_in_batch`: each rank sums its rows and divides by the count of
    rows all-reduced over the ranks (each rank's own count, a constant). Its twin divides by
    the rank's own count: every rank's share is K times too large."""
    rng = rng_for(f"count_{variant}", world, seed)
    share, b = size(rng, 1, 3), size(rng)
    inputs = {"x": In([world * share, b], shard(0))}

    def body(g, x, r):
        if r is None:
            y = g.op("ReduceMean", x["x"], g.ints([0]), keepdims=0)
            return y, g.output(y)
        count = g.const(np.int64(share), np.int64)
        if variant == "count_all_reduced":
            count = g.coll("AllReduce", count, everyone(world))
        local = g.op("ReduceSum", x["x"], g.ints([0]), keepdims=0)
        y = g.coll("AllReduce", g.op("Div", local, g.op("Cast", count, to=1)), everyone(world))
        return y, g.output(y)

    case, (s, out), ranks = make_case(f"count_{variant}", world, inputs, body)
    if variant == "count_all_reduced":
        witness(case, seed, "rank_scale:scaled", "allreduce_sum_scaled:scaled", "seq_scale", "unit_scale")
    else:
        refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) == "rep")


def _experts_case(name: str, world: int, seed: int, pick=lambda e, lo, per: e - lo, terms=lambda lo, hi: range(lo, hi)):
    """A stacked expert weight w [E, a, b], experts split over the ranks (rows [lo, hi) of axis 0);
    the sequential program sums relu(x * w[e]) over every expert e in a loop (a chain of Adds
    started at zero), each rank over the experts it holds, picking local row `pick(e, lo)`, then
    an all-reduce."""
    rng = rng_for(name, world, seed)
    per, a, b = size(rng, 2, 3), size(rng), size(rng)
    experts = world * per
    inputs = {"w": In([experts, a, b], shard(0)), "x": In([a, b], rep())}

    def term(g, x, row: int) -> str:
        return g.op("Relu", g.op("Mul", x["x"], g.op("Gather", x["w"], g.const(np.int64(row), np.int64), axis=0)))

    def body(g, x, r):
        total = g.const(np.float32(0.0))
        if r is None:
            for e in range(experts):
                total = g.op("Add", total, term(g, x, e))
            return total, g.output(total)
        lo, hi = r * per, (r + 1) * per
        for e in terms(lo, hi):
            total = g.op("Add", total, term(g, x, pick(e, lo, per)))
        y = g.coll("AllReduce", total, everyone(world))
        return y, g.output(y)

    return make_case(name, world, inputs, body)


@grid
def test_experts_summed_in_a_loop(world: int, seed: int) -> None:
    case, _, _ = _experts_case("experts_loop", world, seed)
    witness(case, seed, "gather_owned_row", "chain_terms", "allreduce_sum")


@pytest.mark.parametrize("variant", ["global_row", "term_missing", "term_twice"])
@grid
def test_experts_loop_twins_are_refused(world: int, seed: int, variant: str) -> None:
    """The global expert index used as the local row (clamped into the rank's rows so that it
    runs: rank 0 is right, the others sum their last row twice), the rank's last expert left
    out, and the rank's first expert summed twice."""
    rank_rows = {
        "global_row": dict(pick=lambda e, lo, per: min(e, per - 1)),
        "term_missing": dict(terms=lambda lo, hi: range(lo, hi - 1)),
        "term_twice": dict(terms=lambda lo, hi: [*range(lo, hi), lo]),
    }[variant]
    case, (s, out), ranks = _experts_case(f"experts_{variant}", world, seed, **rank_rows)
    refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) == "rep")



def _expert_rows_case(name: str, world: int, seed: int, row=lambda e, lo: e - lo):
    """The gradient of a stacked expert weight w [E, a]: each expert's row gradient g_e [a] written
    into zeros at row e, where(iota_E == e, expand(g_e), 0) (the backward of `w[e]`), summed over
    the experts; each rank writes its experts' rows into its E/K rows (local row `row(e, lo)`),
    sums those and all-gathers the rows."""
    rng = rng_for(name, world, seed)
    per, a = size(rng, 1, 3), size(rng)
    experts = world * per
    inputs = {f"g{e}": In([a], rep()) for e in range(experts)}

    def onehot_write(g, x, e: int, at: int, rows: int) -> str:
        iota = g.const(np.arange(rows, dtype=np.int64).reshape(rows, 1), np.int64)
        cond = g.op("Equal", iota, g.const(np.int64(at), np.int64))
        grad = g.op("Expand", g.op("Unsqueeze", x[f"g{e}"], g.ints([0])), g.ints([rows, a]))
        return g.op("Where", cond, grad, g.const(np.float32(0.0)))

    def body(g, x, r):
        if r is None:
            terms = [onehot_write(g, x, e, e, experts) for e in reversed(range(experts))]
        else:
            lo = r * per
            terms = [onehot_write(g, x, e, row(e, lo), per) for e in reversed(range(lo, lo + per))]
        total = terms[0]
        for t in terms[1:]:
            total = g.op("Add", total, t)
        y = total if r is None else g.coll("AllGather", total, everyone(world), axis=0)
        return y, g.output(y)

    return make_case(name, world, inputs, body)


@grid
def test_stacked_expert_gradient_rows(world: int, seed: int) -> None:
    case, _, _ = _expert_rows_case("expert_rows", world, seed)
    witness(case, seed, "onehot_rows", "add_zero_rows", "allgather")


@grid
def test_stacked_expert_gradient_in_the_wrong_rows_is_refused(world: int, seed: int) -> None:
    """Each rank writes expert e at row (e - lo + 1) mod E/K: the rows of its experts swapped."""
    per = size(rng_for("expert_rows_wrong", world, seed), 1, 3)  # (the case's own first draw)
    if per == 1:
        pytest.skip("one expert per rank: no other row to write into")
    case, (s, out), ranks = _expert_rows_case("expert_rows_wrong", world, seed, row=lambda e, lo: (e - lo + 1) % per)
    refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) in ("sl", "rep"))
