"""Build the bundled example model directories (and check them numerically).

    python examples/build.py [--out examples/] [--check]

Each example is a directory with `seq.onnx` (the sequential model), `rank0.onnx` ...
`rank{N-1}.onnx` (what each tensor-parallel rank runs, collectives as `dist` ops) and
`refine.json` (how every graph input of the sequential model relates to the same-named input
on each rank, plus the verdict the verifier is expected to give).

Every model is written with plain `onnx.helper` calls. One function per block (`mlp`,
`attention`) builds both sides: called on a sequential `Graph` it produces the whole model,
called on a rank `Graph` it produces that rank's shard of it, like a Megatron-style module
that reads its TP size. Buggy variants change the rank side only.

Weights and activations are graph inputs (never initializers), so the files hold no random
data and a rebuild is byte-identical. Every node carries its module path (`namespace`) and
the line of this file that created it (`pkg.torch.onnx.stack_trace`), as the PyTorch
exporter would, so the verifier's reports point at the lines below.

`--check` runs every directory through `refine.diagnose.simulate`: a correct example's sequential
output must equal every rank's output; a buggy one's must not (so each bug is real).
"""

from __future__ import annotations

import argparse
import inspect
import json
import linecache
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from refine.dist import all_gather, all_reduce, dist_opset, recv, register_schemas, send  # noqa: E402

SOURCE = HERE.joinpath("build.py").relative_to(REPO).as_posix()  # "examples/build.py"
OPSET = 18
IR_VERSION = 10  # the first IR version with node metadata_props

# Shapes. Distinct sizes, so that a confused axis shows up as a shape error.
B = 2  # batch
MLP_S, MLP_H, MLP_F = 4, 16, 64  # MLP: sequence, hidden, intermediate
ATT_S, ATT_H, ATT_NH = 6, 32, 8  # attention: sequence, hidden, heads
ATT_HD = ATT_H // ATT_NH  # head dim 4
RMS_EPS = 1e-6


# --- a tiny graph builder ------------------------------------------------------------------


