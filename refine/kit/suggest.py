"""`refine rules suggest DIR`: a candidate lemma for an UNPROVEN verdict, read off the numbers.

At the first sequential node the lemmas could not get past, the rank nodes computing its op whose
inputs relate (as the lemmas derived) are run on the multi-rank simulator with several seeds, and
the rank output is compared with the sequential output under the layouts refine knows: a layout of
one of the inputs (the same term, or moved to another axis), a replica, and each of those scaled by
a constant. A form that holds on every rank and every seed becomes a lemma in the library's own
vocabulary:

    rel_by(So, To, OUT, suggested_<op>) :- pair(N, M, G), op(N, "<Op>"), <the node's attributes>,
        inrel(N, M, 0, L0), ..., pout(N, M, 0, So, To).

with the input layouts as terms (constants where every rank has the same, variables where they
differ) and the output written from them. It is written to a directory beside a witness model
directory (the node alone, its inputs declared as the ranks hold them, when refine.json can say
so), checked with `refine rules check` (refine/kit/rulecheck.py: random shapes and layouts), and the
model verified with it. It is never applied silently: the user reads the identity and adopts it
with `refine verify DIR --rules SUGGESTED`, which checks every relation it derives on the numbers.

Numbers that differ under every form propose nothing: that is what a bug looks like.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from refine import layouts
from refine.config import CONFIG_NAME, SEQ_NAME, rank_file_name
from refine.diagnose.diagnosis import build_report
from refine.diagnose.index import FactIndex
from refine.diagnose.simulate import SimResult, SimulationError
from refine.diagnose.witness import view
from refine.kit import rulecheck
from refine.kit.cases import simulate_loaded
from refine.lowering.load import load_model_dir, rank_graph_id
from refine.lowering.normal_forms import lowered_form
from refine.lowering.shapes import infer_shapes
from refine.lowering.program import lower_program
from refine.report.schema import Suggestion
from refine.run.engine import Derived, solve

SEEDS = (0, 1, 2)
MAX_COMBINATIONS = 64  # input layout combinations tried per rank node
MAX_DENOMINATOR = 64  # a scale is a fraction p/q with q up to this
MAX_ROUNDS = 4  # lemmas proposed for one model (one per node where the relations stop)
POSITIONAL = ("sl", "blk")
_ATOM = re.compile(r"[a-z][A-Za-z0-9_]*")


# --- layouts as patterns over the ranks ----------------------------------------------------------


@dataclass(frozen=True)
class _Pinned:
    """An integer constant input (axes, a shape, an index) with no relation: the lemma is for
    these values only, on both sides."""

    seq: tuple[int, ...]
    rank: tuple[int, ...]

    def premises(self, slot: int) -> list[str]:
        out = [f"sin(N, {slot}, S{slot})", f"node_in(G, M, {slot}, T{slot})"]
        for var, graph, values in ((f"S{slot}", "seq", self.seq), (f"T{slot}", "G", self.rank)):
            out.append(f"const({graph}, {var}, _)")
            out += [f"const_int({graph}, {var}, {k}, {v})" for k, v in enumerate(values)]
            out.append(f"not const_int({graph}, {var}, {len(values)}, _)")
        return out


def _signature(layout: object) -> object:
    """The shape of a layout term with its numbers left out: layouts of one signature on every rank
    become one pattern (sl(0, X, Y) for sl(0, 0, 4) on rank 0 and sl(0, 4, 8) on rank 1)."""
    if isinstance(layout, tuple):
        return (layout[0], len(layout), *(a if isinstance(a, str) else _signature(a) if isinstance(a, tuple) else None
                                          for a in layout[1:]))
    return layout


def _term(value: object) -> str:
    """A Python layout value as clingo text."""
    if isinstance(value, tuple):
        return f"{value[0]}({', '.join(_term(a) for a in value[1:])})"
    if isinstance(value, str):
        return value if _ATOM.fullmatch(value) else json.dumps(value)
    return str(value)


def _has_style(layout: object) -> bool:
    return isinstance(layout, tuple) and (layout[0] in ("psum", "pmax") or any(_has_style(a) for a in layout[1:]))


def _pattern(per_rank: list[object], name: str) -> str:
    """One term matching the layout of every rank: constants where they agree, variables where not."""
    first = per_rank[0]
    if isinstance(first, _Pinned):
        return ""
    if all(layout == first for layout in per_rank) and not _has_style(first):
        return _term(first)
    if not isinstance(first, tuple):
        raise ValueError("layouts of different kinds")
    args = []
    for k in range(1, len(first)):
        if first[0] in ("psum", "pmax") and k in (3, 4):  # (how many pieces, and what names them: any)
            args.append(f"{name}_{'pieces' if k == 3 else 'style'}")
            continue
        column = [layout[k] for layout in per_rank]  # type: ignore[index]
        if isinstance(first[k], tuple):
            args.append(_pattern(column, f"{name}_{k}"))
        elif all(v == column[0] for v in column):
            args.append(_term(column[0]))
        else:
            args.append(f"{name}_{k}")
    return f"{first[0]}({', '.join(args)})"


@dataclass(frozen=True)
class _Form:
    """How the output's layout is made from the inputs' (the same on every rank)."""

    words: str
    text: str  # the output term, in the body's variables

    def layout(self, inputs: list[object]) -> object:  # overridden by the builders below
        raise NotImplementedError


@dataclass(frozen=True)
class _Copied(_Form):
    slot: int = 0

    def layout(self, inputs: list[object]) -> object:
        return inputs[self.slot]


@dataclass(frozen=True)
class _Moved(_Form):
    slot: int = 0
    axis: int = 0

    def layout(self, inputs: list[object]) -> object:
        kind, _axis, *rest = inputs[self.slot]  # type: ignore[misc]
        return (kind, self.axis, *rest)


@dataclass(frozen=True)
class _Fixed(_Form):
    value: object = "rep"

    def layout(self, inputs: list[object]) -> object:
        return self.value


@dataclass(frozen=True)
class _Scaled(_Form):
    inner: _Form | None = None
    scale: Fraction = Fraction(1)

    def layout(self, inputs: list[object]) -> object:
        return ("scaled", self.scale.numerator, self.scale.denominator, self.inner.layout(inputs))  # type: ignore[union-attr]


def _forms(patterns: list[str], layouts_r0: list[object], out_ndim: int) -> list[_Form]:
    """The output forms to try, most specific first: an input's layout as it is, moved to another
    axis, a replica. (Scaled forms are made from these once a scale is measured.)"""
    forms: list[_Form] = []
    for i, (pattern, layout) in enumerate(zip(patterns, layouts_r0)):
        if layout == "rep" or isinstance(layout, _Pinned):
            continue
        forms.append(_Copied(f"input {i}'s layout", pattern, slot=i))
        if isinstance(layout, tuple) and layout[0] in POSITIONAL:
            inner = pattern[pattern.index(",") + 1:]
            for axis in range(out_ndim):
                if axis != layout[1]:
                    forms.append(_Moved(f"input {i}'s layout on axis {axis}", f"{layout[0]}({axis},{inner}",
                                        slot=i, axis=axis))
    forms.append(_Fixed("a replica", "rep", value="rep"))
    return forms


# --- the numbers ---------------------------------------------------------------------------------


def _holds(layout: object, s: np.ndarray, t: np.ndarray) -> bool:
    """T on one rank is `layout` of S (per-tensor layouts; partial sums are checked over the ranks)."""
    expected = view(layout, s)
    return expected is not None and expected.shape == t.shape and bool(np.allclose(t, expected, rtol=1e-4, atol=1e-5))


def _psum_holds(per_rank: list[object], s: np.ndarray, ts: list[np.ndarray]) -> bool:
    """The ranks' tensors (scaled back where the layouts say) are pieces summing to S, each rank one piece."""
    total = np.zeros_like(s)
    pieces = []
    for layout, t in zip(per_rank, ts):
        factor = Fraction(1)
        while layouts.kind(layout) == "scaled":
            factor *= Fraction(layout[1], layout[2])  # type: ignore[index]
            layout = layout[3]  # type: ignore[index]
        if layouts.kind(layout) != "psum" or t.shape != s.shape or factor == 0:
            return False
        pieces.append((layout[1], layout[2], layout[3]))  # type: ignore[index]
        total = total + t / float(factor)
    _a, _b, d = pieces[0]
    covered = sorted((a, b) for a, b, _d in pieces)
    chain = all(covered[k][1] == covered[k + 1][0] for k in range(len(covered) - 1))
    return chain and covered[0][0] == 0 and covered[-1][1] == d and bool(np.allclose(total, s, rtol=1e-4, atol=1e-5))


