"""Layer memoization (DESIGN.md §6, docs/layers.md): verify each distinct layer once.

Lowering (refine/lowering/program.py) keeps the layer calls of function-form models: the main
graphs with each call as one opaque node, and each distinct *template* (the bodies called at one
call site on the sequential side and on every rank) as a fact set of its own. This module runs
them: summaries, keys and the memoized fixpoint.

Running: solve the main graphs up to the first calls (the calls and everything computed from
their outputs left out, so this costs the same at any depth); walk the call sites in order,
reading how each one's inputs relate (its *key*, stated by input position), solving each new
(template, key) once and writing its *summary* (the relations at its outputs) onto the next
call of a chain. Each summary becomes a rule that fires at every call site whose inputs
satisfy its key (rules/layers.lp). Calls still without a key (in a training step, the backward
sweep, whose input is computed after the forward calls) get another partial solve, up to them,
with the summaries so far. Then solve the whole main graphs with those rules and repeat until
no call site shows a new key. The calls inside a chain are instantiated by that
walk and left out of the whole solve (`_elision`), so a chain of N identical layers costs one
small main solve, one template solve and one whole main solve of about one layer's size,
whatever N.

Nothing is assumed about a call that its template's proof did not show: a call's outputs have
relations only through a summary whose key its inputs satisfy.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from refine import layouts
from refine.run.engine import Derived, solve
from refine.lowering.facts import SCHEMA, FactSet, _clingo_value
from refine.lowering.load import SEQ
from refine.lowering.program import Program
from refine.run.stage_symmetry import StageAliases
from refine.run.template_solves import TemplateSolver

Progress = Callable[[str], None]
VIOLATIONS = ("sanity", "missing_call", "disagreeing_call", "ring_stuck", "unchecked_counts")  # invariant breaches
# a template solve may derive (unchecked_counts: a ragged all-to-all whose counts no lemma proved to agree)
Key = frozenset[tuple[int, str, int, str]]  # (seq input, rank graph, rank input, layout as clingo text)
Summary = list[tuple[int, str, int, str]]  # (seq output, rank graph, rank output, layout text)


@dataclass
class Site:
    """One layer call site: the call on the sequential side and on every rank."""

    cid: str
    template: str
    nodes: dict[str, str]  # graph -> call node id
    inputs: dict[str, dict[int, str]]  # graph -> input position -> tensor id
    outputs: dict[str, dict[int, str]]

    @cached_property
    def rank_slots(self) -> dict[str, list[tuple[str, int]]]:
        """rank tensor -> the (rank graph, input position) pairs where this site reads it."""
        slots: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for g, ins in self.inputs.items():
            if g != SEQ:
                for j, t in ins.items():
                    slots[t].append((g, j))
        return dict(slots)


@dataclass
class Run:
    """The fixpoint of a program, and what memoization did to reach it."""

    derived: Derived
    summaries: dict[tuple[str, Key], Summary]
    sites: list[Site]
    main_solves: int = 0
    template_solves: int = 0
    elided: int = 0  # calls left out of the last main solve (instantiated along their chain)
    copied: int = 0  # graph outputs of left-out calls given their class representative's atoms
    template_derived: dict[tuple[str, Key], Derived] = field(default_factory=dict)
    aliased: int = 0  # (template, key) pairs read off another template's solve (refine/run/stage_symmetry.py)
    solved_ahead: int = 0  # template solves whose result was ready when the walk needed it (jobs > 1)
    wasted_solves: int = 0  # solves of guessed keys no walk met (jobs > 1)


# --- running -----------------------------------------------------------------------------------


def sites_of(main: FactSet) -> list[Site]:
    """The call sites recorded in the main facts, in the sequential call order."""
    sites: dict[str, Site] = {}
    for cid, template in main.rows["callsite"]:
        sites[str(cid)] = Site(str(cid), str(template), {}, defaultdict(dict), defaultdict(dict))
    site_of: dict[tuple[str, str], list[Site]] = defaultdict(list)  # (graph, call node) -> its sites
    for cid, g, node in main.rows["call_node"]:  # (a sequential call is in one site per micro-batch)
        sites[str(cid)].nodes[str(g)] = str(node)
        site_of[(str(g), str(node))].append(sites[str(cid)])
    for edges, side in (("node_in", "inputs"), ("node_out", "outputs")):
        for g, node, i, t in main.rows[edges]:
            for site in site_of.get((str(g), str(node)), ()):
                getattr(site, side)[str(g)][int(i)] = str(t)
    return list(sites.values())


def run_program(program: Program, rule_dirs: list[Path] | None = None, progress: Progress | None = None,
                elide: bool = True, learned: Run | None = None, jobs: int = 1, stage_symmetry: bool = True) -> Run:
    """The fixpoint of a program (see the module docstring for the memoization loop). With
    `elide`, the calls inside a chain are left out of the whole main solve (`_elision`): the
    result then has no relations for the activations between them, only for what the rest of
    the graphs read (pipeline.py solves without elision to locate a failure). The summaries of
    a `learned` run of the same program are reused, not solved again. With `jobs` > 1, template
    solves a guessed walk meets run ahead in worker processes (refine/run/template_solves.py). With
    `stage_symmetry`, a template that is an earlier one on other ranks (a later pipeline stage's)
    is solved as that one (refine/run/stage_symmetry.py)."""
    solver = TemplateSolver(program.templates, rule_dirs, jobs, solve_template)
    try:
        return _run_program(program, rule_dirs, progress, elide, learned, solver, stage_symmetry)
    finally:
        solver.close()


def _run_program(program: Program, rule_dirs: list[Path] | None, progress: Progress | None, elide: bool,
                 learned: Run | None, solver: TemplateSolver, stage_symmetry: bool) -> Run:
    start = time.perf_counter()
    sites = sites_of(program.main)
    note = progress or (lambda _msg: None)
    if not sites:
        note("solving")
        derived = solve(program.main, rule_dirs)
        return Run(derived, {}, [], main_solves=1)
    consts = Constants.of(program.main)
    params = _param_relations(program.main)
    param_slots = _param_slots(sites, params)
    solvable = _without_ids(program.main, _hidden_params(sites, params, param_slots))
    shapes_agree = _ResultShapes(solvable, program.templates)
    edges = _Edges.of(solvable)
    relay = _relays(solvable)
    summaries: dict[tuple[str, Key], Summary] = {}
    run = Run(Derived(), summaries, sites)
    rules: list[str] = []

    aliases = StageAliases(program, enabled=stage_symmetry)
    target_solves: dict[tuple[str, Key], tuple[Summary, Derived]] = {}

    def solve_pair(template: str, key: Key) -> tuple[Summary, Derived]:
        """A template's summary under `key`: read off the template it is on other ranks
        (StageAliases), solved once per renamed key, where the renaming carries every entry;
        else solved."""
        alias = aliases.of(template)
        target_key = alias[1].key(key) if alias is not None else None
        if alias is not None and target_key is not None:
            target, renaming = alias
            if (target, target_key) in summaries:  # (the target's own sites met this key)
                target_solves[(target, target_key)] = (summaries[(target, target_key)],
                                                       run.template_derived[(target, target_key)])
            elif (target, target_key) not in target_solves:
                target_solves[(target, target_key)] = _counted(solver(target, target_key))
            summary, tderived = target_solves[(target, target_key)]
            back = renaming.inverse.entries(summary)
            styles = renaming.inverse.styles(style for (style,) in tderived.raw.get("aligned_style", []))
            if back is not None and styles is not None and not any(tderived.get(v) for v in VIOLATIONS):
                run.aliased += 1
                return back, Derived(tderived.atoms, {"aligned_style": [(style,) for style in styles]})
        return _counted(solver(template, key))

    def _counted(solved: tuple[Summary, Derived]) -> tuple[Summary, Derived]:
        run.template_solves += 1
        return solved

    def adopt(template: str, key: Key, summary: Summary, tderived: Derived) -> None:
        """A template's summary under `key` becomes a rule for every site."""
        summaries[(template, key)] = summary
        run.template_derived[(template, key)] = tderived
        kid = f"k{len(summaries)}"
        slots = param_slots[template]
        rules.append(summary_rule(kid, template, key, summary, slots))
        # (a row-symmetric run's sums over the batch, decomposed inside the layer: rules/rows.lp)
        rules.extend(f"template_aligned_style({style})." for (style,) in tderived.raw.get("aligned_style", []))
        rules.extend(f"params_ok({_clingo_value(s.cid, 'str')},{kid})." for s in sites
                     if s.template == template and _params_satisfy(s, key, slots, params))

    every_chunk: dict[tuple[str, Key], tuple[Summary, Derived] | None] = {}

    def learn(site: Site, key: Key) -> None:
        """Solve the site's template under `key` and adopt its summary: for a key of batch chunk
        k, the one solve for every chunk, where it holds (`ChunkClass`)."""
        chunked = ChunkClass.of(key)
        if chunked is not None:
            cls = (site.template, chunked.base)
            if cls not in every_chunk:
                note(f"solving layer template {site.template} for every batch chunk ({len(summaries) + 1} distinct so far)")
                summary, tderived = solve_pair(site.template, chunked.base)
                every_chunk[cls] = (summary, tderived) if ChunkClass.stands_for_every_chunk(summary, tderived) else None
            solved = every_chunk[cls]
            if solved is not None:
                adopt(site.template, key, chunked.renamed(solved[0], shapes_agree.seq_dims(site.template)), solved[1])
                return
        note(f"solving layer template {site.template} ({len(summaries) + 1} distinct so far)")
        summary, tderived = solve_pair(site.template, key)
        adopt(site.template, key, summary, tderived)

    for (template, key), summary in (learned.summaries.items() if learned else ()):
        adopt(template, key, summary, learned.template_derived[(template, key)])

    rels: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    # the calls whose keys the last partial solve was to find (a learned run's summaries
    # already hold the keys the partial solves would find)
    waited: set[str] = {site.cid for site in sites} if learned is not None else set()
    def guess_ahead() -> None:
        if solver.parallel:
            solver.ahead(aliases.target_pairs(_guessed_solves(sites, rels, consts, summaries, shapes_agree, relay)))

    while True:
        guess_ahead()
        walk = _learn_along_chains(sites, rels, consts, summaries, learn, relay=relay)
        cut = _elision(sites, walk.keys, edges, shapes_agree) if elide else Elision()
        waiting = {site.cid for site in sites if site.cid not in walk.keys}
        if waiting and waiting != waited:
            # solve up to the calls whose inputs do not relate yet (at first every call; in a
            # training step then the backward sweep's), with every summary so far, to learn
            # their keys: this solve's cost does not grow with what lies beyond those calls
            waited = waiting
            upto = Elision(cut.sites, cut.ids | _after_calls(edges, [s for s in sites if s.cid in waiting]))
            note(f"solving the main graphs up to {len(waiting)} layer calls ({len(summaries)} layer summaries)")
            derived = solve(_without_ids(solvable, upto.ids), rule_dirs, program="\n".join(rules + upto.given(rels)),
                            raw=frozenset({"rel"}))
            run.main_solves += 1
            rels = _relations(derived, params)
            continue
        copies = _output_copies(cut, walk.keys, edges, solvable) if elide else OutputCopies()
        note(f"solving the main graphs ({len(summaries)} layer summaries)")
        solved = Elision(cut.sites, cut.ids | copies.ids)
        derived = solve(_without_ids(solvable, solved.ids), rule_dirs, program="\n".join(rules + solved.given(rels)),
                        raw=frozenset({"rel"}))
        run.main_solves += 1
        if not copies.write(derived, edges.tensors):
            elide = False  # a copied output's atoms mention more than its call's outputs: solve it whole
            continue
        # the solved relations; at the calls left out, the walk writes its summaries again
        rels = _relations(derived, params)
        guess_ahead()
        check = _learn_along_chains(sites, rels, consts, summaries, learn, foresee=set(map(id, cut.sites)))
        if any(check.keys.get(site.cid) != walk.keys[site.cid] for site in cut.sites):
            elide = False  # the solve related a chain's inputs otherwise than foreseen: solve it whole
        elif not check.new and not check.partial:
            run.elided, run.copied = len(cut.sites), len(copies.renames)
            break
        elif not check.new:
            for (_template, key), site in check.partial.items():  # sites some of whose inputs relate to nothing
                learn(site, key)
    for tderived in run.template_derived.values():  # invariant violations inside layers count too
        for name in VIOLATIONS:
            derived.atoms[name].extend(tderived.get(name))
    derived.seconds = time.perf_counter() - start
    run.derived = derived
    run.solved_ahead = solver.taken_ahead
    run.wasted_solves = solver.solved - run.template_solves
    return run


# --- what a main solve needs to see ------------------------------------------------------------

_ID_COLUMNS = frozenset({"n", "t", "s", "c"})  # schema columns that hold a node, tensor or site id


def _without_ids(facts: FactSet, ids: set[str]) -> FactSet:
    """The facts minus every row that mentions one of `ids` (node, tensor or call site ids,
    which name their graph, so one set serves every graph)."""
    if not ids:
        return facts
    out = FactSet()
    for rel in SCHEMA:
        rows = facts.rows[rel.name]
        for k, (name, kind) in enumerate(rel.columns):
            if name in _ID_COLUMNS and kind == "str":
                rows = [row for row in rows if row[k] not in ids]
        out.rows[rel.name] = rows
    return out


@dataclass
class _Edges:
    """Who reads each tensor, what each node gives, and the graph outputs, of one fact set."""

    readers: dict[str, set[str]]
    outputs: dict[str, list[str]]
    graph_outputs: dict[str, str]  # tensor -> output name
    tensors: set[str]

    @classmethod
    def of(cls, facts: FactSet) -> _Edges:
        readers: dict[str, set[str]] = defaultdict(set)
        for _g, n, _i, t in facts.rows["node_in"]:
            readers[str(t)].add(str(n))
        outputs: dict[str, list[str]] = defaultdict(list)
        for _g, n, _i, t in facts.rows["node_out"]:
            outputs[str(n)].append(str(t))
        return cls(readers, outputs, {str(t): str(name) for _g, t, name in facts.rows["graph_output"]},
                   {str(t) for _g, t, _r in facts.rows["ndim"]})


def _after_calls(edges: _Edges, sites: list[Site]) -> set[str]:
    """The layer calls and everything computed from their outputs (nodes and tensors, on every
    graph). Before any summary exists a main solve relates none of it, so the first solve leaves
    it out: its cost then does not grow with depth, and it still finds the first calls' keys.
    (Each kept node keeps all its facts, so every lemma reads it as in the whole graph.)"""
    dropped = {n for site in sites for n in site.nodes.values()}
    todo = [t for n in dropped for t in edges.outputs[n]]
    dropped.update(todo)
    while todo:
        for n in edges.readers[todo.pop()]:
            if n not in dropped:
                dropped.add(n)
                fresh = [t for t in edges.outputs[n] if t not in dropped]
                dropped.update(fresh)
                todo.extend(fresh)
    return dropped


@dataclass
class Walk:
    """What walking the call sites found: how many keys were new (and learned), the key each
    site whose inputs all relate had, and the first site of each unknown key among the others."""

    new: int = 0
    keys: dict[str, Key] = field(default_factory=dict)
    partial: dict[tuple[str, Key], Site] = field(default_factory=dict)


def _learn_along_chains(sites: list[Site], rels: dict[str, dict[str, set[str]]], consts: Constants,
                        summaries: dict[tuple[str, Key], Summary], learn: Callable[[Site, Key], None],
                        foresee: set[int] | None = None, relay: dict[str, list[str]] | None = None) -> Walk:
    """Walk the call sites in order: a site all of whose sequential inputs relate gets its key
    learned (its template solved, once per key) and its summary written onto `rels` at its
    outputs, so the next call of a chain finds its key without another main solve; an output a
    Send hands to a Recv (`relay`, `_relays`) is written at the received tensor too, so a chain
    goes on across pipeline stages. `foresee` (ids of sites) limits the writing to those sites
    (checking a solve: only the calls it left out have their outputs' relations from the walk;
    every other call's, and every received tensor's, are what it solved)."""
    walk = Walk()
    for site in sites:
        key = site_key(site, rels, consts)
        if not set(site.inputs[SEQ]) <= {i for i, *_ in key}:
            if (site.template, key) not in summaries:
                walk.partial.setdefault((site.template, key), site)
            continue
        if (site.template, key) not in summaries:
            learn(site, key)
            walk.new += 1
        walk.keys[site.cid] = key
        if foresee is not None and id(site) not in foresee:
            continue
        for i, g, j, lay in summaries[(site.template, key)]:
            s, t = site.outputs[SEQ].get(i), site.outputs[g].get(j)
            if s is not None and t is not None:
                rels[s][t].add(lay)
                for received in (relay or {}).get(t, ()):
                    rels[s][received].add(lay)
    return walk


def _guessed_solves(sites: list[Site], rels: dict[str, dict[str, set[str]]], consts: Constants,
                    summaries: dict[tuple[str, Key], Summary], shapes: _ResultShapes,
                    relay: dict[str, list[str]]) -> list[tuple[str, Key]]:
    """The (template, key) pairs a walk would solve, in order, if every layer without a summary
    passed its inputs' relations through (`_ResultShapes.passed_through`): solved ahead in worker
    processes, taken only where the real walk meets the same pair."""
    guessed = dict(summaries)
    pairs: list[tuple[str, Key]] = []

    def guess(site: Site, key: Key) -> None:
        chunked = ChunkClass.of(key)  # (the solve `learn` would run first)
        pairs.append((site.template, chunked.base if chunked is not None else key))
        guessed[(site.template, key)] = shapes.passed_through(site.template, key)

    scratch: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for s, related in rels.items():
        scratch[s] = defaultdict(set, {t: set(texts) for t, texts in related.items()})
    _learn_along_chains(sites, scratch, consts, guessed, guess, relay=relay)
    return pairs


def _relays(facts: FactSet) -> dict[str, list[str]]:
    """Sent tensor -> the tensors its matched Recvs give (the Seq-th Send on a channel meets the
    Seq-th Recv on it, rules/collectives.lp's p2p_pair), where both have one dtype and shape.
    Only a foresight for the walk: a relation it writes at a received tensor only picks the keys
    of the calls that read it, and every key a solve left a call out for is read again off that
    solve's own relations (run_program's check), where the rules' recv lemma alone relates it."""
    ends: dict[tuple[str, int], dict[str, tuple[str, str]]] = defaultdict(dict)
    for g, n, kind, ch, seq in facts.rows["coll"]:
        if kind in ("Send", "Recv"):
            ends[(str(ch), int(seq))][str(kind)] = (str(g), str(n))
    first_in = {(str(g), str(n)): str(t) for g, n, i, t in facts.rows["node_in"] if i == 0}
    first_out = {(str(g), str(n)): str(t) for g, n, i, t in facts.rows["node_out"] if i == 0}
    shapes = _shapes(facts)
    relay: dict[str, list[str]] = defaultdict(list)
    for pair in ends.values():
        if "Send" in pair and "Recv" in pair:
            sent, received = first_in.get(pair["Send"]), first_out.get(pair["Recv"])
            if sent is not None and received is not None and shapes.get(sent) == shapes.get(received) is not None:
                relay[sent].append(received)
    return dict(relay)


# --- calls left out of the whole main solve ------------------------------------------------------
# In a chain of calls (a model's layers), what one call gives is read by the next call only, and
# only through its key. Instantiating those summaries in Python (`_learn_along_chains`, exactly
# what the summary rule would do) and leaving those calls and their activations out of the
# whole main solve keeps its cost that of a one-layer model. The walk used a key at each call
# left out; after the solve, every one of them must still see that key, read off the solved
# relations (so the result is the fixpoint the whole graphs would give), or the graphs are
# solved again whole.


@dataclass
class Elision:
    """Calls left out of a main solve: their nodes and the activations only calls read (`ids`),
    and the outputs kept nodes read, whose relations the solve is given (`given`)."""

    sites: list[Site] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)

    def given(self, rels: dict[str, dict[str, set[str]]]) -> list[str]:
        """The walk's relations at the kept outputs of the calls left out, as the summary rule
        would state them (through the shape guard, like every relation)."""
        lines = []
        for site in self.sites:
            for i, s in site.outputs[SEQ].items():
                if s in self.ids:
                    continue
                related = rels.get(s, {})
                lines += [declared_relation(s, t, lay, fact="rel_by")
                          for g, outs in site.outputs.items() if g != SEQ for t in outs.values() for lay in related.get(t, ())]
        return lines


