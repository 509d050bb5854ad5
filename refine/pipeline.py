"""The steps chained, each in its own home; the CLI and tests call these:

    load + lower     refine/lowering/ (model directory -> Program: facts, layer templates)
    run              refine/run/memo.py over refine/run/engine.py (the lemma library to a fixpoint)
    report           refine/diagnose/diagnosis.py (what failed, where, why) into refine/report/schema.py's schema
    counterexample   refine/diagnose/counterexample.py (refuted only with numbers, else unproven)

Function-form models (docs/layers.md) are memoized unless `memo=False`: the run then reads
relations of each layer call from its template's summary (refine/run/memo.py), and a failure inside
a layer is reported from that layer's own facts (names `CALL/NAME`, like the simulator's).
"""

from __future__ import annotations

import time
from pathlib import Path

from refine.diagnose import counterexample, reduced
from refine.diagnose.silent import silent_ranks_warning

from refine.report import render

from refine.kit import rulecheck
from refine.run.engine import Derived, solve
from refine.lowering.facts import FactSet
from refine.lowering.load import RowSymmetry
from refine.lowering.program import Program, lower_program, read_program, write_program
from refine.run.memo import Progress, Run, failing_instance, run_program
from refine.diagnose.diagnosis import build_report
from refine.report.schema import Report, RuleCheck

FACTS_ONLY = ("not checked: `refine run --facts` has facts but no ONNX models to simulate, so its verdict is "
              "verified or unproven only; `refine verify MODEL_DIR` searches for a counterexample")
NO_SIMULATE = "not checked (--no-simulate): without a numeric counterexample the verdict is verified or unproven only"


def lower_to_dir(model_dir: Path, out_dir: Path, memo: bool = True) -> Program:
    """Lower a model directory and write its facts to `out_dir`, all or nothing."""
    program = lower_program(model_dir, memo)
    write_program(program, out_dir)
    return program


def run_facts(program: Program | FactSet, name: str, rule_dirs: list[Path] | None = None, lower_seconds: float = 0.0,
              explain: str | None = None, progress: Progress | None = None) -> Report:
    """Run the lemma library over a program and build the (static) report."""
    report, _facts, _derived = _run_and_report(_as_program(program), name, rule_dirs, lower_seconds, explain, progress)
    return report


def run_facts_dir(facts_dir: Path, rule_dirs: list[Path] | None = None, explain: str | None = None,
                  progress: Progress | None = None) -> Report:
    """`refine run`: facts only, so a failure stays unproven (no ONNX to look for a counterexample)."""
    report = run_facts(read_program(facts_dir), facts_dir.name, rule_dirs, explain=explain, progress=progress)
    if report.verdict != "verified":
        report.numeric = counterexample.not_run(FACTS_ONLY)
    return report


def verify_dir(model_dir: Path, rule_dirs: list[Path] | None = None, *, simulate: bool = True,
               explain: str | None = None, seeds: tuple[int, ...] = counterexample.SEEDS, memo: bool = True,
               progress: Progress | None = None, sim_memory_gib: float = counterexample.SIM_MEMORY_GIB,
               rule_check: bool = True, jobs: int = 1) -> Report:
    """Lower and run in one step; after a failed proof, look for a numeric counterexample
    (`refuted` only with one) unless `simulate` is False, or the simulation would hold more
    than `sim_memory_gib` of values. With user lemmas (`rule_dirs`) and `rule_check`, every
    relation derived on the model is checked on a simulation too (refine/kit/rulecheck.py), and a
    proof that rests on one that does not hold is unproven. `jobs` > 1 solves layer templates
    ahead in worker processes (refine/run/template_solves.py)."""
    start = time.perf_counter()
    if progress:
        progress("lowering")
    # (user lemmas are checked on the numbers of the relations derived, which a reduced program
    # derives for one row only: they get the whole plan)
    program = lower_program(model_dir, memo, rows=not rule_dirs)
    lower_seconds = time.perf_counter() - start
    report, facts, derived = _run_and_report(program, model_dir.name, rule_dirs, lower_seconds, explain, progress,
                                             locate=program.rows is None, jobs=jobs)
    warning = silent_ranks_warning(program)
    if program.rows is not None and report.verdict == "verified":
        report.rows = rows_words(program.rows, program.main)
    elif program.rows is not None:  # the first row fails alone: find and report it on every row
        if progress:
            progress("the first row did not verify alone: lowering every row")
        program = lower_program(model_dir, memo)
        lower_seconds = time.perf_counter() - start
        report, facts, derived = _run_and_report(program, model_dir.name, rule_dirs, lower_seconds, explain, progress,
                                                 jobs=jobs)
    if warning is not None:
        report.warnings.append(warning)
    if rule_dirs and rule_check:
        flat = derived if not program.templates else None  # (a plain program's fixpoint is the flat one)
        _check_user_lemmas(report, model_dir, program, rule_dirs, sim_memory_gib, progress, flat)
    if report.verdict == "verified":
        return report
    if not simulate:
        report.numeric = counterexample.not_run(NO_SIMULATE)
        return report
    skipped = counterexample.over_memory(counterexample.simulation_bytes(program), sim_memory_gib)
    if skipped is not None:  # too big to run: the same export at reduced sizes, if refine made it
        if progress and reduced.reducible(model_dir):
            progress("searching for a counterexample on the export at reduced sizes")
        report.numeric = reduced.search(model_dir, seeds, sim_memory_gib, skipped, verify_dir)
        if report.numeric.status in counterexample.REFUTING:
            report.verdict = "refuted"
        return report
    if progress:
        progress("searching for a counterexample")
    return counterexample.attach(report, model_dir, facts, derived, seeds)


