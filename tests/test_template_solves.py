"""`refine verify --jobs N` (refine/run/template_solves.py): layer templates solved ahead in worker
processes under guessed keys. The run's result must never depend on the guesses or the workers:
the same summaries and fixpoint as one process, with right guesses, wrong ones, guessed solves
that fail, and a worker that dies mid-solve."""

from __future__ import annotations

import json
import os
import random

import pytest

from harness import invoke
from refine.run import memo
from refine.lowering.program import lower_program
from refine.run.memo import run_program
from refine.errors import InputError
from refine.pipeline import verify_dir
from test_lemmas_layers import layered


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A stack of 3 distinct MLP kinds over 6 layers, TP 4 (3 templates in a chain)."""
    return layered.write(tmp_path_factory.mktemp("hybrid") / "m", 6, 4, kinds=3)


@pytest.fixture(scope="module")
def hybrid_buggy(tmp_path_factory):
    """The same with layer 4 (kind 1) a variant whose bias is added on every rank."""
    return layered.write(tmp_path_factory.mktemp("hybrid_bug") / "m", 6, 4, "bias_every_rank", 4, kinds=3)


@pytest.fixture(scope="module")
def alone(hybrid):
    """The one-process run: what every parallel run must give."""
    return run_program(lower_program(hybrid))


def _fixpoint(run: memo.Run) -> dict[str, list]:
    return {name: sorted(map(repr, atoms)) for name, atoms in run.derived.atoms.items()}


def _same_run(run: memo.Run, alone: memo.Run) -> None:
    assert run.summaries == alone.summaries
    assert run.template_solves == alone.template_solves
    assert _fixpoint(run) == _fixpoint(alone)


def test_distinct_layers_solved_ahead(hybrid, alone):
    """A residual stack's keys are guessed right: every template after the first is ready (or
    solved while waiting) when the walk needs it, nothing is wasted, the result is the same."""
    assert len(alone.summaries) == 3 and alone.template_solves == 3
    run = run_program(lower_program(hybrid), jobs=2)
    _same_run(run, alone)
    assert run.solved_ahead >= 2 and run.wasted_solves == 0


def test_wrong_guesses_change_nothing(hybrid, alone, monkeypatch):
    """Guessed summaries with random layouts (so guessed keys no walk meets) cost solves only."""
    rng = random.Random(5)
    layouts = ["rep", "partial", "sl(2,0,4)", "bc(1,1)"]

    def scrambled(self, template, key):  # noqa: ANN001
        return sorted((i, g, j, rng.choice(layouts)) for i, g, j, _lay in key)

    monkeypatch.setattr(memo._ResultShapes, "passed_through", scrambled)
    run = run_program(lower_program(hybrid), jobs=3)
    _same_run(run, alone)
    assert run.wasted_solves >= 1


def test_failing_guessed_solves_are_not_raised(hybrid, alone, monkeypatch):
    """A guessed pair whose solve raises (here: every pair the one-process run never solved)
    is not the run's error: only a pair the walk needs would raise."""
    needed = {(template, key) for template, key in alone.summaries}
    solve = memo.solve_template
    rng = random.Random(6)

    def picky(facts, key, rule_dirs):  # noqa: ANN001
        if not any(key == k for _t, k in needed):
            raise ValueError("a guessed key")
        return solve(facts, key, rule_dirs)

    def scrambled(self, template, key):  # noqa: ANN001
        return sorted((i, g, j, rng.choice(["rep", "partial"])) for i, g, j, _lay in key)

    monkeypatch.setattr(memo, "solve_template", picky)
    monkeypatch.setattr(memo._ResultShapes, "passed_through", scrambled)
    _same_run(run_program(lower_program(hybrid), jobs=2), alone)


def test_error_of_a_needed_solve_is_raised(hybrid, alone, monkeypatch):
    """A solve the walk needs that fails (first in a worker: every template but the first one)
    raises its own error here: bad input stays one line, exit 2, whatever process met it first."""
    program = lower_program(hybrid)
    first = program.templates[alone.sites[0].template]
    solve = memo.solve_template

    def fails(facts, key, rule_dirs):  # noqa: ANN001
        if facts is first:
            return solve(facts, key, rule_dirs)
        raise InputError(None, "rules do not ground: a test")

    monkeypatch.setattr(memo, "solve_template", fails)
    with pytest.raises(InputError, match="a test"):
        run_program(program, jobs=2)


def test_worker_dying_mid_solve(hybrid, alone, monkeypatch):
    """A worker that dies in its solve (killed, out of memory): its pair is solved here."""
    parent = os.getpid()
    solve = memo.solve_template

    def dies_in_workers(facts, key, rule_dirs):  # noqa: ANN001
        if os.getpid() != parent:
            os._exit(9)
        return solve(facts, key, rule_dirs)

    monkeypatch.setattr(memo, "solve_template", dies_in_workers)
    run = run_program(lower_program(hybrid), jobs=2)
    _same_run(run, alone)


def test_bug_found_alike(hybrid_buggy):
    """A buggy layer fails at the same node, with the same verdict, with workers as without."""
    one = verify_dir(hybrid_buggy, simulate=False)
    two = verify_dir(hybrid_buggy, simulate=False, jobs=2)
    assert one.verdict == two.verdict == "unproven"
    assert one.failure is not None and two.failure is not None
    assert (two.failure.node, two.failure.reason) == (one.failure.node, one.failure.reason)
    assert "layers.4" in one.failure.node


def test_cli_jobs(hybrid, tmp_path):
    out = tmp_path / "report.json"
    result = invoke("verify", hybrid, "--jobs", 2, "--no-simulate", "--json", out, "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["verdict"] == "verified"
    assert report["memo"]["templates"] == 3 and report["memo"]["solved_ahead"] >= 2
