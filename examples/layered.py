"""Stacks of Megatron MLP blocks written the way docs/layers.md describes: each distinct block
is one ONNX local function, called once per layer, with its weights passed in.

    block(x, w1, b1, w2, b2) = x + (relu(rmsnorm(x) @ w1 + b1) @ w2 + b2)   (rmsnorm without a weight)
    rank r: w1, b1 column shards; w2 row shard; the partial sum all-reduced, then b2 added.

`bug` makes one layer (`bug_layer`) a different function with a known bug class:
  "bias_every_rank"  b2 added before the all-reduce on every rank (BUGS.md: bias counted N times)
  "missing_allreduce" the row-parallel partial sum is never reduced
  "extra_scale"      the partial sum is scaled by 1/TP before the all-reduce
`kinds` K > 1 makes a hybrid stack: K distinct block functions (MLPBlock0 .. MLPBlock{K-1}, kind k
with the intermediate size ffn * (k + 1)), layer i of kind i % K; K layer templates, each one's
input the previous kind's output (what `refine verify --jobs N` solves ahead).
Used by the memoization tests and benchmarks (plain vs memoized runs must agree).

    python examples/layered.py OUT_DIR --layers 40 --tp 2 [--bug bias_every_rank --bug-layer 37] [--flat] [--ffn 512] [--kinds 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from refine.dist import all_reduce, dist_opset

B, S, H, F = 2, 4, 8, 16
LAYER_DOMAIN = "refine.layer"
BUGS = ("bias_every_rank", "missing_allreduce", "extra_scale")


def block(name: str, tp: int, rank: int | None, bug: str | None = None) -> onnx.FunctionProto:
    """One MLP block as a function of (x, w1, b1, w2, b2); rank=None is the sequential one."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"], name="norm_square"),
             helper.make_node("Constant", [], ["axes"], name="norm_axes",
                              value=helper.make_tensor("axes", TensorProto.INT64, [1], [-1])),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="norm_mean"),
             helper.make_node("Constant", [], ["eps"], name="norm_eps",
                              value=helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-6])),
             helper.make_node("Add", ["ms", "eps"], ["ms_eps"], name="norm_eps_add"),
             helper.make_node("Sqrt", ["ms_eps"], ["rms"], name="norm_sqrt"),
             helper.make_node("Div", ["x", "rms"], ["h"], name="norm"),
             helper.make_node("MatMul", ["h", "w1"], ["up"], name="up_proj"),
             helper.make_node("Add", ["up", "b1"], ["up_b"], name="up_bias"),
             helper.make_node("Relu", ["up_b"], ["act"], name="act"),
             helper.make_node("MatMul", ["act", "w2"], ["down"], name="down_proj")]
    down = "down"
    if rank is not None and bug == "extra_scale":
        nodes += [helper.make_node("Constant", [], ["scale"], name="scale_const",
                                   value=helper.make_tensor("scale", TensorProto.FLOAT, [], [1.0 / tp])),
                  helper.make_node("Mul", [down, "scale"], ["down_scaled"], name="scale")]
        down = "down_scaled"
    if rank is not None and bug == "bias_every_rank":
        nodes.append(helper.make_node("Add", [down, "b2"], ["down_b"], name="down_bias"))
        down = "down_b"
    if rank is not None and bug != "missing_allreduce":
        nodes.append(all_reduce(down, "summed", list(range(tp)), name="allreduce"))
        down = "summed"
    if rank is None or bug != "bias_every_rank":
        nodes.append(helper.make_node("Add", [down, "b2"], ["down_b"], name="down_bias"))
        down = "down_b"
    nodes.append(helper.make_node("Add", ["x", down], ["y"], name="residual"))
    opsets = [helper.make_opsetid("", 18)] + ([dist_opset()] if rank is not None else [])
    return helper.make_function(LAYER_DOMAIN, name, ["x", "w1", "b1", "w2", "b2"], ["y"], nodes, opsets)


