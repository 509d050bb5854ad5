"""dist.AllToAllV (issue 42 stage 1, docs/moe.md): the ragged all-to-all of MoE token dispatch.

- the simulator moves rows exactly as the semantics say, checked against an independent numpy
  reference on random ragged counts (zeros included), group sizes 2-4, group orders and a rank
  outside the group;
- counts that two members disagree on (split sizes computed from the wrong group, one off by
  one) are refused, naming both ranks, the node and both counts; the correct twin runs;
- a program whose counts are constants (no histogram exchanged: rules/exchanged_rows.lp proves
  only counts that an AllToAll of each member's histogram gives) is unproven, never verified, and
  its mismatched twin is refuted by the simulator;
- bad input is one line, exit 2; a member that skips the call is refused like any collective's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from refine import dist
from refine.cli.main import app
from refine.diagnose.simulate import SimulationError, run_programs
from refine.kit.cases import Case, Graph
from refine.lowering.shapes import infer_shapes
from refine.pipeline import verify_dir

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
OPSET = 18
FAST = 5.0  # seconds: a refused call must be reported promptly, never by hanging
runner = CliRunner()


# --- building programs -----------------------------------------------------------------------


def _model(nodes, inputs, outputs, inits=None) -> onnx.ModelProto:
    """A checked opset-18 + dist model; inputs/outputs: name -> (elem type, shape)."""
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in outputs.items()],
        initializer=[numpy_helper.from_array(v, n) for n, v in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), dist.dist_opset()])
    dist.register_schemas()
    onnx.checker.check_model(model, full_check=False)
    return model


def _v_program(group: list[int], rows: int, width: int, out_rows: int) -> onnx.ModelProto:
    """Y = AllToAllV(X, S, R) over `group`, every operand a graph input."""
    node = dist.all_to_all_v("X", "S", "R", "Y", group, out_rows, name="a2av")
    n = len(group)
    return _model([node], {"X": (FLOAT, [rows, width]), "S": (INT64, [n]), "R": (INT64, [n])},
                  {"Y": (FLOAT, [out_rows, width])})


def _identity(shape: list[int]) -> onnx.ModelProto:
    return _model([helper.make_node("Identity", ["X"], ["Y"])], {"X": (FLOAT, shape)}, {"Y": (FLOAT, shape)})


def _run(world: int, group: list[int], datas: dict[int, np.ndarray], sends: dict[int, np.ndarray],
         recvs: dict[int, np.ndarray], out_rows: int) -> dict[int, np.ndarray]:
    """Run one AllToAllV per member of `group` (each with its own data rows); ranks outside the
    group run an Identity. Each member's Y."""
    width = next(iter(datas.values())).shape[1]
    ranks, feeds = [], []
    for r in range(world):
        if r in group:
            ranks.append(_v_program(group, datas[r].shape[0], width, out_rows))
            feeds.append({"X": datas[r], "S": sends[r].astype(np.int64), "R": recvs[r].astype(np.int64)})
        else:
            ranks.append(_identity([1, width]))
            feeds.append({"X": np.zeros((1, width), np.float32)})
    seq_x = np.zeros((1, width), np.float32)
    res = run_programs(_identity([1, width]), ranks, {"X": seq_x}, feeds, timeout=FAST)
    return {r: res.ranks[r]["Y"] for r in group}


def _reference(group: list[int], datas: dict[int, np.ndarray], counts: np.ndarray, out_rows: int) -> dict[int, np.ndarray]:
    """The semantics written independently: counts[i, j] = rows member i sends member j. Each
    source's data is cut with np.split at its cumulative counts (its rows past them are not
    sent); each destination stacks the
    blocks addressed to it in source order and pads with zero rows to out_rows."""
    n = len(group)
    blocks = {i: np.split(datas[group[i]], np.cumsum(counts[i]), axis=0) for i in range(n)}  # (+ the unsent rest)
    out = {}
    for j, r in enumerate(group):
        got = np.concatenate([blocks[i][j] for i in range(n)], axis=0)
        pad = np.zeros((out_rows - got.shape[0], got.shape[1]), got.dtype)
        out[r] = np.concatenate([got, pad], axis=0)
    return out


