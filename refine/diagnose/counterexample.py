"""Counterexamples: after a failed proof, run the programs and look for a numeric witness.

The lemmas proving nothing is not evidence of a bug (the library may lack a lemma). This module
decides between `refuted` and `unproven` by simulation (refine/diagnose/simulate.py): the sequential
model and every rank program run on random inputs that satisfy the declared input relations
(`make_feeds`), for a couple of seeds. The verdict becomes `refuted` only with a witness:

- some sequential OUTPUT that no reconstruction from the ranks' same-named outputs matches,
  by the output rule the lemmas follow too (docs/model-dir.md): an output refine.json declares
  has one candidate, its declared layout; any other output, only candidates in which every
  rank that has it takes part (a replica on all of them, their concatenation in rank order or
  as windows covering an axis in any order, an interleaving of equal blocks, their sum or
  max). A match is max |a - b| <= tolerance * max(1, max |expected|), the tolerance of the
  float formats the programs round to (refine/precision.py). The report then gives
  max abs/rel error, a few coordinates, and the values at the report's failing node; or
- the programs cannot run together: a mismatched collective call (members disagree on the op,
  attributes, dtype or shape) or a deadlock detected as such (every unfinished rank blocked).
  Both would fail or hang the real job: they are bugs.

Everything else stays `unproven`, and the report says which: every output reconstructs on
every seed ("no lemma applies", a gap in the lemma library, never called a bug); or the
check is inconclusive (a rank failed for another reason, e.g. an op the reference evaluator
lacks, a timeout, non-static shapes; or some input has no declared relation, so a mismatch
could come from the values made up for it).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refine import layouts
from refine.run.engine import Derived
from refine.config import Layout, ModelConfig, PartialLayout, RepLayout, ShardLayout, ShardThen, shard_indices
from refine.lowering.facts import FactSet
from refine.lowering.load import load_model_dir
from refine.lowering.program import Program
from refine.precision import FLOAT32_TOLERANCE, tolerance
from refine.report.render import rank_tensors_text
from refine.report.schema import CandidateResult, Coordinate, NumericCheck, Report, ValueComparison
from refine.diagnose.simulate import (
    COUNT_MISMATCH,
    SimResult,
    SimulationError,
    make_feeds,
    place_shards,
    rebuild_two_dim,
    run_programs,
)

SEEDS = (0, 1)
REFUTING = ("counterexample", "program_error")  # numeric statuses that make the verdict `refuted`
SIM_MEMORY_GIB = 4.0  # default cap on what the simulator may hold (`--sim-memory`)
TOLERANCE = FLOAT32_TOLERANCE  # (programs that round to a 16-bit float: refine/precision.py)
SIMULATE_LIMIT = 1 << 28  # elements of the sequential program's inputs (1 GiB of float32) we simulate at most
MAX_CANDIDATES = 4096
MAX_INTERLEAVE_SPLITS = 16
MAX_WINDOW_AXIS = 4096  # longest axis the windows candidate slides along


@dataclass
class _Candidate:
    text: str
    value: np.ndarray


def attach(report: Report, model_dir: Path, facts: FactSet, derived: Derived,
           seeds: tuple[int, ...] = SEEDS, timeout: float | None = None) -> Report:
    """The report with its numeric check, and `refuted` if the check found a witness; where
    the numbers rebuild every output, without a plain-words diagnosis (no bug to name).

    A verified report is returned as it is (nothing to refute).
    """
    if report.verdict == "verified":
        return report
    num = check_numbers(report, Path(model_dir), facts, derived, seeds, timeout)
    verdict = "refuted" if num.status in REFUTING else report.verdict
    update: dict[str, object] = {"numeric": num, "verdict": verdict}
    if num.status == "agrees":  # the numbers show no bug: no bug class is named (the words are only a pattern)
        update["diagnosis"] = None
    return report.model_copy(update=update)


_ITEMSIZE = {"double": 8, "int64": 8, "uint64": 8, "float": 4, "int32": 4, "uint32": 4, "float16": 2,
             "bfloat16": 2, "int16": 2, "uint16": 2, "int8": 1, "uint8": 1, "bool": 1}


def _tensor_bytes(facts: FactSet) -> int:
    """Bytes of every tensor of these facts, at their inferred shapes."""
    sizes: dict[str, int] = defaultdict(lambda: 1)
    for _g, t, _axis, size in facts.rows["dim"]:
        sizes[str(t)] *= max(int(size), 1)
    for _g, t, _rank in facts.rows["ndim"]:
        sizes.setdefault(str(t), 1)
    itemsize = {str(t): _ITEMSIZE.get(str(ty), 4) for _g, t, ty in facts.rows["dtype"]}
    return sum(n * itemsize.get(t, 4) for t, n in sizes.items())


def simulation_bytes(program: Program) -> int:
    """About what the simulator holds: every value of every program (it keeps them all, to
    compare at the failing node), a layer's body once per call."""
    from refine.run.memo import sites_of

    per_template = {name: _tensor_bytes(facts) for name, facts in program.templates.items()}
    return _tensor_bytes(program.main) + sum(per_template.get(site.template, 0) for site in sites_of(program.main))


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.3g} GiB"


