"""Checking lemmas on numbers: a rule author's lemmas before they are trusted, and the relations
they derived in a real verification (defence in depth).

A lemma is a claim about values; `refine/diagnose/witness.py` checks every derived relation against one
multi-rank simulation. Two uses here:

- `check_rules(DIR)` (`refine rules check DIR`): for every op the lemmas of DIR mention,
  generated instances (the op on random shapes, on the sequential side and on every rank, with
  its float inputs declared in every combination of replicated, sharded on each axis and partial
  sums), plus any example model directory the author put in DIR (a subdirectory holding
  refine.json), each solved with DIR's lemmas and checked on the simulator. Every relation that
  does not hold is a violation, saved as a model directory to debug with `refine verify --rules`.
- `check_derived(...)` (`refine verify --rules`): the relations of the model itself, on its own
  shapes, so that a user lemma cannot turn a bug into "verified" unseen.

Both use the witness-case machinery the project's own lemma tests use (refine/kit/cases.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from refine.kit import rulebook
from refine.kit.cases import OPSET, Case, Graph, partial, rep, run_case, shard, solve_and_check
from refine.config import CONFIG_NAME
from refine.kit.stratification import negative_cycles
from refine.run.engine import Derived, rule_files
from refine.errors import InputError
from refine.report.schema import LemmaTally, RuleCheck, RuleViolation
from refine.lowering.load import load_model_dir
from refine.diagnose.simulate import SimulationError

WORLDS = (2, 3)
MAX_LAYOUT_COMBINATIONS = 24  # per op, world and seed (sampled when there are more)
FLOAT_TYPE = "tensor(float)"


# --- what the lemmas of a directory are about -------------------------------------------------


def user_lemmas(rule_dirs: list[Path]) -> tuple[set[str], list[str]]:
    """(the lemma names the rule files of `rule_dirs` derive, the standard ONNX ops those lemmas
    handle: the ones to make instances of), from refine/kit/rulebook.py's inventory."""
    mine = [lemma for lemma in rulebook.inventory(rule_dirs).lemmas if lemma.user]
    ops = {op for lemma in mine for op in lemma.ops if onnx.defs.has(op)}
    return {lemma.name for lemma in mine}, sorted(ops)


# --- generated instances -------------------------------------------------------------------------


class Unsupported(Exception):
    """The generator cannot make an instance of this op (an author may add an example model)."""


def _instance_plan(op: str, ndim: int, rng: np.random.Generator) -> tuple[list[str], dict[str, object], dict[int, int]]:
    """(kind of each input: 'float' | 'axis', attributes, scalar axis inputs) for `op` on
    float tensors of rank `ndim`: float inputs where the op takes floats, an axis value where it
    takes an integer axis, required attributes only when they are axes."""
    schema = onnx.defs.get_schema(op, OPSET)
    types = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    kinds: list[str] = []
    axis_inputs: dict[int, int] = {}
    for i, formal in enumerate(schema.inputs):
        optional = formal.option == onnx.defs.OpSchema.FormalParameterOption.Optional
        allowed = types.get(formal.type_str, {formal.type_str})
        if FLOAT_TYPE in allowed:
            count = 2 if formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic else 1
            kinds += ["float"] * count
        elif "axis" in formal.name.lower() and allowed & {"tensor(int64)", "tensor(int32)"}:
            axis_inputs[len(kinds)] = int(rng.integers(-ndim, ndim))
            kinds.append("axis")
        elif optional:
            break  # later inputs would need this one's slot
        else:
            raise Unsupported(f"{op}: input {formal.name!r} is neither a float tensor nor an axis")
    attrs: dict[str, object] = {}
    for name, attr in schema.attributes.items():
        is_axis = "axis" in name.lower() and attr.type == onnx.defs.OpSchema.AttrType.INT
        if attr.required and not is_axis:
            raise Unsupported(f"{op}: required attribute {name!r} is not an axis")
        if is_axis:
            attrs[name] = int(rng.integers(-ndim, ndim))
    if "float" not in kinds:
        raise Unsupported(f"{op}: no float input")
    return kinds, attrs, axis_inputs


