"""refine/diagnose/reduced.py: a failed proof on a model too big to simulate gets its counterexample from
the same export at reduced sizes (issue 19); without a recipe the check stays not_run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO
from refine.diagnose import reduced
from refine.pipeline import verify_dir
from refine.report.render import render_text


def test_a_directory_refine_did_not_export_has_no_recipe_and_stays_not_run(tmp_path: Path) -> None:
    model = shutil.copytree(REPO / "examples" / "mlp_missing_allreduce", tmp_path / "m")
    assert reduced.recipe(model) is None and reduced.reducible(model) is None
    report = verify_dir(model, sim_memory_gib=1e-9)
    assert report.verdict == "unproven" and report.numeric is not None
    assert report.numeric.status == "not_run" and "--sim-memory" in report.numeric.summary
    assert report.numeric.reduced_config is None


@pytest.mark.parametrize("manifest", ["not json", json.dumps({"zoo": None}), json.dumps({"zoo": {"config": "tiny"}}),
                                      json.dumps({"zoo": {"model": "llama", "config": "nosuch", "tp": 2}})])
def test_a_broken_or_unknown_recipe_is_no_recipe(tmp_path: Path, manifest: str) -> None:
    (tmp_path / "export.json").write_text(manifest)
    assert reduced.reducible(tmp_path) is None


def test_a_bug_in_a_model_too_big_to_simulate_is_refuted_at_reduced_sizes(tmp_path: Path) -> None:
    """A Llama-3-8B layer (meta: no weight data) at TP 2 with its MLP all-reduce missing: the
    proof fails, the real sizes exceed the cap, and the same export at llama3-8b-reduced sizes
    (32 heads, 8 key/value heads, head size 2) gives the counterexample."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from refine.exporters.zoo.tensor_parallel import export_model
    from refine.exporters.zoo.bugs import BUGS

    out = export_model("llama", "llama3-8b", tp=2, layers=1, meta=True, bug=BUGS["missing_allreduce"],
                       out=tmp_path / "big", workers=0).out_dir
    assert reduced.reducible(out) == "llama3-8b-reduced"
    report = verify_dir(out, sim_memory_gib=0.5)
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert report.numeric is not None and report.numeric.status == "counterexample", text
    assert report.numeric.reduced_config == "llama3-8b-reduced"
    assert "reduced sizes" in report.numeric.summary and report.numeric.output is not None, text