def over_memory(needed: int, limit_gib: float) -> NumericCheck | None:
    """`not_run` if simulating needs more than `limit_gib` (the `--sim-memory` cap)."""
    if needed <= limit_gib * (1 << 30):
        return None
    return not_run(f"the simulation would hold about {_gib(needed)} of values, more than the {_gib(limit_gib * (1 << 30))} "
                   "--sim-memory allows: no numeric search (raise --sim-memory, or export a smaller config of the "
                   "same model to get a counterexample)")


def not_run(summary: str) -> NumericCheck:
    return NumericCheck(status="not_run", summary=summary)


# --- the check ------------------------------------------------------------------------------


_PROGRAM_ERRORS = ("mismatched collective", "deadlock")


_OUT_OF_RANGE = re.compile(r"rank (\d+) failed: IndexError: (index -?\d+ is out of bounds for axis \d+ with size \d+)")


def _out_of_range(message: str) -> re.Match[str] | None:
    """A rank's gather at an index past its axis (numpy's words, from the reference evaluator's
    Gather and GatherElements), after the sequential program ran on the same inputs: ONNX and
    torch both refuse such an index, so the rank program itself fails there (a loss taking the
    labels into a vocabulary shard, a table cut without its ids offset)."""
    return _OUT_OF_RANGE.search(message)


def _is_program_error(message: str) -> bool:
    """Simulation failures that are the programs' fault whatever the input values: collective
    calls the members disagree on, and a deadlock detected as such (not a timeout)."""
    return message.startswith(_PROGRAM_ERRORS) and "timed out" not in message


def check_numbers(report: Report, model_dir: Path, facts: FactSet, derived: Derived,
                  seeds: tuple[int, ...] = SEEDS, timeout: float | None = None) -> NumericCheck:
    start = time.perf_counter()
    try:
        num = _check(report, model_dir, facts, derived, seeds, timeout)
    except MemoryError as exc:
        num = NumericCheck(status="inconclusive", seeds=list(seeds), tolerance=TOLERANCE,
                           summary=f"the simulation ran out of memory ({exc}); no counterexample, the verdict "
                                   "stays unproven (lower --sim-memory to skip such models sooner)")
    except Exception as exc:  # noqa: BLE001 - the check must never take the verdict down
        num = NumericCheck(status="inconclusive", seeds=list(seeds), tolerance=TOLERANCE,
                           summary=f"the numeric check itself failed ({type(exc).__name__}: {exc}); "
                                   "no counterexample, the verdict stays unproven")
    num.seconds = round(time.perf_counter() - start, 4)
    return num


def _input_elements(model) -> int:
    """Elements of a program's graph inputs and initializers (weights declared without data
    are typed inputs: a `--meta` export of a large model)."""
    total = sum(int(np.prod(i.dims, dtype=np.int64)) for i in model.graph.initializer)
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        total += int(np.prod([d.dim_value if d.HasField("dim_value") else 1 for d in dims], dtype=np.int64))
    return total


