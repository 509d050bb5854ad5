"""The diagnosis: from the facts and the fixpoint, the report (refine/report/schema.py's schema) says
what failed, where and why, so that a user can act without reading the engine.

`build_report` reads the static part off the fixpoint: the verdict of each output (rebuilt by
which reconstruction), the first sequential node (topological order) where a relation breaks,
what its inputs relate to on each rank, the closest lemma and its missing premises, the
collective calls near it, a neighbourhood of the graphs (for the HTML page), the other failures
counted by op and cause, and on request the derivation chain of one output (`explain`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from refine.diagnose import closest, plain

from refine import layouts
from refine.dist import VALUE_CHECKED_OPS, channel_of
from refine.run.engine import Derived, builtin_rules_dir
from refine.errors import InputError
from refine.lowering.facts import FactSet
from refine.report.render import mesh_group_words, rank_tensors_text, ranks_text
from refine.diagnose.index import FactIndex
from refine.diagnose.schedule import ScheduleCheck, ScheduledCall, check_schedule, describe_group
from refine.report.schema import (
    ClosestLemma,
    CollectiveCall,
    CollectiveMember,
    ExplainStep,
    Explanation,
    Failure,
    FailureGroup,
    GraphEdge,
    GraphExcerpt,
    GraphNode,
    InputRelation,
    Location,
    NearLemma,
    OutputResult,
    Premise,
    RankNode,
    Report,
)

def _short(tensor_or_node: str) -> str:
    """Strip the graph prefix: `seq:h` -> `h`."""
    return tensor_or_node.split(":", 1)[1] if ":" in tensor_or_node else tensor_or_node


def _runs(said: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """(rank, tensor, phrase) rows grouped into runs of consecutive ranks saying the same of the
    same-named tensor (`r1..r511:y are unrelated to it`)."""
    runs: list[list[tuple[int, str, str]]] = []
    for row in said:
        last = runs[-1][-1] if runs else None
        if last is not None and row[0] == last[0] + 1 and row[1:] == last[1:]:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def _rank_of_tensor(ix: FactIndex, t: str) -> int:
    return ix.rank_of_graph.get(t.split(":", 1)[0], -1)


# rules/report.lp's reconstruction families (rebuilt/2) and the layout kind of their pieces
_FAMILY_KIND = {"rep": "rep", "cat": "sl", "ilv": "blk", "sum": "psum", "max": "pmax", "slsum": "psl"}


def _reconstruction(ix: FactIndex, s: str, rels: list[tuple[str, object]], family: object = None) -> str | None:
    """How sequential output `s` is rebuilt from the same-named rank outputs, as one line, or
    None; `family` (rebuilt/2) narrows it to the reconstruction that every rank took part in."""
    name = _short(s)
    outs = [(t, lay) for t, lay in rels if t in ix.rank_outputs and _short(t) == name]
    if family is not None:
        outs = [(t, lay) for t, lay in outs if layouts.kind(lay) == _FAMILY_KIND[layouts.kind(family)]]
    reps = sorted((_rank_of_tensor(ix, t), t) for t, lay in outs if lay == "rep")
    if reps:
        return f"{name} = r{reps[0][0]}:{_short(reps[0][1])} (replicated on {ranks_text([r for r, _ in reps])})"
    by_kind: dict[tuple, dict[int, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for t, lay in outs:
        k = layouts.kind(lay)
        if k == "sl":
            _, axis, start, end = lay  # type: ignore[misc]
            by_kind[("concat", axis, ix.dims.get((s, axis)))][start].append((end, t))
        elif k == "blk":
            _, axis, inner, start, end = lay  # type: ignore[misc]
            by_kind[("interleave", axis, inner)][start].append((end, t))
        elif k == "psum":
            _, a, b, d, style = lay  # type: ignore[misc]
            by_kind[("sum", style, d)][a].append((b, t))
        elif k == "pmax":
            _, a, b, d, style = lay  # type: ignore[misc]
            by_kind[("max", style, d)][a].append((b, t))
    for key, edges in by_kind.items():
        total = key[2]
        path = _tiling(edges, total)
        if path is None:
            continue
        parts = rank_tensors_text([f"r{_rank_of_tensor(ix, t)}:{_short(t)}" for t in path])  # (runs as ranges)
        if key[0] == "concat":
            return f"{name} = concat({parts}, axis={key[1]})"
        if key[0] == "interleave":
            return f"{name} = interleave({parts}, axis={key[1]}, blocks of {key[2]})"
        return f"{name} = {key[0]}({parts})"
    summed = _summed_slices(ix, s, outs)
    if summed is not None:
        return f"{name} = {summed}"
    first = sorted((_rank_of_tensor(ix, t), t, lay) for t, lay in outs
                   if layouts.kind(lay) == "chunk" and lay[2] == 0 and lay[4] == "rep")  # type: ignore[index]
    if first:  # a row-symmetric plan (docs/rows.md): row 0 holds chunk 0, row K chunk K
        r, t, (_, axis, _k, n, _inner) = first[0]  # type: ignore[misc]
        return (f"{name} = concat of {n} row chunks along axis {axis}: chunk 0 = r{r}:{_short(t)} (replicated on "
                f"{ranks_text([q for q, _, _ in first])}), chunk k the same of row k")
    blocks = sorted((_rank_of_tensor(ix, t), t, lay) for t, lay in outs
                    if layouts.kind(lay) == "chunk" and layouts.kind(lay[4]) == "sl")  # type: ignore[index]
    if blocks:  # a two-dim shard (refine.json `then`): each rank a slice of a chunk
        _, _, (_, axis, _k, n, inner) = blocks[0]  # type: ignore[misc]
        parts = rank_tensors_text([f"r{r}:{_short(t)}" for r, t, _ in blocks])
        return f"{name} = blocks({parts}): {n} chunks along axis {axis}, each cut along axis {inner[1]}"
    return None


def _summed_slices(ix: FactIndex, s: str, outs: list[tuple[str, object]]) -> str | None:
    """Slices of partial pieces (psl, rules/report.lp slsum) as one line: in each slice of an
    axis the pieces' summands tile their decomposition, and the slices tile the axis."""
    by_slice: dict[tuple, dict[int, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for t, lay in outs:
        if layouts.kind(lay) == "psl":
            _, axis, x, y, a, b, d, style = lay  # type: ignore[misc]
            by_slice[(axis, x, y, d, style)][a].append((b, f"r{_rank_of_tensor(ix, t)}:{_short(t)}"))
    sums: dict[int, dict[int, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for (axis, x, y, d, _style), edges in by_slice.items():
        path = _tiling(edges, d)
        if path is not None:
            sums[axis][x].append((y, f"sum({rank_tensors_text(path)})"))
    for axis, edges in sums.items():
        path = _tiling(edges, ix.dims.get((s, axis)))
        if path is not None:
            return f"concat({', '.join(path)}, axis={axis})"
    return None


def _tiling(edges: dict[int, list[tuple[int, str]]], total: int | None) -> list[str] | None:
    """A path of pieces [0,e1),[e1,e2),...,[.,total) through `edges` (start -> (end, tensor))."""
    if total is None:
        return None
    best: dict[int, list[str]] = {0: []}
    frontier = [0]
    while frontier:
        pos = frontier.pop(0)
        for end, t in sorted(edges.get(pos, []), key=lambda e: e[1]):
            if end not in best and end > pos:
                best[end] = best[pos] + [t]
                frontier.append(end)
    return best.get(total)


def _value_checked_calls(derived: Derived) -> str:
    """Why a program whose calls no lemma checked (dist.VALUE_CHECKED_OPS: AllToAllV, whose members'
    counts must agree; rules/exchanged_rows.lp unchecked_counts, inside layers too) is not verified,
    or "" if it makes none."""
    groups = sorted({str(grp) for grp, _seq in derived.get("unchecked_counts")})
    if not groups:
        return ""
    where = ", ".join(f"{VALUE_CHECKED_OPS[0]} on {describe_group(gid)}" for gid in groups[:3])
    return (f"{where}: no lemma proves that the members' counts agree (rules/exchanged_rows.lp reads counts "
            "exchanged by an AllToAll of each member's histogram); only the simulator checks them, on numbers, "
            "so the program is not verified")


def build_report(model: str, facts: FactSet, derived: Derived, lower_seconds: float = 0.0,
                 explain: str | None = None, rule_dirs: list[Path] | None = None,
                 closest_lemma: bool = True) -> Report:
    """Read the verdict and the explanation off the fixpoint.

    `explain` names a sequential output whose derivation chain to include (InputError if the
    sequential model has no output of that name). The verdict is `verified` or `unproven`;
    only a numeric counterexample (refine/diagnose/counterexample.py) turns it into `refuted`.
    On a failure, `closest_lemma` asks clingo once more which lemma came closest at the failing
    node (with the user's `rule_dirs`, as the fixpoint was solved).
    """
    ix = FactIndex(facts)
    rels: dict[str, list[tuple[str, object]]] = defaultdict(list)
    for s, t, lay in derived.get("rel"):
        real, layout = layouts.keyed_by_real(s, lay)
        rels[real].append((str(t), layout))
    explanation = _explain(ix, derived, rels, explain) if explain is not None else None
    ok_outputs = {s for (s,) in derived.get("output_ok")}
    # (the concatenation of sums names an output only where no other family rebuilds it: a rank's
    # piece holding every term of a decomposition is a plain slice too)
    families = {str(s): family for s, family in derived.get("rebuilt") if layouts.kind(family) != "slsum"}
    for s, family in derived.get("rebuilt"):
        families.setdefault(str(s), family)
    outputs = [
        OutputResult(name=name, ok=t in ok_outputs,
                     reconstruction=_reconstruction(ix, t, rels[t], families.get(t)) if t in ok_outputs else None)
        for t, name in ix.seq_outputs
    ]
    unrelated = sorted(_short(str(s)) for (s,) in derived.get("unrelated_input"))
    mismatches = [f"{describe_group(str(grp))} call #{seq}: rank {r} never makes it" for grp, seq, r in derived.get("missing_call")]
    mismatches += [f"{describe_group(str(grp))} call #{seq}: members disagree on the op or its attributes"
                   for grp, seq in derived.get("disagreeing_call")]
    schedule = check_schedule(facts) if not mismatches else ScheduleCheck()
    mismatches += schedule.problems
    sanity = [f"{kind}: {_short(str(s))} ~ {str(t)}" for kind, s, t in derived.get("sanity")]
    unchecked = _value_checked_calls(derived)
    verified = all(o.ok for o in outputs) and not mismatches and bool(outputs) and not unchecked
    failure, others, groups = (None, 0, []) if verified else _first_failure(
        ix, derived, rels, [t for t, _ in ix.seq_outputs if t not in ok_outputs])
    if not verified and (failure is None or schedule.problems) and mismatches:  # (calls that cannot run come first)
        bad_calls = [(str(grp), int(seq)) for grp, seq, _r in derived.get("missing_call")]
        bad_calls += [(str(grp), int(seq)) for grp, seq in derived.get("disagreeing_call")]
        collectives = [_call(ix, rels, grp, seq) for grp, seq in sorted(set(bad_calls))[:4]]
        collectives += [_call(ix, rels, grp, seq, scheduled=made, problem=problem)
                        for (grp, seq), (made, problem) in list(schedule.calls.items())[:4]]
        failure = Failure(node="(collectives)", op="dist", reason="; ".join(mismatches[:3]), collectives=collectives)
    if not verified and failure is None and unchecked:  # (every output rebuilt: the calls are what is unproven)
        failure = Failure(node="(collectives)", op="dist", reason=unchecked)
    elif failure is not None and unchecked and failure.node != "(collectives)":  # (what no lemma reads yet, said too)
        failure.reason = f"{failure.reason}; the ranks also make {unchecked}"
    if failure is not None and closest_lemma:
        failure.closest = _closest(ix, facts, derived, rels, failure.node, rule_dirs)
    diagnosis = None
    if failure is not None:
        failing = f"seq:{failure.node}" if f"seq:{failure.node}" in ix.op else None
        diagnosis = plain.what_is_wrong(ix, rels, failure, failing, derived.get("ring_stuck"))
        if diagnosis is not None and diagnosis.rank_node:  # drawn as the culprit on every rank
            drawn = {node.label for excerpt in failure.neighbourhood if excerpt.rank >= 0 for node in excerpt.nodes}
            if diagnosis.rank_node not in drawn and failing is not None:
                failure.neighbourhood = _neighbourhood(ix, rels, failing, failure, culprit=diagnosis.rank_node)
            for excerpt in failure.neighbourhood:
                for node in excerpt.nodes:
                    if excerpt.rank >= 0 and node.label == diagnosis.rank_node:
                        node.role = "culprit"
    return Report(
        model=model,
        verdict="verified" if verified else "unproven",
        world_size=ix.world_size,
        outputs=outputs,
        diagnosis=diagnosis,
        failure=failure,
        other_failures=others,
        other_failure_groups=groups,
        unrelated_inputs=unrelated,
        collective_mismatches=mismatches,
        sanity_violations=sanity,
        explanation=explanation,
        relations=len(derived.get("rel")),
        lower_seconds=round(lower_seconds, 4),
        run_seconds=round(derived.seconds, 4),
    )


def _ancestors(ix: FactIndex, tensors: list[str]) -> set[str]:
    """Sequential nodes that the given tensors depend on (including their producers)."""
    seen: set[str] = set()
    stack = [ix.producer[t] for t in tensors if t in ix.producer]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(ix.producer[t] for t in ix.inputs.get(n, []) if t in ix.producer)
    return seen


def _rank_nodes(ix: FactIndex, n: str, rels: dict[str, list[tuple[str, object]]]) -> list[RankNode]:
    """Rank nodes that consume a rank tensor related to some input of seq node n (first seen first)."""
    seen: set[str] = set()
    out = []
    for s in ix.inputs.get(n, []):
        for t, _lay in sorted(rels.get(s, []), key=lambda r: _rank_of_tensor(ix, r[0])):
            for m in ix.consumers.get(t, []):
                if m not in seen:
                    seen.add(m)
                    out.append(RankNode(rank=ix.rank_of_graph.get(ix.node_graph.get(m, ""), -1), node=_short(m),
                                        op=ix.op.get(m, "?"), location=ix.loc.get(m)))
    return out


def _diagnose(ix: FactIndex, n: str, op: str, handled: dict[str, str], rank_nodes: list[RankNode]) -> tuple[str, str | None]:
    """Why no lemma relates seq node n's output: (reason, rules file to extend)."""
    if op not in handled:
        return f"no lemma handles op {op}; add one to the lemma library (rules/)", None
    if not rank_nodes:
        return f"no rank program computes {op} on tensors related to this node's inputs", handled[op]
    if any(r.op == op for r in rank_nodes):
        return f"no lemma in rules/{handled[op]} relates the output of {op} for these input layouts", handled[op]
    return (f"the ranks feed these inputs to {', '.join(sorted({r.op for r in rank_nodes}))}, "
            f"not to {op}, and no lemma relates that to this node"), handled[op]


def _first_failure(ix: FactIndex, derived: Derived, rels: dict[str, list[tuple[str, object]]],
                   bad_outputs: list[str]) -> tuple[Failure | None, int, list[FailureGroup]]:
    frontier = {str(n) for (n,) in derived.get("frontier")}
    relevant = _ancestors(ix, bad_outputs)
    candidates = sorted((n for n in frontier if n in relevant), key=lambda n: ix.topo.get(n, 1 << 30))
    unrelated = [str(s) for (s,) in derived.get("unrelated_input")]
    if not candidates:
        if not bad_outputs:
            return None, 0, []
        rebuilt_by_some = {str(s) for s, scope in derived.get("complete") if scope == "own"}
        failure = _output_failure(ix, rels, bad_outputs[0], unrelated, rebuilt_by_some)
        return _with_context(ix, rels, failure, ix.producer.get(bad_outputs[0])), 0, []
    n = candidates[0]
    op = ix.op.get(n, "?")
    handled = {str(o): str(f) for o, f in derived.get("handles")}
    data = {str(s) for (s,) in derived.get("data")}
    inputs = []
    for s in ix.inputs.get(n, []):
        for t, lay in sorted(rels.get(s, []), key=lambda r: _rank_of_tensor(ix, r[0])):
            inputs.append(InputRelation(input=_short(s), rank=_rank_of_tensor(ix, t), rank_tensor=_short(t), layout=layouts.text(lay)))
    rank_nodes = _rank_nodes(ix, n, rels)
    missing = [_short(s) for s in ix.inputs.get(n, []) if s in data and not rels.get(s)]
    reason, rules_file = _diagnose(ix, n, op, handled, rank_nodes)
    failure = Failure(node=_short(n), op=op, location=ix.loc.get(n), reason=reason, rules_file=rules_file,
                      inputs=inputs, unrelated_inputs=missing, rank_nodes=rank_nodes[:16])
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for other in candidates[1:]:
        other_op = ix.op.get(other, "?")
        cause, _ = _diagnose(ix, other, other_op, handled, _rank_nodes(ix, other, rels))
        groups[(other_op, cause)].append(_short(other))
    summary = [FailureGroup(op=o, cause=c, count=len(ns), nodes=ns[:5]) for (o, c), ns in groups.items()]
    summary.sort(key=lambda g: -g.count)
    return _with_context(ix, rels, failure, n), len(candidates) - 1, summary


def _output_failure(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], t: str, unrelated: list[str],
                    rebuilt_by_some: set[str]) -> Failure:
    """An output that no frontier node explains: say what the ranks' outputs hold instead.
    `rebuilt_by_some`: outputs that some of their same-named rank outputs rebuild, though not
    every one takes part (complete(S, own) in rules/report.lp)."""
    n = ix.producer.get(t, t)
    name = _short(t)
    held = [(r, rt, lay) for rt, lay in rels.get(t, []) for r in [_rank_of_tensor(ix, rt)]]
    if not held:
        reason = f"output {name} is not related to any rank tensor"
    else:
        at_outputs = {rt: lay for _r, rt, lay in held if rt in ix.rank_outputs}
        rank_outs = sorted((ix.rank_of_graph[g], rt) for rt in ix.rank_outputs
                           for g in [rt.split(":", 1)[0]] if _short(rt) == name)
        said = [(r, _short(rt), layouts.text(at_outputs[rt]) if rt in at_outputs else "unrelated to it")
                for r, rt in rank_outs]
        parts = [f"{rank_tensors_text([f'r{r}:{short}' for r, short, _ in run])} "
                 f"{'is' if len(run) == 1 else 'are'} {phrase}"
                 for run in _runs(said)[:8] for phrase in [run[0][2]]]
        strays = [(r, rt) for r, rt in rank_outs if rt not in at_outputs]
        if strays and t in rebuilt_by_some:  # the others rebuild it: name the odd ones out
            r, rt = strays[0]
            made_by = ix.producer.get(rt)
            where = f", computed by r{r} node {_short(made_by)}" if made_by else ""
            loc = ix.loc.get(made_by) if made_by else None
            where += f" at {loc.file}:{loc.line}" if loc is not None and loc.file else ""
            reason = (f"every rank that has output {name} must take part in rebuilding it, but r{r}:{_short(rt)}"
                      f"{where} relates to it by no layout ({'; '.join(parts)})")
        else:
            reason = (f"output {name} can be rebuilt from intermediate rank tensors, but the ranks' outputs do not "
                      f"rebuild it" + (f" ({'; '.join(parts)})" if parts else ""))
    if unrelated:
        reason += f"; inputs with no declared relation: {', '.join(_short(u) for u in unrelated)}"
    inputs = [InputRelation(input=name, rank=r, rank_tensor=_short(rt), layout=layouts.text(lay))
              for r, rt, lay in sorted(held, key=lambda h: h[0])]
    return Failure(node=_short(n), op=ix.op.get(n, "?"), location=ix.loc.get(n), reason=reason,
                   inputs=inputs, unrelated_inputs=[_short(u) for u in unrelated],
                   rank_nodes=_output_producers(ix, name)[:16])


def _output_producers(ix: FactIndex, name: str) -> list[RankNode]:
    """The rank nodes that compute each rank's output `name` (past the Identity that names it):
    where an output no frontier node explains is made on the rank side (a lookup's rows, each
    rebuilt by its owner, all-reduced unmasked)."""
    out = []
    for rt in sorted(ix.rank_outputs):
        if _short(rt) != name:
            continue
        node = ix.producer.get(rt)
        for _ in range(8):
            source = ix.in_slot.get(node, {}).get(0) if node is not None and ix.op.get(node) == "Identity" else None
            if source is None or source not in ix.producer:
                break
            node = ix.producer[source]
        if node is not None:
            out.append(RankNode(rank=ix.rank_of_graph.get(ix.node_graph.get(node, ""), -1), node=_short(node),
                                op=ix.op.get(node, "?"), location=ix.loc.get(node)))
    return out


# --- the closest lemma, in words -------------------------------------------------------------


def _closest(ix: FactIndex, facts: FactSet, derived: Derived, rels: dict[str, list[tuple[str, object]]], node: str,
             rule_dirs: list[Path] | None) -> ClosestLemma | None:
    """The lemma that came closest at seq node `node` (short name), or None (no lemma about its
    op came near, or the question could not be asked: an explanation never blocks a report)."""
    n = f"seq:{node}"
    if ix.node_graph.get(n) != "seq" or any(g == "seq" and m == n for _c, g, m in facts.rows["call_node"]):
        return None  # no node, or a layer call: the failure inside the layer is explained instead
    # relations derived by generated rules (layer summaries) go in as facts: the question is
    # asked of the library alone
    program = "\n".join(f"rel({s},{t},{lay})." for s, t, lay in derived.raw.get("rel", []))
    try:
        found = closest.find(facts, n, rule_dirs, program)
    except (RuntimeError, InputError):
        return None
    if found is None:
        return None

    def near(steps: list[closest.Step]) -> NearLemma:
        head, *below = (_premise(ix, rels, step) for step in steps)
        return NearLemma(**head.model_dump(), because=below)

    rank = _ranked(ix, str(found.goal.rank_node.value)) if found.goal.rank_node is not None else None
    return ClosestLemma(**near(found.steps).model_dump(), rank_node=rank, others=[near(s) for s in found.others],
                        tried=found.tried)


def _ranked(ix: FactIndex, t: str) -> str:
    """A rank tensor or node id as `r1:name`."""
    return f"r{_rank_of_tensor(ix, t)}:{_short(t)}"


def _rule_file(path: str) -> str:
    p = Path(path)
    return f"rules/{p.name}" if p.parent == builtin_rules_dir() else path


def _premise(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], step: closest.Step) -> Premise:
    want, have = _premise_words(ix, rels, step)
    words = (f"needs {want}" + (f"; but {have}" if have else "")) if step.missing else "its premises hold"
    return Premise(rule=step.rule.name, file=_rule_file(step.rule.file), line=step.rule.line, matched=step.matched,
                   premises=step.premises, missing=_plain(step.missing) if step.missing else None, words=words)


_GRAPH_PREFIX = re.compile(r'"seq:')
_KIND_WORDS = {"rep": "a replica", "sl": "a slice", "blk": "blocks", "psum": "a partial sum", "pmax": "a partial max",
               "psl": "a slice of a partial sum", "scaled": "a scaled layout"}


def _plain(text: str) -> str:
    """Clingo text with sequential tensor and node ids without their `seq:` prefix."""
    return _GRAPH_PREFIX.sub('"', text)


def _layout_words(value: object, text: str) -> str:
    """A layout in words; a partly open one by its kind and its clingo text."""
    if value is not None:
        return _a(value)
    kind = _KIND_WORDS.get(text.split("(", 1)[0])
    return f"{kind} `{_plain(text)}`" if kind else f"`{_plain(text)}`"


def _where_node(ix: FactIndex, m: str) -> str:
    """`r1's mlp.down_proj/Add (examples/build.py:188)`."""
    loc = ix.loc.get(m)
    at = f" ({loc.file}:{loc.line})" if loc is not None and loc.file else ""
    graph = ix.node_graph.get(m, "")
    who = f"r{ix.rank_of_graph[graph]}'s " if graph in ix.rank_of_graph else ""
    return f"{who}{_short(m)}{at}"


def _holds(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], s: str | None, t: str | None,
           subject: str = "it") -> str:
    """What rank tensor t is of seq tensor s, or where t comes from when it relates to nothing."""
    if s is None or t is None:
        return ""
    lays = [lay for rt, lay in rels.get(s, []) if rt == t]
    if lays:
        return f"{subject} is {' and '.join(sorted(_a(lay) for lay in lays))}"
    producer = ix.producer.get(t)
    source = f" (it comes from {_where_node(ix, producer)}, {ix.op.get(producer, '?')})" if producer else ""
    return f"{subject} relates to no layout of {_short(s)}{source}"


def _a(lay: object) -> str:
    return "a replica" if lay == "rep" else layouts.text(lay)


def _shape(ix: FactIndex, t: str) -> str:
    rank = ix.ndim.get(t)
    return "?" if rank is None else "[" + ", ".join(str(ix.dims.get((t, a), "?")) for a in range(rank)) + "]"


def _premise_words(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], step: closest.Step) -> tuple[str, str]:
    """(what the missing premise asks for, what holds instead), for the core predicates a lemma
    premise is made of; any other premise as its clingo text."""
    if step.missing is None:
        return "", ""
    name = step.missing_sig[0] if step.missing_sig else ""
    vals = [a.value if a is not None else None for a in step.missing_args]
    texts = step.missing_texts

    def s(i: int) -> str | None:
        v = vals[i] if i < len(vals) else None
        return v if isinstance(v, str) else None

    if name == "inrel" and len(vals) == 4:
        n, m, slot = s(0), s(1), vals[2]
        want = _layout_words(vals[3], texts[3])
        if n is not None and m is not None and isinstance(slot, int):
            si, ti = ix.in_slot.get(n, {}).get(slot), ix.in_slot.get(m, {}).get(slot)
            what = f"input {slot} of {_where_node(ix, m)}" + (f", {_short(ti)}," if ti else "")
            return f"{what} to be {want} of {_short(si) if si else '?'}", _holds(ix, rels, si, ti)
        if n is not None and m is not None:
            have = "; ".join(_holds(ix, rels, ix.in_slot.get(n, {}).get(i), ti, f"input {i} ({_short(ti)})")
                             for i, ti in sorted(ix.in_slot.get(m, {}).items()))
            return f"an input of {_where_node(ix, m)} to be {want}", have
        return f"an input of a paired rank node to be {want}", ""
    if name == "pair" and len(vals) == 3:
        n = s(0)
        return (f"a rank node computing {ix.op.get(n, '?') if n else 'the same op'} with the same attributes on a tensor "
                f"related to the same input slot", "no rank node does")
    if name == "pout" and len(vals) == 5:
        m, to = s(1), s(4)
        if m is not None and to is not None:
            producer = ix.producer.get(to)
            have = f"{_short(to)} comes from {_where_node(ix, producer)} ({ix.op.get(producer, '?')})" if producer else ""
            return f"{_short(to)} to be output {vals[2]} of {_where_node(ix, m)}", have
    if name == "rel" and len(vals) == 3 and (si := s(0)) is not None and (ti := s(1)) is not None:
        return f"{_ranked(ix, ti)} to be {_layout_words(vals[2], texts[2])} of {_short(si)}", _holds(ix, rels, si, ti)
    if name == "shape_ok" and len(vals) == 3 and (si := s(0)) is not None and (ti := s(1)) is not None:
        return (f"{_ranked(ix, ti)} to have the shape that {_layout_words(vals[2], texts[2])} of {_short(si)} implies",
                f"it has shape {_shape(ix, ti)}, and {_short(si)} has {_shape(ix, si)}")
    if name == "positional" and len(vals) == 1:
        return f"{_layout_words(vals[0], texts[0])} to be positional (a slice or blocks of one axis)", ""
    concrete = _plain(step.missing)
    if step.source and _plain(step.source) != concrete:
        return f"`{step.source}` of {_rule_file(step.rule.file)}:{step.rule.line}, here `{concrete}`", ""
    return f"`{concrete}`", ""