class _ResultShapes:
    """Whether a call's outputs have exactly the shapes of its template's results (so the
    summary's relations pass the shape guard there as they did in the template)."""

    def __init__(self, main: FactSet, templates: dict[str, FactSet]) -> None:
        self._main = _shapes(main)
        self._results: dict[str, dict[tuple[str, int], tuple]] = {}
        self._params: dict[str, dict[tuple[str, int], tuple]] = {}
        for name, facts in templates.items():
            shapes = _shapes(facts)
            self._results[name] = {(str(g), int(i)): shapes.get(str(t)) for g, i, t in facts.rows["result"]}
            self._params[name] = {(str(g), int(i)): shapes.get(str(t)) for g, i, t in facts.rows["param"]}

    def passed_through(self, template: str, key: Key) -> Summary:
        """A guess at a template's summary under `key` (never adopted: refine/run/template_solves.py):
        each key entry carried to the results at the same positions, where they have the shapes
        of those inputs."""
        params, results = self._params[template], self._results[template]
        return sorted((i, g, j, lay) for i, g, j, lay in key
                      if results.get((SEQ, i)) is not None and results.get((SEQ, i)) == params.get((SEQ, i))
                      and results.get((g, j)) is not None and results.get((g, j)) == params.get((g, j)))

    def seq_dims(self, template: str) -> dict[int, dict[int, int]]:
        """A template's sequential result i -> its sizes by axis."""
        return {i: dict(shape[2]) for (g, i), shape in self._results[template].items() if g == SEQ and shape}

    def __call__(self, site: Site) -> bool:
        results = self._results[site.template]
        return all(self._main.get(t) is not None and self._main.get(t) == results.get((g, i))
                   for g, outs in site.outputs.items() for i, t in outs.items())