def _form_holds(layouts_per_rank: list[object], s: np.ndarray, ts: list[np.ndarray]) -> bool:
    base = layouts_per_rank[0]
    while layouts.kind(base) == "scaled":
        base = base[3]  # type: ignore[index]
    if layouts.kind(base) == "psum":
        return _psum_holds(layouts_per_rank, s, ts)
    return all(_holds(layout, s, t) for layout, t in zip(layouts_per_rank, ts))


def _scale(form: _Form, inputs: list[list[object]], s: np.ndarray, ts: list[np.ndarray]) -> Fraction | None:
    """The constant c with T = c * form(S) on rank 0, as a small fraction, if T is a multiple of it."""
    layout = form.layout(inputs[0])
    base = layout
    while layouts.kind(base) == "scaled":
        base = base[3]  # type: ignore[index]
    if layouts.kind(base) == "psum":
        expected, t = s, sum(ts)
    else:
        expected, t = view(layout, s), ts[0]
    if expected is None or expected.shape != t.shape or not np.any(np.abs(expected) > 1e-6):
        return None
    k = int(np.argmax(np.abs(expected)))
    ratio = Fraction(float(t.reshape(-1)[k] / expected.reshape(-1)[k])).limit_denominator(MAX_DENOMINATOR)
    return ratio if ratio not in (0, 1) else None


