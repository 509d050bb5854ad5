"""The tests' big grids, in full: what the default test run (`python -m pytest -q`) thins to keep
under about 15 minutes, run here with REFINE_TEST_SWEEP=1 (tests/harness.py: SWEEP).

- tests/test_lemmas_structure.py, tests/test_lemmas_context.py: every witness grid at every world
  size 2, 3, 4 with every seed 0, 1, 2 (9 cases; the default run takes 2-0, 3-1, 4-2, one seed
  per world size, even and uneven shards both); every case of the reduce and context positions
  and mask grids at each of the 9, of the refused vocab-parallel embedding and cross-entropy
  grids at each of 2-0, 3-1, 4-2 (the default run takes each case once, those in turn);
- tests/test_lemmas_algebra.py, tests/test_lemmas_equivalent.py: the witnesses at (world, seed,
  uneven) (2, 3, uneven) as well as (2, 0, even), (3, 1, uneven), (4, 2, even); and every case
  of the grids of 12 cases or more (op x variant x ...: Gemm, the matmuls, the casts, the
  commuted and broadcast elementwise ones, the partial sums' sums, products and quotients, the
  view chains, the refused swaps and nonlinear partials) at each of those (Gemm: world 2 even
  and 3 uneven), where the default run takes each case once with the params in turn
  (tests/harness.py in_turn / params_in_turn: every case, world size and shard kind still runs);
- tests/test_exporters.py: every zoo model x {TP, TP+SP} x TP {2, 8}, and Llama's SP at batch 1
  (the default run exports every model at TP 2 and Llama's and GPT-2's TP+SP at TP 2; it leaves
  out llama_tp8, qwen2_tp8, gpt2_tp8, llama_sp8, qwen2_sp8, gpt2_sp8, qwen2_gqa_sp2 and
  llama_b1_sp2: the same exporter code as the TP 2 and SP 2 cases it keeps);
- tests/test_train.py: Qwen2's TP+SP training step, the controls sp_norm_grad_reduced and
  faulty_colwise_sum, GPT-2's grad_avg_allreduce twin, the flat step and the forward export of a
  backward bug (the default run verifies Llama's TP step and GPT-2's SP step, whose
  column-parallel projections have biases as Qwen2's q/k/v do, and refutes missing_grad_allreduce
  and sp_norm_grad_unreduced; Qwen2's forward is in tests/test_exporters.py, a flat training step
  in tests/test_transformers.py);
- tests/test_zoo.py: the correct GPT-2 TP x DP and FSDP training steps of `refine zoo` and the
  FSDP twin fsdp_grad_avg (the default run exports, batches and reruns the mesh twin
  mesh_grad_over_tp; the correct steps verify in tests/test_export_mesh.py and
  tests/test_data_parallel_export.py, which refutes fsdp_grad_avg too);
- tests/test_export_mesh.py: GPT-2's TP+SP training step and SP forward twin on the mesh, Llama's
  training-step twin mesh_grad_over_tp, `refine zoo`'s forward mesh twin (the default run verifies
  Llama's forward and training step and refutes Llama's forward twin mesh_wrong_group; the zoo's
  mesh_grad_over_tp twin is refuted by default in tests/test_zoo.py);
- tests/test_data_parallel_export.py: the twins dp_grad_avg, dp_grad_not_reduced, ga_sum_of_means
  and fsdp_grad_not_reduced, and Llama's DP training step (the default run verifies GPT-2's DP,
  accumulation and FSDP steps and refutes one twin of each: dp_local_token_count,
  ga_local_token_count, fsdp_grad_avg; Llama's DP step runs within the TP x DP one in
  tests/test_export_mesh.py);
- tests/test_torchtitan.py: full_dtensor's training step, PP 2's loss normalisation twin, PP 2 x
  TP 2's training steps, CP 2 x TP 2's training step and Qwen3-MoE's (the default run verifies TP 2
  + SP forward and step on spmd_types, the forward on full_dtensor, PP 2's forward and step, PP 2 x
  TP 2's forward, CP 2's and CP 2 x TP 2's forwards, Qwen3-MoE's forward, and refutes a twin of TP,
  SP, PP, CP and MoE), besides the other twins and plain TP 2 it already left out;
- tests/test_own_bugs.py: 15 of the 32 own-code twins, the training-step twins of forward twins the
  default run keeps and the same class at another place (the default run refutes a twin of every
  class, forward and training step, DDP, FSDP and accumulation: SWEEP_ONLY there);
- tests/test_transformers.py: Llama's training step, gemma2 and Qwen3-MoE's training step (the
  default run verifies Llama, qwen3's training step, phi3's packed override and Qwen3-MoE's forward
  and refutes the three wrong overrides), besides batched_mm and the issue's types at TP 2 and 4;
- tests/test_pipeline_train.py: 3 stages, and the twins pp_loss_not_scaled and
  pp_grad_not_accumulated (the default run verifies 2 micro-batches under GPipe and 1F1B, reads the
  3-stage export's programs, and refutes pp_tied_grad_not_reduced and the 1F1B deadlock);
- tests/test_pipeline_export.py: 3 stages and Llama, the pp_micro_batch_order twin, PP 2 x TP 2's
  inline micro-batches and its layer-twice twin (the default run verifies PP 2 with 1 and 2
  micro-batches and PP 2 x TP 2 with one, and with 2 through layer functions with their order twin,
  and refutes pp_layer_twice and the wrong TP peer);
- tests/test_context_export.py: the training steps at CP 2 and the twins cp_positions_not_offset,
  zig-zag's mask and positions (the default run verifies CP 2, zig-zag and the forward loss and
  refutes the mask, chunk-order and labels twins; the positions twin through `refine zoo` in
  tests/test_zoo.py, a CP training step in tests/test_mesh4d.py);
- tests/test_context_llama.py: the mask twin (the default run refutes the positions twin; GPT-2's
  mask twin in tests/test_context_export.py);
- tests/test_ring.py: CP 4 and the ring_no_rescale twin (the default run verifies CP 2 and refutes
  a twin per diagnosis pattern: ring_mask_not_offset, ring_block_twice);
- tests/test_moe.py: the router_rowwise plan and the missing all-reduce after the experts (the
  default run verifies the TP plan and refutes the router on partial logits);
- tests/test_expert.py: the combine twin (the default run refutes global_ids), besides the
  tokens' side, 4 ranks and the 8B meta export;
- tests/test_transformers_reach.py: gemma3n_text's Tile (the default run: diffllama's, with and
  without rules/tile.lp);
- tests/test_megatron.py: Llama TP 2 + SP, GPT TP 4, Llama TP 8, Llama's training step, and the
  twins bias_before_allreduce_sp, qkv_stride_3 and ce_unmasked_backward (the default run verifies
  GPT style at TP 2 + SP, Llama style at TP 2 and TP 4 + SP, GPT style's training step, and
  refutes a twin of each kind: bias, missing all-reduce, stride, Megatron's two cross-entropy
  paths, the SP scatter and norm twins);
- tests/test_mesh4d.py: PP 2 x CP 2 x TP 2 on one sequence (CP within a pipeline verifies by
  default on the 4-D mesh), besides its micro-batches and other twins;
- tests/test_reports.py: the bias_every_rank and extra_scale layered diagnoses (the default run
  has missing_allreduce's; tests/test_causes.py diagnoses the other two by default);
- tests/test_rulecheck.py: docs/first-lemma.md's tutorial run as written (its rules checks and
  verifies are the calls the file's other tests make by default);
- tests/test_guides.py: the guide commands marked `(slow)`, now also the frameworks' TP 2
  exports (docs/frameworks.md), GPT-2's PP 2 and ring exports (docs/parallelism.md), the TP 8
  export (docs/export.md) and the --no-memo rerun (docs/layers.md): their exporter paths verify by
  default in the test files above.

- and every other test file with sweep-only cases (the exporters of pipeline, context and expert
  parallelism and their meshes: their larger degrees, other models, more twins), found as the
  files that read SWEEP.

Nothing is left out of a sweep: each test file runs whole, the thinned cases with the rest.
Prints pytest's output and the wall time; exits with pytest's exit code.

    python benchmarks/sweep.py                               # the files above (an hour or more, estimated)
    python benchmarks/sweep.py tests/test_lemmas_context.py  # or any pytest arguments
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
THINNED = {"tests/test_lemmas_structure.py", "tests/test_lemmas_context.py", "tests/test_lemmas_algebra.py",
           "tests/test_lemmas_equivalent.py", "tests/test_exporters.py", "tests/test_train.py", "tests/test_zoo.py",
           "tests/test_export_mesh.py", "tests/test_data_parallel_export.py", "tests/test_expert.py",
           "tests/test_torchtitan.py", "tests/test_own_bugs.py", "tests/test_transformers.py",
           "tests/test_pipeline_train.py", "tests/test_pipeline_export.py", "tests/test_context_export.py",
           "tests/test_context_llama.py", "tests/test_ring.py", "tests/test_moe.py", "tests/test_transformers_reach.py",
           "tests/test_megatron.py", "tests/test_mesh4d.py", "tests/test_reports.py", "tests/test_rulecheck.py",
           "tests/test_guides.py"}
FILES = sorted(THINNED | {f"tests/{path.name}" for path in (REPO / "tests").glob("test_*.py") if "SWEEP" in path.read_text()})


def main(argv: list[str]) -> int:
    args = argv or FILES
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                          env={**os.environ, "REFINE_TEST_SWEEP": "1"})
    print(f"sweep: {' '.join(args)}: {time.perf_counter() - start:.0f} s, exit {done.returncode}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