def _layouts(ndim: int) -> list[dict]:
    return [rep(), *(shard(a) for a in range(ndim)), partial()]


def generated_cases(op: str, world: int, seed: int) -> Iterator[Case]:
    """Instances of `op`: float inputs of one random shape (every axis divisible by `world`),
    declared in every combination of layouts (sampled), the same op and attributes on every side."""
    rng = np.random.default_rng([seed, world, *op.encode()])
    ndim = 3
    kinds, attrs, axis_inputs = _instance_plan(op, ndim, rng)
    shape = [world * int(rng.integers(1, 3)) for _ in range(ndim)]
    floats = [i for i, k in enumerate(kinds) if k == "float"]
    combos = list(itertools.product(_layouts(ndim), repeat=len(floats)))
    if len(combos) > MAX_LAYOUT_COMBINATIONS:
        picks = rng.choice(len(combos), size=MAX_LAYOUT_COMBINATIONS, replace=False)
        combos = [combos[int(k)] for k in sorted(picks)]
    for k, combo in enumerate(combos):
        layouts = {f"x{i}": lay for i, lay in zip(floats, combo)}

        def side(r: int | None) -> Graph:
            g = Graph()
            args = []
            for i, kind in enumerate(kinds):
                if kind == "axis":
                    args.append(g.ints(axis_inputs[i]))
                    continue
                lay = layouts[f"x{i}"]
                local = list(shape)
                if r is not None and lay["layout"] == "shard":
                    local[lay["axis"]] //= world
                args.append(g.input(f"x{i}", local, TensorProto.FLOAT))
            schema = onnx.defs.get_schema(op, OPSET)
            outs = g.op_n(op, *args, outputs=max(1, schema.min_output), **attrs)
            for o in outs:
                g.output(o)
            return g

        words = ", ".join(f"x{i} {_layout_words(lay)}" for i, lay in zip(floats, combo))
        yield Case(f"{op} world {world} seed {seed} #{k}: {words}", side(None), [side(r) for r in range(world)],
                   layouts)


def _layout_words(layout: dict) -> str:
    kind = layout["layout"]
    return f"shard axis {layout['axis']}" if kind == "shard" else kind


# --- checking ------------------------------------------------------------------------------------


class _Tally:
    """Accumulates what the instances showed, per lemma."""

    def __init__(self, lemmas: set[str], save_dir: Path | None) -> None:
        self.lemmas = lemmas
        self.save_dir = save_dir
        self.fired: Counter[str] = Counter()
        self.held: Counter[str] = Counter()
        self.violated: Counter[str] = Counter()
        self.violations: list[RuleViolation] = []
        self.instances = 0
        self.checked = 0
        self.saved = 0

    def add(self, name: str, derived: Derived, checked, case: Case | None) -> None:
        self.instances += 1
        self.checked += checked.checked
        derived_by = Counter(str(lemma) for *_, lemma in derived.get("rel_by") if str(lemma) in self.lemmas)
        self.fired.update(derived_by.keys())
        bad = Counter(lm for v in checked.violations for lm in set(v.lemmas) & self.lemmas)
        self.violated.update(bad)
        for lemma, total in derived_by.items():
            self.held[lemma] += max(0, total - bad[lemma])
        saved = None
        if checked.violations and case is not None and self.save_dir is not None:
            self.saved += 1
            saved = str(case.save(self.save_dir / f"instance-{self.saved}"))
        # the user's lemmas' own relations first, then what other lemmas derived from them
        for v in sorted(checked.violations, key=lambda v: not set(v.lemmas) & self.lemmas):
            self.violations.append(RuleViolation(
                seq_tensor=v.seq_tensor, rank_tensors=v.rank_tensors, layout=v.layout, lemmas=v.lemmas,
                max_abs_error=v.max_abs_error if np.isfinite(v.max_abs_error) else 1e308, instance=name, saved=saved))

    def result(self, unsupported: list[str]) -> RuleCheck:
        tallies = [LemmaTally(lemma=lm, fired=self.fired[lm], held=self.held[lm], violated=self.violated[lm])
                   for lm in sorted(self.lemmas)]
        silent = sorted(lm for lm in self.lemmas if not self.fired[lm])
        status = "violated" if self.violations else "held"
        if self.violations:
            culprits = sorted({lm for v in self.violations for lm in v.lemmas if lm in self.lemmas}) or \
                sorted({lm for v in self.violations for lm in v.lemmas})
            summary = (f"{len(self.violations)} derived relation(s) do not hold on the numbers, derived by "
                       f"{', '.join(culprits)}")
        else:
            summary = f"every one of {self.checked} derived relations held on {self.instances} instance(s)"
        return RuleCheck(status=status, summary=summary, instances=self.instances, checked=self.checked,
                         lemmas=tallies, violations=self.violations, not_exercised=silent, unsupported_ops=unsupported)