# --- the search ----------------------------------------------------------------------------------


@dataclass
class _Found:
    node: str
    rank_node: str
    op: str
    patterns: list[str]
    form: _Form
    per_rank_inputs: list[list[object]]


def _relations(derived: Derived) -> dict[tuple[str, str], list[object]]:
    out: dict[tuple[str, str], list[object]] = {}
    for s, t, layout in derived.get("rel"):
        if isinstance(s, str) and isinstance(t, str):
            out.setdefault((s, t), []).append(layout)
    return out


def _slot_layouts(ix: FactIndex, rels: dict, ints: dict[str, tuple[int, ...]], sims: list[SimResult], n: str,
                  m_by_rank: list[str]) -> list[list[list[object]]] | None:
    """For each input slot of n: the layouts each rank's input has to it (one list per rank),
    a constant equal on both sides counting as a replica, integer constants of other values
    pinned; None if a slot relates to nothing."""
    slots = []
    for i, s in sorted(ix.in_slot[n].items()):
        per_rank = []
        for m in m_by_rank:
            t = ix.in_slot[m].get(i)
            if t is None:
                return None
            found = list(rels.get((s, t), []))
            if not found and _same_numbers(sims, s, t):
                found = ["rep"]
            if not found and s in ints and t in ints:
                found = [_Pinned(ints[s], ints[t])]
            if not found:
                return None
            per_rank.append(found)
        slots.append(per_rank)
    return slots


def _value(sim: SimResult, tensor: str) -> np.ndarray | None:
    graph, name = tensor.split(":", 1)
    values = sim.seq if graph == "seq" else sim.ranks[int(graph[1:])]
    v = values.get(name)
    return None if v is None else np.asarray(v, dtype=np.float64)


def _same_numbers(sims: list[SimResult], s: str, t: str) -> bool:
    for sim in sims:
        a, b = _value(sim, s), _value(sim, t)
        if a is None or b is None or a.shape != b.shape or not np.array_equal(a, b):
            return False
    return True


