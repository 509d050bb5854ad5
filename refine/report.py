"""The verdict and the report: pydantic models, built from the facts and the fixpoint.

`verified`: every sequential output is rebuilt from the ranks' outputs (a replica, a
concatenation, a sum or max of partials). Otherwise `unproven`, with the first sequential
node (topological order) where a relation breaks, what its inputs related to on each rank,
and which rules file a rule author would extend. (`refuted` is reserved for a failure
confirmed by a numeric counterexample.)
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from refine import layouts
from refine.engine import Derived
from refine.facts import FactSet

Verdict = Literal["verified", "refuted", "unproven"]


class OutputResult(BaseModel):
    """One sequential output and how it is rebuilt from rank outputs (if it is)."""

    name: str
    ok: bool
    reconstruction: str | None = None


class InputRelation(BaseModel):
    """What one input of the failing node relates to on one rank."""

    input: str
    rank: int
    rank_tensor: str
    layout: str


class Location(BaseModel):
    module: str = ""
    file: str = ""
    line: int = 0


class RankNode(BaseModel):
    rank: int
    node: str
    op: str
    location: Location | None = None


class Failure(BaseModel):
    """The first sequential node where reconstruction breaks, and why."""

    node: str
    op: str
    location: Location | None = None
    reason: str
    rules_file: str | None = Field(default=None, description="lemma file a rule author would extend")
    inputs: list[InputRelation] = Field(default_factory=list)
    unrelated_inputs: list[str] = Field(default_factory=list)
    rank_nodes: list[RankNode] = Field(default_factory=list)


class Report(BaseModel):
    """The result of one verification."""

    model: str
    verdict: Verdict
    world_size: int
    outputs: list[OutputResult]
    failure: Failure | None = None
    other_failures: int = 0
    unrelated_inputs: list[str] = Field(default_factory=list)
    collective_mismatches: list[str] = Field(default_factory=list)
    sanity_violations: list[str] = Field(default_factory=list)
    relations: int = 0
    lower_seconds: float = 0.0
    run_seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "verified" else 1


def _short(tensor_or_node: str) -> str:
    """Strip the graph prefix: `seq:h` -> `h`."""
    return tensor_or_node.split(":", 1)[1] if ":" in tensor_or_node else tensor_or_node


class _Index:
    """The facts the report needs, indexed."""

    def __init__(self, facts: FactSet) -> None:
        rows = facts.rows
        self.world_size = rows["world_size"][0][0] if rows["world_size"] else 0
        self.rank_of_graph = {g: r for g, kind, r in rows["graph"] if kind == "rank"}
        self.op = {n: op for _, n, op in rows["node"]}
        self.topo = {n: i for g, n, i in rows["topo"] if g == "seq"}
        self.loc = {n: Location(module=m, file=f, line=ln) for _, n, m, f, ln in rows["loc"]}
        self.inputs: dict[str, list[str]] = defaultdict(list)
        self.consumers: dict[str, list[str]] = defaultdict(list)
        for g, n, _i, t in rows["node_in"]:
            self.inputs[n].append(t)
            self.consumers[t].append(n)
        self.producer = {t: n for _g, n, _i, t in rows["node_out"]}
        self.node_graph = {n: g for g, n, _op in rows["node"]}
        self.seq_outputs = [(t, name) for g, t, name in rows["graph_output"] if g == "seq"]
        self.rank_outputs = {t for g, t, _ in rows["graph_output"] if g != "seq"}
        self.tensor_graph: dict[str, str] = {t: g for g, t, _ in rows["ndim"]}
        self.dims = {(t, a): d for g, t, a, d in rows["dim"]}


def _rank_of_tensor(ix: _Index, t: str) -> int:
    return ix.rank_of_graph.get(t.split(":", 1)[0], -1)


def _reconstruction(ix: _Index, s: str, rels: list[tuple[str, object]]) -> str | None:
    """How sequential output `s` is rebuilt from rank outputs, as one line, or None."""
    outs = [(t, lay) for t, lay in rels if t in ix.rank_outputs]
    reps = sorted((_rank_of_tensor(ix, t), t) for t, lay in outs if lay == "rep")
    name = _short(s)
    if reps:
        ranks = [r for r, _ in reps]
        where = f"r{ranks[0]}" if len(ranks) == 1 else f"r{ranks[0]}..r{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(f"r{r}" for r in ranks)
        return f"{name} = r{reps[0][0]}:{_short(reps[0][1])} (replicated on {where})"
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
            _, a, b, d = lay  # type: ignore[misc]
            by_kind[("max", None, d)][a].append((b, t))
    for key, edges in by_kind.items():
        total = key[2]
        path = _tiling(edges, total)
        if path is None:
            continue
        parts = ", ".join(f"r{_rank_of_tensor(ix, t)}:{_short(t)}" for t in path)
        if key[0] == "concat":
            return f"{name} = concat({parts}, axis={key[1]})"
        if key[0] == "interleave":
            return f"{name} = interleave({parts}, axis={key[1]}, blocks of {key[2]})"
        return f"{name} = {key[0]}({parts})"
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


def build_report(model: str, facts: FactSet, derived: Derived, lower_seconds: float = 0.0) -> Report:
    """Read the verdict and the explanation off the fixpoint."""
    ix = _Index(facts)
    rels: dict[str, list[tuple[str, object]]] = defaultdict(list)
    for s, t, lay in derived.get("rel"):
        rels[str(s)].append((str(t), lay))
    ok_outputs = {s for (s,) in derived.get("output_ok")}
    outputs = [
        OutputResult(name=name, ok=t in ok_outputs, reconstruction=_reconstruction(ix, t, rels[t]) if t in ok_outputs else None)
        for t, name in ix.seq_outputs
    ]
    unrelated = sorted(_short(str(s)) for (s,) in derived.get("unrelated_input"))
    mismatches = [f"group [{grp}] call #{seq}: rank {r} never makes it" for grp, seq, r in derived.get("missing_call")]
    mismatches += [f"group [{grp}] call #{seq}: members disagree on the op or its attributes" for grp, seq in derived.get("disagreeing_call")]
    sanity = [f"{kind}: {_short(str(s))} ~ {str(t)}" for kind, s, t in derived.get("sanity")]
    verified = all(o.ok for o in outputs) and not mismatches and bool(outputs)
    failure, others = (None, 0) if verified else _first_failure(ix, derived, rels, [t for t, _ in ix.seq_outputs if t not in ok_outputs])
    if not verified and failure is None and mismatches:
        failure = Failure(node="(collectives)", op="dist", reason="; ".join(mismatches[:3]))
    return Report(
        model=model,
        verdict="verified" if verified else "unproven",
        world_size=ix.world_size,
        outputs=outputs,
        failure=failure,
        other_failures=others,
        unrelated_inputs=unrelated,
        collective_mismatches=mismatches,
        sanity_violations=sanity,
        relations=len(derived.get("rel")),
        lower_seconds=round(lower_seconds, 4),
        run_seconds=round(derived.seconds, 4),
    )


def _ancestors(ix: _Index, tensors: list[str]) -> set[str]:
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


def _first_failure(ix: _Index, derived: Derived, rels: dict[str, list[tuple[str, object]]], bad_outputs: list[str]) -> tuple[Failure | None, int]:
    frontier = {str(n) for (n,) in derived.get("frontier")}
    relevant = _ancestors(ix, bad_outputs)
    candidates = sorted((n for n in frontier if n in relevant), key=lambda n: ix.topo.get(n, 1 << 30))
    unrelated = [str(s) for (s,) in derived.get("unrelated_input")]
    if not candidates:
        return (_output_failure(ix, rels, bad_outputs[0], unrelated) if bad_outputs else None), 0
    n = candidates[0]
    op = ix.op.get(n, "?")
    handled = {str(o): str(f) for o, f in derived.get("handles")}
    inputs, consumers = [], []
    data = {str(s) for (s,) in derived.get("data")}
    for s in ix.inputs.get(n, []):
        for t, lay in sorted(rels.get(s, []), key=lambda r: _rank_of_tensor(ix, r[0])):
            inputs.append(InputRelation(input=_short(s), rank=_rank_of_tensor(ix, t), rank_tensor=_short(t), layout=layouts.text(lay)))
            for m in ix.consumers.get(t, []):
                consumers.append(m)
    seen: set[str] = set()
    rank_nodes = []
    for m in consumers:
        if m not in seen:
            seen.add(m)
            rank_nodes.append(RankNode(rank=ix.rank_of_graph.get(ix.node_graph.get(m, ""), -1), node=_short(m), op=ix.op.get(m, "?"), location=ix.loc.get(m)))
    missing = [_short(s) for s in ix.inputs.get(n, []) if s in data and not rels.get(s)]
    if op not in handled:
        reason = f"no lemma handles op {op}; add one to the lemma library (rules/)"
        rules_file = None
    elif not rank_nodes:
        reason = f"no rank program computes {op} on tensors related to this node's inputs"
        rules_file = handled[op]
    else:
        same_op = [r for r in rank_nodes if r.op == op]
        if same_op:
            reason = f"no lemma in rules/{handled[op]} relates the output of {op} for these input layouts"
        else:
            reason = (f"the ranks feed these inputs to {', '.join(sorted({r.op for r in rank_nodes}))}, "
                      f"not to {op}, and no lemma relates that to this node")
        rules_file = handled[op]
    return Failure(node=_short(n), op=op, location=ix.loc.get(n), reason=reason, rules_file=rules_file,
                   inputs=inputs, unrelated_inputs=missing, rank_nodes=rank_nodes[:16]), len(candidates) - 1


def _output_failure(ix: _Index, rels: dict[str, list[tuple[str, object]]], t: str, unrelated: list[str]) -> Failure:
    """An output that no frontier node explains: say what the ranks' outputs hold instead."""
    n = ix.producer.get(t, t)
    name = _short(t)
    held = [(r, rt, lay) for rt, lay in rels.get(t, []) for r in [_rank_of_tensor(ix, rt)]]
    if not held:
        reason = f"output {name} is not related to any rank tensor"
    else:
        at_outputs = {rt: lay for _r, rt, lay in held if rt in ix.rank_outputs}
        rank_outs = sorted((ix.rank_of_graph[g], rt) for rt in ix.rank_outputs
                           for g in [rt.split(":", 1)[0]] if _short(rt) == name)
        parts = [f"r{r}:{_short(rt)} is {layouts.text(at_outputs[rt]) if rt in at_outputs else 'unrelated to it'}"
                 for r, rt in rank_outs[:8]]
        reason = (f"output {name} can be rebuilt from intermediate rank tensors, but the ranks' outputs do not "
                  f"rebuild it" + (f" ({'; '.join(parts)})" if parts else ""))
    if unrelated:
        reason += f"; inputs with no declared relation: {', '.join(_short(u) for u in unrelated)}"
    inputs = [InputRelation(input=name, rank=r, rank_tensor=_short(rt), layout=layouts.text(lay))
              for r, rt, lay in sorted(held, key=lambda h: h[0])]
    return Failure(node=_short(n), op=ix.op.get(n, "?"), location=ix.loc.get(n), reason=reason,
                   inputs=inputs, unrelated_inputs=[_short(u) for u in unrelated])


