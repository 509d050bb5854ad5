"""Declared output layouts: an output refine.json names verifies only with that layout."""

from __future__ import annotations

import pytest

from harness import Case, Graph, rep, run_case, shard


def row_parallel_without_allreduce(outputs: dict[str, dict]) -> Case:
    """y = x @ w; each rank returns its partial x_k @ w_k (the final all-reduce is missing)."""
    seq = Graph()
    x, w = seq.input("x", [4, 4]), seq.input("w", [4, 6])
    seq.output(seq.op("MatMul", x, w))
    ranks = []
    for _ in range(2):
        g = Graph()
        g.output(g.op("MatMul", g.input("x", [4, 2]), g.input("w", [2, 6])))
        ranks.append(g)
    case = Case("no_final_allreduce", seq, ranks, {"x": shard(1), "w": shard(0)}, outputs=outputs)
    # the graphs' output names differ; declare by the sequential name on both sides
    out_name = seq.outputs[0]
    for g in ranks:
        g.nodes[-1].output[0] = out_name
        g.outputs[0] = out_name
    if outputs:
        case.outputs = {out_name: layout for layout in outputs.values()}
    return case


def test_undeclared_output_may_be_rebuilt_as_a_sum():
    out = run_case(row_parallel_without_allreduce({}))
    assert out.checked.ok
    assert out.report.verdict == "verified"
    assert out.report.outputs[0].reconstruction.split(" = ")[1].startswith("sum(")


@pytest.mark.parametrize("layout", [rep(), shard(0)])
def test_declared_output_layout_is_required(layout):
    out = run_case(row_parallel_without_allreduce({"y": layout}))
    assert out.checked.ok
    assert out.report.verdict != "verified"
    assert not out.report.outputs[0].ok
