"""The bundled examples: each correct one verifies, each buggy twin fails at the node its
refine.json names, every relation derived on any of them holds numerically, and the committed
files are exactly what examples/build.py produces."""

from __future__ import annotations

import pytest

from conftest import EXAMPLES_DIR, load_example_builder
from refine.config import load_config
from refine.diagnose.counterexample import attach
from refine.run.engine import solve
from refine.lowering.graphs import lower_dir
from refine.diagnose.diagnosis import build_report
from refine.diagnose.simulate import simulate_dir
from refine.diagnose.witness import check

NAMES = [ex.name for ex in load_example_builder().EXAMPLES]


def test_committed_examples_are_current(fresh_examples):
    for name in NAMES:
        built = sorted(p.name for p in (fresh_examples / name).iterdir())
        committed = sorted(p.name for p in (EXAMPLES_DIR / name).iterdir())
        assert built == committed, name
        for file in built:
            assert (fresh_examples / name / file).read_bytes() == (EXAMPLES_DIR / name / file).read_bytes(), \
                f"examples/{name}/{file} is stale: run python examples/build.py"


@pytest.mark.parametrize("name", NAMES)
def test_example_verdict_and_numbers(name):
    model_dir = EXAMPLES_DIR / name
    expect = load_config(model_dir).expect
    assert expect is not None
    facts = lower_dir(model_dir)
    derived = solve(facts)
    report = attach(build_report(name, facts, derived), model_dir, facts, derived)  # refuted: by the numbers

    assert report.verdict == expect.verdict, report.failure
    if expect.node is not None:
        assert report.failure is not None and report.failure.node == expect.node
        assert report.failure.location is not None and report.failure.location.file == "examples/build.py"
    else:
        assert report.failure is None
        assert all(o.ok and o.reconstruction for o in report.outputs)
    assert not report.sanity_violations
    assert not report.collective_mismatches

    for seed in (0, 1):
        numbers = check(derived, simulate_dir(model_dir, seed=seed), seed)
        assert numbers.ok, numbers.violations[:3]
        assert numbers.checked > 0
