"""The strided shard layout (`"stride"` in refine.json: Megatron's partition_stride).

A strided shard's axis is `stride` equal blocks; rank k holds chunk k of every block, in block
order. Its lemma witnesses (a matmul with a strided weight, split into whole blocks) are in
test_lemmas_structure.py; here: the layout's arithmetic, its validation, how lowering declares
it, and bad input.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from harness import Case, Graph, run_case
from refine.config import ShardLayout, shard_bounds, shard_indices
from refine.errors import InputError
from refine.lowering.graphs import lower_models
from refine.diagnose.simulate import cut_shards, place_shards


def strided(axis: int, stride: int) -> ShardLayout:
    return ShardLayout(layout="shard", axis=axis, stride=stride)


def test_shard_indices_of_a_strided_shard_take_chunk_k_of_every_block() -> None:
    # 12 = 3 blocks of 4; two ranks: rank 0 holds [0,1], [4,5], [8,9]
    assert shard_indices(strided(0, 3), 12, 2) == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    # stride 1 is the plain shard
    assert shard_indices(strided(0, 1), 6, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="not 3 blocks of 2 equal chunks"):
        shard_indices(strided(0, 3), 9, 2)
    with pytest.raises(ValueError, match="ranges, not one"):
        shard_bounds(strided(0, 2), 8, 2)  # a strided shard has no single range per rank


@pytest.mark.parametrize("world,stride,axis", [(2, 2, 0), (3, 2, 1), (4, 3, -1)])
def test_cut_and_place_are_inverse_and_match_megatron(world: int, stride: int, axis: int) -> None:
    """cut_shards is what Megatron's master-weight split does (`torch.split` into pieces of
    size/(world*stride), rank k keeping pieces k, k+world, ...), and place_shards undoes it."""
    rng = np.random.default_rng(world * 10 + stride)
    shape = [3, world * stride * 2]
    if axis == 0:
        shape = shape[::-1]
    value = rng.standard_normal(shape)
    layout = strided(axis, stride)
    parts = cut_shards(layout, value, world)
    a = axis % value.ndim
    pieces = np.split(value, world * stride, axis=a)
    for k, part in enumerate(parts):
        assert np.array_equal(part, np.concatenate(pieces[k::world], axis=a))
    assert np.array_equal(place_shards(layout, parts), value)


def test_stride_with_sizes_or_below_one_is_invalid() -> None:
    with pytest.raises(ValidationError, match="stride or sizes"):
        ShardLayout.model_validate({"layout": "shard", "axis": 0, "stride": 2, "sizes": [2, 2]})
    with pytest.raises(ValidationError):
        ShardLayout.model_validate({"layout": "shard", "axis": 0, "stride": 0})


def _strided_case(world: int, rows: int, stride: int) -> Case:
    seq = Graph()
    seq.output(seq.op("Relu", seq.input("w", [rows, 3])))
    ranks = []
    for _ in range(world):
        g = Graph()
        g.output(g.op("Relu", g.input("w", [rows // world, 3])))
        ranks.append(g)
    return Case("strided", seq, ranks, {"w": {"layout": "shard", "axis": 0, "stride": stride}})


def test_lowering_declares_a_strided_shard_as_blocks() -> None:
    """w [8, 3] with stride 2 over 2 ranks: rank k is blk(0, 4, 2k, 2k+2) of w, and a program that
    only applies Relu to it verifies (its output is rebuilt by interleaving)."""
    facts = lower_models(_strided_case(2, 8, 2).loaded())
    declared = sorted(facts.rows["input_rel"])
    assert [str(r[2]) for r in declared] == ["blk(0,4,0,2)", "blk(0,4,2,4)"]
    outcome = run_case(_strided_case(2, 8, 2))
    assert outcome.checked.ok, outcome.checked.violations
    assert outcome.report.verdict == "verified"


def test_a_strided_shard_that_does_not_divide_is_bad_input(tmp_path) -> None:
    """10 rows are not 2 blocks of 2 ranks' equal chunks: one line naming refine.json."""
    case = _strided_case(2, 10, 2)
    model_dir = case.save(tmp_path / "m")
    config = json.loads((model_dir / "refine.json").read_text())
    assert config["inputs"]["w"] == {"layout": "shard", "axis": 0, "stride": 2}
    with pytest.raises(InputError, match=r"refine.json: input 'w': size 10 is not 2 blocks of 2 equal chunks"):
        lower_models(case.loaded())