# --- context of a failure: collective calls, graph neighbourhood ---------------------------


def _relation_of(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], t: str, prefer: list[str],
                 compact: bool = False) -> str | None:
    """How rank tensor t relates to a sequential tensor (preferring those in `prefer`), as text."""
    found = [(s, lay) for s in prefer for rt, lay in rels.get(s, []) if rt == t]
    if not found:
        found = [(s, lay) for s, pairs in rels.items() for rt, lay in pairs if rt == t]
    if not found:
        return None
    s, lay = found[0]
    if compact:
        return f"{_compact(lay)} of {_short(s)}"
    return f"{layouts.text(lay)} of {_short(s)}"


def _call(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], grp: str, seq: int,
          prefer: list[str] | None = None, scheduled: dict[int, ScheduledCall] | None = None,
          problem: str | None = None) -> CollectiveCall:
    """The call number `seq` on group `grp`, as every member of the group makes it (or not):
    numbered in the facts' own graphs, or, `scheduled`, among every call the members make
    (refine/diagnose/schedule.py: a call inside a layer call is named `CALL/NODE`; `problem` says what
    the schedule check found wrong with it)."""
    if scheduled is None:
        made, inside = ix.calls.get((grp, seq), {}), {}
    else:
        made = {f"r{r}": c.node for r, c in scheduled.items() if not c.inner}
        inside = {r: c for r, c in scheduled.items() if c.inner}
    members = []
    for r in ix.group_members.get(grp, []):
        m = made.get(f"r{r}")
        if r in inside:
            c = inside[r]
            members.append(CollectiveMember(rank=r, node=c.name, op=f"dist.{c.kind}",
                                            location=Location(module=c.module, file=c.file, line=c.line) if c.file else None))
            continue
        if m is None:
            members.append(CollectiveMember(rank=r))
            continue
        t_in, t_out = ix.in_slot[m].get(0), ix.out_slot[m].get(0)
        members.append(CollectiveMember(
            rank=r, node=_short(m), op=ix.op.get(m), signature=ix.sig.get(m), location=ix.loc.get(m),
            input=_short(t_in) if t_in else None, output=_short(t_out) if t_out else None,
            input_relation=_relation_of(ix, rels, t_in, prefer or []) if t_in else None))
    present = [m for m in members if m.node is not None]
    missing = [m.rank for m in members if m.node is None]
    sigs = {m.signature for m in present if m.signature is not None}
    if problem is not None:
        pass
    elif missing:
        problem = f"rank(s) {', '.join(map(str, missing))} never make this call (the others would wait forever)"
    elif len(sigs) > 1 and channel_of(grp) is None:  # (a point-to-point call: a Send meets a Recv)
        problem = "members disagree on the op or its attributes: " + " vs ".join(sorted(str(s) for s in sigs))
    kind = ix.coll[next(iter(made.values()))][0] if made else next((c.kind for c in inside.values()), "?")
    if (channel := channel_of(grp)) is not None:  # group [sender, receiver]
        kind = f"Send/Recv (tag {channel[2]})"
    group = ix.group_members.get(grp, [])
    fits = _pieces_group(ix, rels, ix.in_slot[made[f"r{group[0]}"]].get(0)) if group and f"r{group[0]}" in made else None
    return CollectiveCall(group=group, call=seq, kind=kind, matched=problem is None, problem=problem, members=members,
                          mesh_group=mesh_group_words(group, ix.mesh),
                          fits=fits if fits is not None and fits != group else None,
                          fits_mesh_group=mesh_group_words(fits, ix.mesh) if fits is not None and fits != group else None)