def _combinations(slots: list[list[list[object]]]) -> list[list[list[object]]]:
    """Input layout choices: per slot one signature every rank has (its layout of that signature
    on each rank); the product over slots, bounded."""
    per_slot = []
    for per_rank in slots:
        common = None
        for found in per_rank:
            sigs = {_signature(layout) for layout in found}
            common = sigs if common is None else common & sigs
        choices = []
        for sig in sorted(common or (), key=repr):
            choices.append([next(layout for layout in found if _signature(layout) == sig) for found in per_rank])
        if not choices:
            return []
        per_slot.append(choices)
    combos = []
    for combo in itertools.islice(itertools.product(*per_slot), MAX_COMBINATIONS):
        # combo[slot][rank] -> by rank: [slot layouts]
        combos.append([[combo[i][r] for i in range(len(combo))] for r in range(len(combo[0]))])
    return combos


def _search(ix: FactIndex, rels: dict, ints: dict[str, tuple[int, ...]], sims: list[SimResult], n: str) -> _Found | None:
    op = ix.op[n]
    out = ix.out_slot[n].get(0)
    if out is None:
        return None
    ranks = sorted(ix.rank_of_graph.items(), key=lambda kv: kv[1])
    first_graph = ranks[0][0]
    candidates = [m for m, g in ix.node_graph.items() if g == first_graph and ix.op.get(m) == op]
    for m0 in candidates:
        short = m0.split(":", 1)[1]
        m_by_rank = [f"{g}:{short}" for g, _r in ranks]
        if any(m not in ix.op for m in m_by_rank):
            continue
        slots = _slot_layouts(ix, rels, ints, sims, n, m_by_rank)
        if slots is None:
            continue
        for inputs in _combinations(slots):
            try:
                patterns = [_pattern([inputs[r][i] for r in range(len(inputs))], f"L{i}") for i in range(len(inputs[0]))]
            except ValueError:
                continue
            found = _first_form(ix, sims, n, out, m_by_rank, inputs, patterns)
            if found is not None:
                return _Found(n, m0, op, patterns, found, inputs)
    return None


def _first_form(ix: FactIndex, sims: list[SimResult], n: str, out: str, m_by_rank: list[str],
                inputs: list[list[object]], patterns: list[str]) -> _Form | None:
    outs = [ix.out_slot[m].get(0) for m in m_by_rank]
    if any(t is None for t in outs):
        return None
    values = []
    for sim in sims:
        s = _value(sim, out)
        ts = [_value(sim, t) for t in outs]  # type: ignore[arg-type]
        if s is None or any(t is None for t in ts):
            return None
        values.append((s, ts))
    for form in _forms(patterns, inputs[0], values[0][0].ndim):
        tries: list[_Form] = [form]
        scale = _scale(form, inputs, *values[0])
        if scale is not None:
            inner = form.text
            tries.append(_Scaled(f"{scale} x {form.words}", f"scaled({scale.numerator}, {scale.denominator}, {inner})",
                                 inner=form, scale=scale))
        for candidate in tries:
            try:
                if all(_form_holds([candidate.layout(inputs[r]) for r in range(len(inputs))], s, ts) for s, ts in values):
                    return candidate
            except (ValueError, TypeError, IndexError):
                continue
    return None


# --- writing it ----------------------------------------------------------------------------------


def lemma_name(op: str) -> str:
    return "suggested_" + re.sub(r"[^a-z0-9]+", "_", op.lower()).strip("_")


