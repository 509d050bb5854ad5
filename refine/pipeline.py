"""The steps chained: lower -> run -> report (-> counterexample). The CLI and tests call these."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from refine import counterexample
from refine.engine import solve
from refine.facts import FactSet, read_facts_dir, write_facts_dir
from refine.lower import lower_dir
from refine.report import Report, build_report

FACTS_ONLY = ("not checked: `refine run --facts` has facts but no ONNX models to simulate, so its verdict is "
              "verified or unproven only; `refine verify MODEL_DIR` searches for a counterexample")
NO_SIMULATE = "not checked (--no-simulate): without a numeric counterexample the verdict is verified or unproven only"


def lower_to_dir(model_dir: Path, out_dir: Path) -> FactSet:
    """Lower a model directory and write its facts to `out_dir`, all or nothing."""
    facts = lower_dir(model_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".refine-facts-", dir=out_dir.parent))
    try:
        write_facts_dir(facts, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return facts


def run_facts(facts: FactSet, name: str, rule_dirs: list[Path] | None = None, lower_seconds: float = 0.0,
              explain: str | None = None) -> Report:
    """Run the lemma library over facts and build the (static) report."""
    derived = solve(facts, rule_dirs)
    return build_report(name, facts, derived, lower_seconds, explain=explain)


def run_facts_dir(facts_dir: Path, rule_dirs: list[Path] | None = None, explain: str | None = None) -> Report:
    """`refine run`: facts only, so a failure stays unproven (no ONNX to look for a counterexample)."""
    report = run_facts(read_facts_dir(facts_dir), facts_dir.name, rule_dirs, explain=explain)
    if report.verdict != "verified":
        report.numeric = counterexample.not_run(FACTS_ONLY)
    return report


def verify_dir(model_dir: Path, rule_dirs: list[Path] | None = None, *, simulate: bool = True,
               explain: str | None = None, seeds: tuple[int, ...] = counterexample.SEEDS) -> Report:
    """Lower and run in one step; after a failed proof, look for a numeric counterexample
    (`refuted` only with one) unless `simulate` is False."""
    start = time.perf_counter()
    facts = lower_dir(model_dir)
    lower_seconds = time.perf_counter() - start
    derived = solve(facts, rule_dirs)
    report = build_report(model_dir.name, facts, derived, lower_seconds, explain=explain)
    if report.verdict == "verified":
        return report
    if not simulate:
        report.numeric = counterexample.not_run(NO_SIMULATE)
        return report
    return counterexample.attach(report, model_dir, facts, derived, seeds)