def render_text(report: Report) -> str:
    """The human-readable report."""
    lines = [f"{report.model}: {report.verdict.upper()} (world size {report.world_size}, "
             f"{report.relations} relations, lower {report.lower_seconds:.2f}s, run {report.run_seconds:.2f}s)"]
    for o in report.outputs:
        lines.append(f"  output {o.name}: {o.reconstruction if o.ok else 'NOT rebuilt from the ranks'}")
    f = report.failure
    if f is not None:
        where = ""
        if f.location and (f.location.module or f.location.file):
            where = f" [{f.location.module}]" + (f" {f.location.file}:{f.location.line}" if f.location.file else "")
        lines.append(f"  first failure: node {f.node} ({f.op}){where}")
        lines.append(f"    why: {f.reason}")
        for rel in f.inputs[:24]:
            lines.append(f"    input {rel.input} on r{rel.rank} ({rel.rank_tensor}): {rel.layout}")
        for name in f.unrelated_inputs:
            lines.append(f"    input {name}: related to no rank tensor")
        for rn in f.rank_nodes[:8]:
            loc = f" {rn.location.file}:{rn.location.line}" if rn.location and rn.location.file else ""
            lines.append(f"    consumed on r{rn.rank} by {rn.node} ({rn.op}){loc}")
        if report.other_failures:
            lines.append(f"  ... and {report.other_failures} more sequential node(s) where relations break")
    if report.unrelated_inputs:
        lines.append(f"  inputs with no relation: {', '.join(report.unrelated_inputs)}")
    for m in report.collective_mismatches[:5]:
        lines.append(f"  collective mismatch: {m}")
    for v in report.sanity_violations[:5]:
        lines.append(f"  SANITY (lemma library bug): {v}")
    return "\n".join(lines)


def write_json(report: Report, path: Path) -> None:
    """Write the report as JSON atomically (never a half-written file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
    tmp.replace(path)
