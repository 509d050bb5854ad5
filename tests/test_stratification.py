"""The lemma library stays stratified (refine/kit/stratification.py): no rule negates or
aggregates over a predicate of its own recursion. An unstratified library still answers, but
clingo grounds every rule instance of the cycle and leaves it to the solver (the 405B step's
ground program grew by a sixth from one such negation), so the check reads the rule files."""

from __future__ import annotations

from pathlib import Path

from refine.kit.stratification import negative_cycles
from refine.run.engine import builtin_rules_dir


def test_the_library_is_stratified() -> None:
    found = negative_cycles(sorted(builtin_rules_dir().glob("*.lp")))
    assert not found, "\n".join(map(str, found))


def _program(tmp_path: Path, text: str) -> list[Path]:
    path = tmp_path / "lemmas.lp"
    path.write_text(text)
    return [path]


def test_a_negation_inside_the_recursion_is_found(tmp_path: Path) -> None:
    """The shape of the cycle once in reduce.lp: pair <- rel <- reduce_pair <- not differ <- pair."""
    files = _program(tmp_path, """
        pair(N, M) :- seed(N, M), rel(N, M).
        differ(N, M) :- pair(N, M), axis(N, A), not axis(M, A).
        reduce_pair(N, M) :- pair(N, M), not differ(N, M).
        rel(N, M) :- reduce_pair(N, M).
        rel(N, M) :- given(N, M).
    """)
    found = negative_cycles(files)
    assert [(c.line, c.head, c.body) for c in found] == [(4, ("reduce_pair", 2), ("differ", 2))]
    assert "lemmas.lp:4" in str(found[0])


def test_an_aggregate_inside_the_recursion_is_found(tmp_path: Path) -> None:
    files = _program(tmp_path, """
        reach(X) :- start(X).
        reach(Y) :- reach(X), edge(X, Y), K = #count { Z : reach(Z) }, K < 10.
    """)
    assert [(c.head, c.body) for c in negative_cycles(files)] == [(("reach", 1), ("reach", 1))]


def test_negations_of_lower_strata_are_fine(tmp_path: Path) -> None:
    """Negating base facts or a predicate complete below the recursion; aggregates over them."""
    files = _program(tmp_path, """
        mask(N, X) :- known(N), X = #sum { 2 ** A, A : axis(N, A) }.
        pair(N, M) :- seed(N, M), rel(N, M), not crowded(M).
        reduce_pair(N, M) :- pair(N, M), mask(N, X), mask(M, X).
        rel(N, M) :- reduce_pair(N, M), not blocked(N).
        rel(N, M) :- given(N, M).
    """)
    assert negative_cycles(files) == []


# --- reduce.lp's axes compared as a number (red_axes_mask): a numeric witness --------------------

import pytest  # noqa: E402

from harness import rep, shard, world_seed_grid  # noqa: E402
from test_lemmas_structure import In, make_case, refused, rng_for, size, witness  # noqa: E402


@pytest.mark.parametrize("world,seed", world_seed_grid((2, 3), (0, 1)))
@pytest.mark.parametrize("rank_axis", [-1, 1, 0], ids=["same_negative", "same", "other"])
def test_reduce_axes_given_as_inputs_pair_by_their_set(world: int, seed: int, rank_axis: int) -> None:
    """ReduceSum over axes given as an input: the sequential program over axis 1 of x [a, b]
    (rows sharded), each rank over `rank_axis`. Axis -1 and 1 are one axis (the mask of the set
    is equal): the shard is kept; axis 0 is another set: refused."""
    rng = rng_for(f"red_mask_{rank_axis}", world, seed)
    a, b = world * size(rng, 1, 3), size(rng)
    inputs = {"x": In([a, b], shard(0)), "k": In([b], rep())}

    def body(g, x, r):
        axis = 1 if r is None else rank_axis
        y = g.op("ReduceSum", g.op("Mul", x["x"], x["k"]), g.ints([axis]), keepdims=1)
        return y, g.output(y)

    case, (s, out), ranks = make_case(f"red_mask_{rank_axis}", world, inputs, body)
    if rank_axis == 0:
        refused(case, seed, s, out, [o for _, o in ranks])
    else:
        witness(case, seed, "reduce")
