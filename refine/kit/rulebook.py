"""The rule authors' kit: what the lemma library holds (`refine rules list`), which ops of a model
no rule file handles (`refine rules coverage`, `refine batch --coverage`), and the typo check
of a user's rule files (a body predicate that nothing defines).

Rules are read with clingo's own parser, which locates every rule; a lemma is a rule whose head
is `rel_by(S, T, L, name)`, and the identity it encodes is the `%` comment block right above it.
What a rule file *states* (`handles/2`, op lists such as `reduce_op/1`, often written with
pools) is read by grounding the files without facts (refine.run.engine.ground_rules), so that a
pool or a rule that defines them counts as what clingo makes of it.

The ops of a lemma are the op names its body gives `op(N, Op)` or `node(G, M, Op)`: a string,
or a variable that the body equates with strings (`Op = ("Softmax"; "LogSoftmax")`) or draws
from a stated op list (`reduce_op(Op)`). A lemma that names none inherits those of the helper
predicates its body uses that its own file defines (`softmax_axis` -> `softmax_op`), and failing
that its file's `handles/2` ops.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import clingo
import onnx
from clingo import ast
from pydantic import BaseModel, Field

from refine.run.engine import ground_rules, rule_files
from refine.errors import InputError

LEMMA_HEAD = ("rel_by", 4)
# Handled before any lemma: lowering evaluates a Constant, and equal small constants relate as
# replicas (core.lp inrel); it rewrites a Gemm into MatMul, Mul and Add (refine/lowering/canonical.py).
LOWERED_OPS = frozenset({"Constant", "Gemm"})
OP_ARGUMENT = {("op", 2): 1, ("node", 3): 2}  # predicate -> the argument that names the op
Signature = tuple[str, int]


class Lemma(BaseModel):
    """One lemma rule: its name, the identity it encodes, where it is, and the ops it handles."""

    name: str
    identity: str = Field(description="the comment lines above the rule, on one line ('' if none)")
    file: str
    line: int
    ops: list[str] = Field(description="the ONNX op types it handles (domain-qualified: dist.AllReduce)")
    ops_from: Literal["body", "helpers", "file", "none"] = Field(
        description="where the ops were read: the rule's body, helper predicates of its file, its file's handles/2")
    user: bool = Field(description="from a --rules directory, not the bundled library")

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


class Inventory(BaseModel):
    """Every lemma of the bundled library and the user's rule files, in file order."""

    files: list[str]
    lemmas: list[Lemma]
    handled_ops: list[str] = Field(description="every op some rule file handles (handles/2 and lemma bodies)")

    def for_op(self, op: str) -> list[Lemma]:
        """The lemmas for `op` (case-insensitive; `AllReduce` also finds `dist.AllReduce`)."""
        return [lemma for lemma in self.lemmas if any(_same_op(op, o) for o in lemma.ops)]


class OpCount(BaseModel):
    op: str
    nodes: int


class Coverage(BaseModel):
    """The op types of some models, split by whether a rule file handles them."""

    inputs: list[str] = Field(description="the model directories and .onnx files read")
    unhandled: list[OpCount] = Field(description="op types no rule file handles, most nodes first")
    handled: list[OpCount]
    skipped: list[str] = Field(default_factory=list, description="batch entries that did not load (one line each)")


# --- the inventory -----------------------------------------------------------------------------


def display_path(path: Path) -> str:
    """A rule file as the user can open it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@dataclass
class _Rule:
    """A parsed rule and the signature of its head (None: not a plain atom)."""

    head: Signature | None
    node: ast.AST


@dataclass
class _File:
    """One parsed rule file: its rules in order, and the predicates it defines."""

    path: Path
    shown: str
    lines: list[str]
    rules: list[_Rule] = field(default_factory=list)

    def defining(self, sig: Signature) -> Iterator[_Rule]:
        return (r for r in self.rules if r.head == sig)


def _parse(path: Path, shown: str) -> _File:
    """Parse a rule file with clingo's parser (a syntax error is an InputError naming the file)."""
    messages: list[str] = []
    statements: list[ast.AST] = []
    try:
        text = path.read_text()
        ast.parse_files([str(path)], statements.append, logger=lambda _code, msg: messages.append(msg), message_limit=1)
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(path, f"cannot read the rule file ({getattr(exc, 'strerror', None) or type(exc).__name__})") from None
    except RuntimeError:
        raise InputError(path, f"cannot parse rule file: {' '.join((messages or ['syntax error'])[0].split())}") from None
    parsed = _File(path, shown, text.splitlines())
    for stmt in statements:
        if stmt.ast_type == ast.ASTType.Rule:
            parsed.rules.append(_Rule(_signature(stmt.head), stmt))
    return parsed