def _check(report: Report, model_dir: Path, facts: FactSet, derived: Derived,
           seeds: tuple[int, ...], timeout: float | None) -> NumericCheck:
    loaded = load_model_dir(model_dir)
    tol = tolerance([loaded.seq, *loaded.ranks])
    elements = _input_elements(loaded.seq)
    if elements > SIMULATE_LIMIT:
        return not_run(f"the sequential program's inputs hold {elements:,} elements, more than the "
                       f"{SIMULATE_LIMIT:,} the reference executor simulates: no numeric search (export a "
                       "smaller config of the same model to get a counterexample)")
    free = _free_inputs(loaded)
    guessed = sorted(set(report.unrelated_inputs) | set(free))
    agreed: list[str] = []
    for seed in seeds:
        try:
            seq_feeds, rank_feeds = make_feeds(loaded.seq, loaded.ranks, loaded.config, np.random.default_rng(seed))
            sim = run_programs(loaded.seq, loaded.ranks, seq_feeds, rank_feeds, timeout=timeout)
        except SimulationError as exc:
            message = " ".join(str(exc).split())
            on_values = message.startswith(COUNT_MISMATCH)  # (AllToAllV's counts are values: they disagree on these inputs)
            if _is_program_error(message) and on_values and guessed:
                return NumericCheck(
                    status="inconclusive", seeds=list(seeds), seed=seed, tolerance=tol, simulation_error=message,
                    summary=f"the rank programs' {message.split(':', 1)[0]}, but inputs {', '.join(guessed)} have no "
                            "declared relation (they got made-up values, and the counts are computed from values), so "
                            "this is not a counterexample; declare them in refine.json")
            if _is_program_error(message):
                return NumericCheck(
                    status="program_error", seeds=list(seeds), seed=seed, tolerance=tol, simulation_error=message,
                    summary="the rank programs cannot run together: " + message.split(":", 1)[0]
                            + (" (on inputs satisfying the declared relations: a real job would fail here)" if on_values
                               else " (a real job would fail or hang here whatever the input values)"))
            out_of_range = _out_of_range(message)
            if out_of_range is not None and not guessed:
                return NumericCheck(
                    status="program_error", seeds=list(seeds), seed=seed, tolerance=tol, simulation_error=message,
                    summary=f"rank {out_of_range.group(1)} cannot run on inputs satisfying the declared relations, on "
                            f"which the sequential model runs: a gather's {out_of_range.group(2)} (a real job would "
                            "fail here)")
            return NumericCheck(
                status="inconclusive", seeds=list(seeds), seed=seed, tolerance=tol, simulation_error=message,
                summary="the simulation could not run, so there is no counterexample (this may be a limit of the "
                        "reference evaluator rather than a bug); the verdict stays unproven")
        except ValueError as exc:
            return NumericCheck(status="inconclusive", seeds=list(seeds), tolerance=tol,
                                simulation_error=str(exc), summary=f"cannot make inputs: {exc}")
        for name, cmp in _compare_outputs(loaded, sim, tol):
            if cmp.matches:
                if seed == seeds[0] and cmp.best is not None:
                    agreed.append(f"{name} = {cmp.best.candidate}")
                continue
            if guessed:
                return NumericCheck(
                    status="inconclusive", seeds=list(seeds), seed=seed, tolerance=tol, output=cmp,
                    summary=f"output {name} does not match the ranks numerically, but inputs "
                            f"{', '.join(guessed)} have no declared relation (they got made-up values), so this "
                            "is not a counterexample; declare them in refine.json")
            at_node = _at_node(report, facts, derived, sim, tol)
            err = cmp.best.max_abs_error if cmp.best is not None else None
            detail = (f"best {cmp.best.candidate}, max abs error {err:.3g}" if err is not None
                      else f"no candidate even has its shape {cmp.shape}")
            return NumericCheck(
                status="counterexample", seeds=list(seeds), seed=seed, tolerance=tol, output=cmp, at_node=at_node,
                summary=f"on inputs satisfying the declared relations, no reconstruction of output {name} from the "
                        f"ranks' outputs matches ({detail})")
    how = "; ".join(agreed[:4]) + (f"; ... {len(agreed) - 4} more" if len(agreed) > 4 else "")
    return NumericCheck(
        status="agrees", seeds=list(seeds), tolerance=tol,
        summary=f"every output is rebuilt numerically on seeds {', '.join(map(str, seeds))} ({how}): "
                "not a known bug; no lemma applies, so the lemma library needs one (the verdict stays unproven): "
                f"`refine rules suggest {model_dir}` proposes one from the numbers")


def _free_inputs(loaded) -> list[str]:
    """Rank inputs that get made-up values: neither declared nor a same-named, same-shaped
    sequential input (which make_feeds replicates)."""
    declared = set(loaded.config.inputs)
    inits = {i.name for i in loaded.seq.graph.initializer}
    seq_inputs = {vi.name: _sig(vi) for vi in loaded.seq.graph.input if vi.name not in inits}
    free = []
    for model in loaded.ranks:
        rank_inits = {i.name for i in model.graph.initializer}
        for vi in model.graph.input:
            if vi.name in declared or vi.name in rank_inits:
                continue
            if seq_inputs.get(vi.name) != _sig(vi) and vi.name not in free:
                free.append(vi.name)
    return free


def _sig(vi) -> tuple:
    tt = vi.type.tensor_type
    return tt.elem_type, tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)


# --- comparing ------------------------------------------------------------------------------


