"""Test harness: the witness-case machinery of refine/kit/cases.py (build small sequential + rank
programs in a few lines, verify them in memory, simulate them, check every derived relation
numerically), plus what only the tests need: the CLI run in-process, session-shared exports,
and `Prog`, which builds a sequential graph and its rank graphs with shared random sizes.

`SWEEP` (the environment variable REFINE_TEST_SWEEP=1, which benchmarks/sweep.py sets)
turns the tests' big grids on: every world size x every seed for the witness grids
(`world_seed_grid`) and every case of a grid at every world size (`params_in_turn`), every zoo
model x plan x TP degree for the exporters. Without it each grid
keeps the cases that exercise distinct paths (every world size, even and uneven shards).

`run_case` here is refine.kit.cases.run_case without the report's closest-lemma search unless asked
(`closest_lemma=True`): that search explains a failure and never changes the verdict
(tests/test_causes.py checks both), and it was most of the time of every refused witness.

    seq = Graph()
    x = seq.input("x", [b, h]); w = seq.input("w", [h, f])
    seq.output(seq.op("MatMul", x, w))
    ranks = [...]                      # Graph per rank, same input names
    case = Case("matmul_col", seq, ranks, {"x": rep(), "w": shard(1)}, lemmas={"matmul_column_parallel"})
    outcome = run_case(case)           # lower -> solve -> simulate -> check
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from refine.kit import cases
from refine.kit.cases import (  # noqa: F401 - re-exported for the tests
    OPSET,
    Case,
    Graph,
    Outcome,
    bounds,
    partial,
    rank_shape,
    rep,
    shard,
    simulate,
)
from refine.run.engine import builtin_rules_dir


def run_case(case: Case, seed: int = 0, rules: list[Path] | None = None, closest_lemma: bool = False) -> Outcome:
    """refine.kit.cases.run_case (lower, solve, simulate on one seed, check every derived relation,
    report), the report's closest lemma searched only if `closest_lemma`."""
    return cases.run_case(case, seed, rules, closest_lemma=closest_lemma)


SWEEP = os.environ.get("REFINE_TEST_SWEEP", "") not in ("", "0")


def world_seed_grid(worlds: tuple[int, ...] = (2, 3, 4), seeds: tuple[int, ...] = (0, 1, 2)) -> list[tuple[int, int]]:
    """The (world size, seed) pairs of a witness grid: under SWEEP every pair; else every world
    size once, the seeds taken in turn (2-0, 3-1, 4-2: tests that cut uneven shards on odd seeds
    get both kinds)."""
    if SWEEP:
        return [(w, s) for w in worlds for s in seeds]
    return [(w, seeds[i % len(seeds)]) for i, w in enumerate(worlds)]


def params_in_turn(params: list[tuple], cases: list[tuple]) -> list[tuple]:
    """(*param, *case) rows of a witness grid over `params` x `cases`: under SWEEP every pair;
    else each case once, the params taken in turn (case i with params[i % len(params)]), so
    that every case runs and every param (world size, even or uneven shards) runs with many."""
    if SWEEP:
        return [(*p, *c) for c in cases for p in params]
    return [(*params[i % len(params)], *c) for i, c in enumerate(cases)]


def in_turn(params: list[tuple], names: str = "world,seed,uneven", **axes: list) -> pytest.MarkDecorator:
    """parametrize `names` (each param a tuple of them) and every axis (name -> values; a name
    "a,b" takes tuples): the axes' product, each case with the params taken in turn
    (`params_in_turn`: every case at every param under SWEEP)."""
    values = [[v if "," in name else (v,) for v in vals] for name, vals in axes.items()]
    rows = params_in_turn(params, [sum(combo, ()) for combo in itertools.product(*values)])
    n = len(names.split(","))

    def case_id(row: tuple) -> str:
        case = "-".join(getattr(v, "__name__", str(v)) for v in row[n:])
        w, s, *u = row[:n]
        return f"{case}-w{w}-s{s}" + (f"-{'uneven' if u[0] else 'even'}" if u else "")

    return pytest.mark.parametrize(",".join([names, *axes]), rows, ids=[case_id(row) for row in rows])