_GLUE = ("Concat", "Identity", "Reshape")  # rank-only steps between a tensor and its collective


def _pieces_group(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], t: str | None) -> list[int] | None:
    """The ranks holding the pieces (of one partial sum or max, of one batch chunk) that rank tensor
    t is a piece of (or, for a rank-only Concat of slices of pieces, its first input): the group a
    reduction of t must run over (BUGS.md class 11), or None when t is no piece."""
    if t is None:
        return None
    producer = ix.producer.get(t)
    if producer is not None and ix.op.get(producer) in _GLUE and not any(rt == t for pairs in rels.values() for rt, _ in pairs):
        return _pieces_group(ix, rels, ix.in_slot[producer].get(0))
    for s, pairs in rels.items():
        for rt, lay in pairs:
            if rt == t and _decomposition(lay) is not None:
                whole, me = _decomposition(lay), _rank_of_tensor(ix, t)
                holders: dict[tuple, set[int]] = defaultdict(set)  # piece -> the ranks holding it
                for other, other_lay in pairs:
                    if _decomposition(other_lay) == whole:
                        holders[_piece(other_lay)].add(_rank_of_tensor(ix, other))
                # one holder per piece: this rank for its own, else the one nearest it on the mesh
                return sorted(me if me in ranks else min(ranks, key=lambda r: (_mesh_distance(ix, r, me), r))
                              for ranks in holders.values())
    return None


