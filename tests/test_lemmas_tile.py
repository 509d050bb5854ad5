"""Numeric witnesses for ONNX Tile (rules/tile.lp: torch's Tensor.repeat, DiffLlama's
v.repeat(1, 2, 1, 1) over a chunk of its key/value heads, Gemma 3n's AltUp). The
ScatterND at constant distinct indices that follows Gemma 3n's Tile (its slice assignment
corrected_predictions[1:] += ...) is rules/scatter_replica.lp's, witnessed in
tests/test_lemmas_scatter_replica.py.

- `tile`: a replica tiled alike on both sides is a replica; a partial sum's (or partial max's)
  pieces tiled alike are pieces of the tiled sum (max);
- `tile_other_axis`: a shard (sl) or a strided shard (blk) whose cut axis is not repeated keeps
  its layout;
- `tile_repeated_axis`: a shard whose cut axis is repeated K > 1 times is the same inner range of
  each of the K copies (blk of the sequential tile, blocks of the input's size), read back copy by
  copy as plain shards (shape.lp's block_slice), also through an elementwise op; a strided shard
  stays strided with its block size.

Each positive case asserts that the lemma fired with a layout of the named kind and that every
relation derived held on the multi-rank simulation (random shapes and repeats, asymmetric random
values, world sizes 2..4, even and uneven shards), no sanity violation, and a verified verdict.

Refused twins (must not verify; no relation of a wrong kind for the tensor named; whatever is
derived still holds): the repeated shard all-gathered as if it were a contiguous shard of the
sequential tile; a copy read back at the wrong offset; repeats that differ between the sides
(a replica tiled along another axis and viewed back to the sequential shape; a shard repeated
K*W times where the sequential program repeats K times, of the sequential tile's very shape).
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import partial, rep, shard, world_seed_grid
from test_lemmas_structure import In, everyone, kind, make_case, refused, rng_for, sharded, size, witness

grid = pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1, 2)))
# (world, seed, uneven): every world size, even and uneven shards
PARAMS = [(2, 0, False), (3, 1, True), (4, 2, False), (2, 1, True)]
params = pytest.mark.parametrize("world,seed,uneven", PARAMS,
                                 ids=[f"w{w}-s{s}-{'uneven' if u else 'even'}" for w, s, u in PARAMS])


def repeats(rng: np.random.Generator, ndim: int, fixed: dict[int, int] | None = None) -> list[int]:
    """Random repeats 1..3 per axis, some axes pinned (`fixed`), at least one axis above 1."""
    reps = [int(rng.integers(1, 4)) for _ in range(ndim)]
    for a, k in (fixed or {}).items():
        reps[a] = k
    free = [a for a in range(ndim) if a not in (fixed or {})]
    if all(r == 1 for r in reps) and free:
        reps[free[0]] = 2
    return reps


def gather_or_output(g, t: str, axis: int, r: int | None, world: int, even: bool) -> str:
    """The sequential tensor as it is; a rank's slice all-gathered when the shards are even, else
    output as it is (the verdict concatenates the ranks' outputs)."""
    if r is None or not even:
        return g.output(t)
    return g.output(g.coll("AllGather", t, everyone(world), axis=axis))


# ============================================================================================
# tile: replicas, partial sums and maxima


@grid
def test_tile_of_a_replica_is_a_replica(world: int, seed: int) -> None:
    """tile(S, r) = tile(S, r): the same repeats (a constant) on both sides; after a torch-style
    Expand (Tensor.repeat exports Expand then Tile) on odd seeds."""
    rng = rng_for("tile_rep", world, seed)
    shape = [size(rng, 1, 4) for _ in range(int(rng.integers(2, 5)))]
    reps = repeats(rng, len(shape))

    def body(g, x, r):
        t = x["x"]
        if seed % 2:
            t = g.op("Expand", t, g.ints(shape))
        return g.output(g.op("Relu", g.op("Tile", t, g.ints(reps))))

    case, _, _ = make_case("tile_rep", world, {"x": In(shape, rep())}, body)
    witness(case, seed, "tile:rep")


@pytest.mark.parametrize("op", ["sum", "max"])
@grid
def test_tile_of_partial_pieces_is_a_partial(world: int, seed: int, op: str) -> None:
    """tile(sum_k P_k, r) = sum_k tile(P_k, r) (and max): each rank tiles its piece, the
    all-reduce sums (takes the max of) the tiled pieces."""
    rng = rng_for(f"tile_partial_{op}", world, seed)
    shape = [size(rng, 1, 4) for _ in range(int(rng.integers(1, 4)))]
    reps = repeats(rng, len(shape))

    def body(g, x, r):
        t = g.op("Tile", x["p"], g.ints(reps))
        return g.output(t if r is None else g.coll("AllReduce", t, everyone(world), reduce_op=op))

    case, _, _ = make_case(f"tile_partial_{op}", world, {"p": In(shape, partial(op))}, body)
    witness(case, seed, f"tile:{'psum' if op == 'sum' else 'pmax'}", "allreduce_sum" if op == "sum" else "allreduce_max")


# ============================================================================================
# tile_other_axis: a cut axis that is not repeated


@params
def test_tile_keeps_a_shard_on_an_axis_it_does_not_repeat(world: int, seed: int, uneven: bool) -> None:
    """tile(S[X:Y on A], r) = tile(S, r)[X:Y on A] when r[A] = 1, every other axis repeated."""
    rng = rng_for("tile_other_axis_sl", world, seed)
    ndim = int(rng.integers(2, 4))
    axis = int(rng.integers(0, ndim))
    dim, layout = sharded(rng, axis, world, uneven)
    shape = [dim if a == axis else size(rng, 1, 4) for a in range(ndim)]
    reps = repeats(rng, ndim, {axis: 1})

    def body(g, x, r):
        return gather_or_output(g, g.op("Tile", x["x"], g.ints(reps)), axis, r, world, not uneven)

    case, _, _ = make_case("tile_other_axis_sl", world, {"x": In(shape, layout)}, body)
    witness(case, seed, "tile_other_axis:sl")


@grid
def test_tile_keeps_a_strided_shard_on_an_axis_it_does_not_repeat(world: int, seed: int) -> None:
    """A strided shard (blk: chunk k of each of `stride` blocks) tiled along the other axis keeps
    its blocks; each block read back is a plain shard, all-gathered."""
    rng = rng_for("tile_other_axis_blk", world, seed)
    stride, part = int(rng.integers(2, 4)), size(rng, 1, 2)
    block = world * part
    b = size(rng, 1, 4)
    k = int(rng.integers(2, 4))
    inputs = {"w": In([stride * block, b], {"layout": "shard", "axis": 0, "stride": stride})}

    def body(g, x, r):
        t = g.op("Tile", x["w"], g.ints([1, k]))
        piece = block if r is None else part
        for j in range(stride):
            s = g.op("Slice", t, g.ints([j * piece]), g.ints([(j + 1) * piece]), g.ints([0]))
            gather_or_output(g, s, 0, r, world, True)

    case, _, _ = make_case("tile_other_axis_blk", world, inputs, body)
    witness(case, seed, "tile_other_axis:blk", "block_slice:sl")


# ============================================================================================
# tile_repeated_axis: a cut axis repeated K > 1 times


def _repeated_shard_case(name: str, world: int, seed: int, uneven: bool, read, elementwise: bool = False,
                         least: int = 1):
    """x [.., D on A, ..] sharded on A; tile(x, r) with r[A] = K > 1 on both sides (other axes
    repeated at random); `read(g, t, D_or_part, K, r)` takes what each side outputs."""
    rng = rng_for(name, world, seed)
    ndim = int(rng.integers(1, 4))
    axis = int(rng.integers(0, ndim))
    dim, layout = sharded(rng, axis, world, uneven, least)
    shape = [dim if a == axis else size(rng, 1, 3) for a in range(ndim)]
    k = int(rng.integers(2, 4))
    reps = repeats(rng, ndim, {axis: k})
    own = layout.get("sizes") or [dim // world] * world

    def body(g, x, r):
        t = g.op("Tile", x["x"], g.ints(reps))
        if elementwise:
            t = g.op("Sigmoid", t)
        return t, read(g, t, axis, dim if r is None else own[r], k, r)

    case, seq_ret, rank_rets = make_case(name, world, {"x": In(shape, layout)}, body)
    return case, seq_ret, rank_rets, axis


@params
@pytest.mark.parametrize("spelling", ["slice", "split", "sigmoid_then_slice"])
def test_tile_repeats_a_shard_as_the_same_range_of_every_copy(world: int, seed: int, uneven: bool, spelling: str) -> None:
    """tile(S[X:Y on A], r) = blk(A, D, X, Y) of tile(S, r) when r[A] = K > 1: the rank's copies
    [S[X:Y], .., S[X:Y]] are range [X, Y) of each copy of S. Reading copy j back on both sides
    (Slice, or Split into the K copies; through a Sigmoid first) gives S[X:Y] of copy j."""

    def read(g, t, axis, piece, k, r):
        if spelling == "split":
            copies = g.op_n("Split", t, g.ints([piece] * k), axis=axis, outputs=k)
        else:
            copies = [g.op("Slice", t, g.ints([j * piece]), g.ints([(j + 1) * piece]), g.ints([axis])) for j in range(k)]
        return [gather_or_output(g, c, axis, r, world, not uneven) for c in copies]

    case, _, _, _ = _repeated_shard_case(f"tile_repeated_{spelling}", world, seed, uneven, read,
                                         elementwise=spelling == "sigmoid_then_slice")
    witness(case, seed, "tile_repeated_axis:blk", "block_slice:sl")


@grid
def test_tile_repeats_a_strided_shard_blockwise(world: int, seed: int) -> None:
    """tile(blk(A, I, X, Y) of S, r) = blk(A, I, X, Y) of tile(S, r) when r[A] = K > 1: the
    sequential tile is K * stride blocks of I, the rank keeps [X, Y) of each; every block read
    back is a plain shard, all-gathered."""
    rng = rng_for("tile_repeated_blk", world, seed)
    stride, part = int(rng.integers(2, 4)), size(rng, 1, 2)
    block = world * part
    b, k = size(rng, 1, 3), 2  # (K * stride <= 8 readers of the tile: a tensor read more often seeds no pair)
    inputs = {"w": In([b, stride * block], {"layout": "shard", "axis": 1, "stride": stride})}

    def body(g, x, r):
        t = g.op("Tile", x["w"], g.ints([int(seed % 2) + 1, k]))
        piece = block if r is None else part
        for j in range(k * stride):
            s = g.op("Slice", t, g.ints([j * piece]), g.ints([(j + 1) * piece]), g.ints([1]))
            gather_or_output(g, s, 1, r, world, True)

    case, _, _ = make_case("tile_repeated_blk", world, inputs, body)
    witness(case, seed, "tile_repeated_axis:blk", "block_slice:sl")


# --- refused twins ----------------------------------------------------------------------------


@grid
def test_a_repeated_shard_gathered_as_a_contiguous_shard_is_refused(world: int, seed: int) -> None:
    """Each rank repeats its shard K times and all-gathers the result as if it were a contiguous
    shard of the sequential tile: [S_0, S_0, S_1, S_1] where the sequential program has
    [S_0, S_1, S_0, S_1]. Only the blk relation of the tile may hold, nothing for the gather."""

    def read(g, t, axis, piece, k, r):
        return g.output(t if r is None else g.coll("AllGather", t, everyone(world), axis=axis))

    case, (seq_t, seq_out), ranks, _ = _repeated_shard_case("tile_gathered_as_shard", world, seed, False, read)
    out = refused(case, seed, seq_t, seq_out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) != "blk")
    assert "tile_repeated_axis" in out.lemmas_fired()  # (the tile itself is blk; the gather is not the seq tile)


@grid
def test_a_copy_read_back_at_the_wrong_offset_is_refused(world: int, seed: int) -> None:
    """The ranks read their copy j one index late (a rotation of their shard across two copies,
    at least 2 indices each): not a shard of the sequential copy j."""

    def read(g, t, axis, piece, k, r):
        j = seed % (k - 1)
        lo = j * piece + (0 if r is None else 1)
        c = g.op("Slice", t, g.ints([lo]), g.ints([lo + piece]), g.ints([axis]))
        return c, gather_or_output(g, c, axis, r, world, True)

    case, (_, (seq_c, seq_out)), ranks, _ = _repeated_shard_case("tile_wrong_offset", world, seed, False, read, least=2)
    refused(case, seed, seq_c, seq_out, [o for _, (_, o) in ranks])


@grid
def test_repeats_that_differ_between_the_sides_are_refused(world: int, seed: int) -> None:
    """A replica tiled along another axis by the ranks ([a, K*b] where the sequential program has
    [K*a, b]) and viewed back to the sequential shape."""
    rng = rng_for("tile_other_repeats", world, seed)
    a, b, k = size(rng, 2, 4), size(rng, 2, 4), int(rng.integers(2, 4))

    def body(g, x, r):
        if r is None:
            t = g.op("Tile", x["x"], g.ints([k, 1]))
            return t, g.output(t)
        t = g.op("Reshape", g.op("Tile", x["x"], g.ints([1, k])), g.ints([k * a, b]))
        return t, g.output(t)

    case, (seq_t, seq_out), ranks = make_case("tile_other_repeats", world, {"x": In([a, b], rep())}, body)
    out = refused(case, seed, seq_t, seq_out, [o for _, o in ranks])
    assert "tile" not in out.lemmas_fired()


@grid
def test_a_shard_repeated_more_often_to_the_same_shape_is_refused(world: int, seed: int) -> None:
    """x sharded on axis 0 (D = W * p rows): the sequential program repeats it K times ([K*D]),
    each rank repeats its p rows K*W times, [K*W*p] = the sequential tile's very shape."""
    rng = rng_for("tile_more_repeats", world, seed)
    p, b, k = size(rng, 1, 3), size(rng, 1, 3), int(rng.integers(2, 4))

    def body(g, x, r):
        t = g.op("Tile", x["x"], g.ints([k if r is None else k * world, 1]))
        return t, g.output(t)

    case, (seq_t, seq_out), ranks = make_case("tile_more_repeats", world, {"x": In([world * p, b], shard(0))}, body)
    out = refused(case, seed, seq_t, seq_out, [o for _, o in ranks])
    assert not {"tile", "tile_other_axis", "tile_repeated_axis"} & out.lemmas_fired()
