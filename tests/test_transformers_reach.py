"""HF transformers model types under HF's own TP plans (issue 40) that refine could not reach
before: what each needed, end to end.

- diffllama (v.repeat(1, 2, 1, 1) over a chunk of its key/value heads) and gemma3n_text (AltUp
  repeats its correction over the predictions) meet an ONNX Tile on replicated operands; they
  verify with rules/tile.lp (gemma3n_text's slice assignment after it, a ScatterND at constant
  distinct indices, with rules/scatter_replica.lp), and without tile.lp the proof stops at that
  Tile, at the model's own source line (gemma3n_text under harness.SWEEP: REFINE_TEST_SWEEP=1).
- higgs_audio_v2: AutoModel builds HiggsAudioV2ForConditionalGeneration, a head model over its
  base model that is no causal LM of transformers' mapping; its output has logits (the audio
  head's), no last_hidden_state. The front end exports the field its output has
  (`output_field`), and the export runs and matches torch. Its verdict is left to the lemma
  library: its decoder layers index the hidden states by a boolean mask (hidden_states[mask]:
  NonZero, shapes that depend on the values), which no lemma follows yet; the test asserts only
  that nothing is refuted.
- falcon_h1: its Mamba mixer adds replicated terms to partial sums that one rank holds whole
  (piece [0, D) of D); each such Add once made both a once- and an even-style relation, so the
  styles of one tensor doubled with every Add (2^k relations: 593 s to verify). Whole pieces are
  left to the replica lemmas (rules/elementwise.lp): the layer verifies with relations linear in
  its size.
- gemma4_vision: a vision encoder's config has no vocab_size. Every path that reads the
  vocabulary (the CLI's validation and `export_hf_model` for a model the user built) says so in
  one line, never an AttributeError.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import onnx  # noqa: E402
import torch  # noqa: E402

import refine.exporters  # noqa: E402
from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402
from refine.exporters.errors import ExportError  # noqa: E402
from refine.exporters.frameworks import transformers as hf  # noqa: E402
from refine.exporters.frameworks.transformers_configs import tiny_config  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402
from refine.run.engine import LIBRARY_ENV, builtin_rules_dir  # noqa: E402

HF_SITE = "/site-packages/transformers/"
NO_VOCAB = ("model type 'gemma4_vision' has no token vocabulary (its config has no vocab_size: its inputs are not "
            "token ids, e.g. a vision or audio encoder): refine exports models of token ids")
# model type -> (the Tile node the proof stopped at, the model's source file) before rules/tile.lp
TILES = {
    "diffllama": ("model.layers.0/self_attn/Tile", "diffllama/modeling_diffllama.py"),
    "gemma3n_text": ("model.layers.0/Tile", "gemma3n/modeling_gemma3n.py"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """model type -> its export at TP 2 (HF's plan as shipped), made on first use."""
    return exports_on_first_use(tmp_path_factory.mktemp("reach"),
                                lambda model_type, out: hf.export_model_type(model_type, 2, out))


def _library_without(tmp_path: Path, name: str) -> Path:
    library = tmp_path / "rules"
    library.mkdir()
    for path in builtin_rules_dir().glob("*.lp"):
        if path.name != name:
            shutil.copy(path, library / path.name)
    return library


# --- Tile: diffllama, gemma3n_text ------------------------------------------------------------

# (gemma3n_text under harness.SWEEP: REFINE_TEST_SWEEP=1, benchmarks/sweep.py; diffllama's Tile takes
# the same lemmas of rules/tile.lp by default)
TILE_TYPES = [pytest.param(t, marks=pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): "
                                                       "diffllama meets the same Tile lemmas by default"))
              if t == "gemma3n_text" else t for t in TILES]


@pytest.mark.parametrize("model_type", TILE_TYPES)
def test_tile_under_hfs_plan_verifies(exported, model_type: str) -> None:
    report = verify_dir(exported(model_type))
    assert report.verdict == "verified", render_text(report)