def _piece(lay: object) -> tuple:
    """Which piece of its decomposition a layout is: [a, b) (and its batch chunk)."""
    if layouts.kind(lay) == "chunk":
        _, axis, k, n, inner = lay  # type: ignore[misc]
        return (axis, k, n, _piece(inner))
    args = lay[1:]  # type: ignore[index]
    return tuple(args[-4:-2])  # (psum/pmax: a, b; psl: a, b)


def _mesh_distance(ix: FactIndex, a: int, b: int) -> int:
    """How many mesh coordinates two ranks differ in (0 apart: the same rank)."""
    sizes = [size for _, size in ix.mesh] or [ix.world_size or 1]
    return sum(x != y for x, y in zip(np.unravel_index(a, sizes), np.unravel_index(b, sizes)))


def _decomposition(lay: object) -> tuple | None:
    """What a piece is a piece of: (kind, pieces, style), within its batch chunk if any."""
    if layouts.kind(lay) == "chunk":
        _, axis, k, n, inner = lay  # type: ignore[misc]
        whole = _decomposition(inner)
        return None if whole is None else ("chunk", axis, k, n, whole)
    if layouts.kind(lay) in ("psum", "pmax"):
        _, _a, _b, d, style = lay  # type: ignore[misc]
        return (layouts.kind(lay), d, repr(style))
    if layouts.kind(lay) == "psl":  # the same slice of pieces of one sum
        _, c, x, y, _a, _b, d, style = lay  # type: ignore[misc]
        return ("psl", c, x, y, d, repr(style))
    return None


