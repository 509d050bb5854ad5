"""Witness cases: a tiny sequential program and its rank programs built side by side, run
through lowering, the lemmas (with any extra rule directories), the multi-rank simulator and
the numeric check of every derived relation (refine/diagnose/witness.py). The project's lemma witness
tests and `refine rules check` (refine/kit/rulecheck.py) both build on it.

    seq = Graph()
    x = seq.input("x", [b, h]); w = seq.input("w", [h, f])
    seq.output(seq.op("MatMul", x, w))
    ranks = [...]                      # Graph per rank, same input names
    case = Case("matmul_col", seq, ranks, {"x": rep(), "w": shard(1)})
    outcome = run_case(case)           # lower -> solve -> simulate -> check
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from refine import dist
from refine.config import CONFIG_NAME, SEQ_NAME, ModelConfig, ShardLayout, rank_file_name, shard_bounds
from refine.diagnose.diagnosis import build_report
from refine.run.engine import Derived, solve
from refine.lowering.facts import FactSet
from refine.lowering.graphs import lower_models
from refine.lowering.load import LoadedModels, rank_graph_id
from refine.lowering.normal_forms import lowered_form
from refine.lowering.shapes import infer_shapes, value_types
from refine.report.schema import Report
from refine.diagnose.simulate import SimResult, make_feeds, run_programs
from refine.diagnose.witness import CheckResult, check

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
        """A dist collective (AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast)."""
        builder = {"AllReduce": dist.all_reduce, "AllGather": dist.all_gather, "ReduceScatter": dist.reduce_scatter,
                   "AllToAll": dist.all_to_all, "Broadcast": dist.broadcast}[op_type]
        k = next(_counter)
        y = f"{op_type.lower()}{k}"
        self.nodes.append(builder(x, y, group, name=f"{op_type}_{k}", **attrs))
        return y

    def all_to_all_v(self, x: str, send_counts: str, recv_counts: str, group: list[int], out_rows: int) -> str:
        """dist.AllToAllV of x's rows with the given count tensors (refine/dist.py)."""
        k = next(_counter)
        y = f"alltoallv{k}"
        self.nodes.append(dist.all_to_all_v(x, send_counts, recv_counts, y, group, out_rows, name=f"AllToAllV_{k}"))
        return y

    def send(self, x: str, peer: int, tag: int = 0) -> str:
        """dist.Send of x to rank `peer`; returns its output (x again)."""
        k = next(_counter)
        self.nodes.append(dist.send(x, f"send{k}", peer, tag, name=f"Send_{k}"))
        return f"send{k}"

    def recv(self, buffer: str, peer: int, tag: int = 0) -> str:
        """dist.Recv from rank `peer` into a tensor shaped like `buffer`; returns the received tensor."""
        k = next(_counter)
        self.nodes.append(dist.recv(buffer, f"recv{k}", peer, tag, name=f"Recv_{k}"))
        return f"recv{k}"

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
    mesh: dict | None = None  # refine.json's mesh, for layouts `over` one of its dims

    def loaded(self) -> LoadedModels:
        n = len(self.ranks)
        config = ModelConfig.model_validate({"world_size": n, "inputs": self.inputs, "outputs": self.outputs,
                                             **({"mesh": self.mesh} if self.mesh else {})})
        paths = {"seq": Path(f"<{self.name}>/seq.onnx")}
        paths.update({rank_graph_id(r): Path(f"<{self.name}>/rank{r}.onnx") for r in range(n)})
        seq, ranks = self.seq.model(), [g.model() for g in self.ranks]
        _name_outputs_alike(seq, ranks)
        return LoadedModels(config, seq, ranks, paths)

    def save(self, out: Path, layer_calls: int = 0) -> Path:
        """The case as a model directory (refine.json with the case's name as its description,
        seq.onnx, rank*.onnx), to run through the CLI; with `layer_calls`, every program is
        one layer function called that many times in a chain (`as_layer_calls`)."""
        loaded = self.loaded()
        loaded.config = loaded.config.model_copy(update={"description": self.name})
        if layer_calls:
            loaded.seq = as_layer_calls(loaded.seq, layer_calls)
            loaded.ranks = [as_layer_calls(m, layer_calls) for m in loaded.ranks]
        return _save_loaded(loaded, out)


def _save_loaded(loaded: LoadedModels, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.onnx"):
        old.unlink()
    onnx.save(loaded.seq, out / SEQ_NAME)
    for r, m in enumerate(loaded.ranks):
        onnx.save(m, out / rank_file_name(r))
    config = loaded.config.model_dump(mode="json", exclude_none=True)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=1) + "\n")
    return out


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
    return simulate_loaded(case.loaded(), seed)