def _compare_outputs(loaded, sim: SimResult, tol: float) -> Iterator[tuple[str, ValueComparison]]:
    """Every sequential output against the reconstructions the output rule allows
    (docs/model-dir.md): its declared layout only; or, undeclared, those in which every rank
    that has an output of that name takes part."""
    rank_outputs = [{vi.name for vi in m.graph.output} for m in loaded.ranks]
    for vi in loaded.seq.graph.output:
        if vi.name not in sim.seq:
            continue
        expected = np.asarray(sim.seq[vi.name])
        own = [(f"r{r}:{vi.name}", np.asarray(sim.ranks[r][vi.name])) for r, names in enumerate(rank_outputs)
               if vi.name in names and vi.name in sim.ranks[r]]
        layout = loaded.config.outputs.get(vi.name)
        candidates = _declared_candidates(layout, expected, own, loaded.config) if layout is not None \
            else _every_rank_candidates(expected, own, loaded.config)
        yield vi.name, _score(vi.name, expected, candidates, tol)


def _declared_candidates(layout: Layout, expected: np.ndarray, own: list[tuple[str, np.ndarray]],
                         config: ModelConfig) -> Iterator[_Candidate]:
    """The one reconstruction a declared output layout allows (refine.json `outputs`). A shard
    `over` a mesh dim is one concatenation per line of ranks along that dim, each of which must
    be the output: the line that fits worst stands for them (its error shows)."""
    if isinstance(layout, (ShardLayout, PartialLayout)) and layout.then is not None:  # two-dim: each plane of ranks
        held = {r: item for r, item in enumerate(own)} if len(own) == config.world_size else {}
        try:
            rebuilt = rebuild_two_dim(layout, {r: v for r, (_label, v) in held.items()}, config)
        except ValueError:
            return
        first = f"axis {layout.axis} over {layout.over}" if isinstance(layout, ShardLayout) else f"{layout.op} over {layout.over}"
        fits = [_Candidate(f"blocks({rank_tensors_text([held[r][0] for r in ranks])}, {first}, "
                           f"axis {layout.then.axis} over {layout.then.over})", value)
                for ranks, value in rebuilt if value.shape == expected.shape]
        if fits:
            yield max(fits, key=lambda c: _errors(expected, c.value)[0])
        return
    if isinstance(layout, PartialLayout) and layout.over is not None and config.mesh is not None \
            and len(own) == config.world_size and all(v.shape == expected.shape for _label, v in own):
        sums: dict[tuple, list[np.ndarray]] = defaultdict(list)  # one sum per line of ranks along the dim
        for r, (_label, v) in enumerate(own):
            sums[tuple(c for dim, c in config.mesh.coordinates(r).items() if dim != layout.over)].append(v)
        totals = [np.stack([v.astype(np.float64) for v in line]).sum(axis=0) for line in sums.values()]
        yield _Candidate(f"sum over {layout.over} ({rank_tensors_text([label for label, _v in own])})",
                         max(totals, key=lambda value: _errors(expected, value)[0]))
        return
    if isinstance(layout, ShardLayout) and layout.over is not None and len(own) == config.world_size:
        lines: dict[tuple, list[tuple[int, tuple[str, np.ndarray]]]] = defaultdict(list)
        for r, item in enumerate(own):
            coords = config.mesh.coordinates(r) if config.mesh is not None else {}
            lines[tuple(c for dim, c in coords.items() if dim != layout.over)].append((config.split_of(layout, r)[0], item))
        plain = layout.model_copy(update={"over": None})
        fits = [candidate for line in lines.values()
                for candidate in _declared_candidates(plain, expected, [item for _k, item in sorted(line, key=lambda e: e[0])], config)]
        if fits:
            yield max(fits, key=lambda c: _errors(expected, c.value)[0] if c.value.shape == expected.shape else np.inf)
        return
    labels = rank_tensors_text([label for label, _v in own])
    vals = [v for _label, v in own]
    if isinstance(layout, RepLayout):
        yield _replica_on_all(expected, own)
    elif isinstance(layout, PartialLayout):
        if all(v.shape == expected.shape for v in vals):
            wide = np.stack([v.astype(np.float64) for v in vals])
            value = wide.sum(axis=0) if layout.op == "sum" else wide.max(axis=0)
            yield _Candidate(f"{layout.op}({labels}), as declared", value)
    elif expected.ndim and -expected.ndim <= layout.axis < expected.ndim:
        axis = layout.axis % expected.ndim
        try:
            indices = shard_indices(layout, expected.shape[axis], len(vals))
        except ValueError:
            return
        if all(v.ndim == expected.ndim and v.shape[axis] == len(idx) for v, idx in zip(vals, indices)) \
                and len({v.shape[:axis] + v.shape[axis + 1:] for v in vals}) == 1:
            how = f"concat({labels}, axis={axis})" if (layout.stride or 1) == 1 else \
                f"interleave({labels}, axis={axis}, stride={layout.stride})"
            yield _Candidate(f"{how}, as declared", place_shards(layout, vals))