def _with_context(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], failure: Failure, n: str | None) -> Failure:
    """Add the collective calls near seq node n and the graphs' neighbourhood of it."""
    if n is None or n not in ix.op:
        return failure
    seq_tensors = list(ix.in_slot[n].values()) + list(ix.out_slot[n].values())
    related = [t for s in seq_tensors for t, _lay in rels.get(s, [])]
    centers = {m for t in related for m in ix.consumers.get(t, []) if ix.op.get(m) == ix.op.get(n)}
    near: set[str] = set()
    for t in related:
        for m in ix.consumers.get(t, []) + ([ix.producer[t]] if t in ix.producer else []):
            if m in ix.coll:
                near.add(m)
            elif ix.op.get(m) in _GLUE:  # (sequence parallelism stacks slices of a partial, then reduce-scatters)
                near.update(c for o in ix.out_slot[m].values() for c in ix.consumers.get(o, []) if c in ix.coll)
    for m in centers:
        for t in ix.out_slot[m].values():
            near.update(c for c in ix.consumers.get(t, []) if c in ix.coll)
    calls = sorted({ix.coll[m][1:] for m in near}, key=lambda c: (c[0], c[1]))
    failure.collectives = [_call(ix, rels, grp, seq, seq_tensors) for grp, seq in calls[:4]]
    failure.neighbourhood = _neighbourhood(ix, rels, n, failure)
    return failure


