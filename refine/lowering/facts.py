"""The facts schema: every relation the lowering writes, its columns, and their types.

This module is the one place where the intermediate representation is defined. A facts
directory holds one tab-separated `<relation>.facts` file per relation (Souffle style:
readable, diffable, greppable). `docs/facts.md` documents the same schema for rule authors;
`tests/test_facts.py` keeps the two in step.

Column types:
  sym  -- a clingo constant written bare (graph ids: `seq`, `r0`, `r1`, ...)
  str  -- a string, quoted in clingo (tensor ids, node ids, op names, keys)
  int  -- an integer
  term -- a clingo term written verbatim (layouts such as `sl(1,0,4)`)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from refine.errors import InputError

ColumnType = str  # "sym" | "str" | "int" | "term"


@dataclass(frozen=True)
class Relation:
    """One relation of the schema: its name, column names and column types."""

    name: str
    columns: tuple[tuple[str, ColumnType], ...]
    doc: str

    @property
    def arity(self) -> int:
        return len(self.columns)


def _rel(name: str, cols: str, doc: str) -> Relation:
    columns = tuple(tuple(c.split(":")) for c in cols.split())
    return Relation(name, columns, doc)  # type: ignore[arg-type]


SCHEMA: tuple[Relation, ...] = (
    _rel("graph", "g:sym kind:str rank:int", "a graph: `seq` (kind seq, rank -1) or `rK` (kind rank, rank K)"),
    _rel("world_size", "n:int", "number of rank programs"),
    _rel("node", "g:sym n:str op:str", "node n of graph g computes op (domain-qualified for non-ONNX domains: dist.AllReduce)"),
    _rel("node_in", "g:sym n:str i:int t:str", "input i of node n is tensor t (absent optional inputs are skipped)"),
    _rel("node_out", "g:sym n:str i:int t:str", "output i of node n is tensor t"),
    _rel("arity", "g:sym n:str inputs:int", "number of input slots of node n (including empty optional ones)"),
    _rel("topo", "g:sym n:str index:int", "position of node n in the graph's topological order"),
    _rel("since", "g:sym n:str version:int", "since_version of the op's schema at the model's opset (its semantics version; 0 if unknown)"),
    _rel("sig", "g:sym n:str signature:str", "op, semantics version and attributes that must agree for a seq node and a rank node to be paired"),
    _rel("dim", "g:sym t:str axis:int size:int", "static size of tensor t along axis"),
    _rel("ndim", "g:sym t:str rank:int", "number of axes of tensor t (only for tensors with a known static shape)"),
    _rel("dtype", "g:sym t:str type:str", "element type of tensor t (float, float16, int64, bool, ...)"),
    _rel("attr_int", "g:sym n:str key:str value:int", "integer attribute; axis-valued attributes are normalized to non-negative axes"),
    _rel("attr_ints", "g:sym n:str key:str index:int value:int", "integer-list attribute, one row per element (axes normalized)"),
    _rel("attr_str", "g:sym n:str key:str value:str", "string attribute"),
    _rel("attr_float", "g:sym n:str key:str value:str", "float attribute, as its repr"),
    _rel("const", "g:sym t:str hash:str", "tensor t is a small constant (initializer or Constant output); equal hash = equal value"),
    _rel("const_along", "g:sym t:str axis:int hash:str", "constant t is constant along axis (all its slices there are equal; size > 1); hash of one slice: equal hash = equal slices"),
    _rel("const_chunk", "g:sym t:str axis:int lo:int hi:int hash:str", "sequential float constant t cut into equal chunks along axis (2 .. world size of them): chunk [lo,hi) has hash (equal hash = equal value: a rank's constant that is its chunk)"),
    _rel("fill_zero", "g:sym t:str", "constant t is zero everywhere (a fill of 0, 0.0 or false, any element type)"),
    _rel("fill_num", "g:sym t:str value:int", "constant t (more than one element, integer or boolean, or float of an integer value) holds one value everywhere (a range-decided mask: all true is 1)"),
    _rel("const_int", "g:sym t:str index:int value:int", "elements of a small integer constant, flattened"),
    _rel("const_num", "g:sym t:str num:int den:int", "a scalar (single-element) constant equal to the exact rational num/den"),
    _rel("int_edges", "g:sym t:str n:int", "constant t is a 1-D float vector of n edges, edge k in (k - 1, k]: exactly k non-negative integers lie below edge k (a histogram of integers, one bin each)"),
    _rel("slice_spec", "g:sym n:str out:int axis:int start:int end:int", "output `out` of a Slice/Split node is input 0 restricted to [start,end) along axis (step 1; normalized)"),
    _rel("slice_step", "g:sym n:str out:int axis:int start:int end:int step:int", "output `out` of a Slice node is input 0 at start, start+step, ... below end along axis (step > 1; normalized; no other axis cut)"),
    _rel("reduce_axis", "g:sym n:str axis:int", "a Reduce* node reduces over axis (normalized; all axes when none are given)"),
    _rel("keepdims", "g:sym n:str keep:int", "keepdims of a Reduce* node (default 1)"),
    _rel("graph_input", "g:sym t:str name:str", "t is a graph input or a declared initializer"),
    _rel("graph_output", "g:sym t:str name:str", "t is a graph output"),
    _rel("loc", "g:sym n:str module:str file:str line:int", "source location of node n, from its ONNX metadata (module path, file, line)"),
    _rel("coll", "g:sym n:str kind:str group:str seq:int", "collective or point-to-point node n: kind, group id (the members, `0,1,2`; for Send/Recv the channel `p2p:A>B#TAG`, member 0 the sender A, member 1 the receiver B), and its call number within that group in this graph (a memoized layer call's calls are numbered in its body, its template; refine/diagnose/schedule.py numbers every call a rank makes, in order)"),
    _rel("body_coll", "g:sym function:str index:int name:str kind:str group:str module:str file:str line:int",
         "in a memoized lowering: the index-th collective or point-to-point call (program order, nested calls inlined) that the body of layer function `function` (the call nodes' op) makes when rank graph g calls it: its node name in the body, kind, group id (as coll's) and source location. Read by refine/diagnose/schedule.py (every call a rank makes, in order), not given to the rules"),
    _rel("group_member", "group:str index:int rank:int", "the group's member at group position index is global rank"),
    _rel("group_size", "group:str size:int", "number of members of a group"),
    _rel("mesh_dim", "dim:str index:int size:int", "refine.json's mesh: dim `dim` is axis `index` of the mesh shape, `size` ranks long (rank r sits at the row-major coordinates of r)"),
    _rel("input_rel", "s:str t:str layout:term", "declared relation from refine.json: rank tensor t relates to seq tensor s by layout"),
    _rel("output_rel", "s:str t:str layout:term", "required by refine.json: rank output t must relate to seq output s by layout"),
    _rel("window_seed", "s:str axis:int parts:int", "seq input s is split into `parts` even chunks along axis: declared in refine.json over one dim of a mesh of several dims (rules/windows.lp: the batch slice of a DP x TP rank), or a replicated data input that a rank cuts into such chunks (a pipeline stage's micro-batches)"),
    _rel("input_chunk_rel", "s:str axis:int k:int n:int t:str layout:term", "a layer key's (refine/run/memo.py), or a row-symmetric plan's declared (refine/lowering/rows.py), relation of a batch chunk (rules/windows.lp): rank tensor t relates by layout to chunk k of n along axis of seq tensor s"),
    _rel("output_chunk_rel", "s:str axis:int k:int n:int t:str layout:term", "required by refine.json of a row-symmetric plan (refine/lowering/rows.py): rank output t must relate by layout to chunk k of n along axis of seq output s"),
    _rel("row_symmetry", "dim:str rows:int", "the mesh's rows along dim run the same programs (refine/lowering/rows.py): only row 0 is lowered, and its ranks meet the batch only through its chunk (rules/windows.lp, docs/rows.md)"),
    _rel("mirror_member", "group:str index:int of:int row:int", "in a row-symmetric plan, member `index` of a column group (rows.py) is a rank that is not lowered: row `row`'s counterpart of member `of`, a row-0 rank (rules/rows.lp states its part of the call by symmetry)"),
    _rel("value_range", "s:str lo:int hi:int", "declared in refine.json (integer inputs): every value of seq tensor s lies in [lo, hi)"),
    _rel("callsite", "c:str template:str", "layer call site c (its seq call node; `<node>@k` for the k-th call of it on a pipeline stage, micro-batch k) is an occurrence of template (docs/layers.md)"),
    _rel("call_node", "c:str g:sym n:str", "at call site c, graph g's call is node n"),
    _rel("param_rel", "s:str t:str layout:term", "a declared relation (checked by lowering) of a tensor that only layer calls read: kept out of the lemmas, read by layer keys"),
    _rel("param", "g:sym i:int t:str", "in a template's facts: formal input i of graph g's body is tensor t"),
    _rel("result", "g:sym i:int t:str", "in a template's facts: formal output i of graph g's body is tensor t"),
)

SCHEMA_BY_NAME: dict[str, Relation] = {r.name: r for r in SCHEMA}
NOT_FOR_RULES = frozenset({"body_coll"})  # read in Python only: kept out of every solve

Row = tuple[object, ...]


@dataclass
class FactSet:
    """Facts in memory: relation name -> list of rows (tuples in schema column order)."""

    rows: dict[str, list[Row]] = field(default_factory=lambda: {r.name: [] for r in SCHEMA})

    def add(self, relation: str, *values: object) -> None:
        self.rows[relation].append(values)

    def extend(self, other: "FactSet") -> None:
        for name, rows in other.rows.items():
            self.rows[name].extend(rows)

    def count(self) -> int:
        return sum(len(r) for r in self.rows.values())


# --- text form (.facts files) -------------------------------------------------------------

_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n"})


def _escape_field(value: str) -> str:
    return value.translate(_ESCAPES)


def _unescape_field(value: str) -> str:
    out, i = [], 0
    while i < len(value):
        ch = value[i]
        if ch == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append({"t": "\t", "n": "\n", "\\": "\\"}.get(nxt, nxt))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def write_facts_dir(facts: FactSet, out_dir: Path) -> None:
    """Write one `<relation>.facts` file per relation into an existing directory."""
    for rel in SCHEMA:
        lines = ("\t".join(_escape_field(str(v)) for v in row) for row in facts.rows[rel.name])
        (out_dir / f"{rel.name}.facts").write_text("".join(line + "\n" for line in lines))


def read_facts_dir(facts_dir: Path) -> FactSet:
    """Read a facts directory written by `write_facts_dir` (or by hand) back into memory."""
    if not facts_dir.is_dir():
        raise InputError(facts_dir, "not a directory of .facts files")
    facts = FactSet()
    for rel in SCHEMA:
        path = facts_dir / f"{rel.name}.facts"
        if not path.is_file():
            raise InputError(path, "missing (run `refine lower` to produce a complete facts directory)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(path, "not UTF-8 text (a .facts file is tab-separated text)") from None
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line:
                continue
            fields = [_unescape_field(f) for f in line.split("\t")]
            if len(fields) != rel.arity:
                raise InputError(path, f"line {lineno}: {len(fields)} columns, expected {rel.arity}")
            try:
                row = tuple(int(v) if t == "int" else v for v, (_, t) in zip(fields, rel.columns))
            except ValueError:
                raise InputError(path, f"line {lineno}: a column that must be an integer is not") from None
            facts.rows[rel.name].append(row)
    return facts


# --- clingo form -------------------------------------------------------------------------


def _clingo_value(value: object, col_type: ColumnType) -> str:
    if col_type == "int":
        return str(int(value))  # type: ignore[call-overload]
    if col_type in ("sym", "term"):
        return str(value)
    return quoted(value)


def quoted(value: object) -> str:
    text = value if isinstance(value, str) else str(value)
    if "\\" in text or '"' in text or "\n" in text:
        text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def _row_renderer(rel: Relation) -> Callable[[Row], str]:
    """A function rendering one row of `rel` as a clingo fact (the hot loop of every solve:
    one format string per relation, strings escaped only when they need it)."""
    fmt = rel.name + "(" + ",".join("{}" for _ in rel.columns) + ")."
    convert = [int if t == "int" else quoted if t == "str" else str for _, t in rel.columns]
    return lambda row: fmt.format(*[f(v) for f, v in zip(convert, row)])


_RENDERERS: dict[str, Callable[[Row], str]] = {rel.name: _row_renderer(rel) for rel in SCHEMA}


def to_clingo_lines(facts: FactSet) -> Iterator[str]:
    """Render facts as clingo program text, one fact per line (parsed in one Control.add)."""
    for rel in SCHEMA:
        if rel.name not in NOT_FOR_RULES:
            yield from map(_RENDERERS[rel.name], facts.rows[rel.name])


def schema_markdown(relations: Iterable[Relation] = SCHEMA) -> str:
    """The schema as a markdown table (docs/facts.md embeds this)."""
    lines = ["| relation | columns | meaning |", "|---|---|---|"]
    for rel in relations:
        cols = ", ".join(f"{n}:{t}" for n, t in rel.columns)
        lines.append(f"| `{rel.name}` | {cols} | {rel.doc} |")
    return "\n".join(lines)
