"""Renderers of a Report: text (plain, or coloured with rich on a terminal), JUnit XML, HTML.

Every renderer takes the Report alone (refine/report/schema.py), so `--json` output can be rendered
again later. Output is bounded on big models: the first failure in full, the other failing
nodes counted by op and cause, at most a few collective calls, candidates and coordinates.
"""

from __future__ import annotations

import html
import math
import re
from math import prod
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Callable
from itertools import combinations, product

from refine.report.schema import (
    CandidateResult,
    ClosestLemma,
    CollectiveCall,
    Diagnosis,
    Explanation,
    Failure,
    GraphExcerpt,
    InputRelation,
    Location,
    NearLemma,
    NumericCheck,
    Report,
    RuleCheck,
    ValueComparison,
)

Segment = tuple[str, str | None]  # text, rich style
Line = list[Segment]

MAX_OUTPUT_LINES = 10
VERDICT_STYLE = {"verified": "bold green", "refuted": "bold red", "unproven": "bold yellow"}


def _where(loc: Location | None, module: bool = True) -> str:
    if loc is None or not (loc.module or loc.file):
        return ""
    out = f" [{loc.module}]" if module and loc.module else ""
    return out + (f" {loc.file}:{loc.line}" if loc.file else "")


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _candidate(c: CandidateResult) -> str:
    if c.max_abs_error is None:
        return f"{c.candidate}: shape {c.shape}"
    return f"{c.candidate}: max abs error {_num(c.max_abs_error)} (rel {_num(c.max_rel_error)})"


def ranks_text(ranks: list[int]) -> str:
    """r0 / r0..r7 / r0,r2,r5 (the diagnosis words rank lists the same way)."""
    if len(ranks) == 1:
        return f"r{ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"r{ranks[0]}..r{ranks[-1]}"
    return ",".join(f"r{r}" for r in ranks)


def group_text(group: list[int]) -> str:
    """A group's global ranks, short at any world size: `[0..511]` (consecutive), `[3..507 step 8]`
    (evenly spaced, a mesh column), a long list as its runs of consecutive ranks (`[0..15,
    1024..1039, 2048..2063, 12 more runs, 15360..15375; 256 ranks]`: a DP row of a 4-D mesh), else
    the list as it is."""
    if len(group) >= 3:
        step = group[1] - group[0]
        if step > 0 and all(b - a == step for a, b in zip(group, group[1:])):
            return f"[{group[0]}..{group[-1]}]" if step == 1 else f"[{group[0]}..{group[-1]} step {step}]"
    if len(group) > LONG_GROUP:
        runs: list[list[int]] = []
        for rank in group:
            if runs and rank == runs[-1][1] + 1:
                runs[-1][1] = rank
            else:
                runs.append([rank, rank])
        words = [f"{a}..{b}" if b > a else str(a) for a, b in runs]
        if len(words) > 5:
            words = [*words[:3], f"{len(words) - 4} more runs", words[-1]]
        return "[" + ", ".join(words) + f"; {len(group)} ranks]"
    return "[" + ", ".join(map(str, group)) + "]"


LONG_GROUP = 16  # (a group of more members is shown as its runs of consecutive ranks)