MAX_EXCERPT_NODES = 12


def _compact(lay: object) -> str:
    """A layout in a few characters, for edge labels: `rep`, `sl2[0:32)`, `psum[0:32)/64`."""
    k = layouts.kind(lay)
    args = [] if isinstance(lay, str) else list(lay[1:])  # type: ignore[index]
    if k == "rep":
        return "rep"
    if k == "sl":
        return f"sl{args[0]}[{args[1]}:{args[2]})"
    if k == "blk":
        return f"blk{args[0]}/{args[1]}[{args[2]}:{args[3]})"
    if k in ("psum", "pmax"):
        return f"{k}[{args[0]}:{args[1]})/{args[2]}"
    if k == "scaled":
        return f"{args[0]}/{args[1]}*{_compact(args[2])}"
    return layouts.text(lay)


def _rel_summary(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], s: str) -> str:
    """A seq tensor's relations, compressed: `rep on r0..r1` / `r0 psum[0:32)/64, r1 psum[32:64)/64`."""
    pairs = sorted(((_rank_of_tensor(ix, t), _compact(lay)) for t, lay in rels.get(s, [])))
    if not pairs:
        return "no relation"
    texts = {txt for _r, txt in pairs}
    if len(texts) == 1:
        return f"{texts.pop()} on {ranks_text(sorted({r for r, _ in pairs}))}"
    shown = ", ".join(f"r{r} {txt}" for r, txt in pairs[:2])
    return shown + (f", +{len(pairs) - 2}" if len(pairs) > 2 else "")


