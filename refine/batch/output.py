"""The renderings of a `refine batch` run: the summary table and line, JSON and JUnit XML."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

from refine.batch.entries import BatchReport, EntryResult
from refine.batch.verify_entry import one_line
from refine.errors import InputError

if TYPE_CHECKING:
    from rich.table import Table

# --- outputs -----------------------------------------------------------------------------------------


def _summary_line(result: EntryResult) -> str:
    """What went wrong with an entry, on one line (for the JUnit message)."""
    want = result.expected + (f" at {result.expected_node}" if result.expected_node else "")
    if result.status in ("verified", "refuted", "unproven"):
        got = result.status + (f" at {result.failing_node}" if result.failing_node else "")
        reason = result.report.failure.reason if result.report and result.report.failure and result.status != "verified" else ""
        return one_line(f"expected {want}, got {got}" + (f": {reason}" if reason else ""))
    return one_line(f"{result.status}: {result.error or ''}")


def render_junit(batch: BatchReport) -> str:
    """JUnit XML: one testsuite, one testcase per entry; an entry that got the wrong verdict is
    a failure (body: the core's text report), one without a verdict is an error."""
    from refine.report.render import render_text

    suites = ET.Element("testsuites", name="refine.batch")
    suite = ET.SubElement(suites, "testsuite", name="refine.batch", timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    props = ET.SubElement(suite, "properties")
    for key, value in [("root", batch.root), ("refine_version", batch.refine_version), ("plan", batch.plan or ""),
                       ("rules_digest", batch.rules_digest)]:
        ET.SubElement(props, "property", name=key, value=value)
    failures = errors = 0
    for result in batch.entries:
        case = ET.SubElement(suite, "testcase", classname="refine.batch", name=result.entry, time=f"{result.seconds:.3f}")
        if result.ok:
            continue
        verdict = result.status in ("verified", "refuted", "unproven")
        failures, errors = failures + verdict, errors + (not verdict)
        el = ET.SubElement(case, "failure" if verdict else "error", message=_summary_line(result), type=result.status)
        el.text = render_text(result.report) if result.report is not None else (result.error or result.status)
    for parent in (suites, suite):
        parent.set("tests", str(len(batch.entries)))
        parent.set("failures", str(failures))
        parent.set("errors", str(errors))
        parent.set("time", f"{batch.seconds:.3f}")
    suite.set("skipped", "0")
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def render_json(batch: BatchReport) -> str:
    return batch.model_dump_json(indent=1) + "\n"


STATUS_STYLE = {"verified": "green", "refuted": "red", "unproven": "yellow", "nothing_sharded": "yellow", "error": "magenta",
                "timeout": "magenta", "out_of_memory": "magenta", "crashed": "magenta"}


def detail(result: EntryResult) -> str:
    """The table's last column: the failing node, the error, or what the sharder did."""
    if result.error:
        return result.error
    parts = []
    if result.failing_node:
        failure = result.report.failure if result.report else None
        parts.append(f"{result.failing_node} ({failure.op})" if failure else result.failing_node)
    if result.plan is not None:
        parts.append(result.plan.summary)
    return "; ".join(p for p in parts if p)


def summary_table(batch: BatchReport, ascii_only: bool = False) -> Table:
    """The summary: entry, verdict, expected, time, failing node (or error) for failures;
    paths in errors are shown relative to the root."""
    from rich import box
    from rich.table import Table

    prefix = batch.root.rstrip("/") + "/"
    table = Table(title=f"refine batch {batch.root}", title_justify="left", box=box.ASCII if ascii_only else box.SIMPLE_HEAD)
    for col, kw in (("entry", {}), ("verdict", {}), ("expected", {}), ("ok", {}), ("time", {"justify": "right"}),
                    ("failing node / error", {"overflow": "fold"})):
        table.add_column(col, **kw)
    for r in batch.entries:
        time_text = f"{r.seconds:.1f}s" + (" (cached)" if r.cached else "")
        expected = r.expected + (f" at {r.expected_node}" if r.expected_node else "")
        table.add_row(r.entry, f"[{STATUS_STYLE[r.status]}]{r.status}[/]", expected,
                      "[green]ok[/]" if r.ok else "[bold red]FAIL[/]", time_text, detail(r).replace(prefix, ""))
    return table


def summary_line(batch: BatchReport) -> str:
    counts = batch.counts()
    parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    cached = sum(1 for e in batch.entries if e.cached)
    bad = sum(1 for e in batch.entries if not e.ok)
    verdict = "all as expected" if bad == 0 else f"{bad} not as expected"
    return (f"{len(batch.entries)} entr{'y' if len(batch.entries) == 1 else 'ies'} ({parts}; {cached} from cache) in {batch.seconds:.1f}s "
            f"with {batch.jobs} job{'s' if batch.jobs != 1 else ''}: {verdict}")


def write_outputs(batch: BatchReport, json_path: Path | None, junit_path: Path | None) -> None:
    """Write the requested files, each atomically; a failure is an InputError naming the file."""
    from refine.report.schema import write_atomic

    for path, what, render in ((json_path, "JSON", render_json), (junit_path, "JUnit", render_junit)):
        if path is None:
            continue
        try:
            write_atomic(path, render(batch))
        except OSError as exc:
            raise InputError(path, f"cannot write the {what} report ({exc.strerror or type(exc).__name__})") from None


def print_summary(batch: BatchReport) -> None:
    """The summary table and one closing line on stdout (coloured on a terminal)."""
    from rich.console import Console

    console = Console(highlight=False)
    terminal = console.is_terminal
    if not terminal:
        console = Console(highlight=False, width=max(console.width, 160), no_color=True)
    console.print(summary_table(batch, ascii_only=not terminal))
    console.print(summary_line(batch))

