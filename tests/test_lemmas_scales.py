"""Numeric witnesses for constant factors carried through linear ops (rules/scales.lp,
refine/run/scales.py) and for the reduce-scatters of scaled partial sums (collectives.lp).

- `scaled_linear`: a rank scales its shard by p/q, and the factor runs through MatMul,
  Transpose, a Where against zero and an Add of two scaled terms (the virtual unscaled copies)
  before the rank's own q/p cancels it;
- `value_ratio`: the seed of a mean loss's backward, ones / count, is 1/n sequentially and
  1/(n/K) on each rank (DDP's local mean): rank = K x sequential, carried into the per-row
  gradient and cancelled by the rank's 1/K;
- `reduce_scatter_scaled`, `reduce_scatter_avg_scaled`: each rank scales its partial-sum piece
  by c and reduce-scatters it (sum or avg): member j holds c (or c/K) times chunk j.

Refused twins: a factor that does not cancel (p/q against q/(p+1)), a local mean whose ranks
divide by 1/(K+1), a reduce-scatter's factor off by one.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import partial, rep, shard, world_seed_grid
from test_lemmas_structure import In, everyone, kind, make_case, refused, rng_for, size, witness

grid = pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1, 2)))
INT64 = TensorProto.INT64


def fraction(rng: np.random.Generator) -> tuple[int, int]:
    p = int(rng.integers(1, 4))
    return p, p + int(rng.integers(1, 6))


def _linear_case(name: str, world: int, seed: int, unscale: tuple[int, int] | None = None):
    """y = (x @ w)^T + (relu-masked x @ v)^T sequentially; each rank scales its rows of x by p/q
    first and by `unscale` (q/p when correct) last, then gathers the columns."""
    rng = rng_for(name, world, seed)
    p, q = fraction(rng)
    back = unscale or (q, p)
    a, b, c = world * size(rng, 1, 3), size(rng), size(rng)
    inputs = {"x": In([a, b], shard(0)), "w": In([b, c], rep()), "v": In([b, c], rep())}

    def body(g, x, r):
        if r is None:
            m = g.op("MatMul", x["x"], x["v"])
            masked = g.op("Where", g.op("Greater", m, g.const(np.float32(0.0))), m, g.const(np.float32(0.0)))
            y = g.op("Add", g.op("Transpose", g.op("MatMul", x["x"], x["w"]), perm=[1, 0]),
                     g.op("Transpose", masked, perm=[1, 0]))
            return y, g.output(y)
        xs = g.op("Mul", x["x"], g.const(np.float32(p / q)))
        cond = g.op("Greater", g.op("MatMul", x["x"], x["v"]), g.const(np.float32(0.0)))
        masked = g.op("Where", cond, g.op("MatMul", xs, x["v"]), g.const(np.float32(0.0)))
        t = g.op("Add", g.op("Transpose", g.op("MatMul", xs, x["w"]), perm=[1, 0]), g.op("Transpose", masked, perm=[1, 0]))
        y = g.coll("AllGather", g.op("Mul", t, g.const(np.float32(back[0] / back[1]))), everyone(world), axis=1)
        return y, g.output(y)

    return make_case(name, world, inputs, body)


@grid
def test_a_factor_runs_through_linear_ops_and_cancels(world: int, seed: int) -> None:
    case, _, _ = _linear_case("scaled_linear", world, seed)
    witness(case, seed, "scaled_linear:scaled", "rank_scale:scaled", "unit_scale", "allgather")


@grid
def test_a_factor_that_does_not_cancel_is_refused(world: int, seed: int) -> None:
    p, q = fraction(rng_for("scaled_linear", world, seed))
    case, (s, out), ranks = _linear_case("scaled_linear_refused", world, seed, unscale=(q, p + 1))
    refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) != "scaled")


def _seed_case(name: str, world: int, seed: int, rank_share: int | None = None):
    """The per-row gradient of a mean loss: x * (1 / count) with count the number of labels that
    are not -100 (all of them: labels declared in [0, v)); each rank divides by its own count and
    multiplies by 1/`rank_share` (the world size when correct), then gathers the rows."""
    rng = rng_for(name, world, seed)
    n, v = world * size(rng, 1, 3), size(rng, 3, 6)
    share = rank_share or world
    inputs = {"x": In([n], shard(0)), "labels": In([n], {**shard(0), "range": [0, v]}, INT64)}

    def body(g, x, r):
        valid = g.op("Cast", g.op("Not", g.op("Equal", x["labels"], g.const(np.int64(-100), np.int64))), to=INT64)
        count = g.op("Cast", g.op("ReduceSum", valid, g.ints([0]), keepdims=0), to=TensorProto.FLOAT)
        seed_grad = g.op("Div", g.const(np.float32(1.0)), count)
        y = g.op("Mul", x["x"], seed_grad)
        if r is not None:
            y = g.coll("AllGather", g.op("Mul", y, g.const(np.float32(1.0 / share))), everyone(world), axis=0)
        return y, g.output(y)

    return make_case(name, world, inputs, body)


@grid
def test_a_local_mean_seed_is_the_world_size_times_the_global_one(world: int, seed: int) -> None:
    case, _, _ = _seed_case("value_ratio", world, seed)
    witness(case, seed, "value_ratio:scaled", "rank_scale", "unit_scale")


@grid
def test_a_local_mean_seed_scaled_wrongly_is_refused(world: int, seed: int) -> None:
    case, (s, out), ranks = _seed_case("value_ratio_refused", world, seed, rank_share=world + 1)
    refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) != "scaled")


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@grid
def test_reduce_scatter_of_scaled_pieces(world: int, seed: int, reduce_op: str) -> None:
    """Each rank scales its partial-sum piece by p/q and reduce-scatters it along axis 0; member j
    then undoes the factor (q/p, times K for avg) and the chunks are gathered."""
    rng = rng_for(f"rs_scaled_{reduce_op}", world, seed)
    p, q = fraction(rng)
    a, b = world * size(rng, 1, 2), size(rng)
    back = q / p * (world if reduce_op == "avg" else 1)

    def body(g, x, r):
        if r is None:
            return g.output(x["p"])
        chunk = g.coll("ReduceScatter", g.op("Mul", x["p"], g.const(np.float32(p / q))), everyone(world), axis=0,
                       reduce_op=reduce_op)
        return g.output(g.coll("AllGather", g.op("Mul", chunk, g.const(np.float32(back))), everyone(world), axis=0))

    case, _, _ = make_case(f"rs_scaled_{reduce_op}", world, {"p": In([a, b], partial())}, body)
    lemma = {"sum": "reduce_scatter_scaled", "avg": "reduce_scatter_avg_scaled"}[reduce_op]
    witness(case, seed, f"{lemma}:scaled", "rank_scale:scaled", "unit_scale", "allgather")


@grid
def test_reduce_scatter_of_pieces_scaled_off_by_one_is_refused(world: int, seed: int) -> None:
    rng = rng_for("rs_scaled_refused", world, seed)
    p, q = fraction(rng)
    a, b = world * size(rng, 1, 2), size(rng)

    def body(g, x, r):
        if r is None:
            return x["p"], g.output(x["p"])
        chunk = g.coll("ReduceScatter", g.op("Mul", x["p"], g.const(np.float32(p / q))), everyone(world), axis=0,
                       reduce_op="avg")
        y = g.coll("AllGather", g.op("Mul", chunk, g.const(np.float32(q / p * (world + 1)))), everyone(world), axis=0)
        return y, g.output(y)

    case, (s, out), ranks = make_case("rs_scaled_refused", world, {"p": In([a, b], partial())}, body)
    refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) in ("sl", "rep"))