def _excerpt(ix: FactIndex, graph: str, rank: int, centers: list[str], roles: dict[str, str],
             edge_label) -> GraphExcerpt:
    """Centers, their producers (one hop up) and consumers (one hop down), with graph inputs/outputs."""
    nodes: list[str] = []

    def add(m: str) -> None:
        if m not in nodes and len(nodes) < MAX_EXCERPT_NODES:
            nodes.append(m)

    for c in centers:
        add(c)
    for c in centers:
        for t in ix.in_slot[c].values():
            if t in ix.producer:
                add(ix.producer[t])
    for c in centers:
        for t in ix.out_slot[c].values():
            for m in ix.consumers.get(t, []):
                add(m)
    inside = set(nodes)
    out = GraphExcerpt(graph=graph, rank=rank)
    for m in sorted(nodes, key=lambda m: ix.topo_all.get(m, 0)):
        loc = ix.loc.get(m)
        out.nodes.append(GraphNode(id=m, label=_short(m), op=ix.op.get(m, "?"), role=roles.get(m, "context"),  # type: ignore[arg-type]
                                   location=f"{loc.file}:{loc.line}" if loc and loc.file else None))
    pseudo: set[str] = set()
    for m in nodes:
        for _i, t in sorted(ix.in_slot[m].items()):
            src = ix.producer.get(t)
            if src is None and m in centers and t not in ix.consts:
                src = f"in:{t}"
                if src not in pseudo:
                    pseudo.add(src)
                    out.nodes.insert(0, GraphNode(id=src, label=_short(t), op="input", role="input"))
            if src is not None and (src in inside or src in pseudo):
                out.edges.append(GraphEdge(src=src, dst=m, tensor=_short(t), layout=edge_label(t)))
        for _i, t in sorted(ix.out_slot[m].items()):
            if t in ix.graph_outputs and m in centers:
                dst = f"out:{t}"
                out.nodes.append(GraphNode(id=dst, label=_short(t), op="output", role="output"))
                out.edges.append(GraphEdge(src=m, dst=dst, tensor=_short(t), layout=edge_label(t)))
    return out


def _neighbourhood(ix: FactIndex, rels: dict[str, list[tuple[str, object]]], n: str, failure: Failure,
                   culprit: str | None = None) -> list[GraphExcerpt]:
    """The failing node's neighbourhood in the sequential graph and in every rank graph (and the
    diagnosis's rank-side `culprit`, where it is a few ops away: a factor the ranks carry to it)."""
    seq_tensors = list(ix.in_slot[n].values()) + list(ix.out_slot[n].values())
    excerpts = [_excerpt(ix, "seq", -1, [n], {n: "failing"}, lambda t: _rel_summary(ix, rels, t))]
    op = ix.op.get(n)
    for g, r in sorted(ix.rank_of_graph.items(), key=lambda kv: kv[1]):
        if r >= 8:
            break
        centers: list[str] = [f"{g}:{rn.node}" for rn in failure.rank_nodes if rn.rank == r]
        for s in ix.in_slot[n].values():  # rank nodes computing the same op on related inputs
            for t, _lay in rels.get(s, []):
                if t.startswith(g + ":"):
                    centers.extend(m for m in ix.consumers.get(t, []) if ix.op.get(m) == op)
        for s in ix.out_slot[n].values():  # where the ranks hold (pieces of) the node's output
            for t, _lay in rels.get(s, []):
                if t.startswith(g + ":") and t in ix.producer:
                    centers.append(ix.producer[t])
        if not centers:
            continue
        centers = sorted(set(centers), key=lambda m: (ix.op.get(m) != op, ix.topo_all.get(m, 0)))[:4]
        if culprit is not None and f"{g}:{culprit}" in ix.op:
            centers = [f"{g}:{culprit}", *centers[:3]]
        roles = {m: "match" for m in centers if ix.op.get(m) == op}
        excerpts.append(_excerpt(ix, g, r, centers, roles,
                                 lambda t: _relation_of(ix, rels, t, seq_tensors, compact=True)))
    return excerpts


# --- explain: the derivation chain of one output -------------------------------------------