def _attribute_premises(facts_rows: dict, n: str, m_by_rank: list[str]) -> list[str]:
    """The node's attributes, pinned on both sides (a lemma for one Gather axis is not one for all)."""
    premises = []
    for side, nodes, var in (("seq", [n], "seq"), ("rank", m_by_rank, "G")):
        for relation in ("attr_int", "attr_str", "attr_float"):
            values: dict[str, set] = {}
            for _g, node, key, value in facts_rows[relation]:
                if node in nodes:
                    values.setdefault(key, set()).add(value)
            for key, seen in sorted(values.items()):
                if len(seen) == 1:
                    premises.append(f"{relation}({var}, {'N' if side == 'seq' else 'M'}, {json.dumps(key)}, "
                                    f"{_term(next(iter(seen))) if relation == 'attr_int' else json.dumps(str(next(iter(seen))))})")
        values2: dict[tuple[str, int], set] = {}
        for _g, node, key, index, value in facts_rows["attr_ints"]:
            if node in nodes:
                values2.setdefault((key, index), set()).add(value)
        for (key, index), seen in sorted(values2.items()):
            if len(seen) == 1:
                premises.append(f"attr_ints({var}, {'N' if side == 'seq' else 'M'}, {json.dumps(key)}, {index}, {next(iter(seen))})")
    return premises


def lemma_text(found: _Found, name: str, premises: list[str], where: str, seeds: int, world: int) -> str:
    layouts_words = ", ".join(f"input {i} " + (f"the constant {list(lay.seq)} (rank: {list(lay.rank)})"
                                                 if isinstance(lay, _Pinned) else layouts.text(lay))
                              for i, lay in enumerate(found.per_rank_inputs[0]))
    slots = [lay.premises(i) if isinstance(lay, _Pinned) else [f"inrel(N, M, {i}, {found.patterns[i]})"]
             for i, lay in enumerate(found.per_rank_inputs[0])]
    body = ["pair(N, M, G)", f"op(N, {json.dumps(found.op)})", *premises, *(p for slot in slots for p in slot),
            "pout(N, M, 0, So, To)"]
    return (f"% Suggested by `refine rules suggest` at {where}: seen on {seeds} seeds x {world} ranks, not proved.\n"
            f"% {found.op} on every rank, its inputs as the ranks hold them (on rank 0: {layouts_words}),\n"
            f"% gives {found.form.words} of the sequential output:\n"
            f"%   {found.op}(L_0(S_0), ..., L_k(S_k)) = OUT({found.op}(S_0, ..., S_k)),   OUT = {found.form.text}.\n"
            f"% Read it as an identity before you adopt it: it must hold for every value and shape these\n"
            f"% premises allow, not only for this model's.\n"
            f"rel_by(So, To, {found.form.text}, {name}) :-\n    " + ",\n    ".join(body) + ".\n")


def _declared(per_rank: list[object], world: int) -> dict | None:
    """The refine.json declaration of an input the ranks hold in these layouts, if it has one."""
    if all(layout == "rep" for layout in per_rank):
        return {"layout": "rep"}
    kinds = {layouts.kind(layout) for layout in per_rank}
    if kinds == {"sl"} and len({layout[1] for layout in per_rank}) == 1:  # type: ignore[index]
        spans = [(layout[2], layout[3]) for layout in per_rank]  # type: ignore[index]
        if spans[0][0] == 0 and all(spans[k][1] == spans[k + 1][0] for k in range(world - 1)):
            return {"layout": "shard", "axis": per_rank[0][1], "sizes": [b - a for a, b in spans]}  # type: ignore[index]
    if kinds == {"psum"}:  # pieces that tile [0, D) in rank order: each rank holds one summand
        spans = [(layout[1], layout[2]) for layout in per_rank]  # type: ignore[index]
        if spans[0][0] == 0 and spans[-1][1] == per_rank[0][3] and all(spans[k][1] == spans[k + 1][0] for k in range(world - 1)):  # type: ignore[index]
            return {"layout": "partial"}
    return None


def _unscaled(per_rank: list[object]) -> tuple[list[object], Fraction]:
    """The layouts with one common constant factor taken off (scaled(p, q, L) on every rank)."""
    scales = set()
    inner = []
    for layout in per_rank:
        factor = Fraction(1)
        while layouts.kind(layout) == "scaled":
            factor *= Fraction(layout[1], layout[2])  # type: ignore[index]
            layout = layout[3]  # type: ignore[index]
        scales.add(factor)
        inner.append(layout)
    return (inner, scales.pop()) if len(scales) == 1 else (per_rank, Fraction(1))


