"""Layer templates that are another template on other ranks: solve one, rename its summaries.

A pipeline stage runs the same layer functions as the stage before it, on its own ranks: its
template (the sequential body and its ranks' bodies, refine/lowering/program.py) differs from
the first stage's only in the ranks it names -- its graphs, the members of its groups, its peers
-- and in the template's own name in its value ids. Solving each stage's template costs P solves
of one layer (docs/layout4d.md, section 7, stage 4: two thirds of a 4-D row's time). Here a
template is recognised as an *alias* of an earlier one when renaming its ranks by a translation
of the mesh (every rank's coordinates shifted by one vector, modulo each dim's size) and its name
by the earlier one's turns its facts into exactly the earlier template's facts, row for row
(source locations aside, which no rule reads but to name a virtual node's line). A site of the
alias is then solved as the earlier template under the renamed key, and the summary renamed
back.

Why the renamed summary holds (docs/layers.md, "Stage symmetry"): the facts are all the rules
see of a template, so the two solves see the same facts up to the renaming. The rules treat
graph ids, group ids and rank numbers as names -- joined by equality, never ordered -- except
two lemmas that compute with a rank's number: core.lp's even_share (rank K holds piece [K, K+1)
of W equal pieces: every piece of that decomposition is the same S/W, so any K states a true
piece) and shape.lp's repeat_group (any run C of a repeated group is the rank's, and the lemma
picks one by K). Their conclusions hold whatever number the rank has, so a solve of the earlier
template derives, for each rank, only what holds of its image. A mesh translation keeps what the
facts mean: groups along a dim stay groups along that dim, in their member order, and a row's
counterpart of a rank (rules/rows.lp's mirror members) is moved with it. The summary is used
only where nothing rank-specific leaks out of the solve: no rank id in a key or summary text,
and no invariant violation in the solve (those are reported in the alias's own terms by solving
it). Anything else falls back to solving the alias's own template.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from math import prod

from refine import dist
from refine.config import Mesh
from refine.lowering.facts import SCHEMA, FactSet, Row
from refine.lowering.program import Program

Key = frozenset[tuple[int, str, int, str]]
Summary = list[tuple[int, str, int, str]]

_ANY_RANK_ID = re.compile(r"\br\d+:")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_RANK_COLUMNS = {("graph", "rank"), ("group_member", "rank"), ("mirror_member", "of")}
_GROUP_COLUMNS = {("coll", "group"), ("group_member", "group"), ("group_size", "group"), ("mirror_member", "group")}
_NAME_COLUMNS = {("graph_input", "name"), ("graph_output", "name")}  # a value's bare name (`T<k>/x`)
_RANK_ATTRS = ("root", "peer")  # dist attributes holding one global rank (group: a list of them)
_UNREAD = frozenset({"loc"})  # relations no lemma reads (a node's source line): left out of the comparison
_UNREAD_COLUMNS = {("topo", "index")}  # columns no lemma reads the value of (the rules ask only that a node is one)


class Ids:
    """A template's node and value ids as labels that name neither the template nor its values:
    a value by what computes it -- the node that makes it (its signature: op, version, a
    constant's value hash; and every attribute, a dist op's ranks as `ranks` renames them) and
    the labels of that node's inputs by slot, recursively -- a formal input by its position, a
    constant without a node by its value hash (element type, shape, elements). Two exports of one
    layer name and order their values apart (`Constant_2` here, `Constant_3` there); the labels
    agree where the computations do. A label is the whole computation of its value from the
    formal inputs (a collective's also needs its call number, which `coll` rows compare), so
    equal labels in one graph are equal values, and rows compared as multisets of labels compare
    the programs up to swapping values computed alike. A value without a node, a formal input
    or a constant's value is labelled by its own id: never equal to another template's."""

    def __init__(self, facts: FactSet, ranks: dict[int, int]) -> None:
        sig = {str(n): renamed_signature(str(v), ranks) for _g, n, v in facts.rows["sig"]}
        inputs: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for _g, n, i, t in facts.rows["node_in"]:
            inputs[str(n)].append((int(i), str(t)))
        made: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for _g, n, i, t in facts.rows["node_out"]:
            made[str(n)].append((int(i), str(t)))
        const = {str(t): str(h) for _g, t, h in facts.rows["const"]}
        self.dist_nodes = {str(n) for _g, n, op in facts.rows["node"] if str(op).startswith("dist.")}
        attrs: dict[str, list[tuple]] = defaultdict(list)  # (every attribute: the signature leaves shape ones out)
        for relation in ("attr_int", "attr_ints", "attr_str", "attr_float"):
            for row in facts.rows[relation]:
                attrs[str(row[1])].append((relation, *self.attribute(row, ranks)[2:]))
        self.label: dict[str, str] = {}  # id -> label (the graph apart)
        self.graph_of: dict[str, str] = {}
        for g, i, t in facts.rows["param"]:
            self.label[str(t)], self.graph_of[str(t)] = f"in{i}", str(g)

        def value(t: str) -> str:
            if t not in self.label:
                self.label[t] = f"c:{const[t]}" if t in const else f"?:{t}"  # (no value to compare: never equal)
            return self.label[t]

        for g, n, _k in sorted(facts.rows["topo"], key=lambda row: (str(row[0]), int(row[2]))):
            n = str(n)
            text = repr((sig.get(n), sorted(attrs[n], key=repr), sorted((i, value(t)) for i, t in inputs[n])))
            self.label[n], self.graph_of[n] = hashlib.blake2b(text.encode(), digest_size=10).hexdigest(), str(g)
            for i, t in made[n]:
                self.label[t], self.graph_of[t] = f"{self.label[n]}.{i}", str(g)
        results = {str(t) for _g, _i, t in facts.rows["result"]}
        for rel in SCHEMA:  # (values no node reads or makes: folded constants, views the lowering left behind)
            for (col, kind), column in zip(rel.columns, zip(*facts.rows[rel.name]) if facts.rows[rel.name] else ()):
                if col == "t" and kind == "str":
                    for t in map(str, column):
                        if t not in self.label and t not in const and t not in results:
                            # (inert: nothing reads, makes or returns it, so no relation can name it)
                            self.label[t] = f"unused:{t.split('/', 1)[-1]}"
                        value(t)
        for ident in list(self.label):
            self.graph_of.setdefault(ident, ident.split(":", 1)[0])
        named: dict[tuple[str, str], list[str]] = defaultdict(list)
        for ident, lab in self.label.items():
            named[(self.graph_of[ident], lab)].append(ident)
        self.named = {form: ids[0] for form, ids in named.items() if len(ids) == 1}  # (ambiguous: none)

    def attribute(self, row: Row, ranks: dict[int, int]) -> Row:
        """An attribute row (g, node, name, ..., value) with a dist op's rank value renamed."""
        if str(row[1]) in self.dist_nodes and row[2] in (*_RANK_ATTRS, "group"):
            return (*row[:-1], ranks[int(row[-1])])
        return row

    def form(self, ident: str) -> tuple[str, str] | None:
        lab = self.label.get(ident)
        return (self.graph_of[ident], lab) if lab is not None else None

    def bare(self, name: str, graph: str) -> str | None:
        """The label of a graph input's or output's bare name (its id without the graph)."""
        return self.label.get(f"{graph}:{name}")


@dataclass(frozen=True)
class Renaming:
    """A template's ranks moved by a mesh translation (`ranks`), its ids read in `source`'s
    forms and written back in `target`'s."""

    ranks: dict[int, int]  # every rank of the world -> its image
    source: Ids
    target: Ids

    @cached_property
    def inverse(self) -> Renaming:
        return Renaming({v: k for k, v in self.ranks.items()}, self.target, self.source)

    def graph(self, g: str) -> str:
        return g if g == "seq" else f"r{self.ranks[int(g[1:])]}"

    def form(self, ident: str) -> tuple[str, str] | None:
        """An id of the source as a (graph, label) of the target's graphs."""
        found = self.source.form(ident)
        return (self.graph(found[0]), found[1]) if found else None

    def ident(self, ident: str) -> str | None:
        """An id of the source as the target names it, None if the target has none such."""
        found = self.form(ident)
        return self.target.named.get(found) if found else None

    def text(self, text: str) -> str | None:
        """A layout text whose quoted ids are the source's, with the target's; None where a
        quoted rank id is not a template's (no renaming states it) or the target lacks one."""
        missing = False

        def one(m: re.Match[str]) -> str:
            nonlocal missing
            inner = m.group(1)
            if inner in self.source.label:
                renamed = self.ident(inner)
                if renamed is None:
                    missing = True
                    return m.group(0)
                return '"' + renamed + '"'
            if _ANY_RANK_ID.match(inner):
                missing = True
            return m.group(0)
        out = _QUOTED.sub(one, text)
        return None if missing else out

    def group(self, gid: str) -> str:
        channel = dist.channel_of(gid)
        if channel is not None:
            sender, receiver, tag = channel
            return f"p2p:{self.ranks[sender]}>{self.ranks[receiver]}#{tag}"
        return dist.group_id([self.ranks[r] for r in dist.group_of_id(gid)])

    def rows(self, facts: FactSet) -> dict[str, list[Row]]:
        """The rows the rules read (of the facts `source` labels), in the comparison's form:
        graphs and ranks renamed, ids as (graph, label), sorted per relation."""
        out: dict[str, list[Row]] = {}
        for rel in SCHEMA:
            if rel.name in _UNREAD:
                continue
            rows = []
            for row in facts.rows[rel.name]:
                values: list[object] = []
                for (col, kind), v in zip(rel.columns, row):
                    if (rel.name, col) in _UNREAD_COLUMNS:
                        v = None
                    elif kind == "sym":
                        v = self.graph(str(v))
                    elif (rel.name, col) in _RANK_COLUMNS:
                        v = self.ranks[int(v)] if int(v) >= 0 else v
                    elif (rel.name, col) in _GROUP_COLUMNS:
                        v = self.group(str(v))
                    elif (rel.name, col) in _NAME_COLUMNS:
                        v = self.source.bare(str(v), str(row[0])) or v
                    elif rel.name == "sig" and col == "signature":
                        v = renamed_signature(str(v), self.ranks)
                    elif kind == "str":
                        v = self.form(str(v)) or v
                    values.append(v)
                if rel.name in ("attr_int", "attr_ints"):
                    values[-1] = self.source.attribute(row, self.ranks)[-1]
                rows.append(tuple(values))
            out[rel.name] = sorted(rows, key=repr)
        return out

    def entries(self, entries: Iterable[tuple[int, str, int, str]]) -> list[tuple[int, str, int, str]] | None:
        """Key or summary entries (position, rank graph, position, layout text) of the source's
        sites as the target's state them; None where a text is not renamable."""
        out = []
        for i, g, j, lay in entries:
            text = self.text(lay)
            if text is None:
                return None
            out.append((i, self.graph(g), j, text))
        return sorted(out)

    def key(self, key: Key) -> Key | None:
        renamed = self.entries(key)
        return frozenset(renamed) if renamed is not None else None

    def styles(self, styles: Iterable[str]) -> list[str] | None:
        out = [self.text(s) for s in styles]
        return None if any(s is None for s in out) else [s for s in out if s is not None]


def renamed_signature(sig: str, ranks: dict[int, int]) -> str:
    """A node's signature (`op@version/...|attr=value;...`) with the ranks in a dist op's
    attributes (group, root, peer) renamed."""
    if not sig.startswith("dist.") or "|" not in sig:
        return sig
    head, attrs = sig.split("|", 1)
    out = []
    for item in attrs.split(";"):
        name, eq, value = item.partition("=")
        if name == "group":  # (written as a group id: `0,1` or `16..19`)
            value = dist.group_id([ranks[r] for r in dist.group_of_id(value)])
        elif name in _RANK_ATTRS:
            value = str(ranks[int(value)])
        out.append(f"{name}{eq}{value}")
    return head + "|" + ";".join(out)


def mesh_translation(mesh: Mesh, src: list[int], dst: list[int]) -> dict[int, int] | None:
    """The translation of `mesh` (every coordinate shifted by one vector, modulo each dim's size)
    that takes the least rank of `src` to the least of `dst`, as a map of every rank, if it takes
    the set `src` onto the set `dst`; else None."""
    first, image = mesh.coordinates(min(src)), mesh.coordinates(min(dst))
    ranks = {}
    for r in range(prod(mesh.shape)):
        at = mesh.coordinates(r)
        ranks[r] = mesh.rank_at({d: (at[d] + image[d] - first[d]) % n for d, n in zip(mesh.dims, mesh.shape)})
    return ranks if sorted(ranks[r] for r in src) == sorted(dst) else None


class StageAliases:
    """For each template, the earlier template it is on other ranks (and the renaming), if any."""

    def __init__(self, program: Program, enabled: bool = True) -> None:
        self.templates = program.templates
        self.enabled = enabled
        self.world = int(program.main.rows["world_size"][0][0]) if program.main.rows["world_size"] else 0
        dims = sorted((int(index), str(dim), int(size)) for dim, index, size in program.main.rows["mesh_dim"])
        self.mesh = (Mesh(shape=[size for *_, size in dims], dims=[dim for _, dim, _ in dims]) if dims
                     else Mesh(shape=[max(self.world, 1)], dims=["world"]))  # (no mesh: the world as one dim)
        self._found: dict[str, tuple[str, Renaming] | None] = {}
        self._ids: dict[str, Ids] = {}
        self._own_rows: dict[str, dict[str, list[Row]]] = {}

    def of(self, template: str) -> tuple[str, Renaming] | None:
        """(the earlier template, the renaming of `template`'s ranks and ids into it), or None."""
        if template not in self._found:
            self._found[template] = self._search(template) if self.enabled else None
        return self._found[template]

    def _search(self, template: str) -> tuple[str, Renaming] | None:
        facts = self.templates[template]
        counts = _counts(facts)
        ranks = _ranks(facts)
        for earlier in self.templates:
            if earlier == template:
                break
            other = self.templates[earlier]
            if self.of(earlier) is not None or counts != _counts(other):
                continue  # (an alias's own target is earlier still: compare with targets only)
            moved = mesh_translation(self.mesh, ranks, _ranks(other)) if ranks and self.world else None
            if moved is None:
                continue
            renaming = Renaming(moved, Ids(facts, moved), self.ids(earlier))
            if renaming.rows(facts) == self._rows(earlier):
                return earlier, renaming
        return None

    def target_pairs(self, pairs: list[tuple[str, Key]]) -> list[tuple[str, Key]]:
        """(template, key) pairs as they are solved: an alias's as its target's, renamed."""
        out = []
        for template, key in pairs:
            alias = self.of(template)
            renamed = alias[1].key(key) if alias is not None else None
            out.append((alias[0], renamed) if alias is not None and renamed is not None else (template, key))
        return out

    def ids(self, template: str) -> Ids:
        """A template's labels, its ranks as they are."""
        if template not in self._ids:
            self._ids[template] = Ids(self.templates[template], {r: r for r in range(self.world)})
        return self._ids[template]

    def _rows(self, template: str) -> dict[str, list[Row]]:
        """A template's own rows in the comparison's form (ranks as they are)."""
        if template not in self._own_rows:
            ids = self.ids(template)
            self._own_rows[template] = Renaming({r: r for r in range(self.world)}, ids, ids).rows(self.templates[template])
        return self._own_rows[template]


def _counts(facts: FactSet) -> dict[str, int]:
    return {name: len(rows) for name, rows in facts.rows.items() if name not in _UNREAD}


def _ranks(facts: FactSet) -> list[int]:
    return sorted(int(rank) for g, kind, rank in facts.rows["graph"] if kind == "rank")
