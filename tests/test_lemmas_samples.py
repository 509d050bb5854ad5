"""Numeric witnesses for per-sample ops over a data-parallel rank's samples (rules/samples.lp): a
convolutional net whose ranks each run the whole model on a slice of the batch (DDP, FSDP).

Each rank holds samples [lo, hi) of the batch (axis 0), the weights replicated; a convolution
(grouped or not), a max-pool, an average pool, instance normalization, a global average pool and
batch normalization in inference mode each give the rank the same samples of the sequential output.

Refused (a real numeric difference; not verified; whatever is derived holds): batch normalization in
training mode (each rank normalizes by its own samples' statistics: the DDP BatchNorm bug without
SyncBatchNorm), and a max-pool's indices (flat over the whole batch: a rank's are offset by its
first sample).

A max-pool's indices within each plane (torch.onnx's `max_pool2d_with_indices`: the indices minus a
unit pool's at spatial position 0) are per-sample (`plane_index`); refused: the offsets of a unit
pool of another tensor (the pooled output's planes are smaller).

A convolution's weight gradient as exporters/capture/conv_backward.py writes it (the batch folded
into the channels, one group per sample and input channel, then summed over the batch): a rank's
samples are a run of the groups (`grouped_channels`), and the sum over them a partial sum the
all-reduce completes; refused: every rank's filters those of rank 0's samples.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import rep, shard
from test_lemmas_structure import FLOAT, In, grid, make_case, refused, rng_for, size, witness

BUGS = {
    "batch_norm_training": "batch normalization in training mode: each rank's statistics are of its own samples",
    "pool_indices": "a max-pool's indices, flat over the whole batch, used as values",
}


def samples_case(name: str, world: int, seed: int, bug: str | None = None):
    """seq: the net on the whole batch; rank r: the same net on its samples (shard(0) of x)."""
    rng = rng_for(name, world, seed)
    n, groups = size(rng, 1, 3), int(rng.choice([1, 2]))
    channels, out_channels, height, width = 2 * size(rng, 1, 2), 2 * size(rng, 1, 3), size(rng, 4, 7), size(rng, 4, 7)
    inputs = {"x": In([world * n, channels, height, width], shard(0)),
              "w": In([out_channels, channels // groups, 3, 3], rep()), "b": In([out_channels], rep()),
              "scale": In([out_channels], rep()), "shift": In([out_channels], rep())}
    stats = {"mean": rng.standard_normal(out_channels).astype(np.float32),
             "var": (rng.random(out_channels) + 0.5).astype(np.float32)}

    def body(g, x: dict[str, str], r: int | None) -> str:
        y = g.op("Relu", g.op("Conv", x["x"], x["w"], x["b"], group=groups, pads=[1, 1, 1, 1], kernel_shape=[3, 3]))
        pooled, indices = g.op_n("MaxPool", y, outputs=2, kernel_shape=[2, 2], strides=[2, 2])
        if bug == "pool_indices":
            pooled = g.op("Add", pooled, g.op("Cast", indices, to=FLOAT))
        y = g.op("AveragePool", pooled, kernel_shape=[1, 2], strides=[1, 1], pads=[0, 0, 0, 1])
        y = g.op("InstanceNormalization", y, x["scale"], x["shift"], epsilon=1e-5)
        if bug == "batch_norm_training":
            y = g.op_n("BatchNormalization", y, x["scale"], x["shift"], g.const(stats["mean"]), g.const(stats["var"]),
                       outputs=3, training_mode=1)[0]
        else:
            y = g.op("BatchNormalization", y, x["scale"], x["shift"], g.const(stats["mean"]), g.const(stats["var"]))
        return g.output(g.op("Add", y, g.op("GlobalAveragePool", y)))

    return make_case(name, world, inputs, body)


@grid
def test_per_sample_ops_keep_the_ranks_samples(world: int, seed: int) -> None:
    case, _, _ = samples_case("samples", world, seed)
    witness(case, seed, "per_sample")


@pytest.mark.parametrize("bug", list(BUGS))
@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_batch_statistics_and_pool_indices_are_refused(world: int, seed: int, bug: str) -> None:
    case, y, outs = samples_case(f"samples_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)


def plane_index_case(name: str, world: int, seed: int, bug: str | None = None):
    """seq and rank r: a 2 x 2 max-pool's indices minus a unit pool's at spatial position 0, as
    floats; `other_planes`: the unit pool of the pooled output instead (smaller planes)."""
    rng = rng_for(name, world, seed)
    n, channels, height, width = size(rng, 1, 3), size(rng, 1, 3), 2 * size(rng, 2, 3), 2 * size(rng, 2, 3)
    inputs = {"x": In([world * n, channels, height, width], shard(0))}

    def body(g, x: dict[str, str], r: int | None) -> str:
        pooled, indices = g.op_n("MaxPool", x["x"], outputs=2, kernel_shape=[2, 2], strides=[2, 2])
        source = pooled if bug == "other_planes" else x["x"]
        _, every = g.op_n("MaxPool", source, outputs=2, kernel_shape=[1, 1], strides=[1, 1])
        offsets = g.op("Slice", every, g.ints([0, 0]), g.ints([1, 1]), g.ints([2, 3]))
        return g.output(g.op("Cast", g.op("Sub", indices, offsets), to=FLOAT))

    return make_case(name, world, inputs, body)


@grid
def test_pool_indices_within_their_plane_are_per_sample(world: int, seed: int) -> None:
    case, _, _ = plane_index_case("plane_index", world, seed)
    witness(case, seed, "plane_index")


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_pool_indices_minus_another_tensors_offsets_are_refused(world: int, seed: int) -> None:
    case, y, outs = plane_index_case("plane_index_other_planes", world, seed, "other_planes")
    refused(case, seed, y, y, outs)


def weight_gradient_case(name: str, world: int, seed: int, bug: str | None = None):
    """A convolution's weight gradient over the batch (conv_backward.py `_weight_grad`, one group
    per sample and input channel): seq over the whole batch; rank r over its samples, the sum over
    them all-reduced. `first_samples`: every rank's filters are those of rank 0's samples."""
    rng = rng_for(name, world, seed)
    n, cin, per_out, height, width, kernel = (size(rng, 1, 2), size(rng, 1, 3), size(rng, 1, 3), size(rng, 4, 6),
                                              size(rng, 4, 6), size(rng, 2, 3))
    grad_h, grad_w = height - kernel + 1, width - kernel + 1
    batch = world * n
    inputs = {"x": In([batch, cin, height, width], shard(0)), "grad": In([batch, per_out, grad_h, grad_w], shard(0))}
    if bug == "first_samples":
        inputs["grad"] = In([batch, per_out, grad_h, grad_w], rep())

    def body(g, x: dict[str, str], r: int | None) -> str:
        samples = batch if r is None else n
        grad = x["grad"]
        if r is not None and bug == "first_samples":
            grad = g.op("Slice", grad, g.ints([0]), g.ints([n]), g.ints([0]))
        filters = g.op("Expand", g.op("Reshape", grad, g.ints([samples, 1, 1, per_out, grad_h, grad_w])),
                       g.ints([samples, 1, cin, per_out, grad_h, grad_w]))
        filters = g.op("Reshape", filters, g.ints([samples * cin * per_out, 1, grad_h, grad_w]))
        folded = g.op("Reshape", x["x"], g.ints([1, samples * cin, height, width]))
        w = g.op("Conv", folded, filters, group=samples * cin, kernel_shape=[grad_h, grad_w])
        w = g.op("ReduceSum", g.op("Reshape", w, g.ints([samples, 1, cin, per_out, kernel, kernel])), g.ints([0]), keepdims=0)
        w = g.op("Reshape", g.op("Transpose", w, perm=[0, 2, 1, 3, 4]), g.ints([per_out, cin, kernel, kernel]))
        return g.output(w if r is None else g.coll("AllReduce", w, list(range(world)), reduce_op="sum"))

    return make_case(name, world, inputs, body)


@grid
def test_a_ranks_samples_are_a_run_of_the_weight_gradients_groups(world: int, seed: int) -> None:
    case, _, _ = weight_gradient_case("grouped_channels", world, seed)
    witness(case, seed, "grouped_channels")


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_filters_of_other_samples_are_refused(world: int, seed: int) -> None:
    case, y, outs = weight_gradient_case("grouped_channels_first_samples", world, seed, "first_samples")
    # (rank 0's own sum is a true piece of the sequential sum: only the all-reduced replica is wrong)
    refused(case, seed, y, y, outs, wrong=lambda t, lay: lay == "rep")
