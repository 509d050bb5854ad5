"""Declared row copies (refine.json `row_copies`, refine/lowering/row_copies.py): a mesh whose DP
rows run row 0's programs stores row 0's files only. Every reader of a whole directory (the
whole lowering, the simulator, `--check`, the mutation harness) makes the copies; the row-symmetric
lowering needs none of them. A directory that declares its rows copies must verify and run as
the same directory with the copies written out, correct or buggy; a file where a copy is
declared, or a stored file missing, is bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from harness import invoke
from refine import pipeline
from refine.config import load_config
from refine.diagnose.simulate import simulate_dir
from refine.kit import mutation
from refine.lowering.row_copies import RowMesh, write_copies_out

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CORRECT = ["mlp_dp2_tp2", "mlp_dp2_tp2_grads"]
BUGGY = ["mlp_dp2_tp2_wrong_group", "mlp_dp2_tp2_grads_over_tp"]


def declare_copies(name: str, tmp: Path) -> Path:
    """Example `name` with its dp=1 row's files removed and declared row 0's copies."""
    out = tmp / name
    shutil.copytree(EXAMPLES / name, out)
    config = load_config(out)
    mesh = RowMesh(config, "dp")
    for r in range(config.world_size):
        if mesh.row(r) != 0:
            (out / f"rank{r}.onnx").unlink()
    raw = json.loads((out / "refine.json").read_text())
    raw["row_copies"] = {"dim": "dp"}
    (out / "refine.json").write_text(json.dumps(raw, indent=1))
    return out


@pytest.mark.parametrize("name", CORRECT)
def test_declared_copies_verify_on_row_zero_and_run_like_written_copies(name: str, tmp_path: Path) -> None:
    """The reduced proof reads row 0 only; the simulator makes the copies, and they compute what the
    example's own files for row dp=1 compute (the example is SPMD: its rows are one program)."""
    declared = declare_copies(name, tmp_path)
    report = pipeline.verify_dir(declared, simulate=False)
    assert report.verdict == "verified" and report.rows is not None and "dp=0" in report.rows, report.failure
    assert "declares them row 0's copies" in report.rows, report.rows
    ours, theirs = simulate_dir(declared, seed=1), simulate_dir(EXAMPLES / name, seed=1)
    assert len(ours.ranks) == len(theirs.ranks) == 4
    for r, (mine, written) in enumerate(zip(ours.ranks, theirs.ranks)):
        for output, value in written.items():
            if output in mine:
                np.testing.assert_allclose(mine[output], value, rtol=1e-6, err_msg=f"rank {r} {output}")


@pytest.mark.parametrize("name", BUGGY)
def test_declared_copies_of_a_buggy_row_are_refuted(name: str, tmp_path: Path) -> None:
    """Row 0's bug is every row's (its copies carry it): the plan is refuted, with the whole mesh
    lowered from the copies once row 0 fails alone, and the simulation of the copies disagrees."""
    declared = declare_copies(name, tmp_path)
    assert mutation.judge(declared).judgement == "differs"
    report = pipeline.verify_dir(declared)
    assert report.verdict == "refuted", report.verdict


def test_the_mutation_harness_mutates_every_rank_apart(tmp_path: Path) -> None:
    """A subject with declared copies is mutated as its written-out copy: every rank a file, no
    declaration, so a change to one rank's file reaches no other rank."""
    declared = declare_copies("mlp_dp2_tp2_grads", tmp_path)
    subject = mutation.load_subject(declared)
    assert subject.name == declared.name and subject.path != declared
    assert sorted(subject.models) == ["rank0.onnx", "rank1.onnx", "rank2.onnx", "rank3.onnx", "seq.onnx"]
    assert "row_copies" not in subject.config and load_config(subject.path).row_copies is None
    assert mutation.run_subject(declared).verdict == "verified"


def test_write_copies_out_is_the_same_plan(tmp_path: Path) -> None:
    declared = declare_copies("mlp_dp2_tp2_grads", tmp_path)
    whole = tmp_path / "whole"
    write_copies_out(declared, whole)
    assert sorted(p.name for p in whole.glob("rank*.onnx")) == [f"rank{r}.onnx" for r in range(4)]
    report = pipeline.verify_dir(whole, simulate=False)
    assert report.verdict == "verified" and report.rows is not None


def test_a_file_where_a_copy_is_declared_is_bad_input(tmp_path: Path) -> None:
    declared = declare_copies("mlp_dp2_tp2", tmp_path)
    shutil.copyfile(declared / "rank0.onnx", declared / "rank2.onnx")
    result = invoke("verify", declared)
    assert result.exit_code == 2 and f"{declared / 'rank2.onnx'}: present, but refine.json declares" in result.stderr


def test_a_missing_row_zero_file_is_bad_input(tmp_path: Path) -> None:
    declared = declare_copies("mlp_dp2_tp2", tmp_path)
    (declared / "rank1.onnx").unlink()
    result = invoke("verify", declared)
    assert result.exit_code == 2 and f"{declared / 'rank1.onnx'}: missing" in result.stderr
    assert "declared copies" in result.stderr


def test_copies_along_a_dim_the_mesh_lacks_are_bad_input(tmp_path: Path) -> None:
    declared = declare_copies("mlp_dp2_tp2", tmp_path)
    raw = json.loads((declared / "refine.json").read_text())
    raw["row_copies"] = {"dim": "pp"}
    (declared / "refine.json").write_text(json.dumps(raw))
    result = invoke("verify", declared)
    assert result.exit_code == 2 and "row_copies: dim 'pp' names none of the mesh dims" in result.stderr
