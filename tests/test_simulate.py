"""The dist domain and the multi-rank reference executor: the ground truth lemmas are tested on."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from refine import dist

from refine.diagnose import simulate
from refine.config import ModelConfig
from refine.diagnose.simulate import SimulationError, make_feeds, run_programs, simulate_dir

FLOAT = TensorProto.FLOAT
FAST = 5.0  # seconds: failures must be reported promptly, never by hanging


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, list[int]],
    outputs: dict[str, list[int]],
    inits: dict[str, np.ndarray] | None = None,
    elem: int = FLOAT,
) -> onnx.ModelProto:
    """A checked opset-18 + dist model with float inputs and outputs."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, elem, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, elem, s) for n, s in outputs.items()],
        initializer=[numpy_helper.from_array(v, n) for n, v in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), dist.dist_opset()])
    dist.register_schemas()
    onnx.checker.check_model(model, full_check=False)
    return model


def identity_seq(shape: list[int]) -> onnx.ModelProto:
    return make_model([helper.make_node("Identity", ["X"], ["Y"])], {"X": shape}, {"Y": shape})


def one_collective(node: onnx.NodeProto, in_shape: list[int], out_shape: list[int]) -> onnx.ModelProto:
    return make_model([node], {"X": in_shape}, {"Y": out_shape})


def run_collective(
    nodes: list[onnx.NodeProto], xs: list[np.ndarray], out_shape: list[int]
) -> list[np.ndarray]:
    """Run one collective node per rank on the given per-rank inputs; each rank's Y."""
    ranks = [one_collective(n, list(x.shape), out_shape) for n, x in zip(nodes, xs)]
    seq_x = xs[0]
    res = run_programs(identity_seq(list(seq_x.shape)), ranks, {"X": seq_x}, [{"X": x} for x in xs])
    return [r["Y"] for r in res.ranks]


def asym(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) + 0.5).astype(np.float32)


# --------------------------------------------------------------------------------------------
# dist domain


@pytest.mark.parametrize(
    "node",
    [
        dist.all_reduce("X", "Y", [0, 1], reduce_op="max"),
        dist.all_gather("X", "Y", [0, 1], axis=-1),
        dist.reduce_scatter("X", "Y", [1, 0], axis=0),
        dist.all_to_all("X", "Y", [0, 1], split_axis=0, concat_axis=1),
        dist.broadcast("X", "Y", [0, 1], root=1),
        dist.send("X", "Y", peer=1, tag=3),
        dist.recv("X", "Y", peer=0),
    ],
    ids=lambda n: n.op_type,
)
def test_checker_accepts_each_dist_op(node: onnx.NodeProto) -> None:
    out = dist.output_shape(node.op_type, dist.node_attrs(node), [4, 6], 2)
    model = make_model([node], {"X": [4, 6]}, {"Y": out})
    dist.register_schemas()  # idempotent
    onnx.checker.check_model(model, full_check=False)
    assert node.domain == dist.DIST_DOMAIN


def test_checker_rejects_missing_required_attribute() -> None:
    node = helper.make_node("AllGather", ["X"], ["Y"], domain=dist.DIST_DOMAIN, group=[0, 1])
    with pytest.raises(onnx.checker.ValidationError, match="axis"):
        make_model([node], {"X": [2]}, {"Y": [4]})


def test_node_attrs_and_output_shape() -> None:
    assert dist.node_attrs(dist.all_reduce("a", "b", (3, 1))) == {"group": [3, 1], "reduce_op": "sum"}
    a2a = dist.node_attrs(dist.all_to_all("a", "b", [0, 1, 2], split_axis=-1, concat_axis=0))
    assert a2a == {"split_axis": -1, "concat_axis": 0, "group": [0, 1, 2]}
    assert dist.output_shape("AllToAll", a2a, [2, 9], 3) == [6, 3]
    assert dist.output_shape("AllReduce", {}, [5, 7], 4) == [5, 7]
    assert dist.output_shape("AllGather", {"axis": -2}, [5, 7], 4) == [20, 7]
    assert dist.output_shape("ReduceScatter", {"axis": 1}, [5, 8], 4) == [5, 2]
    with pytest.raises(ValueError, match="divisible"):
        dist.output_shape("ReduceScatter", {"axis": 0}, [5, 8], 4)
    with pytest.raises(ValueError, match="out of range"):
        dist.output_shape("AllGather", {"axis": 2}, [5, 8], 4)
    with pytest.raises(ValueError):
        dist.all_reduce("a", "b", [0], reduce_op="prod")


