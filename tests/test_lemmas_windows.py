"""Numeric witnesses for batch windows (rules/windows.lp): on a DP x TP mesh every rank holds a TP
layout of its DP row's batch chunk, and the TP lemmas meet it on virtual chunks of the sequential
program.

Each witness runs on a 2-D mesh (dp, tp) in both dim orders, random sizes and degrees, and asserts
that the lemmas fired, that everything derived (chunks included: their values are the sequential
values' chunks) held in the multi-rank simulator, no sanity violation, and the verdict. Each
negative is a program whose numbers differ and that must not verify: an all-reduce over the
wrong mesh dim (BUGS.md class 11: the forward's TP reduction over the DP group, a gradient's DP
reduction over the TP group), a reduction over the batch left local, ops that mix the batch (a
softmax along it), which no chunk may pass.

Covered: window (by a slice and by a broadcast), unwindow, chunk_term (a row's term of a sum over
the batch: a weight's gradient, a TP shard of it) with collectives.lp's allreduce_slices (the DP
all-reduce of those terms), and virtual nodes of every op family
windows.lp chunks: elementwise with broadcasting, MatMul (batch and row axes), Gather of chunked
ids, LayerNormalization, Reshape (merging the batch with the sequence and back), Transpose,
Softmax, a keepdims Reduce, Concat and Slice off the batch, Expand off the batch, constants
constant along the batch (a mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

from harness import Case, Graph, rep, run_case, shard, simulate
from refine.report.render import mesh_group_words
from test_lemmas_backward import dim, rng_for

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
MESHES = [(("dp", "tp"), 2, 2, 0), (("tp", "dp"), 2, 3, 1), (("dp", "tp"), 3, 2, 2)]


class Mesh:
    """A dp x tp mesh in either dim order (row-major ranks, as refine.json's mesh)."""

    def __init__(self, dims: tuple[str, str], dp: int, tp: int) -> None:
        self.dims, self.dp, self.tp = dims, dp, tp
        self.shape = [dp, tp] if dims == ("dp", "tp") else [tp, dp]
        self.world = dp * tp

    def coord(self, r: int) -> dict[str, int]:
        return dict(zip(self.dims, divmod(r, self.shape[1])))

    def group(self, r: int, along: str) -> list[int]:
        """The ranks that differ from r only in their `along` coordinate, in coordinate order."""
        other = "tp" if along == "dp" else "dp"
        return sorted((q for q in range(self.world) if self.coord(q)[other] == self.coord(r)[other]),
                      key=lambda q: self.coord(q)[along])

    def json(self) -> dict:
        return {"shape": self.shape, "dims": list(self.dims)}


In = tuple[list[int], dict, int]  # sequential shape, declared layout (with "over"), dtype


def over(layout: dict, dim_name: str) -> dict:
    return {**layout, "over": dim_name}


def local(shape: list[int], layout: dict, mesh: Mesh, r: int) -> list[int]:
    if layout["layout"] != "shard":
        return shape
    parts = mesh.dp if layout["over"] == "dp" else mesh.tp
    return [d // parts if a == layout["axis"] else d for a, d in enumerate(shape)]


def build(name: str, mesh: Mesh, inputs: dict[str, In], body: Callable[[Graph, dict, int | None], Any],
          outputs: dict[str, dict] | None = None) -> tuple[Case, Any]:
    """body(g, inputs, r) builds one side (r None: the sequential one)."""
    seq = Graph()
    ret = body(seq, {n: seq.input(n, s, d) for n, (s, _, d) in inputs.items()}, None)
    ranks = [Graph() for _ in range(mesh.world)]
    for r, g in enumerate(ranks):
        body(g, {n: g.input(n, local(s, lay, mesh, r), d) for n, (s, lay, d) in inputs.items()}, r)
    return Case(name, seq, ranks, {n: lay for n, (_, lay, _) in inputs.items()}, outputs=outputs or {},
                mesh=mesh.json()), ret


def witness(case: Case, seed: int, *lemmas: str) -> Any:
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    missing = set(lemmas) - out.checked.lemmas_checked
    assert not missing, f"not witnessed: {missing}; fired {sorted(out.lemmas_fired())}"
    assert out.derived.get("sanity") == [], out.derived.get("sanity")
    assert out.report.verdict == "verified", out.report.failure
    return out


def refused(case: Case, mesh: Mesh, seed: int) -> Any:
    """The ranks' outputs differ from the sequential one (as a replica, or as the DP rows' chunks),
    nothing wrong is derived, and the verdict is not verified."""
    sim = simulate(case, seed)
    want = sim.seq[case.seq.outputs[0]]
    pieces = [sim.ranks[r][g.outputs[0]] for r, g in enumerate(case.ranks)]
    rebuilt = [np.concatenate([pieces[q] for q in mesh.group(r, "dp")], axis=0) for r in range(mesh.world)]
    assert not any(v.shape == want.shape and np.allclose(v, want, atol=1e-5) for v in [*pieces, *rebuilt]), \
        "the negative case is not buggy"
    out = run_case(case, seed, closest_lemma=False)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == [], out.derived.get("sanity")
    assert out.report.verdict != "verified"
    return out


def gathered_over_tp(g: Graph, y: str, mesh: Mesh, r: int | None, axis: int) -> str:
    """y as the output: on a rank, its TP shards gathered along `axis` over its TP group (each row's chunk)."""
    return g.output(y if r is None else g.coll("AllGather", y, mesh.group(r, "tp"), axis=axis))


def batch(mesh: Mesh, rng: np.random.Generator) -> int:
    return mesh.dp * dim(rng, 1, 2)


# --- a transformer-ish block on a mesh ------------------------------------------------------

def block(mesh: Mesh, rng: np.random.Generator, reduce_over: str = "tp") -> tuple[dict[str, In], Callable]:
    """Embedding of chunked ids, LayerNorm, the batch merged with the sequence, a TP MLP
    (column then row parallel, all-reduced over `reduce_over`), back to [b, s, h], a residual, a
    transpose, a softmax and a keepdims mean off the batch, a concat, a slice and a pad off it."""
    b, s, h, v = batch(mesh, rng), dim(rng, 2, 3), dim(rng, 2, 4), dim(rng, 4, 7)
    f = mesh.tp * dim(rng, 1, 2)
    inputs: dict[str, In] = {
        "ids": ([b, s], over({**shard(0), "range": [0, v]}, "dp"), INT64),
        "emb": ([v, h], rep(), FLOAT), "gamma": ([h], rep(), FLOAT), "beta": ([h], rep(), FLOAT),
        "w1": ([h, f], over(shard(1), "tp"), FLOAT), "w2": ([f, h], over(shard(0), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        rows = b if r is None else b // mesh.dp
        e = g.op("Gather", x["emb"], x["ids"], axis=0)
        n = g.op("LayerNormalization", e, x["gamma"], x["beta"], axis=2)
        flat = g.op("Reshape", n, g.ints([rows * s, h]))
        y = g.op("MatMul", g.op("Relu", g.op("MatMul", flat, x["w1"])), x["w2"])
        if r is not None:
            y = g.coll("AllReduce", y, mesh.group(r, reduce_over))
        y = g.op("Add", g.op("Reshape", y, g.ints([rows, s, h])), e)
        t = g.op("Transpose", y, perm=[0, 2, 1])
        p = g.op("Softmax", t, axis=1)
        m = g.op("ReduceMean", p, g.ints([2]), keepdims=1)
        c = g.op("Concat", p, m, axis=2)
        padded = g.op("Pad", g.op("Slice", c, g.ints([1]), g.ints([s + 1]), g.ints([2])), g.ints([0, 1, 0, 0, 0, 1]))
        return g.output(padded)

    return inputs, body


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES)
def test_block_on_a_mesh(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """Every rank of a DP row refines that row's batch chunk; the output is rebuilt from the rows'
    chunks (declared: sharded over dp, each TP rank holding its row's replica)."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = block(mesh, rng_for("window_block", seed))
    case, y = build(f"window_block-{seed}", mesh, inputs, body)
    case.outputs = {y: over(shard(0), "dp")}
    witness(case, seed, "window", "unwindow", "gather", "norm", "reshape", "matmul_column_parallel",
            "matmul_row_parallel", "allreduce_sum", "elementwise", "transpose", "softmax", "reduce", "concat", "slice",
            "pad")


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_all_reduce_over_the_dp_dim_is_refused(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """Class 11: the row-parallel partial sums all-reduced over the DP group (the mesh column)
    add pieces of different batch chunks: not verified, and the report shows the chunks."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = block(mesh, rng_for("window_block", seed), reduce_over="dp")
    case, _ = build(f"window_wrong_group-{seed}", mesh, inputs, body)
    out = refused(case, mesh, seed)
    call = next(c for c in out.report.failure.collectives if c.group == mesh.group(0, "dp"))
    assert call.mesh_group == f"the dp group of tp={mesh.coord(0)['tp']}"
    assert call.fits == mesh.group(0, "tp") and call.fits_mesh_group == "the tp group of dp=0", call


# --- constants and broadcasts along the batch -----------------------------------------------

@pytest.mark.parametrize("dims,dp,tp,seed", MESHES)
def test_mask_constant_along_the_batch(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """A mask with equal rows for every batch row, as a constant of each side's own rows and as an
    Expand of one row: the chunk of the constant is the rank's constant (a virtual constant), and
    the expanded row is any rows of it (window by a broadcast)."""
    mesh = Mesh(dims, dp, tp)
    rng = rng_for("window_mask", seed)
    b, s, h = batch(mesh, rng), dim(rng, 2, 4), mesh.tp * dim(rng, 1, 2)
    row = rng.standard_normal((1, s, 1)).astype(np.float32)
    inputs: dict[str, In] = {"x": ([b, s, h], over(shard(0), "dp"), FLOAT), "w": ([h, h], over(shard(1), "tp"), FLOAT),
                             "m": ([1, s, 1], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        rows = b if r is None else b // mesh.dp
        masked = g.op("Add", x["x"], g.const(np.repeat(row, rows, axis=0)))
        expanded = g.op("Expand", x["m"], g.ints([rows, s, 1]))
        return gathered_over_tp(g, g.op("MatMul", g.op("Mul", masked, expanded), x["w"]), mesh, r, axis=2)

    case, y = build(f"window_mask-{seed}", mesh, inputs, body)
    case.outputs = {y: over(shard(0), "dp")}
    witness(case, seed, "window", "unwindow", "expand_broadcast", "allgather", "matmul_column_parallel")


# --- reductions over the batch ---------------------------------------------------------------

@pytest.mark.parametrize("dims,dp,tp,seed", MESHES)
def test_batch_sum_reduced_over_the_dp_dim(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """A sum over the batch (a loss, a gradient's contraction over tokens) leaves the chunks: each
    rank's chunk sum is a piece of the whole sum, all-reduced over the DP group; a MatMul
    contracting over the batch likewise. (Only a replica of a chunk leaves it: a TP shard of a
    chunk is a slice along two axes, which no layout states -- the gradient of a TP weight.)"""
    mesh = Mesh(dims, dp, tp)
    rng = rng_for("window_reduce", seed)
    b, h = batch(mesh, rng), mesh.tp * dim(rng, 1, 2)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT), "w": ([h, h], over(shard(1), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = g.op("Tanh", x["x"])
        total = g.op("ReduceSum", y, g.ints([0]), keepdims=1)
        gram = g.op("MatMul", g.op("Transpose", x["x"], perm=[1, 0]), y)  # [h, h]: over the batch
        if r is not None:
            total = g.coll("AllReduce", total, mesh.group(r, "dp"))
            gram = g.coll("AllReduce", gram, mesh.group(r, "dp"))
        out = g.op("MatMul", g.op("Add", gram, total), x["w"])
        if r is not None:
            out = g.coll("AllGather", out, mesh.group(r, "tp"), axis=1)
        return g.output(out)

    case, _ = build(f"window_reduce-{seed}", mesh, inputs, body)
    witness(case, seed, "unwindow", "reduce_sum_sharded", "matmul_row_parallel", "allreduce_sum")


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_batch_sum_left_local_is_refused(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """The same sum over the batch reduced over the TP group instead: each rank has its chunk's sum only."""
    mesh = Mesh(dims, dp, tp)
    rng = rng_for("window_reduce_local", seed)
    b, h = batch(mesh, rng), dim(rng, 2, 4)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        total = g.op("ReduceSum", g.op("Tanh", x["x"]), g.ints([0]), keepdims=1)
        if r is not None:
            total = g.coll("AllReduce", g.op("Div", total, g.const(np.float32(mesh.tp))), mesh.group(r, "tp"))
        return g.output(total)

    case, _ = build(f"window_reduce_local-{seed}", mesh, inputs, body)
    refused(case, mesh, seed)


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_softmax_along_the_batch_is_refused(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """A softmax normalising along the batch axis mixes the chunks: no virtual node, and each
    rank's softmax of its chunk is not the chunk of the softmax."""
    mesh = Mesh(dims, dp, tp)
    rng = rng_for("window_softmax_batch", seed)
    b, h = batch(mesh, rng), dim(rng, 2, 4)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT)}
    case, _ = build(f"window_softmax_batch-{seed}", mesh, inputs,
                    lambda g, x, r: g.output(g.op("Softmax", x["x"], axis=0)))
    refused(case, mesh, seed)


def test_groups_in_mesh_coordinates() -> None:
    """A group is named by the dims it runs along (one, or a sub-grid of several in row-major
    order) and the others' coordinates, on any mesh; a group that is no such sub-grid of the mesh
    (or no mesh) has no such name."""
    mesh = [("pp", 2), ("dp", 3), ("tp", 4)]
    assert mesh_group_words([4, 5, 6, 7], mesh) == "the tp group of pp=0, dp=1"
    assert mesh_group_words([13, 17, 21], mesh) == "the dp group of pp=1, tp=1"
    assert mesh_group_words([2, 14], mesh) == "the pp group of dp=0, tp=2"
    assert mesh_group_words([14, 2], mesh) is None  # (not in coordinate order: not the group a mesh dim gives)
    assert mesh_group_words([0, 1, 2], mesh) is None
    assert mesh_group_words([0, 1], [("tp", 2)]) is None
    assert mesh_group_words([1, 5, 9, 13, 17, 21], mesh) == "the pp x dp group of tp=1"  # (a data group)
    assert mesh_group_words([1, 13, 5, 17, 9, 21], mesh) is None  # (dp before pp: not row-major)
    grid = [("pp", 2), ("dp", 2), ("cp", 2), ("tp", 2)]
    assert mesh_group_words([9, 11, 13, 15], grid) == "the dp x cp group of pp=1, tp=1"
    assert mesh_group_words([9, 11, 13], grid) is None


# --- sums over the batch of a chunk's TP shard: a weight's gradient (chunk_term) -------------

def mlp_step(mesh: Mesh, rng: np.random.Generator, grads_over: str = "dp",
             reduce_op: str = "sum") -> tuple[dict[str, In], Callable]:
    """The backward of y = tanh(x W1) W2 (W1 column-, W2 row-parallel over tp) on each DP row's
    chunk, dy given: dW1 = x^T dh1, dW2 = a^T dy, db1 = sum_rows dh1 (TP shards of sums over the
    row's tokens; dW1 written (dh1^T x)^T, as torch's backward of a linear layer does) and
    dg = sum_rows dy * y (a replica's), all-reduced over `grads_over` (`reduce_op` avg: then
    multiplied by the group's size, which gives the sum back; "predivide": each term divided by the
    group's size before a sum all-reduce, then multiplied back, as DDP's gradient_predivide_factor
    and Megatron's gradient scaling do; "predivide_avg": divided before an avg all-reduce;
    "predivide_unscaled": divided, summed and never multiplied back, a bug)."""
    b, h, f = batch(mesh, rng), dim(rng, 2, 4), mesh.tp * dim(rng, 1, 2)
    inputs: dict[str, In] = {
        "x": ([b, h], over(shard(0), "dp"), FLOAT), "dy": ([b, h], over(shard(0), "dp"), FLOAT),
        "w1": ([h, f], over(shard(1), "tp"), FLOAT), "w2": ([f, h], over(shard(0), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        a = g.op("Tanh", g.op("MatMul", x["x"], x["w1"]))
        y = g.op("MatMul", a, x["w2"])
        if r is not None:
            y = g.coll("AllReduce", y, mesh.group(r, "tp"))
        da = g.op("MatMul", x["dy"], g.op("Transpose", x["w2"], perm=[1, 0]))
        dh1 = g.op("Mul", da, g.op("Sub", g.const(np.float32(1.0)), g.op("Mul", a, a)))
        grads = [g.op("Transpose", g.op("MatMul", g.op("Transpose", dh1, perm=[1, 0]), x["x"]), perm=[1, 0]),
                 g.op("MatMul", g.op("Transpose", a, perm=[1, 0]), x["dy"]),
                 g.op("Reshape", g.op("ReduceSum", dh1, g.ints([0]), keepdims=1), g.ints([-1])),  # [1, f] -> [f]
                 g.op("ReduceSum", g.op("Mul", x["dy"], y), g.ints([0]), keepdims=0)]
        for grad in grads:
            if r is not None:
                group = mesh.group(r, grads_over)
                op = "avg" if reduce_op in ("avg", "predivide_avg") else "sum"
                if reduce_op.startswith("predivide"):
                    grad = g.op("Mul", grad, g.const(np.float32(1.0 / len(group))))
                grad = g.coll("AllReduce", grad, group, reduce_op=op)
                back = len(group) ** ((op == "avg") + (reduce_op in ("predivide", "predivide_avg")))
                grad = g.op("Mul", grad, g.const(np.float32(back))) if back != 1 else grad
            g.output(grad)
        return grads[0]

    return inputs, body


@pytest.mark.parametrize("reduce_op", ["sum", "avg", "predivide", "predivide_avg"])
@pytest.mark.parametrize("dims,dp,tp,seed", MESHES)
def test_gradients_of_tp_shards_reduced_over_the_dp_dim(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                        reduce_op: str) -> None:
    """Each DP row's term of a sum over the batch, sharded over tp, is a slice of a piece of the
    sum (psl); the DP all-reduce adds the rows' pieces of the same slice: each rank holds its TP
    shard of the whole batch's gradient (declared: the weight's layout). With avg (DDP's), the
    mean of the rows' pieces: the slice divided by the DP size, which the ranks multiply back. Each
    term divided by the DP size before the all-reduce (predivide) is a scaled slice of a piece, and
    the scaled slices add up to the scaled slice."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = mlp_step(mesh, rng_for("window_step", seed), reduce_op=reduce_op)
    case, _ = build(f"window_step-{seed}-{reduce_op}", mesh, inputs, body)
    case.outputs = dict(zip(case.seq.outputs, [over(shard(1), "tp"), over(shard(0), "tp"), over(shard(0), "tp"), rep()]))
    # (the terms themselves are not simulated: their pieces of the sums are checked, summed)
    if reduce_op == "sum":
        witness(case, seed, "chunk_term", "allreduce_slices", "allreduce_sum", "matmul_column_parallel", "transpose",
                "reshape")
    elif reduce_op == "avg":
        witness(case, seed, "chunk_term", "allreduce_avg_slices", "allreduce_avg", "rank_scale")
    elif reduce_op == "predivide":  # (each row's term scaled by 1/D before the sum)
        witness(case, seed, "chunk_term", "rank_scale", "allreduce_slices_scaled", "allreduce_sum_scaled")
    else:
        witness(case, seed, "chunk_term", "rank_scale", "allreduce_avg_slices_scaled", "allreduce_avg_scaled")


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_gradients_divided_and_never_multiplied_back_are_refused(dims: tuple[str, str], dp: int, tp: int,
                                                                 seed: int) -> None:
    """Each row's term divided by the DP size before the sum, the sum left so (the mean where the
    step's loss is a sum): each rank's TP shard is 1/D of the gradient's, not verified."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = mlp_step(mesh, rng_for("window_step", seed), reduce_op="predivide_unscaled")
    case, _ = build(f"window_step_predivided-{seed}", mesh, inputs, body)
    case.outputs = dict(zip(case.seq.outputs, [over(shard(1), "tp"), over(shard(0), "tp"), over(shard(0), "tp"), rep()]))
    out = run_case(case, seed, closest_lemma=False)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    sim = simulate(case, seed)
    want = sim.seq[case.seq.outputs[0]]
    assert not np.allclose(sim.ranks[0][case.ranks[0].outputs[0]], want[:, : want.shape[1] // tp], atol=1e-5)


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_gradients_reduced_over_the_tp_dim_are_refused(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """Class 11: the gradients all-reduced over the TP group instead of the DP group add TP
    shards of one row's term: not verified."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = mlp_step(mesh, rng_for("window_step", seed), grads_over="tp")
    case, _ = build(f"window_step_tp-{seed}", mesh, inputs, body)
    out = run_case(case, seed, closest_lemma=False)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    assert out.report.verdict != "verified"
    sim = simulate(case, seed)
    want = sim.seq[case.seq.outputs[0]]
    assert not np.allclose(sim.ranks[0][case.ranks[0].outputs[0]], want[:, : want.shape[1] // tp], atol=1e-5)


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_chunk_on_an_inner_axis_through_reshapes(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """A batch moved to axis 1 (x^T), reshaped with the axis before it split and merged back: the
    chunk stays one contiguous run of each outer block, so the reshapes chunk it too."""
    mesh = Mesh(dims, dp, tp)
    rng = rng_for("window_inner_reshape", seed)
    b, h = batch(mesh, rng), 2 * mesh.tp * dim(rng, 1, 2)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT), "w": ([h, h], over(shard(1), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        rows = b if r is None else b // mesh.dp
        t = g.op("Transpose", g.op("Tanh", x["x"]), perm=[1, 0])  # [h, rows]: the chunk on axis 1
        split = g.op("Reshape", t, g.ints([2, h // 2, rows]))      # [2, h/2, rows]: on axis 2
        back = g.op("Transpose", g.op("Reshape", split, g.ints([h, rows])), perm=[1, 0])
        return gathered_over_tp(g, g.op("MatMul", back, x["w"]), mesh, r, axis=1)

    case, y = build(f"window_inner_reshape-{seed}", mesh, inputs, body)
    case.outputs = {y: over(shard(0), "dp")}
    witness(case, seed, "window", "unwindow", "reshape", "transpose", "allgather")
