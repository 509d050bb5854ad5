"""Export cost of the zoo: time to capture the sequential model and each rank, and peak RSS.

    python benchmarks/export.py [--models llama qwen2 gpt2] [--tp 2 8] [--config tiny] [--sp] [--flat]

Each export runs in a fresh child process (`--one`), so the times include importing torch and
transformers and the peak resident set sizes belong to that export alone: the exporting
process's own (resource.getrusage RUSAGE_SELF) and its largest forked rank worker's
(RUSAGE_CHILDREN). A plan the config cannot take (heads over TP) is skipped. Prints a markdown
table. Depth and the Llama 3 presets, exported and verified: benchmarks/scale.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one(model: str, config: str, tp: int, sp: bool, flat: bool, out: Path) -> dict:
    """Export once in this process; the timings and the peak RSS of this process and its workers."""
    start = time.perf_counter()
    sys.path.insert(0, str(REPO))
    import refine.exporters

    result = refine.exporters.export_model(model, config, tp, sp, out, flat=flat)
    ranks = result.seconds["ranks"]
    return {"seq": result.seconds["seq"], "rank_mean": sum(ranks) / len(ranks), "rank_max": max(ranks),
            "ranks_total": sum(ranks), "total": time.perf_counter() - start,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
            "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def run_one(model: str, config: str, tp: int, sp: bool, flat: bool) -> dict | str:
    """`one` in a fresh process; a one-line error on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, __file__, "--one", json.dumps([model, config, tp, sp, flat, str(out)])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_rss(r: dict) -> str:
    return f"{r['rss_mb']:.0f} / {r['worker_rss_mb']:.0f}"


def zoo_table(args: argparse.Namespace) -> int:
    from refine.exporters.zoo.configs import validate
    from refine.exporters.errors import ExportError

    plan = "TP+SP" if args.sp else "TP"
    form = "flat" if args.flat else "layers as functions"
    print(f"config {args.config!r}, plan {plan}, {form}, python {platform.python_version()}, one fresh process "
          "per row (seconds; peak RSS MB of the exporting process / its largest rank worker)\n")
    print("| model | tp | seq export s | per-rank export s (mean / max) | all ranks s | total s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for model in args.models:
        for tp in args.tp:
            try:
                validate(model, args.config, tp, args.sp)
            except ExportError as exc:
                print(f"| {model} | {tp} | skipped: {exc} | | | | |")
                continue
            r = run_one(model, args.config, tp, args.sp, args.flat)
            if isinstance(r, str):
                failed += 1
                print(f"| {model} | {tp} | {r} | | | | |")
                continue
            print(f"| {model} | {tp} | {r['seq']:.2f} | {r['rank_mean']:.2f} / {r['rank_max']:.2f} | "
                  f"{r['ranks_total']:.2f} | {r['total']:.2f} | {_fmt_rss(r)} |", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "qwen2", "gpt2"])
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--sp", action="store_true", help="TP+SP plans instead of TP")
    parser.add_argument("--flat", action="store_true", help="every layer inline (the zoo table)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        model, config, tp, sp, flat, out = json.loads(args.one)
        print(json.dumps(one(model, config, tp, sp, flat, Path(out))))
        return 0
    sys.path.insert(0, str(REPO))
    return zoo_table(args)


if __name__ == "__main__":
    sys.exit(main())
