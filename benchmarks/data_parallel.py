"""Cost against the data-parallel degree: a zoo model's training step at DP 2 .. 16 (one batch row
per rank, `refine export --dp N --batch N --train`), or with `--tp T` the forward of a TP x DP
plan on a DP x TP mesh (`refine export --tp T --dp N`), each export and `refine verify` in a fresh
process, memo on, no counterexample search. Prints a markdown table (export wall and peak RSS,
lower, run, verify wall and peak RSS) and the fitted growth exponents over the three largest
degrees (issue 15: cost growth with the DP degree, and at fixed TP).

    python benchmarks/data_parallel.py                           # gpt2 tiny, DP 2 4 8 16
    python benchmarks/data_parallel.py --model llama --dp 2 4 8 --micro-batches 2
    python benchmarks/data_parallel.py --model llama --tp 2 --dp 2 4 8 16          # TP 2 x DP n
    python benchmarks/data_parallel.py --model llama --config llama3-405b --tp 8 --dp 4 --sp --meta
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale import REFINE, run_step, verify  # noqa: E402
from world import growth_line  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per rank")
    parser.add_argument("--tp", type=int, default=1, help="TP degree inside each DP row (> 1: the forward on a DP x TP mesh)")
    parser.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism too")
    parser.add_argument("--meta", action="store_true", help="export on the meta device (no weight data)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            out = Path(tmp) / f"dp{dp}"
            batch = dp * args.micro_batches
            plan = ["--tp", str(args.tp), *(["--sp"] if args.sp else [])] if args.tp > 1 else \
                ["--micro-batches", str(args.micro_batches), "--train"]
            command = [*REFINE, "export", "--model", args.model, "--config", args.config, "--dp", str(dp),
                       "--batch", str(batch), *plan, *(["--meta"] if args.meta else []), "--out", str(out)]
            exported = run_step(command)
            if exported.code != 0:
                raise SystemExit(f"export failed ({' '.join(command)}):\n{exported.output}")
            step, report = verify(out, memo=True)
            rows.append((dp, batch, exported.seconds, exported.peak_mb, report.get("verdict"),
                         report.get("lower_seconds", 0.0), report.get("run_seconds", 0.0), step.seconds, step.peak_mb))
    if args.tp > 1:
        print(f"{args.model} config {args.config!r}, forward, TP {args.tp}{' with SP' if args.sp else ''} inside each "
              f"DP row, one batch row per DP row, memo on, `--no-simulate`{', meta weights' if args.meta else ''}\n")
    else:
        print(f"{args.model} config {args.config!r}, one training step, one batch row per rank and micro-batch "
              f"({args.micro_batches} micro-batch{'es' if args.micro_batches > 1 else ''}), memo on, `--no-simulate`\n")
    print("| DP | ranks | batch | export s | export MB | verdict | lower s | run s | verify wall s | verify MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dp, batch, ex_s, ex_mb, verdict, lower, run, wall, peak in rows:
        print(f"| {dp} | {dp * args.tp} | {batch} | {ex_s:.1f} | {ex_mb:.0f} | {verdict} | {lower:.2f} | {run:.2f} | "
              f"{wall:.1f} | {peak:.0f} |")
    line = growth_line("DP", rows, {"export": 2, "lower": 5, "run": 6, "verify memory": 8})
    if line:
        print(line)


if __name__ == "__main__":
    main()