def write_witness(found: _Found, ix: FactIndex, protos: dict[str, onnx.NodeProto], sims: list[SimResult],
                  dest: Path) -> str | None:
    """The failing node alone as a model directory, for `rules check` to run the lemma on: its inputs
    declared as the ranks hold them (an input the ranks hold scaled by c declared unscaled, and
    multiplied by c on the ranks before the node); None, or why not, when refine.json cannot
    declare an input."""
    world = len(found.per_rank_inputs)
    n, m0 = found.node, found.rank_node
    short = m0.split(":", 1)[1]
    graphs = ["seq"] + [g for g, _r in sorted(ix.rank_of_graph.items(), key=lambda kv: kv[1])]
    sim = sims[0]
    declared: dict[str, dict] = {}
    scales: dict[int, Fraction] = {}
    for i, t in sorted(ix.in_slot[n].items()):
        if t in ix.consts:
            continue
        inner, scales[i] = _unscaled([found.per_rank_inputs[r][i] for r in range(world)])
        layout = _declared(inner, world)
        if layout is None:
            return f"input {i} ({t.split(':', 1)[1]}) is held in a layout refine.json cannot declare"
        value = np.asarray(sim.seq[t.split(":", 1)[1]])
        if value.dtype.kind in "iu":
            low = min(int(np.min(_value(s, t))) for s in sims)
            high = max(int(np.max(_value(s, t))) for s in sims)
            layout["range"] = [low, high + 1]
        declared[f"in{i}"] = layout
    models: dict[str, onnx.ModelProto] = {}
    for g in graphs:
        node_id = n if g == "seq" else f"{g}:{short}"
        values = sim.seq if g == "seq" else sim.ranks[ix.rank_of_graph[g]]
        inputs, inits, names, nodes = [], [], [], []
        for i, t in sorted(ix.in_slot[node_id].items()):
            value = np.asarray(values[t.split(":", 1)[1]])
            name = f"in{i}"
            if t in ix.consts:
                inits.append(numpy_helper.from_array(value, name))
                names.append(name)
                continue
            if g != "seq" and scales.get(i, 1) != 1:  # (value / c: the declared layout's own values)
                inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
                inits.append(numpy_helper.from_array(np.asarray(float(scales[i]), dtype=value.dtype), f"{name}_scale"))
                nodes.append(helper.make_node("Mul", [name, f"{name}_scale"], [f"{name}_scaled"], name=f"{name}_scaled"))
                names.append(f"{name}_scaled")
                continue
            inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
            names.append(name)
        original = protos[node_id]
        node = helper.make_node(original.op_type, names, ["out"], domain=original.domain, name="node")
        node.attribute.extend(original.attribute)
        out_value = np.asarray(values[ix.out_slot[node_id][0].split(":", 1)[1]])
        output = helper.make_tensor_value_info("out", helper.np_dtype_to_tensor_dtype(out_value.dtype), list(out_value.shape))
        graph = helper.make_graph([*nodes, node], g, inputs, [output], initializer=inits)
        models[g] = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    dest.mkdir(parents=True, exist_ok=True)
    onnx.save(models["seq"], str(dest / SEQ_NAME))
    for g in graphs[1:]:
        onnx.save(models[g], str(dest / rank_file_name(ix.rank_of_graph[g])))
    (dest / CONFIG_NAME).write_text(json.dumps({"world_size": world, "inputs": declared}, indent=1) + "\n")
    return None


# --- the command ---------------------------------------------------------------------------------