def _every_rank_candidates(expected: np.ndarray, own: list[tuple[str, np.ndarray]],
                           config: ModelConfig | None = None) -> Iterator[_Candidate]:
    """Reconstructions of an undeclared output in which every same-named rank output takes
    part: a replica on all of them, a concatenation, windows covering an axis, an interleaving,
    their sum or their max; on a mesh of several dims, the two-dim layouts too (`_two_dim_candidates`)."""
    if not own:
        return
    yield _replica_on_all(expected, own)
    if len(own) < 2:
        return
    yield from _candidates(expected.shape, [[] for _ in own], [own], chunks=False)
    for axis in range(expected.ndim):
        windows = _windows(expected, own, axis)
        if windows is not None:
            yield windows
    if config is not None:
        yield from _two_dim_candidates(expected, own, config)
        yield from _line_candidates(expected, own, config)


def _line_candidates(expected: np.ndarray, own: list[tuple[str, np.ndarray]], config: ModelConfig) -> Iterator[_Candidate]:
    """On a mesh, with a block of ranks holding the output (a pipeline stage's ranks: some
    coordinates fixed, every coordinate of the others): per mesh dim, a concatenation along an
    axis, or a sum, of each complete line of holders along that dim (in coordinate order), every
    line's the output (a gradient sharded over tp, the same on every dp row): the line that fits
    worst stands for them. With every rank holding it, `_two_dim_candidates` has these."""
    mesh = config.mesh
    if mesh is None or len(mesh.dims) < 2 or len(own) >= config.world_size or len(own) < 2 or not expected.ndim:
        return
    ranks = [int(label.split(":", 1)[0][1:]) for label, _v in own]
    for dim, size in zip(mesh.dims, mesh.shape):
        lines: dict[tuple, list[tuple[int, tuple[str, np.ndarray]]]] = defaultdict(list)
        for r, item in zip(ranks, own):
            coords = mesh.coordinates(r)
            lines[tuple(c for d, c in coords.items() if d != dim)].append((coords[dim], item))
        if size < 2 or any(sorted(k for k, _item in line) != list(range(size)) for line in lines.values()):
            continue
        ordered = [[item for _k, item in sorted(line, key=lambda e: e[0])] for line in lines.values()]
        builds: list[tuple[str, Callable[[list[np.ndarray]], np.ndarray | None]]] = [
            ("sum", lambda vals: np.sum([v.astype(np.float64) for v in vals], axis=0)
             if all(v.shape == expected.shape for v in vals) else None)]
        builds += [(f"concat axis {axis}", lambda vals, axis=axis: np.concatenate(vals, axis=axis)
                    if all(v.ndim == expected.ndim for v in vals) and sum(v.shape[axis] for v in vals) == expected.shape[axis]
                    and all(v.shape[:axis] + v.shape[axis + 1:] == expected.shape[:axis] + expected.shape[axis + 1:] for v in vals)
                    else None) for axis in range(expected.ndim)]
        for how, build in builds:
            values = [build([v for _label, v in line]) for line in ordered]
            if any(value is None for value in values):
                continue
            worst = max(range(len(values)), key=lambda i: _errors(expected, values[i])[0])  # type: ignore[arg-type]
            labels = rank_tensors_text([label for label, _v in ordered[worst]])
            yield _Candidate(f"{how} over {dim} of each line ({labels} fits worst)", values[worst])  # type: ignore[arg-type]


