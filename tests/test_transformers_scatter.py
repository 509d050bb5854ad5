"""HF's own TP plan for Qwen3-VL's text model (issue 40): its interleaved multimodal RoPE writes
`freqs_t[..., idx] = freqs[dim, ..., idx]` (modeling_qwen3_vl.py), exported as ScatterND without a
reduction at distinct index tuples, every operand a replica.  It verifies with
rules/scatter_replica.lp (`scatter_nd_distinct`: the tuples as constants) or with routing.lp's
distinct tuples (a slice of a Range, `distinct_tuples`); without both the proof stops at the
first of those scatters (nothing else takes a ScatterND without a reduction).  The programs
compute what torch computes.  (Cosmos3-edge's text model has the same RoPE; the linear-attention types,
qwen3_5_text and olmo_hybrid, take minutes to export: benchmarks/transformers_plans.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import refine.exporters
from refine.exporters.frameworks import transformers as hf

from refine.pipeline import verify_dir
from refine.report.render import render_text
from refine.run.engine import LIBRARY_ENV, builtin_rules_dir


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> Path:
    return hf.export_model_type("qwen3_vl_text", 2, tmp_path_factory.mktemp("qwen3_vl") / "out").out_dir


def test_qwen3_vl_rope_scatter_verifies_and_matches_torch(qwen3_vl: Path) -> None:
    report = verify_dir(qwen3_vl)
    assert report.verdict == "verified", render_text(report)
    checked = refine.exporters.check(qwen3_vl)
    assert checked.ok, checked.render()


def test_without_the_lemma_the_proof_stops_at_the_rope_scatter(qwen3_vl: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    library = tmp_path / "rules"
    library.mkdir()
    for path in builtin_rules_dir().glob("*.lp"):
        if path.name == "routing.lp":  # (without its ScatterND at distinct tuples either)
            text = path.read_text()
            kept = [ln for ln in text.splitlines() if not ln.startswith("deterministic(N) :- distinct_tuples(N)")]
            assert len(kept) < len(text.splitlines()), "routing.lp's distinct-tuple rules moved: update this test"
            (library / path.name).write_text("\n".join(kept) + "\n")
        elif path.name != "scatter_replica.lp":
            shutil.copy(path, library / path.name)
    monkeypatch.setenv(LIBRARY_ENV, str(library))
    report = verify_dir(qwen3_vl, simulate=False)
    assert report.verdict != "verified", render_text(report)
    assert report.failure is not None and report.failure.node == "rotary_emb/ScatterND", render_text(report)
