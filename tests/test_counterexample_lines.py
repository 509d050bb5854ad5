"""Reconstructions of an undeclared output held by a block of a mesh's ranks (a pipeline stage's:
refine/diagnose/counterexample.py `_line_candidates`): every holder takes part, as one concatenation
(or sum) per complete line of holders along a mesh dim, every line's the output. A correct stage's
gradient, a partial sum over tp (a row-parallel bias's) and the same on every dp row, is rebuilt
(the sum of every holder counts each dp row once too often); a row whose term differs is not (the
line that fits worst stands for them)."""

from __future__ import annotations

import numpy as np

from refine.config import ModelConfig
from refine.diagnose.counterexample import _score, _every_rank_candidates

CONFIG = ModelConfig.model_validate({"world_size": 8, "mesh": {"shape": [2, 2, 2], "dims": ["pp", "dp", "tp"]},
                                     "inputs": {}, "outputs": {}})


def stage_holders(expected: np.ndarray, stage: int, broken_row: int | None = None) -> list[tuple[str, np.ndarray]]:
    """Stage `stage`'s ranks (pp, dp, tp) = (stage, d, t): TP term t of `expected` (two terms that
    add up to it) on every dp row (row `broken_row`'s term 1 off by one)."""
    first = np.random.default_rng(stage).standard_normal(expected.shape)
    out = []
    for d in range(2):
        for t in range(2):
            term = (first if t == 0 else expected - first).copy()
            if d == broken_row and t == 1:
                term[0, 0] += 1.0
            out.append((f"r{stage * 4 + d * 2 + t}:grad", term))
    return out


def test_a_stage_gradient_partial_over_tp_on_every_dp_row_is_rebuilt() -> None:
    rng = np.random.default_rng(3)
    expected = rng.standard_normal((3, 4)) * np.array([1.0, -2.0, 0.5, 3.0])
    for stage in (0, 1):
        comparison = _score("grad", expected, _every_rank_candidates(expected, stage_holders(expected, stage), CONFIG))
        assert comparison.matches, comparison
        assert comparison.best is not None and comparison.best.candidate.startswith("sum over tp of each line")


def test_a_dp_row_whose_term_differs_is_not_rebuilt() -> None:
    rng = np.random.default_rng(4)
    expected = rng.standard_normal((3, 4))
    for broken in (0, 1):
        comparison = _score("grad", expected,
                            _every_rank_candidates(expected, stage_holders(expected, 1, broken_row=broken), CONFIG))
        assert not comparison.matches, comparison
