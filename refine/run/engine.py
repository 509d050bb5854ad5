"""The engine: facts + the lemma library (rules/*.lp) -> the fixpoint, via clingo.

The only module that imports clingo. The program is stratified Datalog, so grounding alone
computes the unique model; we solve once to read the shown atoms. Facts go in as one text
block through a single `Control.add` (clingo's C++ parser), never one Python call per atom.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import clingo

from refine.errors import InputError
from refine.lowering.facts import FactSet, quoted, to_clingo_lines
from refine.run.scales import unscaled_copies
from refine.run.window_seeds import window_seeds

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # (the refine package: the wheel ships rules/ as refine/rules)


LIBRARY_ENV = "REFINE_LIBRARY"
SCALE_ROUNDS = 3  # solves after the first that may add unscaled copies (refine/run/scales.py)
# solves that may add the window seeds a reduce-scatter asks for (rules/windows.lp window_need): one
# per layer of a chain whose backward scatters chunks (each layer's scatter is reached once the
# later layer's chunks exist), so a flat CP x TP training step of L layers per stage solves L + 1 times
WINDOW_ROUNDS = 16


def builtin_rules_dir() -> Path:
    """The shipped lemma library: inside the installed package, or the repo's rules/ folder; or
    the directory the REFINE_LIBRARY environment variable names (a rule author's library with a
    lemma left out, `refine rules without`, to see what `refine rules suggest` proposes instead)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        library = Path(override)
        if not library.is_dir() or not any(library.glob("*.lp")):
            raise InputError(library, f"{LIBRARY_ENV} does not name a directory of .lp rule files")
        return library
    for candidate in (_PACKAGE_DIR / "rules", _PACKAGE_DIR.parent / "rules"):
        if candidate.is_dir() and any(candidate.glob("*.lp")):
            return candidate
    raise RuntimeError("refine's lemma library (rules/*.lp) is missing from this installation")


def rule_files(extra_dirs: list[Path] | None = None) -> list[Path]:
    """All rule files: the built-in library, then every *.lp in the user's --rules dirs."""
    files = sorted(builtin_rules_dir().glob("*.lp"))
    for d in extra_dirs or []:
        if not d.is_dir():
            raise InputError(d, "not a directory of .lp rule files")
        found = sorted(d.glob("*.lp"))
        if not found:
            raise InputError(d, "contains no .lp rule files")
        files.extend(found)
    return files


Atom = tuple[object, ...]


@dataclass
class Derived:
    """The shown atoms of the fixpoint, by predicate name, as Python tuples."""

    atoms: dict[str, list[Atom]] = field(default_factory=lambda: defaultdict(list))
    raw: dict[str, list[tuple[str, ...]]] = field(default_factory=lambda: defaultdict(list))
    seconds: float = 0.0

    def get(self, name: str) -> list[Atom]:
        return self.atoms.get(name, [])


def _py(sym: clingo.Symbol) -> object:
    """A clingo symbol as Python: numbers -> int, strings and constants -> str,
    compound terms -> tuple (name, *args), e.g. sl(1,0,4) -> ("sl", 1, 0, 4)."""
    if sym.type == clingo.SymbolType.Number:
        return sym.number
    if sym.type == clingo.SymbolType.String:
        return sym.string
    if sym.type == clingo.SymbolType.Function and sym.arguments:
        return (sym.name, *(_py(a) for a in sym.arguments))
    if sym.type == clingo.SymbolType.Function:
        return sym.name
    return str(sym)


def _grounded(facts: FactSet, extra_rule_dirs: list[Path] | None, program: str,
              undefined: list[str] | None = None) -> clingo.Control:
    """A Control holding facts + `program` + the rules, ground (errors as one-line InputError).
    With `undefined`, clingo's infos about body atoms that no rule head, fact or `#defined`
    declares (a typo in a rule file: `pairr` for `pair`) are collected there, as clingo words them."""
    messages: list[str] = []

    def log(code: clingo.MessageCode, msg: str) -> None:
        (undefined if undefined is not None and code == clingo.MessageCode.AtomUndefined else messages).append(msg)

    warn = ["--warn=none"] if undefined is None else ["--warn=none", "--warn=atom-undefined"]
    ctl = clingo.Control(warn, logger=log, message_limit=5 if undefined is None else 10_000)
    try:
        ctl.add("base", [], "\n".join(to_clingo_lines(facts)))
    except RuntimeError:
        raise InputError(None, f"facts do not parse: {_first(messages)}") from None
    if program:
        try:
            ctl.add("base", [], program)
        except RuntimeError:
            raise InputError(None, f"generated rules do not parse: {_first(messages)}") from None
    for path in rule_files(extra_rule_dirs):
        try:
            ctl.load(str(path))
        except RuntimeError:
            raise InputError(path, f"cannot parse rule file: {_first(messages)}") from None
    try:
        ctl.ground([("base", [])])
    except RuntimeError:
        raise InputError(None, f"rules do not ground: {_first(messages)}") from None
    return ctl


