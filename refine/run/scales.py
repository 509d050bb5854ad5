"""Virtual unscaled copies of rank ops that are linear in a scaled operand (rules/scales.lp).

A rank tensor T that is a constant multiple of a layout of a sequential tensor,
rel(S, T, scaled(P, Q, L)), meets only the few lemmas written for scaled layouts: a DDP rank's
gradients carry its local 1/(n/K) where the sequential step divides by n, and the factor runs
through the whole backward pass (MatMul, views, Where, sums) before an avg all-reduce cancels
it. Writing a scaled twin of every lemma would double the library; instead, an op that is
homogeneous of degree one in its operands,

    f(.., c X, ..) = c f(.., X, ..)          (f linear in X; or in all of a joint slot set),

is given to the lemmas a second time as a virtual node: the same op, attributes and signature,
reading the virtual tensor unsc(T, P, Q) = (Q/P) T in place of T, and writing unsc(To, P, Q) =
(Q/P) To. That is a real computation on real values, so every lemma is as sound for it as for
a real node; what the lemmas derive for unsc(To, P, Q) comes back to To as scaled(P, Q, ..)
(rules/scales.lp, `scaled_linear`). The copy runs along the linear cone of T (the consumers of
T, and theirs, as long as they stay linear), so one more solve carries the factor to where a
lemma that reads scaled layouts (an avg all-reduce, a rank scale, unit_scale) consumes it.

The copies are facts, given to the grounder before it runs (refine/run/engine.py: a second
solve when the first left a scaled tensor stuck at a linear op): node facts derived from
relations inside the rules would put node/4, dim/4 and the rest into the recursion and break
the library's stratification. A copy is made only where it may help: a scaled rank tensor read
by a linear op whose output no relation reaches.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import product
from math import gcd
from dataclasses import dataclass, field

from refine import layouts
from refine.lowering.facts import FactSet, quoted

FLOAT_TYPES = frozenset({"float", "float16", "float64", "bfloat16"})
# f(x) linear in input 0 alone (the data; other inputs are indices, shapes, axes).
LINEAR_IN_DATA = frozenset({
    "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand", "Tile", "Slice", "Split",
    "Gather", "GatherElements", "GatherND", "ReduceSum", "ReduceMean", "Neg", "Cast", "CastLike", "CumSum", "Div",
})
# f(x, y) linear in each operand with the other fixed: one copy per scaled operand.
MULTILINEAR = frozenset({"MatMul", "Mul", "Einsum"})
# f(x, w) bilinear when it has no bias (a convolution: conv(c X, W) = c conv(X, W); with a bias,
# affine only): as MULTILINEAR, only without input 2.
BILINEAR_WITHOUT_BIAS = frozenset({"Conv", "ConvTranspose"})
# f linear in a set of slots jointly (every slot of the set scaled alike, or a zero constant).
JOINT_SLOTS: dict[str, tuple[int, ...] | None] = {
    "Add": None, "Sub": None, "Sum": None, "Mean": None, "Concat": None,  # None: every input
    "Where": (1, 2), "ScatterND": (0, 2), "ScatterElements": (0, 2),
}
# Node facts a copy repeats under its own id (everything a lemma may read about a rank node;
# not topo, loc, coll: a copy has no place in the program order and is no collective).
NODE_FACTS = ("arity", "since", "sig", "attr_int", "attr_ints", "attr_str", "attr_float",
              "slice_spec", "slice_step", "reduce_axis", "keepdims")
TENSOR_FACTS = ("ndim", "dim", "dtype")
MAX_COPIES_PER_NODE = 4  # scales per rank node (a bound on the copies, not on soundness)

Scale = tuple[int, int]


@dataclass
class _Index:
    """The rank graphs' facts by node and by tensor, built once per solve that needs copies."""

    op: dict[str, str] = field(default_factory=dict)
    graph_of: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    outputs: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    readers: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: defaultdict(list))
    dtype: dict[str, str] = field(default_factory=dict)
    zero: set[str] = field(default_factory=set)
    node_rows: dict[str, list[tuple[str, tuple]]] = field(default_factory=lambda: defaultdict(list))
    tensor_rows: dict[str, list[tuple[str, tuple]]] = field(default_factory=lambda: defaultdict(list))
    call_reads: set[str] = field(default_factory=set)