def _shapes(facts: FactSet) -> dict[str, tuple]:
    """tensor -> (dtype, rank, sizes by axis)."""
    dims: dict[str, dict[int, int]] = defaultdict(dict)
    for _g, t, axis, size in facts.rows["dim"]:
        dims[str(t)][int(axis)] = int(size)
    dtypes = {str(t): str(ty) for _g, t, ty in facts.rows["dtype"]}
    return {str(t): (dtypes.get(str(t)), int(r), tuple(sorted(dims[str(t)].items()))) for _g, t, r in facts.rows["ndim"]}


def _elision(sites: list[Site], keys: dict[str, Key], edges: _Edges, shapes_agree: Callable[[Site], bool]) -> Elision:
    """The calls to leave out: each one the walk gave a key, whose outputs only calls read (or
    are graph outputs: a layer's backward gives its weights' gradients) and have the shapes of
    its template's results. Graph outputs stay in the solve, given their walk relations."""
    readers = edges.readers
    calls = {n for site in sites for n in site.nodes.values()}

    def only_calls_read(site: Site) -> bool:
        return all(readers[t] <= calls for outs in site.outputs.values() for t in outs.values())

    cut = Elision([site for site in sites if site.cid in keys and only_calls_read(site) and shapes_agree(site)])
    nodes = {n for site in cut.sites for n in site.nodes.values()}
    cut.ids = nodes | {t for site in cut.sites for outs in site.outputs.values() for t in outs.values()
                       if readers[t] <= nodes and t not in edges.graph_outputs}
    return cut