def lemma_names_in_rules(rules_dir: Path | None = None) -> set[str]:
    """Every lemma name a rule file derives with `rel_by(..., name)` (the witness inventory)."""
    names: set[str] = set()
    for path in sorted((rules_dir or builtin_rules_dir()).glob("*.lp")):
        text = re.sub(r"%[^\n]*", "", path.read_text())
        for head in re.findall(r"rel_by\(([^.]*?)\)\s*:-", text, flags=re.S):
            names.add(head.rsplit(",", 1)[1].strip())
    return names


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@functools.lru_cache(maxsize=None)
def _example_report(name: str):
    from refine.pipeline import verify_dir

    return verify_dir(EXAMPLES / name)


def example_report(name: str):
    """`verify_dir(examples/NAME)` with the defaults, verified once per test process (several
    test files read the bundled examples' reports): a copy each call, to change at will."""
    return _example_report(name).model_copy(deep=True)


def invoke(*args: object):
    """Run the `refine` CLI in-process; it must never end in a traceback."""
    from typer.testing import CliRunner

    from refine.cli.main import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def assert_export_refused(out: Path, words: str, *args: object) -> None:
    """`refine export ARGS --out OUT` is one `refine: error:` line holding `words`, exit code 2,
    and nothing written."""
    result = invoke("export", *args, "--out", out)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refine: error: ") and words in lines[0], result.output
    assert not out.exists()


