"""Numeric witnesses for ScatterND without a reduction at distinct constant index tuples
(rules/scatter_replica.lp, `scatter_nd_distinct`): the index assignments HF's models write with
literal positions, left replicated by HF's TP plans (issue 40) -- the interleaved multimodal RoPE
of Qwen3-VL and Cosmos3 (`freqs_t[..., idx] = freqs[dim, ..., idx]`, a stride of positions) and
the chunked delta rule of Qwen3.5 / OLMo-hybrid linear attention (`attn[..., i, :i] = ...` in a
loop over i: one index tuple per scatter).

Positive cases (random shapes, asymmetric random values, world sizes 2..4): whole-row tuples in a
random order, with negative indices among them; tuples of two coordinates; the RoPE interleave
(transposed so that the scattered axis leads, as torch exports it); a loop of one-tuple scatters
each reading the previous one's output; with the reduction attribute absent and "none".

Refused twins (a real numeric difference, no replica derived for the scatter's output, not
verified): rank indices other than the sequential ones (the tuples reversed against the same
updates); updates that are a shard (every rank scatters only its own tuples: a missing
all-gather); updates or data that are partial sums (scattered and then all-reduced: the places
the scatter keeps, or those it writes, are counted K times).

Static refusals (the numbers cannot tell: the simulator is deterministic, and so is ORT, so a
duplicate writes alike on every side; it is torch's CUDA index_put_ and the ONNX spec that leave
the order open): duplicate tuples, a negative index naming the same place as a non-negative
one, and indices that are not constants (a replicated index input) -- the lemma must not fire.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import partial, rep, run_case, shard, world_seed_grid
from onnx import TensorProto
from test_lemmas_structure import (
    In,
    everyone,
    make_case,
    refused,
    rng_for,
    size,
    witness,
)

grid = pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1, 2)))
INT64 = TensorProto.INT64
LEMMA = "scatter_nd_distinct"


def scatter(g, data: str, indices: str, updates: str, reduction: str | None) -> str:
    """ScatterND, its reduction attribute absent (None) or given."""
    return g.op("ScatterND", data, indices, updates, **({} if reduction is None else {"reduction": reduction}))


def distinct_rows(rng: np.random.Generator, a: int, n: int, negative: bool) -> np.ndarray:
    """n distinct row indices of an axis of a, in a random order, [n, 1]; with `negative`, some
    written counting from the end (i - a)."""
    rows = rng.permutation(a)[:n]
    if negative:
        rows = np.where(rng.random(n) < 0.5, rows - a, rows)
    return rows.reshape(n, 1).astype(np.int64)


# ============================================================================================
# positive cases


@grid
@pytest.mark.parametrize("reduction", [None, "none"])
def test_scatter_rows_at_distinct_indices(world: int, seed: int, reduction: str | None) -> None:
    """y = scatter(x, I, u): whole rows of x [a, b, c] replaced at n distinct row indices (some
    negative), x and u replicas: y is a replica on every rank."""
    rng = rng_for(f"snd_rows_{reduction}", world, seed)
    a, b, c = size(rng, 3, 8), size(rng), size(rng)
    n = int(rng.integers(1, a + 1))
    idx = distinct_rows(rng, a, n, negative=True)
    inputs = {"x": In([a, b, c], rep()), "u": In([n, b, c], rep())}

    def body(g, x, r):
        y = scatter(g, x["x"], g.const(idx, np.int64), x["u"], reduction)
        g.output(g.op("Tanh", y))
        return y

    case, _, _ = make_case("snd_rows", world, inputs, body)
    witness(case, seed, f"{LEMMA}:rep")


@grid
def test_scatter_points_at_distinct_tuples(world: int, seed: int) -> None:
    """Tuples of two coordinates (places of the leading two axes of x [a, b, c]), distinct as
    pairs though their coordinates repeat: y = scatter(x, I [n, 2], u [n, c])."""
    rng = rng_for("snd_points", world, seed)
    a, b, c = size(rng, 2, 5), size(rng, 2, 5), size(rng)
    n = int(rng.integers(2, a * b + 1))
    flat = rng.permutation(a * b)[:n]
    idx = np.stack([flat // b, flat % b], axis=1).astype(np.int64)
    inputs = {"x": In([a, b, c], rep()), "u": In([n, c], rep())}

    def body(g, x, r):
        y = scatter(g, x["x"], g.const(idx, np.int64), x["u"], "none")
        g.output(g.op("Sigmoid", y))
        return y

    case, _, _ = make_case("snd_points", world, inputs, body)
    witness(case, seed, f"{LEMMA}:rep")


@grid
def test_interleaved_rope_sections(world: int, seed: int) -> None:
    """Qwen3-VL's interleaved MRoPE as exported: freqs [3, s, d] replicated; freqs_t = freqs[0],
    and the positions idx = start, start+3, ... of the last axis taken from freqs[k]:
    freqs_t[..., idx] = freqs[k][..., idx], written as Transpose -> ScatterND on the leading axis
    (tuples [[i]]) -> Transpose back, once for k = 1 and once for k = 2."""
    rng = rng_for("snd_rope", world, seed)
    s, d = size(rng), size(rng, 6, 12)
    inputs = {"freqs": In([3, s, d], rep())}

    def body(g, x, r):
        f = x["freqs"]
        t = g.op("Transpose", g.op("Gather", f, g.const(0, np.int64), axis=0), perm=[1, 0])   # [d, s]
        for k in (1, 2):
            idx = np.arange(k, d, 3, dtype=np.int64)
            src = g.op("Transpose", g.op("Gather", f, g.const(k, np.int64), axis=0), perm=[1, 0])
            upd = g.op("Gather", src, g.const(idx, np.int64), axis=0)                          # [n, s]
            t = scatter(g, t, g.const(idx.reshape(-1, 1), np.int64), upd, "none")
        y = g.op("Transpose", t, perm=[1, 0])
        g.output(g.op("Cos", y))
        return y

    case, _, _ = make_case("snd_rope", world, inputs, body)
    witness(case, seed, f"{LEMMA}:rep")


@grid
def test_loop_of_single_tuple_scatters(world: int, seed: int) -> None:
    """The delta rule's loop, `x[i] = x[i] + x[i - 1] * w` for i = 1..n-1: each step gathers two
    rows of the previous step's output and scatters one row back at the tuple [[i]]."""
    rng = rng_for("snd_loop", world, seed)
    n, c = size(rng, 3, 6), size(rng)
    inputs = {"x": In([n, c], rep()), "w": In([c], rep())}

    def body(g, x, r):
        t = x["x"]
        for i in range(1, n):
            row = g.op("Gather", t, g.const([i], np.int64), axis=0)
            prev = g.op("Gather", t, g.const([i - 1], np.int64), axis=0)
            t = scatter(g, t, g.const([[i]], np.int64), g.op("Add", row, g.op("Mul", prev, x["w"])), "none")
        g.output(t)
        return t

    case, _, _ = make_case("snd_loop", world, inputs, body)
    witness(case, seed, f"{LEMMA}:rep")