def _two_dim_candidates(expected: np.ndarray, own: list[tuple[str, np.ndarray]], config: ModelConfig) -> Iterator[_Candidate]:
    """On a mesh of several dims, with every rank holding a piece: the layouts split over one mesh
    dim (a sum, or a concatenation along an axis, per line of ranks along it) and over two (a
    sum or a concatenation over one of the concatenations along an axis over another: a TP
    shard's gradient left partial over CP), each as `_declared_candidates` rebuilds it."""
    mesh = config.mesh
    if mesh is None or len(mesh.dims) < 2 or len(own) != config.world_size or not expected.ndim \
            or any(v.ndim != expected.ndim for _label, v in own):
        return
    layouts: list[Layout] = []
    for first in mesh.dims:
        layouts += [PartialLayout(layout="partial", over=first)]
        layouts += [ShardLayout(layout="shard", axis=a, over=first) for a in range(expected.ndim)]
        for second in (d for d in mesh.dims if d != first):
            for then_axis in range(expected.ndim):
                then = ShardThen(axis=then_axis, over=second)
                layouts += [PartialLayout(layout="partial", over=first, then=then)]
                layouts += [ShardLayout(layout="shard", axis=a, over=first, then=then) for a in range(expected.ndim)]
    for layout in layouts:  # (refine.json declares none of them: not "as declared")
        for candidate in _declared_candidates(layout, expected, own, config):
            yield _Candidate(candidate.text.removesuffix(", as declared"), candidate.value)


def _replica_on_all(expected: np.ndarray, own: list[tuple[str, np.ndarray]]) -> _Candidate:
    """Every rank holds the whole tensor: judged by the rank furthest from it."""
    def error(v: np.ndarray) -> float:
        return _errors(expected, v)[0] if v.shape == expected.shape else float("inf")
    label, worst = max(own, key=lambda lv: error(lv[1]))
    ranks = rank_tensors_text([lbl for lbl, _v in own])
    return _Candidate(f"replica on every rank ({ranks}; furthest {label})", worst)


def _windows(expected: np.ndarray, own: list[tuple[str, np.ndarray]], axis: int) -> _Candidate | None:
    """Each rank's output placed where it best fits a contiguous window of `expected` along
    `axis` (any order, overlaps allowed), the rank that fits worst placed last so that its
    error shows; positions no rank covers are NaN (an infinite error)."""
    size = expected.shape[axis]
    other = expected.shape[:axis] + expected.shape[axis + 1:]
    if any(v.ndim != expected.ndim or v.shape[:axis] + v.shape[axis + 1:] != other or not 0 < v.shape[axis] <= size
           for _label, v in own) or size > MAX_WINDOW_AXIS:
        return None
    if all(v.shape[axis] == size for _label, v in own):
        return None  # whole tensors: the replica candidate
    placed = []
    for label, v in own:
        width = v.shape[axis]
        errors = [_errors(np.take(expected, range(o, o + width), axis=axis), v)[0] for o in range(size - width + 1)]
        best = int(np.argmin(errors))
        placed.append((errors[best], best, label, v))
    value = np.full(expected.shape, np.nan)
    for _err, offset, _label, v in sorted(placed, key=lambda p: p[0]):
        index = [slice(None)] * expected.ndim
        index[axis] = slice(offset, offset + v.shape[axis])
        value[tuple(index)] = v
    parts = ", ".join(f"{label}@{offset}" for _err, offset, label, _v in placed)
    return _Candidate(f"windows({parts}, axis={axis})", value)


def _at_node(report: Report, facts: FactSet, derived: Derived, sim: SimResult, tol: float) -> ValueComparison | None:
    """The failing node's output against the rank nodes with the same op that consume related inputs."""
    f = report.failure
    if f is None or f.node.startswith("("):
        return None
    n = f"seq:{f.node}"
    rows = facts.rows
    op = {m: o for _g, m, o in rows["node"]}
    if n not in op:
        return None
    ins: dict[str, list[str]] = defaultdict(list)
    consumers: dict[str, list[str]] = defaultdict(list)
    outs: dict[str, dict[int, str]] = defaultdict(dict)
    for _g, m, _i, t in rows["node_in"]:
        ins[m].append(t)
        consumers[t].append(m)
    for _g, m, i, t in rows["node_out"]:
        outs[m][i] = t
    topo = {m: i for _g, m, i in rows["topo"]}
    related = defaultdict(set)
    for s, t, _lay in derived.get("rel"):
        related[layouts.real_id(s)].add(str(t))  # (a batch chunk's relations count for its tensor)
    world = len(sim.ranks)
    by_rank: dict[int, list[str]] = defaultdict(list)
    for s in ins[n]:
        for t in sorted(related.get(s, ())):
            for m in consumers.get(t, []):
                g = m.split(":", 1)[0]
                if op.get(m) == op[n] and g != "seq" and m not in by_rank[int(g[1:])]:
                    by_rank[int(g[1:])].append(m)
    note = f"rank nodes computing {op[n]} on tensors related to this node's inputs"
    if not by_rank:  # fall back: the rank tensors the analysis relates to the node's output
        note = f"no rank node computes {op[n]} on related inputs; candidates are rank tensors related to its output"
        cands = sorted({t for s in outs[n].values() for t in related.get(s, ())})
        per_rank = [pr for r in range(world) if (pr := [(t, sim.ranks[r][t.split(":", 1)[1]]) for t in cands
                                                        if t.startswith(f"r{r}:") and t.split(":", 1)[1] in sim.ranks[r]])]
        slot_lists: list[list[tuple[str, np.ndarray]]] = [[pr[0] for pr in per_rank]] if per_rank else []
    short = f.node
    for r in by_rank:  # the same-named node first, then topological order
        by_rank[r].sort(key=lambda m: (m.split(":", 1)[1] != short, topo.get(m, 0)))
    best: ValueComparison | None = None
    for slot, s_out in sorted(outs[n].items()):
        name = s_out.split(":", 1)[1]
        if name not in sim.seq:
            continue
        if by_rank:  # (the ranks that compute it: a pipeline stage's node lives on its own ranks only)
            per_rank = [pr for r in range(world) if (pr := [(t, sim.ranks[r][t.split(":", 1)[1]]) for m in by_rank.get(r, [])
                                                            for t in [outs[m].get(slot)] if t and t.split(":", 1)[1] in sim.ranks[r]])]
            slot_lists = [[pr[0] for pr in per_rank]] if per_rank else []
        cmp = compare(name, np.asarray(sim.seq[name]), per_rank, slot_lists + _mesh_lines(slot_lists, facts), tol)
        cmp.seq_node = f.node
        cmp.note = note
        if best is None or (best.matches and not cmp.matches):
            best = cmp
    return best


