"""Numeric witnesses for strided slices (rules/shape.lp `slice_step`): x[..., lo:hi:k] with k > 1,
lowered as `slice_step` facts.

Models that rotate interleaved pairs (GPT-J, CodeGen, Cohere, GLM, ERNIE: `rotate_every_two`,
`x[..., ::2]` and `x[..., 1::2]`) stride the head axis of a tensor sharded on the heads axis.
The identity: taking every k-th index of one axis commutes with a cut of another axis and with
replicas, sums and maxima of pieces. Positive cases (random shapes, world sizes 2 to 4, even
and uneven shards, random lo/hi/k, negative starts normalized by the lowering): a sharded tensor
strided on another axis, a partial sum strided and then all-reduced, and a replica. Refused twins
(a real numeric difference, no relation derived for the strided tensor, not verified): the rank
takes the other phase (1::2 where the sequential program takes 0::2), and both sides stride
the sharded axis itself (rank r's stride starts at its shard's own first index, not at the
sequential program's phase).
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import partial, rep, run_case, world_seed_grid
from test_lemmas_structure import In, make_case, refused, rng_for, sharded, size, witness

grid = pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1, 2)))


def _strided(rng, dim: int) -> tuple[int, int, int]:
    """(lo, hi, k) of a strided range of an axis of `dim` indices that keeps at least one."""
    k = int(rng.integers(2, 4))
    lo = int(rng.integers(0, max(1, dim - 1)))
    hi = int(rng.integers(lo + 1, dim + 1))
    return lo, hi, k


@grid
def test_strided_slice_of_another_axis(world: int, seed: int) -> None:
    """x [heads, b, d] sharded on the heads (evenly or not), strided on d; y = the same stride of a
    partial sum, all-reduced; z of a replica (a negative start, normalized)."""
    rng = rng_for("slice_step", world, seed)
    heads, lay = sharded(rng, 0, world, uneven=seed == 1)
    b, d = size(rng), size(rng, 4, 9)
    lo, hi, k = _strided(rng, d)
    inputs = {"x": In([heads, b, d], lay), "p": In([b, d], partial()), "r": In([b, d], rep())}

    def body(g, x, r):
        g.output(g.op("Slice", x["x"], g.ints([lo]), g.ints([hi]), g.ints([2]), g.ints([k])))
        s = g.op("Slice", x["p"], g.ints([lo]), g.ints([1 << 40]), g.ints([-1]), g.ints([k]))
        g.output(s if r is None else g.coll("AllReduce", s, list(range(world)), reduce_op="sum"))
        g.output(g.op("Slice", x["r"], g.ints([lo - d]), g.ints([hi]), g.ints([1]), g.ints([k])))

    case, _, _ = make_case("slice_step", world, inputs, body)
    witness(case, seed, "slice_step:sl", "slice_step:psum", "slice_step:rep", "allreduce_sum")


@grid
def test_strided_slice_in_rotate_every_two(world: int, seed: int) -> None:
    """GPT-J's rotate_every_two on heads sharded over the ranks: x[..., ::2], x[..., 1::2],
    stacked as (-x2, x1) on a new last axis and flattened back, times a replicated table."""
    rng = rng_for("rotate_every_two", world, seed)
    heads, lay = sharded(rng, 1, world, uneven=seed == 2)
    b, half = size(rng), size(rng, 1, 3)
    d = 2 * half
    inputs = {"x": In([b, heads, d], lay), "sin": In([b, 1, d], rep())}

    def body(g, x, r):
        x1 = g.op("Slice", x["x"], g.ints([0]), g.ints([d]), g.ints([2]), g.ints([2]))
        x2 = g.op("Slice", x["x"], g.ints([1]), g.ints([1 << 40]), g.ints([-1]), g.ints([2]))
        pair = g.op("Concat", g.op("Unsqueeze", g.op("Neg", x2), g.ints([-1])), g.op("Unsqueeze", x1, g.ints([-1])),
                    axis=-1)
        local = heads if r is None else (lay.get("sizes") or [heads // world] * world)[r]
        rotated = g.op("Reshape", pair, g.ints([b, local, d]))
        g.output(g.op("Mul", rotated, x["sin"]))

    case, _, _ = make_case("rotate_every_two", world, inputs, body)
    witness(case, seed, "slice_step:sl", "concat", "reshape")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_strided_slice_of_the_other_phase_is_refused(world: int, seed: int) -> None:
    """The ranks take x[..., 1::2] where the sequential program takes x[..., 0::2]."""
    rng = rng_for("slice_step_phase", world, seed)
    heads, lay = sharded(rng, 0, world, uneven=seed == 1)
    b, d = size(rng), 2 * size(rng, 2, 4)
    inputs = {"x": In([heads, b, d], lay)}

    def body(g, x, r):
        start = 0 if r is None else 1
        t = g.op("Slice", x["x"], g.ints([start]), g.ints([d]), g.ints([2]), g.ints([2]))
        g.output(g.op("Tanh", t))
        return t

    case, seq_t, rank_ts = make_case("slice_step_phase", world, inputs, body)
    refused(case, seed, seq_t, case.seq.outputs[0], [g.outputs[0] for g in case.ranks])


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 0)])
def test_strided_slice_of_the_sharded_axis_is_refused(world: int, seed: int) -> None:
    """Both sides stride the sharded axis with the same (lo, k): rank r strides its own shard from
    its own first index, so its picks are not the sequential program's picks in its range
    (shards of an odd size: rank 1 starts on an odd index)."""
    rng = rng_for("slice_step_sharded", world, seed)
    per = 2 * size(rng, 1, 3) + 1  # odd shards: the ranks' phases differ from the sequential one
    b = size(rng)
    inputs = {"x": In([world * per, b], {"layout": "shard", "axis": 0})}

    def body(g, x, r):
        t = g.op("Slice", x["x"], g.ints([0]), g.ints([1 << 40]), g.ints([0]), g.ints([2]))
        g.output(g.op("Tanh", t))
        return t

    case, seq_t, _ = make_case("slice_step_sharded", world, inputs, body)
    refused(case, seed, seq_t, case.seq.outputs[0], [g.outputs[0] for g in case.ranks])


# --- reversed slices of a replica (rules/shape.lp `slice`, its replica clause) ----------------------------


def flip_case(world: int, seed: int, rank_start: int = 0):
    """torch.flip as torch exports it (Slice from -1 to INT64_MIN, step -1) of a replica, then a
    cumsum (a reversed cumsum's backward): the rank's the same Slice, a replica; `rank_start` > 0:
    the ranks reverse from another start (a row fewer: not the sequential tensor)."""
    rng = rng_for(f"flip_{rank_start}", world, seed)
    n, d = size(rng, 3, 6), size(rng)
    inputs = {"x": In([n, d], rep())}

    def body(g, x, r):
        start = -1 - (rank_start if r is not None else 0)
        flipped = g.op("Slice", x["x"], g.ints([start]), g.ints([-(2 ** 63)]), g.ints([0]), g.ints([-1]))
        return g.output(g.op("Tanh", g.op("CumSum", flipped, g.const(0, np.int64))))

    return make_case(f"flip_{rank_start}", world, inputs, body)


@grid
def test_reversed_slice_of_a_replica_is_a_replica(world: int, seed: int) -> None:
    case, _, _ = flip_case(world, seed)
    witness(case, seed, "slice:rep")


@pytest.mark.parametrize("world", (2, 3))
def test_reversed_slice_from_another_start_is_refused(world: int) -> None:
    case, y, _ = flip_case(world, 0, rank_start=1)
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    assert out.report.verdict != "verified"
    assert not [lay for _, lay in out.relations_of(y)], out.relations_of(y)


@grid
def test_sequence_parts_relate_each_to_its_own(world: int, seed: int) -> None:
    """A SplitToSequence into equal parts and SequenceAt of each (the lowering's own Slices, their
    bounds in slice_spec only, so that a seq part and a rank part pair by signature alone): each
    part relates to its own, never to the other (whose values differ), and the difference of the
    two parts verifies."""
    rng = rng_for("sequence_parts", world, seed)
    m, d = size(rng, 1, 3), size(rng)
    inputs = {"x": In([2 * m, d], rep())}

    def body(g, x, r):
        parts = g.op("SplitToSequence", x["x"], g.ints([m, m]), axis=0)
        first, second = (g.op("SequenceAt", parts, g.const(i, np.int64)) for i in (0, 1))
        return g.output(g.op("Sub", first, second))

    case, _, _ = make_case("sequence_parts", world, inputs, body)
    witness(case, seed)
