"""Mutation testing of refine (refine/kit/mutation.py): random one-change mutants of model
directories, each judged by running it and verified by refine. Prints the confusion table
(refine's verdict x the judge's), the holes (verified while the numbers differ or the programs
cannot run, or a crash), the false alarms and the equivalent mutants left unproven.

    python benchmarks/mutation.py --count 300 [--seed 0] [--jobs 2] [--no-zoo] [--zoo-dir DIR] [--only A,B] [--json F] [--write]

Subjects: the bundled examples (examples/*/ with a refine.json), a 2-layer stack of layer
functions (examples/layered.py), and, when torch is installed, small zoo exports (Llama TP 2,
GPT-2 TP 2 with sequence parallelism, Qwen2 TP 2, training steps of Llama TP 2 and GPT-2
TP 2 with sequence parallelism and of GPT-2 and Llama at DP 2 (GPT-2 also accumulating 2 micro-batches, and
sharding its parameters: FSDP), the forward of Llama and GPT-2 (with SP) at TP 2 x DP 2 on a mesh and Llama's training step there
and at PP 2 x DP 2 x TP 2 and PP 2 x CP 2 x TP 2, and with the megatron extra Megatron-Core's GPTModel at TP 2 with
SP and in its Llama style, and their training steps, and HF transformers' Llama, Phi-3 and Gemma 2 under HF's
own TP plans, and with the torchtitan extra torchtitan's Llama 3 at TP 2 with SP, forward and training step, and at CP 2, and CP 2 x TP 2's training step), exported once per run into a temporary
directory, or into --zoo-dir and reused from there when present. `--write` replaces the
`## Mutation testing` section of benchmarks/RESULTS.md with this run's tables.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from refine.config import CONFIG_NAME
from refine.kit.mutation import OPERATORS_BY_NAME, TARGET_KINDS, Campaign, MutantRow, run_campaign

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Mutation testing"
ZOO = {"llama_tp2": ["--model", "llama", "--tp", "2"],
       "gpt2_tp2_sp": ["--model", "gpt2", "--tp", "2", "--sp"],
       "qwen2_tp2": ["--model", "qwen2", "--tp", "2"],
       "llama_b1_sp2": ["--model", "llama", "--config", "tiny-b1", "--tp", "2", "--sp"],
       "llama_tp2_train": ["--model", "llama", "--tp", "2", "--train"],
       "gpt2_tp2_sp_train": ["--model", "gpt2", "--tp", "2", "--sp", "--train"],
       # data-parallel training steps: batch slices, the global token count, gradient all-reduces
       "gpt2_dp2_train": ["--model", "gpt2", "--dp", "2", "--train", "--layers", "1"],
       "llama_dp2_train": ["--model", "llama", "--dp", "2", "--train", "--layers", "1"],
       "gpt2_dp2_ga2_train": ["--model", "gpt2", "--dp", "2", "--micro-batches", "2", "--batch", "4", "--train",
                              "--layers", "1"],
       # a TP x DP mesh (batch windows, rules/windows.lp), layer functions; an FSDP step
       "llama_tp2_dp2": ["--model", "llama", "--tp", "2", "--dp", "2", "--layers", "2"],
       "gpt2_tp2_dp2_sp": ["--model", "gpt2", "--tp", "2", "--dp", "2", "--sp", "--layers", "1", "--flat"],
       "gpt2_dp2_fsdp_train": ["--model", "gpt2", "--dp", "2", "--train", "--fsdp", "--layers", "1"],
       "llama_tp2_dp2_train": ["--model", "llama", "--tp", "2", "--dp", "2", "--train", "--layers", "1"],
       # pipeline stages (one with the TP plan inside each), context parallelism (all-gather, ring), experts
       "gpt2_pp2_mb2": ["--model", "gpt2", "--pp", "2", "--micro-batches", "2"],
       "gpt2_pp2_tp2": ["--model", "gpt2", "--pp", "2", "--tp", "2"],
       "gpt2_pp2_tp2_mb2": ["--model", "gpt2", "--pp", "2", "--tp", "2", "--micro-batches", "2"],
       # a pipeline training step: per-micro-batch backward through Send/Recv, the tied embedding's all-reduce
       "gpt2_pp2_train": ["--model", "gpt2", "--pp", "2", "--micro-batches", "2", "--train"],
       "gpt2_pp2_train_1f1b": ["--model", "gpt2", "--pp", "2", "--micro-batches", "2", "--train", "--schedule", "1f1b"],
       # a PP x TP training step: each stage's TP plan with its backward, the tied embedding's all-reduce per TP position
       "gpt2_pp2_tp2_train": ["--model", "gpt2", "--pp", "2", "--tp", "2", "--micro-batches", "2", "--train"],
       # ... on three stages: the later stages' layer templates solved as an earlier one's (refine/run/stage_symmetry.py)
       "gpt2_pp3_tp2_train": ["--model", "gpt2", "--pp", "3", "--tp", "2", "--layers", "3", "--micro-batches", "2",
                              "--train"],
       # a PP x DP x TP training step (exporters/strategies/mesh4d.py): each DP row's micro-batches, the token count,
       # loss and gradients all-reduced over the stage's data group
       "llama_pp2_dp2_tp2_train": ["--model", "llama", "--pp", "2", "--dp", "2", "--tp", "2", "--batch", "4",
                                   "--micro-batches", "2", "--train"],
       # ... with GPT-2's tied embedding: each DP row's two stage summands added over the pp group (rules/stages.lp)
       "gpt2_pp2_dp2_tp2_train": ["--model", "gpt2", "--pp", "2", "--dp", "2", "--tp", "2", "--train"],
       # ... and PP x CP x TP on one sequence: K/V gathered over cp from each rank's heads, their gradients scattered back
       "llama_pp2_cp2_tp2_train": ["--model", "llama", "--pp", "2", "--cp", "2", "--tp", "2", "--batch", "1", "--train"],
       # ... and the 4-D mesh PP x DP x CP x TP (16 ranks, a row per DP rank): windows of windows
       "llama_pp2_dp2_cp2_tp2_train": ["--model", "llama", "--pp", "2", "--dp", "2", "--cp", "2", "--tp", "2",
                                       "--train"],
       "gpt2_cp2": ["--model", "gpt2", "--cp", "2"],
       "gpt2_cp2_ring": ["--model", "gpt2", "--cp", "2", "--ring"],
       "gpt2_cp2_zigzag": ["--model", "gpt2", "--cp", "2", "--zigzag"],
       # the forward training loss under CP: labels sliced alongside the tokens, the token count all-reduced
       "gpt2_cp2_loss": ["--model", "gpt2", "--cp", "2", "--loss"],
       # the CP training step: the K/V all-gathers' backward reduce-scatters, gradients all-reduced
       "gpt2_cp2_train": ["--model", "gpt2", "--cp", "2", "--train"],
       # Llama (RoPE) under CP: each rank's rotary positions and causal mask offset by its slice's start
       "llama_cp2": ["--model", "llama", "--cp", "2"],
       # ... with ring attention (RoPE on q/k, GQA heads repeated per key/value block)
       "llama_cp2_ring": ["--model", "llama", "--cp", "2", "--ring"],
       "mixtral_ep2": ["--model", "mixtral", "--ep", "2", "--layers", "1"],
       # an EP x TP mesh: attention TP within each row, experts sharded and all-to-all'ed over each column
       "mixtral_ep2_tp2": ["--model", "mixtral", "--ep", "2", "--tp", "2", "--layers", "1"],
       # Megatron-Core's own GPTModel (the megatron extra): GPT style with SP, Llama style (GQA, SwiGLU, RoPE)
       "megatron_tp2_sp": ["--framework", "megatron-core", "--tp", "2", "--sp"],
       "megatron_llama_tp2": ["--framework", "megatron-core", "--config", "tiny-llama", "--tp", "2"],
       "megatron_llama_tp4": ["--framework", "megatron-core", "--config", "tiny-llama", "--tp", "4"],
       # its training steps: Megatron's vocab-parallel cross-entropy and custom backward
       "megatron_train_tp2": ["--framework", "megatron-core", "--tp", "2", "--train"],
       "megatron_llama_train_tp2": ["--framework", "megatron-core", "--config", "tiny-llama", "--tp", "2", "--train"],
       # HF transformers under HF's own TP plans (issue 40): a dense Llama (embedding_rowwise), Phi-3's packed
       # qkv_proj / gate_up_proj (colwise_gather_output + rowwise_split_input), Gemma 2 (tied head, soft-capping)
       "hf_llama_tp2": ["--framework", "transformers", "--model-type", "llama", "--tp", "2"],
       "hf_phi3_tp2": ["--framework", "transformers", "--model-type", "phi3", "--tp", "2"],
       "hf_gemma2_tp2": ["--framework", "transformers", "--model-type", "gemma2", "--tp", "2"],
       # HF's MoE experts code under moe_tp_experts (sort by expert, grouped GEMM, inverse permutation)
       "hf_qwen3_moe_tp2": ["--framework", "transformers", "--model-type", "qwen3_moe", "--tp", "2"],
       "hf_qwen3_moe_tp2_train": ["--framework", "transformers", "--model-type", "qwen3_moe", "--tp", "2", "--train"],
       # ... and under HF's expert-parallel plan (AllReduceEP, batched_mm experts: each rank's routes to its own
       # experts, local ids from the global ones, the others masked, the outputs all-reduced), forward and step
       "hf_mixtral_ep2": ["--framework", "transformers", "--model-type", "mixtral", "--tp", "2", "--ep", "2",
                          "--experts", "batched_mm"],
       "hf_qwen3_moe_ep2_train": ["--framework", "transformers", "--model-type", "qwen3_moe", "--tp", "2", "--ep", "2",
                                  "--experts", "batched_mm", "--train"],
       # ... with HF's default grouped_mm experts (rules/sorted_rows.lp: each side sorts the routes in its own
       # order, the rank by local id; histc counts, their cumsum, the inverse permutation), forward and step
       "hf_mixtral_ep2_grouped": ["--framework", "transformers", "--model-type", "mixtral", "--tp", "2", "--ep", "2",
                                  "--experts", "grouped_mm"],
       "hf_mixtral_ep2_grouped_train": ["--framework", "transformers", "--model-type", "mixtral", "--tp", "2", "--ep",
                                        "2", "--experts", "grouped_mm", "--train"],
       "hf_gpt_oss_ep2_grouped": ["--framework", "transformers", "--model-type", "gpt_oss", "--tp", "2", "--ep", "2",
                                  "--experts", "grouped_mm"],
       # HF's token-moving AllToAllEP at static capacity (its exchanges dist.AllToAllV; rules/exchanged_rows.lp:
       # the sorted slices, the counts' AllToAll, the received ids, the rows sent back and unsorted)
       "hf_mixtral_ep2_a2a": ["--framework", "transformers", "--model-type", "mixtral", "--tp", "2", "--ep", "2",
                              "--experts", "batched_mm", "--ep-implementation", "all_to_all"],
       # ... with HF's default grouped_mm experts (rules/placed_rows.lp: the receiver sorts its rows again, the
       # sequential rows placed by the sequential sort)
       "hf_mixtral_ep2_a2a_grouped": ["--framework", "transformers", "--model-type", "mixtral", "--tp", "2", "--ep", "2",
                                      "--experts", "grouped_mm", "--ep-implementation", "all_to_all"],
       "hf_mixtral_ep2_a2a_grouped_train": ["--framework", "transformers", "--model-type", "mixtral", "--tp", "2", "--ep",
                                            "2", "--experts", "grouped_mm", "--ep-implementation", "all_to_all", "--train"],
       # torchtitan's AllToAllTokenDispatcher (rules/expert_major.lp: routing-map counts, _permute's computed
       # expert-major index, the groups from each expert's total, _unpermute's scatter, the scores' combine)
       # ... with a batch of two sequences under SP: each rank's routes each sequence's window (a blocked window)
       "tt_qwen3_moe_ep2": ["--framework", "torchtitan", "--model", "qwen3_moe", "--tp", "2", "--sp", "--ep", "2"],
       "tt_qwen3_moe_ep2_train": ["--framework", "torchtitan", "--model", "qwen3_moe", "--tp", "2", "--sp", "--ep", "2",
                                  "--train"],
       "tt_qwen3_moe_ep2_seq": ["--framework", "torchtitan", "--model", "qwen3_moe", "--config", "tiny-seq", "--tp", "2",
                                "--sp", "--ep", "2"],
       "tt_qwen3_moe_ep2_seq_train": ["--framework", "torchtitan", "--model", "qwen3_moe", "--config", "tiny-seq", "--tp",
                                      "2", "--sp", "--ep", "2", "--train"],
       # Megatron-Core's MoELayer (config tiny-moe) under TP 2 + SP: its allgather token dispatcher (the routing map,
       # probs and tokens all-gathered, masked_select at the number of routes, SequentialMLP's chunk windows, each
       # expert's hidden units over TP, the rows joined, scattered back and reduce-scattered), forward and training step
       "megatron_moe_tp2_sp": ["--framework", "megatron-core", "--config", "tiny-moe", "--tp", "2", "--sp"],
       "megatron_moe_tp2_sp_train": ["--framework", "megatron-core", "--config", "tiny-moe", "--tp", "2", "--sp",
                                     "--train"],
       # gpt-oss's AllToAllEP training step with grouped_mm (its biases' gradient at the receiver's sorted ids)
       "hf_gpt_oss_ep2_a2a_grouped_train": ["--framework", "transformers", "--model-type", "gpt_oss", "--tp", "2", "--ep",
                                            "2", "--experts", "grouped_mm", "--ep-implementation", "all_to_all",
                                            "--train"],
       "hf_mixtral_ep2_a2a_train": ["--framework", "transformers", "--model-type", "mixtral", "--tp", "2", "--ep", "2",
                                    "--experts", "batched_mm", "--ep-implementation", "all_to_all", "--train"],
       # (its training step: the interleaved gate/up's gradient scattered back off the route axis, the
       # biases' gradients at the sorted ids)
       "hf_gpt_oss_ep2_grouped_train": ["--framework", "transformers", "--model-type", "gpt_oss", "--tp", "2", "--ep",
                                        "2", "--experts", "grouped_mm", "--train"],
       # ... gpt-oss (its fused gate/up interleaved: strided slices, clamp(max=...), biases gathered per row) and
       # PhiMoE (its experts picked by arg-maxes)
       "hf_gpt_oss_ep2": ["--framework", "transformers", "--model-type", "gpt_oss", "--tp", "2", "--ep", "2",
                          "--experts", "batched_mm"],
       "hf_gpt_oss_ep2_train": ["--framework", "transformers", "--model-type", "gpt_oss", "--tp", "2", "--ep", "2",
                                "--experts", "batched_mm", "--train"],
       "hf_phimoe_ep2": ["--framework", "transformers", "--model-type", "phimoe", "--tp", "2", "--ep", "2",
                         "--experts", "batched_mm"],
       # ... training steps this session's lemmas reach: GLM-4-MoE-Lite's MLA (its kv projection's gradient a
       # replica next to a partial, taken back apart by HF's mla_kv_a_proj style), Jamba's Mamba mixer (a
       # convolution's backward translated, an unrolled scan), Hunyuan V4 (arg-max along a slice of the heads)
       "hf_glm4_moe_lite_tp2_train": ["--framework", "transformers", "--model-type", "glm4_moe_lite", "--tp", "2",
                                      "--train"],
       "hf_jamba_tp2_train": ["--framework", "transformers", "--model-type", "jamba", "--tp", "2", "--train"],
       "hf_hy_v4_ep2_train": ["--framework", "transformers", "--model-type", "hy_v4", "--tp", "2", "--ep", "2",
                              "--experts", "batched_mm", "--train"],
       # ... DiffLlama (Tile: its values repeated over the head halves), Qwen3-VL (multimodal RoPE: ScatterND at
       # constant distinct indices)
       "hf_diffllama_tp2": ["--framework", "transformers", "--model-type", "diffllama", "--tp", "2"],
       "hf_qwen3_vl_tp2": ["--framework", "transformers", "--model-type", "qwen3_vl_text", "--tp", "2"],
       # ... Falcon-H1 (a Mamba mixer: replicated terms added to partial sums a rank holds whole)
       "hf_falcon_h1_tp2": ["--framework", "transformers", "--model-type", "falcon_h1", "--tp", "2"],
       # a module of one's own (examples/own_training.py, refine.exporters.export_train): its training step under
       # its own TP plan, and under DDP's own semantics (each rank's mean loss, gradients all-reduced with avg)
       "own_tp2_train": ["--module", f"{EXAMPLES / 'own_training.py'}:example", "--tp", "2", "--train"],
       "own_ddp2_train": ["--module", f"{EXAMPLES / 'own_training.py'}:example", "--dp", "2", "--train"],
       # ... its TP plan within each row of a DP x TP mesh, DDP over each column (verified on one row)
       "own_tp2_dp2_train": ["--module", f"{EXAMPLES / 'own_training.py'}:example", "--tp", "2", "--dp", "2",
                             "--train"],
       # ... FSDP's avg reduce-scatter of the local mean's gradients, and DDP with gradient accumulation (the rank's
       # factor K carried through the backward by the scale copies, rules/scales.lp)
       "own_fsdp2_train": ["--module", f"{EXAMPLES / 'own_training.py'}:example", "--dp", "2", "--fsdp", "--train"],
       "own_ddp2_ga2_train": ["--module", f"{EXAMPLES / 'own_training.py'}:example", "--dp", "2",
                              "--micro-batches", "2", "--train"],
       # torchtitan's Llama 3 through its own parallelize path (issue 41, the torchtitan extra): TP 2 + SP on the
       # spmd_types backend (clamp-then-mask vocab-parallel embedding, complex RoPE as real pairs), its training
       # step (vocab-parallel cross-entropy, the SP norms' gradients left partial), and on full_dtensor
       "tt_llama3_tp2_sp": ["--framework", "torchtitan", "--model", "llama3", "--tp", "2", "--sp"],
       "tt_llama3_tp2_sp_train": ["--framework", "torchtitan", "--model", "llama3", "--tp", "2", "--sp", "--train"],
       "tt_llama3_tp2_sp_fd_train": ["--framework", "torchtitan", "--model", "llama3", "--tp", "2", "--sp", "--train",
                                     "--backend", "full_dtensor"],
       # ... and CP 2 (FlexAttention, its K/V all-gathered by the sharding config; each rank's run of the tokens,
       # positions and block-mask rows)
       "tt_llama3_cp2": ["--framework", "torchtitan", "--model", "llama3", "--config", "tiny-cp", "--cp", "2"],
       # ... and PP 2's training step (2 micro-batches, 1F1B: the loss over the step's token count on the last
       # stage, gradients sent back and summed over the micro-batches)
       "tt_llama3_pp2_train": ["--framework", "torchtitan", "--model", "llama3", "--pp", "2", "--micro-batches", "2",
                               "--train"],
       # ... and PP 2 x TP 2 on its (pp, tp) mesh, 2 micro-batches: forward (each stage's TP shard of each
       # micro-batch, the logits concatenated) and training step (each micro-batch's vocab-parallel loss)
       "tt_llama3_pp2_tp2": ["--framework", "torchtitan", "--model", "llama3", "--pp", "2", "--tp", "2",
                             "--micro-batches", "2"],
       "tt_llama3_pp2_tp2_train": ["--framework", "torchtitan", "--model", "llama3", "--pp", "2", "--tp", "2",
                                   "--micro-batches", "2", "--train"],
       "tt_llama3_pp2_tp2_sp_train": ["--framework", "torchtitan", "--model", "llama3", "--pp", "2", "--tp", "2",
                                      "--sp", "--micro-batches", "2", "--train"],
       # ... and CP 2 x TP 2's forward (the logits a two-dim shard: the sequence over cp, the vocabulary over tp)
       "tt_qwen3_moe_tp2_sp": ["--framework", "torchtitan", "--model", "qwen3_moe", "--tp", "2", "--sp"],
       "tt_qwen3_moe_tp2_train": ["--framework", "torchtitan", "--model", "qwen3_moe", "--tp", "2", "--train"],
       "tt_llama3_cp2_tp2": ["--framework", "torchtitan", "--model", "llama3", "--config", "tiny-cp", "--cp", "2",
                             "--tp", "2"],
       # ... and its training step (each TP shard's gradient left partial over cp: rebuilt as sums, report.lp slsum)
       "tt_llama3_cp2_tp2_train": ["--framework", "torchtitan", "--model", "llama3", "--config", "tiny-cp", "--cp", "2",
                                   "--tp", "2", "--train"],
       # FSDP 2 x TP 2 on full_dtensor (exporters/frameworks/torchtitan_fsdp.py): two-dim weight shards, gradients
       # reduce-scattered over dp_shard
       "tt_llama3_fsdp2_tp2_train": ["--framework", "torchtitan", "--model", "llama3", "--tp", "2", "--dp", "2", "--fsdp",
                                     "--backend", "full_dtensor", "--train"],
       # PP 2 x TP 2 on full_dtensor: DTensors rebuilt at the stage boundary, both directions
       "tt_llama3_pp2_tp2_fd_train": ["--framework", "torchtitan", "--model", "llama3", "--pp", "2", "--tp", "2",
                                      "--micro-batches", "2", "--backend", "full_dtensor", "--train"],
       # CP 2 x TP 2 on full_dtensor: FSDP over cp, DTensor's K/V gather along the batch-1 axis and its
       # gradient's stacked reduce-scatter
       "tt_llama3_cp2_tp2_fd_train": ["--framework", "torchtitan", "--model", "llama3", "--config", "tiny-cp", "--cp", "2",
                                      "--tp", "2", "--backend", "full_dtensor", "--train"],
       # FSDP 2 x TP 2 on spmd_types: the shim on spmd_types' annotations (partition-spec two-dim shards)
       "tt_llama3_fsdp2_tp2_spmd_train": ["--framework", "torchtitan", "--model", "llama3", "--tp", "2", "--sp", "--dp", "2",
                                          "--fsdp", "--train"]}


def bundled_examples() -> list[Path]:
    return sorted(d for d in EXAMPLES.iterdir() if (d / CONFIG_NAME).is_file())


def layered_stack(root: Path, kinds: int = 1) -> Path:
    """Two MLP blocks as calls of one layer function (the bundled examples have none); with
    `kinds` K > 1, a hybrid stack: 2K blocks of K distinct functions (K templates in a chain)."""
    spec = importlib.util.spec_from_file_location("examples_layered", EXAMPLES / "layered.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if kinds == 1:
        return module.write(root / "layered_2x_tp2", 2, 2)
    return module.write(root / f"layered_hybrid{kinds}_tp2", 2 * kinds, 2, kinds=kinds)


def zoo_exports(root: Path, wanted: set[str] | None = None) -> list[Path]:
    """Tiny zoo models (torch extra; Megatron's with the megatron extra), exported with `refine
    export` unless already in `root` (only the `wanted` ones, if given)."""
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed: no zoo subjects", file=sys.stderr)
        return []
    megatron = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    out = []
    for name, args in ZOO.items():
        if (wanted is not None and name not in wanted) or ("megatron-core" in args and not megatron) \
                or ("torchtitan" in args and importlib.util.find_spec("torchtitan") is None):
            continue
        target = root / name
        if not (target / CONFIG_NAME).is_file():
            print(f"exporting {name} ...", file=sys.stderr, flush=True)
            config = [] if "--config" in args else ["--config", "tiny"]
            command = [sys.executable, "-m", "refine.cli.main", "export", *args, *config, "--out", str(target)]
            done = subprocess.run(command, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"export failed ({' '.join(command)}):\n{done.stdout}{done.stderr}")
        out.append(target)
    return out


def progress(row: MutantRow) -> None:
    mark = "  HOLE" if row.hole else ""
    print(f"#{row.index} {row.verdict}/{row.judgement} {row.seconds:.1f}s {row.operator}{mark}", file=sys.stderr, flush=True)


def section(campaign: Campaign, command: str, subjects: list[Path]) -> str:
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    names = ", ".join(p.name for p in subjects)
    return "\n".join([
        SECTION, "",
        (f"{datetime.date.today().isoformat()}, {machine}: `{command}`; {len(campaign.rows)} mutants "
         f"(seed {campaign.seed}) of {len(subjects)} subjects ({names}), {campaign.seconds:.0f} s wall. Rows: refine's "
         "verdict; columns: the judge (the programs run on 2 seeds, outputs compared by the rule of "
         "docs/model-dir.md). A hole is `verified` on a mutant that differs or cannot run, or a crash."), "",
        campaign.markdown(), "",
        campaign.operator_markdown(), ""])


def write_section(text: str, path: Path = RESULTS) -> None:
    """Replace the `## Mutation testing` section (up to the next `## ` heading), or append it."""
    old = path.read_text()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    new = pattern.sub(lambda _m: text.rstrip("\n") + "\n\n", old, count=1) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
    path.write_text(new.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300, help="mutants to make")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant (judge and verify)")
    parser.add_argument("--no-zoo", action="store_true", help="bundled examples and the layered stack only")
    parser.add_argument("--zoo-dir", type=Path, help="export the zoo subjects here (reused when present)")
    parser.add_argument("--json", type=Path, help="write every row (pydantic JSON) here")
    parser.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of {RESULTS.name}")
    parser.add_argument("--only", help="comma-separated subject names (e.g. llama_tp2_train,gpt2_tp2_sp_train)")
    parser.add_argument("--verify-jobs", type=int, default=1,
                        help="refine verify --jobs for every mutant (its layers solved ahead in worker processes)")
    parser.add_argument("--operators", help="comma-separated operator names to draw from (default: all; the call "
                        "operators: drop_collective,collective_group,collective_other_group,point_to_point,reorder_call)")
    parser.add_argument("--targets", default=",".join(TARGET_KINDS),
                        help="comma-separated kinds of file model operators land on: seq, one (one rank), every "
                        "(every rank alike; with seq, what keeps a row-symmetric subject's rows alike)")
    args = parser.parse_args()
    operators = tuple(args.operators.split(",")) if args.operators else None
    targets = tuple(args.targets.split(","))
    if not targets or set(targets) - set(TARGET_KINDS):
        raise SystemExit(f"--targets: each of {', '.join(TARGET_KINDS)}, got {args.targets!r}")
    unknown = sorted(set(operators or ()) - set(OPERATORS_BY_NAME))
    if unknown:
        raise SystemExit(f"--operators: no operator named {unknown} (known: {', '.join(OPERATORS_BY_NAME)})")
    with tempfile.TemporaryDirectory(prefix="refine-mutation-") as tmp:
        subjects = bundled_examples() + [layered_stack(Path(tmp)), layered_stack(Path(tmp), kinds=3)]
        if not args.no_zoo:
            subjects += zoo_exports(args.zoo_dir or Path(tmp) / "zoo", set(args.only.split(",")) if args.only else None)
        if args.only:
            wanted = set(args.only.split(","))
            subjects = [s for s in subjects if s.name in wanted]
            if {s.name for s in subjects} != wanted:
                raise SystemExit(f"--only: no subject named {sorted(wanted - {s.name for s in subjects})}")
        campaign = run_campaign(subjects, args.count, args.seed, args.jobs, args.timeout, done=progress,
                                verify_jobs=args.verify_jobs, operators=operators, targets=targets)
    if args.json:
        args.json.write_text(campaign.model_dump_json(indent=1))
    print(campaign.markdown())
    print()
    print(campaign.operator_markdown())
    if args.write:
        command = "python benchmarks/mutation.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        write_section(section(campaign, command.strip(), subjects))
        print(f"\nwrote the '{SECTION}' section of {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