# --- (a) semantics ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_move_as_the_semantics_say(n: int, seed: int) -> None:
    """Random ragged counts (about a third of them 0), members whose data buffers differ in rows
    and have unsent slack, a shuffled group order and one rank outside the group: every member's
    output equals the independent reference, zero rows included."""
    rng = np.random.default_rng(100 * n + seed)
    world = n + 1
    group = [int(r) for r in rng.permutation(world)[:n]]
    counts = rng.integers(1, 4, size=(n, n)) * (rng.random((n, n)) > 0.33)
    counts[0, :] = 0  # one member sends nothing at all
    out_rows = int(counts.sum(axis=0).max()) + int(rng.integers(0, 3))
    width = 3
    datas = {group[i]: (rng.standard_normal((int(counts[i].sum()) + int(rng.integers(0, 3)), width)) + 0.5)
             .astype(np.float32) for i in range(n)}
    for x in datas.values():  # (no two rows alike: a row in the wrong place cannot pass)
        x += np.arange(x.shape[0], dtype=np.float32)[:, None] * 10
    sends = {group[i]: counts[i] for i in range(n)}
    recvs = {group[j]: counts[:, j] for j in range(n)}
    got = _run(world, group, datas, sends, recvs, out_rows)
    want = _reference(group, datas, counts, out_rows)
    for r in group:
        assert got[r].shape == (out_rows, width)
        np.testing.assert_array_equal(got[r], want[r])
    j = next(j for j in range(n) if counts[:, j].sum() < out_rows) if (counts.sum(axis=0) < out_rows).any() else None
    if j is not None:  # the rows past what arrived are zero, whatever the data held
        assert not got[group[j]][int(counts[:, j].sum()):].any()


def test_one_hand_checked_exchange() -> None:
    """Group [1, 0]: member 0 is rank 1. Rank 1 sends rows 0 to itself and rows 1..2 to rank 0;
    rank 0 sends nothing to rank 1 and row 0 to itself."""
    a = np.array([[1.0], [2.0], [3.0]], np.float32)  # rank 1
    b = np.array([[7.0], [8.0]], np.float32)  # rank 0
    got = _run(2, [1, 0], {1: a, 0: b}, {1: np.array([1, 2]), 0: np.array([0, 1])},
               {1: np.array([1, 0]), 0: np.array([2, 1])}, out_rows=4)
    np.testing.assert_array_equal(got[1][:, 0], [1, 0, 0, 0])
    np.testing.assert_array_equal(got[0][:, 0], [2, 3, 7, 0])


def test_output_shape_and_node_attrs() -> None:
    node = dist.all_to_all_v("d", "s", "r", "y", (0, 1), 9)
    assert list(node.input) == ["d", "s", "r"] and node.domain == dist.DIST_DOMAIN
    attrs = dist.node_attrs(node)
    assert attrs == {"group": [0, 1], "out_rows": 9}
    assert dist.output_shape("AllToAllV", attrs, [4, 3, 5], 2) == [9, 3, 5]
    with pytest.raises(ValueError, match="scalar"):
        dist.output_shape("AllToAllV", attrs, [], 2)
    assert "AllToAllV" in dist.COLLECTIVE_OPS and "AllToAllV" in dist.KNOWN_OPS


