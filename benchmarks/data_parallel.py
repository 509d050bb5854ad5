"""Cost against the data-parallel degree: a zoo model's training step at DP 2 .. 16 (one batch row
per rank, `refine export --dp N --batch N --train`), each export and `refine verify` in a fresh
process, memo on, no counterexample search. Prints a markdown table (export wall and peak RSS,
lower, run, verify wall and peak RSS) and the fitted growth exponents over the three largest
degrees (issue 15: cost growth with the DP degree).

    python benchmarks/data_parallel.py                           # gpt2 tiny, DP 2 4 8 16
    python benchmarks/data_parallel.py --model llama --dp 2 4 8 --micro-batches 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale import REFINE, run_step, verify  # noqa: E402
from world import exponent  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per rank")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            out = Path(tmp) / f"dp{dp}"
            batch = dp * args.micro_batches
            command = [*REFINE, "export", "--model", args.model, "--config", args.config, "--dp", str(dp),
                       "--batch", str(batch), "--micro-batches", str(args.micro_batches), "--train", "--out", str(out)]
            exported = run_step(command)
            if exported.code != 0:
                raise SystemExit(f"export failed ({' '.join(command)}):\n{exported.output}")
            step, report = verify(out, memo=True)
            rows.append((dp, batch, exported.seconds, exported.peak_mb, report.get("verdict"),
                         report.get("lower_seconds", 0.0), report.get("run_seconds", 0.0), step.seconds, step.peak_mb))
    print(f"{args.model} config {args.config!r}, one training step, one batch row per rank and micro-batch "
          f"({args.micro_batches} micro-batch{'es' if args.micro_batches > 1 else ''}), memo on, `--no-simulate`\n")
    print("| DP | batch | export s | export MB | verdict | lower s | run s | verify wall s | verify MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dp, batch, ex_s, ex_mb, verdict, lower, run, wall, peak in rows:
        print(f"| {dp} | {batch} | {ex_s:.1f} | {ex_mb:.0f} | {verdict} | {lower:.2f} | {run:.2f} | {wall:.1f} | {peak:.0f} |")
    tail = rows[-3:]
    if len(tail) >= 2:
        sizes = [r[0] for r in tail]
        print(f"\ngrowth over DP {sizes[0]}..{sizes[-1]}: export ~ n^{exponent(sizes, [r[2] for r in tail]):.2f}, "
              f"lower ~ n^{exponent(sizes, [r[5] for r in tail]):.2f}, run ~ n^{exponent(sizes, [r[6] for r in tail]):.2f}, "
              f"verify memory ~ n^{exponent(sizes, [r[8] for r in tail]):.2f}")


if __name__ == "__main__":
    main()