def stack(layers: int, tp: int, rank: int | None, bug: str | None = None, bug_layer: int = -1,
          ffn: int = F, kinds: int = 1) -> onnx.ModelProto:
    """The whole model for one program (rank=None: sequential); `ffn`: the intermediate size
    (of kind k: ffn * (k + 1))."""
    plains = [block("MLPBlock" if kinds == 1 else f"MLPBlock{k}", tp, rank) for k in range(kinds)]
    functions = list(plains)
    if bug is not None:
        functions.append(block("MLPBlockVariant", tp, rank, bug))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, H])]
    nodes, x = [], "x"
    for i in range(layers):
        p = f"layers.{i}"
        f = ffn * (i % kinds + 1) // (1 if rank is None else tp)
        plain = plains[i % kinds]
        inputs += [helper.make_tensor_value_info(f"{p}.w1", TensorProto.FLOAT, [H, f]),
                   helper.make_tensor_value_info(f"{p}.b1", TensorProto.FLOAT, [f]),
                   helper.make_tensor_value_info(f"{p}.w2", TensorProto.FLOAT, [f, H]),
                   helper.make_tensor_value_info(f"{p}.b2", TensorProto.FLOAT, [H])]
        fn = functions[-1] if bug is not None and i == bug_layer else plain
        nodes.append(helper.make_node(fn.name, [x, f"{p}.w1", f"{p}.b1", f"{p}.w2", f"{p}.b2"], [f"{p}.out"],
                                      domain=LAYER_DOMAIN, name=p))
        x = f"{p}.out"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="output"))
    graph = helper.make_graph(nodes, "stack", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, H])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(LAYER_DOMAIN, 1)] + ([dist_opset()] if rank is not None else [])
    return helper.make_model(graph, opset_imports=opsets, functions=functions)


def write(out: Path, layers: int, tp: int, bug: str | None = None, bug_layer: int = -1, flat: bool = False,
          ffn: int = F, kinds: int = 1) -> Path:
    """Write the model directory (seq.onnx, rank*.onnx, refine.json); `flat` inlines the calls;
    `ffn` widens the intermediate size (it must divide by `tp`); `kinds` distinct blocks."""
    if ffn % tp:
        raise ValueError(f"the intermediate size {ffn} does not divide by TP {tp}")
    from refine.lowering.layers import inline_calls  # the same inlining the verifier uses

    out.mkdir(parents=True, exist_ok=True)
    programs = {"seq.onnx": stack(layers, tp, None, bug, bug_layer, ffn, kinds)}
    programs.update({f"rank{r}.onnx": stack(layers, tp, r, bug, bug_layer, ffn, kinds) for r in range(tp)})
    for name, model in programs.items():
        onnx.save(inline_calls(model, out / name) if flat else model, out / name)
    inputs: dict[str, dict] = {"x": {"layout": "rep"}}
    for i in range(layers):
        inputs[f"layers.{i}.w1"] = {"layout": "shard", "axis": 1}
        inputs[f"layers.{i}.b1"] = {"layout": "shard", "axis": 0}
        inputs[f"layers.{i}.w2"] = {"layout": "shard", "axis": 0}
        inputs[f"layers.{i}.b2"] = {"layout": "rep"}
    config = {"world_size": tp, "inputs": inputs, "outputs": {"y": {"layout": "rep"}},
              "description": f"{layers} MLP blocks as layer functions"
                             + (f" of {kinds} kinds" if kinds > 1 else "") + f", TP {tp}"
                             + (f"; layer {bug_layer} has bug {bug}" if bug else "")}
    if bug:
        node = {"bias_every_rank": "residual", "missing_allreduce": "residual", "extra_scale": "down_bias"}[bug]
        config["expect"] = {"verdict": "refuted", "node": f"layers.{bug_layer}/{node}"}
    (out / "refine.json").write_text(json.dumps(config, indent=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--bug", choices=BUGS)
    parser.add_argument("--bug-layer", type=int, default=-1)
    parser.add_argument("--flat", action="store_true")
    parser.add_argument("--ffn", type=int, default=F, help=f"intermediate size, divisible by --tp (default {F})")
    parser.add_argument("--kinds", type=int, default=1, help="distinct blocks, layer i of kind i %% KINDS (default 1)")
    args = parser.parse_args()
    write(args.out, args.layers, args.tp, args.bug, args.bug_layer, args.flat, args.ffn, args.kinds)


if __name__ == "__main__":
    main()