def test_shape_inference_gives_out_rows() -> None:
    """The lowering's inference (the standard-op proxy) gives the output out_rows rows."""
    node = dist.all_to_all_v("X", "S", "R", "Y", [0, 1], 7)
    relu = helper.make_node("Relu", ["Y"], ["Z"])
    model = _model([node, relu], {"X": (FLOAT, [5, 3, 2]), "S": (INT64, [2]), "R": (INT64, [2])},
                   {"Z": (FLOAT, ["a", "b", "c"])})
    inferred = infer_shapes(model, Path("rank0.onnx"), 2)
    types = {vi.name: vi.type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    for name in ("Y", "Z"):
        dims = [d.dim_value for d in types[name].tensor_type.shape.dim]
        assert dims == [7, 3, 2], (name, dims)


# --- (b) counts the members disagree on ------------------------------------------------------


def _two_groups(wrong: str | None) -> tuple[dict, dict, dict]:
    """World 4, two AllToAllV groups [0, 1] and [2, 3] with different ragged counts. `wrong`:
    "group" computes group [0, 1]'s recv counts from group [2, 3]'s sends (split sizes
    exchanged over the wrong group); "off_by_one" takes one off rank 1's count from rank 0."""
    sends = {0: [2, 1], 1: [0, 3], 2: [1, 1], 3: [2, 2]}
    recvs = {0: [sends[0][0], sends[1][0]], 1: [sends[0][1], sends[1][1]],
             2: [sends[2][0], sends[3][0]], 3: [sends[2][1], sends[3][1]]}
    if wrong == "group":
        recvs[0], recvs[1] = recvs[2], recvs[3]
    elif wrong == "off_by_one":
        recvs[1] = [recvs[1][0] - 1, recvs[1][1]]
    rng = np.random.default_rng(5)
    datas = {r: rng.standard_normal((4, 2)).astype(np.float32) for r in range(4)}
    return datas, {r: np.array(v) for r, v in sends.items()}, {r: np.array(v) for r, v in recvs.items()}


def _run_world4(datas, sends, recvs) -> dict[int, np.ndarray]:
    ranks, feeds = [], []
    for r in range(4):
        group = [0, 1] if r < 2 else [2, 3]
        ranks.append(_v_program(group, 4, 2, 5))
        feeds.append({"X": datas[r], "S": sends[r].astype(np.int64), "R": recvs[r].astype(np.int64)})
    res = run_programs(_identity([1, 2]), ranks, {"X": np.zeros((1, 2), np.float32)}, feeds, timeout=FAST)
    return {r: res.ranks[r]["Y"] for r in range(4)}


def test_correct_twin_runs() -> None:
    datas, sends, recvs = _two_groups(None)
    got = _run_world4(datas, sends, recvs)
    for group in ([0, 1], [2, 3]):
        counts = np.array([sends[r] for r in group])
        want = _reference(group, datas, counts, 5)
        for r in group:
            np.testing.assert_array_equal(got[r], want[r])


@pytest.mark.parametrize(("wrong", "pair"), [
    ("group", "rank 0 (rank 0 node 'a2av') sends 2 rows to rank 0 (send_counts[0] = 2) but rank 0 (rank 0 node "
              "'a2av') expects 1 from rank 0 (recv_counts[0] = 1)"),
    ("off_by_one", "rank 0 (rank 0 node 'a2av') sends 1 rows to rank 1 (send_counts[1] = 1) but rank 1 (rank 1 node "
                   "'a2av') expects 0 from rank 0 (recv_counts[0] = 0)"),
])
def test_counts_that_disagree_are_refused(wrong: str, pair: str) -> None:
    """Split sizes from the wrong group, or one off by one: a mismatched collective (a program
    error, as the verdict machinery reads it), naming the node, both ranks and both counts."""
    datas, sends, recvs = _two_groups(wrong)
    with pytest.raises(SimulationError) as err:
        _run_world4(datas, sends, recvs)
    message = str(err.value)
    assert message.startswith("mismatched collective counts: AllToAllV call #0 on group [0, 1]"), message
    assert pair in message, message


@pytest.mark.parametrize(("change", "words"), [
    (lambda s, r: s.__setitem__(0, np.array([3, -1])), "send_counts [3, -1] has a negative count"),
    (lambda s, r: s.__setitem__(0, np.array([4, 1])), "send_counts [4, 1] add up to 5 rows, more than its data's 4"),
    (lambda s, r: r.__setitem__(1, np.array([3, 3])), "recv_counts [3, 3] add up to 6 rows, more than out_rows 5"),
])
def test_counts_that_do_not_fit_are_refused(change, words: str) -> None:
    datas, sends, recvs = _two_groups(None)
    change(sends, recvs)
    with pytest.raises(SimulationError, match="mismatched collective counts") as err:
        _run_world4(datas, sends, recvs)
    assert words in str(err.value)


# --- (c) verify: never verified; a count mismatch refuted -------------------------------------

D = 3


def _verify_case(d: Path, recv1: list[int] = (2, 2), skip_on: int | None = None, **change) -> Path:
    """World 2. seq: y = x [4, D]. Each rank gets x (rep), sends rows 0..1 to rank 0 and rows
    2..3 to rank 1 (send_counts [2, 2], an initializer), receives 2 + 2 rows into a buffer of
    out_rows 5 (one padding row) and keeps the first two: y_r = x[2r:2r+2] (y sharded on axis 0).
    `recv1`: rank 1's recv_counts; `skip_on`: a rank that makes no AllToAllV (it slices x itself)."""
    d.mkdir(parents=True)
    seq = _model([helper.make_node("Identity", ["x"], ["y"])], {"x": (FLOAT, [4, D])}, {"y": (FLOAT, [4, D])})
    onnx.save(seq, d / "seq.onnx")
    for r in range(2):
        recv = list(recv1) if r == 1 else [2, 2]
        inits = {"send": np.array([2, 2], np.int64), "recv": np.array(recv, np.int64),
                 "starts": np.array([0], np.int64), "ends": np.array([2], np.int64), "axes": np.array([0], np.int64),
                 "own_starts": np.array([2 * r], np.int64), "own_ends": np.array([2 * r + 2], np.int64)}
        if r == skip_on:
            nodes = [helper.make_node("Slice", ["x", "own_starts", "own_ends", "axes"], ["y"], name="own")]
        else:
            nodes = [dist.all_to_all_v("x", "send", "recv", "buf", [0, 1], change.get("out_rows", 5), name="dispatch"),
                     helper.make_node("Slice", ["buf", "starts", "ends", "axes"], ["y"], name="keep")]
        onnx.save(_model(nodes, {"x": (FLOAT, [4, D])}, {"y": (FLOAT, [2, D])}, inits), d / f"rank{r}.onnx")
    (d / "refine.json").write_text(json.dumps({
        "world_size": 2, "inputs": {"x": {"layout": "rep"}}, "outputs": {"y": {"layout": "shard", "axis": 0}}}))
    return d


def test_a_correct_program_is_unproven_and_its_numbers_agree(tmp_path: Path) -> None:
    """Constant counts prove nothing (rules/exchanged_rows.lp reads exchanged histograms):
    unproven, and the simulation rebuilds the output (so the counts match and the case itself is
    right)."""
    report = verify_dir(_verify_case(tmp_path / "ok"))
    assert report.verdict == "unproven", report.verdict
    assert report.collective_mismatches == []
    assert report.numeric is not None and report.numeric.status == "agrees", report.numeric


def test_a_count_mismatch_is_refuted_naming_it(tmp_path: Path) -> None:
    """Rank 1 expects 1 row from rank 0, which sends 2: refuted by the simulator, the report
    naming the call, both ranks and both counts."""
    report = verify_dir(_verify_case(tmp_path / "bad", recv1=[1, 2]))
    assert report.verdict == "refuted", report.numeric
    num = report.numeric
    assert num is not None and num.status == "program_error"
    assert "mismatched collective counts" in num.summary and "declared relations" in num.summary, num.summary
    assert "rank 0 (rank 0 node 'dispatch') sends 2 rows to rank 1 (send_counts[1] = 2) but rank 1 (rank 1 node " \
           "'dispatch') expects 1 from rank 0 (recv_counts[0] = 1)" in (num.simulation_error or ""), num.simulation_error


def test_counts_from_made_up_inputs_are_no_counterexample(tmp_path: Path) -> None:
    """Counts are values: where they come from a rank input with no declared relation (made-up
    values in the simulation), their disagreeing is no counterexample, the verdict stays
    unproven; the same counts as stated constants are refuted."""
    d = _verify_case(tmp_path / "free", recv1=[1, 2])
    model = onnx.load(d / "rank1.onnx")
    init = next(i for i in model.graph.initializer if i.name == "recv")
    model.graph.initializer.remove(init)
    model.graph.input.append(helper.make_tensor_value_info("recv", INT64, [2]))  # (rank 1 only: no relation)
    onnx.save(model, d / "rank1.onnx")
    report = verify_dir(d)
    assert report.verdict == "unproven", report.numeric
    assert report.numeric is not None and report.numeric.status == "inconclusive", report.numeric
    assert "recv" in report.numeric.summary and "made-up values" in report.numeric.summary, report.numeric.summary


def test_the_cli_says_unproven_and_refuted(tmp_path: Path) -> None:
    ok = runner.invoke(app, ["verify", str(_verify_case(tmp_path / "ok"))])
    bad = runner.invoke(app, ["verify", str(_verify_case(tmp_path / "bad", recv1=[2, 3]))])
    assert ok.output.startswith("ok: UNPROVEN"), ok.output
    assert bad.output.startswith("bad: REFUTED") and "mismatched collective counts" in bad.output, bad.output
    assert "(recv_counts[1] = 3)" in bad.output, bad.output
    assert ok.exit_code not in (0, 2) and bad.exit_code not in (0, 2), (ok.exit_code, bad.exit_code)


# --- (d) bad input ---------------------------------------------------------------------------


def _edit(path: Path, fn) -> None:
    model = onnx.load(str(path))
    fn(model)
    onnx.save(model, str(path))  # no checker: the point is to write broken models


def _node(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.domain == dist.DIST_DOMAIN)


def _drop_attr(name: str):
    def fn(model: onnx.ModelProto) -> None:
        node = _node(model)
        keep = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(keep)
    return fn


def _drop_input(model: onnx.ModelProto) -> None:
    del _node(model).input[2]


def _counts(value: np.ndarray):
    def fn(model: onnx.ModelProto) -> None:
        init = next(i for i in model.graph.initializer if i.name == "recv")
        init.CopyFrom(numpy_helper.from_array(value, "recv"))
    return fn


def _group(group: list[int]):
    def fn(model: onnx.ModelProto) -> None:
        for a in _node(model).attribute:
            if a.name == "group":
                del a.ints[:]
                a.ints.extend(group)
    return fn


@pytest.mark.parametrize(("edit", "words"), [
    (_drop_attr("group"), "group"),
    (_drop_attr("out_rows"), "out_rows"),
    (_drop_input, "has input size 2 not in range [min=3, max=3]"),
    (_counts(np.array([2, 2, 0], np.int64)), "recv_counts has shape [3], not [2]"),
    (_counts(np.array([2.0, 2.0], np.float32)), "recv_counts has element type float32, not int64"),
    (_group([0]), "rank 1 calls it but is not in its group [0]"),
    (lambda m: next(a for a in _node(m).attribute if a.name == "out_rows").__setattr__("i", -1),
     "out_rows -1 is not a non-negative integer"),
], ids=["no-group", "no-out_rows", "two-inputs", "counts-length", "counts-float", "not-in-group", "negative-out_rows"])
def test_bad_alltoallv_is_one_line_exit_2(tmp_path: Path, edit, words: str) -> None:
    d = _verify_case(tmp_path / "m")
    _edit(d / "rank1.onnx", edit)
    result = runner.invoke(app, ["verify", str(d)])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"refine: error: {d / 'rank1.onnx'}: "), lines[0]
    assert words in lines[0], lines[0]
    assert "Traceback" not in result.output