def _signature(literal: ast.AST) -> Signature | None:
    """name/arity of a positive plain atom (a head or body literal), else None."""
    if literal.ast_type != ast.ASTType.Literal or literal.sign != ast.Sign.NoSign:
        return None
    atom = literal.atom
    if atom.ast_type != ast.ASTType.SymbolicAtom:
        return None
    term = atom.symbol
    if term.ast_type == ast.ASTType.SymbolicTerm and term.symbol.type == clingo.SymbolType.Function:
        return term.symbol.name, len(term.symbol.arguments)
    if term.ast_type == ast.ASTType.Function:
        return term.name, len(term.arguments)
    return None


def _arguments(literal: ast.AST) -> list[ast.AST]:
    term = literal.atom.symbol
    return list(term.arguments) if term.ast_type == ast.ASTType.Function else []


def _strings(term: ast.AST) -> set[str] | None:
    """The strings a term stands for (a string, or a pool of them), None if anything else."""
    if term.ast_type == ast.ASTType.SymbolicTerm and term.symbol.type == clingo.SymbolType.String:
        return {term.symbol.string}
    if term.ast_type == ast.ASTType.Pool:
        parts = [_strings(t) for t in term.arguments]
        return set().union(*parts) if all(p is not None for p in parts) else None
    return None


class _Reader:
    """The ops of rules, given what the ground rule files state (`lists`: name -> strings of
    every unary predicate whose atoms are strings, e.g. reduce_op/1)."""

    def __init__(self, lists: dict[str, set[str]]) -> None:
        self.lists = lists
        self._helpers: dict[tuple[str, Signature], set[str]] = {}

    def body_ops(self, rule: ast.AST) -> set[str]:
        """The op names the body itself gives op/2 or node/3 (see the module doc)."""
        ops: set[str] = set()
        op_vars: set[str] = set()
        body = [lit for lit in rule.body if lit.ast_type == ast.ASTType.Literal]
        for lit in body:
            slot = OP_ARGUMENT.get(_signature(lit) or ("", 0))
            if slot is None:
                continue
            term = _arguments(lit)[slot]
            if term.ast_type == ast.ASTType.Variable:
                op_vars.add(term.name)
            ops |= _strings(term) or set()
        for lit in body:
            if lit.sign != ast.Sign.NoSign:
                continue
            atom = lit.atom
            if atom.ast_type == ast.ASTType.Comparison and atom.term.ast_type == ast.ASTType.Variable \
                    and atom.term.name in op_vars and len(atom.guards) == 1 \
                    and atom.guards[0].comparison == ast.ComparisonOperator.Equal:
                ops |= _strings(atom.guards[0].term) or set()
            sig = _signature(lit)
            if sig is not None and sig[1] == 1 and sig[0] in self.lists:
                arg = _arguments(lit)[0]
                if arg.ast_type == ast.ASTType.Variable and arg.name in op_vars:
                    ops |= self.lists[sig[0]]
        return ops

    def helper_ops(self, rule: ast.AST, file: _File) -> set[str]:
        """The ops of the helper predicates the body uses that `file` defines (transitively)."""
        ops: set[str] = set()
        for lit in rule.body:
            sig = _signature(lit) if lit.ast_type == ast.ASTType.Literal else None
            if sig is not None and sig != LEMMA_HEAD:
                ops |= self._predicate_ops(sig, file)
        return ops

    def _predicate_ops(self, sig: Signature, file: _File) -> set[str]:
        key = (file.shown, sig)
        if key not in self._helpers:
            self._helpers[key] = set()  # a recursive predicate adds nothing through itself
            found: set[str] = set()
            for r in file.defining(sig):
                found |= self.body_ops(r.node) | self.helper_ops(r.node, file)
            self._helpers[key] = found
        return self._helpers[key]


def _identity(lines: list[str], line: int) -> str:
    """The `%` comment block right above 1-based `line`, on one line (up to a section title)."""
    parts: list[str] = []
    i = line - 2
    while i >= 0 and lines[i].lstrip().startswith("%"):
        text = lines[i].strip().lstrip("%").strip()
        if text.startswith(("---", "===")):  # a section title, not this rule's comment
            break
        parts.append(text)
        i -= 1
    return " ".join(" ".join(reversed(parts)).split())


def _stated(ctl: clingo.Control) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """From the ground rule files: `handles` (file name -> ops) and the string lists (unary
    predicates all of whose atoms are strings)."""
    handles: dict[str, set[str]] = {}
    lists: dict[str, set[str]] = {}
    mixed: set[str] = set()
    for atom in ctl.symbolic_atoms:
        sym = atom.symbol
        args = sym.arguments
        if sym.name == "handles" and len(args) == 2 and all(a.type == clingo.SymbolType.String for a in args):
            handles.setdefault(args[1].string, set()).add(args[0].string)
        elif len(args) == 1:
            if args[0].type == clingo.SymbolType.String:
                lists.setdefault(sym.name, set()).add(args[0].string)
            else:
                mixed.add(sym.name)
    return handles, {name: ops for name, ops in lists.items() if name not in mixed}


