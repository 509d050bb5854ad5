"""Test harness: build small sequential + rank programs in a few lines, verify them in memory,
simulate them, and check every derived relation numerically (refine/witness.py).

    seq = Graph()
    x = seq.input("x", [b, h]); w = seq.input("w", [h, f])
    seq.output(seq.op("MatMul", x, w))
    ranks = [...]                      # Graph per rank, same input names
    case = Case("matmul_col", seq, ranks, {"x": rep(), "w": shard(1)}, lemmas={"matmul_column_parallel"})
    outcome = run_case(case)           # lower -> solve -> simulate -> check
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from refine import dist
from refine.config import ModelConfig, ShardLayout, shard_bounds
from refine.engine import Derived, builtin_rules_dir, solve
from refine.lowering.graphs import lower_models
from refine.lowering.load import LoadedModels, rank_graph_id
from refine.lowering.shapes import infer_shapes, value_types
from refine.diagnosis import build_report
from refine.report import Report
from refine.simulate import SimResult, make_feeds, run_programs
from refine.witness import CheckResult, check

OPSET = 18
_counter = itertools.count()


class Graph:
    """A tiny ONNX graph builder: names are generated, shapes come from shape inference."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[str] = []
        self.inits: list[onnx.TensorProto] = []

    def input(self, name: str, shape: list[int], dtype: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def const(self, value: object, dtype: type = np.float32) -> str:
        name = f"c{next(_counter)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def ints(self, values: list[int]) -> str:
        return self.const(values, np.int64)

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs: object) -> str:
        """Add a node; return its (first) output name. Use `op_n` for several outputs."""
        return self.op_n(op_type, *inputs, outputs=outputs, domain=domain, **attrs)[0]

    def op_n(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs: object) -> list[str]:
        k = next(_counter)
        outs = [f"{op_type.lower()}{k}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{k}", domain=domain, **attrs))
        return outs

    def coll(self, op_type: str, x: str, group: list[int], **attrs: object) -> str:
        """A dist collective (AllReduce, AllGather, ReduceScatter, AllToAll)."""
        builder = {"AllReduce": dist.all_reduce, "AllGather": dist.all_gather,
                   "ReduceScatter": dist.reduce_scatter, "AllToAll": dist.all_to_all}[op_type]
        k = next(_counter)
        y = f"{op_type.lower()}{k}"
        self.nodes.append(builder(x, y, group, name=f"{op_type}_{k}", **attrs))
        return y

    def output(self, name: str) -> str:
        self.outputs.append(name)
        return name

    def model(self, meta: dict[str, str] | None = None) -> onnx.ModelProto:
        """The ONNX model; output types come from refine's own shape inference."""
        graph = helper.make_graph(self.nodes, "g", self.inputs, [], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), dist.dist_opset()])
        model.ir_version = 9
        types = value_types(infer_shapes(model, Path("<test>"), 1).graph)
        for name in self.outputs:
            model.graph.output.append(helper.make_value_info(name, types[name]))
        for k, v in (meta or {}).items():
            model.metadata_props.add(key=k, value=v)
        return model


def rep() -> dict:
    return {"layout": "rep"}


def shard(axis: int, sizes: list[int] | None = None) -> dict:
    return {"layout": "shard", "axis": axis, **({"sizes": sizes} if sizes else {})}


def partial(op: str = "sum") -> dict:
    return {"layout": "partial", "op": op}


@dataclass
class Case:
    """One witness case: programs, declared input layouts, and the lemmas it must exercise."""

    name: str
    seq: Graph
    ranks: list[Graph]
    inputs: dict[str, dict]
    lemmas: set[str] = field(default_factory=set)
    outputs: dict[str, dict] = field(default_factory=dict)

    def loaded(self) -> LoadedModels:
        n = len(self.ranks)
        config = ModelConfig.model_validate({"world_size": n, "inputs": self.inputs, "outputs": self.outputs})
        paths = {"seq": Path(f"<{self.name}>/seq.onnx")}
        paths.update({rank_graph_id(r): Path(f"<{self.name}>/rank{r}.onnx") for r in range(n)})
        seq, ranks = self.seq.model(), [g.model() for g in self.ranks]
        _name_outputs_alike(seq, ranks)
        return LoadedModels(config, seq, ranks, paths)