# --- (e) a member that never makes the call ----------------------------------------------------


def test_a_member_that_skips_the_call_is_refused(tmp_path: Path) -> None:
    """Rank 1 computes its rows itself and never calls the AllToAllV rank 0 waits in: the static
    call check names the missing call, and the simulator refutes it as a deadlock."""
    d = _verify_case(tmp_path / "skip", skip_on=1)
    static = verify_dir(d, simulate=False)
    assert static.verdict == "unproven"
    assert static.collective_mismatches == ["group [0, 1] call #0: rank 1 never makes it"], static.collective_mismatches
    report = verify_dir(d)
    assert report.verdict == "refuted", report.numeric
    assert report.numeric is not None and report.numeric.status == "program_error"
    assert "deadlock" in (report.numeric.simulation_error or "") and "AllToAllV" in report.numeric.simulation_error


def test_members_that_disagree_on_out_rows_are_refused(tmp_path: Path) -> None:
    """out_rows is an attribute the members must agree on, as any collective's."""
    d = _verify_case(tmp_path / "rows")
    _edit(d / "rank1.onnx", lambda m: next(a for a in _node(m).attribute if a.name == "out_rows").__setattr__("i", 6))
    report = verify_dir(d, simulate=False)
    assert report.verdict == "unproven"
    assert report.collective_mismatches == ["group [0, 1] call #0: members disagree on the op or its attributes"], \
        report.collective_mismatches