# --- graph outputs of calls left out, checked once per class ---------------------------------------
# A training step's backward calls give their weights' gradients as graph outputs, declared in
# refine.json: 9 per layer and program, so checking each one would grow the whole solve with
# depth. A graph output of a call left out is a tensor no kept node reads, whose relations are
# the walk's (its call's summary under its key, through the shape guard, at the shapes of the
# template's results). Outputs at the same position of calls with the same template and key,
# declared alike (the same layouts at the same rank output positions, the same-named rank
# outputs at the same positions) therefore derive the same atoms up to renaming: one of each
# class is solved, the others are left out and get its atoms renamed.


@dataclass
class OutputCopies:
    """Graph outputs (seq and rank tensors, `ids`) left out of a solve, and for each one the
    renaming that turns its class representative's atoms into its own."""

    ids: set[str] = field(default_factory=set)
    renames: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (rep seq output, rep -> copy)

    def write(self, derived: Derived, tensors: set[str]) -> bool:
        """Add each copy's atoms to `derived`: every shown atom that mentions the
        representative, renamed. False (nothing written) if such an atom mentions a tensor
        outside the representative's call outputs: then the class argument does not hold."""
        if not self.renames:
            return True
        mentioning: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for name, atoms in derived.atoms.items():
            for k, atom in enumerate(atoms):
                for arg in atom:
                    if isinstance(arg, str) and arg in tensors:
                        mentioning[arg].append((name, k))
        written: list[tuple[str, tuple, tuple | None]] = []
        for rep, rename in self.renames:
            quoted = {_clingo_value(a, "str"): _clingo_value(b, "str") for a, b in rename.items()}  # (raw atoms)
            for name, k in dict.fromkeys(mentioning.get(rep, [])):
                atom = derived.atoms[name][k]
                if any(isinstance(a, str) and a in tensors and a not in rename for a in atom):
                    return False
                copied = tuple(rename.get(a, a) if isinstance(a, str) else a for a in atom)
                raw = tuple(quoted.get(a, a) for a in derived.raw[name][k]) if name in derived.raw else None
                written.append((name, copied, raw))
        for name, atom, raw in written:
            derived.atoms[name].append(atom)
            if raw is not None:
                derived.raw[name].append(raw)
        return True