def _mesh_lines(slots: list[list[tuple[str, np.ndarray]]], facts: FactSet) -> list[list[tuple[str, np.ndarray]]]:
    """Each slot's tensors on every line of the mesh (the ranks along one dim at fixed other
    coordinates, in coordinate order): on a DP x TP mesh a DP row's chunk is rebuilt along a dp
    line, a TP sum along a tp line."""
    sizes = [int(size) for _d, _i, size in sorted(facts.rows["mesh_dim"], key=lambda row: row[1])]
    if len(sizes) < 2:
        return []
    grid = np.arange(int(np.prod(sizes))).reshape(sizes)
    lines = [list(line) for axis in range(len(sizes)) for line in np.moveaxis(grid, axis, -1).reshape(-1, sizes[axis])]
    out = []
    for slot in slots:
        by_rank = {int(label.split(":", 1)[0][1:]): (label, v) for label, v in slot}
        out += [[by_rank[int(r)] for r in line] for line in lines if all(int(r) in by_rank for r in line)]
    return out


def compare(name: str, expected: np.ndarray, per_rank: list[list[tuple[str, np.ndarray]]],
            slots: list[list[tuple[str, np.ndarray]]], tol: float = TOLERANCE) -> ValueComparison:
    """`expected` against every candidate reconstruction from the rank tensors.

    per_rank[r]: rank r's tensors (label, value), each a candidate replica or chunk holder;
    slots: lists of one tensor per rank (in rank order) to sum, max, concatenate, interleave.
    """
    return _score(name, expected, _candidates(expected.shape, per_rank, slots), tol)


def _score(name: str, expected: np.ndarray, candidates: Iterator[_Candidate], tol: float = TOLERANCE) -> ValueComparison:
    """`expected` against each candidate: the best, the runners-up, where the best is off."""
    shape = list(expected.shape)
    results: list[tuple[CandidateResult, np.ndarray | None]] = []
    tried = 0
    for cand in candidates:
        tried += 1
        if tried > MAX_CANDIDATES:
            break
        if list(cand.value.shape) != shape:
            results.append((CandidateResult(candidate=cand.text, shape=list(cand.value.shape)), None))
            continue
        abs_err, rel_err, diff = _errors(expected, cand.value)
        ok = abs_err <= tol * max(1.0, _scale(expected))
        results.append((CandidateResult(candidate=cand.text, shape=shape, max_abs_error=_finite(abs_err),
                                        max_rel_error=_finite(rel_err), matches=ok), (diff, cand.value)))
    comparable = sorted(((c, d) for c, d in results if c.max_abs_error is not None or d is not None),
                        key=lambda cd: (not cd[0].matches, cd[0].max_abs_error if cd[0].max_abs_error is not None else float("inf")))
    if not comparable:
        shapes = [c for c, _d in results][:3]
        return ValueComparison(seq_tensor=name, shape=shape, matches=False, best=None, runners_up=shapes,
                               candidates_tried=tried, note="no candidate has this shape")
    best, extra = comparable[0]
    coords: list[Coordinate] = []
    if not best.matches and extra is not None:
        diff, got = extra
        flat = np.argsort(-np.nan_to_num(diff, nan=np.inf, posinf=np.inf).ravel(), kind="stable")[:3]
        for k in flat:
            idx = [int(i) for i in np.unravel_index(int(k), expected.shape)] if expected.ndim else []
            coords.append(Coordinate(index=idx, expected=_finite(float(expected[tuple(idx)])) or 0.0,
                                     got=_finite(float(got[tuple(idx)])) or 0.0))
    return ValueComparison(seq_tensor=name, shape=shape, matches=best.matches, best=best,
                           runners_up=[c for c, _d in comparable[1:4]], candidates_tried=tried, coordinates=coords,
                           allowed_error=tol * max(1.0, _scale(expected)))