def _index(facts: FactSet) -> _Index:
    ix = _Index()
    rank_graphs = {g for g, kind, _ in facts.rows["graph"] if kind == "rank"}
    for g, n, op in facts.rows["node"]:
        if g in rank_graphs:
            ix.op[n], ix.graph_of[n] = op, g
    for g, n, i, t in facts.rows["node_in"]:
        if n in ix.op:
            ix.inputs[n][i] = t
            ix.readers[t].append((n, i))
    for g, n, i, t in facts.rows["node_out"]:
        if n in ix.op:
            ix.outputs[n][i] = t
    for g, t, ty in facts.rows["dtype"]:
        if g in rank_graphs:
            ix.dtype[t] = ty
    ix.zero = {t for g, t in facts.rows["fill_zero"] if g in rank_graphs}
    ix.zero |= {t for g, t, num, _den in facts.rows["const_num"] if g in rank_graphs and num == 0}
    for name in NODE_FACTS:
        for row in facts.rows[name]:
            if row[1] in ix.op:
                ix.node_rows[row[1]].append((name, row))
    for name in TENSOR_FACTS:
        for row in facts.rows[name]:
            if row[0] in rank_graphs:
                ix.tensor_rows[row[1]].append((name, row))
    ix.call_reads = {n for _c, _g, n in facts.rows["call_node"]}
    return ix


def _floats(ix: _Index, node: str, slots: tuple[int, ...]) -> bool:
    """Every output, and every unscaled input, of a float type: integer ops round (x / 2 * 2 != x)."""
    outs, ins = ix.outputs.get(node, {}), ix.inputs.get(node, {})
    return bool(outs) and all(ix.dtype.get(t) in FLOAT_TYPES for t in [*outs.values(), *(ins[i] for i in slots)])


Slots = tuple[tuple[int, Scale], ...]  # a copy's unscaled slots, each with its factor


def _product(a: Scale, b: Scale) -> Scale | None:
    """a * b as a reduced fraction (None past 32 bits: clingo's integers)."""
    p, q = a[0] * b[0], a[1] * b[1]
    d = gcd(p, q) or 1
    p, q = p // d, q // d
    return (p, q) if max(abs(p), abs(q)) < 2**31 else None


def _copies(ix: _Index, node: str, scales: dict[str, set[Scale]]) -> list[tuple[Slots, Scale]]:
    """The copies of `node` that the known factors of its inputs (`scales`, by tensor) allow, each
    with the factor of its outputs: slot 0 of an op linear in its data; any non-empty set of
    operands of a multilinear op (the factors multiply); every operand of a joint op at one
    factor (zero constants stand for any)."""
    op, ins = ix.op[node], ix.inputs.get(node, {})
    if node in ix.call_reads:
        return []
    found: list[tuple[Slots, Scale]] = []
    if op in LINEAR_IN_DATA:
        found = [(((0, sc),), sc) for sc in scales.get(ins.get(0, ""), ())]
    elif op in MULTILINEAR or (op in BILINEAR_WITHOUT_BIAS and not ins.get(2)):
        options = [[None, *sorted(scales.get(t, ()))] for _i, t in sorted(ins.items())]
        for combo in product(*options):
            slots = tuple((i, sc) for (i, _t), sc in zip(sorted(ins.items()), combo) if sc is not None)
            out: Scale | None = (1, 1)
            for _i, sc in slots:
                out = _product(out, sc) if out else None
            if slots and out:
                found.append((slots, out))
    elif op in JOINT_SLOTS and _adds(ix, node):
        joint = JOINT_SLOTS[op] or tuple(sorted(ins))
        if all(i in ins for i in joint):
            common = set.intersection(*[scales.get(ins[i], set()) for i in joint if ins[i] not in ix.zero] or [set()])
            found = [(tuple((i, sc) for i in joint if ins[i] not in ix.zero), sc) for sc in sorted(common)]
    return [(slots, out) for slots, out in found if _floats(ix, node, tuple(i for i, _ in slots))]


def _adds(ix: _Index, node: str) -> bool:
    """A scatter that writes or adds its updates (a multiplying or max scatter is not linear)."""
    reduction = [row[3] for name, row in ix.node_rows.get(node, []) if name == "attr_str" and row[2] == "reduction"]
    return all(r in ("none", "add") for r in reduction)