def _output_copies(cut: Elision, keys: dict[str, Key], edges: _Edges, facts: FactSet) -> OutputCopies:
    """The graph outputs of the calls left out that a class representative stands for (above)."""
    declared: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for s, t, text in facts.rows["output_rel"]:
        declared[str(s)].append((str(t), str(text)))
    named: dict[str, int] = defaultdict(int)  # output name -> how many rank graphs have it
    for g, _t, name in facts.rows["graph_output"]:
        named[str(name)] += str(g) != SEQ
    copies = OutputCopies()
    reps: dict[tuple, tuple[Site, int]] = {}
    for site in cut.sites:
        at = {t: (g, j) for g, outs in site.outputs.items() if g != SEQ for j, t in outs.items()}
        for i, s in site.outputs[SEQ].items():
            name = edges.graph_outputs.get(s)
            if name is None:
                continue
            own = frozenset(at[t] for t in at if edges.graph_outputs.get(t) == name)
            if len(own) != named[name] or any(t not in at for t, _ in declared[s]):
                continue  # a same-named rank output or a declared one outside this call
            if not all(edges.readers[t] <= cut.ids for t in [s, *(site.outputs[g][j] for g, j in own)]):
                continue  # a kept node reads it (the next call of a chain, not left out)
            cls = (site.template, keys[site.cid], i, own, frozenset((at[t], text) for t, text in declared[s]))
            if cls not in reps:
                reps[cls] = (site, i)
                continue
            rep, _ = reps[cls]
            rename = {rep.outputs[SEQ][i]: s} | {rep.outputs[g][j]: site.outputs[g][j] for g, j in at.values()}
            copies.renames.append((rep.outputs[SEQ][i], rename))
            copies.ids |= {s} | {site.outputs[g][j] for g, j in own}
    return copies


