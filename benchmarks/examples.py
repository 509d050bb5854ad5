"""Lower and run times of the bundled examples (TP 2 and 8), as a table.

    python benchmarks/examples.py [--repeat 5]

Prints a markdown table; paste it into benchmarks/RESULTS.md with the date and machine.
Times are the best of --repeat runs (wall clock, one process).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from refine.run.engine import solve
from refine.lowering.graphs import lower_dir
from refine.diagnose.diagnosis import build_report

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def best_of(repeat: int, fn):
    best, value = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}")
    print("| example | ranks | facts | relations | lower s | run s | verdict |")
    print("|---|---|---|---|---|---|---|")
    for d in sorted(p for p in EXAMPLES.iterdir() if (p / "refine.json").is_file()):
        lower_s, facts = best_of(args.repeat, lambda: lower_dir(d))
        run_s, derived = best_of(args.repeat, lambda: solve(facts))
        report = build_report(d.name, facts, derived)
        print(f"| {d.name} | {report.world_size} | {facts.count()} | {report.relations} | "
              f"{lower_s:.3f} | {run_s:.3f} | {report.verdict} |")


if __name__ == "__main__":
    main()