def _dead_call_case(d: Path, recv1: list[int]) -> Path:
    """The ranks slice their own rows of x (which verifies) and also make an AllToAllV whose
    result nothing reads, rank 1 with recv_counts `recv1`."""
    _verify_case(d)
    for r in range(2):
        model = onnx.load(str(d / f"rank{r}.onnx"))
        nodes = [dist.all_to_all_v("x", "send", "recv", "buf", [0, 1], 5, name="dispatch"),
                 helper.make_node("Slice", ["x", "own_starts", "own_ends", "axes"], ["y"], name="own")]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        if r == 1:
            _counts(np.array(recv1, np.int64))(model)
        onnx.save(model, str(d / f"rank{r}.onnx"))
    return d


@pytest.mark.parametrize("recv1", [[2, 2], [1, 2]], ids=["counts-agree", "counts-disagree"])
def test_a_call_no_output_reads_still_keeps_verified_out(tmp_path: Path, recv1: list[int]) -> None:
    """Every output is proved without the AllToAllV, but its counts are values no lemma checks
    (a real job hangs on disagreeing ones): never verified; the simulator refutes the
    disagreeing twin."""
    d = _dead_call_case(tmp_path / "m", recv1)
    static = verify_dir(d, simulate=False)
    assert all(o.ok for o in static.outputs)
    assert static.verdict == "unproven"
    assert static.failure is not None and "no lemma proves that the members' counts agree" in static.failure.reason
    report = verify_dir(d)
    if recv1 == [2, 2]:
        assert report.verdict == "unproven" and report.numeric is not None and report.numeric.status == "agrees"
    else:
        assert report.verdict == "refuted" and "(recv_counts[0] = 1)" in (report.numeric.simulation_error or "")