def inventory(extra_dirs: list[Path] | None = None) -> Inventory:
    """Every lemma of the bundled library and of the `--rules` directories (InputError for a bad
    directory or a rule file that does not parse or ground)."""
    paths = rule_files(extra_dirs)
    bundled = len(rule_files(None))
    files = [_parse(p, display_path(p) if i < bundled else str(p)) for i, p in enumerate(paths)]
    ctl, _undefined = ground_rules(extra_dirs)
    handles, lists = _stated(ctl)
    reader = _Reader(lists)
    lemmas: list[Lemma] = []
    named: set[str] = set()
    for i, f in enumerate(files):
        previous: Lemma | None = None
        for rule in f.rules:
            if rule.head != LEMMA_HEAD:
                continue
            name_term = _arguments(rule.node.head)[3]
            name = str(name_term.symbol) if name_term.ast_type == ast.ASTType.SymbolicTerm else str(name_term)
            line = rule.node.location.begin.line
            identity = _identity(f.lines, line)
            if not identity and previous is not None and previous.name == name:
                identity = previous.identity  # a second case of the same lemma, under the first's comment
            ops, source = reader.body_ops(rule.node), "body"
            if not ops:
                ops, source = reader.helper_ops(rule.node, f), "helpers"
            named |= ops
            own = handles.get(f.path.name, set())
            if not ops or ops.isdisjoint(own):  # only other ops named (a Transpose after a gather): the file's too
                ops, source = ops | own, source if ops else "file"
            previous = Lemma(name=name, identity=identity, file=f.shown, line=line, ops=sorted(ops),
                             ops_from=source if ops else "none", user=i >= bundled)
            lemmas.append(previous)
    handled = named.union(*handles.values())
    return Inventory(files=[f.shown for f in files], lemmas=lemmas, handled_ops=sorted(handled))


def library_without(lemmas: Iterable[str], dest: Path) -> list[str]:
    """Write the bundled library into `dest` with every rule deriving one of `lemmas` left out
    (their lines blanked, so line numbers stay those of the library); the lemma names found.
    With REFINE_LIBRARY=dest, refine runs as if those lemmas had never been written. A name that
    is no lemma of the library is bad input (InputError), and then nothing is written."""
    wanted, found = set(lemmas), set()
    texts: dict[str, str] = {}
    for path in rule_files(None):
        parsed = _parse(path, display_path(path))
        lines = list(parsed.lines)
        for rule in parsed.rules:
            if rule.head != LEMMA_HEAD:
                continue
            name_term = _arguments(rule.node.head)[3]
            name = str(name_term.symbol) if name_term.ast_type == ast.ASTType.SymbolicTerm else str(name_term)
            if name in wanted:
                found.add(name)
                begin, end = rule.node.location.begin.line, rule.node.location.end.line
                lines[begin - 1:end] = [""] * (end - begin + 1)
        texts[path.name] = "\n".join(lines) + "\n"
    if wanted - found:
        raise InputError(None, f"no lemma named {', '.join(sorted(wanted - found))} in the library "
                               "(`refine rules list` prints their names)")
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (dest / name).write_text(text)
    return sorted(found)


def _same_op(query: str, op: str) -> bool:
    q, o = query.lower(), op.lower()
    return q == o or o.endswith("." + q)


def typo_warnings(extra_dirs: list[Path] | None) -> list[str]:
    """One line per body atom of a user rule file that no rule head, fact or `#defined` declares
    (clingo's own check): `FILE:LINE: pairr/3 ...`. Bundled files are not checked (decls.lp
    declares every fact predicate they read)."""
    if not extra_dirs:
        return []
    user = {str(p) for p in rule_files(extra_dirs)[len(rule_files(None)):]}
    _ctl, undefined = ground_rules(extra_dirs)
    lines: list[str] = []
    for message in undefined:
        found = _UNDEFINED.match(message)
        if found is None or found["file"] not in user:
            continue
        sig = _atom_signature(found["atom"])
        lines.append(f"{found['file']}:{found['line']}: {sig} is used in a rule body, but no rule head, fact "
                     f"or #defined declares it (a typo?)")
    return list(dict.fromkeys(lines))


_UNDEFINED = re.compile(r"(?P<file>.+?):(?P<line>\d+):[\d:-]+: info: atom does not occur in any rule head:\s*"
                        r"(?P<atom>.*?)\s*$", re.S)