def suggest(model_dir: Path, out_dir: Path, rule_dirs: list[Path] | None = None, seeds: tuple[int, ...] = SEEDS,
            check_seeds: tuple[int, ...] = (0, 1), rounds: int = MAX_ROUNDS) -> Suggestion:
    """Propose lemmas for an unproven `model_dir` until it verifies (at most `rounds`, one per
    node where the relations stop), or say why none (InputError on bad input)."""
    from refine.pipeline import verify_dir  # (the pipeline imports the kit: late, no circle at import time)

    first = verify_dir(model_dir, rule_dirs)
    if first.verdict == "verified":
        return Suggestion(status="not_unproven", summary="verified already: there is nothing to suggest")
    if first.verdict == "refuted":
        return Suggestion(status="nothing", node=first.failure.node if first.failure else None, summary=(
            "refuted: on the numbers the ranks' outputs do not rebuild the sequential ones, so no lemma can prove "
            "it (a bug, not a missing lemma: see `refine verify`'s counterexample)"))
    try:
        sims = [simulate_loaded(load_model_dir(model_dir), seed) for seed in seeds]
    except SimulationError as exc:
        return Suggestion(status="nothing", summary=f"the programs do not run together ({exc}): no lemma can help")
    protos = _node_protos(model_dir)
    written: list[_Written] = []
    verdict, failure_words = first.verdict, ""
    for _round in range(rounds):
        step = _next_lemma(model_dir, [*(rule_dirs or []), *([out_dir] if written else [])], sims, protos, out_dir,
                           {w.name for w in written})
        if isinstance(step, str):
            failure_words = step
            break
        if any(w.node == step.node for w in written):  # (it fired, and the relations still stop there)
            step.path.unlink()
            failure_words = (f"the relation at {step.node} does not lead on: the step after it is a rank-only op "
                             f"(a collective) whose lemma `rules suggest` does not write (docs/first-lemma.md)")
            break
        written.append(step)
        verdict = verify_dir(model_dir, [*(rule_dirs or []), out_dir], simulate=False).verdict
        if verdict == "verified":
            break
    if not written:
        return Suggestion(status="nothing", node=first.failure.node if first.failure else None,
                          op=first.failure.op if first.failure else None, summary=failure_words)
    check = rulecheck.check_rules(out_dir, check_seeds, out_dir / "violations")
    unexercised = [w.name for w in written if w.name in check.not_exercised]
    status = "proposed" if check.status != "violated" and verdict == "verified" and not unexercised else "refused"
    summary = "; ".join(w.words for w in written)
    if check.status == "violated":
        summary += f"; but `refine rules check` found instances where it does not hold ({check.summary}): do not adopt it"
    elif unexercised:
        summary += (f"; no instance and no witness made {', '.join(unexercised)} fire, so nothing checked it: "
                    f"write an example model directory into {out_dir} and run `refine rules check {out_dir}`")
    elif verdict != "verified":
        summary += f"; with {'it' if len(written) == 1 else 'them'} the model is still {verdict}" + \
                   (f" ({failure_words})" if failure_words else "")
    notes = [f"{w.name}: {w.witness_note}" for w in written if w.witness_note]
    return Suggestion(status=status, summary=summary, node=written[0].node, op=written[0].op,
                      lemma="\n".join(w.text for w in written), lemma_files=[str(w.path) for w in written],
                      witness=[str(w.witness) for w in written if w.witness_note is None],
                      witness_note="; ".join(notes) or None, check=check, verdict_with_it=verdict,
                      command=f"refine verify {model_dir} --rules {out_dir}")


@dataclass
class _Written:
    name: str
    node: str
    op: str
    text: str
    path: Path
    witness: Path
    witness_note: str | None
    words: str