MAX_EXPLAIN_STEPS = 200


def _explain(ix: FactIndex, derived: Derived, rels: dict[str, list[tuple[str, object]]], output: str) -> Explanation:
    names = {name: t for t, name in ix.seq_outputs}
    if output not in names:
        raise InputError(None, f"--explain: the sequential model has no output {output!r} "
                               f"(outputs: {', '.join(sorted(names)) or 'none'})")
    s0 = names[output]
    lemmas: dict[tuple, list[str]] = defaultdict(list)
    for s, t, lay, lemma in derived.get("rel_by"):
        lemmas[(str(s), str(t), lay)].append(str(lemma))
    rel_set = {(str(s), str(t), lay) for s, t, lay in derived.get("rel")}
    by_pair: dict[tuple[str, str], list[object]] = defaultdict(list)
    for s, t, lay in sorted(rel_set, key=str):
        by_pair[(s, t)].append(lay)
    data = {str(s) for (s,) in derived.get("data")}
    ok = s0 in {str(s) for (s,) in derived.get("output_ok")}
    steps: list[ExplainStep] = []
    visited: set[tuple] = set()
    seen_unrelated: set[str] = set()

    def pick(s: str, t: str) -> object | None:
        lays = by_pair.get((s, t), [])
        plain = [lay for lay in lays if layouts.kind(lay) != "scaled"]
        return (plain or lays or [None])[0]

    def rank_key(t: str) -> tuple:
        return (_rank_of_tensor(ix, t), t)

    def step(depth: int, s: str, t: str | None, lay: object | None, note: str = "") -> ExplainStep:
        n = ix.producer.get(s)
        m = ix.producer.get(t) if t else None
        return ExplainStep(
            depth=depth, seq_tensor=_short(s), seq_node=_short(n) if n else None, op=ix.op.get(n) if n else None,
            location=ix.loc.get(n) if n else None, rank=_rank_of_tensor(ix, t) if t else None,
            rank_tensor=_short(t) if t else None, rank_node=_short(m) if m else None,
            rank_op=ix.op.get(m) if m else None, layout=layouts.text(lay) if lay is not None else None,
            lemmas=sorted(set(lemmas.get((s, t, lay), []))) if t else [], note=note)

    def premises(s: str, t: str, lay: object) -> list[tuple[str, str, object]]:
        """One plausible set of premises of rel(s, t, lay), found through the two graphs."""
        n, m = ix.producer.get(s), ix.producer.get(t)
        seq_in = ix.in_slot.get(n, {}) if n else {}
        rank_in = ix.in_slot.get(m, {}) if m else {}
        if n and m and ix.op.get(n) == ix.op.get(m):  # paired: slot by slot
            found = []
            for i, si in sorted(seq_in.items()):
                ti = rank_in.get(i)
                if ti is not None and si in data and pick(si, ti) is not None:
                    found.append((si, ti, pick(si, ti)))
            if found:
                return found
        if m:  # an op only the rank has (a collective, an identity): same seq tensor, its input
            for _i, ti in sorted(rank_in.items()):
                if pick(s, ti) is not None:
                    return [(s, ti, pick(s, ti))]
        if n:  # an op only the sequential model has
            for _i, si in sorted(seq_in.items()):
                if si in data and pick(si, t) is not None:
                    return [(si, t, pick(si, t))]
        other = [lay2 for lay2 in by_pair.get((s, t), []) if lay2 != lay and (s, t, lay2) not in visited]
        if other:  # the same pair by another layout (full_slice, unit_scale)
            return [(s, t, other[0])]
        found = []
        for _i, si in sorted(seq_in.items()):  # any related pair of inputs
            if si not in data:
                continue
            for _j, ti in sorted(rank_in.items()):
                if pick(si, ti) is not None:
                    found.append((si, ti, pick(si, ti)))
                    break
        return found

    def walk(depth: int, s: str, t: str, lay: object) -> None:
        if len(steps) >= MAX_EXPLAIN_STEPS:
            return
        key = (s, t, lay)
        if key in visited:
            steps.append(step(depth, s, t, lay, "derived above"))
            return
        visited.add(key)
        st = step(depth, s, t, lay)
        steps.append(st)
        if "declared" in st.lemmas:
            st.note = "declared in refine.json"
            return
        found = premises(s, t, lay)
        if not found:
            st.note = "premises not recovered by this walk"
        for s2, t2, lay2 in found:
            walk(depth + 1, s2, t2, lay2)

    def start(depth: int, s: str, prefer_outputs: bool) -> None:
        if len(steps) >= MAX_EXPLAIN_STEPS:
            return
        pairs = rels.get(s, [])
        if prefer_outputs:
            at_out = [(t, lay) for t, lay in pairs if t in ix.rank_outputs]
            pairs = at_out or pairs
        if pairs:
            t, lay = sorted(pairs, key=lambda p: (p[1] != "rep", rank_key(p[0])))[0]
            walk(depth, s, t, lay)
            if prefer_outputs and not ok and steps:
                what = "a rank output" if t in ix.rank_outputs else "an intermediate rank tensor"
                steps[0].note = (f"{what}, but the ranks' outputs do not rebuild {_short(s)}"
                                 + (f"; {steps[0].note}" if steps[0].note else ""))
            return
        if s in seen_unrelated:
            steps.append(step(depth, s, None, None, "related to no rank tensor (see above)"))
            return
        seen_unrelated.add(s)
        note = "declared input without a relation" if s in ix.seq_inputs else "related to no rank tensor: the chain breaks here"
        steps.append(step(depth, s, None, None, note))
        n = ix.producer.get(s)
        for _i, si in sorted(ix.in_slot.get(n, {}).items()) if n else []:
            if si in data:
                start(depth + 1, si, False)

    start(0, s0, True)
    reconstruction = _reconstruction(ix, s0, rels.get(s0, [])) if ok else None
    return Explanation(output=output, rebuilt=ok, reconstruction=reconstruction, steps=steps,
                       truncated=len(steps) >= MAX_EXPLAIN_STEPS)