def rows_words(rows: RowSymmetry, main: FactSet) -> str:
    """What a verified reduced program says of the rows it did not lower."""
    ranks = sorted({int(r) for _g, kind, r in main.rows["graph"] if kind == "rank"})
    columns = bool(main.rows["mirror_member"])
    return (f"the {rows.rows} rows along {rows.dim} run the same programs on their own batch chunks"
            + (", joined by calls over each column" if columns else "") + ": "
            f"row {rows.dim}=0 (ranks {render.group_text(ranks)}) verified, the other rows by symmetry (docs/rows.md)"
            + (" (their files are not stored: refine.json declares them row 0's copies)" if rows.declared else "")
            + ("; the outputs below name row 0's ranks, and each rank of another row holds what its row-0 "
               "counterpart does" if columns else ""))


def _check_user_lemmas(report: Report, model_dir: Path, program: Program, rule_dirs: list[Path],
                       sim_memory_gib: float, progress: Progress | None, flat: Derived | None) -> None:
    """Defence in depth for user lemmas: the relations derived on the model checked on its own
    shapes; a violation takes "verified" away (unproven, naming the lemma and the relation)."""
    skipped = counterexample.over_memory(counterexample.simulation_bytes(program), sim_memory_gib)
    if skipped is not None:
        report.rule_check = RuleCheck(status="not_run", summary=f"the user lemmas were not checked on the numbers: "
                                                                f"{skipped.summary}")
        return
    if progress:
        progress("checking the user lemmas on the numbers")
    report.rule_check = rulecheck.check_derived(model_dir, rule_dirs, derived=flat)
    if report.rule_check.status == "violated" and report.verdict == "verified":
        report.verdict = "unproven"


def _as_program(program: Program | FactSet) -> Program:
    return program if isinstance(program, Program) else Program(program)


def _run_and_report(program: Program, name: str, rule_dirs: list[Path] | None, lower_seconds: float,
                    explain: str | None, progress: Progress | None, locate: bool = True,
                    jobs: int = 1) -> tuple[Report, FactSet, Derived]:
    """The report, and the facts and fixpoint its failure (if any) was read from: a failing
    layer call is reported from the layer's own facts, so the failure names a node inside it.
    Without `locate`, a failure is not looked into (a reduced run's, which is redone whole)."""
    run = run_program(program, rule_dirs, progress, elide=explain is None, jobs=jobs)
    report = build_report(name, program.main, run.derived, lower_seconds, explain=explain, rule_dirs=rule_dirs,
                          closest_lemma=locate and not run.elided)
    if not locate:
        return report, program.main, run.derived
    if report.verdict != "verified" and run.elided:  # locate the failure on the whole graphs
        first = run
        run = run_program(program, rule_dirs, progress, elide=False, learned=first, jobs=jobs)
        run.derived.seconds += first.derived.seconds
        run.main_solves += first.main_solves
        run.template_solves += first.template_solves
        run.solved_ahead += first.solved_ahead
        run.aliased += first.aliased
        run.wasted_solves += first.wasted_solves
        report = build_report(name, program.main, run.derived, lower_seconds, explain=explain, rule_dirs=rule_dirs)
    report.memo = _memo_stats(run) if run.sites else None
    if report.verdict == "verified" or report.failure is None:
        return report, program.main, run.derived
    found = failing_instance(program, run, report.failure.node)
    if found is None:
        return report, program.main, run.derived
    site, facts = found
    derived = solve(facts, rule_dirs)
    inner = build_report(name, facts, derived, rule_dirs=rule_dirs)
    if inner.failure is not None:
        inner.failure.reason = f"in layer call {report.failure.node} (template {site.template}): {inner.failure.reason}"
        report.failure = inner.failure
        report.diagnosis = inner.diagnosis or report.diagnosis
        report.other_failures += inner.other_failures
        report.other_failure_groups = inner.other_failure_groups + report.other_failure_groups
    return report, facts, derived


def _memo_stats(run: Run) -> dict[str, int]:
    return {"layer_calls": len(run.sites), "templates": len({s.template for s in run.sites}),
            "template_solves": run.template_solves, "main_solves": run.main_solves, "elided_calls": run.elided,
            "copied_outputs": run.copied, "solved_ahead": run.solved_ahead, "wasted_solves": run.wasted_solves,
            "aliased": run.aliased}