def exports_on_first_use(root: Path, export: Callable[[str, Path], None]) -> Callable[[str], Path]:
    """name -> root/name, written by `export(name, out)` the first time a test asks for it, so
    that a session's exports are shared by every test that needs them."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            export(name, root / name)
            done[name] = root / name
        return done[name]

    return get


# --------------------------------------------------------------------------------------------
# lemma witnesses: a sequential graph and its rank graphs built side by side


class Prog:
    """A sequential graph and `world` rank graphs whose declared inputs share their names."""

    def __init__(self, world: int, seed: int, uneven: bool = False) -> None:
        self.world, self.seed, self.uneven = world, seed, uneven
        self.rng = np.random.default_rng(1000 + seed)
        self.seq = Graph()
        self.ranks = [Graph() for _ in range(world)]
        self.layouts: dict[str, dict] = {}
        self._n = 0

    @property
    def group(self) -> list[int]:
        return list(range(self.world))

    def dim(self, lo: int = 2, hi: int = 7) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def split(self) -> tuple[int, list[int] | None]:
        """A dimension to shard over the ranks: (size, sizes) -- sizes None for even chunks."""
        if not self.uneven:
            per = int(self.rng.integers(1, 3))
            return per * self.world, None
        sizes = [int(v) for v in self.rng.integers(1, 4, size=self.world)]
        if len(set(sizes)) == 1:
            sizes[0] += 1
        return sum(sizes), sizes

    def input(self, shape: list[int], layout: dict, dtype: int = TensorProto.FLOAT, name: str = "in") -> str:
        self._n += 1
        name = f"{name}{self._n}"
        self.seq.input(name, list(shape), dtype)
        self.layouts[name] = layout
        for r, g in enumerate(self.ranks):
            g.input(name, rank_shape(list(shape), layout, r, self.world), dtype)
        return name

    def local(self, shape: list[int], layout: dict, r: int) -> list[int]:
        """The shape rank r holds of a tensor of `shape` under `layout`."""
        return rank_shape(list(shape), layout, r, self.world)

    def case(self, name: str, lemmas: set[str] | None = None) -> Case:
        return Case(f"{name}-w{self.world}-s{self.seed}", self.seq, self.ranks, self.layouts, lemmas or set())

    # completions: make the rank pieces rebuildable from the ranks' outputs
    def out_sl(self, g: Graph, t: str, axis: int, even: bool) -> None:
        """A sliced rank tensor: AllGather it when the chunks are even, else output the slice."""
        g.output(g.coll("AllGather", t, self.group, axis=axis) if even else t)

    def out_ps(self, g: Graph, t: str, op: str = "sum") -> str:
        y = g.coll("AllReduce", t, self.group, reduce_op=op)
        g.output(y)
        return y


# --- programs whose calls run (or not) in a given order: tests/test_schedule.py, the mutation subjects ---


def _relu_plus_sigmoid() -> Graph:
    """The sequential program of the cases below: y = relu(x) + sigmoid(x), x [4, 6]."""
    seq = Graph()
    x = seq.input("x", [4, 6])
    seq.output(seq.op("Add", seq.op("Relu", x), seq.op("Sigmoid", x)))
    return seq


def exchange_case(variant: str) -> Case:
    """Each of 2 ranks takes its half of the batch, applies relu and sigmoid, and swaps both with
    the other rank by Send/Recv; the halves are put back together: y = relu(x) + sigmoid(x),
    replicated. Rank 0 sends both, then receives both; rank 1 receives both, then sends both.
    `crossed`: rank 1 sends first too (both ranks wait in a Send); `recv_after_send`: rank 1
    receives the first, sends the first, then receives the second (rank 0 waits in its second
    Send, rank 1 in its first)."""
    seq = _relu_plus_sigmoid()
    ranks = []
    for r in range(2):
        g = Graph()
        x = g.input("x", [4, 6])
        piece = g.op("Slice", x, g.ints([r * 2]), g.ints([(r + 1) * 2]), g.ints([0]))
        mine = [g.op("Relu", piece), g.op("Sigmoid", piece)]
        other: list[str] = []
        if r == 0 or variant == "crossed":
            for t in mine:
                g.send(t, 1 - r)
            other = [g.recv(t, 1 - r) for t in mine]
        elif variant == "recv_after_send":
            other.append(g.recv(mine[0], 0))
            g.send(mine[0], 0)
            other.append(g.recv(mine[1], 0))
            g.send(mine[1], 0)
        else:
            other = [g.recv(t, 0) for t in mine]
            for t in mine:
                g.send(t, 0)
        whole = [g.op("Concat", *((m, o) if r == 0 else (o, m)), axis=0) for m, o in zip(mine, other)]
        g.output(g.op("Add", *whole))
        ranks.append(g)
    return Case(f"exchange_{variant}", seq, ranks, {"x": rep()})


def mesh_maxes_case(variant: str) -> Case:
    """A 2 x 2 mesh (dp, tp): every rank all-reduces relu(x) with max over its tp group and
    sigmoid(x) over its dp group (max of replicas: the replica), y = the sum. `opposite`: ranks 0
    and 3 take the dp group first, so 0 waits for 2 in dp, 2 for 3 in tp, 3 for 1 in dp, 1 for 0
    in tp (each group's calls alone are matched rightly: only the order is wrong)."""
    seq = _relu_plus_sigmoid()
    ranks = []
    for r in range(4):
        g = Graph()
        x = g.input("x", [4, 6])
        d, t = divmod(r, 2)
        values = [(g.op("Relu", x), [2 * d, 2 * d + 1]), (g.op("Sigmoid", x), [t, t + 2])]
        if variant == "opposite" and r in (0, 3):
            values.reverse()
        reduced = {tuple(group): g.coll("AllReduce", v, group, reduce_op="max") for v, group in values}
        g.output(g.op("Add", reduced[(2 * d, 2 * d + 1)], reduced[(t, t + 2)]))
        ranks.append(g)
    return Case(f"mesh_maxes_{variant}", seq, ranks, {"x": rep()}, mesh={"shape": [2, 2], "dims": ["dp", "tp"]})


def assert_verified_and_matches_torch(out: Path, model: object | None = None) -> None:
    """A framework's export: refine verifies it, and the programs compute what torch computes
    (refine.exporters.check, against `model` when the manifest cannot rebuild it)."""
    import refine.exporters
    from refine.pipeline import verify_dir
    from refine.report.render import render_text

    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)
    checked = refine.exporters.check(out, model)  # type: ignore[arg-type]
    assert checked.ok, checked.render()
