"""Row symmetry (refine/lowering/rows.py, docs/rows.md): a DP x TP mesh whose rows run the same
programs is lowered and solved for row 0 only, its batch and outputs declared as chunk 0.

Witnesses: what the reduced solve derives holds on a simulation of the whole mesh, chunks and
all, and the conclusion drawn from it (every row holds its own chunk of the output) holds on the
numbers of every row. Negatives, each a program whose rows are identical up to their groups but
whose numbers differ: the sequential side reads one batch row for every row (X + X[0:1]), a
constant that varies along the batch added by every row as row 0's chunk of it; neither may
verify (the reduced solve proves nothing, the whole plan is then verified and refuted). And the
symmetry must not be claimed where a row differs: one asymmetric rank, a call across rows that
is no column call; a column call of anything but the rows' terms of a sum proves nothing on one row.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from harness import Case, Graph, simulate
from refine import pipeline
from refine.report import render
from refine.config import load_config
from refine.kit.cases import check
from refine.run.engine import solve
from refine.lowering import rows
from refine.lowering.graphs import lower_models
from test_lemmas_backward import dim, rng_for
from test_lemmas_windows import FLOAT, MESHES, In, Mesh, batch, block, build, gathered_over_tp, over, shard

REPO = Path(__file__).resolve().parent.parent


def reduced_witness(case: Case, mesh: Mesh, seed: int, tmp: Path) -> pipeline.Report:
    """The reduced solve's relations checked on a simulation of every rank, every row's output
    checked to be its chunk, and the verdict of `refine verify`: verified on row 0 alone."""
    model_dir = case.save(tmp / case.name)
    loaded = rows.load_rows(model_dir)
    assert loaded is not None and loaded.rank_ids == [r for r in range(mesh.world) if mesh.coord(r)["dp"] == 0]
    derived = solve(lower_models(loaded))
    sim = simulate(case, seed)
    checked = check(derived, sim, seed)
    assert checked.ok, checked.violations
    assert derived.get("sanity") == []
    assert any(isinstance(s, tuple) and s[0] == "win" for s, _t, _l in derived.get("rel")), "no chunk related"
    want, name = sim.seq[case.seq.outputs[0]], case.seq.outputs[0]
    rows_of = np.split(want, mesh.dp, axis=0)
    for r in range(mesh.world):  # (what the symmetry concludes, on the numbers)
        np.testing.assert_allclose(sim.ranks[r][name], rows_of[mesh.coord(r)["dp"]], rtol=1e-4, atol=1e-5)
    report = pipeline.verify_dir(model_dir)
    assert report.verdict == "verified" and report.rows is not None, report.failure
    return report


def not_verified(case: Case, mesh: Mesh, seed: int, tmp: Path) -> pipeline.Report:
    """Rows identical up to their groups whose numbers differ: the row-0 solve must not verify,
    and `refine verify` (the whole plan after it) refutes."""
    sim = simulate(case, seed)
    name = case.seq.outputs[0]
    rows_of = np.split(sim.seq[name], mesh.dp, axis=0)
    assert not all(np.allclose(sim.ranks[r][name], rows_of[mesh.coord(r)["dp"]], atol=1e-5)
                   for r in range(mesh.world)), "the negative case is not buggy"
    model_dir = case.save(tmp / case.name)
    loaded = rows.load_rows(model_dir)
    assert loaded is not None, "the rows are identical up to their groups: the reduction must be tried"
    derived = solve(lower_models(loaded))
    assert not {s for (s,) in derived.get("output_ok")}, "row 0 alone proved an output"
    report = pipeline.verify_dir(model_dir)
    assert report.verdict == "refuted" and report.rows is None
    return report


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES)
def test_block_verified_on_its_first_row(dims: tuple[str, str], dp: int, tp: int, seed: int, tmp_path: Path) -> None:
    """The windows' block (an embedding, a norm, a TP MLP, reshapes, a softmax, ...) on a mesh
    in both dim orders: row 0 alone verifies it, and every row's numbers bear it out."""
    mesh = Mesh(dims, dp, tp)
    inputs, body = block(mesh, rng_for("rows_block", seed))
    case, y = build(f"rows_block-{seed}", mesh, inputs, body)
    case.outputs = {y: over(shard(0), "dp")}
    report = reduced_witness(case, mesh, seed, tmp_path)
    assert f"the {dp} rows along dp" in report.rows


