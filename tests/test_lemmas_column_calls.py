"""Numeric witnesses for a row-symmetric plan's column calls (rules/rows.lp, docs/rows.md): a
training step on a DP x TP mesh, whose gradients and loss are all-reduced over each DP column,
verified on row 0 alone.

The reduced solve states each absent column member's input by symmetry (`row_mirror`: row K's
counterpart of a row-0 rank holds the same piece of row K's share of a sum over the batch). Each
such statement is checked here on a simulation of the whole mesh, as a relation of the tensor it
stands for (the same-named tensor of the row-K rank), and so is every other relation the reduced
solve derives. Refused twins, each a program whose numbers differ, must not verify on one row
nor whole: the DP all-reduce with avg where the sum was wanted (class 14, gradients averaged
twice), a constant that varies along the batch summed as row 0's chunk by every row, and the
all-reduce over part of each column (no symmetry: verified whole, refuted).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from harness import Case, Graph, rep, shard, simulate
from refine import pipeline
from refine.diagnose.witness import check
from refine.lowering import row_copies, rows
from refine.lowering.program import lower_program
from refine.run.engine import Derived, solve
import test_lemmas_nested_windows as nested
from test_lemmas_backward import dim, rng_for
from test_lemmas_windows import FLOAT, MESHES, In, Mesh, batch, build, mlp_step, over

# (the mirrors are not rank tensors: the library keeps them out of what it shows)
SHOW_MIRRORS = "#show mirror_rel(S, T, K, L) : rel(S, mirror(T, K), L)."
MESHES_4 = [*MESHES, (("dp", "tp"), 4, 2, 3)]


def _stride(mesh: Mesh) -> int:
    return mesh.shape[1] if mesh.dims[0] == "dp" else 1


def _same_value(case: Case, rank: int, other: int) -> dict[str, str]:
    """Rank `rank`'s value names as `other` names them (the same program, built apart)."""
    return {a: b for n, m in zip(case.ranks[rank].nodes, case.ranks[other].nodes) for a, b in zip(n.output, m.output)}


def reduced_solve(case: Case, stride: int, seed: int, tmp: Path) -> tuple[Derived, Path]:
    """Row 0's solve, its relations and its mirrors' (as the row-K tensors they stand for)
    checked on a simulation of the whole mesh."""
    model_dir = case.save(tmp / case.name)
    program = lower_program(model_dir, memo=False, rows=True)
    assert program.rows is not None and program.rows.dim == "dp"
    derived = solve(program.main, program=SHOW_MIRRORS)
    for s, t, k, lay in derived.get("mirror_rel"):
        graph, name = str(t).split(":", 1)
        rank = int(graph[1:])
        stands_for = f"r{rank + int(k) * stride}:{_same_value(case, rank, rank + int(k) * stride)[name]}"
        derived.atoms["rel"].append((s, stands_for, lay))
        derived.atoms["rel_by"].append((s, stands_for, lay, "row_mirror"))
    checked = check(derived, simulate(case, seed), seed)
    assert checked.ok, checked.violations
    assert "row_mirror" in checked.lemmas_checked, sorted(checked.lemmas_checked)
    assert derived.get("sanity") == [], derived.get("sanity")
    return derived, model_dir


def verified_on_one_row(case: Case, stride: int, seed: int, tmp: Path) -> pipeline.Report:
    """Row 0's solve checked (`reduced_solve`) proves every output, and `refine verify` says so."""
    derived, model_dir = reduced_solve(case, stride, seed, tmp)
    assert {str(s) for (s,) in derived.get("output_ok")} == {f"seq:{o}" for o in case.seq.outputs}
    report = pipeline.verify_dir(model_dir, simulate=False)
    assert report.verdict == "verified" and report.rows is not None, report.failure
    assert "dp=0" in report.rows
    return report


def refused_on_every_row(case: Case, mesh: Mesh | None, seed: int, tmp: Path, *, symmetric: bool = True) -> None:
    """The ranks' numbers differ from the sequential ones (checked for a replicated first output,
    on `mesh`); the reduced solve (where the rows are symmetric) proves that output not, and
    `refine verify` refutes the whole plan."""
    name = case.seq.outputs[0]
    if mesh is not None:
        sim = simulate(case, seed)
        assert not all(np.allclose(sim.ranks[r][name], sim.seq[name], atol=1e-5) for r in range(mesh.world)), \
            "the twin is not buggy"
    model_dir = case.save(tmp / case.name)
    if symmetric:
        program = lower_program(model_dir, memo=False, rows=True)
        assert program.rows is not None, "the rows are alike: the reduction must be tried"
        derived = solve(program.main)
        assert f"seq:{name}" not in {str(s) for (s,) in derived.get("output_ok")}, "row 0 alone proved it"
    else:
        assert rows.load_rows(model_dir) is None
    report = pipeline.verify_dir(model_dir)
    assert report.verdict == "refuted" and report.rows is None, report.verdict