def ground_rules(extra_rule_dirs: list[Path] | None = None) -> tuple[clingo.Control, list[str]]:
    """The rule files alone, ground without facts (decls.lp declares the fact predicates), for
    what the files themselves state (`handles/2`, op lists) and clingo's atom-undefined infos."""
    undefined: list[str] = []
    return _grounded(FactSet(), extra_rule_dirs, "", undefined), undefined


def solve(facts: FactSet, extra_rule_dirs: list[Path] | None = None, program: str = "",
          raw: frozenset[str] = frozenset()) -> Derived:
    """Ground facts + rules (+ `program`, generated rules such as layer summaries) to the
    fixpoint and return the shown atoms. Predicates named in `raw` are also kept with their
    arguments as clingo text, so that terms can be written back into a program verbatim."""
    start = time.perf_counter()
    derived = _solve_once(facts, extra_rule_dirs, program, raw)
    # Chunks a reduce-scatter hands out that no flow made exist (rules/windows.lp window_need):
    # solve again with those seeds as facts (given before grounding: the library stays stratified).
    seeded: set[tuple[str, ...]] = set()
    tensors: frozenset[str] | None = None
    for _ in range(WINDOW_ROUNDS):
        needs = derived.raw.get("window_need", [])
        if not needs:
            break
        tensors = tensors if tensors is not None else _seq_tensors(facts)
        seeds = window_seeds(needs, seeded, tensors)
        if not seeds:
            break
        program = "\n".join([program, *seeds])
        derived = _solve_once(facts, extra_rule_dirs, program, raw)
    # A scaled rank tensor stuck at an op linear in it: solve again with the op's unscaled copies
    # (refine/run/scales.py; facts given before grounding keep the library stratified).
    made: set = set()
    for _ in range(SCALE_ROUNDS):
        copies = unscaled_copies(facts, derived.get("rel"), made)
        if not copies:
            break
        program = "\n".join([program, *copies])
        derived = _solve_once(facts, extra_rule_dirs, program, raw)
    derived.seconds = time.perf_counter() - start
    return derived


def _seq_tensors(facts: FactSet) -> frozenset[str]:
    """The sequential program's tensors as clingo string literals (what a need names)."""
    return frozenset(quoted(str(row[-1])) for row in facts.rows["node_out"] if str(row[-1]).startswith("seq:"))


def _solve_once(facts: FactSet, extra_rule_dirs: list[Path] | None, program: str, raw: frozenset[str]) -> Derived:
    ctl = _grounded(facts, extra_rule_dirs, program)
    derived = Derived()
    raw = raw | {"window_need"}  # (its tensors written back as seeds: engine.solve)
    converted: dict[clingo.Symbol, object] = {}  # arguments repeat (tensors, layouts): convert each once

    def value(sym: clingo.Symbol) -> object:
        if sym not in converted:
            converted[sym] = _py(sym)
        return converted[sym]

    with ctl.solve(yield_=True) as handle:
        for model in handle:
            for sym in model.symbols(shown=True):
                args = sym.arguments
                derived.atoms[sym.name].append(tuple(value(a) for a in args))
                if sym.name in raw:
                    derived.raw[sym.name].append(tuple(str(a) for a in args))
            break
    return derived


def _first(messages: list[str]) -> str:
    return " ".join(messages[0].split()) if messages else "unknown error"


@dataclass(frozen=True)
class Term:
    """A clingo term as both Python (`value`, as `solve` gives it) and clingo text (`text`, to
    write it back into a rule); `args` holds the parts of a tuple or compound term."""

    text: str
    value: object
    args: tuple[Term, ...] = ()


def _term(sym: clingo.Symbol) -> Term:
    args = tuple(_term(a) for a in sym.arguments) if sym.type == clingo.SymbolType.Function else ()
    return Term(str(sym), _py(sym), args)


class Probe:
    """The fixpoint kept open for follow-up questions (clingo multi-shot): rules added by `ask`
    are ground against the atoms already derived, so an explanation can ask about atoms the
    report does not show (pair/3, helper predicates) without grounding the program again per
    question. Only refine/diagnose/closest.py uses it, after a failed proof."""

    def __init__(self, facts: FactSet, extra_rule_dirs: list[Path] | None = None, program: str = "") -> None:
        self._ctl = _grounded(facts, extra_rule_dirs, program)  # errors: InputError
        self._parts = 0

    def ask(self, rules: str, name: str, arity: int) -> list[tuple[Term, ...]]:
        """Add `rules` (which must not define atoms derived before) and return the arguments of
        every true atom name/arity. The library is stratified, so grounding decides every atom:
        the true ones are facts, and no solve is needed. Raises RuntimeError if the rules do
        not parse or ground."""
        self._parts += 1
        part = f"probe{self._parts}"
        self._ctl.add(part, [], rules)
        self._ctl.ground([(part, [])])
        return [tuple(_term(a) for a in atom.symbol.arguments)
                for atom in self._ctl.symbolic_atoms.by_signature(name, arity) if atom.is_fact]
