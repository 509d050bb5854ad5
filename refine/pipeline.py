"""The steps chained: lower -> run -> report. The CLI and tests call these."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from refine.engine import solve
from refine.facts import FactSet, read_facts_dir, write_facts_dir
from refine.lower import lower_dir
from refine.report import Report, build_report


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


def run_facts(facts: FactSet, name: str, rule_dirs: list[Path] | None = None, lower_seconds: float = 0.0) -> Report:
    """Run the lemma library over facts and build the report."""
    derived = solve(facts, rule_dirs)
    return build_report(name, facts, derived, lower_seconds)


def run_facts_dir(facts_dir: Path, rule_dirs: list[Path] | None = None) -> Report:
    return run_facts(read_facts_dir(facts_dir), facts_dir.name, rule_dirs)


def verify_dir(model_dir: Path, rule_dirs: list[Path] | None = None) -> Report:
    """Lower and run in one step."""
    start = time.perf_counter()
    facts = lower_dir(model_dir)
    return run_facts(facts, model_dir.name, rule_dirs, time.perf_counter() - start)