def batch_sums(mesh: Mesh, rng: np.random.Generator, *, reduce_op: str = "sum", column: bool = True,
               constant: bool = False) -> tuple[dict[str, In], Callable]:
    """A weight's gradient s^T dy (a contraction over the batch; s: each token's mean feature of
    tanh(x), expanded to the row's own shape) and a loss-like sum over the batch,
    each row's terms all-reduced over its DP column (`column` False: over half of it); with
    `constant`, the sum reads a constant that varies along the batch, every row its row-0 chunk."""
    b, h = batch(mesh, rng), dim(rng, 2, 4)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT), "dy": ([b, h], over(shard(0), "dp"), FLOAT)}
    varying = rng.standard_normal((b, h)).astype(np.float32)

    def body(g: Graph, x: dict, r: int | None) -> str:
        act = g.op("Tanh", x["x"])
        # (each row's mean over the features broadcast back to its own shape: Expand to a shape
        # the row computes, [B/D, h], where the sequential program's is [B, h])
        spread = g.op("Expand", g.op("ReduceMean", act, g.ints([1]), keepdims=1), g.op("Shape", act))
        grad = g.op("MatMul", g.op("Transpose", spread, perm=[1, 0]), x["dy"])
        if constant:
            act = g.op("Mul", act, g.const(varying if r is None else varying[: b // mesh.dp]))
        total = g.op("ReduceSum", act, g.ints([0]), keepdims=1)
        if r is not None:
            group = mesh.group(r, "dp")
            if not column:
                half = len(group) // 2
                row = mesh.coord(r)["dp"]
                group = group[:half] if row < half else group[half:]
            grad = g.coll("AllReduce", grad, group, reduce_op=reduce_op)
            total = g.coll("AllReduce", total, group, reduce_op=reduce_op)
        g.output(total)
        return g.output(grad)

    return inputs, body


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES_4)
def test_batch_sums_all_reduced_over_the_column_verify_on_one_row(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                                  tmp_path: Path) -> None:
    """Each row's term of a sum over the batch (a contraction, a reduction), all-reduced with sum
    over its DP column: the absent rows' terms stated by symmetry tile the sum, so row 0 alone
    proves every rank holds the whole sum."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = batch_sums(mesh, rng_for("column_sums", seed))
    case, _ = build(f"column_sums-{seed}", mesh, inputs, body, outputs={})
    case.outputs = {name: rep() for name in case.seq.outputs}
    verified_on_one_row(case, _stride(mesh), seed, tmp_path)


def micro_step(mesh: Mesh, rng: np.random.Generator) -> tuple[dict[str, In], Callable]:
    """y = sum over the batch of tanh(x W), W column-parallel over tp: each row cuts its chunk into
    two micro-batches, projects each on its TP columns and adds their sums, all-reduced over the
    DP column (each rank its TP columns of y)."""
    b, h, f = mesh.dp * 2 * dim(rng, 1, 2), dim(rng, 2, 4), mesh.tp * dim(rng, 1, 2)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT), "w": ([h, f], over(shard(1), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        def term(rows: str) -> str:
            return g.op("ReduceSum", g.op("Tanh", g.op("MatMul", rows, x["w"])), g.ints([0]), keepdims=1)

        if r is None:
            return g.output(term(x["x"]))
        half = b // mesh.dp // 2
        y = g.op("Add", *(term(g.op("Slice", x["x"], g.ints([k * half]), g.ints([(k + 1) * half]), g.ints([0])))
                          for k in range(2)))
        return g.output(g.coll("AllReduce", y, mesh.group(r, "dp")))

    return inputs, body


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES_4[::2])
def test_micro_batches_of_a_row_verify_on_one_row(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                  tmp_path: Path) -> None:
    """A cut of the row's window along its own axis is a finer window (`window_recut`), on which
    the TP projection's column lemma meets it; the micro-batches' terms tile row 0's share."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = micro_step(mesh, rng_for("column_micro", seed))
    case, _ = build(f"column_micro-{seed}", mesh, inputs, body)
    case.outputs = {name: over(shard(1), "tp") for name in case.seq.outputs}
    verified_on_one_row(case, _stride(mesh), seed, tmp_path)


@pytest.mark.parametrize("reduce_op", ["sum", "avg", "predivide", "predivide_avg"])
@pytest.mark.parametrize("dims,dp,tp,seed", MESHES_4)
def test_training_step_of_tp_shards_verifies_on_one_row(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                        reduce_op: str, tmp_path: Path) -> None:
    """The backward of a TP MLP on each DP row's chunk: TP shards of sums over the row's tokens
    (psl) and a replica's sum, all-reduced over the DP column (avg: DDP's mean, multiplied back by
    the group's size; predivide: each row's term scaled by 1/D before the sum, so the mirrors are
    scaled pieces): verified on row 0 alone."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = mlp_step(mesh, rng_for("column_step", seed), reduce_op=reduce_op)
    case, _ = build(f"column_step-{seed}-{reduce_op}", mesh, inputs, body)
    case.outputs = dict(zip(case.seq.outputs, [over(shard(1), "tp"), over(shard(0), "tp"), over(shard(0), "tp"), rep()]))
    verified_on_one_row(case, _stride(mesh), seed, tmp_path)


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES_4[::2])
def test_column_average_is_refused(dims: tuple[str, str], dp: int, tp: int, seed: int, tmp_path: Path) -> None:
    """Class 14: the rows' terms averaged over the column where their sum is the output (the
    gradients averaged twice): S / D on every rank."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = batch_sums(mesh, rng_for("column_avg", seed), reduce_op="avg")
    case, _ = build(f"column_avg-{seed}", mesh, inputs, body)
    case.outputs = {name: rep() for name in case.seq.outputs}
    refused_on_every_row(case, mesh, seed, tmp_path)


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES_4[:2])
def test_varying_constant_summed_as_row_zero_chunk_is_refused(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                              tmp_path: Path) -> None:
    """Every row weighs its tokens by row 0's chunk of a constant that varies along the batch:
    the rows are alike, but row K's term is not the sum's K-th term, so no statement about it
    may follow from row 0's."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = batch_sums(mesh, rng_for("column_constant", seed), constant=True)
    case, _ = build(f"column_constant-{seed}", mesh, inputs, body)
    case.outputs = {name: rep() for name in case.seq.outputs}
    case.seq.outputs.reverse()  # (the sum that reads the constant first: the twin's buggy output)
    refused_on_every_row(case, mesh, seed, tmp_path)


def test_all_reduce_over_part_of_the_column_is_refused(tmp_path: Path) -> None:
    """Each half of the column all-reduces apart: not a column call (no symmetry claimed), and
    each rank holds half the rows' sum."""
    mesh = Mesh(("dp", "tp"), 4, 2)
    inputs, body = batch_sums(mesh, rng_for("column_half", 0), column=False)
    case, _ = build("column_half", mesh, inputs, body)
    case.outputs = {name: rep() for name in case.seq.outputs}
    refused_on_every_row(case, mesh, 0, tmp_path, symmetric=False)