def _candidates(shape: tuple[int, ...], per_rank: list[list[tuple[str, np.ndarray]]],
                slots: list[list[tuple[str, np.ndarray]]], chunks: bool = True) -> Iterator[_Candidate]:
    """Replicas and (with `chunks`) even chunks of single rank tensors; sums, maxes,
    concatenations and interleavings of each slot (one tensor per rank)."""
    n = len(per_rank)
    for r, tensors in enumerate(per_rank):  # a replica on one rank
        for label, v in tensors:
            yield _Candidate(label, np.asarray(v))
    for tensors in per_rank if chunks else []:  # an even chunk of one rank's tensor
        for label, v in tensors:
            v = np.asarray(v)
            if v.ndim != len(shape) or v.shape == shape or n < 2:
                continue
            for axis in range(v.ndim):
                if v.shape[axis] == shape[axis] * n and all(v.shape[a] == shape[a] for a in range(v.ndim) if a != axis):
                    for k, chunk in enumerate(np.split(v, n, axis=axis)):
                        yield _Candidate(f"chunk {k}/{n} of {label} on axis {axis}", chunk)
    seen: set[tuple[str, ...]] = set()
    for slot in slots:
        labels = tuple(label for label, _v in slot)
        if labels in seen or len(slot) < 2:
            continue
        seen.add(labels)
        vals = [np.asarray(v) for _label, v in slot]
        parts = rank_tensors_text(list(labels))
        if all(v.shape == vals[0].shape for v in vals):
            wide = [v.astype(np.float64) for v in vals]
            yield _Candidate(f"sum({parts})", np.sum(wide, axis=0))
            yield _Candidate(f"max({parts})", np.max(wide, axis=0))
        if len({v.ndim for v in vals}) != 1 or vals[0].ndim != len(shape):
            continue
        for axis in range(vals[0].ndim):
            if any(v.shape[:axis] + v.shape[axis + 1:] != vals[0].shape[:axis] + vals[0].shape[axis + 1:] for v in vals):
                continue
            if sum(v.shape[axis] for v in vals) != shape[axis]:
                continue
            yield _Candidate(f"concat({parts}, axis={axis})", np.concatenate(vals, axis=axis))
            if len({v.shape[axis] for v in vals}) == 1:
                yield from _interleavings(vals, axis, parts)


def _interleavings(vals: list[np.ndarray], axis: int, parts: str) -> Iterator[_Candidate]:
    """Rank pieces as `blocks` equal blocks each, interleaved: block b of every rank, in rank order."""
    p = vals[0].shape[axis]
    splits = [b for b in range(2, p + 1) if p % b == 0][:MAX_INTERLEAVE_SPLITS]
    for blocks in splits:
        chunks = [np.split(v, blocks, axis=axis) for v in vals]
        merged = np.concatenate([c[b] for b in range(blocks) for c in chunks], axis=axis)
        yield _Candidate(f"interleave({parts}, axis={axis}, {blocks} blocks each)", merged)


def _scale(x: np.ndarray) -> float:
    if x.size == 0:
        return 0.0
    v = np.abs(np.asarray(x, dtype=np.float64))
    finite = v[np.isfinite(v)]
    return float(finite.max()) if finite.size else 0.0


def _errors(expected: np.ndarray, got: np.ndarray) -> tuple[float, float, np.ndarray]:
    e = np.asarray(expected, dtype=np.float64)
    g = np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(e - g)
    both_nan = np.isnan(e) & np.isnan(g)
    same_inf = np.isinf(e) & (e == g)
    diff = np.where(both_nan | same_inf, 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)
    abs_err = float(diff.max()) if diff.size else 0.0
    return abs_err, abs_err / max(_scale(e), 1e-30), diff


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


__all__ = ["SEEDS", "TOLERANCE", "attach", "check_numbers", "compare", "not_run"]
