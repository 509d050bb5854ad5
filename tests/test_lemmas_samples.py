"""Numeric witnesses for per-sample ops over a data-parallel rank's samples (rules/samples.lp): a
convolutional net whose ranks each run the whole model on a slice of the batch (DDP, FSDP).

Each rank holds samples [lo, hi) of the batch (axis 0), the weights replicated; a convolution
(grouped or not), a max-pool, an average pool, instance normalization, a global average pool and
batch normalization in inference mode each give the rank the same samples of the sequential output.

Refused (a real numeric difference; not verified; whatever is derived holds): batch normalization in
training mode (each rank normalizes by its own samples' statistics: the DDP BatchNorm bug without
SyncBatchNorm), and a max-pool's indices (flat over the whole batch: a rank's are offset by its
first sample).
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
