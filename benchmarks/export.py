"""Export cost of the zoo: time to capture the sequential model and each rank, and peak RSS.

    python benchmarks/export.py [--models llama qwen2 gpt2] [--tp 2 8] [--config tiny] [--sp]

Each (model, TP) export runs in a fresh child process (`--one`), so the peak resident set
size it reports (resource.getrusage(RUSAGE_SELF).ru_maxrss) belongs to that export alone,
imports of torch and transformers included. A TP the config's heads cannot be split over is
skipped. Prints a markdown table.
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


def one(model: str, config: str, tp: int, sp: bool) -> dict:
    """Export once in this process; the timings and this process's peak RSS."""
    sys.path.insert(0, str(REPO))
    import exporters

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = exporters.export_model(model, config, tp, sp, Path(tmp) / "out")
    total = time.perf_counter() - start
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    ranks = result.seconds["ranks"]
    return {"seq": result.seconds["seq"], "rank_mean": sum(ranks) / len(ranks), "rank_max": max(ranks),
            "ranks_total": sum(ranks), "total": total, "rss_mb": rss_kb / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "qwen2", "gpt2"])
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--sp", action="store_true", help="TP+SP plans instead of TP")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.config, int(args.one[1]), args.sp)))
        return 0

    sys.path.insert(0, str(REPO))
    from exporters.configs import CONFIGS

    heads = CONFIGS[args.config].heads
    kv = CONFIGS[args.config].kv_heads
    plan = "TP+SP" if args.sp else "TP"
    print(f"config {args.config!r}, plan {plan}, python {platform.python_version()}, "
          "one fresh process per row (seconds; peak RSS of that process)\n")
    print("| model | tp | seq export s | per-rank export s (mean / max) | all ranks s | total s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for model in args.models:
        for tp in args.tp:
            if heads % tp or kv % tp:
                print(f"| {model} | {tp} | skipped: {heads} heads / {kv} KV heads | | | | |")
                continue
            cmd = [sys.executable, __file__, "--one", model, str(tp), "--config", args.config] + (["--sp"] if args.sp else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                failed += 1
                err = (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
                print(f"| {model} | {tp} | failed: {err} | | | | |")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"| {model} | {tp} | {r['seq']:.2f} | {r['rank_mean']:.2f} / {r['rank_max']:.2f} | "
                  f"{r['ranks_total']:.2f} | {r['total']:.2f} | {r['rss_mb']:.0f} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