def test_mirrors_name_their_rows() -> None:
    """A column group's members outside row 0 are row K's counterparts of row-0 members, in both
    dim orders; a group within one row, or over part of a column, is no column."""
    from refine.config import ModelConfig
    config = ModelConfig.model_validate({"world_size": 8, "mesh": {"shape": [4, 2], "dims": ["dp", "tp"]},
                                         "inputs": {"x": {"layout": "shard", "axis": 0, "over": "dp"}},
                                         "outputs": {"y": {"layout": "rep"}}})
    mesh = row_copies.RowMesh(config, "dp")
    assert mesh.is_column([1, 3, 5, 7]) and mesh.mirrors([1, 3, 5, 7]) == [(1, 0, 1), (2, 0, 2), (3, 0, 3)]
    assert mesh.is_column(list(range(8)))
    assert not mesh.is_column([0, 1]) and not mesh.is_column([1, 3]) and not mesh.is_column([1, 3, 5, 7, 7])
    flipped = row_copies.RowMesh(ModelConfig.model_validate({**config.model_dump(exclude_none=True),
                                                     "mesh": {"shape": [2, 4], "dims": ["tp", "dp"]}}), "dp")
    assert flipped.is_column([4, 5, 6, 7]) and flipped.mirrors([4, 5, 6, 7]) == [(1, 0, 1), (2, 0, 2), (3, 0, 3)]