def simulate_loaded(loaded: LoadedModels, seed: int = 0) -> SimResult:
    """Run the programs as lowering reads them (refine.lowering.normal_forms.lowered_form: the
    same values for every tensor of the files, and values for the tensors a rewrite made, so that
    every derived relation can be checked)."""
    dist.register_schemas()
    seq_feeds, rank_feeds = make_feeds(loaded.seq, loaded.ranks, loaded.config, np.random.default_rng(seed))
    n = len(loaded.ranks)
    declared = set(loaded.config.inputs)
    seq = lowered_form(infer_shapes(loaded.seq, loaded.paths["seq"], n), declared)
    ranks = [lowered_form(infer_shapes(m, loaded.paths[rank_graph_id(r)], n), declared) for r, m in enumerate(loaded.ranks)]
    return run_programs(seq, ranks, seq_feeds, rank_feeds)


def solve_and_check(loaded: LoadedModels, seed: int = 0, rules: list[Path] | None = None,
                    derived: Derived | None = None) -> tuple[FactSet | None, Derived, CheckResult]:
    """Lower and solve the flat programs (with the bundled lemmas and `rules`; or take
    `derived`, the fixpoint of exactly these programs), simulate them on one seed, and check
    every derived relation on the numbers."""
    sim = simulate_loaded(loaded, seed)  # (first: the lowering may rewrite the models it is given)
    facts = None
    if derived is None:
        facts = lower_models(loaded)
        derived = solve(facts, rules)
    return facts, derived, check(derived, sim, seed)


def run_case(case: Case, seed: int = 0, rules: list[Path] | None = None, closest_lemma: bool = True) -> Outcome:
    """Lower, solve (with the bundled lemmas and `rules`, extra rule directories), simulate on
    random inputs satisfying the layouts, check every derived relation. `closest_lemma`: search
    the lemma that came closest at a failure (an explanation only, and most of the time of a
    refused witness: the witness tests leave it out)."""
    loaded = case.loaded()
    dist.register_schemas()
    for m in [loaded.seq, *loaded.ranks]:
        onnx.checker.check_model(m)
    facts, derived, checked = solve_and_check(loaded, seed, rules)
    assert facts is not None
    return Outcome(derived, checked, build_report(case.name, facts, derived, closest_lemma=closest_lemma))


LAYER_DOMAIN = "refine.layer"


def as_layer_calls(model: onnx.ModelProto, calls: int = 2) -> onnx.ModelProto:
    """The model's graph as one layer function (docs/layers.md) called `calls` times in a chain:
    call k + 1 takes call k's first output in place of the graph's first input (so that output
    must be shaped like that input), and every other input as it is; the graph's outputs are the
    last call's. Initializers become Constant nodes of the body. So a witness case also runs
    with its calls and collectives inside layer calls, memoized."""
    g = model.graph
    body = [helper.make_node("Constant", [], [init.name], name=f"const_{init.name}", value=init) for init in g.initializer]
    body += list(g.node)
    inputs, outputs = [vi.name for vi in g.input], [vi.name for vi in g.output]
    opsets = [o for o in model.opset_import if o.domain != LAYER_DOMAIN]
    function = helper.make_function(LAYER_DOMAIN, "Layer", inputs, outputs, body, opsets)
    nodes, x = [], inputs[0]
    for k in range(calls):
        results = outputs if k == calls - 1 else [f"layers.{k}.{o}" for o in outputs]
        nodes.append(helper.make_node("Layer", [x, *inputs[1:]], results, domain=LAYER_DOMAIN, name=f"layers.{k}"))
        x = results[0]
    graph = helper.make_graph(nodes, g.name, list(g.input), list(g.output))
    layered = helper.make_model(graph, opset_imports=[*opsets, helper.make_opsetid(LAYER_DOMAIN, 1)], functions=[function])
    layered.ir_version = model.ir_version
    layered.metadata_props.extend(model.metadata_props)
    return layered


def rank_shape(shape: list[int], layout: dict, r: int, world: int) -> list[int]:
    if layout["layout"] != "shard":
        return shape
    axis = layout["axis"] % len(shape)
    lo, hi = bounds(layout, shape[axis], world)[r]
    return [hi - lo if a == axis else d for a, d in enumerate(shape)]


def bounds(layout: dict, size: int, world: int) -> list[tuple[int, int]]:
    return shard_bounds(ShardLayout.model_validate(layout), size, world)
