"""How lower and run time grow with depth (no memoization yet): a stack of L Megatron MLP
blocks (column-parallel up, ReLU, row-parallel down, all-reduce, residual) at TP 2 and 8.

    python benchmarks/depth.py [--layers 1 8 32] [--tp 2 8]

Builds the models in a temporary directory with onnx.helper, then times `lower_dir` and
`solve` once each. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from refine.dist import all_reduce, dist_opset
from refine.engine import solve
from refine.lower import lower_dir
from refine.report import build_report

B, S, H, F = 2, 8, 64, 256


def stack(layers: int, tp: int, rank: int | None) -> onnx.ModelProto:
    """L residual MLP blocks; rank=None builds the sequential model."""
    f = F if rank is None else F // tp
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, H])]
    nodes, x = [], "x"
    for i in range(layers):
        w1, w2 = f"l{i}.w1", f"l{i}.w2"
        inputs += [helper.make_tensor_value_info(w1, TensorProto.FLOAT, [H, f]),
                   helper.make_tensor_value_info(w2, TensorProto.FLOAT, [f, H])]
        nodes += [helper.make_node("MatMul", [x, w1], [f"l{i}.up"], name=f"l{i}.up"),
                  helper.make_node("Relu", [f"l{i}.up"], [f"l{i}.act"], name=f"l{i}.act"),
                  helper.make_node("MatMul", [f"l{i}.act", w2], [f"l{i}.down"], name=f"l{i}.down")]
        down = f"l{i}.down"
        if rank is not None:
            nodes.append(all_reduce(down, f"l{i}.sum", list(range(tp)), name=f"l{i}.allreduce"))
            down = f"l{i}.sum"
        nodes.append(helper.make_node("Add", [x, down], [f"l{i}.out"], name=f"l{i}.residual"))
        x = f"l{i}.out"
    out = helper.make_tensor_value_info(x, TensorProto.FLOAT, [B, S, H])
    graph = helper.make_graph(nodes, "stack", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), dist_opset()])


def write(d: Path, layers: int, tp: int) -> None:
    d.mkdir(parents=True)
    onnx.save(stack(layers, tp, None), d / "seq.onnx")
    for r in range(tp):
        onnx.save(stack(layers, tp, r), d / f"rank{r}.onnx")
    inputs = {"x": {"layout": "rep"}}
    for i in range(layers):
        inputs[f"l{i}.w1"] = {"layout": "shard", "axis": 1}
        inputs[f"l{i}.w2"] = {"layout": "shard", "axis": 0}
    (d / "refine.json").write_text(json.dumps({"world_size": tp, "inputs": inputs}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    print("| layers | tp | facts | relations | lower s | run s | verdict |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            for layers in args.layers:
                d = Path(tmp) / f"L{layers}_tp{tp}"
                write(d, layers, tp)
                t0 = time.perf_counter()
                facts = lower_dir(d)
                t1 = time.perf_counter()
                derived = solve(facts)
                t2 = time.perf_counter()
                report = build_report(d.name, facts, derived)
                print(f"| {layers} | {tp} | {facts.count()} | {report.relations} | {t1 - t0:.3f} | {t2 - t1:.3f} | {report.verdict} |")


if __name__ == "__main__":
    main()
