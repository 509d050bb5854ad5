"""Numeric witnesses for the lemmas HF's MoE experts need to put routed rows back in token order
(transformers.integrations.moe: `perm = sort(expert_ids)`, `inv[perm] = arange(S)`,
`out[inv]`, under HF's TP plan each rank's rows a partial sum over its slice of every expert):

- rules/routing.lp `replica_op` for ScatterND without a reduction at distinct index tuples: the
  tuples a TopK's index output with a unit axis appended (through a Concat of that one input, as
  torch exports `x[perm] = v`), so each place is written once and replicated inputs give a
  replica;
- rules/shape.lp `gather` of a partial sum (or a replica) at replicated indices: a gather moves
  values and does not mix them, so it picks the same places of every piece;
- rules/routing.lp `scatter_slabs`: ScatterND with one-coordinate tuples writes whole slabs along
  axis 0, so data and updates sliced alike on another axis give that slice of the output (MLA's
  key assembled in place, `k[..., :nope] = k_nope`, on a rank's heads: a ScatterND of the
  transposed tensors at a slice of a Range); data or updates constant along that axis (an
  expanded buffer, a key broadcast over the heads) stand for their slice, through a transpose
  (rules/shape.lp `transpose` of a broadcast axis).

Refused: ScatterND at index tuples that merely come from an input (duplicates possible: the
writes' order decides, no replica is claimed), a gather of a partial sum at indices that
differ per rank (each rank picks other rows of its piece), and a slab scatter whose ranks write
at other positions than the sequential program.

Partial sums written once and a concat taken back apart (HF's MLA kv projection under its TP
plan, differentiated: the gradient of `cat(k_pass, k_rot)` is a replica next to a partial):
- rules/routing.lp `scatter_write_partial`: a scatter without a reduction at distinct places
  into zeros is linear in its updates, so a partial sum written gives the pieces written;
- rules/shape.lp `slice_of_concat`: a Slice that takes back exactly one operand of a Concat is
  that operand, on both sides or on a rank alone, whatever the concat relates to.
Refused: the style's all-reduce left out (the rope part stays a piece), a slice one column late.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from harness import partial, rep, run_case, shard, world_seed_grid
from test_lemmas_structure import In, make_case, refused, rng_for, size, witness

INT64 = TensorProto.INT64
grid = pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1, 2)))


def inverse_permutation(g, ids: str, s: int, concat: bool) -> str:
    """HF's `perm = sort(ids)` (TopK over the whole axis, ascending), then `inv[perm] = arange(s)`
    as torch exports it: ScatterND(zeros, Concat(Unsqueeze(perm, -1)), arange)."""
    _, perm = g.op_n("TopK", ids, g.ints([s]), axis=-1, largest=0, sorted=1, outputs=2)
    tuples = g.op("Unsqueeze", perm, g.ints([-1]))
    if concat:
        tuples = g.op("Concat", tuples, axis=-1)
    zeros = g.op("ConstantOfShape", g.ints([s]), value=numpy_helper.from_array(np.zeros(1, dtype=np.int64)))
    arange = g.op("Range", g.const(0, np.int64), g.const(s, np.int64), g.const(1, np.int64))
    return g.op("ScatterND", zeros, tuples, arange)


@grid
def test_inverse_permutation_of_replicas_is_a_replica(world: int, seed: int) -> None:
    """Expert ids repeat (ties everywhere); the rows gathered back through the inverse permutation,
    with and without the Concat torch puts around one index tensor: replicas on every rank."""
    rng = rng_for("inverse_perm", world, seed)
    s, h = size(rng, 4, 9), size(rng)
    inputs = {"ids": In([s], {**rep(), "range": [0, 3]}, INT64), "rows": In([s, h], rep())}

    def body(g, x, r):
        for concat in (False, True):
            inv = inverse_permutation(g, x["ids"], s, concat)
            g.output(g.op("Tanh", g.op("Gather", x["rows"], inv, axis=0)))

    case, _, _ = make_case("inverse_perm", world, inputs, body)
    witness(case, seed, "replica_op:rep", "gather")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3), (0, 1)))
def test_scatter_at_index_tuples_of_an_input_is_refused(world: int, seed: int) -> None:
    """The tuples come from an input (an index tensor that may repeat): ScatterND without a
    reduction writes a repeated place in an undefined order, so no replica is claimed (even
    though both sides hold the same values here)."""
    rng = rng_for("scatter_input_tuples", world, seed)
    s = size(rng, 4, 9)
    inputs = {"tuples": In([s, 1], {**rep(), "range": [0, s]}, INT64), "u": In([s], rep())}

    def body(g, x, r):
        zeros = g.op("ConstantOfShape", g.ints([s]), value=numpy_helper.from_array(np.zeros(1, dtype=np.float32)))
        y = g.op("ScatterND", zeros, x["tuples"], x["u"])
        g.output(g.op("Tanh", y))
        return y

    case, seq_y, _ = make_case("scatter_input_tuples", world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert not [lay for _, lay in out.relations_of(seq_y)], out.relations_of(seq_y)
    assert out.report.verdict != "verified"


@pytest.mark.parametrize("op", ["sum", "max"])
@grid
def test_gather_of_a_partial_at_replicated_indices(world: int, seed: int, op: str) -> None:
    """Each rank's rows are a partial sum (its slice of every expert), or a partial max; picked
    back into token order at the same indices, then all-reduced with the same op: the sequential
    rows in token order."""
    rng = rng_for("gather_partial", world, seed)
    n, h, m = size(rng, 3, 8), size(rng), size(rng, 2, 9)
    inputs = {"p": In([n, h], partial(op)), "i": In([m], {**rep(), "range": [0, n]}, INT64)}

    def body(g, x, r):
        y = g.op("Gather", x["p"], x["i"], axis=0)
        g.output(g.op("Tanh", y if r is None else g.coll("AllReduce", y, list(range(world)), reduce_op=op)))

    case, _, _ = make_case("gather_partial", world, inputs, body)
    witness(case, seed, "gather")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3), (0, 1)))
def test_gather_of_a_partial_at_per_rank_indices_is_refused(world: int, seed: int) -> None:
    """Each rank picks its own slice of the indices from its piece, and the pieces of different
    rows are summed: not the sequential pick of the sum."""
    rng = rng_for("gather_partial_sharded", world, seed)
    n, h, m = size(rng, 3, 8), size(rng), world * size(rng, 1, 3)
    inputs = {"p": In([n, h], partial()), "i": In([m], {**shard(0), "range": [0, n]}, INT64)}

    def body(g, x, r):
        y = g.op("Gather", x["p"], x["i"], axis=0)
        out = y if r is None else g.op("Tile", g.coll("AllReduce", y, list(range(world)), reduce_op="sum"),
                                       g.ints([world, 1]))
        g.output(g.op("Tanh", out))
        return y

    case, _, _ = make_case("gather_partial_sharded", world, inputs, body)
    out = case.seq.outputs[0]
    refused(case, seed, out, out, [g.outputs[0] for g in case.ranks], wrong=lambda t, lay: lay == "rep")


def slab_positions(g, n: int, lo: int, hi: int, shift: int = 0) -> str:
    """Tuples [hi - lo, 1]: positions lo .. hi-1 of a Range over n (+ shift), as torch exports the
    index of `x[..., lo:hi] = v` (a slice of a Range, a unit axis appended)."""
    arange = g.op("Range", g.const(shift, np.int64), g.const(n + shift, np.int64), g.const(1, np.int64))
    return g.op("Unsqueeze", g.op("Slice", arange, g.ints([lo]), g.ints([hi]), g.ints([0])), g.ints([-1]))


@grid
def test_slab_scatter_of_sliced_heads(world: int, seed: int) -> None:
    """MLA's key assembled in place on a rank's heads: the buffer an expanded zero of each side's
    own shape (constant along the heads), the first `nope` positions of the last axis written with
    the heads' slice of k_nope, the rest with a key broadcast over the heads and transposed
    (all through the transposed tensors torch exports); the heads all-gathered."""
    rng = rng_for("slab_scatter", world, seed)
    per, s, nope, rope = size(rng, 1, 3), size(rng, 2, 5), size(rng, 1, 4), size(rng, 1, 4)
    heads, d = world * per, nope + rope
    inputs = {"k_nope": In([nope, heads, s], shard(1)), "k_rot": In([1, rope, s], rep())}

    def body(g, x, r):
        h = heads if r is None else per
        buffer = g.op("Expand", g.const(np.zeros(1, dtype=np.float32)), g.ints([d, h, s]))
        first = g.op("ScatterND", buffer, slab_positions(g, d, 0, nope), x["k_nope"])
        rot = g.op("Transpose", g.op("Expand", x["k_rot"], g.ints([h, rope, s])), perm=[1, 0, 2])  # heads: 0 -> 1
        key = g.op("ScatterND", first, slab_positions(g, d, nope, d), rot)
        g.output(g.op("Tanh", key if r is None else g.coll("AllGather", key, list(range(world)), axis=1)))

    case, _, _ = make_case("slab_scatter", world, inputs, body)
    witness(case, seed, "scatter_slabs", "transpose")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3), (0, 1)))
def test_slab_scatter_at_other_positions_is_refused(world: int, seed: int) -> None:
    """The ranks' positions shifted by one (a Range from 1): they write other slabs than the
    sequential program, and the gathered heads are not its output."""
    rng = rng_for("slab_scatter_shifted", world, seed)
    per, s, k = size(rng, 1, 3), size(rng, 2, 5), size(rng, 2, 4)
    heads, d = world * per, k + 2
    inputs = {"u": In([k, heads, s], shard(1)), "data": In([d, heads, s], shard(1))}

    def body(g, x, r):
        y = g.op("ScatterND", x["data"], slab_positions(g, d, 0, k, shift=0 if r is None else 1), x["u"])
        g.output(g.op("Tanh", y if r is None else g.coll("AllGather", y, list(range(world)), axis=1)))
        return y

    case, seq_y, _ = make_case("slab_scatter_shifted", world, inputs, body)
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks])


@grid
def test_scatter_at_cast_topk_indices_is_a_replica(world: int, seed: int) -> None:
    """DeepSeek-V3.2's sparse attention mask: ones scattered with zeros at the top-k keys of each
    query, the TopK indices cast (`.long()`, through int32 here too): distinct along the axis
    after the casts, so each place is written once and the mask is a replica."""
    rng = rng_for("cast_topk_scatter", world, seed)
    q, n = size(rng, 2, 5), size(rng, 3, 8)
    k = int(rng.integers(1, n + 1))
    inputs = {"scores": In([q, n], rep())}

    def body(g, x, r):
        _, idx = g.op_n("TopK", x["scores"], g.ints([k]), axis=-1, largest=1, sorted=1, outputs=2)
        idx = g.op("Cast", g.op("Cast", idx, to=TensorProto.INT32), to=TensorProto.INT64)
        ones = g.op("Expand", g.const(np.ones(1, dtype=np.float32)), g.ints([q, n]))
        zeros = g.op("Expand", g.const(np.zeros(1, dtype=np.float32)), g.ints([q, k]))
        g.output(g.op("Tanh", g.op("ScatterElements", ones, idx, zeros, axis=-1)))

    case, _, _ = make_case("cast_topk_scatter", world, inputs, body)
    witness(case, seed, "replica_op:rep")


def test_scatter_at_cast_input_indices_is_not_a_replica() -> None:
    """Indices cast from an input (repeats possible): no reduction, so no replica is claimed."""
    rng = rng_for("cast_input_scatter", 2)
    q, n = size(rng, 2, 5), size(rng, 3, 8)
    inputs = {"idx": In([q, 2], {**rep(), "range": [0, n]}, TensorProto.INT32)}

    def body(g, x, r):
        ones = g.op("Expand", g.const(np.ones(1, dtype=np.float32)), g.ints([q, n]))
        zeros = g.op("Expand", g.const(np.zeros(1, dtype=np.float32)), g.ints([q, 2]))
        y = g.op("ScatterElements", ones, g.op("Cast", x["idx"], to=TensorProto.INT64), zeros, axis=-1)
        g.output(g.op("Tanh", y))
        return y

    case, seq_y, _ = make_case("cast_input_scatter", 2, inputs, body)
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert not [lay for _, lay in out.relations_of(seq_y)], out.relations_of(seq_y)


# ============================================================================================
# partial sums written once, and a concat taken back apart (HF's MLA kv projection's backward)
# ============================================================================================


@grid
def test_slab_write_of_a_partial_is_a_partial(world: int, seed: int) -> None:
    """A slice assignment's backward, `grad[lo:hi] = g`, with g a partial sum on the ranks: each
    place written once (positions from a Range), so writing the pieces gives the pieces of the
    write (scatter_write_partial); the all-reduce sums them."""
    rng = rng_for("slab_write_partial", world, seed)
    d, m = size(rng, 4, 8), size(rng)
    lo = int(rng.integers(0, d - 1))
    hi = int(rng.integers(lo + 1, d + 1))
    inputs = {"u": In([hi - lo, m], partial())}

    def body(g, x, r):
        zeros = g.op("Expand", g.const(np.zeros(1, dtype=np.float32)), g.ints([d, m]))
        y = g.op("ScatterND", zeros, slab_positions(g, d, lo, hi), x["u"])
        g.output(g.op("Tanh", y if r is None else g.coll("AllReduce", y, list(range(world)))))

    case, _, _ = make_case("slab_write_partial", world, inputs, body)
    witness(case, seed, "scatter_write_partial")


def mla_split_case(world: int, seed: int, bug: str | None = None):
    """The gradient of HF's MLA kv projection output, cat(g_pass, g_rot): g_pass a replica, g_rot
    a partial sum on the ranks (it bypasses the column-parallel kv_b_proj).  The sequential
    program concatenates; each rank concatenates, takes the two parts back with a Slice each
    (the `mla_kv_a_proj` style's cat, differentiated), all-reduces g_rot's and concatenates
    again.  Bugs: `no_allreduce` (the style's all-reduce left out), `slice_short` (the rope part
    taken back one column late)."""
    rng = rng_for(f"mla_split_{bug}", world, seed)
    rows, npass, nrot = size(rng), size(rng, 2, 5), size(rng, 2, 4)
    inputs = {"g_pass": In([rows, npass], rep()), "g_rot": In([rows, nrot], partial())}

    def body(g, x, r):
        both = g.op("Concat", x["g_pass"], x["g_rot"], axis=-1)
        if r is not None:
            start = npass + (1 if bug == "slice_short" else 0)
            part = g.op("Slice", both, g.ints([0]), g.ints([npass]), g.ints([1]))
            rot = g.op("Slice", both, g.ints([start]), g.ints([npass + nrot]), g.ints([1]))
            if bug != "no_allreduce":
                rot = g.coll("AllReduce", rot, list(range(world)))
            both = g.op("Concat", part, rot, axis=1)
        g.output(g.op("Tanh", both))
        return both

    return make_case(f"mla_split_{bug}", world, inputs, body)


@grid
def test_concat_taken_back_apart_relates_as_its_operands(world: int, seed: int) -> None:
    """Each rank's Slice takes back one operand of its Concat exactly: the replica part is a replica
    and the partial part a partial, so the all-reduced concat is the sequential one."""
    case, _, _ = mla_split_case(world, seed)
    witness(case, seed, "slice_of_concat")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3), (0, 1)))
@pytest.mark.parametrize("bug", ["no_allreduce", "slice_short"])
def test_concat_taken_back_wrong_is_refused(world: int, seed: int, bug: str) -> None:
    """Without the all-reduce the rope part stays one rank's piece; a slice one column late is not
    the operand (and has a column fewer): neither is the sequential gradient."""
    case, seq_y, _ = mla_split_case(world, seed, bug)
    whole = lambda t, lay: lay == "rep" or lay[0] != "sl" or lay[2] > 0  # (the pass part, sl(1, 0, npass), is right)
    if bug == "slice_short":  # (the ranks' output is a column short: no numbers to compare, nothing may claim it)
        out = run_case(case, seed)
        assert out.checked.ok, out.checked.violations
        assert out.report.verdict != "verified"
        assert not [lay for t, lay in out.relations_of(seq_y) if whole(t, lay)], out.relations_of(seq_y)
        return
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks], wrong=whole)