@dataclass(frozen=True)
class Constants:
    """The main graph's static tensors, for keys: equal constants relate as replicas, and
    constants whose slices along an axis are equal as bc (rules/layers.lp's `given`)."""

    hashes: dict[str, str]
    along: dict[str, dict[int, str]]  # tensor -> axis -> hash of its (equal) slices there
    dims: dict[str, dict[int, int]]
    chunks: dict[str, list[tuple[int, int, int, str]]]  # sequential tensor -> (axis, lo, hi, hash of that chunk)

    @classmethod
    def of(cls, main: FactSet) -> "Constants":
        along: dict[str, dict[int, str]] = defaultdict(dict)
        for _g, t, axis, h in main.rows["const_along"]:
            along[str(t)][int(axis)] = str(h)
        hashes = {str(t): str(h) for _g, t, h in main.rows["const"]}
        dims: dict[str, dict[int, int]] = defaultdict(dict)
        for _g, t, axis, size in main.rows["dim"]:
            if str(t) in hashes:
                dims[str(t)][int(axis)] = int(size)
        chunks: dict[str, list[tuple[int, int, int, str]]] = defaultdict(list)
        for _g, t, axis, lo, hi, h in main.rows["const_chunk"]:
            chunks[str(t)].append((int(axis), int(lo), int(hi), str(h)))
        return cls(hashes, dict(along), dict(dims), dict(chunks))

    def layouts(self, s: str, t: str) -> set[str]:
        """How rank constant t relates to sequential constant s by value alone."""
        out = {"rep"} if s in self.hashes and self.hashes.get(t) == self.hashes[s] else set()
        for axis, h in self.along.get(s, {}).items():
            size, seq_size = self.dims.get(t, {}).get(axis), self.dims.get(s, {}).get(axis)
            if size is not None and size != seq_size and (self.along.get(t, {}).get(axis) == h
                                                          or (size == 1 and self.hashes.get(t) == h)):
                out.add(f"bc({axis},{size})")
        out |= {f"sl({axis},{lo},{hi})" for axis, lo, hi, h in self.chunks.get(s, ()) if self.hashes.get(t) == h}
        return out


def _relations(derived: Derived, params: ParamRels) -> dict[str, dict[str, set[str]]]:
    """seq tensor -> rank tensor -> layouts (as clingo text): derived and set-aside ones."""
    rels: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for (s, t, _lay), (_s, _t, text) in zip(derived.get("rel"), derived.raw.get("rel", [])):
        real, wrapped = chunk_entry(s, text)
        rels[real][str(t)].add(wrapped)
    for s, rank_rels in params.items():
        for t, texts in rank_rels.items():
            rels[s][t] |= texts
    return rels


# --- layer weights: keyed in Python, never solved ------------------------------------------------
# A layer's weights (param_rel: declared on every rank, read by calls only) are most of a deep
# model's main-graph facts, and their relations are declared, not derived. So the main solve
# never sees them: the weight part of a key is checked here, exactly, per call site, and stated
# to the summary rule as a fact params_ok(C, k). The main solve then costs little per layer.

ParamRels = dict[str, dict[str, set[str]]]


def _param_relations(main: FactSet) -> ParamRels:
    """seq weight -> rank weight -> declared layouts (clingo text), from param_rel."""
    rels: ParamRels = defaultdict(lambda: defaultdict(set))
    for s, t, text in main.rows["param_rel"]:
        rels[str(s)][str(t)].add(str(text))
    return rels


def _hidden_params(sites: list[Site], params: ParamRels, slots: dict[str, frozenset[int]]) -> set[str]:
    """The set-aside tensors (seq and rank) that calls read at weight positions only: those the
    main solve need not see. One read at another position (a stack's input, set aside because
    only the first call reads it, where later calls read the previous layer's output) keeps it
    there, since the summary rule checks that position."""
    at_weight: set[str] = set()
    elsewhere: set[str] = set()
    for site in sites:
        for i, s in site.inputs[SEQ].items():
            if s in params:
                (at_weight if i in slots[site.template] else elsewhere).add(s)
    hidden_seq = at_weight - elsewhere
    kept_rank = {t for s in params if s not in hidden_seq for t in params[s]}
    return hidden_seq | {t for s in hidden_seq for t in params[s]} - kept_rank


def _param_slots(sites: list[Site], params: ParamRels) -> dict[str, frozenset[int]]:
    """template -> the sequential input positions that carry a set-aside weight at every one
    of its call sites (the key entries checked in Python, not by the summary rule)."""
    slots: dict[str, frozenset[int]] = {}
    for site in sites:
        here = frozenset(i for i, s in site.inputs[SEQ].items() if s in params)
        slots[site.template] = here if site.template not in slots else slots[site.template] & here
    return slots


def _params_satisfy(site: Site, key: Key, slots: frozenset[int], params: ParamRels) -> bool:
    """Whether the site's weights relate as `key` says at the weight positions `slots`."""
    for i, g, j, lay in key:
        if i in slots:
            t = site.inputs[g].get(j)
            if t is None or lay not in params.get(site.inputs[SEQ][i], {}).get(t, ()):
                return False
    return True


def site_key(site: Site, rels: dict[str, dict[str, set[str]]], consts: Constants) -> Key:
    """How the call's inputs relate, by position: every relation between a sequential input
    and a rank input (constants: by value, Constants.layouts)."""
    entries: set[tuple[int, str, int, str]] = set()
    slots = site.rank_slots
    for i, s in site.inputs[SEQ].items():
        for t, texts in rels.get(s, {}).items():
            for g, j in slots.get(t, ()):
                entries.update((i, g, j, lay) for lay in texts)
        if s in consts.hashes:
            for t, where in slots.items():
                entries.update((i, g, j, lay) for lay in consts.layouts(s, t) for g, j in where)
    return frozenset(entries)


def solve_template(facts: FactSet, key: Key, rule_dirs: list[Path] | None) -> tuple[Summary, Derived]:
    """Solve one template with its formal inputs related as `key` says; its summary is every
    relation between a sequential output and a rank output."""
    params = {(str(g), int(i)): str(t) for g, i, t in facts.rows["param"]}
    declared = [declared_relation(params[(SEQ, i)], params[(g, j)], lay)
                for i, g, j, lay in sorted(key) if (SEQ, i) in params and (g, j) in params]
    derived = solve(facts, rule_dirs, program="\n".join(declared), raw=frozenset({"rel", "aligned_style"}))
    seq_out = {str(t): int(i) for g, i, t in facts.rows["result"] if g == SEQ}
    rank_out = {str(t): (str(g), int(i)) for g, i, t in facts.rows["result"] if g != SEQ}
    summary = sorted({(seq_out[real], *rank_out[str(t)], text)
                      for (s, t, _), (_s, _t, raw) in zip(derived.get("rel"), derived.raw.get("rel", []))
                      for real, text in [chunk_entry(s, raw)] if real in seq_out and str(t) in rank_out})
    return summary, derived