class Graph:
    """One ONNX graph under construction: the sequential model (rank None) or one rank's."""

    def __init__(self, world_size: int, rank: int | None = None):
        self.world_size = world_size
        self.rank = rank
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.names: set[str] = set()

    @property
    def is_rank(self) -> bool:
        return self.rank is not None

    @property
    def tp(self) -> int:
        """How many ways sharded tensors are split here: 1 on the sequential side."""
        return self.world_size if self.is_rank else 1

    @property
    def group(self) -> list[int]:
        return list(range(self.world_size))

    def input(self, name: str, shape: Sequence[int]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def output(self, name: str, shape: Sequence[int]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))

    def const(self, name: str, value: float | Sequence[int]) -> str:
        """A small constant as an initializer: a float scalar, or an int64 vector (shapes, axes)."""
        if isinstance(value, (int, float)):
            array = np.array(value, dtype=np.float32)
        else:
            array = np.array(list(value), dtype=np.int64)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], *, ns: str, label: str | None = None,
           out: str | None = None, **attrs: object) -> str:
        """Add node `{ns}/{label or op_type}` and return its output's name."""
        name = self._name(ns, label or op_type)
        node = helper.make_node(op_type, list(inputs), [out or f"{name}_output_0"], name=name, **attrs)
        return self._add(node, ns)

    def collective(self, make: Callable[..., onnx.NodeProto], x: str, *, ns: str,
                   label: str, out: str | None = None, group: list[int] | None = None, **kwargs: object) -> str:
        """Add a `dist` collective over `group` (default: every rank), made by a `refine.dist` constructor."""
        name = self._name(ns, label)
        node = make(x, out or f"{name}_output_0", self.group if group is None else group, name=name, **kwargs)
        return self._add(node, ns)

    def model(self, graph_name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.is_rank:
            opsets.append(dist_opset())
        model = helper.make_model(graph, opset_imports=opsets, producer_name="refine-examples",
                                  ir_version=IR_VERSION)
        meta = {"world_size": str(self.world_size)}
        if self.is_rank:
            meta["rank"] = str(self.rank)
        helper.set_model_props(model, meta)
        onnx.checker.check_model(model, full_check=True)
        return model

    def _name(self, ns: str, label: str) -> str:
        name = f"{ns}/{label}"
        if name in self.names:
            raise ValueError(f"duplicate node name {name!r}: give it a label")
        self.names.add(name)
        return name

    def _add(self, node: onnx.NodeProto, ns: str) -> str:
        frame = _call_site()
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        trace = f'File "{SOURCE}", line {frame.f_lineno}, in {frame.f_code.co_name}\n    {code}'
        helper.set_metadata_props(node, {"namespace": ns, "pkg.torch.onnx.stack_trace": trace})
        self.nodes.append(node)
        return node.output[0]


_BUILDER_CODE = {f.__code__ for f in vars(Graph).values() if inspect.isfunction(f)}


def _call_site():
    """The first frame outside Graph's methods: the line of a block function that made a node."""
    frame = inspect.currentframe()
    while frame is not None and (frame.f_code in _BUILDER_CODE or frame.f_code is _call_site.__code__):
        frame = frame.f_back
    assert frame is not None and Path(frame.f_code.co_filename).resolve() == HERE / "build.py"
    return frame


# --- the blocks ----------------------------------------------------------------------------
#
# `bug` selects a variant of the rank side; None is the correct Megatron-style program.


def mlp(g: Graph, bug: str | None = None) -> None:
    """y = relu(x @ W1 + b1) @ W2 + b2; W1/b1 column-parallel, W2 row-parallel, b2 replicated."""
    f = MLP_F // g.tp
    x = g.input("x", [B, MLP_S, MLP_H])
    w1 = g.input("mlp.up_proj.weight", [MLP_H, f])
    b1 = g.input("mlp.up_proj.bias", [f])
    w2 = g.input("mlp.down_proj.weight", [f, MLP_H])
    b2 = g.input("mlp.down_proj.bias", [MLP_H])

    h = g.op("MatMul", [x, w1], ns="mlp.up_proj")
    h = g.op("Add", [h, b1], ns="mlp.up_proj")
    h = g.op("Relu", [h], ns="mlp.act_fn")
    if g.is_rank and bug == "extra_scale":
        h = g.op("Mul", [h, g.const("mlp.act_fn.scale", 0.5)], ns="mlp.act_fn")  # BUG (class 14)
    y = g.op("MatMul", [h, w2], ns="mlp.down_proj")

    if not g.is_rank:
        g.op("Add", [y, b2], ns="mlp.down_proj", out="y")
    elif bug in (None, "extra_scale"):
        y = g.collective(all_reduce, y, ns="mlp.down_proj", label="AllReduce")
        g.op("Add", [y, b2], ns="mlp.down_proj", out="y")
    elif bug == "missing_allreduce":
        g.op("Add", [y, b2], ns="mlp.down_proj", out="y")  # BUG (class 1): partial sums used as is
    elif bug == "wrong_collective":
        y = g.collective(all_gather, y, ns="mlp.down_proj", label="AllGather", axis=0)  # BUG (class 2)
        g.op("Add", [y, b2], ns="mlp.down_proj", out="y")
        g.output("y", [B * g.tp, MLP_S, MLP_H])  # the gathered batch axis
        return
    elif bug == "bias_before_allreduce":
        y = g.op("Add", [y, b2], ns="mlp.down_proj")  # BUG (class 3): TP copies of b2 get summed
        g.collective(all_reduce, y, ns="mlp.down_proj", label="AllReduce", out="y")
    elif bug == "bias_rank0":  # correct: only rank 0 adds the bias to its partial sum
        if g.rank == 0:
            y = g.op("Add", [y, b2], ns="mlp.down_proj")
        g.collective(all_reduce, y, ns="mlp.down_proj", label="AllReduce", out="y")
    elif bug == "bias_div_tp":  # correct: every rank adds b2 / TP to its partial sum
        b = g.op("Div", [b2, g.const("mlp.down_proj.tp_size", float(g.tp))], ns="mlp.down_proj")
        y = g.op("Add", [y, b], ns="mlp.down_proj")
        g.collective(all_reduce, y, ns="mlp.down_proj", label="AllReduce", out="y")
    else:
        raise ValueError(f"unknown mlp variant {bug!r}")
    g.output("y", [B, MLP_S, MLP_H])


def point_to_point(g: Graph, make: Callable[..., onnx.NodeProto], x: str, peer: int, *, ns: str, label: str) -> str:
    """Add a `dist.Send` or `dist.Recv` (a `refine.dist` constructor) with rank `peer`."""
    name = g._name(ns, label)
    return g._add(make(x, f"{name}_output_0", peer, name=name), ns)


_BUILDER_CODE.add(point_to_point.__code__)  # its nodes carry the line that called it


PP_STAGES, PP_TP = 2, 2  # the pipelined example's mesh: 2 stages x TP 2 (rank = 2 * stage + tp rank)


def mlp_layer(g: Graph, prefix: str, x: str, tp: int, group: list[int], send_partial: bool = False) -> str:
    """One Megatron MLP layer `prefix` (column- then row-parallel over `group`, `tp` ranks) on x;
    with `send_partial`, the row-parallel partial sums get their bias but no all-reduce."""
    f, ns = MLP_F // tp, f"{prefix}.mlp"
    w1 = g.input(f"{prefix}.mlp.up_proj.weight", [MLP_H, f])
    w2 = g.input(f"{prefix}.mlp.down_proj.weight", [f, MLP_H])
    b2 = g.input(f"{prefix}.mlp.down_proj.bias", [MLP_H])
    h = g.op("Relu", [g.op("MatMul", [x, w1], ns=f"{ns}.up_proj")], ns=f"{ns}.act_fn")
    y = g.op("MatMul", [h, w2], ns=f"{ns}.down_proj")
    if g.is_rank and not send_partial:  # (send_partial, the BUG: the partial sums leave the stage unreduced)
        y = g.collective(all_reduce, y, ns=f"{ns}.down_proj", label="AllReduce", group=group)
    return g.op("Add", [y, b2], ns=f"{ns}.down_proj")


def pipelined_mlp(g: Graph, bug: str | None = None) -> None:
    """y = mlp_1(mlp_0(x)) on a 2 x 2 mesh (pp, tp): stage s (ranks 2s, 2s+1) runs layer s with
    TP 2 inside the stage; each stage-0 rank sends its (replicated) activation to the rank of
    stage 1 at the same TP position, which receives it into a buffer of its shape."""
    if bug not in (None, "send_partial"):
        raise ValueError(f"unknown pipelined_mlp variant {bug!r}")
    if not g.is_rank:
        x = g.input("x", [B, MLP_S, MLP_H])
        y = mlp_layer(g, "layers.1", mlp_layer(g, "layers.0", x, 1, []), 1, [])
        g.op("Identity", [y], ns="output", out="y")
        g.output("y", [B, MLP_S, MLP_H])
        return
    stage, tp_rank = divmod(g.rank, PP_TP)
    group = [stage * PP_TP + t for t in range(PP_TP)]
    x = g.input("x", [B, MLP_S, MLP_H])
    if stage == 0:
        h = mlp_layer(g, "layers.0", x, PP_TP, group, send_partial=bug == "send_partial")
        point_to_point(g, send, h, g.rank + PP_TP, ns="pipeline", label="Send")
        return
    h = point_to_point(g, recv, x, g.rank - PP_TP, ns="pipeline", label="Recv")  # x: the buffer's shape
    g.op("Identity", [mlp_layer(g, "layers.1", h, PP_TP, group)], ns="output", out="y")
    g.output("y", [B, MLP_S, MLP_H])


DP_ROWS, DP_TP = 2, 2  # the data-parallel example's mesh: 2 DP rows x TP 2 (rank = 2 * row + tp rank)


def data_parallel_mlp(g: Graph, bug: str | None = None) -> None:
    """y = mlp_0(x) on a 2 x 2 mesh (dp, tp): DP row d holds batch rows [d*B/2, (d+1)*B/2) of x and
    runs the Megatron MLP with TP 2 inside the row; each row's y is its batch chunk. With
    `wrong_group` (the BUG, BUGS.md class 11) the row-parallel all-reduce runs over the rank's DP
    group (its mesh column), adding the partial sums of two different batch chunks."""
    if bug not in (None, "wrong_group"):
        raise ValueError(f"unknown data_parallel_mlp variant {bug!r}")
    if not g.is_rank:
        y = mlp_layer(g, "layers.0", g.input("x", [B, MLP_S, MLP_H]), 1, [])
        g.op("Identity", [y], ns="output", out="y")
        g.output("y", [B, MLP_S, MLP_H])
        return
    row, tp_rank = divmod(g.rank, DP_TP)
    tp_group = [row * DP_TP + t for t in range(DP_TP)]
    dp_group = [d * DP_TP + tp_rank for d in range(DP_ROWS)]
    x = g.input("x", [B // DP_ROWS, MLP_S, MLP_H])
    y = mlp_layer(g, "layers.0", x, DP_TP, dp_group if bug == "wrong_group" else tp_group)
    g.op("Identity", [y], ns="output", out="y")
    g.output("y", [B // DP_ROWS, MLP_S, MLP_H])


def data_parallel_mlp_step(g: Graph, bug: str | None = None) -> None:
    """The gradients of y = tanh(x W1) W2 (W1 column-, W2 row-parallel) for an upstream gradient
    dy, on the 2 x 2 (dp, tp) mesh: each DP row's ranks compute their TP shard of its batch
    chunk's gradients (a sum over the chunk's tokens), all-reduced over the DP group (the mesh
    column) into the TP shard of the whole batch's. With `grads_over_tp` (the BUG, BUGS.md class
    11) that all-reduce runs over the TP group (the mesh row)."""
    if bug not in (None, "grads_over_tp"):
        raise ValueError(f"unknown data_parallel_mlp_step variant {bug!r}")
    rows, tp = (B, 1) if not g.is_rank else (B // DP_ROWS, DP_TP)
    row, tp_rank = divmod(g.rank, DP_TP) if g.is_rank else (0, 0)
    tp_group = [row * DP_TP + t for t in range(DP_TP)]
    dp_group = [d * DP_TP + tp_rank for d in range(DP_ROWS)]
    x = g.input("x", [rows, MLP_S, MLP_H])
    dy = g.input("dy", [rows, MLP_S, MLP_H])
    w1 = g.input("mlp.up_proj.weight", [MLP_H, MLP_F // tp])
    w2 = g.input("mlp.down_proj.weight", [MLP_F // tp, MLP_H])
    ns = "mlp"
    a = g.op("Tanh", [g.op("MatMul", [x, w1], ns=f"{ns}.up_proj")], ns=f"{ns}.act_fn")
    y = g.op("MatMul", [a, w2], ns=f"{ns}.down_proj")
    if g.is_rank:
        y = g.collective(all_reduce, y, ns=f"{ns}.down_proj", label="AllReduce", group=tp_group)
    g.op("Identity", [y], ns="output", out="y")
    g.output("y", [rows, MLP_S, MLP_H])
    back = f"{ns} (backward)"
    w2t = g.op("Transpose", [w2], ns=back, label="Transpose_w2", perm=[1, 0])
    da = g.op("MatMul", [dy, w2t], ns=back, label="MatMul_da")
    one = g.const(f"{back}.one", 1.0)
    dh = g.op("Mul", [da, g.op("Sub", [one, g.op("Mul", [a, a], ns=back, label="Mul_a2")], ns=back)], ns=back, label="Mul_dh")
    tokens = g.const(f"{back}.tokens", [rows * MLP_S, -1])

    def flat_t(t: str, label: str) -> str:  # [rows, S, K] -> [K, rows*S]
        return g.op("Transpose", [g.op("Reshape", [t, tokens], ns=back, label=f"Reshape_{label}")], ns=back,
                    label=f"Transpose_{label}", perm=[1, 0])

    grads = {"grad.mlp.up_proj.weight": g.op("MatMul", [flat_t(x, "x"), g.op("Reshape", [dh, tokens], ns=back, label="Reshape_dh")],
                                             ns=back, label="MatMul_dw1"),
             "grad.mlp.down_proj.weight": g.op("MatMul", [flat_t(a, "a"), g.op("Reshape", [dy, tokens], ns=back, label="Reshape_dy")],
                                               ns=back, label="MatMul_dw2")}
    shapes = {"grad.mlp.up_proj.weight": [MLP_H, MLP_F // tp], "grad.mlp.down_proj.weight": [MLP_F // tp, MLP_H]}
    for name, grad in grads.items():
        if g.is_rank:  # the DP all-reduce (BUG: over the TP group)
            grad = g.collective(all_reduce, grad, ns=back, label=f"AllReduce_{name}",
                                group=tp_group if bug == "grads_over_tp" else dp_group)
        g.op("Identity", [grad], ns="output", label=f"Identity_{name}", out=name)
        g.output(name, shapes[name])


def rms_norm(g: Graph, x: str, weight: str, ns: str) -> str:
    """RMSNorm decomposed the way an exporter writes it: x / sqrt(mean(x^2) + eps) * weight."""
    sq = g.op("Pow", [x, g.const(f"{ns}.exponent", 2.0)], ns=ns)
    ms = g.op("ReduceMean", [sq, g.const(f"{ns}.axes", [-1])], ns=ns, keepdims=1)
    ms = g.op("Add", [ms, g.const(f"{ns}.eps", RMS_EPS)], ns=ns)
    rms = g.op("Sqrt", [ms], ns=ns)
    h = g.op("Div", [x, rms], ns=ns)
    return g.op("Mul", [h, weight], ns=ns)


def attention(g: Graph, bug: str | None = None) -> None:
    """y = x + o_proj(softmax(q k^T / sqrt(hd)) v), q/k/v = RMSNorm(x) @ Wq/Wk/Wv.

    Wq, Wk, Wv are column-parallel (rank r holds heads r*nh/TP ... as contiguous columns),
    Wo is row-parallel; the rest is replicated.
    """
    heads, hidden = ATT_NH // g.tp, ATT_H // g.tp  # this side's heads and q/k/v width
    x = g.input("x", [B, ATT_S, ATT_H])
    gamma = g.input("input_layernorm.weight", [ATT_H])
    wq = g.input("self_attn.q_proj.weight", [ATT_H, hidden])
    wk = g.input("self_attn.k_proj.weight", [ATT_H, hidden])
    wv = g.input("self_attn.v_proj.weight", [ATT_H, hidden])
    wo = g.input("self_attn.o_proj.weight", [hidden, ATT_H])

    h = rms_norm(g, x, gamma, ns="input_layernorm")
    q = g.op("MatMul", [h, wq], ns="self_attn.q_proj")
    k = g.op("MatMul", [h, wk], ns="self_attn.k_proj")
    v = g.op("MatMul", [h, wv], ns="self_attn.v_proj")

    if g.is_rank and bug == "reshape_moves_shard":
        # BUG (class 8): all heads with half of each head's dims, not half of the heads.
        split = g.const("self_attn.head_shape", [B, ATT_S, ATT_NH, ATT_HD // g.tp])
    elif bug in (None, "reshape_moves_shard"):
        split = g.const("self_attn.head_shape", [B, ATT_S, heads, ATT_HD])
    else:
        raise ValueError(f"unknown attention variant {bug!r}")
    q = g.op("Reshape", [q, split], ns="self_attn", label="Reshape_q")
    k = g.op("Reshape", [k, split], ns="self_attn", label="Reshape_k")
    v = g.op("Reshape", [v, split], ns="self_attn", label="Reshape_v")
    q = g.op("Transpose", [q], ns="self_attn", label="Transpose_q", perm=[0, 2, 1, 3])
    k = g.op("Transpose", [k], ns="self_attn", label="Transpose_k", perm=[0, 2, 1, 3])
    v = g.op("Transpose", [v], ns="self_attn", label="Transpose_v", perm=[0, 2, 1, 3])

    kt = g.op("Transpose", [k], ns="self_attn", label="Transpose_kt", perm=[0, 1, 3, 2])
    s = g.op("MatMul", [q, kt], ns="self_attn", label="MatMul_qk")
    s = g.op("Mul", [s, g.const("self_attn.scaling", 1.0 / ATT_HD**0.5)], ns="self_attn", label="Mul_scale")
    p = g.op("Softmax", [s], ns="self_attn", axis=-1)
    o = g.op("MatMul", [p, v], ns="self_attn", label="MatMul_pv")
    o = g.op("Transpose", [o], ns="self_attn", label="Transpose_o", perm=[0, 2, 1, 3])
    o = g.op("Reshape", [o, g.const("self_attn.merged_shape", [B, ATT_S, hidden])], ns="self_attn",
             label="Reshape_o")

    o = g.op("MatMul", [o, wo], ns="self_attn.o_proj")
    if g.is_rank:
        o = g.collective(all_reduce, o, ns="self_attn.o_proj", label="AllReduce")
    g.op("Add", [o, x], ns="residual", out="y")
    g.output("y", [B, ATT_S, ATT_H])


# --- the examples --------------------------------------------------------------------------

REP = {"layout": "rep"}


def shard(axis: int) -> dict:
    return {"layout": "shard", "axis": axis}


MLP_INPUTS = {
    "x": REP,
    "mlp.up_proj.weight": shard(1),
    "mlp.up_proj.bias": shard(0),
    "mlp.down_proj.weight": shard(0),
    "mlp.down_proj.bias": REP,
}
PP_MESH = {"shape": [PP_STAGES, PP_TP], "dims": ["pp", "tp"]}
PP_INPUTS = {
    "x": REP,
    **{f"layers.{i}.mlp.{name}": {**layout, "over": "tp"} if layout != REP else REP
       for i in range(PP_STAGES)
       for name, layout in (("up_proj.weight", shard(1)), ("down_proj.weight", shard(0)), ("down_proj.bias", REP))},
}
DP_MESH = {"shape": [DP_ROWS, DP_TP], "dims": ["dp", "tp"]}
DP_INPUTS = {"x": {**shard(0), "over": "dp"}, **{name: layout for name, layout in PP_INPUTS.items() if name.startswith("layers.0.")}}
DP_OUTPUTS = {"y": {**shard(0), "over": "dp"}}  # each DP row's batch chunk, on every rank of the row
DP_STEP_INPUTS = {"x": DP_INPUTS["x"], "dy": DP_INPUTS["x"], "mlp.up_proj.weight": {**shard(1), "over": "tp"},
                  "mlp.down_proj.weight": {**shard(0), "over": "tp"}}
DP_STEP_OUTPUTS = {**DP_OUTPUTS, "grad.mlp.up_proj.weight": DP_STEP_INPUTS["mlp.up_proj.weight"],
                   "grad.mlp.down_proj.weight": DP_STEP_INPUTS["mlp.down_proj.weight"]}
ATTN_INPUTS = {
    "x": REP,
    "input_layernorm.weight": REP,
    "self_attn.q_proj.weight": shard(1),
    "self_attn.k_proj.weight": shard(1),
    "self_attn.v_proj.weight": shard(1),
    "self_attn.o_proj.weight": shard(0),
}


@dataclass(frozen=True)
class Example:
    name: str
    block: Callable[[Graph, str | None], None]
    world_size: int
    inputs: dict
    description: str
    bug: str | None = None
    expect_node: str | None = None  # sequential node of the first break; None: must verify
    mesh: dict | None = None
    outputs: dict | None = None  # refine.json's outputs (default: y replicated)

    @property
    def correct(self) -> bool:
        return self.expect_node is None

    def expected(self, name: str, seq_value: np.ndarray, rank: int) -> np.ndarray:
        """What rank `rank`'s output `name` must be: the sequential value, or (sharded over a mesh
        dim, a DP row's batch chunk or a TP shard) the chunk of the rank's coordinate there."""
        layout = (self.outputs or {}).get(name, REP)
        if layout.get("over") is None or self.mesh is None:
            return seq_value
        dims, shape = self.mesh["dims"], self.mesh["shape"]
        coord = np.unravel_index(rank, shape)[dims.index(layout["over"])]
        parts = shape[dims.index(layout["over"])]
        return np.array_split(seq_value, parts, axis=layout["axis"])[coord]


EXAMPLES = [
    Example("mlp_tp2", mlp, 2, MLP_INPUTS,
            "Megatron MLP, TP=2: column-parallel up projection, row-parallel down projection, "
            "all-reduce, replicated bias."),
    Example("mlp_tp8", mlp, 8, MLP_INPUTS, "The same MLP at TP=8."),
    Example("attn_tp2", attention, 2, ATTN_INPUTS,
            "Pre-norm attention block, TP=2: RMSNorm, column-parallel q/k/v (4 of 8 heads per rank), "
            "row-parallel output projection, all-reduce, residual."),
    Example("attn_tp8", attention, 8, ATTN_INPUTS, "The same attention block at TP=8 (one head per rank)."),
    Example("mlp_missing_allreduce", mlp, 2, MLP_INPUTS,
            "BUGS.md class 1 (missing all-reduce): the row-parallel partial sums are used as if complete.",
            bug="missing_allreduce", expect_node="mlp.down_proj/Add"),
    Example("mlp_wrong_collective", mlp, 2, MLP_INPUTS,
            "BUGS.md class 2 (wrong collective): an all-gather along the batch axis where the "
            "all-reduce belongs.",
            bug="wrong_collective", expect_node="mlp.down_proj/Add"),
    Example("mlp_bias_before_allreduce", mlp, 2, MLP_INPUTS,
            "BUGS.md class 3 (bias before all-reduce): every rank adds the full bias to its partial "
            "sum, so the result holds TP x bias.",
            bug="bias_before_allreduce", expect_node="mlp.down_proj/Add"),
    Example("attn_reshape_moves_shard", attention, 2, ATTN_INPUTS,
            "BUGS.md class 8 (reshape moves the shard axis): q/k/v hold contiguous column halves, but "
            "each rank reshapes them to all 8 heads with half of each head's dims instead of 4 whole heads.",
            bug="reshape_moves_shard", expect_node="self_attn/Reshape_q"),
    Example("mlp_extra_scale", mlp, 2, MLP_INPUTS,
            "BUGS.md class 14 (scaling): the ranks multiply the activation by 0.5, a factor the "
            "sequential model does not have.",
            bug="extra_scale", expect_node="mlp.down_proj/Add"),
    Example("mlp_bias_rank0", mlp, 2, MLP_INPUTS,
            "BUGS.md class 3, correct variant: only rank 0 adds the bias before the all-reduce.",
            bug="bias_rank0"),
    Example("mlp_bias_div_tp", mlp, 2, MLP_INPUTS,
            "BUGS.md class 3, correct variant: every rank adds bias / TP before the all-reduce.",
            bug="bias_div_tp"),
    Example("mlp_tp2_pp2", pipelined_mlp, 4, PP_INPUTS,
            "Two MLP layers pipelined over 2 stages, TP 2 inside each (a 2 x 2 mesh): stage 0's ranks "
            "send their activations to stage 1's with dist.Send / dist.Recv; y lives on stage 1 only.",
            mesh=PP_MESH),
    Example("mlp_pp_send_partial", pipelined_mlp, 4, PP_INPUTS,
            "BUGS.md class 1 across a pipeline: stage 0 adds the bias to its row-parallel partial sums and "
            "sends them without the all-reduce; stage 1 uses what it receives as the whole activation.",
            bug="send_partial", expect_node="layers.1.mlp.up_proj/MatMul", mesh=PP_MESH),
    Example("mlp_dp2_tp2", data_parallel_mlp, 4, DP_INPUTS,
            "An MLP on a 2 x 2 mesh (dp, tp): each DP row holds half of the batch and runs the MLP with "
            "TP 2 inside the row (the all-reduce over the row's TP group); y is each row's batch chunk.",
            mesh=DP_MESH, outputs=DP_OUTPUTS),
    Example("mlp_dp2_tp2_wrong_group", data_parallel_mlp, 4, DP_INPUTS,
            "BUGS.md class 11 (collective over the wrong group): the row-parallel all-reduce runs over the "
            "rank's DP group (its mesh column), adding partial sums of two different batch chunks.",
            bug="wrong_group", expect_node="layers.0.mlp.down_proj/Add", mesh=DP_MESH, outputs=DP_OUTPUTS),
    Example("mlp_dp2_tp2_grads", data_parallel_mlp_step, 4, DP_STEP_INPUTS,
            "The MLP's weight gradients on the 2 x 2 (dp, tp) mesh: each rank's TP shard of its DP row's gradient "
            "(a sum over the row's tokens), all-reduced over the DP group into its shard of the whole batch's.",
            mesh=DP_MESH, outputs=DP_STEP_OUTPUTS),
    Example("mlp_dp2_tp2_grads_over_tp", data_parallel_mlp_step, 4, DP_STEP_INPUTS,
            "BUGS.md class 11 (collective over the wrong group): the gradients' data-parallel all-reduce runs over "
            "the TP group (the mesh row), adding TP shards of one row's gradient instead of the rows' terms.",
            bug="grads_over_tp", expect_node="output/Identity_grad.mlp.up_proj.weight", mesh=DP_MESH,
            outputs=DP_STEP_OUTPUTS),
]


def build(ex: Example, out: Path) -> None:
    """Write one example directory (replacing any rank files of an earlier build)."""
    d = out / ex.name
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("rank*.onnx"):
        old.unlink()

    seq = Graph(ex.world_size)
    ex.block(seq, ex.bug)
    models = {"seq.onnx": seq.model(f"{ex.name}.seq")}
    for r in range(ex.world_size):
        g = Graph(ex.world_size, rank=r)
        ex.block(g, ex.bug)
        models[f"rank{r}.onnx"] = g.model(f"{ex.name}.rank{r}")

    declared = {vi.name for vi in seq.inputs}
    assert declared == set(ex.inputs), f"{ex.name}: refine.json must declare exactly {sorted(declared)}"
    for file, model in models.items():
        (d / file).write_bytes(model.SerializeToString())

    expect = {"verdict": "verified"} if ex.correct else {"verdict": "refuted", "node": ex.expect_node}
    if not ex.correct:
        assert ex.expect_node in seq.names, f"{ex.name}: no sequential node {ex.expect_node!r}"
    config = {"world_size": ex.world_size, **({"mesh": ex.mesh} if ex.mesh else {}), "description": ex.description,
              "inputs": ex.inputs, "outputs": ex.outputs or {"y": REP}, "expect": expect}
    (d / "refine.json").write_text(json.dumps(config, indent=2) + "\n")


def check(ex: Example, out: Path) -> bool:
    """Simulate one example; True if the numbers agree with what the example claims."""
    from refine.diagnose.simulate import simulate_dir

    result = simulate_dir(out / ex.name, seed=0)
    errors = []
    for name in ex.outputs or {"y": REP}:
        want = np.asarray(result.seq[name])
        for r, tensors in enumerate(result.ranks):
            if name not in tensors:  # (a pipeline's earlier stages hold no output)
                continue
            got, mine = np.asarray(tensors[name]), ex.expected(name, want, r)
            if got.shape != mine.shape:
                errors.append((r, name, f"shape {list(got.shape)} vs {list(mine.shape)}", np.inf))
            else:
                rel = float(np.max(np.abs(got - mine)) / max(float(np.max(np.abs(mine))), 1e-30))
                errors.append((r, name, f"rel err {rel:.2e}", rel))
    worst = max(errors, key=lambda e: e[3])
    ok = worst[3] <= 1e-4 if ex.correct else worst[3] > 1e-4
    verb = "==" if ex.correct else "!="
    what = f"seq {verb} the ranks' outputs (worst: rank {worst[0]}'s {worst[1]}, {worst[2]})"
    print(f"{'ok  ' if ok else 'FAIL'} {ex.name:28s} {'correct' if ex.correct else 'buggy  '}  {what}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where to write the example directories")
    parser.add_argument("--check", action="store_true",
                        help="after building, simulate every example and compare seq with the ranks")
    args = parser.parse_args(argv)

    register_schemas()
    for ex in EXAMPLES:
        build(ex, args.out)
    print(f"built {len(EXAMPLES)} examples in {args.out}")
    if args.check:
        results = [check(ex, args.out) for ex in EXAMPLES]
        if not all(results):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
