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
- tests/test_exporters.py: every zoo model x {TP, TP+SP} x TP {2, 8} (the default run leaves out
  llama_tp8, qwen2_tp8, qwen2_sp8, llama_sp8 and gpt2_tp8: the same exporter code as their TP 2
  cases and as the TP 8 case it keeps, gpt2_sp8: TP within SP at 8 ranks, one head and one token
  per rank);
- tests/test_train.py: Qwen2's TP+SP training step (the default run has Llama's SP step, through
  its sp_norm_grad_reduced control twin, and GPT-2's, whose column-parallel projections have
  biases as Qwen2's q/k/v do; Qwen2's forward is in tests/test_exporters.py);
- tests/test_zoo.py: the correct GPT-2 TP x DP and FSDP training steps of `refine zoo` (the
  default run exports, batches and reruns their twins; the correct steps verify in
  tests/test_export_mesh.py and tests/test_data_parallel_export.py);
- tests/test_export_mesh.py: GPT-2's TP+SP training step on the mesh (the default run has Llama's
  TP step) and `refine zoo`'s forward mesh twin (the default run refutes both forward mesh twins
  from `refine export`);
- tests/test_data_parallel_export.py: the fsdp_grad_not_reduced twin (the default run refutes
  fsdp_grad_avg, the same reduce-scatter's backward at the same node) and Llama's DP training
  step (the default run verifies GPT-2's, and Llama's DP step within the TP x DP one in
  tests/test_export_mesh.py).

- and every other test file with sweep-only cases (the exporters of pipeline, context and expert
  parallelism and their meshes: their larger degrees, other models, more twins), found as the
  files that read SWEEP.

Nothing is left out of a sweep: each test file runs whole, the thinned cases with the rest.
Prints pytest's output and the wall time; exits with pytest's exit code.

    python benchmarks/sweep.py                               # the files above (~19 min on 2 cores, estimated)
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
           "tests/test_export_mesh.py", "tests/test_data_parallel_export.py", "tests/test_expert.py"}
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