def tp_partial_over_the_column(mesh: Mesh, rng: np.random.Generator, reduce_over: str) -> tuple[dict[str, In], Callable]:
    """y = (sum over the batch of x) W, W row-parallel over tp: the batch sum all-reduced over the DP
    column, each rank's product of its TP slice a partial over the contraction, all-reduced over
    `reduce_over` (the TP group; the twin: the DP column, class 11)."""
    b, o, h = batch(mesh, rng), dim(rng, 2, 4), mesh.tp * dim(rng, 1, 2)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT), "w": ([h, o], over(shard(0), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        total = g.op("ReduceSum", x["x"], g.ints([0]), keepdims=1)
        if r is not None:
            total = g.coll("AllReduce", total, mesh.group(r, "dp"))
            t, width = mesh.coord(r)["tp"], h // mesh.tp
            total = g.op("Slice", total, g.ints([t * width]), g.ints([(t + 1) * width]), g.ints([1]))
        y = g.op("MatMul", total, x["w"])
        if r is not None:
            y = g.coll("AllReduce", y, mesh.group(r, reduce_over))
        return g.output(y)

    return inputs, body


def test_tp_partial_reduced_over_the_tp_group_verifies_on_one_row(tmp_path: Path) -> None:
    mesh = Mesh(("dp", "tp"), 2, 2)
    inputs, body = tp_partial_over_the_column(mesh, rng_for("column_tp_partial", 0), "tp")
    case, _ = build("column_tp_partial", mesh, inputs, body)
    case.outputs = {name: rep() for name in case.seq.outputs}
    verified_on_one_row(case, _stride(mesh), 0, tmp_path)


@pytest.mark.parametrize("dims,dp,tp,seed", [(("dp", "tp"), 2, 2, 0), (("tp", "dp"), 2, 2, 1)])
def test_tp_partial_reduced_over_the_column_is_refused(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                       tmp_path: Path) -> None:
    """Class 11 on a DP x TP mesh of equal sizes: a partial over the TP contraction (pieces [t, t+1)
    of T = D) all-reduced over the DP column. Every row holds the same piece, so the column adds D
    copies of one piece: the pieces of a contraction over another axis than the batch are not
    the rows' terms (rows.lp's row_aligned), and nothing may be stated for the absent rows."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = tp_partial_over_the_column(mesh, rng_for("column_tp_partial", seed), "dp")
    case, _ = build(f"column_tp_partial_dp-{seed}", mesh, inputs, body)
    case.outputs = {name: rep() for name in case.seq.outputs}
    refused_on_every_row(case, mesh, seed, tmp_path)


# --- a DP row's sequence over cp: windows of the row's window (rules/windows.lp, second level) ---
# test_lemmas_nested_windows.py's cases on a (dp, cp, tp) = 2 x 2 x 2 mesh, verified on row dp=0
# (ranks 0..3; row 1 is ranks 4..7): the row's chunk of the batch, its sequence chunks over cp
# (all of them: the second level is the row's own), a rotary-like table's sequence chunk read by
# the row's chunk (wsecond), the data group's all-reduce over dp x cp (a column group).

@pytest.mark.parametrize("make", [nested.flat_projection_case, nested.micro_batches_case])
def test_a_dp_row_of_cp_ranks_verifies_on_one_row(make, tmp_path: Path) -> None:
    verified_on_one_row(make(), 4, 0, tmp_path)


def rotary_case(bug: str | None = None) -> Case:
    """x [B, S, F] on the batch over dp then the sequence over cp, each rank its TP half of the
    features (a head slice of its chunk), times a table [S, F] (a rotary table: the same for every
    batch row, given whole) that each rank slices to its sequence chunk and feature half; the sum
    over batch and sequence all-gathered over tp and all-reduced over the data group (dp x cp).
    `bug` "row": each rank slices the table by its dp coordinate for its cp one (the rows differ:
    no symmetry)."""
    seq, ranks = Graph(), [Graph() for _ in range(8)]
    f = 4

    def side(g: Graph, r: int | None) -> None:
        b, s = (nested.B, nested.S) if r is None else (nested.B // 2, nested.S // 2)
        x = g.input("x", [b, s, f], FLOAT)
        table = g.input("table", [nested.S, f], FLOAT)
        if r is not None:
            d, c, t = nested.coordinates(r)
            k = d if bug == "row" else c
            x = g.op("Slice", x, g.ints([t * f // 2]), g.ints([(t + 1) * f // 2]), g.ints([2]))
            table = g.op("Slice", table, g.ints([k * s]), g.ints([(k + 1) * s]), g.ints([0]))
            table = g.op("Slice", table, g.ints([t * f // 2]), g.ints([(t + 1) * f // 2]), g.ints([1]))
        y = g.op("ReduceSum", g.op("Mul", g.op("Tanh", x), table), g.ints([0, 1]), keepdims=0)
        if r is not None:
            y = g.coll("AllGather", y, [4 * d + 2 * c, 4 * d + 2 * c + 1], axis=0)
            y = g.coll("AllReduce", y, [t, 2 + t, 4 + t, 6 + t])
        g.output(y)

    side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    return Case(f"column-rotary-{bug or 'ok'}", seq, ranks, {"x": nested.BATCH_THEN_SEQUENCE, "table": {"layout": "rep"}},
                outputs={seq.outputs[0]: {"layout": "rep"}}, mesh=nested.MESH)


def test_a_sequence_table_read_by_cp_chunks_verifies_on_one_row(tmp_path: Path) -> None:
    verified_on_one_row(rotary_case(), 4, 0, tmp_path)


@pytest.mark.parametrize("make,bug", [
    (nested.flat_projection_case, "cp_only"),
    (nested.flat_projection_case, "avg"),
    (nested.micro_batches_case, "avg"),
    (nested.micro_batches_case, "twice"),
])
def test_a_wrong_data_group_reduction_is_refused_on_one_row(make, bug: str, tmp_path: Path) -> None:
    """The data group's all-reduce over the dp column alone (the cp ranks' terms left out), with
    avg, or a micro-batch's term added twice: the row proves not the output, nor the plan whole."""
    case = make(bug)
    case.seq.outputs[:] = [o for o in case.seq.outputs if o in case.outputs and case.outputs[o] == {"layout": "rep"}] + \
        [o for o in case.seq.outputs if not (o in case.outputs and case.outputs[o] == {"layout": "rep"})]
    refused_on_every_row(case, None, 0, tmp_path)


def test_a_table_sliced_by_row_is_refused(tmp_path: Path) -> None:
    refused_on_every_row(rotary_case("row"), None, 0, tmp_path, symmetric=False)


def as_one_layer_call(model_dir: Path, copy_rows: bool) -> Path:
    """Every program of `model_dir` rewritten as one call of a layer function holding its graph
    (refine/kit/cases.py as_layer_calls), so that the row's proof runs in a template solved for its
    key's chunk. `copy_rows`: the other DP rows written as row 0's copies (row_copies.row_copy, as an
    exporter that captures one row writes them: the kit names each program's values afresh, and a
    function body keeps its names)."""
    import onnx

    from refine.config import ModelConfig
    from refine.kit.cases import as_layer_calls

    for path in [model_dir / "seq.onnx", *sorted(model_dir.glob("rank*.onnx"))]:
        onnx.save(as_layer_calls(onnx.load(path), calls=1), path)
    if copy_rows:
        config = ModelConfig.model_validate_json((model_dir / "refine.json").read_text())
        first = rows.row_dim(config)
        assert first is not None
        row_size = config.world_size // first.rows
        for r in range(row_size, config.world_size):
            row0 = onnx.load(model_dir / f"rank{r % row_size}.onnx")
            onnx.save(row_copies.row_copy(row0, config, first.dim, r), model_dir / f"rank{r}.onnx")
    return model_dir


@pytest.mark.parametrize("bug", [None, "row"])
def test_a_sequence_table_read_by_cp_chunks_inside_a_layer(bug: str | None, tmp_path: Path) -> None:
    """The rotary case inside a layer function: the template is solved for its key's chunk, the
    row window (window_only), with every sequence chunk of it (rules/windows.lp: the second level
    whole where the first is limited) and the table's chunks read by them (wsecond); its sum's
    terms over the row window pass to the column's all-reduce as row-aligned (rules/rows.lp
    row_flow). Correct: verified on row 0 alone. The table sliced by the dp coordinate: the rows
    differ, the plan is verified whole and refuted."""
    model_dir = as_one_layer_call(rotary_case(bug).save(tmp_path / "rotary"), copy_rows=bug is None)
    program = lower_program(model_dir, rows=True)
    assert program.templates, "the graph is a layer call"
    report = pipeline.verify_dir(model_dir, simulate=bug is not None)
    if bug is None:
        assert program.rows is not None
        assert report.verdict == "verified" and report.rows is not None, report.failure
    else:
        assert program.rows is None
        assert report.verdict == "refuted", report.verdict


def test_a_column_reduce_scatter_is_verified_whole(tmp_path: Path) -> None:
    """A reduce-scatter over the DP column hands each row another block of the sum: no renaming
    of row 0's proof says which, so the symmetry is not claimed (rows.py) and the plan, correct,
    is verified whole; an all-reduce's sum is the same on every member, and only it is a column
    call."""
    mesh = Mesh(("dp", "tp"), 2, 2)
    rng = rng_for("column_scatter", 0)
    b, h = batch(mesh, rng), mesh.dp * dim(rng, 1, 2)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT), "dy": ([b, h], over(shard(0), "dp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        grad = g.op("MatMul", g.op("Transpose", x["x"], perm=[1, 0]), x["dy"])
        if r is not None:
            grad = g.coll("ReduceScatter", grad, mesh.group(r, "dp"), axis=0)
        return g.output(grad)

    case, _ = build("column_scatter", mesh, inputs, body)
    case.outputs = {name: over(shard(0), "dp") for name in case.seq.outputs}
    model_dir = case.save(tmp_path / case.name)
    assert rows.row_dim(rows.model_dir_files(model_dir)[0]) is not None and rows.load_rows(model_dir) is None
    report = pipeline.verify_dir(model_dir, simulate=False)
    assert report.rows is None and report.verdict == "verified", report.failure


@pytest.mark.parametrize("mesh_flags", [("--tp", "2", "--dp", "2"), ("--pp", "2", "--dp", "2", "--cp", "2", "--tp", "2")],
                         ids=["tp2_dp2", "pp2_dp2_cp2_tp2"])
def test_mirrors_of_layer_function_terms_hold_on_the_whole_mesh(mesh_flags: tuple[str, ...], tmp_path: Path) -> None:
    """A layer function's gradient terms reach the DP column's all-reduce through its template's
    summary: the template's solve finds their styles aligned with the row windows (rules/rows.lp
    `row_flow`: windows descending from its key's chunk of a row window) and refine/run/memo.py
    passes that on (`template_aligned_style`). A training step, layers as functions, memoized on
    row 0 alone -- Llama's TP 2 x DP 2, and its PP 2 x DP 2 x CP 2 x TP 2, whose layers hold each
    rank's sequence chunk of its row's chunk (a window of a window in the template: rules/windows.lp,
    every chunk of a chunk where the key names the first level's) -- every mirrored piece holds, as
    the same-named tensor of the row-1 rank (a row copy: the same program, its groups moved), on a
    simulation of the whole mesh; and the run is the one-row run (without the template's styles it
    falls back to every rank)."""
    pytest.importorskip("torch")
    from harness import invoke
    from refine.diagnose.simulate import simulate_dir
    from refine.run.memo import run_program

    out = tmp_path / "mesh"
    exported = invoke("export", "--model", "llama", "--config", "tiny", *mesh_flags, "--train",
                      "--layers", "2", "--out", out)
    assert exported.exit_code == 0, exported.output
    program = lower_program(out, rows=True)
    assert program.rows is not None and program.templates, "one row, layers as functions"
    show = tmp_path / "show"
    show.mkdir()
    (show / "mirrors.lp").write_text(SHOW_MIRRORS + "\n")
    run = run_program(program, rule_dirs=[show], elide=False)
    derived = run.derived
    mirrors = derived.get("mirror_rel")
    assert mirrors, "no column member stated by symmetry"
    mesh = json.loads((out / "refine.json").read_text())["mesh"]
    stride = int(np.prod(mesh["shape"][mesh["dims"].index("dp") + 1:]))  # (row K's counterpart of rank r)
    for s, t, k, lay in mirrors:
        graph, name = str(t).split(":", 1)
        stands_for = f"r{int(graph[1:]) + int(k) * stride}:{name}"
        derived.atoms["rel"].append((s, stands_for, lay))
        derived.atoms["rel_by"].append((s, stands_for, lay, "row_mirror"))
    checked = check(derived, simulate_dir(out, 0), 0)
    assert checked.ok, checked.violations
    assert "row_mirror" in checked.lemmas_checked
    report = pipeline.verify_dir(out, simulate=False)
    assert report.verdict == "verified" and report.rows is not None, report.failure