def _next_lemma(model_dir: Path, rule_dirs: list[Path], sims: list[SimResult], protos: dict[str, onnx.NodeProto],
                out_dir: Path, taken: set[str]) -> _Written | str:
    """One lemma for the first node where the relations stop (with the lemmas so far), written
    with its witness; or why none, in words."""
    program = lower_program(model_dir, memo=False, rows=False)
    facts = program.main
    derived = solve(facts, rule_dirs or None)
    report = build_report(model_dir.name, facts, derived, rule_dirs=rule_dirs or None, closest_lemma=False)
    failure = report.failure
    if failure is None or failure.node == "(collectives)":
        return ("the failure is not at a node's relation (" + (failure.reason if failure else "no failing node") +
                "): no lemma can help")
    ix = FactIndex(facts)
    rels = _relations(derived)
    ints = _int_constants(facts.rows)
    found = None
    for node in _frontier(ix, rels, f"seq:{failure.node}"):
        found = _search(ix, rels, ints, sims, node)
        if found is not None:
            break
    if found is None:
        where = _where(ix, f"seq:{failure.node}")
        return (f"no rank node computing {failure.op} gives the output of {where} in any layout refine knows "
                f"(an input's, a replica, or either scaled by a constant) on {len(sims)} seeds")
    where = _where(ix, found.node)
    name = lemma_name(found.op)
    name = next(f"{name}_{k}" if k else name for k in itertools.count() if (f"{name}_{k}" if k else name) not in taken)
    m_by_rank = [f"{g}:{found.rank_node.split(':', 1)[1]}" for g, _r in sorted(ix.rank_of_graph.items(), key=lambda kv: kv[1])]
    text = lemma_text(found, name, _attribute_premises(facts.rows, found.node, m_by_rank), where, len(sims), len(m_by_rank))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.lp"
    path.write_text(text)
    witness = out_dir / f"witness_{name}"
    note = write_witness(found, ix, protos, sims, witness)
    words = f"{found.op} at {where}: the ranks' output is {found.form.words} of the sequential output ({path})"
    return _Written(name, found.node.split(":", 1)[1], found.op, text, path, witness, note, words)


def _where(ix: FactIndex, node: str) -> str:
    location = ix.loc.get(node)
    return node.split(":", 1)[1] + (f" ({location.file}:{location.line})" if location and location.file else "")


def _int_constants(facts_rows: dict) -> dict[str, tuple[int, ...]]:
    """The small integer constants the lowering states element by element (const_int), empty ones
    included (an empty axes list: reduce every axis)."""
    values: dict[str, dict[int, int]] = {t: {} for _g, t, _digest in facts_rows["const"]}
    stated = set()
    for _g, t, i, v in facts_rows["const_int"]:
        values[t][int(i)] = int(v)
        stated.add(t)
    empty = {t for _g, t, r in facts_rows["ndim"] if r == 1} & {t for _g, t, a, d in facts_rows["dim"] if a == 0 and d == 0}
    return {t: tuple(v[k] for k in sorted(v)) for t, v in values.items() if t in stated or t in empty}


def _frontier(ix: FactIndex, rels: dict, failing: str, limit: int = 32) -> list[str]:
    """The failing node, then the sequential nodes where relations stop, in program order: every
    input relates to some rank tensor (constants aside) and the output to none. The reported node
    is the first whose output nothing rebuilds; the missing lemma may be one step before it."""
    related = {s for s, _t in rels}
    frontier = []
    for node in sorted((m for m, g in ix.node_graph.items() if g == "seq"), key=lambda m: ix.topo.get(m, 0)):
        out = ix.out_slot[node].get(0)
        inputs = list(ix.in_slot[node].values())
        if out is None or out in related or node == failing:
            continue
        if inputs and all(t in related or t in ix.consts for t in inputs) and any(t in related for t in inputs):
            frontier.append(node)
    return [failing, *frontier[:limit]]


def _node_protos(model_dir: Path) -> dict[str, onnx.NodeProto]:
    """The ONNX nodes of the programs as the lowering reads them (inlined, in normal form), by
    node id: the witness copies the node's attributes."""
    loaded = load_model_dir(model_dir)
    n = len(loaded.ranks)
    out: dict[str, onnx.NodeProto] = {}
    graphs = {"seq": loaded.seq, **{rank_graph_id(r): m for r, m in enumerate(loaded.ranks)}}
    for g, model in graphs.items():
        for node in lowered_form(infer_shapes(model, loaded.paths[g], n), set(loaded.config.inputs)).graph.node:
            out[f"{g}:{node.name}"] = node
    return out
