"""Correct parallel code spelled the way frameworks spell it verifies, and its bug twin is refuted
(issue 38; the corpus is tests/spellings/). By default one entry per kind of spelling (a loss, a
mean, a mask, a RoPE cache, stacked experts, a DDP average); REFINE_TEST_SWEEP=1 runs them all,
and benchmarks/spellings.py prints the whole table with its times."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import SWEEP
from refine.pipeline import verify_dir

pytest.importorskip("torch")
pytest.importorskip("onnxscript")
from spellings import Spelling, corpus  # noqa: E402  (torch first)

CORPUS = corpus()

# the default run: each a different normal form or lemma family the corpus leans on
DEFAULT = {
    "hf_cross_entropy_vs_vocab_parallel",  # log_softmax parts, the vocab-parallel loss
    "ddp_local_mean_avg",  # mean as a sum over a count, the avg all-reduce
    "hf_rope_cache_context_parallel",  # a RoPE cache sliced by position
    "megatron_stacked_experts_by_index",  # experts stacked in one weight, picked by index
    "nanogpt_explicit_mask_offset",  # a mask written with masked_fill (a known gap: SDPA's split scale)
    "vllm_vocab_parallel_embedding_where",  # a vocab-parallel lookup masked by torch.where
}

CHOSEN = [s for s in CORPUS if SWEEP or s.name in DEFAULT]


def test_corpus_is_well_formed() -> None:
    """Unique names, every default entry present, each twin names its bug class."""
    names = [s.name for s in CORPUS]
    assert len(names) == len(set(names))
    assert DEFAULT <= set(names)
    assert all(1 <= s.bug_class <= 14 and s.bug for s in CORPUS)
    assert {s.style for s in CORPUS} >= {"hf", "torchtitan", "megatron", "deepspeed", "vllm", "nanogpt"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spellings")


@pytest.mark.parametrize("spelling", CHOSEN, ids=[s.name for s in CHOSEN])
def test_spelling_verifies_and_twin_is_refuted(spelling: Spelling, exports: Path) -> None:
    correct = verify_dir(spelling.export(exports))
    if spelling.known_gap:  # (correct code: unproven at worst, never refuted)
        assert correct.verdict in ("verified", "unproven"), f"{spelling.name}: {correct.verdict}"
    else:
        assert correct.verdict == "verified", f"{spelling.name}: {correct.verdict}"
    twin = verify_dir(spelling.export(exports, buggy=True))
    assert twin.verdict == "refuted", f"{spelling.name} twin ({spelling.bug}): {twin.verdict}"
