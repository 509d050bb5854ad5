"""Numeric witnesses for convolutions and running sums of replicas (rules/routing.lp `replica_op`
with Conv and CumSum): the short causal convolutions and segment sums of Mamba and LFM blocks,
which HF's plans for those models leave replicated (only the embedding is vocab-parallel): a
1-D depthwise conv with padding, a 2-D one with a bias, CumSum plain, exclusive and reversed.
Refused twins: every rank convolving its own slice of the channels where the sequential program
convolves them all (the output is no replica), a rank whose weight is its own shard while the
sequential weight is whole, and a running sum along the sharded axis (each rank's sums restart
at its own first index).
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import rep, shard, world_seed_grid
from test_lemmas_structure import In, make_case, refused, rng_for, size, witness

grid = pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1, 2)))


@grid
def test_conv_of_replicas(world: int, seed: int) -> None:
    """y = conv1d(x, w) depthwise (group = channels, causal padding), z = conv2d(x2, w2, b): every
    input a replica, every output a replica on every rank."""
    rng = rng_for("conv_rep", world, seed)
    b, c, t, k = size(rng), size(rng), size(rng, 3, 8), int(rng.integers(2, 4))
    h, w_, o = size(rng, 3, 6), size(rng, 3, 6), size(rng)
    inputs = {"x": In([b, c, t], rep()), "w": In([c, 1, k], rep()),
              "x2": In([b, c, h, w_], rep()), "w2": In([o, c, 2, 2], rep()), "b2": In([o], rep())}

    def body(g, x, r):
        g.output(g.op("Conv", x["x"], x["w"], group=c, pads=[k - 1, 0], kernel_shape=[k]))
        g.output(g.op("Tanh", g.op("Conv", x["x2"], x["w2"], x["b2"], kernel_shape=[2, 2], strides=[1, 2])))

    case, _, _ = make_case("conv_rep", world, inputs, body)
    witness(case, seed, "replica_op:rep", "elementwise")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_conv_of_a_channel_slice_is_refused(world: int, seed: int) -> None:
    """The channels are sharded over the ranks and each rank convolves its own slice with the whole
    (replicated) weight's first channels, depthwise: not a replica of the sequential output."""
    rng = rng_for("conv_slice", world, seed)
    b, per, t, k = size(rng), size(rng, 1, 3), size(rng, 3, 8), 2
    c = world * per
    inputs = {"x": In([b, c, t], shard(1)), "w": In([c, 1, k], rep())}

    def body(g, x, r):
        w = x["w"] if r is None else g.op("Slice", x["w"], g.ints([0]), g.ints([per]), g.ints([0]))
        y = g.op("Conv", x["x"], w, group=c if r is None else per, pads=[k - 1, 0], kernel_shape=[k])
        out = y if r is None else g.coll("AllGather", y, list(range(world)), axis=1)
        g.output(g.op("Tanh", out))
        return y

    case, seq_y, _ = make_case("conv_slice", world, inputs, body)
    # (rank 0's slice is right by luck of order: the check is that no relation claims a replica)
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks],
            wrong=lambda t, lay: lay == "rep")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_conv_with_a_sharded_weight_is_refused(world: int, seed: int) -> None:
    """The output channels' weight is sharded over the ranks and each rank's conv output (its own
    channels) is taken as the whole: no replica."""
    rng = rng_for("conv_weight", world, seed)
    b, c, t = size(rng), size(rng), size(rng, 3, 8)
    o = world * size(rng, 1, 3)
    inputs = {"x": In([b, c, t], rep()), "w": In([o, c, 2], shard(0))}

    def body(g, x, r):
        y = g.op("Conv", x["x"], x["w"], kernel_shape=[2])
        g.output(g.op("ReduceSum", y, g.ints([1]), keepdims=1))
        return y

    case, seq_y, _ = make_case("conv_weight", world, inputs, body)
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks],
            wrong=lambda t, lay: lay == "rep")


@grid
def test_cumsum_of_replicas(world: int, seed: int) -> None:
    """CumSum of a replica along any axis (exclusive, reversed or plain) is a replica."""
    rng = rng_for("cumsum_rep", world, seed)
    shape = [size(rng), size(rng), size(rng)]
    axis = int(rng.integers(-3, 3))
    inputs = {"x": In(shape, rep())}

    def body(g, x, r):
        g.output(g.op("CumSum", x["x"], g.const(axis, np.int64), exclusive=seed % 2, reverse=int(seed == 2)))

    case, _, _ = make_case("cumsum_rep", world, inputs, body)
    witness(case, seed, "replica_op:rep")


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3, 4), (0, 1)))
def test_cumsum_along_the_sharded_axis_is_refused(world: int, seed: int) -> None:
    """Each rank's running sum of its own shard restarts at zero: not the sequential sums' slice."""
    rng = rng_for("cumsum_shard", world, seed)
    per, b = size(rng, 1, 3), size(rng)
    inputs = {"x": In([b, world * per], shard(1))}

    def body(g, x, r):
        y = g.op("CumSum", x["x"], g.const(1, np.int64))
        g.output(y if r is None else g.coll("AllGather", y, list(range(world)), axis=1))
        return y

    case, seq_y, _ = make_case("cumsum_shard", world, inputs, body)
    refused(case, seed, seq_y, case.seq.outputs[0], [g.outputs[0] for g in case.ranks])
