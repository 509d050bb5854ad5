"""The call schedule (refine/diagnose/schedule.py) over every call each rank makes, in order, including
the calls inside layer functions: programs whose calls cannot all complete are refuted naming
the calls, with layer functions (memoized) and inlined alike, and their correct twins verify.
Each case is a witness case (refine/kit/cases.py) saved flat and as layer calls (`as_layer_calls`)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from harness import exchange_case, mesh_maxes_case
from refine import dist
from refine.kit.cases import LAYER_DOMAIN, OPSET
from refine.lowering.program import lower_program
from refine.pipeline import verify_dir
from refine.diagnose.schedule import check_schedule, rank_schedules
from refine.diagnose.simulate import SimulationError, simulate_dir

B, H = 4, 6


CASES = {"exchange": (exchange_case, ["crossed", "recv_after_send"]), "mesh_maxes": (mesh_maxes_case, ["opposite"])}


@pytest.mark.parametrize("layered", [True, False], ids=["layer_functions", "inlined"])
@pytest.mark.parametrize("make,variant", [(make, v) for make, vs in CASES.values() for v in ["twin", *vs]])
def test_calls_that_cannot_all_complete_are_refuted(tmp_path: Path, make, variant: str, layered: bool) -> None:
    """Crossed sends, a receive moved after a send on one rank, groups taken in opposite orders:
    refuted naming the waiting calls (inside the layer call where they are), whether the calls
    live in layer functions or in the main graphs; the correct twins verify."""
    d = make(variant).save(tmp_path / "m", layer_calls=2 if layered else 0)
    report = verify_dir(d)
    if variant == "twin":
        assert report.verdict == "verified", report.failure
        return
    assert report.verdict == "refuted", report.collective_mismatches
    assert report.numeric is not None and "cannot run together" in report.numeric.summary
    [problem] = report.collective_mismatches
    assert problem.startswith("these calls cannot run together")
    if layered:
        assert "in layer call layers.0" in problem, problem
    assert report.failure is not None and report.failure.collectives
    for call in report.failure.collectives:
        assert not call.matched and "never reach it" in (call.problem or "")
        named = [m.node for m in call.members if m.node]
        assert named and all(n.startswith("layers.0/") for n in named) == layered, named


def test_a_static_deadlock_inside_layers_is_found_without_simulating(tmp_path: Path) -> None:
    """The schedule is read off the facts: an export that is never simulated (--meta, or
    --no-simulate) is not verified either, and the report names both ranks' calls."""
    d = exchange_case("crossed").save(tmp_path / "m", layer_calls=3)
    report = verify_dir(d, simulate=False)
    assert report.verdict == "unproven"
    assert report.collective_mismatches[0].count("waits in Send call #0") == 2
    assert "node 'Send_" in report.collective_mismatches[0]


def test_schedule_numbers_calls_across_layer_calls(tmp_path: Path) -> None:
    """Each rank's schedule holds its main calls and its layer calls' body calls where the layer
    is called, numbered per group across all of them; in-body numbers restart at every call."""
    d = mesh_maxes_case("twin").save(tmp_path / "m", layer_calls=3)
    program = lower_program(d)
    schedules = rank_schedules(program.main)
    assert sorted(schedules) == [0, 1, 2, 3]
    calls = schedules[0]
    assert [(c.group, c.seq, c.local) for c in calls] == [
        ("0,1", 0, 0), ("0,2", 0, 0), ("0,1", 1, 0), ("0,2", 1, 0), ("0,1", 2, 0), ("0,2", 2, 0)]
    assert [c.group for c in schedules[3]] == ["2,3", "1,3"] * 3
    assert [c.name.split("/")[0] for c in calls] == ["layers.0", "layers.0", "layers.1", "layers.1", "layers.2", "layers.2"]
    assert check_schedule(program.main).problems == []


def _main_and_layer(rank: int, swapped: bool) -> onnx.ModelProto:
    """Rank `rank` of 2: y1 = AllReduce(x) in the main graph, y2 = relu(AllReduce(z)) in a layer
    call; `swapped` on rank 1: the layer call first, so each rank's first call on the group is
    the other's second (rank 0's x meets rank 1's z)."""
    body = [dist.all_reduce("z", "zs", [0, 1], name="AllReduce"), helper.make_node("Relu", ["zs"], ["y"], name="Relu")]
    fn = helper.make_function(LAYER_DOMAIN, "Layer", ["z"], ["y"], body,
                              [helper.make_opsetid("", OPSET), dist.dist_opset()])
    main = [dist.all_reduce("x", "y1", [0, 1], name="AllReduce"),
            helper.make_node("Layer", ["z"], ["y2"], domain=LAYER_DOMAIN, name="layers.0")]
    if swapped and rank == 1:
        main.reverse()
    return _model(main, fn, [dist.dist_opset()])


def _model(nodes: list[onnx.NodeProto], fn: onnx.FunctionProto, extra: list[onnx.OperatorSetIdProto]) -> onnx.ModelProto:
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H]) for n in ("x", "z")]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H]) for n in ("y1", "y2")]
    model = helper.make_model(helper.make_graph(nodes, "g", vi, out), functions=[fn], opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(LAYER_DOMAIN, 1), *extra])
    model.ir_version = 9
    return model


