"""What `refine verify --jobs N` gains (issue 17: distinct layer templates solved in parallel
processes, refine/run/template_solves.py): hybrid stacks of K distinct MLP kinds (examples/layered.py
--kinds K, kind k with the intermediate size ffn * (k + 1)), each verified in a fresh process
with --jobs 1 and with --jobs N, memo on, no counterexample search. Prints a markdown table:
run seconds, template solves, how many were ready when the walk needed them, guessed solves
wasted, wall and peak RSS (of the main process and, as a max, its reaped workers).

    python benchmarks/jobs.py                                   # TP 8 and 64, K 1 2 4 8, 16 layers
    python benchmarks/jobs.py --tp 64 --kinds 4 8 --jobs 2 --layers 16
    python benchmarks/jobs.py --dirs MODEL_DIR ...              # any model directories instead
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale import REFINE, run_step  # noqa: E402  (a fresh process: wall time, peak RSS)


def verify(model_dir: Path, jobs: int) -> tuple[float, float, dict]:
    """(wall s, peak MB, report) of `refine verify --jobs N` in a fresh process."""
    report_path = model_dir.parent / f"{model_dir.name}.jobs{jobs}.json"
    step = run_step([*REFINE, "verify", str(model_dir), "--quiet", "--no-simulate", "--jobs", str(jobs),
                     "--json", str(report_path)])
    report = json.loads(report_path.read_text()) if report_path.exists() else {"verdict": f"error {step.code}"}
    return step.seconds, step.peak_mb, report


def row(label: str, model_dir: Path, jobs: int) -> str:
    wall, peak, report = verify(model_dir, jobs)
    memo = report.get("memo") or {}
    return (f"| {label} | {jobs} | {report['verdict']} | {report.get('run_seconds', 0):.2f} | "
            f"{memo.get('template_solves', 0)} | {memo.get('solved_ahead', 0)} | {memo.get('wasted_solves', 0)} | "
            f"{wall:.1f} | {peak:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--kinds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=2, help="the --jobs to compare with 1 (default 2)")
    parser.add_argument("--dirs", type=Path, nargs="*", help="model directories to verify instead of the stacks")
    args = parser.parse_args()
    print("| model | jobs | verdict | run s | template solves | ready when needed | wasted | verify wall s | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    if args.dirs:
        for d in args.dirs:
            for jobs in (1, args.jobs):
                print(row(d.name, d, jobs), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            for kinds in args.kinds:
                out = Path(tmp) / f"tp{tp}_k{kinds}"
                subprocess.run([sys.executable, str(HERE.parent / "examples" / "layered.py"), str(out),
                                "--layers", str(args.layers), "--tp", str(tp), "--ffn", str(args.ffn),
                                "--kinds", str(kinds)], check=True)
                for jobs in (1, args.jobs):
                    print(row(f"TP {tp}, {kinds} kinds x {args.layers // kinds}", out, jobs), flush=True)


if __name__ == "__main__":
    main()
