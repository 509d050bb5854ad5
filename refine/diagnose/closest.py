"""The closest lemma: which rule came nearest to relating a failing node's output, and the
first premise of it that did not hold. An explanation only: nothing here touches a verdict.

clingo keeps no record of rules that almost fired, so this asks it, for the failing node only.
What was missing: the relation of the node's output on the output of a rank node paired with
it (same op, a related input) whose output relates to nothing -- else any relation of the
node's output. Every lemma about a sequential node whose head unifies with that (its node
variable bound to the failing node, its paired-node variable to the rank node) is cut into
prefixes

    near(Id, K) :- <binding equalities>, <first K body literals>.

ordered so that what the bindings fix anchors the next literal: first the premises about the
sequential node alone (its op, its shapes: the gate, which must all hold for the rule to be
about this node at all), then the rank programs' structure, then the premises on relations,
in the rule's order; the shape guard of rel/3 (core.lp) comes last, as it judges the lemma's
result. Grounding them against the fixpoint held open by engine.Probe (multi-shot: the library
is not solved again per question) gives the largest K per rule, and a second question the
values at it; item K+1 is the premise that did not hold. The closest lemma: one that fired
(only the shape guard refused it), else the most premises on relations held, in its own body,
then with its helper predicates unfolded.

A missing premise on a helper predicate of the lemma's own rule file (ew_all, mm, ...) is
explained a level deeper the same way: its defining rules, head unified with the premise's
values. Positions naming the sequential node and the paired rank node are found from the
facts schema and pair/3, carried through rule heads to a fixpoint; nothing here names a lemma.
This module does the clingo AST work; engine.py grounds.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import clingo
from clingo import ast

from refine.run.engine import Probe, Term, rule_files
from refine.lowering.facts import SCHEMA, FactSet, quoted

_POS = ast.Position("<closest>", 0, 0)
LOC = ast.Location(_POS, _POS)
GOAL_SIG = ("rel_by", 4)
REL_SIG = ("rel", 3)
MAX_ROUNDS = 5  # levels of helper rules (a recursion over input slots needs one per slot)
MAX_BINDINGS = 2  # bindings of one rule explained a level deeper (e.g. two ranks)
MAX_GOALS = 1  # missing relations tried: the first rank's
MAX_OTHERS = 3

# --- the rule library as clingo AST --------------------------------------------------------


@dataclass(frozen=True)
class Lit:
    """One literal and what the prefix analysis needs to know about it (computed once: clingo's
    AST attribute access is slow)."""

    node: ast.AST
    text: str
    sig: tuple[str, int] | None  # predicate of a symbolic atom (positive or negative)
    positive: bool  # a positive symbolic atom: it binds variables
    static: bool  # decided by the facts alone (no relation involved)
    premise: bool  # a body literal of the rule (not one of the binding equalities added here)
    vars: frozenset[str]  # named variables
    bind: frozenset[str]  # variables a positive atom binds
    eq: tuple[frozenset[str], frozenset[str], frozenset[str], frozenset[str]] | None
    # an equality: (left vars, right vars, left bindable, right bindable)
    args: tuple[str, ...]  # a symbolic atom's arguments as text
    seq_side: bool = False  # about the sequential graph: a seq node at a node position, or a `seq` fact


def lit(node: ast.AST, static: bool = True, premise: bool = True) -> Lit:
    text = str(node)
    atom = node.atom
    kind = atom.ast_type
    symbol = atom.symbol if kind == ast.ASTType.SymbolicAtom else None
    arg_nodes = list(symbol.arguments) if symbol is not None and symbol.ast_type == ast.ASTType.Function else []
    sig = (symbol.name, len(arg_nodes)) if arg_nodes or (symbol is not None and symbol.ast_type == ast.ASTType.Function) else None
    args = tuple(str(a) for a in arg_nodes)
    sign = node.sign
    positive = sig is not None and sign == ast.Sign.NoSign
    bind: set[str] = set()
    if positive:
        for arg_node, arg in zip(arg_nodes, args):
            bind |= _text_vars(arg) if not _ARITH.search(_STRING.sub("", arg)) else _bindable(arg_node)
    eq = None
    if kind == ast.ASTType.Comparison and _is_eq(node):
        left, right = atom.term, atom.guards[0].term
        lb = _bindable(left) | ({left.name} if left.ast_type == ast.ASTType.Variable and left.name != "_" else set())
        eq = (frozenset(_vars(left)), frozenset(_vars(right)), frozenset(lb), frozenset(_bindable(right)))
    return Lit(node, text, sig, positive, static, premise, frozenset(_text_vars(text)), frozenset(bind), eq, args)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_VARIABLE = re.compile(r"(?<![A-Za-z0-9_'])_*[A-Z][A-Za-z0-9_']*")
_ARITH = re.compile(r"[-+*/\\^&|?]|\.\.")


def _text_vars(text: str) -> set[str]:
    """Named variables in clingo text (uppercase identifiers outside strings): one C call for
    the text instead of a walk over clingo's AST, whose attribute access is slow."""
    return set(_VARIABLE.findall(_STRING.sub('""', text)))