def _name_outputs_alike(seq: onnx.ModelProto, ranks: list[onnx.ModelProto]) -> None:
    """Outputs correspond by name (docs/model-dir.md), but the builder names every value afresh:
    each rank's i-th output is passed on, by an Identity, under the sequential i-th output's
    name (the rank's own value keeps its name for the tests that read it). Where that name is
    taken in a rank graph (the sequential output is a graph input, say), the sequential side
    passes its output on under a fresh name first."""
    taken = {x for m in ranks for n in m.graph.node for x in [*n.input, *n.output]} \
        | {vi.name for m in ranks for vi in m.graph.input}
    for i, out in enumerate(seq.graph.output):
        if out.name in taken and any(len(m.graph.output) > i and m.graph.output[i].name != out.name for m in ranks):
            fresh = f"{out.name}__output{i}"
            seq.graph.node.append(helper.make_node("Identity", [out.name], [fresh], name=f"output_{fresh}"))
            out.name = fresh
    for model in ranks:
        for vi, out in zip(model.graph.output, seq.graph.output):
            if vi.name != out.name:
                model.graph.node.append(helper.make_node("Identity", [vi.name], [out.name], name=f"output_{out.name}"))
                vi.name = out.name


@dataclass
class Outcome:
    derived: Derived
    checked: CheckResult
    report: Report

    def relations_of(self, seq_tensor: str) -> list[tuple[str, object]]:
        return [(t, lay) for s, t, lay in self.derived.get("rel") if s == f"seq:{seq_tensor}"]

    def lemmas_fired(self) -> set[str]:
        return {str(lm) for *_, lm in self.derived.get("rel_by")}


def simulate(case: Case, seed: int = 0) -> SimResult:
    """Run the case's programs on random inputs satisfying its layouts (same seed, same feeds)."""
    loaded = case.loaded()
    dist.register_schemas()
    seq_feeds, rank_feeds = make_feeds(loaded.seq, loaded.ranks, loaded.config, np.random.default_rng(seed))
    return run_programs(loaded.seq, loaded.ranks, seq_feeds, rank_feeds)


def run_case(case: Case, seed: int = 0) -> Outcome:
    """Lower, solve, simulate on random inputs satisfying the layouts, check every relation."""
    loaded = case.loaded()
    dist.register_schemas()
    for m in [loaded.seq, *loaded.ranks]:
        onnx.checker.check_model(m)
    facts = lower_models(loaded)
    derived = solve(facts)
    sim = simulate(case, seed)
    return Outcome(derived, check(derived, sim, seed), build_report(case.name, facts, derived))


def lemma_names_in_rules(rules_dir: Path | None = None) -> set[str]:
    """Every lemma name a rule file derives with `rel_by(..., name)` (the witness inventory)."""
    names: set[str] = set()
    for path in sorted((rules_dir or builtin_rules_dir()).glob("*.lp")):
        text = re.sub(r"%[^\n]*", "", path.read_text())
        for head in re.findall(r"rel_by\(([^.]*?)\)\s*:-", text, flags=re.S):
            names.add(head.rsplit(",", 1)[1].strip())
    return names


def invoke(*args: object):
    """Run the `refine` CLI in-process; it must never end in a traceback."""
    from typer.testing import CliRunner

    from refine.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


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


def rank_shape(shape: list[int], layout: dict, r: int, world: int) -> list[int]:
    if layout["layout"] != "shard":
        return shape
    axis = layout["axis"] % len(shape)
    lo, hi = bounds(layout, shape[axis], world)[r]
    return [hi - lo if a == axis else d for a, d in enumerate(shape)]


def bounds(layout: dict, size: int, world: int) -> list[tuple[int, int]]:
    return shard_bounds(ShardLayout.model_validate(layout), size, world)