def _write_main_and_layer(out: Path, swapped: bool) -> Path:
    out.mkdir()
    seq_fn = helper.make_function(LAYER_DOMAIN, "Layer", ["z"], ["y"], [helper.make_node("Relu", ["z"], ["y"], name="Relu")],
                                  [helper.make_opsetid("", OPSET)])
    onnx.save(_model([helper.make_node("Identity", ["x"], ["y1"], name="Identity"),
                      helper.make_node("Layer", ["z"], ["y2"], domain=LAYER_DOMAIN, name="layers.0")], seq_fn, []),
              out / "seq.onnx")
    for r in range(2):
        onnx.save(_main_and_layer(r, swapped), out / f"rank{r}.onnx")
    partial = {"layout": "partial", "op": "sum"}
    (out / "refine.json").write_text(
        f'{{"world_size": 2, "inputs": {{"x": {_json(partial)}, "z": {_json(partial)}}}, '
        f'"outputs": {{"y1": {{"layout": "rep"}}, "y2": {{"layout": "rep"}}}}}}')
    return out


def _json(layout: dict) -> str:
    import json
    return json.dumps(layout)


@pytest.mark.parametrize("swapped", [False, True])
def test_a_call_matched_across_a_layer_boundary_is_not_verified(tmp_path: Path, swapped: bool) -> None:
    """Rank 0 all-reduces x in its main graph, then z inside its layer call; rank 1 the other
    way round. Each solve alone matches its calls (x with x in the main graphs, z with z in the
    template), but the program matches rank 0's x with rank 1's z: refuted on the numbers, and
    the report says where each rank makes the call. In the same order on both ranks: verified."""
    d = _write_main_and_layer(tmp_path / "m", swapped)
    report = verify_dir(d)
    if not swapped:
        assert report.verdict == "verified", report.failure
        return
    assert report.verdict == "refuted"
    [problem, *_] = report.collective_mismatches
    assert "the proof matches the calls numbered 0 in the main graphs, but the programs do not" in problem
    assert "rank 0 makes node 'AllReduce' as its call #0" in problem and "rank 1 makes node 'AllReduce' as its call #1" in problem
    assert verify_dir(d, memo=False).verdict == "refuted"


def _stages(variant: str) -> dict[str, onnx.ModelProto]:
    """Two pipeline stages whose Send/Recv live in their layer functions (1F1B's steady state: a
    forward's activation out, a gradient-like value back): stage 0 runs layer 0 (h = relu(x), sent
    to stage 1; then it receives g), stage 1 runs layer 1 (receives h, sends g = h back, y =
    sigmoid(h)). `send_first`: stage 1 sends g before it receives h (both stages wait in a Send)."""
    opsets = [helper.make_opsetid("", OPSET), dist.dist_opset()]
    f0 = helper.make_function(LAYER_DOMAIN, "Stage0", ["x"], ["g"], [
        helper.make_node("Relu", ["x"], ["h"], name="Relu"), dist.send("h", "sent", 1, name="Send"),
        dist.recv("x", "g", 1, name="Recv")], opsets)
    back = dist.send("x", "sent", 0, name="Send")
    recv = dist.recv("x", "h", 0, name="Recv")
    f1 = helper.make_function(LAYER_DOMAIN, "Stage1", ["x"], ["y"], [
        *([back, recv] if variant == "send_first" else [recv, back]), helper.make_node("Sigmoid", ["h"], ["y"], name="Sigmoid")],
        opsets)
    seq_l0 = helper.make_function(LAYER_DOMAIN, "L0", ["x"], ["h"], [helper.make_node("Relu", ["x"], ["h"], name="Relu")], opsets[:1])
    seq_l1 = helper.make_function(LAYER_DOMAIN, "L1", ["h"], ["y"], [helper.make_node("Sigmoid", ["h"], ["y"], name="Sigmoid")],
                                  opsets[:1])

    def model(nodes: list, fns: list, out: str, extra: list) -> onnx.ModelProto:
        m = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, H])],
                                                [helper.make_tensor_value_info(out, TensorProto.FLOAT, [B, H])]),
                              functions=fns, opset_imports=[*opsets[:1], helper.make_opsetid(LAYER_DOMAIN, 1), *extra])
        m.ir_version = 9
        return m

    return {
        "seq.onnx": model([helper.make_node("L0", ["x"], ["h"], domain=LAYER_DOMAIN, name="layers.0"),
                           helper.make_node("L1", ["h"], ["y"], domain=LAYER_DOMAIN, name="layers.1")], [seq_l0, seq_l1], "y", []),
        "rank0.onnx": model([helper.make_node("Stage0", ["x"], ["g"], domain=LAYER_DOMAIN, name="layers.0")], [f0], "g",
                            [dist.dist_opset()]),
        "rank1.onnx": model([helper.make_node("Stage1", ["x"], ["y"], domain=LAYER_DOMAIN, name="layers.1")], [f1], "y",
                            [dist.dist_opset()]),
    }


@pytest.mark.parametrize("variant", ["in_order", "send_first"])
def test_pipeline_sends_inside_layer_functions_are_scheduled(tmp_path: Path, variant: str) -> None:
    """A pipeline whose stages' Send/Recv live in their layer functions: with stage 1 sending
    first, both stages wait in a Send, and the static check names both calls inside their layer
    calls; in order, the stages' calls complete (what the proof makes of the values crossing
    stages inside layer calls is another matter: it must never be `verified` wrongly)."""
    d = tmp_path / "m"
    d.mkdir()
    for name, model in _stages(variant).items():
        onnx.save(model, d / name)
    (d / "refine.json").write_text('{"world_size": 2, "inputs": {"x": {"layout": "rep"}}, "outputs": {"y": {"layout": "rep"}}}')
    check = check_schedule(lower_program(d).main)
    if variant == "in_order":
        assert check.problems == []
        simulate_dir(d, 0)
        return
    with pytest.raises(SimulationError, match="deadlock"):
        simulate_dir(d, 0)
    [problem] = check.problems
    assert "rank 0 waits in Send call #0" in problem and "node 'Send' in layer call layers.0" in problem
    assert "rank 1 waits in Send call #0" in problem and "node 'Send' in layer call layers.1" in problem
    assert verify_dir(d).verdict == "refuted"
