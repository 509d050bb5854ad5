"""Is a rule library stratified? Negations and aggregates inside a recursion, found statically.

The lemma library must stay stratified (docs/rules.md): every `not p` and every aggregate
(`#count`, `#sum`, ...) must read predicates that are complete before the rule's own recursion
runs. clingo accepts an unstratified program, but it cannot settle such atoms while grounding:
the ground program grows with every rule instance on the cycle (a negation over `pair/3` once
grew the 405B step's by a sixth) and its solving is a search. Nothing in the answers shows it,
so this check reads the rule files: the predicate dependency graph (head <- body predicate,
marked when the body literal is negated or inside an aggregate or a condition), its strongly
connected components, and every marked edge whose two ends share a component.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from clingo import ast

Predicate = tuple[str, int]  # (name, arity)


@dataclass(frozen=True)
class NegativeCycle:
    """A rule whose head and a negated (or aggregated) body predicate depend on each other."""

    path: Path
    line: int
    head: Predicate
    body: Predicate

    def __str__(self) -> str:
        return (f"{self.path.name}:{self.line}: {self.head[0]}/{self.head[1]} reads "
                f"{self.body[0]}/{self.body[1]} under a negation or an aggregate, inside their recursion")


def _atoms(node: ast.AST) -> list[Predicate]:
    """Every predicate of a symbolic atom under `node` (terms are not walked)."""
    found: list[Predicate] = []

    def walk(n: object) -> None:
        if not isinstance(n, ast.AST):
            return
        if n.ast_type == ast.ASTType.SymbolicAtom:
            term = n.symbol
            if term.ast_type == ast.ASTType.Function:
                found.append((term.name, len(term.arguments)))
            elif term.ast_type == ast.ASTType.Pool:
                found.extend((f.name, len(f.arguments)) for f in term.arguments if f.ast_type == ast.ASTType.Function)
            return
        for key in n.child_keys:
            child = getattr(n, key)
            for c in (child if isinstance(child, (list, ast.ASTSequence)) else [child]):
                walk(c)

    walk(node)
    return found


def _edges(files: Iterable[Path]) -> list[tuple[Path, int, Predicate, Predicate, bool]]:
    """(file, line, head, body predicate, negative or aggregated) for every rule of `files`."""
    edges: list[tuple[Path, int, Predicate, Predicate, bool]] = []
    for path in files:
        def on_statement(stm: ast.AST, path: Path = path) -> None:
            if stm.ast_type != ast.ASTType.Rule:
                return
            heads = _atoms(stm.head)
            line = stm.location.begin.line
            for lit in stm.body:
                if lit.ast_type == ast.ASTType.Literal and lit.atom.ast_type == ast.ASTType.SymbolicAtom:
                    marked = lit.sign != ast.Sign.NoSign
                else:  # an aggregate, a conditional literal, a comparison (no atoms)
                    marked = True
                for body in _atoms(lit):
                    edges.extend((path, line, head, body, marked) for head in heads)

        ast.parse_files([str(path)], on_statement)
    return edges


def _components(graph: dict[Predicate, set[Predicate]]) -> dict[Predicate, int]:
    """Strongly connected components (Tarjan, iterative): predicate -> component id."""
    index: dict[Predicate, int] = {}
    low: dict[Predicate, int] = {}
    stack: list[Predicate] = []
    on_stack: set[Predicate] = set()
    comp: dict[Predicate, int] = {}
    counter = 0
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp[w] = index[v]
                    if w == v:
                        break
    return comp


def negative_cycles(files: Iterable[Path]) -> list[NegativeCycle]:
    """Every rule of `files` that negates or aggregates over a predicate of its own recursion."""
    edges = _edges(list(files))
    graph: dict[Predicate, set[Predicate]] = defaultdict(set)
    for _path, _line, head, body, _marked in edges:
        graph[head].add(body)  # (head depends on body)
        graph[body]
    comp = _components(graph)
    found = {NegativeCycle(path, line, head, body) for path, line, head, body, marked in edges
             if marked and comp[head] == comp[body]}
    return sorted(found, key=lambda c: (c.path.name, c.line, c.head, c.body))