# ============================================================================================
# refused twins: the ranks compute something else


def _no_replica(t: str, lay: object) -> bool:
    return lay == "rep"


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_rank_indices_other_than_the_sequential_ones_are_refused(world: int, seed: int) -> None:
    """Every rank scatters the same updates at the tuples in reverse order (distinct too, a
    replica-looking constant of its own): the rows land at other places."""
    rng = rng_for("snd_other_idx", world, seed)
    a, c = size(rng, 3, 8), size(rng)
    n = int(rng.integers(2, a + 1))
    idx = distinct_rows(rng, a, n, negative=False)
    inputs = {"x": In([a, c], rep()), "u": In([n, c], rep())}

    def body(g, x, r):
        mine = idx if r is None else idx[::-1].copy()
        y = scatter(g, x["x"], g.const(mine, np.int64), x["u"], "none")
        g.output(g.op("Tanh", y))
        return y

    case, seq_y, _ = make_case("snd_other_idx", world, inputs, body)
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks], wrong=_no_replica)


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_updates_that_are_a_shard_are_refused(world: int, seed: int) -> None:
    """The updates' tuples are sharded over the ranks and every rank scatters only its own tuples
    (at its own slice of the indices) into the whole data, with no all-gather of the updates."""
    rng = rng_for("snd_shard_upd", world, seed)
    per, c = size(rng, 1, 2), size(rng)
    n = world * per
    a = n + size(rng, 1, 3)
    idx = distinct_rows(rng, a, n, negative=False)
    inputs = {"x": In([a, c], rep()), "u": In([n, c], shard(0))}

    def body(g, x, r):
        mine = idx if r is None else idx[r * per:(r + 1) * per]
        y = scatter(g, x["x"], g.const(mine, np.int64), x["u"], "none")
        g.output(g.op("Tanh", y))
        return y

    case, seq_y, _ = make_case("snd_shard_upd", world, inputs, body)
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks], wrong=_no_replica)


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
@pytest.mark.parametrize("operand", ["updates", "data"])
def test_partial_operands_are_refused(world: int, seed: int, operand: str) -> None:
    """One operand is a partial sum (each rank its own piece) and every rank scatters with its
    piece, then all-reduces: a scatter is not linear in either operand alone -- with partial
    updates the places it keeps are the data's K times, with partial data the places it writes
    are the updates' K times."""
    rng = rng_for(f"snd_partial_{operand}", world, seed)
    a, c = size(rng, 3, 8), size(rng)
    n = int(rng.integers(1, a))
    idx = distinct_rows(rng, a, n, negative=False)
    inputs = {"x": In([a, c], partial() if operand == "data" else rep()),
              "u": In([n, c], partial() if operand == "updates" else rep())}

    def body(g, x, r):
        y = scatter(g, x["x"], g.const(idx, np.int64), x["u"], "none")
        g.output(y if r is None else g.coll("AllReduce", y, everyone(world), reduce_op="sum"))
        return y

    case, seq_y, _ = make_case(f"snd_partial_{operand}", world, inputs, body)
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks], wrong=_no_replica)