# --------------------------------------------------------------------------------------------
# tensor parallel MatMul: the rank programs compute the sequential value


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_matmul_all_gather(world: int) -> None:
    rng = np.random.default_rng(world)
    b, k, n = (int(v) for v in rng.integers(2, 6, size=3))
    seq = make_model(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        {"X": [b, k]},
        {"Y": [b, n * world]},
        inits={"W": np.zeros((k, n * world), np.float32)},  # must be overridden by the feeds
    )
    rank = make_model(
        [helper.make_node("MatMul", ["X", "W"], ["P"]), dist.all_gather("P", "Y", range(world), axis=-1)],
        {"X": [b, k], "W": [k, n]},
        {"Y": [b, n * world]},
    )
    config = ModelConfig.model_validate(
        {"world_size": world, "inputs": {"X": {"layout": "rep"}, "W": {"layout": "shard", "axis": 1}}}
    )
    seq_feeds, rank_feeds = make_feeds(seq, [rank] * world, config, rng)
    res = run_programs(seq, [rank] * world, seq_feeds, rank_feeds)
    assert np.abs(res.seq["W"]).min() > 0  # the declared initializer was overridden
    np.testing.assert_allclose(res.seq["Y"], res.seq["X"] @ res.seq["W"], rtol=1e-5)
    for values in res.ranks:
        np.testing.assert_allclose(values["Y"], res.seq["Y"], rtol=1e-5, atol=1e-6)
        assert "P" in values and "W" in values  # intermediates and inputs are recorded


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_matmul_all_reduce(world: int) -> None:
    rng = np.random.default_rng(10 + world)
    b, k, n = int(rng.integers(2, 6)), world * int(rng.integers(1, 4)), int(rng.integers(2, 6))
    seq = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], {"X": [b, k], "W": [k, n]}, {"Y": [b, n]})
    rank = make_model(
        [helper.make_node("MatMul", ["X", "W"], ["P"]), dist.all_reduce("P", "Y", range(world))],
        {"X": [b, k // world], "W": [k // world, n]},
        {"Y": [b, n]},
    )
    config = ModelConfig.model_validate(
        {"world_size": world, "inputs": {"X": {"layout": "shard", "axis": -1}, "W": {"layout": "shard", "axis": 0}}}
    )
    seq_feeds, rank_feeds = make_feeds(seq, [rank] * world, config, rng)
    res = run_programs(seq, [rank] * world, seq_feeds, rank_feeds)
    for values in res.ranks:
        np.testing.assert_allclose(values["Y"], res.seq["Y"], rtol=1e-5, atol=1e-5)
    assert not np.allclose(res.ranks[0]["P"], res.seq["Y"])  # the partial products really are partial


# --------------------------------------------------------------------------------------------
# collective semantics against hand-computed numpy


@pytest.mark.parametrize("reduce_op", ["sum", "max", "min", "avg"])
def test_all_reduce_ops(reduce_op: str) -> None:
    rng = np.random.default_rng(1)
    xs = [asym(rng, 3, 4) for _ in range(3)]
    ys = run_collective([dist.all_reduce("X", "Y", [0, 1, 2], reduce_op=reduce_op)] * 3, xs, [3, 4])
    expected = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}[reduce_op](np.stack(xs), axis=0)
    for y in ys:
        np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_all_gather_uses_group_order_and_subgroups() -> None:
    rng = np.random.default_rng(2)
    xs = [asym(rng, 2, 3) for _ in range(4)]
    groups = {0: [2, 0], 2: [2, 0], 1: [3, 1], 3: [3, 1]}
    nodes = [dist.all_gather("X", "Y", groups[r], axis=1) for r in range(4)]
    ys = run_collective(nodes, xs, [2, 6])
    for r in range(4):
        np.testing.assert_array_equal(ys[r], np.concatenate([xs[m] for m in groups[r]], axis=1))


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter(world: int) -> None:
    rng = np.random.default_rng(3)
    group = [int(r) for r in rng.permutation(world)]
    xs = [asym(rng, 2, 3 * world) for _ in range(world)]
    ys = run_collective([dist.reduce_scatter("X", "Y", group, axis=-1)] * world, xs, [2, 3])
    chunks = np.split(np.sum(np.stack(xs).astype(np.float64), axis=0), world, axis=1)
    for j, r in enumerate(group):
        np.testing.assert_allclose(ys[r], chunks[j], rtol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all(world: int) -> None:
    rng = np.random.default_rng(4)
    group = [int(r) for r in rng.permutation(world)]
    xs = [asym(rng, 2 * world, 3) for _ in range(world)]
    ys = run_collective(
        [dist.all_to_all("X", "Y", group, split_axis=0, concat_axis=1)] * world, xs, [2, 3 * world]
    )
    for j, r in enumerate(group):
        received = [np.split(xs[i], world, axis=0)[j] for i in group]
        np.testing.assert_array_equal(ys[r], np.concatenate(received, axis=1))


def test_calls_match_by_order_within_group() -> None:
    """Groups are independent channels: ranks 2 and 3 do their pair call first, 0 and 1 last."""
    rng = np.random.default_rng(5)
    xs = [asym(rng, 2, 2) for _ in range(4)]
    world, ranks = [0, 1, 2, 3], []
    for r in range(4):
        pair = [r - r % 2, r - r % 2 + 1]
        if r < 2:
            nodes = [dist.all_reduce("X", "A", world), dist.all_reduce("A", "Y", pair, reduce_op="max")]
        else:
            nodes = [dist.all_reduce("X", "A", pair, reduce_op="max"), dist.all_reduce("A", "Y", world)]
        ranks.append(make_model(nodes, {"X": [2, 2]}, {"Y": [2, 2]}))
    res = run_programs(identity_seq([2, 2]), ranks, {"X": xs[0]}, [{"X": x} for x in xs])
    expected = xs[0] + xs[1] + 2 * np.maximum(xs[2], xs[3])
    for values in res.ranks:
        np.testing.assert_allclose(values["Y"], expected, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# failures are SimulationErrors, reported promptly


def loose_model(nodes: list[onnx.NodeProto], shape: list[int]) -> onnx.ModelProto:
    """A rank model with an undeclared output shape (these runs are expected to fail)."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", FLOAT, shape)],
        [helper.make_tensor_value_info(nodes[-1].output[0], FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), dist.dist_opset()])


def assert_fails_fast(
    match: str, programs: list[list[onnx.NodeProto]], shapes: list[list[int]] | None = None
) -> SimulationError:
    rng = np.random.default_rng(6)
    shapes = shapes or [[2, 2]] * len(programs)
    ranks = [loose_model(nodes, shape) for nodes, shape in zip(programs, shapes)]
    start = time.monotonic()
    with pytest.raises(SimulationError, match=match) as info:
        run_programs(identity_seq([2, 2]), ranks, {"X": asym(rng, 2, 2)}, [{"X": asym(rng, *s)} for s in shapes])
    assert time.monotonic() - start < FAST
    return info.value


def test_mismatched_reduce_op() -> None:
    assert_fails_fast("mismatched.*reduce_op", [[dist.all_reduce("X", "Y", [0, 1])], [dist.all_reduce("X", "Y", [0, 1], "max")]])


def test_mismatched_op_type() -> None:
    assert_fails_fast(
        "mismatched.*AllReduce vs AllGather",
        [[dist.all_reduce("X", "Y", [0, 1])], [dist.all_gather("X", "Y", [0, 1], axis=0)]],
    )


def test_mismatched_shapes() -> None:
    node = dist.all_gather("X", "Y", [0, 1], axis=0)
    assert_fails_fast("mismatched.*shape", [[node], [node]], shapes=[[2, 2], [2, 3]])


def test_indivisible_reduce_scatter() -> None:
    node = dist.reduce_scatter("X", "Y", [0, 1], axis=0)
    assert_fails_fast("not divisible", [[node], [node]], shapes=[[3, 2], [3, 2]])


def test_fewer_calls_is_a_deadlock() -> None:
    twice = [dist.all_reduce("X", "A", [0, 1]), dist.all_reduce("A", "Y", [0, 1])]
    assert_fails_fast(r"deadlock.*rank 0 waits.*rank 1 \(finished\)", [twice, twice[:1]])


def test_crossed_call_order_is_a_deadlock() -> None:
    a, b = [0, 1], [1, 0]  # same members, but different groups (group order matters)
    assert_fails_fast(
        "deadlock",
        [
            [dist.all_reduce("X", "A", a), dist.all_reduce("A", "Y", b)],
            [dist.all_reduce("X", "A", b), dist.all_reduce("A", "Y", a)],
        ],
    )


def test_rank_outside_its_group() -> None:
    node = dist.all_reduce("X", "Y", [0])
    assert_fails_fast("rank 1 calls it but is not in its group \\[0\\]", [[node], [node]])


def test_failing_rank_releases_the_others() -> None:
    bad = [helper.make_node("MatMul", ["X", "X"], ["P"]), dist.all_reduce("P", "Y", [0, 1])]
    err = assert_fails_fast("rank 1 failed", [[dist.all_reduce("X", "Y", [0, 1])], bad], shapes=[[2, 3], [2, 3]])
    assert err.__cause__ is not None


def test_collective_in_sequential_model() -> None:
    seq = loose_model([dist.all_reduce("X", "Y", [0])], [2])
    with pytest.raises(SimulationError, match="sequential"):
        run_programs(seq, [seq], {"X": np.ones(2, np.float32)}, [{"X": np.ones(2, np.float32)}])


def test_timeout_backstop() -> None:
    """A partner that is still running (neither blocked nor finished) is waited for only so long."""
    comm = simulate._Communicator(2, timeout=0.2)
    with pytest.raises(SimulationError):
        comm.exchange(0, dist.all_reduce("X", "Y", [0, 1]), np.ones(2, np.float32))
    assert comm.failure is not None and "timed out" in str(comm.failure[1])


# --------------------------------------------------------------------------------------------
# feeds


@pytest.mark.parametrize("world", [2, 4])
def test_make_feeds_layouts(world: int) -> None:
    rng = np.random.default_rng(7)
    sizes = [1, 5] if world == 2 else [0, 1, 2, 3]
    seq_inputs = {"A": [6, 4], "B": [3, 2 * world], "S": [3, 4], "M": [3, 4], "R": [5], "U": [2, 2]}
    seq = make_model(
        [helper.make_node("Identity", ["A"], ["Y"])],
        seq_inputs,
        {"Y": [6, 4]},
        inits={"C": np.ones(3, np.float32), "S": np.zeros((3, 4), np.float32)},
    )
    config = ModelConfig.model_validate(
        {
            "world_size": world,
            "inputs": {
                "A": {"layout": "shard", "axis": 0, "sizes": sizes},
                "B": {"layout": "shard", "axis": -1},
                "S": {"layout": "partial"},
                "M": {"layout": "partial", "op": "max"},
                "R": {"layout": "rep"},
            },
        }
    )
    ranks = []
    for r in range(world):
        inputs = {"A": [sizes[r], 4], "B": [3, 2], "S": [3, 4], "M": [3, 4], "R": [5], "U": [2, 2], "V": [3]}
        ranks.append(make_model([helper.make_node("Identity", ["A"], ["Y"])], inputs, {"Y": [sizes[r], 4]}))
    seq_feeds, rank_feeds = make_feeds(seq, ranks, config, rng)

    assert set(seq_feeds) == set(seq_inputs)  # "C" is an undeclared initializer: not fed
    assert all(v.dtype == np.float32 for v in seq_feeds.values())
    starts = np.cumsum([0] + sizes)
    for r, feeds in enumerate(rank_feeds):
        np.testing.assert_array_equal(feeds["A"], seq_feeds["A"][starts[r] : starts[r + 1]])
        np.testing.assert_array_equal(feeds["B"], seq_feeds["B"][:, 2 * r : 2 * r + 2])
        np.testing.assert_array_equal(feeds["R"], seq_feeds["R"])
        np.testing.assert_array_equal(feeds["U"], seq_feeds["U"])  # same name and shape: replicated
        assert feeds["V"].shape == (3,)
    parts = np.stack([f["S"] for f in rank_feeds])
    np.testing.assert_allclose(parts.astype(np.float64).sum(axis=0), seq_feeds["S"], atol=1e-5)
    assert not np.allclose(parts[0], seq_feeds["S"] / world)  # summands are not a symmetric split
    maxes = np.stack([f["M"] for f in rank_feeds])
    assert (maxes <= seq_feeds["M"]).all()
    np.testing.assert_array_equal(maxes.max(axis=0), seq_feeds["M"])
    assert all((m == seq_feeds["M"]).any() and (m < seq_feeds["M"]).any() for m in maxes)


def test_make_feeds_integer_inputs() -> None:
    rng = np.random.default_rng(8)
    seq = make_model([helper.make_node("Identity", ["I"], ["O"])], {"I": [4, 3]}, {"O": [4, 3]}, elem=TensorProto.INT64)
    rank = make_model([helper.make_node("Identity", ["I"], ["O"])], {"I": [4, 3]}, {"O": [4, 3]}, elem=TensorProto.INT64)
    config = ModelConfig.model_validate({"world_size": 2, "inputs": {"I": {"layout": "partial"}}})
    seq_feeds, rank_feeds = make_feeds(seq, [rank, rank], config, rng)
    assert seq_feeds["I"].dtype == np.int64 and rank_feeds[1]["I"].dtype == np.int64
    np.testing.assert_array_equal(rank_feeds[0]["I"] + rank_feeds[1]["I"], seq_feeds["I"])


def test_simulate_dir(tmp_path: Path) -> None:
    world, rng = 2, np.random.default_rng(9)
    k, n = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    seq = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], {"X": [3, k]}, {"Y": [3, n * world]},
                     inits={"W": np.zeros((k, n * world), np.float32)})
    rank_nodes = [helper.make_node("MatMul", ["X", "W"], ["P"]), dist.all_gather("P", "Y", [0, 1], axis=1)]
    for r in range(world):
        w = np.zeros((k, n), np.float32)
        onnx.save(make_model(rank_nodes, {"X": [3, k]}, {"Y": [3, n * world]}, inits={"W": w}), tmp_path / f"rank{r}.onnx")
    onnx.save(seq, tmp_path / "seq.onnx")
    (tmp_path / "refine.json").write_text(
        json.dumps({"world_size": world, "inputs": {"X": {"layout": "rep"}, "W": {"layout": "shard", "axis": 1}}})
    )
    first, again = simulate_dir(tmp_path, seed=3), simulate_dir(tmp_path, seed=3)
    assert np.abs(first.seq["Y"]).sum() > 0
    for values in first.ranks:
        np.testing.assert_allclose(values["Y"], first.seq["Y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(first.seq["Y"], again.seq["Y"])


def test_counterexamples_do_not_depend_on_the_hash_seed(tmp_path):
    """Every random draw follows the seed, in file order: the same directory gives the same
    counterexample whatever PYTHONHASHSEED is (weights stored as declared initializers, as
    exported models hold them, were once drawn in a set's order)."""
    import os
    import shutil
    import subprocess
    import sys

    d = tmp_path / "m"
    shutil.copytree(Path(__file__).resolve().parent.parent / "examples" / "mlp_bias_before_allreduce", d)
    for path in sorted(d.glob("*.onnx")):
        model = onnx.load(str(path))
        weights = [vi for vi in model.graph.input if vi.name != "x"]
        assert len(weights) >= 3
        for vi in weights:
            dims = [dim.dim_value for dim in vi.type.tensor_type.shape.dim]
            model.graph.initializer.append(numpy_helper.from_array(np.zeros(dims, np.float32), vi.name))
            model.graph.input.remove(vi)
        onnx.save(model, str(path))
    summaries = set()
    for hash_seed in ("1", "2", "3"):
        out = tmp_path / f"r{hash_seed}.json"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run([sys.executable, "-m", "refine.cli.main", "verify", str(d), "--json", str(out)],
                              env=env, capture_output=True, text=True)
        assert done.returncode == 1, done.stdout + done.stderr
        summaries.add(json.loads(out.read_text())["numeric"]["summary"])
    assert len(summaries) == 1, summaries


def test_a_simulation_over_the_memory_cap_is_not_run(tmp_path):
    """--sim-memory: the search is skipped up front, in one clear line, when its values would
    not fit (a large model's bug was once UNPROVEN with a MemoryError after 49 s); the
    estimate counts a layer's body once per call."""
    from refine.diagnose import counterexample
    from refine.lowering.program import lower_program
    from refine.pipeline import verify_dir

    examples = Path(__file__).resolve().parent.parent / "examples"
    buggy = examples / "mlp_bias_before_allreduce"
    report = verify_dir(buggy, sim_memory_gib=1e-6)
    assert report.verdict == "unproven" and report.numeric.status == "not_run"
    assert "--sim-memory allows" in report.numeric.summary and "\n" not in report.numeric.summary
    assert verify_dir(buggy).verdict == "refuted"  # under the default cap it runs
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("examples_layered_sim", examples / "layered.py")
    layered = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("examples_layered_sim", layered)
    spec.loader.exec_module(layered)
    two, eight = (counterexample.simulation_bytes(lower_program(layered.write(tmp_path / f"l{n}", n, 2)))
                  for n in (2, 8))
    flat = counterexample.simulation_bytes(lower_program(layered.write(tmp_path / "flat8", 8, 2, flat=True)))
    assert 3 * two < eight and abs(eight - flat) < 0.25 * flat, (two, eight, flat)


# --------------------------------------------------------------------------------------------
# point-to-point calls and Broadcast


def test_send_reaches_the_matching_recv() -> None:
    """The k-th Send of a (sender, receiver, tag) channel meets the receiver's k-th Recv on it;
    tags keep two channels between the same ranks apart, whatever the program order."""
    rng = np.random.default_rng(3)
    x0, x1 = asym(rng, 2, 3), asym(rng, 2, 3)
    rank0 = make_model([dist.send("X", "A", peer=1, tag=7), dist.send("A", "B", peer=1, tag=2),
                        helper.make_node("Identity", ["B"], ["Y"])], {"X": [2, 3]}, {"Y": [2, 3]})
    rank1 = make_model([dist.recv("X", "P", peer=0, tag=2), dist.recv("X", "Q", peer=0, tag=7),
                        helper.make_node("Sub", ["P", "Q"], ["Y"])], {"X": [2, 3]}, {"Y": [2, 3]})
    with pytest.raises(SimulationError, match="deadlock.*Send/Recv call #0 from rank 0 to rank 1 \\(tag 7\\)"):
        run_programs(identity_seq([2, 3]), [rank0, rank1], {"X": x0}, [{"X": x0}, {"X": x1}])
    rank1 = make_model([dist.recv("X", "Q", peer=0, tag=7), dist.recv("X", "P", peer=0, tag=2),
                        helper.make_node("Sub", ["P", "Q"], ["Y"])], {"X": [2, 3]}, {"Y": [2, 3]})
    res = run_programs(identity_seq([2, 3]), [rank0, rank1], {"X": x0}, [{"X": x0}, {"X": x1}])
    np.testing.assert_array_equal(res.ranks[0]["Y"], x0)
    np.testing.assert_array_equal(res.ranks[1]["Y"], np.zeros_like(x0))  # both carried rank 0's X


def test_broadcast_gives_the_root_value() -> None:
    rng = np.random.default_rng(4)
    xs = [asym(rng, 3, 2) for _ in range(3)]
    ys = run_collective([dist.broadcast("X", "Y", [2, 0, 1], root=1)] * 3, xs, [3, 2])
    for y in ys:
        np.testing.assert_array_equal(y, xs[1])


def test_crossed_sends_are_a_deadlock() -> None:
    """Both ranks send first: a send completes only when its receive is posted (NCCL's rendezvous)."""
    assert_fails_fast(
        "deadlock: rank 0 waits in Send/Recv call #0 from rank 0 to rank 1",
        [[dist.send("X", "A", peer=1), dist.recv("X", "Y", peer=1)],
         [dist.send("X", "A", peer=0), dist.recv("X", "Y", peer=0)]],
    )


def test_send_without_recv_is_a_deadlock() -> None:
    assert_fails_fast(r"deadlock.*rank 1 \(finished\)",
                      [[dist.send("X", "Y", peer=1)], [helper.make_node("Identity", ["X"], ["Y"])]])


def test_recv_into_a_buffer_of_another_shape() -> None:
    assert_fails_fast("mismatched.*shape \\[2, 2\\] vs \\[2, 3\\]", [[dist.send("X", "Y", peer=1)], [dist.recv("X", "Y", peer=0)]],
                      shapes=[[2, 2], [2, 3]])


@pytest.mark.parametrize(("node", "why"), [
    (dist.send("X", "Y", peer=2), "peer 2 is outside 0..1"),
    (dist.send("X", "Y", peer=0), "rank 0 names itself"),
    (dist.recv("X", "Y", peer=1, tag=-1), "tag -1 is negative"),
    (dist.broadcast("X", "Y", [0, 1], root=3), "root 3 is not in its group"),
])
def test_malformed_point_to_point_calls(node: onnx.NodeProto, why: str) -> None:
    assert_fails_fast(why, [[node], [helper.make_node("Identity", ["X"], ["Y"])]])