def mesh_group_words(group: list[int] | None, mesh: list[tuple[str, int]]) -> str | None:
    """A group in mesh coordinates (mesh: (dim, size) in axis order, ranks row-major): `the tp
    group of dp=1` when the group is exactly the ranks along one dim at fixed other coordinates,
    in coordinate order, `the dp x cp group of pp=0, tp=1` along several; else None."""
    if not group or len(mesh) < 2:
        return None
    sizes = [size for _, size in mesh]
    strides = [int(prod(sizes[k + 1:])) for k in range(len(sizes))]
    first = [(group[0] // stride) % size for stride, size in zip(strides, sizes)]
    for count in range(1, len(mesh)):
        for axes in combinations(range(len(mesh)), count):
            base = sum(c * stride for k, (c, stride) in enumerate(zip(first, strides)) if k not in axes)
            line = [base + sum(c * strides[k] for k, c in zip(axes, cs)) for cs in product(*(range(sizes[k]) for k in axes))]
            if line == group:
                dims = " x ".join(mesh[k][0] for k in axes)
                fixed = ", ".join(f"{d}={c}" for k, ((d, _), c) in enumerate(zip(mesh, first)) if k not in axes)
                return f"the {dims} group of {fixed}"
    return None


_RANK_LABEL = re.compile(r"^r(\d+):(.+)$")


def rank_tensors_text(labels: list[str]) -> str:
    """`r0:y, r1:y, ..., r511:y` as `r0..r511:y`: a run of consecutive ranks holding the
    same-named tensor is one range, so that a report at world size 512 stays readable. Labels
    of another form are kept as they are, in place."""
    out: list[str] = []
    run: list = []  # [first rank, last rank, tensor name]

    def flush() -> None:
        if run:
            first, last, name = run
            out.append(f"r{first}:{name}" if first == last else f"r{first}..r{last}:{name}")
            run.clear()

    for label in labels:
        m = _RANK_LABEL.match(label)
        if m and run and run[2] == m[2] and int(m[1]) == run[1] + 1:
            run[1] = int(m[1])
            continue
        flush()
        if m:
            run.extend([int(m[1]), int(m[1]), m[2]])
        else:
            out.append(label)
    flush()
    return ", ".join(out)


def _input_lines(rels: list[InputRelation], limit: int = 24) -> list[str]:
    """One line per input when every rank holds it the same way, else one line per rank."""
    by_input: dict[str, list[InputRelation]] = defaultdict(list)
    for rel in rels:
        by_input[rel.input].append(rel)
    lines: list[str] = []
    for name, group in by_input.items():
        layouts_ = {r.layout for r in group}
        tensors = {r.rank_tensor for r in group}
        ranks = sorted({r.rank for r in group})
        if len(group) > 1 and len(layouts_) == 1 and len(tensors) == 1 and len(ranks) == len(group):
            lines.append(f"input {name} on {ranks_text(ranks)} ({group[0].rank_tensor}): {group[0].layout}")
            continue
        for rel in group[:8]:
            lines.append(f"input {name} on r{rel.rank} ({rel.rank_tensor}): {rel.layout}")
        if len(group) > 8:
            lines.append(f"input {name}: ... {len(group) - 8} more rank tensors")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... {len(lines) - limit} more input relations (see --json)"]
    return lines


def _call_lines(call: CollectiveCall) -> list[Line]:
    state = "matched on every member" if call.matched else f"NOT matched: {call.problem}"
    where = f" ({call.mesh_group})" if call.mesh_group else ""
    out: list[Line] = [[("collective: ", "bold"), (f"{call.kind} call #{call.call} on group {group_text(call.group)}{where}: {state}",
                                                    None if call.matched else "red")]]
    if call.fits is not None:
        fits_where = f" ({call.fits_mesh_group})" if call.fits_mesh_group else ""
        out.append([(f"  r{call.group[0]}'s input is a piece of a sum whose pieces are on {group_text(call.fits)}{fits_where}, "
                     f"not on this group", "red")])
    for m in call.members[:8]:
        if m.node is None:
            out.append([(f"  r{m.rank}: ", None), ("never makes this call", "red")])
            continue
        rel = f" ({m.input_relation})" if m.input_relation else ""
        given = f", input {m.input}{rel}" if m.input is not None else ""
        out.append([(f"  r{m.rank}: {m.node} ({m.op}){_where(m.location, module=False)}{given}", None)])
    if len(call.members) > 8:
        out.append([(f"  ... {len(call.members) - 8} more members", None)])
    return out


def _comparison_lines(cmp: ValueComparison, what: str) -> list[Line]:
    out: list[Line] = []
    if cmp.best is None:
        out.append([(f"{what}: no candidate has shape {cmp.shape} ({cmp.candidates_tried} tried)", "red")])
        return out
    state = "matches" if cmp.matches else "does NOT match"
    out.append([(f"{what}: best of {cmp.candidates_tried} reconstructions {state}: ", None),
                (_candidate(cmp.best), None if cmp.matches else "red"), (f" (allowed {cmp.allowed_error:.2g})", "dim")])
    for c in cmp.coordinates[:3]:
        idx = ", ".join(map(str, c.index))
        out.append([(f"  {cmp.seq_tensor}[{idx}] = {c.expected:.6g}, rebuilt: {c.got:.6g}", None)])
    for c in cmp.runners_up[:1]:
        out.append([(f"  next best: {_candidate(c)}", "dim")])
    if cmp.note:
        out.append([(f"  ({cmp.note})", "dim")])
    return out


def _numeric_lines(num: NumericCheck) -> list[Line]:
    style = {"counterexample": "bold red", "program_error": "bold red", "agrees": "yellow",
             "inconclusive": "yellow", "not_run": "dim"}[num.status]
    head = "counterexample" if num.status in ("counterexample", "program_error") else "numbers"
    seed = f" (seed {num.seed})" if num.seed is not None else ""
    out: list[Line] = [[(f"  {head}{seed}: ", style), (num.summary, None)]]
    if num.simulation_error:
        out.append([(f"    simulation: {num.simulation_error}", None)])
    if num.output is not None:
        out += [[("    ", None), *line] for line in _comparison_lines(num.output, f"output {num.output.seq_tensor}")]
    at = num.at_node
    if at is not None and num.output is not None and at.seq_tensor == num.output.seq_tensor and at.best is not None \
            and num.output.best is not None and at.best.candidate == num.output.best.candidate:
        out.append([(f"    at node {at.seq_node}: it computes output {at.seq_tensor} (above)", None)])
    elif at is not None:
        out += [[("    ", None), *line] for line in _comparison_lines(at, f"at node {at.seq_node}")]
    return out


def _near_head(near: NearLemma) -> str:
    """`partial_add_once (rules/elementwise.lp:76), 3 of 6 premises held`."""
    return f"{near.rule} ({near.file}:{near.line}), {near.matched} of {near.premises} premises held"


def _near_words(near: NearLemma) -> str:
    """What a near lemma needs, down to the helper rule that explains its missing premise."""
    if not near.because:
        return near.words
    last = near.because[-1]
    return f"{near.words}, down to {last.rule} ({last.file}:{last.line}): {last.words}"


def closest_summary(c: ClosestLemma) -> str:
    """One line for messages (JUnit): the closest lemma and what it needs."""
    return f"closest lemma {c.rule} ({c.file}:{c.line}) {_near_words(c)}"


def _closest_lines(c: ClosestLemma) -> list[Line]:
    sought = f" with {c.rank_node}" if c.rank_node else ""
    out: list[Line] = [[("    closest lemma: ", "bold"), (_near_head(c), "yellow"), (sought, None)]]
    out.append([(f"      {c.words}", None)])
    if c.because:
        last = c.because[-1]
        out.append([(f"      down to {last.rule} ({last.file}:{last.line}): {last.words}", None)])
    for other in c.others[:2]:
        out.append([(f"      also near: {_near_head(other)}: {_near_words(other)}", "dim")])
    return out


def _failure_lines(f: Failure, report: Report, verbose: bool = True) -> list[Line]:
    out: list[Line] = [[("  first failure: ", "bold"), (f"node {f.node} ({f.op})", "bold red"), (_where(f.location), "cyan")]]
    out.append([(f"    why: {f.reason}", None)])
    if f.closest is not None and verbose:  # (lemma internals: for rule authors, --verbose)
        out += _closest_lines(f.closest)
    out += [[(f"    {line}", None)] for line in _input_lines(f.inputs)]
    for name in f.unrelated_inputs:
        out.append([(f"    input {name}: related to no rank tensor", None)])
    groups: dict[tuple[int, str], list] = defaultdict(list)
    for rn in f.rank_nodes:
        groups[(rn.rank, rn.op)].append(rn)
    for (rank, op), rns in list(groups.items())[:8]:
        if len(rns) == 1:
            out.append([(f"    consumed on r{rank} by {rns[0].node} ({op}){_where(rns[0].location, module=False)}", None)])
        else:
            names = ", ".join(rn.node for rn in rns[:3]) + (f", +{len(rns) - 3}" if len(rns) > 3 else "")
            out.append([(f"    consumed on r{rank} by {len(rns)} {op} nodes ({names})", None)])
    if len(groups) > 8:
        out.append([(f"    ... consumed by {sum(len(v) for v in list(groups.values())[8:])} more rank nodes", None)])
    for call in f.collectives[:4]:
        out += [[("    ", None), *line] for line in _call_lines(call)]
    if report.other_failures:
        out.append([(f"  ... and {report.other_failures} more sequential node(s) where relations break", None)])
        for g in report.other_failure_groups[:6]:
            more = f", +{g.count - len(g.nodes)}" if g.count > len(g.nodes) else ""
            out.append([(f"      {g.count} x {g.op}: {g.cause} ({', '.join(g.nodes)}{more})", "dim")])
        if len(report.other_failure_groups) > 6:
            rest = sum(g.count for g in report.other_failure_groups[6:])
            out.append([(f"      {rest} more in {len(report.other_failure_groups) - 6} other groups (see --json)", "dim")])
    return out


def explanation_lines(ex: Explanation) -> list[Line]:
    head = ex.reconstruction if ex.rebuilt and ex.reconstruction else f"{ex.output} is NOT rebuilt from the ranks' outputs"
    out: list[Line] = [[("explain ", "bold"), (f"{ex.output}: {head}", None)]]
    for s in ex.steps:
        pad = "  " * (s.depth + 1)
        if s.rank_tensor is None:
            where = f" at {s.seq_node} ({s.op})" if s.seq_node else " (graph input)"
            out.append([(f"{pad}{s.seq_tensor}{where}: ", None), (s.note, "red")])
            continue
        lemma = ", ".join(s.lemmas) or "?"
        seq_node = f"seq {s.seq_node} ({s.op}){_where(s.location, module=False)}" if s.seq_node else "graph input"
        rank_node = f"; rank {s.rank_node} ({s.rank_op})" if s.rank_node and s.rank_op != s.op else ""
        note = f"  -- {s.note}" if s.note else ""
        out.append([(f"{pad}{s.seq_tensor} ~ r{s.rank}:{s.rank_tensor} as {s.layout} ", None), (f"by {lemma}", "green"),
                    (f"  [{seq_node}{rank_node}]{note}", "dim")])
    if ex.truncated:
        out.append([("  ... (truncated)", "dim")])
    return out


def report_lines(report: Report, verbose: bool = True) -> list[Line]:
    """The text report, line by line; without `verbose`, the lemma internals (the closest
    lemma and its premises) are left out."""
    secs = f"lower {report.lower_seconds:.2f}s, run {report.run_seconds:.2f}s"
    if report.numeric is not None and report.numeric.status != "not_run":
        secs += f", simulate {report.numeric.seconds:.2f}s"
    lines: list[Line] = [[(f"{report.model}: ", "bold"), (report.verdict.upper(), VERDICT_STYLE[report.verdict]),
                          (f" (world size {report.world_size}, {report.relations} relations, {secs})", None)]]
    if report.diagnosis is not None:
        lines.append([("  what is wrong: ", "bold"), (diagnosis_text(report.diagnosis), "red")])
    for w in report.warnings:
        lines.append([("  warning: ", "bold"), (w, "yellow")])
    if report.rows is not None:
        lines.append([(f"  rows: {report.rows}", None)])
    shown = report.outputs if len(report.outputs) <= MAX_OUTPUT_LINES else report.outputs[:MAX_OUTPUT_LINES - 2]
    for o in shown:
        lines.append([(f"  output {o.name}: ", None),
                      (o.reconstruction or "", "green") if o.ok else ("NOT rebuilt from the ranks", "red")])
    rest = report.outputs[len(shown):]
    if rest:
        bad = sum(not o.ok for o in rest)
        lines.append([(f"  ... {len(rest)} more outputs: {len(rest) - bad} rebuilt, {bad} NOT rebuilt (see --json)", None)])
    if report.rule_check is not None:
        lines += rule_check_lines(report.rule_check, "  user lemmas")
    if report.numeric is not None:
        lines += _numeric_lines(report.numeric)
    if report.failure is not None:
        lines += _failure_lines(report.failure, report, verbose)
    if report.unrelated_inputs:
        lines.append([(f"  inputs with no relation: {', '.join(report.unrelated_inputs)}", None)])
    for m in report.collective_mismatches[:5]:
        lines.append([(f"  collective mismatch: {m}", "red")])
    if len(report.collective_mismatches) > 5:
        lines.append([(f"  ... {len(report.collective_mismatches) - 5} more collective mismatches", None)])
    for v in report.sanity_violations[:5]:
        lines.append([(f"  SANITY (lemma library bug): {v}", "magenta")])
    if report.explanation is not None:
        lines += explanation_lines(report.explanation)
    return lines


def rule_check_lines(rc: RuleCheck, what: str, limit: int = 5) -> list[Line]:
    """Lemmas checked on numbers: one line, then a line per relation that did not hold."""
    style = {"held": "green", "violated": "red", "not_run": "yellow"}[rc.status]
    lines: list[Line] = [[(f"{what}: ", "bold"), (rc.summary, style)]]
    for v in rc.violations[:limit]:
        where = f" (saved: {v.saved})" if v.saved else ""
        lines.append([(f"    {v.seq_tensor} ~ {', '.join(v.rank_tensors)} as {v.layout}, by {', '.join(v.lemmas)}: "
                       f"off by {v.max_abs_error:.3g} on {v.instance}{where}", "red")])
    if len(rc.violations) > limit:
        lines.append([(f"    ... {len(rc.violations) - limit} more (see --json)", None)])
    return lines


def diagnosis_text(d: Diagnosis) -> str:
    """The plain-word diagnosis with its docs/bugs.md class."""
    return d.summary + (f" [docs/bugs.md class {d.bug_class}]" if d.bug_class else "")


def render_text(report: Report, verbose: bool = True) -> str:
    """The human-readable report, plain text."""
    return "\n".join("".join(text for text, _style in line) for line in report_lines(report, verbose))


def print_report(report: Report, echo: Callable[[str], None], color: bool, verbose: bool = True) -> None:
    """Print the text report: coloured through rich if `color` (a terminal), else plain."""
    if not color:
        echo(render_text(report, verbose))
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    for line in report_lines(report, verbose):
        text = Text()
        for segment, style in line:
            text.append(segment, style=style or "")
        console.print(text)


# --- JUnit XML ------------------------------------------------------------------------------


def _output_failure_message(report: Report, name: str) -> str:
    num = report.numeric
    f = report.failure
    closest = f"; {closest_summary(f.closest)}" if f is not None and f.closest is not None else ""
    if num is not None and num.output is not None and num.output.seq_tensor == name and num.status == "counterexample":
        best = f"; best {_candidate(num.output.best)}" if num.output.best else ""
        at = f"; first failure at {f.node} ({f.op}){_where(f.location)}{closest}" if f is not None else ""
        return f"refuted: no reconstruction of output {name} from the ranks' outputs matches (seed {num.seed}{best}){at}"
    where = f" (first failure at {f.node} ({f.op}){_where(f.location)}: {f.reason}{closest})" if f is not None else ""
    prefix = "refuted" if report.verdict == "refuted" else "unproven"
    return f"{prefix}: output {name} is not rebuilt from the ranks' outputs{where}"


def render_junit(report: Report) -> str:
    """JUnit XML: one testsuite, one testcase per sequential output (plus one for the programs
    when they fail as a whole: mismatched collectives or a deadlock)."""
    suite = ET.Element("testsuite", name=f"refine.{report.model}")
    props = ET.SubElement(suite, "properties")
    for key, value in [("verdict", report.verdict), ("world_size", str(report.world_size)),
                       ("relations", str(report.relations))]:
        ET.SubElement(props, "property", name=key, value=value)
    body = render_text(report)
    failures = 0
    cases = [(o.name, None if o.ok else _output_failure_message(report, o.name)) for o in report.outputs]
    whole = report.collective_mismatches or (report.numeric is not None and report.numeric.status == "program_error")
    if report.verdict != "verified" and (whole or all(msg is None for _n, msg in cases)):
        msg = report.numeric.summary if report.numeric is not None and report.numeric.status == "program_error" else \
            "; ".join(report.collective_mismatches[:3]) or (report.failure.reason if report.failure else report.verdict)
        cases.append(("(programs)", f"{report.verdict}: {msg}"))
    total = report.lower_seconds + report.run_seconds + (report.numeric.seconds if report.numeric else 0.0)
    for name, message in cases:
        case = ET.SubElement(suite, "testcase", classname=f"refine.{report.model}", name=name,
                             time=f"{total / max(1, len(cases)):.4f}")
        if message is not None:
            failures += 1
            el = ET.SubElement(case, "failure", message=message, type=report.verdict)
            el.text = body
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", "0")
    suite.set("time", f"{total:.4f}")
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


# --- HTML -----------------------------------------------------------------------------------

NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 160, 36, 14, 60, 10  # a column's least width, a one-line node's height
COL_MAX = 320  # widest column: longer names wrap onto more lines
NODE_CHAR_W, NODE_LINE_H = 6.4, 13  # node labels (11px): upper bound of a character's width, line height
EDGE_CHAR_W, EDGE_LINE_H = 5.4, 11  # edge labels (9px)

CSS = """
body { font: 14px/1.4 system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 20px; color: #222; background: #fafafa; }
h1 { font-size: 20px; margin: 0 0 8px 0; }
h2 { font-size: 16px; margin: 22px 0 8px 0; }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: 600; }
.verdict.verified { background: #2e7d32; } .verdict.refuted { background: #c62828; } .verdict.unproven { background: #f9a825; color: #222; }
.why { background: #fff; border-left: 4px solid #d32f2f; padding: 8px 12px; margin: 8px 0; }
.closest { background: #fff; border-left: 4px solid #f9a825; padding: 8px 12px; margin: 8px 0; }
.closest code { background: #f5f5f5; padding: 0 3px; }
table { border-collapse: collapse; background: #fff; margin: 6px 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; font-size: 13px; vertical-align: top; }
th { background: #f0f0f0; }
.graphs { display: flex; flex-wrap: wrap; gap: 8px; align-items: flex-start; }
.panel { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 6px; }
.panel h3 { margin: 2px 6px 6px 6px; font-size: 14px; }
.node rect { fill: #e3f2fd; stroke: #5c8db8; stroke-width: 1.2; rx: 5; }
.node.input rect, .node.output rect { fill: #f5f5f5; stroke: #999; stroke-dasharray: 4 2; }
.node.match rect { fill: #fff3e0; stroke: #ef6c00; stroke-width: 2; }
.node.failing rect { fill: #ffebee; stroke: rgb(211, 47, 47); stroke-width: 3; }
.node.culprit rect { fill: #ffebee; stroke: rgb(211, 47, 47); stroke-width: 3; stroke-dasharray: 6 3; }
.node.culprit text { fill: #b71c1c; font-weight: 600; }
.node text { font-size: 11px; text-anchor: middle; }
.node text.op { font-size: 10px; fill: #555; }
.node.failing text { fill: #b71c1c; font-weight: 600; }
.edge { fill: none; stroke: #888; stroke-width: 1.2; }
.elabel { font-size: 9px; fill: #333; paint-order: stroke; stroke: #fff; stroke-width: 3px; stroke-linejoin: round; }
.elabel.layout { fill: #6a1b9a; }
pre { background: #fff; border: 1px solid #ddd; padding: 8px; overflow-x: auto; font-size: 12px; }
.legend span { display: inline-block; padding: 0 8px; margin-right: 8px; border-radius: 3px; }
"""

SCRIPT = """
document.addEventListener('DOMContentLoaded', function () {
  var rect = document.querySelector('.node.failing rect');
  document.body.setAttribute('data-rendered', '1');
  if (rect) {
    document.body.setAttribute('data-failing-node', rect.parentNode.getAttribute('data-node'));
    document.body.setAttribute('data-failing-stroke', getComputedStyle(rect).stroke);
  }
});
"""


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


_BREAK = re.compile(r"[^/.,\s]*(?:[/.,]\s*|\s+)|[^/.,\s]+$")  # a token, with the separator after it


def _wrap(text: str, width: int) -> list[str]:
    """`text` on lines of at most `width` characters, broken after a separator (`/`, `.`, `,`,
    a space) so that names and layouts are never cut mid-token; only a token longer than a
    whole line is split."""
    lines = [""]
    for token in _BREAK.findall(text):
        if lines[-1] and len(lines[-1]) + len(token.rstrip()) > width:
            lines[-1] = lines[-1].rstrip()
            lines.append("")
        while len(token) > width:
            lines[-1], token = token[:width], token[width:]
            lines.append("")
        lines[-1] += token
    return [line.rstrip() for line in lines if line.strip()] or [""]


def _chars(width: float, char_w: float) -> int:
    """How many characters fit in `width` pixels (the column was sized for whole characters)."""
    return max(1, int(width / char_w + 1e-6))


def _lines(x: float, y: float, lines: list[str], step: float, cls: str = "", title: str | None = None) -> str:
    """One SVG text element of several lines (tspans), with its whole text as a tooltip."""
    spans = "".join(f'<tspan x="{x:.1f}" dy="{0 if k == 0 else step}">{_esc(line)}</tspan>' for k, line in enumerate(lines))
    attr = f' class="{cls}"' if cls else ""
    tip = f"<title>{_esc(title)}</title>" if title is not None else ""
    return f'<text{attr} x="{x:.1f}" y="{y:.1f}">{spans}{tip}</text>'


def _svg(ex: GraphExcerpt) -> str:
    """A layered drawing of one graph excerpt: rows by longest path, edges labelled.

    Every column is as wide as the longest name needs (up to COL_MAX; longer ones wrap), and
    each edge's labels (tensor, then its relation) are written in full under the source box,
    inside its column, wrapped at separators; the gap under a row grows with its labels, so
    that no label runs into a neighbour's column or into the next row."""
    ids = [n.id for n in ex.nodes]
    depth = {i: 0 for i in ids}
    for _ in range(len(ids)):
        changed = False
        for e in ex.edges:
            if e.src in depth and e.dst in depth and depth[e.dst] < depth[e.src] + 1:
                depth[e.dst] = depth[e.src] + 1
                changed = True
        if not changed:
            break
    rows: dict[int, list[str]] = defaultdict(list)
    for i in ids:
        rows[depth[i]].append(i)
    edges = [e for e in ex.edges if e.src in depth and e.dst in depth]
    col_w = math.ceil(max([NODE_W] + [min(COL_MAX, len(n.label) * NODE_CHAR_W + 12) for n in ex.nodes]
                          + [min(COL_MAX, len(t) * EDGE_CHAR_W + 12) for e in edges for t in (e.tensor, e.layout or "")]))
    node_lines = {n.id: _wrap(n.label, _chars(col_w - 12, NODE_CHAR_W)) for n in ex.nodes}
    most = max((len(v) for v in node_lines.values()), default=1)
    node_h = NODE_H + NODE_LINE_H * (most - 1)
    # each source's labels, once per tensor and relation (a value two nodes read is one label)
    per_line = _chars(col_w - 8, EDGE_CHAR_W)
    labels: dict[str, dict[tuple[str, str], tuple[list[str], list[str]]]] = defaultdict(dict)
    for e in edges:
        if (e.tensor, e.layout or "") not in labels[e.src]:
            labels[e.src][e.tensor, e.layout or ""] = (_wrap(e.tensor, per_line), _wrap(e.layout, per_line) if e.layout else [])
    stack = {src: sum((len(t) + len(lay)) * EDGE_LINE_H + 4 for t, lay in items.values()) for src, items in labels.items()}
    gaps = {d: max([GAP_Y] + [stack.get(i, 0) + 18 for i in row]) for d, row in rows.items()}
    widest = max((len(r) for r in rows.values()), default=1)
    width = PAD * 2 + widest * col_w + (widest - 1) * GAP_X
    pos: dict[str, tuple[float, float]] = {}
    y = float(PAD)
    for d in sorted(rows):
        row = rows[d]
        x0 = (width - (len(row) * col_w + (len(row) - 1) * GAP_X)) / 2
        for k, i in enumerate(row):
            pos[i] = (x0 + k * (col_w + GAP_X), y)
        y += node_h + gaps[d]
    last = rows[max(rows)] if rows else []  # (its labels, if any, hang below it too)
    height = y - gaps.get(max(rows, default=0), 0) + max([PAD] + [stack.get(i, 0) + 12 for i in last])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{_esc(ex.graph)} graph">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#888"/></marker></defs>']
    for e in edges:
        (x1, y1), (x2, y2) = pos[e.src], pos[e.dst]
        ax, ay, bx, by = x1 + col_w / 2, y1 + node_h, x2 + col_w / 2, y2
        my = (ay + by) / 2
        parts.append(f'<path class="edge" d="M {ax:.1f} {ay:.1f} C {ax:.1f} {my:.1f}, {bx:.1f} {my:.1f}, {bx:.1f} {by - 2:.1f}" '
                     f'marker-end="url(#arrow)"><title>{_esc(e.tensor)}: {_esc(e.layout or "")}</title></path>')
    for src, items in labels.items():
        x, y = pos[src][0] + 6, pos[src][1] + node_h + 12
        for (tensor, layout), (tensor_lines, layout_lines) in items.items():
            parts.append(_lines(x, y, tensor_lines, EDGE_LINE_H, "elabel", tensor))
            y += len(tensor_lines) * EDGE_LINE_H
            if layout_lines:
                parts.append(_lines(x, y, layout_lines, EDGE_LINE_H, "elabel layout", layout))
                y += len(layout_lines) * EDGE_LINE_H
            y += 4
    for n in ex.nodes:
        x, y = pos[n.id]
        title = f"{n.label} ({n.op})" + (f" {n.location}" if n.location else "")
        parts.append(f'<g class="node {n.role}" data-node="{_esc(n.label)}" data-op="{_esc(n.op)}">'
                     f'<title>{_esc(title)}</title>'
                     f'<rect x="{x:.1f}" y="{y:.1f}" width="{col_w}" height="{node_h}"/>'
                     + _lines(x + col_w / 2, y + 15 + NODE_LINE_H * (most - len(node_lines[n.id])) / 2,
                              node_lines[n.id], NODE_LINE_H)
                     + f'<text class="op" x="{x + col_w / 2:.1f}" y="{y + node_h - 6:.1f}">{_esc(n.op)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _comparison_html(cmp: ValueComparison, what: str) -> str:
    rows = [[c.candidate, c.shape, _num(c.max_abs_error), _num(c.max_rel_error), "yes" if c.matches else "no"]
            for c in ([cmp.best] if cmp.best else []) + cmp.runners_up[:4]]
    out = f"<p><b>{_esc(what)}</b> (shape {_esc(cmp.shape)}, {cmp.candidates_tried} candidates tried)</p>"
    out += _table(["candidate", "shape", "max abs error", "rel error", "matches"], rows) if rows else "<p>no candidate</p>"
    if cmp.coordinates:
        out += _table(["index", "sequential", "rebuilt"], [[c.index, f"{c.expected:.6g}", f"{c.got:.6g}"] for c in cmp.coordinates])
    return out


def _numbers_html(num: NumericCheck) -> str:
    parts = [f"<h2>Numbers ({_esc(num.status.replace('_', ' '))}, seeds {_esc(', '.join(map(str, num.seeds)) or '-')}, "
             f"tolerance {num.tolerance:g} x max(1, max |value|))</h2>"]
    if num.simulation_error:
        parts.append(f"<pre>{_esc(num.simulation_error)}</pre>")
    if num.output is not None:
        parts.append(_comparison_html(num.output, f"output {num.output.seq_tensor}"))
    if num.at_node is not None:
        parts.append(_comparison_html(num.at_node, f"at node {num.at_node.seq_node}"))
    return "\n".join(parts)


def _closest_html(c: ClosestLemma) -> str:
    """The closest lemma, next to the failure's reason."""
    sought = f" with <code>{_esc(c.rank_node)}</code>" if c.rank_node else ""
    return (f'<div class="closest" data-lemma="{_esc(c.rule)}"><b>Closest lemma</b> <code>{_esc(c.rule)}</code> '
            f'({_esc(c.file)}:{c.line}): {c.matched} of {c.premises} premises held{sought}.<br>'
            f'Missing premise: <code>{_esc(c.missing or "")}</code><br>{_esc(c.words)}</div>')


def _closest_details_html(c: ClosestLemma) -> str:
    """The helper rules below the closest lemma's missing premise, and the next closest lemmas."""
    out = [f"<h2>Closest lemmas ({c.tried} rules tried)</h2>"]
    rows = [[n.rule, f"{n.file}:{n.line}", f"{n.matched} of {n.premises}", n.missing or "", n.words]
            for n in c.because]
    if rows:
        out.append(f"<p>The missing premise of <code>{_esc(c.rule)}</code>, explained by the helper rules defining it:</p>")
        out.append(_table(["rule", "where", "held", "missing premise", "in words"], rows))
    if c.others:
        out.append("<p>Next closest:</p>")
        out.append(_table(["lemma", "where", "held", "missing premise", "in words"],
                          [[n.rule, f"{n.file}:{n.line}", f"{n.matched} of {n.premises}", n.missing or "",
                            _near_words(n)] for n in c.others]))
    return "\n".join(out)


def render_html(report: Report) -> str:
    """One self-contained page (inline CSS and SVG, no external resources)."""
    f = report.failure
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>refine: {_esc(report.model)} {_esc(report.verdict)}</title>",
             f"<style>{CSS}</style><script>{SCRIPT}</script></head><body>",
             f'<h1>{_esc(report.model)} <span class="verdict {report.verdict}">{report.verdict.upper()}</span></h1>',
             f"<p>world size {report.world_size}, {report.relations} relations</p>"]
    if report.diagnosis is not None:
        parts.append(f'<p class="diagnosis"><b>What is wrong:</b> {_esc(diagnosis_text(report.diagnosis))}</p>')
    if report.rows is not None:
        parts.append(f"<p><b>Rows:</b> {_esc(report.rows)}</p>")
    if report.numeric is not None:
        parts.append(f'<p class="summary"><b>{"Counterexample" if report.verdict == "refuted" else "Numbers"}:</b> '
                     f"{_esc(report.numeric.summary)}</p>")
    parts.append(_table(["output", "rebuilt from the ranks"],
                        [[o.name, o.reconstruction if o.ok else "NOT rebuilt"] for o in report.outputs]))
    if f is not None:
        where = _where(f.location)
        parts.append(f'<h2>First failure: <code>{_esc(f.node)}</code> ({_esc(f.op)}){_esc(where)}</h2>')
        parts.append(f'<div class="why">{_esc(f.reason)}</div>')
        if f.closest is not None:
            parts.append(_closest_html(f.closest))
        if f.neighbourhood:
            parts.append('<p class="legend"><span style="background:#ffebee;border:2px solid #d32f2f">failing seq node</span>'
                         '<span style="background:#fff3e0;border:2px solid #ef6c00">rank node, same op</span>'
                         '<span style="background:#e3f2fd;border:1px solid #5c8db8">context</span>'
                         'edge labels: tensor, then its relation (seq: per rank; rank: to a sequential tensor)</p>')
            parts.append('<div class="graphs">')
            for ex in f.neighbourhood:
                title = "sequential model" if ex.rank < 0 else f"rank {ex.rank}"
                parts.append(f'<div class="panel" data-graph="{_esc(ex.graph)}"><h3>{_esc(title)}</h3>{_svg(ex)}</div>')
            parts.append("</div>")
        if f.closest is not None and (f.closest.because or f.closest.others):
            parts.append(_closest_details_html(f.closest))
        if report.numeric is not None:
            parts.append(_numbers_html(report.numeric))
        if f.inputs:
            parts.append("<h2>Inputs of the failing node</h2>")
            parts.append(_table(["input", "rank", "rank tensor", "layout"],
                                [[r.input, f"r{r.rank}", r.rank_tensor, r.layout] for r in f.inputs[:64]]))
        for call in f.collectives:
            state = "matched" if call.matched else f"NOT matched: {call.problem}"
            parts.append(f"<h2>Collective: {_esc(call.kind)} call #{call.call} on group {_esc(group_text(call.group))} ({_esc(state)})</h2>")
            parts.append(_table(["rank", "node", "op", "where", "input", "input relation"],
                                [[f"r{m.rank}", m.node or "(never called)", m.op or "", _where(m.location, module=False),
                                  m.input or "", m.input_relation or ""] for m in call.members]))
        if report.other_failure_groups:
            parts.append(f"<h2>{report.other_failures} other failing node(s)</h2>")
            parts.append(_table(["count", "op", "cause", "nodes"],
                                [[g.count, g.op, g.cause, ", ".join(g.nodes)] for g in report.other_failure_groups]))
    elif report.numeric is not None:
        parts.append(_numbers_html(report.numeric))
    if report.explanation is not None:
        ex = report.explanation
        parts.append(f"<h2>Derivation of {_esc(ex.output)}</h2>")
        parts.append(_table(["seq tensor", "seq node", "rank tensor", "layout", "lemma", "note"],
                            [["\u00a0\u00a0" * s.depth + s.seq_tensor, s.seq_node or "", f"r{s.rank}:{s.rank_tensor}" if s.rank_tensor else "",
                              s.layout or "", ", ".join(s.lemmas), s.note] for s in ex.steps]))
    parts.append(f"<h2>Text report</h2><pre>{_esc(render_text(report))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