# --- batch chunks (rules/windows.lp) in keys and summaries ---------------------------------------
# A DP x TP rank's layer input is a TP layout of its DP row's batch chunk, a relation of the
# virtual tensor win(S, A, K, N). Keys and summaries state it of the call's real input or output
# as the entry chunk(A, K, N, L); a template solved under such a key has its input chunked (a
# window_seed, the one chunk K) and that chunk related by L.

_CHUNK = re.compile(rf"^chunk\((\d+),(\d+|{layouts.EVERY_CHUNK}),(\d+),(.*)\)$", re.S)


def chunk_entry(s: object, text: str) -> tuple[str, str]:
    """A derived relation rel(S, T, L) as (real seq tensor, layout text): for a chunk
    win(S0, A, K, N), (S0, chunk(A, K, N, L))."""
    chunk = layouts.chunk_of(s)
    if chunk is None or not isinstance(chunk[0], str):  # (a window of a window: kept out of summaries)
        return str(s), text
    real, axis, k, n = chunk
    return real, f"chunk({axis},{k},{n},{text})"


def chunk_parts(text: str) -> tuple[int, layouts.ChunkIndex, int, str] | None:
    """(axis, k, n, inner layout text) of a chunk entry's text, else None."""
    m = _CHUNK.match(text)
    if m is None:
        return None
    k = m.group(2)
    return int(m.group(1)), int(k) if k.isdigit() else k, int(m.group(3)), m.group(4)


# --- one template solve for every batch chunk ------------------------------------------------------
# A stage's k-th micro-batch call (and a DP row's call where the rows are not reduced) has a key
# of batch chunk k: its sequential input's chunk k of N relates to the rank inputs. The layer is
# the same function of chunk k as of any other, so one solve serves every k: the template is
# solved with its chunk named by a constant (layouts.EVERY_CHUNK) instead of a number. No rule
# computes with that constant, so nothing is derived of the chunk's place in the batch (its
# bounds [kD/N, (k+1)D/N): rules/windows.lp's window / unwindow; a term's piece [k, k+1)), and
# every rule instance that fires names the chunk only as a whole: read with k for the constant,
# each is an instance of the same lemma about chunk k, whose premises hold of chunk k (the key's
# relations, renamed; the virtual program, the same for every k). So the summary, the constant
# read as k, holds at every site of chunk k. The solve is used only where it can be read so: no
# sum over the chunked axis (rules/windows.lp's chunk_sums: its terms need k's number) and the
# constant nowhere in a summary entry but as a chunk's index; else the site's own key is solved.


@dataclass(frozen=True)
class ChunkClass:
    """A key of batch chunk `k` stated for every chunk: `base` holds the entries of the batch
    inputs (the sequential inputs whose chunk entries all name one chunk k of N, on every rank)
    with EVERY_CHUNK for k, and the plain entries of the other inputs; it leaves out the batch
    inputs' plain entries (their slice [kD/N, (k+1)D/N), k's own) and the other inputs' chunk
    entries (chunks of a weight that its slices also state: a TP shard can coincide with a
    chunk of as many parts), so that no numbered chunk exists in the solve."""

    base: Key
    k: int

    @classmethod
    def of(cls, key: Key) -> ChunkClass | None:
        chunks: dict[int, set[tuple[int, layouts.ChunkIndex, int]]] = defaultdict(set)
        held: dict[int, set[tuple[str, int]]] = defaultdict(set)  # seq input -> rank inputs related to it
        chunked: dict[int, set[tuple[str, int]]] = defaultdict(set)  # ... by a chunk entry
        for i, g, j, lay in key:
            c = chunk_parts(lay)
            held[i].add((g, j))
            if c is not None:
                chunks[i].add(c[:3])
                chunked[i].add((g, j))
        batch = {i: next(iter(cs)) for i, cs in chunks.items() if len(cs) == 1 and chunked[i] == held[i]}
        if len({(k, n) for _a, k, n in batch.values()}) != 1:
            return None
        ((_a, k, _n),) = {batch[next(iter(batch))]}
        if not isinstance(k, int):
            return None
        base = set()
        for i, g, j, lay in key:
            c = chunk_parts(lay)
            if i in batch and c is not None:
                base.add((i, g, j, _chunk_text(c, layouts.EVERY_CHUNK)))
            elif i not in batch and c is None:
                base.add((i, g, j, lay))
        return cls(frozenset(base), k)

    def renamed(self, summary: Summary, dims: dict[int, dict[int, int]]) -> Summary:
        """The summary for every chunk as chunk k's (`dims`: the sequential results' sizes by
        axis). A rank output equal to chunk k of a result is also its slice [kD/N, (k+1)D/N), as
        rules/windows.lp's unwindow states in a solve of chunk k's own key."""
        out = set()
        for i, g, j, lay in summary:
            c = chunk_parts(lay)
            out.add((i, g, j, _chunk_text(c, self.k) if c is not None else lay))
            if c is not None and c[3] == "rep" and c[0] in dims.get(i, {}):
                axis, _k, n, _inner = c
                size = dims[i][axis] // n
                out.add((i, g, j, f"sl({axis},{self.k * size},{(self.k + 1) * size})"))
        return sorted(out)

    @staticmethod
    def stands_for_every_chunk(summary: Summary, derived: Derived) -> bool:
        """The solve derived no term of a sum over the chunk, and names the chunk in no summary
        entry but as a chunk entry's index."""
        if derived.get("chunk_sums"):
            return False
        for *_, lay in summary:
            c = chunk_parts(lay)
            inner = c[3] if c is not None else lay
            if layouts.EVERY_CHUNK in inner or (c is not None and c[1] != layouts.EVERY_CHUNK):
                return False
        return True