def check_rules(rule_dir: Path, seeds: tuple[int, ...] = (0, 1), save_dir: Path | None = None) -> RuleCheck:
    """`refine rules check DIR`: the lemmas of DIR on generated instances of the ops they
    mention and on DIR's example model directories."""
    rules = [rule_dir]
    lemmas, ops = user_lemmas(rules)
    if not lemmas:
        raise InputError(rule_dir, "no lemma here: no rule `rel_by(..., name) :- ...` in its .lp files")
    tally = _Tally(lemmas, save_dir)
    unsupported = []
    for op in ops:
        try:
            cases = [c for world in WORLDS for seed in seeds for c in generated_cases(op, world, seed)]
        except Unsupported as exc:
            unsupported.append(str(exc))
            continue
        for case in cases:
            try:
                out = run_case(case, seed=0, rules=rules)
            except (SimulationError, ValueError, InputError) as exc:  # an input the simulator cannot take, or
                unsupported.append(f"{op}: {case.name}: {exc}")            # layouts whose local shapes do not broadcast
                continue
            tally.add(case.name, out.derived, out.checked, case)
    for example in sorted(p.parent for p in rule_dir.glob(f"*/{CONFIG_NAME}")):
        for seed in seeds:
            derived, checked = _check_model_dir(example, rules, seed)
            tally.add(f"example {example.name} seed {seed}", derived, checked, None)
    result = tally.result(unsupported)
    user_files = {path.resolve() for path in rule_dir.glob("*.lp")}
    result.unstratified = [str(c) for c in negative_cycles(rule_files(rules)) if c.path.resolve() in user_files]
    return result


def _check_model_dir(model_dir: Path, rules: list[Path], seed: int, derived: Derived | None = None):
    """A model directory's flat program solved with `rules` (unless `derived` is its fixpoint
    already), checked on one simulation: (fixpoint, check)."""
    _facts, derived, checked = solve_and_check(load_model_dir(model_dir), seed, rules, derived)
    return derived, checked


def check_derived(model_dir: Path, rules: list[Path], seed: int = 0, derived: Derived | None = None) -> RuleCheck:
    """verify's defence in depth: every relation derived on the model itself (flat, with the user's
    lemmas; `derived` when the verification already solved the flat program) checked on one
    simulation at the model's own shapes."""
    lemmas, _ops = user_lemmas(rules)
    tally = _Tally(lemmas, None)
    try:
        derived, checked = _check_model_dir(model_dir, rules, seed, derived)
    except (SimulationError, ValueError, MemoryError) as exc:
        return RuleCheck(status="not_run", summary=f"the user lemmas could not be checked on the numbers: {exc}")
    tally.add(model_dir.name, derived, checked, None)
    return tally.result([])