# ============================================================================================
# static refusals: tuples that may name one place twice, or are unknown


def _not_taken(name: str, world: int, seed: int, idx_of, extra: dict | None = None) -> None:
    """Replicated data x [a, c] and updates scattered at the constant indices `idx_of(rng, a, c)`
    ([n, K], the same on every side), or at the index input `i` of `extra` (with its `n`): the
    lemma does not fire, nothing derived is wrong, the output is not proven."""
    rng = rng_for(name, world, seed)
    a, c = size(rng, 3, 8), size(rng)
    idx = idx_of(rng, a, c)
    n, k = idx.shape if idx is not None else ((extra or {})["n"], 1)
    inputs = {"x": In([a, c], rep()), "u": In([n, *[a, c][k:]], rep()),
              **{key: v for key, v in (extra or {}).items() if key != "n"}}

    def body(g, x, r):
        indices = g.const(idx, np.int64) if idx is not None else x["i"]
        y = scatter(g, x["x"], indices, x["u"], "none")
        g.output(g.op("Tanh", y))
        return y

    case, seq_y, _ = make_case(name, world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    assert LEMMA not in out.lemmas_fired()
    assert not [lay for _t, lay in out.relations_of(seq_y) if lay == "rep"]
    assert out.report.verdict != "verified"


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_duplicate_tuples_are_not_taken(world: int, seed: int) -> None:
    """One tuple twice among distinct ones (whole rows, or places (i, j) with i != j, whose
    coordinates differ from each other but not from the other copy's): two updates race for
    one place."""
    def idx(rng, a, c):
        if seed % 2 == 0:
            tuples = distinct_rows(rng, a, int(rng.integers(2, a + 1)), negative=False)
        else:
            flat = rng.permutation(a * c)[:int(rng.integers(2, a * c + 1))]
            tuples = np.stack([flat // c, flat % c], axis=1)
            i = int(rng.integers(1, min(a, c)))
            tuples = np.concatenate([tuples[(tuples[:, 0] != 0) | (tuples[:, 1] != i)], [[0, i]]], axis=0)
        return np.concatenate([tuples, tuples[-1:]], axis=0)[rng.permutation(tuples.shape[0] + 1)].astype(np.int64)

    _not_taken("snd_dup", world, seed, idx)


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_a_negative_alias_of_another_tuple_is_not_taken(world: int, seed: int) -> None:
    """Row i and row i - a (the same row, counted from the end): distinct numbers, one place."""
    def idx(rng, a, c):
        i = int(rng.integers(0, a))
        return np.array([[i], [i - a]], dtype=np.int64)

    _not_taken("snd_neg_alias", world, seed, idx)


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_indices_that_are_not_constants_are_not_taken(world: int, seed: int) -> None:
    """The indices are a replicated input (equal on every side, but their values unknown: they
    may repeat)."""
    n = 3
    _not_taken("snd_input_idx", world, seed, lambda rng, a, c: None,
               {"n": n, "i": In([n, 1], {**rep(), "range": [0, 3]}, INT64)})