def _known_scales(relations: list[tuple[object, ...]], ix: _Index) -> dict[str, set[Scale]]:
    """The factors of the rank tensors' scaled relations (other than 0 and 1), by tensor."""
    scales: dict[str, set[Scale]] = defaultdict(set)
    for _s, t, lay in relations:
        if layouts.kind(lay) == "scaled" and isinstance(t, str) and t in ix.readers:
            p, q = int(lay[1]), int(lay[2])  # type: ignore[index]
            if p != 0 and p != q:
                scales[t].add((p, q))
    return scales


def _ghost(t: str, scale: Scale) -> str:
    return f"unsc({quoted(t)},{scale[0]},{scale[1]})"


def _copy_id(node: str, slots: Slots) -> str:
    return f"un({quoted(node)},\"{','.join(f'{i}:{p}/{q}' for i, (p, q) in slots)}\")"


def _fact(name: str, row: tuple, replace: dict[int, str]) -> str:
    """A fact row as clingo text, columns in `replace` written verbatim (virtual ids)."""
    parts = []
    for i, v in enumerate(row):
        if i in replace:
            parts.append(replace[i])
        elif isinstance(v, int):
            parts.append(str(v))
        elif i == 0:  # the graph id: a bare symbol
            parts.append(str(v))
        else:
            parts.append(quoted(v))
    return f"{name}({','.join(parts)})."


def unscaled_copies(facts: FactSet, relations: list[tuple[object, ...]], made: set[tuple[str, Slots]],
                    budget: int | None = None) -> list[str]:
    """Clingo facts for the virtual copies along the linear cone of every stuck scaled tensor
    (a scaled tensor read by an op whose copy is possible and whose outputs no relation reaches),
    none already in `made`, which this extends; `relations`: the rel/3 atoms of the last solve.
    Empty when no scaled tensor is stuck."""
    if not any(layouts.kind(lay) == "scaled" for _s, _t, lay in relations):
        return []
    ix = _index(facts)
    scales = _known_scales(relations, ix)
    related = {str(t) for _s, t, _l in relations}
    budget = len(ix.op) if budget is None else budget
    per_node: dict[str, int] = defaultdict(int)
    for node, _slots in made:
        per_node[node] += 1
    work = [t for t in scales
            if any(_copies(ix, node, scales) and not any(o in related for o in ix.outputs[node].values())
                   for node, _slot in ix.readers[t])]
    lines: list[str] = []
    ghosts: set[tuple[str, Scale]] = set()  # (a fact repeated from an earlier round is harmless)
    while work:
        t = work.pop()
        for node, _slot in ix.readers.get(t, []):
            for slots, out in _copies(ix, node, scales):
                key = (node, slots)
                if key in made or per_node[node] >= MAX_COPIES_PER_NODE or len(made) >= budget:
                    continue
                made.add(key)
                per_node[node] += 1
                lines.extend(_copy_facts(ix, node, slots, out, ghosts))
                if out[0] == out[1]:
                    continue  # (a copy whose factors cancel writes its real outputs' values)
                for o in ix.outputs[node].values():
                    if out not in scales[o]:
                        scales[o].add(out)
                        work.append(o)
    return lines


def _copy_facts(ix: _Index, node: str, slots: Slots, out: Scale, ghosts: set[tuple[str, Scale]]) -> list[str]:
    """The facts of one copy: its node rows under its id, its inputs (slots unscaled), its
    outputs (unscaled by `out`), and each virtual tensor's shape, type and link to its real tensor."""
    g, cid = ix.graph_of[node], _copy_id(node, slots)
    lines = [f"node({g},{cid},{quoted(ix.op[node])})."]
    for name, row in ix.node_rows.get(node, []):
        lines.append(_fact(name, row, {1: cid}))
    unscaled = dict(slots)
    virtual: list[tuple[str, Scale]] = []
    for i, t in sorted(ix.inputs[node].items()):
        lines.append(f"node_in({g},{cid},{i},{_ghost(t, unscaled[i]) if i in unscaled else quoted(t)}).")
        if i in unscaled:
            virtual.append((t, unscaled[i]))
    for i, t in sorted(ix.outputs[node].items()):
        lines.append(f"node_out({g},{cid},{i},{_ghost(t, out)}).")
        virtual.append((t, out))
    for t, scale in virtual:
        if (t, scale) in ghosts:
            continue
        ghosts.add((t, scale))
        gid = _ghost(t, scale)
        lines.append(f"unscaled({g},{gid},{quoted(t)},{scale[0]},{scale[1]}).")
        for name, row in ix.tensor_rows.get(t, []):
            lines.append(_fact(name, row, {1: gid}))
    return lines