def _atom_signature(atom: str) -> str:
    """`pairr(N,M,G)` -> `pairr/3` (commas counted outside nested terms and strings)."""
    name, _, rest = atom.partition("(")
    if not rest:
        return f"{name.strip()}/0"
    depth, arity, quoted, escaped = 0, 1, False, False
    for ch in rest:
        if quoted:
            quoted, escaped = (ch != '"' or escaped), (ch == "\\" and not escaped)
        elif ch == '"':
            quoted = True
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch in ",;" and depth == 0:
            arity += 1
    return f"{name.strip()}/{arity}"


# --- coverage ----------------------------------------------------------------------------------


def op_name(node: onnx.NodeProto) -> str:
    """The op as the facts name it (refine/lowering/graphs.py): domain-qualified outside ONNX."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def _count_ops(model: onnx.ModelProto, counts: Counter[str]) -> None:
    """Count the nodes of the main graph and of every local function by op (a call of a local
    function is not an op: its body's nodes are counted, once per function)."""
    functions = {(f.domain, f.name) for f in model.functions}
    for node in [*model.graph.node, *(n for f in model.functions for n in f.node)]:
        if (node.domain, node.op_type) not in functions:
            counts[op_name(node)] += 1


def model_ops(path: Path) -> Counter[str]:
    """Node counts by op of a model directory (seq.onnx and every rank) or one .onnx file,
    loaded and checked as `refine verify` does (bad input is an InputError naming the file)."""
    from refine.lowering.load import load_model_dir, load_model_file

    counts: Counter[str] = Counter()
    if path.is_dir() or (not path.exists() and path.suffix != ".onnx"):
        loaded = load_model_dir(path, inline=False)
        models = [loaded.seq, *loaded.ranks]
    else:
        models = [load_model_file(path)]
    for model in models:
        _count_ops(model, counts)
    return counts


def coverage(inputs: Iterable[Path], extra_dirs: list[Path] | None = None, *, skip_bad: bool = False) -> Coverage:
    """Which op types of the models no rule file handles (nor lowering: LOWERED_OPS). A model that
    does not load is an InputError, or with `skip_bad` a line in `skipped` (a batch reports its
    entries itself)."""
    handled = set(inventory(extra_dirs).handled_ops) | LOWERED_OPS
    counts: Counter[str] = Counter()
    read: list[str] = []
    skipped: list[str] = []
    for path in inputs:
        try:
            counts.update(model_ops(path))
        except InputError as exc:
            if not skip_bad:
                raise
            skipped.append(exc.one_line(path))
            continue
        read.append(str(path))
    order = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return Coverage(inputs=read, skipped=skipped,
                    unhandled=[OpCount(op=op, nodes=n) for op, n in order if op not in handled],
                    handled=[OpCount(op=op, nodes=n) for op, n in order if op in handled])


def batch_coverage(root: Path, plan_tp: int | None, extra_dirs: list[Path] | None = None) -> Coverage:
    """`refine batch --coverage`: the coverage summed over every entry of the batch."""
    from refine.batch.entries import find_entries

    return coverage([e.path for e in find_entries(root, plan_tp)], extra_dirs, skip_bad=True)


def render_coverage(cov: Coverage) -> str:
    """Unhandled op types with their node counts, most first, then one line of totals."""
    def total(rows: list[OpCount]) -> int:
        return sum(r.nodes for r in rows)

    out: list[str] = []
    if cov.unhandled:
        out.append("ops no rule file handles (nodes, op):")
        width = len(str(cov.unhandled[0].nodes))
        out.extend(f"  {r.nodes:>{width}}  {r.op}" for r in cov.unhandled)
    else:
        out.append("every op is handled by some rule file")
    kinds = len(cov.handled) + len(cov.unhandled)
    nodes = total(cov.handled) + total(cov.unhandled)
    models = cov.inputs[0] if len(cov.inputs) == 1 else f"{len(cov.inputs)} models"
    out.append(f"handled: {len(cov.handled)} of {kinds} op types ({total(cov.handled)} of {nodes} nodes) in {models}")
    out.extend(f"not counted: {line}" for line in cov.skipped)
    return "\n".join(out)


def render_lemma(lemma: Lemma) -> str:
    """Two lines: where it is, its name and ops; then the identity it encodes."""
    ops = ", ".join(lemma.ops) if lemma.ops else "no op named"
    via = {"body": "", "helpers": " (via its helper predicates)", "file": " (its file's handles/2)", "none": ""}[lemma.ops_from]
    return f"{lemma.where}  {lemma.name}  [{ops}]{via}\n    {lemma.identity or '(no comment above the rule)'}"