@pytest.mark.parametrize("model_type", TILE_TYPES)
def test_without_the_tile_lemmas_the_proof_stops_at_the_tile(exported, model_type: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIBRARY_ENV, str(_library_without(tmp_path, "tile.lp")))
    report = verify_dir(exported(model_type), simulate=False)
    node, source = TILES[model_type]
    assert report.verdict != "verified", render_text(report)
    assert report.failure is not None and report.failure.node == node, render_text(report)
    assert report.failure.location is not None and HF_SITE in report.failure.location.file, render_text(report)
    assert report.failure.location.file.endswith(source), render_text(report)


# --- higgs_audio_v2: a head model's logits ------------------------------------------------------


def test_the_exported_field_is_the_one_the_output_has() -> None:
    """A causal LM's logits; a head model over its base model (AutoModel of higgs_audio_v2) its
    logits; a base model's last hidden state."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        higgs = AutoModel.from_config(tiny_config("higgs_audio_v2", 2).config)
        llama = AutoModelForCausalLM.from_config(tiny_config("llama", 2).config)
        base = AutoModel.from_config(tiny_config("llama", 2).config)
    assert type(higgs).__name__ == "HiggsAudioV2ForConditionalGeneration"
    assert [hf.output_field(m) for m in (higgs, llama, base)] == ["logits", "logits", "last_hidden_state"]
    assert [hf.as_logits_model(m).output_name for m in (higgs, llama, base)] == ["logits", "logits", "last_hidden_state"]


def test_higgs_audio_v2_exports_its_logits_and_matches_torch(exported) -> None:
    out = exported("higgs_audio_v2")
    config = tiny_config("higgs_audio_v2", 2).config
    assert json.loads((out / "refine.json").read_text())["outputs"] == {"logits": {"layout": "rep"}}
    logits = onnx.load(str(out / "seq.onnx"), load_external_data=False).graph.output
    assert [o.name for o in logits] == ["logits"]
    assert logits[0].type.tensor_type.shape.dim[-1].dim_value == config.num_codebooks * config.codebook_size
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()
    report = verify_dir(out, simulate=False)
    assert report.verdict != "refuted", render_text(report)


def test_higgs_audio_v2_training_step_is_refused_in_one_line(tmp_path: Path) -> None:
    """No causal-LM class, so no loss of its own."""
    assert_export_refused(tmp_path / "out", "has no causal-LM class", "--framework", "transformers",
                          "--model-type", "higgs_audio_v2", "--train")


# --- gemma4_vision: no vocabulary ---------------------------------------------------------------


def test_a_vision_encoder_is_refused_in_one_line(tmp_path: Path) -> None:
    result = invoke("export", "--framework", "transformers", "--model-type", "gemma4_vision", "--tp", "2",
                    "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.output == f"refine: error: {NO_VOCAB}\n"
    assert "AttributeError" not in result.output and not (tmp_path / "out").exists()


def test_a_user_built_vision_encoder_is_refused_in_one_line(tmp_path: Path) -> None:
    """`export_hf_model` reads the vocabulary through the same check as the CLI."""
    from transformers import AutoModel

    model = AutoModel.from_config(tiny_config("gemma4_vision", 2).config, attn_implementation="eager")
    with pytest.raises(ExportError) as caught:
        hf.export_hf_model(model, 2, tmp_path / "out")
    assert str(caught.value) == NO_VOCAB
    assert not (tmp_path / "out").exists()


# --- falcon_h1: partial-sum styles that doubled with every Add ----------------------------------


def test_whole_pieces_do_not_multiply_styles(exported) -> None:
    """falcon_h1 verifies, its relations a few per tensor (before: 257k relations in the layer's
    solve, most of them psum(0, D, D, St) with a style per path through its Adds)."""
    report = verify_dir(exported("falcon_h1"))
    assert report.verdict == "verified", render_text(report)
    assert report.relations < 2_000, report.relations