def _chunk_text(chunk: tuple[int, layouts.ChunkIndex, int, str], k: layouts.ChunkIndex) -> str:
    axis, _k, n, inner = chunk
    return f"chunk({axis},{k},{n},{inner})"


def declared_relation(s: str, t: str, text: str, fact: str = "input_rel") -> str:
    """The clingo text stating that rank tensor t relates to seq tensor s by a key or summary
    entry (`fact`: input_rel for a template's inputs, rel_by(..., layer_summary) for a call's
    kept outputs in a main solve). A chunk entry relates t to the chunk: a template's input is
    the chunk its key names alone (window_only); a call output's chunks flow on (window_seed)."""
    chunk = chunk_parts(text)
    qs, qt = _clingo_value(s, "str"), _clingo_value(t, "str")
    if chunk is None:
        return f"{fact}({qs},{qt},{text}{',layer_summary' if fact == 'rel_by' else ''})."
    axis, k, n, inner = chunk
    if fact == "input_rel":
        return f"input_chunk_rel({qs},{axis},{k},{n},{qt},{inner}). window_only({n},{k})."
    return f"window_seed({qs},{axis},{n}). rel_by(win({qs},{axis},{k},{n}),{qt},{inner},layer_summary)."


def summary_rule(kid: str, template: str, key: Key, summary: Summary, param_slots: frozenset[int] = frozenset()) -> str:
    """The clingo text that carries a summary to every call site whose inputs satisfy `key`
    (the rules that use it are in rules/layers.lp). Entries at `param_slots` (weights) are not
    in it: a fact params_ok(C, kid) says site C's weights satisfy them.

    The key is checked rank by rank along a chain, memo_at(C, kid, 0..n) with one step per rank
    graph, by rules/layers.lp's generic rules from facts key_entry / key_step / key_steps: one
    rule whose body held every rank's inputs was re-joined whole each time one of its `given`
    atoms appeared, and one generated rule per rank met every rank's `given` atoms (both
    quadratic in the world size: benchmarks/RESULTS.md)."""
    site = _clingo_value(template, "str")
    start = [f"callsite(C,{site})"] + ([f"params_ok(C,{kid})"] if param_slots else [])
    lines = [f"memo_at(C,{kid},0) :- {', '.join(start)}."]
    by_graph: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for i, g, j, lay in sorted(key):
        if i not in param_slots:
            by_graph[g].append((i, j, lay))
    for step, (g, entries) in enumerate(sorted(by_graph.items())):  # (any order of the ranks will do)
        lines += [f"key_entry({kid},{step},{e},{g},{i},{j},{lay})." for e, (i, j, lay) in enumerate(entries)]
        lines.append(f"key_step({kid},{step},{len(entries)}).")
    lines.append(f"key_steps({kid},{len(by_graph)}).")
    lines += [f"memo_out({kid},{i},{g},{j},{lay})." for i, g, j, lay in summary]
    return "\n".join(lines)


# --- the failing layer, cut out ----------------------------------------------------------------

_TEMPLATE_ID = re.compile(r"^(seq|r\d+):T\d+/(.*)$", re.S)


def instance_facts(program: Program, site: Site, key: Key) -> FactSet:
    """One call site's template facts renamed as the layer itself (`CALL/NAME`, the names the
    simulator gives it), with its inputs' relations declared: a failing layer is reported and
    checked numerically like a model of its own."""
    template = program.templates[site.template]
    rename: dict[str, str] = {}
    for g, i, t in template.rows["param"]:
        if int(i) in site.inputs.get(str(g), {}):
            rename[str(t)] = site.inputs[str(g)][int(i)]
    for g, i, t in template.rows["result"]:
        if int(i) in site.outputs.get(str(g), {}):
            rename[str(t)] = site.outputs[str(g)][int(i)]
    labels = {g: node.split(":", 1)[1] for g, node in site.nodes.items()}

    def name(value: object) -> object:
        if not isinstance(value, str):
            return value
        if value in rename:
            return rename[value]
        m = _TEMPLATE_ID.match(value)
        return f"{m.group(1)}:{labels.get(m.group(1), 'layer')}/{m.group(2)}" if m else value

    facts = FactSet()
    for rel in SCHEMA:
        if rel.name in ("param", "result"):
            continue
        cols = [t == "str" for _, t in rel.columns]
        for row in template.rows[rel.name]:
            facts.rows[rel.name].append(tuple(name(v) if is_str else v for v, is_str in zip(row, cols)))
    for i, g, j, lay in sorted(key):
        chunk = chunk_parts(lay)
        if chunk is None:
            facts.add("input_rel", site.inputs[SEQ][i], site.inputs[g][j], lay)
        else:
            axis, k, n, inner = chunk
            facts.add("input_chunk_rel", site.inputs[SEQ][i], axis, k, n, site.inputs[g][j], inner)
    # the call's results that are the model's outputs stay outputs, with what refine.json
    # requires of them: a wrong one then fails inside the layer, at the node that computes it
    results = {t for outs in site.outputs.values() for t in outs.values()}
    facts.rows["graph_output"] += [row for row in program.main.rows["graph_output"] if row[1] in results]
    facts.rows["mesh_dim"] += program.main.rows["mesh_dim"]  # (groups in mesh coordinates)
    facts.rows["output_rel"] += [row for row in program.main.rows["output_rel"] if row[0] in results and row[1] in results]
    return facts


def failing_instance(program: Program, run: Run, seq_node: str) -> tuple[Site, FactSet] | None:
    """If `seq_node` (a short node name, as reports print it) is a layer call, that call's
    instance facts (see `instance_facts`) under the relations its inputs had in `run`."""
    site = next((s for s in run.sites if s.cid.split(":", 1)[-1] == seq_node), None)
    if site is None:
        return None
    key = site_key(site, _relations(run.derived, _param_relations(program.main)), Constants.of(program.main))
    return site, instance_facts(program, site, key)