def _layer_program(rank: int | None) -> Graph:
    """y = Relu(x), x [4, 3]; on a rank the layer also makes an AllToAllV of x that nothing reads
    (counts [2, 2] both ways: they agree)."""
    g = Graph()
    x = g.input("x", [4, 3])
    if rank is not None:
        g.nodes.append(dist.all_to_all_v(x, g.ints([2, 2]), g.ints([2, 2]), f"buf{rank}", [0, 1], 5, name="dispatch"))
    g.output(g.op("Relu", x))
    return g


def test_a_call_inside_a_layer_function_keeps_verified_out(tmp_path: Path) -> None:
    """The same guard where memoization hides the call in a layer template (two calls of one
    layer function per program): every output is proved, the AllToAllV inside the layer is
    still a call no lemma checks, so the program is not verified."""
    case = Case("layered", _layer_program(None), [_layer_program(0), _layer_program(1)], {"x": {"layout": "rep"}})
    d = case.save(tmp_path / "layered", layer_calls=2)
    rank0 = onnx.load(str(d / "rank0.onnx"))
    assert rank0.functions and any(n.op_type == "AllToAllV" for f in rank0.functions for n in f.node)
    report = verify_dir(d, simulate=False)
    assert all(o.ok for o in report.outputs), report.outputs
    assert report.verdict == "unproven"
    assert report.failure is not None and "no lemma proves that the members' counts agree" in report.failure.reason
