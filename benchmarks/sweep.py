"""The tests' big grids, in full: what the default test run (`python -m pytest -q`) thins to keep
under about 15 minutes, run here with REFINE_TEST_SWEEP=1 (tests/harness.py: SWEEP).

- tests/test_lemmas_structure.py, tests/test_lemmas_context.py: every witness grid at every world
  size 2, 3, 4 with every seed 0, 1, 2 (9 cases; the default run takes 2-0, 3-1, 4-2, one seed
  per world size, even and uneven shards both);
- tests/test_lemmas_algebra.py, tests/test_lemmas_equivalent.py: the witnesses at (world, seed,
  uneven) (2, 3, uneven) as well as (2, 0, even), (3, 1, uneven), (4, 2, even);
- tests/test_exporters.py: every zoo model x {TP, TP+SP} x TP {2, 8} (the default run leaves out
  qwen2_tp8, qwen2_sp8, llama_sp8 and gpt2_tp8: the same exporter code as their TP 2 cases and as
  the TP 8 cases it keeps, llama_tp8 and gpt2_sp8, at 8 ranks).

Nothing is left out of a sweep: each test file runs whole, the thinned cases with the rest.
Prints pytest's output and the wall time; exits with pytest's exit code.

    python benchmarks/sweep.py                               # the files above (~12 min on 2 cores)
    python benchmarks/sweep.py tests/test_lemmas_context.py  # or any pytest arguments
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILES = ["tests/test_lemmas_structure.py", "tests/test_lemmas_context.py", "tests/test_lemmas_algebra.py",
         "tests/test_lemmas_equivalent.py", "tests/test_exporters.py"]


def main(argv: list[str]) -> int:
    args = argv or FILES
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                          env={**os.environ, "REFINE_TEST_SWEEP": "1"})
    print(f"sweep: {' '.join(args)}: {time.perf_counter() - start:.0f} s, exit {done.returncode}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
