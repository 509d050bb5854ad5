"""Context parallelism for the zoo Llama (RoPE; exporters/strategies/context_llama.py): the sequence split over
2 ranks, each rank's rotary positions and causal mask offset by its slice's start, keys (rotated)
and values all-gathered in every attention layer. It verifies with layer functions and matches
torch; its twins (docs/bugs.md class 9) are refuted by a numeric counterexample at the right node:
`cp_positions_not_offset` (every rank's rotary cos/sin of positions 0 .. S/CP - 1) at the rotary
tables' Mul, `cp_mask_not_offset` (tril() without the offset) at layer 0's masked fill, each with
its source line. The sequential model (CausalLlama over the HF model's own modules) computes HF's
logits. The sweep (REFINE_TEST_SWEEP=1) adds --flat, CP 4, GQA, the forward loss, the training
step, ring attention (--ring) and the mask, labels and ring twins. Each export is made once per session through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402

CONTEXT_LLAMA_PY = str(Path(__file__).resolve().parent.parent / "exporters" / "strategies" / "context_llama.py")
# name -> refine export arguments after `--model llama`
EXPORTS = {
    "cp2": ("--config", "tiny", "--cp", "2"),
    "positions": ("--config", "tiny", "--cp", "2", "--bug", "cp_positions_not_offset"),
    "mask": ("--config", "tiny", "--cp", "2", "--bug", "cp_mask_not_offset"),
    # sweep only
    "flat": ("--config", "tiny", "--cp", "2", "--flat"),
    "cp4": ("--config", "tiny", "--cp", "4"),
    "gqa": ("--config", "tiny-gqa", "--cp", "2"),
    "loss2": ("--config", "tiny", "--cp", "2", "--loss"),
    "train2": ("--config", "tiny", "--cp", "2", "--train", "--layers", "1"),
    "loss_shifted": ("--config", "tiny", "--cp", "2", "--loss", "--bug", "cp_labels_shifted_after_split"),
    "ring2": ("--config", "tiny", "--cp", "2", "--ring"),
    "ring4_gqa": ("--config", "tiny-gqa", "--cp", "4", "--ring"),
    **{bug: ("--config", "tiny", "--cp", "2", "--ring", "--bug", bug)
       for bug in ("ring_mask_not_offset", "ring_no_rescale", "ring_block_twice")},
}
SWEEP_VERIFIED = ["flat", "cp4", "gqa", "loss2", "train2", "ring2", "ring4_gqa"] if SWEEP else []
SWEEP_REFUTED = ["loss_shifted", "ring_mask_not_offset", "ring_no_rescale", "ring_block_twice"] if SWEEP else []


@pytest.fixture(scope="session")
def llama_cp_dir(tmp_path_factory):
    """name -> the Llama CP export of that name (EXPORTS), made through the CLI (exit 0)."""
    def export(name: str, out: Path) -> None:
        result = invoke("export", "--model", "llama", *EXPORTS[name], "--out", out)
        assert result.exit_code == 0, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("context_llama"), export)


def test_causal_llama_computes_hf_logits() -> None:
    """The sequential model of a Llama CP export (CausalLlama: our forward, a tril causal mask,
    over HF's own modules) computes what HF's LlamaForCausalLM computes, with the same FQNs."""
    import torch

    from refine.exporters.zoo import models as zoo
    from refine.exporters.strategies.context_llama import CausalLlama

    hf = zoo.build("llama", "tiny", 0)
    ours = CausalLlama(zoo.build("llama", "tiny", 0)).eval()
    (input_ids,) = zoo.example_inputs("llama", "tiny", 0)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids), hf(input_ids), rtol=1e-5, atol=1e-5)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]


def test_llama_context_parallel_verifies_and_matches_torch(llama_cp_dir) -> None:
    """Token ids sliced along the sequence, logits sequence-sharded, every weight replicated;
    VERIFIED with the layers as layer functions, and the ranks' logits are torch's."""
    import refine.exporters

    out = llama_cp_dir("cp2")
    config = json.loads((out / "refine.json").read_text())
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 1, "range": [0, 128]}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 1}}
    assert all(v == {"layout": "rep"} for k, v in config["inputs"].items() if k != "input_ids")
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    assert "logits = concat(r0..r1:logits, axis=1)" in result.output
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


@pytest.mark.parametrize("name,node,file", [
    ("positions", "model.rotary_emb/Mul", "modeling_llama.py"),  # positions[..., None] * inv_freq
    pytest.param("mask", "model.layers.0/self_attn/Where", CONTEXT_LLAMA_PY,  # masked_fill with tril()
                 marks=pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): GPT-2's CP mask "
                                          "twin runs by default in tests/test_context_export.py")),
])
def test_llama_context_parallel_twin_refuted(llama_cp_dir, tmp_path: Path, name: str, node: str, file: str) -> None:
    """REFUTED (exit 1) by a counterexample, the first failure at the rotary tables (positions not
    offset) or layer 0's masked fill (mask not offset), its rank nodes at a source line."""
    report = tmp_path / "report.json"
    result = invoke("verify", llama_cp_dir(name), "--json", report)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output.splitlines()[0]
    assert "counterexample" in result.output and f"at node {node}" in result.output
    failure = json.loads(report.read_text())["failure"]
    assert failure["node"] == node, failure["node"]
    assert failure["location"]["file"].endswith(file) and failure["location"]["line"] > 0, failure["location"]
    assert failure["rank_nodes"] and all(n["location"]["file"].endswith(file) for n in failure["rank_nodes"])


@pytest.mark.parametrize("args,words", [
    (("--model", "llama", "--cp", "2", "--zigzag"), "--zigzag is built for gpt2 only"),
    (("--model", "qwen2", "--cp", "2"), "context parallelism exports gpt2, llama only"),
])
def test_llama_context_parallel_variants_not_built_exit_2(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--config", "tiny", *args)


@pytest.mark.parametrize("name", SWEEP_VERIFIED)
def test_llama_context_parallel_sweep_verifies_and_matches_torch(llama_cp_dir, name: str) -> None:
    """(sweep) --flat, CP 4, GQA (K/V heads gathered, then repeated), the forward loss, the
    training step and ring attention (CP 2; CP 4 with GQA) verify and match torch."""
    import refine.exporters

    result = invoke("verify", llama_cp_dir(name))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    checked = refine.exporters.check(llama_cp_dir(name))
    assert checked.ok, checked.render()


@pytest.mark.parametrize("name", SWEEP_REFUTED)
def test_llama_sweep_twin_refuted(llama_cp_dir, name: str) -> None:
    """(sweep) the labels twin and the ring twins, refuted by a counterexample."""
    result = invoke("verify", llama_cp_dir(name))
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output.splitlines()[0] and "counterexample" in result.output