@dataclass(frozen=True)
class Rule:
    head: ast.AST  # the head atom (an ast.Function)
    body: tuple[Lit, ...]
    file: str  # the rule file's path, as loaded
    line: int
    lemma: str | None  # rel_by's lemma name; None for a helper rule
    node_vars: tuple[str, ...]  # variables naming a sequential node
    paired_vars: tuple[str, ...] = ()  # variables naming the rank node paired with it (pair/3)

    @property
    def sig(self) -> tuple[str, int]:
        return (self.head.name, len(self.head.arguments))

    @property
    def name(self) -> str:
        return self.lemma or f"{self.head.name}/{len(self.head.arguments)}"


def _children(node: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    for key in node.child_keys:
        value = getattr(node, key)
        if value is None:
            continue
        if isinstance(value, ast.AST):
            out.append(value)
        else:
            out.extend(v for v in value if isinstance(v, ast.AST))
    return out


def _vars(node: ast.AST) -> set[str]:
    """Named variables in a term or literal (anonymous `_` ones need no binding)."""
    return _text_vars(str(node))


def _occurrences(node: ast.AST) -> int:
    if node.ast_type == ast.ASTType.Variable:
        return 1
    return sum(_occurrences(c) for c in _children(node))


_LINEAR = {ast.BinaryOperator.Plus, ast.BinaryOperator.Minus, ast.BinaryOperator.Multiplication}


def _bindable(term: ast.AST) -> set[str]:
    """Variables a positive atom binds through this argument: plain variables, variables in
    compound terms, and the one variable of a linear term (clingo inverts `K - 1`, not `A + B`)."""
    kind = term.ast_type
    if kind == ast.ASTType.Variable:
        return _vars(term)
    if kind == ast.ASTType.Function:
        out: set[str] = set()
        for arg in term.arguments:
            out |= _bindable(arg)
        return out
    if kind == ast.ASTType.Pool:
        sets = [_bindable(a) for a in term.arguments]
        return set.intersection(*sets) if sets else set()
    if kind in (ast.ASTType.BinaryOperation, ast.ASTType.UnaryOperation) and _occurrences(term) == 1:
        ops_ok = all(n.operator_type in _LINEAR for n in _walk(term) if n.ast_type == ast.ASTType.BinaryOperation)
        return _vars(term) if ops_ok else set()
    return set()


def _walk(node: ast.AST) -> list[ast.AST]:
    out = [node]
    for child in _children(node):
        out.extend(_walk(child))
    return out


def _atom_args(lit: ast.AST) -> list[ast.AST]:
    return list(lit.atom.symbol.arguments)


def _is_eq(lit: ast.AST) -> bool:
    return (lit.atom.ast_type == ast.ASTType.Comparison and lit.sign == ast.Sign.NoSign
            and len(lit.atom.guards) == 1 and lit.atom.guards[0].comparison == ast.ComparisonOperator.Equal)


def _binds(item: Lit, bound: set[str]) -> set[str]:
    """Variables this literal binds, given the bound ones."""
    if item.positive:
        return set(item.bind)
    if item.eq is not None:
        lv, rv, lb, rb = item.eq
        return (set(lb) if rv <= bound else set()) | (set(rb) if lv <= bound else set())
    return set()


def _closure(items: list[Lit]) -> set[str]:
    """Variables bound by a set of literals (clingo's order-free safety, conservatively)."""
    bound: set[str] = set()
    while True:
        new = set(bound)
        for item in items:
            new |= _binds(item, new)
        if new == bound:
            return bound
        bound = new


def _safe(items: list[Lit]) -> bool:
    needed: set[str] = set()
    for item in items:
        needed |= item.vars
    return needed <= _closure(items)


def _simple(body: list[ast.AST]) -> bool:
    return all(b.ast_type == ast.ASTType.Literal and b.atom.ast_type in (
        ast.ASTType.SymbolicAtom, ast.ASTType.Comparison, ast.ASTType.BooleanConstant) for b in body)


def _sig_of(lit: ast.AST) -> tuple[str, int] | None:
    if lit.ast_type != ast.ASTType.Literal or lit.atom.ast_type != ast.ASTType.SymbolicAtom:
        return None
    sym = lit.atom.symbol
    return (sym.name, len(sym.arguments)) if sym.ast_type == ast.ASTType.Function else None


_NODE_COLUMNS = {(r.name, r.arity): [i for i, (c, _t) in enumerate(r.columns) if c == "n"] for r in SCHEMA}


class Library:
    """The parsed rule files: rules with a function head, which predicates depend on relations,
    and which argument positions name a sequential node (from the facts schema: a column `n` of
    a `seq` row, carried through rule heads to a fixpoint)."""

    def __init__(self, files: list[Path]) -> None:
        statements: list[ast.AST] = []
        ast.parse_files([str(f) for f in files], statements.append)
        parsed: list[tuple[ast.AST, ast.AST, list[Lit] | None, str, int]] = []
        deps: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
        for st in statements:
            if st.ast_type != ast.ASTType.Rule or st.head.ast_type != ast.ASTType.Literal \
                    or st.head.atom.ast_type != ast.ASTType.SymbolicAtom:
                continue
            head = st.head.atom.symbol
            if head.ast_type != ast.ASTType.Function:
                continue
            body_nodes = list(st.body)
            body = [lit(b) for b in body_nodes] if _simple(body_nodes) else None
            sig = (head.name, len(head.arguments))
            if body is not None:
                deps[sig] |= {b.sig for b in body if b.sig}
            else:  # aggregates and conditions: their literals count as dependencies too
                deps[sig] |= {s for b in body_nodes for n in _walk(b) if n.ast_type == ast.ASTType.Literal
                              for s in [_sig_of(n)] if s}
            parsed.append((st, head, body, st.location.begin.filename, st.location.begin.line))
        self.dynamic = {GOAL_SIG}
        changed = True
        while changed:
            changed = False
            for sig, used in deps.items():
                if sig not in self.dynamic and used & self.dynamic:
                    self.dynamic.add(sig)
                    changed = True
        heads = {id(st): [str(a) for a in head.arguments] for st, head, *_ in parsed}
        simple = [(head.name, heads[id(st)], body) for st, head, body, *_ in parsed if body is not None]
        self.node_pos = node_pos = _positions(simple, set(), seq_columns=True)
        self.paired_pos = paired_pos = _positions(simple, {PAIR_POS}, seq_columns=False)
        self.rules: list[Rule] = []
        for st, head, body, file, line in parsed:
            if body is None:
                continue
            body = [replace(b, static=b.sig not in self.dynamic,
                            seq_side=bool(_vars_at([b], node_pos, True)) or b.args[:1] == ("seq",)) for b in body]
            args = heads[id(st)]
            lemma = args[3] if len(args) == 4 and head.name == GOAL_SIG[0] and not _text_vars(args[3]) else None
            self.rules.append(Rule(head, tuple(body), file, line, lemma, tuple(sorted(_vars_at(body, node_pos, True))),
                                   tuple(sorted(_vars_at(body, paired_pos, False)))))
        self.by_sig: dict[tuple[str, int], list[Rule]] = defaultdict(list)
        for rule in self.rules:
            self.by_sig[rule.sig].append(rule)
        # rel(S, T, L) :- rel_by(S, T, L, _), <guards>: a lemma's relation still has to pass them
        self.guards = [r for r in self.by_sig[REL_SIG] if any(b.sig == GOAL_SIG for b in r.body)]
        self._guard_cache: dict[int, list[Lit]] = {}
        helpers: dict[str, set[tuple[str, int]]] = defaultdict(set)
        for sig, rules in self.by_sig.items():
            if len({r.file for r in rules}) == 1:
                helpers[rules[0].file].add(sig)
        self._helpers = {file: frozenset(sigs) for file, sigs in helpers.items()}

    def helpers_of(self, file: str) -> frozenset[tuple[str, int]]:
        """Predicates defined in rule file `file` alone: a lemma's helpers, explained a level down."""
        return self._helpers.get(file, frozenset())

    def guards_of(self, rule: Rule) -> list[Lit]:
        """The rel rule's other premises (the shape guard) on a lemma's head terms: a lemma's
        relation still has to pass them (cached: they depend on the rule alone)."""
        if id(rule) not in self._guard_cache:
            extra: list[Lit] = []
            for guard in self.guards:
                (via,) = [it for it in guard.body if it.sig == GOAL_SIG]
                values = {g.name: h for g, h in zip(_atom_args(via.node)[:3], rule.head.arguments[:3])
                          if g.ast_type == ast.ASTType.Variable}
                rename = {v: ast.Variable(LOC, f"{v}_guard") for it in guard.body for v in it.vars if v not in values}
                extra += [lit(substitute(substitute(it.node, rename), values), it.static)
                          for it in guard.body if it is not via]
            self._guard_cache[id(rule)] = extra
        return self._guard_cache[id(rule)]


Position = tuple[str, int, int]  # predicate name, arity, argument index
PAIR_POS: Position = ("pair", 3, 1)  # core.lp: pair(N, M, G), M the rank node paired with seq node N


def _vars_at(body: list[Lit], pos: set[Position], seq_columns: bool) -> set[str]:
    """Variables of a body at the given argument positions (and, with `seq_columns`, at a node
    column of a facts relation whose graph argument is `seq`)."""
    found: set[str] = set()
    for b in body:
        if not b.positive or b.sig is None:
            continue
        cols = [i for i in range(len(b.args)) if (*b.sig, i) in pos]
        if seq_columns and b.sig in _NODE_COLUMNS and b.args and b.args[0] == "seq":
            cols += _NODE_COLUMNS[b.sig]
        found |= {b.args[i] for i in cols if _VARIABLE.fullmatch(b.args[i])}
    return found


def _positions(rules: list[tuple[str, list[str], list[Lit]]], seed: set[Position], seq_columns: bool) -> set[Position]:
    """Argument positions that hold what `seed` holds, carried through rule heads to a fixpoint."""
    pos = set(seed)
    changed = True
    while changed:
        changed = False
        for name, head_args, body in rules:
            found = _vars_at(body, pos, seq_columns)
            for i, arg in enumerate(head_args):
                key = (name, len(head_args), i)
                if key not in pos and arg in found:
                    pos.add(key)
                    changed = True
    return pos


_LIBRARIES: dict[tuple[tuple[str, float], ...], Library] = {}


def library(extra_rule_dirs: list[Path] | None = None) -> Library:
    """The parsed library, cached by its files and their modification times."""
    files = rule_files(extra_rule_dirs)
    key = tuple((str(f), os.path.getmtime(f)) for f in files)
    if key not in _LIBRARIES:
        _LIBRARIES.clear()
        _LIBRARIES[key] = Library(files)
    return _LIBRARIES[key]


# --- substitution and unification on AST ---------------------------------------------------


class _Subst(ast.Transformer):
    def __init__(self, values: dict[str, ast.AST]) -> None:
        self.values = values

    def visit_Variable(self, node: ast.AST) -> ast.AST:  # noqa: N802 (clingo's visitor naming)
        return self.values.get(node.name, node)


def substitute(node: ast.AST, values: dict[str, ast.AST]) -> ast.AST:
    return _Subst(values)(node) if values else node


def term_ast(term: Term) -> ast.AST:
    return ast.SymbolicTerm(LOC, clingo.parse_term(term.text))


def _eq(value: ast.AST, pattern: ast.AST) -> ast.AST:
    return ast.Literal(LOC, ast.Sign.NoSign, ast.Comparison(value, [ast.Guard(ast.ComparisonOperator.Equal, pattern)]))


def _parts(node: ast.AST) -> tuple[str, list[ast.AST]] | None:
    """A compound term (or constant) as (name, arguments), from an AST function or a symbol."""
    if node.ast_type == ast.ASTType.Function:
        return node.name, list(node.arguments)
    if node.ast_type == ast.ASTType.SymbolicTerm and node.symbol.type == clingo.SymbolType.Function:
        return node.symbol.name, [ast.SymbolicTerm(LOC, a) for a in node.symbol.arguments]
    return None


def unify(value: ast.AST, pattern: ast.AST) -> list[ast.AST] | None:
    """Equalities `value = pattern` that bind the pattern's variables, split along matching
    compound terms; None if the two cannot unify (different constants or functors)."""
    if pattern.ast_type == ast.ASTType.Variable:
        return [] if pattern.name == "_" else [_eq(value, pattern)]
    if _vars(pattern) == set() and _vars(value) == set() and value.ast_type == ast.ASTType.SymbolicTerm \
            and pattern.ast_type in (ast.ASTType.SymbolicTerm, ast.ASTType.Function):
        return [] if str(value) == str(pattern) else None
    pv, pp = _parts(value), _parts(pattern)
    if pp is not None and pv is None and not _vars(value) and value.ast_type == ast.ASTType.SymbolicTerm:
        return None  # a number or string against a compound term
    if pv is not None and pp is not None:
        if pv[0] != pp[0] or len(pv[1]) != len(pp[1]):
            return None
        out: list[ast.AST] = []
        for v, p in zip(pv[1], pp[1]):
            sub = unify(v, p)
            if sub is None:
                return None
            out += sub
        return out
    return [_eq(value, pattern)]


# --- candidates: one rule, bound, its body ordered -------------------------------------------


@dataclass
class Cand:
    """One rule tried against the failure: its literals in prefix order, and what grounding found."""

    id: int
    rule: Rule
    items: list[Lit]  # binding equalities and the body (and guard) literals, in prefix order
    gate_len: int  # leading items about the seq node alone (its op, shapes): must all hold
    safe: list[bool]  # safe[k]: the prefix of k items is safe (clingo can ground it)
    guards: int = 0  # trailing items that are the rel rule's guards on the lemma's result
    via: int = 0  # which of the parent's bindings this candidate explains
    shown: int = 0  # which binding to show (the one the explanation below went on with)
    evaluated: bool = False  # asked (a candidate left when the rounds ran out is not)
    best: int = -1  # largest k whose prefix holds
    bindings: list[dict[str, Term]] = field(default_factory=list)
    children: list[Cand] = field(default_factory=list)

    @property
    def premises(self) -> int:
        return sum(1 for it in self.items if it.premise)

    @property
    def matched(self) -> int:
        return sum(1 for it in self.items[: max(self.best, 0)] if it.premise)

    @property
    def matched_relations(self) -> int:
        """Premises on relations that held: what ranks candidates. The fact-only ones (the op,
        shapes, slots) only say the rule is about this node, and all must hold anyway."""
        return sum(1 for it in self.items[: max(self.best, 0)] if it.premise and not it.static)

    @property
    def lead(self) -> int:
        """Items before the first premise: the binding equalities."""
        return next((k for k, it in enumerate(self.items) if it.premise), len(self.items))

    @property
    def unified(self) -> bool:
        """The binding equalities before the first premise hold (the head matched)."""
        return self.best >= self.lead

    @property
    def missing(self) -> Lit | None:
        return self.items[self.best] if 0 <= self.best < len(self.items) else None

    def applicable(self) -> bool:
        """The rule is about this node (its fact-only premises hold), and so is the helper rule
        explaining its missing premise, if one was tried."""
        if not self.evaluated or self.best < self.gate_len:
            return False
        if self.children and not any(c.evaluated for c in self.children):
            return False  # the explanation ran out of rounds (a recursion below its base case)
        tried = [c for c in self.children if c.unified]
        return not tried or any(c.applicable() for c in tried)

    @property
    def fired(self) -> bool:
        """The body held: the lemma derived its rel_by, and only a guard (the shape) refused it."""
        return self.best >= len(self.items) - self.guards

    def held(self) -> int:
        """Premises on relations that held, counting those of the helper rules that explain the
        missing one (the lemma's body with its helper predicates unfolded)."""
        kids = [k.held() for k in self.children if k.unified and k.applicable()]
        return self.matched_relations + max(kids, default=0)

    def score(self) -> tuple[int, int, int]:
        """A lemma that fired first, then the most premises on relations of its own body that
        held, then with its helper predicates unfolded (ties: the library's order)."""
        return (int(self.fired), self.matched_relations, self.held())


def _order(items: list[Lit], seq_vars: set[str], rank_vars: set[str],
           helpers: frozenset[tuple[str, int]] = frozenset()) -> tuple[list[Lit], int]:
    """The prefix order, and how many leading items make the gate: the premises about the
    sequential node alone (its op, its shapes), which must all hold for the rule to be about
    this node at all.

    Bindings and checks as soon as they can be evaluated, then the gate's premises, then the
    premises on the sequential node through a helper predicate of the rule's own file (mm(N, ...)
    may hold its op: `helpers`), then fact-only premises anchored at what is bound (the rank programs' structure), then the
    others anchored at what is bound, then the rest; within a tier, the rule's order."""
    pool = list(items)
    out: list[Lit] = []
    bound: set[str] = set()
    seq = set(seq_vars)
    gate_len = 0

    def check(it: Lit) -> bool:
        if it.positive:
            return False
        if it.eq is not None:  # one side known, and the other binds whatever is left
            left, right, left_binds, right_binds = it.eq
            return (right <= bound and it.vars - bound <= left_binds) or (left <= bound and it.vars - bound <= right_binds)
        return it.vars <= bound

    def anchored(it: Lit) -> bool:
        return it.positive and (not it.vars or bool(it.vars & bound))

    def gate(it: Lit) -> bool:
        return (it.premise and it.static and not it.vars & rank_vars
                and (it.vars <= seq if not it.positive else (it.seq_side or it.vars <= seq)))

    choices = [check, lambda it: not it.premise and it.positive, lambda it: anchored(it) and gate(it),
               lambda it: anchored(it) and it.seq_side and it.sig in helpers, lambda it: anchored(it) and it.static, anchored,
               lambda it: it.positive, lambda it: True]
    while pool:
        pick = next(it for test in choices for it in pool if test(it))
        pool.remove(pick)
        if gate(pick) or not pick.premise:  # what the bindings fix counts as known, bar the rank side
            seq |= pick.vars - rank_vars
        if gate_len == len(out) and (not pick.premise or gate(pick)):
            gate_len += 1
        out.append(pick)
        bound = _closure(out)
    return out, gate_len


def make_cand(cid: int, rule: Rule, bindings: list[ast.AST], seq_vars: set[str], rank_vars: set[str],
              guards: list[Lit] | None = None, helpers: frozenset[tuple[str, int]] = frozenset()) -> Cand:
    """A candidate: binding equalities and the body in prefix order, then the guards (premises
    about the rule's result, so last). `seq_vars`/`rank_vars`: what the bindings fix on the
    sequential side / on the rank side."""
    items, gate_len = _order([lit(b, premise=False) for b in bindings] + list(rule.body), seq_vars, rank_vars, helpers)
    items += list(guards or [])
    safe = [_safe(items[:k]) for k in range(len(items) + 1)]
    return Cand(cid, rule, items, gate_len, safe, len(guards or []))


def _names(items: list[Lit]) -> list[str]:
    return sorted(set().union(*(it.vars for it in items))) if items else []


def _tuple(names: list[str]) -> str:
    if not names:
        return "()"
    return "(" + ",".join(names) + ("," if len(names) == 1 else "") + ")"


def near_rules(cands: list[Cand], pred: str) -> str:
    """`pred(Id, K) :- <first K items>.` for every safe prefix of every candidate."""
    lines = []
    for c in cands:
        for k in range(len(c.items) + 1):
            if c.safe[k]:
                body = ", ".join(it.text for it in c.items[:k])
                lines.append(f"{pred}({c.id},{k})" + (f" :- {body}." if body else "."))
    return "\n".join(lines)


def binding_rules(cands: list[Cand], pred: str) -> str:
    """`pred(Id, (Vars)) :- <first best items>.`: the values at each candidate's largest prefix."""
    lines = []
    for c in cands:
        items = c.items[: max(c.best, 0)]
        body = ", ".join(it.text for it in items)
        lines.append(f"{pred}({c.id},{_tuple(_names(items))})" + (f" :- {body}." if body else "."))
    return "\n".join(lines)


# --- the search ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    """The relation that was missing: of the failing node's output `seq`, on the output of
    `rank_node`, a rank node paired with it whose output relates to nothing (None: any)."""

    seq: Term
    rank_node: Term | None = None


@dataclass
class Step:
    """One rule on the way down: how much of its body held and the first premise that did not."""

    rule: Rule
    matched: int
    premises: int
    missing: str | None  # the premise, with the values it was asked with (clingo text)
    missing_sig: tuple[str, int] | None
    missing_args: list[Term | None]  # per argument: its value, None where it was left open
    missing_texts: list[str]  # per argument: as asked (clingo text; open variables by name)
    source: str | None  # the premise as the rule writes it (its variables by name)


@dataclass
class Closest:
    """The closest lemma (steps[0]) and the helper rules that explain its missing premise
    (steps[1:]); `others`: the next closest lemmas, each explained the same way."""

    goal: Goal
    steps: list[Step]
    others: list[list[Step]]
    tried: int


def _chain(c: Cand) -> list[Cand]:
    """c, then the helper rule that best explains its missing premise, and so on down."""
    chain = [c]
    while True:
        kids = [k for k in chain[-1].children if k.unified and k.applicable()]
        if not kids:
            return chain
        best = max(kids, key=Cand.score)
        chain[-1].shown = best.via
        chain.append(best)


_INT_OP = re.compile(r"\((-?\d+)([-+*])(-?\d+)\)")


def _fold(text: str) -> str:
    """Integer arithmetic in a partly open term, done: `sl((3-1),X,Y)` -> `sl(2,X,Y)`."""
    while True:
        found = _INT_OP.search(text)
        if found is None:
            return text
        a, op, b = int(found[1]), found[2], int(found[3])
        value = a + b if op == "+" else a - b if op == "-" else a * b
        text = text[: found.start()] + str(value) + text[found.end():]


def _has_var(node: ast.AST) -> bool:
    return any(n.ast_type == ast.ASTType.Variable for n in _walk(node))


class Search:
    """One failing node, explained against the fixpoint held open in a Probe."""

    def __init__(self, lib: Library, probe: Probe, node: str) -> None:
        self.lib, self.probe, self.node = lib, probe, node
        self.next_id = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def lemma_cands(self, goal: Goal) -> list[Cand]:
        """Every lemma about a sequential node whose head unifies with the goal, its node
        variable bound to the failing node."""
        out = []
        node = ast.SymbolicTerm(LOC, clingo.String(self.node))
        for rule in self.lib.rules:
            if rule.lemma is None or not rule.node_vars:
                continue
            binds = unify(term_ast(goal.seq), rule.head.arguments[0])
            if binds is None:
                continue
            guards = self.lib.guards_of(rule)
            seq_vars = set(rule.node_vars) | _vars(rule.head.arguments[0])
            for var in rule.node_vars:
                for more, rank_vars in self._rank_bindings(rule, goal):
                    out.append(make_cand(self._id(), rule, [_eq(node, ast.Variable(LOC, var))] + binds + more,
                                         seq_vars, rank_vars, guards, self.lib.helpers_of(rule.file)))
        return out

    @staticmethod
    def _rank_bindings(rule: Rule, goal: Goal) -> list[tuple[list[ast.AST], set[str]]]:
        """The goal's rank node as the rule's paired node (one variant per paired variable), or,
        for a rule without one, as the producer of the rank tensor it relates; with the
        variables that binds on the rank side."""
        if goal.rank_node is None:
            return [([], set(rule.paired_vars) | _vars(rule.head.arguments[1]))]
        m = term_ast(goal.rank_node)
        if rule.paired_vars:
            return [([_eq(m, ast.Variable(LOC, var))], set(rule.paired_vars)) for var in rule.paired_vars]
        anon = ast.Variable(LOC, "_")
        produced = ast.Function(LOC, "node_out", [anon, m, anon, rule.head.arguments[1]], 0)
        return [([ast.Literal(LOC, ast.Sign.NoSign, ast.SymbolicAtom(produced))], _vars(rule.head.arguments[1]))]

    def helper_cands(self, literal: ast.AST) -> list[Cand]:
        """The rules defining a missing premise's predicate, head unified with its bound values."""
        out = []
        for rule in self.lib.by_sig[_sig_of(literal)]:  # type: ignore[index]
            binds: list[ast.AST] = []
            for value, pattern in zip(_atom_args(literal), rule.head.arguments):
                if _has_var(value):
                    continue  # left open by the parent: any value will do
                more = unify(value, pattern)
                if more is None:
                    break
                binds += more
            else:
                sig, args = rule.sig, rule.head.arguments
                seq_vars = {v for i, a in enumerate(args) if (*sig, i) in self.lib.node_pos for v in _vars(a)}
                rank_vars = {v for i, a in enumerate(args) if (*sig, i) in self.lib.paired_pos for v in _vars(a)}
                out.append(make_cand(self._id(), rule, binds, seq_vars, rank_vars,
                                     helpers=self.lib.helpers_of(rule.file)))
        return out

    def descend(self, c: Cand) -> list[Cand]:
        """Candidates explaining c's missing premise when it is a helper predicate of c's own
        rule file, one set per binding (at most MAX_BINDINGS)."""
        missing = c.missing
        if missing is None or c.best < c.gate_len or not missing.positive or missing.sig == GOAL_SIG \
                or missing.sig not in self.lib.helpers_of(c.rule.file):
            return []
        for i, binding in enumerate(c.bindings[:MAX_BINDINGS]):
            kids = self.helper_cands(substitute(missing.node, {k: term_ast(v) for k, v in binding.items()}))
            for kid in kids:
                kid.via = i
            c.children += kids
        return c.children

    def _evaluate(self, cands: list[Cand], depth: int) -> None:
        """Each candidate's largest prefix that holds, then the values it holds with (two
        questions: the values only for the prefixes that matter)."""
        by_id = {c.id: c for c in cands}
        for c in cands:
            c.evaluated = True
        for cid, k in self.probe.ask(near_rules(cands, f"near_{depth}"), f"near_{depth}", 2):
            c = by_id[int(cid.value)]  # type: ignore[call-overload]
            c.best = max(c.best, int(k.value))  # type: ignore[call-overload]
        found = [c for c in cands if c.best >= 0]
        rows: dict[int, list[tuple[Term, ...]]] = defaultdict(list)
        for cid, vals in self.probe.ask(binding_rules(found, f"near_values_{depth}"), f"near_values_{depth}", 2):
            rows[int(cid.value)].append(vals.args)  # type: ignore[call-overload]
        for c in found:
            names = _names(c.items[: c.best])
            c.bindings = [dict(zip(names, vals)) for vals in sorted(rows[c.id], key=lambda v: [t.text for t in v])]

    def run(self, goals: list[Goal]) -> Closest | None:
        top = [c for g in goals[:MAX_GOALS] for c in self.lemma_cands(g)]
        todo = top
        for depth in range(1, MAX_ROUNDS + 1):
            if not todo:
                break
            self._evaluate(todo, depth)
            todo = [kid for c in todo for kid in self.descend(c)]
        # (one that held relates another tensor; one whose first missing item is an equality is
        # about terms of another shape, a chunk's or a piece's: not near)
        near = [c for c in top if c.applicable() and c.best < len(c.items)
                and not (c.missing is not None and c.missing.eq is not None)]
        ranked = sorted(near, key=Cand.score, reverse=True)  # stable: ties keep the library's order
        if not ranked:
            return None
        firsts = [ranked[0]]
        for c in ranked[1:]:
            if len(firsts) <= MAX_OTHERS and c.rule.lemma not in {o.rule.lemma for o in firsts}:
                firsts.append(c)
        chains = [_chain(c) for c in firsts]
        steps = iter(self._steps([c for chain in chains for c in chain]))
        found = [[next(steps) for _c in chain] for chain in chains]
        return Closest(goals[0], found[0], found[1:], len(top))

    def _steps(self, cands: list[Cand]) -> list[Step]:
        """Steps with the missing premises' arguments evaluated (`K - 1` becomes a number)."""
        literals: list[ast.AST | None] = []
        for c in cands:
            binding = c.bindings[c.shown] if c.bindings else {}
            missing = c.missing
            literals.append(substitute(missing.node, {k: term_ast(v) for k, v in binding.items()})
                            if missing is not None else None)
        facts = [f"arg_value({i},{j},{arg})." for i, node in enumerate(literals)
                 if node is not None and _sig_of(node) is not None
                 for j, arg in enumerate(_atom_args(node)) if not _has_var(arg)]
        values = {(int(i.value), int(j.value)): v  # type: ignore[call-overload]
                  for i, j, v in (self.probe.ask("\n".join(facts), "arg_value", 3) if facts else [])}
        steps = []
        for i, (c, node) in enumerate(zip(cands, literals)):
            sig = _sig_of(node) if node is not None else None
            args = [values.get((i, j)) for j in range(sig[1])] if sig else []
            texts = [a.text if a is not None else _fold(str(t)) for a, t in zip(args, _atom_args(node))] if sig else []
            shown = f"{sig[0]}({','.join(texts)})" if sig else (str(node) if node is not None else None)
            source = c.missing.text if c.missing is not None else None
            steps.append(Step(c.rule, c.matched, c.premises, shown, sig, args, texts, source))
        return steps


def find(facts: FactSet, node: str, extra_rule_dirs: list[Path] | None = None, program: str = "") -> Closest | None:
    """The closest lemma for sequential node `node` (an id as in the facts, `seq:...`), or None
    when no lemma about its op came near. `program`: rules the fixpoint was solved with besides
    the library (layer summaries), or the relations it derived, as facts.

    What was missing: preferably the relation of an output of a rank node paired with `node`
    (the rank computes the same op, and its result relates to nothing), else any relation of
    the node's output."""
    lib = library(extra_rule_dirs)
    probe = Probe(facts, extra_rule_dirs, program)
    n = quoted(node)
    rows = probe.ask("\n".join([
        f"closest_goal(1, So, M) :- pair({n}, M, _), pout({n}, M, _, So, To), not closest_related(So, To).",
        f"closest_goal(2, So, none) :- sout({n}, _, So).",
        "closest_related(So, To) :- rel(So, To, _).",
    ]), "closest_goal", 3)
    if not rows:
        return None
    kind = min(int(r[0].value) for r in rows)  # type: ignore[call-overload]
    chosen = sorted((r for r in rows if int(r[0].value) == kind), key=lambda r: (r[2].text, r[1].text))  # type: ignore[call-overload]
    goals = [Goal(s, None if m.text == "none" else m) for _k, s, m in chosen]
    return Search(lib, probe, node).run(goals)

