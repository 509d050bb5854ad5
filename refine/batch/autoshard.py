"""A Megatron-style sharder for plain ONNX models (`refine batch --plan tp:N`).

It only *proposes* rank programs; the verifier decides whether they refine the model, so a
wrong proposal comes out refuted or unproven, never verified on the sharder's word.

The proposal: find pairs of MatMul/Gemm nodes whose second operand is a weight (an
initializer or a graph input, 2-D, used by that node only), the first (column-parallel) one's
output reaching the second's (row-parallel) activation through elementwise ops only, each
intermediate used once. The column node's weight is split along its output features, and so
are the biases and per-feature constants on the way (a bias of size 1 stays whole); the row
node's weight is split along its input features, so each rank holds a partial sum, and a
`dist` AllReduce is inserted right after it (a row Gemm's bias is added after the
all-reduce, once). Everything else is replicated: every rank runs the rest of the graph on
whole tensors. Features split evenly when they can, else in sizes that differ by one.

`shard_file(model, tp, out_dir)` writes a model directory (seq.onnx: the model as given;
rank{K}.onnx; refine.json declaring each sharded weight's layout and every graph input and
output replicated) and returns a `ShardPlan`: what was sharded, where all-reduces went, and
every MatMul/Gemm left replicated with the reason.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import load_external_data_for_model
from pydantic import BaseModel, Field, computed_field

from refine import dist
from refine.config import (
    CONFIG_NAME,
    SEQ_NAME,
    ShardLayout,
    rank_file_name,
    shard_bounds,
)
from refine.errors import InputError
from refine.lowering.load import load_model_file

# ops that act on each feature column separately; their other operands must be per-feature or scalar
UNARY = {"Relu", "Gelu", "Tanh", "Sigmoid", "Erf", "Exp", "Log", "Softplus", "Softsign", "LeakyRelu", "Elu", "Selu",
         "Celu", "HardSigmoid", "HardSwish", "Mish", "Neg", "Abs", "Sqrt", "Reciprocal", "Identity", "Cast",
         "Dropout", "Clip", "ThresholdedRelu", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu"}
MATMULS = {"MatMul", "Gemm"}


class ShardedTensor(BaseModel):
    """A tensor each rank holds a slice of."""

    name: str
    node: str = Field(description="the node it was sharded for")
    role: Literal["column", "row", "column-elementwise"]
    axis: int
    shape: list[int]
    sizes: list[int] | None = Field(default=None, description="uneven slices, one per rank")


class Pair(BaseModel):
    """A column-parallel node, the elementwise ops after it, and its row-parallel partner."""

    column: str
    elementwise: list[str] = Field(default_factory=list)
    row: str
    allreduce: str = Field(description="the inserted dist AllReduce node")


class Replicated(BaseModel):
    """A MatMul/Gemm every rank runs on whole tensors, and why it was not sharded."""

    node: str
    op: str
    reason: str


class ShardPlan(BaseModel):
    """What the sharder proposed for one model."""

    model: str
    tp: int
    pairs: list[Pair] = Field(default_factory=list)
    sharded: list[ShardedTensor] = Field(default_factory=list)
    replicated: list[Replicated] = Field(default_factory=list)
    nodes: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def summary(self) -> str:
        if not self.pairs:
            kinds = f" ({len(self.replicated)} MatMul/Gemm)" if self.replicated else ""
            return f"nothing sharded: all {self.nodes} nodes replicated{kinds}"
        return (f"{len(self.pairs)} column/row pair{'s' if len(self.pairs) != 1 else ''} sharded "
                f"({len(self.sharded)} tensors, {len(self.pairs)} all-reduce{'s' if len(self.pairs) != 1 else ''}); "
                f"{len(self.replicated)} MatMul/Gemm replicated")


@dataclass
class _Weight:
    """How a MatMul/Gemm's second operand splits: along `col_axis` for output features (column
    parallel), along `row_axis` for input features (row parallel)."""

    name: str
    shape: list[int]
    col_axis: int
    row_axis: int


@dataclass
class _Graph:
    model: onnx.ModelProto
    producer: dict[str, onnx.NodeProto] = field(default_factory=dict)
    consumers: dict[str, list[onnx.NodeProto]] = field(default_factory=dict)
    shapes: dict[str, list[int] | None] = field(default_factory=dict)
    inits: dict[str, onnx.TensorProto] = field(default_factory=dict)
    inputs: set[str] = field(default_factory=set)
    outputs: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> _Graph:
        g = cls(model)
        graph = model.graph
        g.inits = {i.name: i for i in graph.initializer}
        g.inputs = {i.name for i in graph.input if i.name not in g.inits}
        g.outputs = {o.name for o in graph.output}
        for node in graph.node:
            for out in node.output:
                g.producer[out] = node
            for name in node.input:
                if name:
                    g.consumers.setdefault(name, []).append(node)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # noqa: BLE001 - shapes are a help here, not a requirement
            inferred = model
        for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
            g.shapes[vi.name] = _static(vi.type)
        for init in graph.initializer:
            g.shapes[init.name] = list(init.dims)
        return g

    def is_leaf(self, name: str) -> bool:
        """A tensor the graph takes in (weight-like): an initializer or a graph input."""
        return name in self.inits or name in self.inputs

    def uses(self, name: str) -> int:
        return len(self.consumers.get(name, [])) + (name in self.outputs)


def _static(tp: onnx.TypeProto) -> list[int] | None:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tp.tensor_type.shape.dim]
    return None if any(d <= 0 for d in dims) else dims


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _weight(g: _Graph, node: onnx.NodeProto) -> _Weight | str:
    """The node's shardable weight (a leaf, or the Transpose of one, as torch exports a Linear),
    or why it has none."""
    if len(node.input) < 2:
        return "no second operand"
    if node.input[0] in g.inits:
        return "both operands are initializers"
    name, flip = node.input[1], False
    source = g.producer.get(name)
    if (source is not None and source.op_type == "Transpose" and g.is_leaf(source.input[0])
            and list(_attr(source, "perm", [1, 0])) == [1, 0] and g.uses(name) == 1):
        name, flip = source.input[0], True
    elif not g.is_leaf(name):
        return "second operand is computed, not a weight"
    shape = g.shapes.get(name)
    if shape is None or len(shape) != 2:
        return f"weight {name} is not a 2-D tensor of known shape"
    if g.uses(name) != 1:
        return f"weight {name} is shared with another node"
    if node.op_type == "Gemm" and _attr(node, "transA", 0):
        return "Gemm with transA"
    trans = bool(_attr(node, "transB", 0)) if node.op_type == "Gemm" else False
    col, row = (0, 1) if trans != flip else (1, 0)  # axes of the stored tensor
    return _Weight(name, shape, col_axis=col, row_axis=row)


def _split(n: int, tp: int) -> list[int] | None:
    """Even slices -> None; else sizes differing by one (first ranks larger)."""
    if n % tp == 0:
        return None
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


def _per_feature(g: _Graph, name: str, features: int) -> Literal["scalar", "shard"] | str:
    """How a side operand of an elementwise op on the sharded tensor can follow the split."""
    shape = g.shapes.get(name)
    if shape is None:
        return f"operand {name} has no known shape"
    if int(np.prod(shape, dtype=np.int64)) == 1:
        return "scalar"
    if shape[-1] == features and g.is_leaf(name) and g.uses(name) == 1:
        return "shard"
    if shape[-1] == 1:
        return f"operand {name} broadcasts along the features but is not a scalar"
    return f"operand {name} is not a per-feature weight used only here"


def _follow(g: _Graph, start: str, features: int, weights: dict[str, _Weight], used: set[str]
            ) -> tuple[list[onnx.NodeProto], list[str], onnx.NodeProto] | str:
    """From the column output `start`, through elementwise ops, to a row-parallel partner:
    (elementwise nodes, side operands to shard, row node), or why there is none."""
    path: list[onnx.NodeProto] = []
    sides: list[str] = []
    t = start
    while True:
        if t in g.outputs:
            return f"{t} is a graph output"
        users = g.consumers.get(t, [])
        if len(users) != 1:
            return f"{t} is used by {len(users)} nodes" if users else f"{t} is unused"
        n = users[0]
        if n.op_type in MATMULS:
            w = weights.get(n.name or n.output[0])
            if w is not None and n.input[0] == t and n.name not in used and w.shape[w.row_axis] == features:
                return path, sides, n
            return f"{t} feeds {n.op_type} {n.name} that cannot be its row-parallel partner"
        if n.op_type in UNARY or n.op_type in BINARY:
            if n.op_type in UNARY and n.input[0] != t:
                return f"{t} is a parameter of {n.op_type} {n.name}"
            extra = [o for o in n.output[1:] if o and g.uses(o)]
            if extra:
                return f"{n.op_type} {n.name} has a second output in use"
            for other in n.input:
                if other == t or not other:
                    continue
                how = _per_feature(g, other, features)
                if how == "shard":
                    sides.append(other)
                elif how != "scalar":
                    return f"{n.op_type} {n.name}: {how}"
            path.append(n)
            t = n.output[0]
            continue
        return f"{t} feeds {n.op_type} {n.name}, not elementwise"


def plan_model(model: onnx.ModelProto, tp: int, name: str = "model") -> tuple[ShardPlan, _Graph]:
    """The sharding proposal (names the model's unnamed nodes, so that ranks and report share
    them), and the graph it was read from."""
    g = _Graph.of(model)
    for i, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
    plan = ShardPlan(model=name, tp=tp, nodes=len(model.graph.node))
    candidates = [n for n in model.graph.node if n.op_type in MATMULS]
    weights: dict[str, _Weight] = {}
    reasons: dict[str, str] = {}
    for n in candidates:
        w = _weight(g, n)
        if isinstance(w, str):
            reasons[n.name] = w
        else:
            weights[n.name] = w
    used: set[str] = set()
    for n in candidates:
        if n.name in used or n.name not in weights:
            continue
        w = weights[n.name]
        features = w.shape[w.col_axis]
        if features < tp:
            reasons[n.name] = f"{features} output features cannot be split over {tp} ranks"
            continue
        bias = n.input[2] if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2] else None
        bias_shard = False
        if bias is not None:
            how = _per_feature(g, bias, features)
            if how not in ("scalar", "shard"):
                reasons[n.name] = f"bias: {how}"
                continue
            bias_shard = how == "shard"
        found = _follow(g, n.output[0], features, weights, used)
        if isinstance(found, str):
            reasons[n.name] = f"no row-parallel partner: {found}"
            continue
        path, sides, row = found
        used |= {n.name, row.name}
        reasons.pop(row.name, None)
        sizes = _split(features, tp)
        rw = weights[row.name]
        plan.sharded.append(ShardedTensor(name=w.name, node=n.name, role="column", axis=w.col_axis, shape=w.shape, sizes=sizes))
        for side in ([bias] if bias_shard else []) + sides:
            shape = g.shapes[side] or []
            plan.sharded.append(ShardedTensor(name=side, node=n.name, role="column-elementwise", axis=len(shape) - 1,
                                              shape=shape, sizes=sizes))
        plan.sharded.append(ShardedTensor(name=rw.name, node=row.name, role="row", axis=rw.row_axis, shape=rw.shape, sizes=sizes))
        plan.pairs.append(Pair(column=n.name, elementwise=[p.name for p in path], row=row.name,
                               allreduce=f"{row.name}/allreduce"))
    for n in candidates:
        if n.name not in used:
            plan.replicated.append(Replicated(node=n.name, op=n.op_type, reason=reasons.get(n.name, "not paired")))
    return plan, g


def _rank_model(model: onnx.ModelProto, plan: ShardPlan, rank: int) -> onnx.ModelProto:
    """Rank `rank`'s program: the model with its slices of the sharded tensors and an
    AllReduce after each row-parallel node (a row Gemm's bias added after it)."""
    m = copy.deepcopy(model)
    graph = m.graph
    group = list(range(plan.tp))
    inits = {i.name: i for i in graph.initializer}
    for s in plan.sharded:
        lo, hi = shard_bounds(ShardLayout(layout="shard", axis=s.axis, sizes=s.sizes), s.shape[s.axis], plan.tp)[rank]
        if s.name in inits:
            local = np.take(numpy_helper.to_array(inits[s.name]), range(lo, hi), axis=s.axis)
            inits[s.name].CopyFrom(numpy_helper.from_array(local, s.name))
        for vi in graph.input:  # a graph input (or, before IR 4, an initializer's input entry)
            if vi.name == s.name:
                vi.type.tensor_type.shape.dim[s.axis].dim_value = hi - lo
    del graph.value_info[:]  # shapes of intermediates change; inference redoes them
    rows = {p.row: p.allreduce for p in plan.pairs}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        if node.name not in rows:
            continue
        out = node.output[0]
        partial = f"{out}/partial"
        node.output[0] = partial
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
        if bias is None:
            nodes.append(dist.all_reduce(partial, out, group, name=rows[node.name]))
            continue
        beta = float(_attr(node, "beta", 1.0))
        del node.input[2]
        reduced = f"{out}/reduced"
        nodes.append(dist.all_reduce(partial, reduced, group, name=rows[node.name]))
        if beta != 1.0:
            scale = f"{node.name}/beta"
            graph.initializer.append(numpy_helper.from_array(np.array(beta, dtype=np.float32), scale))
            scaled = f"{out}/scaled_bias"
            nodes.append(onnx.helper.make_node("Mul", [bias, scale], [scaled], name=f"{node.name}/bias_scale"))
            bias = scaled
        nodes.append(onnx.helper.make_node("Add", [reduced, bias], [out], name=f"{node.name}/bias"))
    del graph.node[:]
    graph.node.extend(nodes)
    if plan.pairs and not any(o.domain == dist.DIST_DOMAIN for o in m.opset_import):
        m.opset_import.append(dist.dist_opset())
    del m.metadata_props[:]
    onnx.helper.set_model_props(m, {"rank": str(rank), "world_size": str(plan.tp)})
    return m


def _config(g: _Graph, plan: ShardPlan) -> dict:
    inputs: dict[str, dict] = {name: {"layout": "rep"} for name in sorted(g.inputs)}
    for s in plan.sharded:
        layout: dict = {"layout": "shard", "axis": s.axis}
        if s.sizes:
            layout["sizes"] = s.sizes
        inputs[s.name] = layout
    return {"world_size": plan.tp, "inputs": inputs,
            "outputs": {name: {"layout": "rep"} for name in sorted(g.outputs)},
            "description": f"proposed by refine's Megatron-style sharder (--plan tp:{plan.tp}): {plan.summary}"}


def load(path: Path) -> onnx.ModelProto:
    """The model at `path` with its weights, checked as refine checks every model it reads; an
    InputError naming it if it is not a plain model to shard."""
    model = load_model_file(path)
    try:
        load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError) as exc:
        raise InputError(path, f"cannot read its external weight data ({type(exc).__name__})") from None
    if not model.graph.node:
        raise InputError(path, "not an ONNX model with a graph (no nodes)")
    if any(n.domain == dist.DIST_DOMAIN for n in model.graph.node):
        raise InputError(path, "already holds dist collectives: a rank program, not a plain model to shard")
    return model


def shard_file(path: Path, tp: int, out_dir: Path) -> ShardPlan:
    """Shard the plain model at `path` over `tp` ranks into the new model directory `out_dir`."""
    model = load(path)
    plan, g = plan_model(model, tp, path.stem)  # (names its nodes as the ranks' are named)
    out_dir.mkdir(parents=True)
    onnx.save(model, str(out_dir / SEQ_NAME))
    for rank in range(tp):
        onnx.save(_rank_model(model, plan, rank), str(out_dir / rank_file_name(rank)))
    (out_dir / CONFIG_NAME).write_text(json.dumps(_config(g, plan), indent=1) + "\n")
    return plan