def _masked(mesh: Mesh, seed: int, mask: str) -> tuple[Case, str]:
    """y = (x + P) @ w, gathered over tp: P a [b, s, h] constant equal along the batch
    (`mask="equal"`), or not, each rank adding its own row's chunk (`"own"`) or row 0's
    (`"first"`, the bug: every row computes with row 0's P)."""
    rng = rng_for("rows_mask", seed)
    b, s, h = batch(mesh, rng), dim(rng, 2, 3), mesh.tp * dim(rng, 1, 2)
    p = rng.standard_normal((1 if mask == "equal" else b, s, h)).astype(np.float32)
    p = np.repeat(p, b, axis=0) if mask == "equal" else p
    inputs: dict[str, In] = {"x": ([b, s, h], over(shard(0), "dp"), FLOAT), "w": ([h, h], over(shard(1), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        if r is None:
            chunk = p
        else:
            row = 0 if mask == "first" else mesh.coord(r)["dp"]
            chunk = np.split(p, mesh.dp, axis=0)[row]
        return gathered_over_tp(g, g.op("MatMul", g.op("Add", x["x"], g.const(chunk)), x["w"]), mesh, r, axis=2)

    case, y = build(f"rows_mask_{mask}-{seed}", mesh, inputs, body)
    case.outputs = {y: over(shard(0), "dp")}
    return case, y


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_a_constant_equal_along_the_batch_is_every_rows_chunk(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                              tmp_path: Path) -> None:
    mesh = Mesh(dims, dp, tp)
    case, _ = _masked(mesh, seed, "equal")
    reduced_witness(case, mesh, seed, tmp_path)


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_row_0s_chunk_of_a_varying_constant_in_every_row_is_refuted(dims: tuple[str, str], dp: int, tp: int,
                                                                    seed: int, tmp_path: Path) -> None:
    """The rows are identical (each adds the same constant), and row 0 is right: only the other
    rows are wrong, which row 0's proof must not be taken to show."""
    mesh = Mesh(dims, dp, tp)
    case, _ = _masked(mesh, seed, "first")
    not_verified(case, mesh, seed, tmp_path)


def test_each_rows_own_chunk_of_a_varying_constant_is_not_symmetric(tmp_path: Path) -> None:
    """Each row adds its own chunk: the rows differ, no symmetry is claimed, and the whole plan
    has no counterexample (it is right; that a rank constant is a slice of a sequential one that
    varies along the batch is no lemma today, so it stays unproven, not verified)."""
    mesh = Mesh(("dp", "tp"), 2, 2)
    case, _ = _masked(mesh, 0, "own")
    model_dir = case.save(tmp_path / case.name)
    assert rows.load_rows(model_dir) is None
    report = pipeline.verify_dir(model_dir)
    assert report.verdict != "refuted" and report.rows is None, report.numeric


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_a_sequential_program_that_mixes_the_rows_is_refuted(dims: tuple[str, str], dp: int, tp: int, seed: int,
                                                             tmp_path: Path) -> None:
    """y = x + x[0:1] (every batch row plus the first): each rank adds its own first row, which is
    the sequential one in row 0 only."""
    mesh = Mesh(dims, dp, tp)
    rng = rng_for("rows_mix", seed)
    b, h = batch(mesh, rng), mesh.tp * dim(rng, 1, 2)
    inputs: dict[str, In] = {"x": ([b, h], over(shard(0), "dp"), FLOAT), "w": ([h, h], over(shard(1), "tp"), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        first = g.op("Slice", x["x"], g.ints([0]), g.ints([1]), g.ints([0]))
        return gathered_over_tp(g, g.op("MatMul", g.op("Add", x["x"], first), x["w"]), mesh, r, axis=1)

    case, y = build(f"rows_mix-{seed}", mesh, inputs, body)
    case.outputs = {y: over(shard(0), "dp")}
    not_verified(case, mesh, seed, tmp_path)


def _example(tmp: Path, name: str = "mlp_dp2_tp2") -> Path:
    return Path(shutil.copytree(REPO / "examples" / name, tmp / name))


def test_one_asymmetric_rank_gets_the_whole_plan_verified(tmp_path: Path) -> None:
    """A rank of row 1 differs from its row-0 counterpart by one constant (its bias doubled):
    no symmetry, the whole plan is verified, and refuted at that rank's node."""
    model_dir = _example(tmp_path)
    assert rows.load_rows(model_dir) is not None
    path = model_dir / "rank3.onnx"
    model = onnx.load(str(path))
    mul = onnx.helper.make_node("Mul", ["y", "two"], ["y_doubled"], name="doubled")
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    for node in model.graph.node:
        node.output[:] = ["y_local" if x == "y" else x for x in node.output]
        node.input[:] = ["y_local" if x == "y" else x for x in node.input]
    mul.input[0] = "y_local"
    mul.output[0] = "y"
    model.graph.node.append(mul)
    onnx.save(model, str(path))
    assert rows.load_rows(model_dir) is None
    report = pipeline.verify_dir(model_dir)
    assert report.verdict == "refuted" and report.rows is None


def test_a_tp_reduction_over_the_column_proves_nothing_on_one_row(tmp_path: Path) -> None:
    """The wrong-group twin all-reduces its TP partial over the DP column: a column call, so the
    rows are alike, but the partial's pieces are not the rows' terms of a sum over the batch
    (rules/rows.lp states nothing for the absent rows): row 0 proves no output, and the whole
    plan is refuted."""
    model_dir = _example(tmp_path, "mlp_dp2_tp2_wrong_group")
    assert rows.row_dim(load_config(model_dir)) is not None
    loaded = rows.load_rows(model_dir)
    assert loaded is not None and loaded.rank_ids == [0, 1]
    from refine.lowering.program import lower_program
    derived = solve(lower_program(model_dir, memo=False, rows=True).main)
    assert not derived.get("output_ok")
    report = pipeline.verify_dir(model_dir)
    assert report.verdict == "refuted" and report.rows is None


def test_example_verified_on_row_0(tmp_path: Path) -> None:
    report = pipeline.verify_dir(_example(tmp_path))
    assert report.verdict == "verified" and report.rows is not None
    assert "row dp=0 (ranks [0, 1])" in report.rows
    assert "concat of 2 row chunks" in (report.outputs[0].reconstruction or "")
    assert f"<b>Rows:</b> {report.rows}" in render.render_html(report)


def test_row_copies_are_recognised_byte_for_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exporter that copies row 0's files to the other rows (groups and `rank` metadata moved
    to the row, as exporters/strategies/mesh.py does) has them recognised without parsing them; a copy
    whose call leaves the row is no copy, and breaks the symmetry."""
    model_dir = _example(tmp_path)
    for r in (2, 3):
        model = onnx.load(str(model_dir / f"rank{r - 2}.onnx"))
        for node in model.graph.node:
            for attr in node.attribute:
                if node.domain == "dist" and attr.name == "group":
                    attr.ints[:] = [m + 2 for m in attr.ints]
        onnx.helper.set_model_props(model, {"world_size": "4", "rank": str(r)})
        onnx.save(model, str(model_dir / f"rank{r}.onnx"))

    def no_parse(*_args: object) -> None:
        raise AssertionError("a row copy was parsed")

    monkeypatch.setattr(rows, "_parse", no_parse)
    loaded = rows.load_rows(model_dir)
    assert loaded is not None and loaded.rank_ids == [0, 1]
    monkeypatch.undo()
    model = onnx.load(str(model_dir / "rank3.onnx"))
    for node in model.graph.node:
        for attr in node.attribute:
            if node.domain == "dist" and attr.name == "group":
                attr.ints[:] = [1, 3]  # (the dp column: a call across the rows)
    onnx.save(model, str(model_dir / "rank3.onnx"))
    assert rows.load_rows(model_dir) is None


@pytest.mark.parametrize("dims", [("dp", "tp"), ("tp", "dp")])
def test_row_copies_in_either_dim_order(dims: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block on a 3-row mesh written as an exporter writes it (row 0's files copied, each
    call's group replaced by the same group of the copy's row): recognised without parsing in
    either dim order, and verified on row 0."""
    mesh = Mesh(dims, 3, 2)
    inputs, body = block(mesh, rng_for("rows_copies", 0))
    case, y = build(f"rows_copies_{dims[0]}", mesh, inputs, body)
    case.outputs = {y: over(shard(0), "dp")}
    model_dir = case.save(tmp_path / case.name)
    first = {mesh.coord(r)["tp"]: r for r in range(mesh.world) if mesh.coord(r)["dp"] == 0}
    for r in range(mesh.world):
        if mesh.coord(r)["dp"] == 0:
            continue
        model = onnx.load(str(model_dir / f"rank{first[mesh.coord(r)['tp']]}.onnx"))
        for node in model.graph.node:
            for attr in node.attribute:
                if node.domain == "dist" and attr.name == "group":
                    attr.ints[:] = mesh.group(r, "tp")
        for prop in model.metadata_props:
            if prop.key == "rank":
                prop.value = str(r)
        onnx.save(model, str(model_dir / f"rank{r}.onnx"))

    def no_parse(*_args: object) -> None:
        raise AssertionError("a row copy was parsed")

    monkeypatch.setattr(rows, "_parse", no_parse)
    loaded = rows.load_rows(model_dir)
    assert loaded is not None and loaded.rank_ids == sorted(first.values())
    report = pipeline.verify_dir(model_dir)
    assert report.verdict == "verified" and report.rows is not None, report.failure
