"""Export cost of the zoo: time to capture the sequential model and each rank, and peak RSS.

    python benchmarks/export.py [--models llama qwen2 gpt2] [--tp 2 8] [--config tiny] [--sp] [--flat]
    python benchmarks/export.py --depth [--layers 1 8 32 126] [--tp 2 8]   # tiny llama, layers as functions
    python benchmarks/export.py --large [--configs llama3-8b llama3-70b llama3-405b]  # --meta, TP 8 + SP

Each export runs in a fresh child process (`--one`), so the times include importing torch and
transformers and the peak resident set sizes belong to that export alone: the exporting
process's own (resource.getrusage RUSAGE_SELF) and its largest forked rank worker's
(RUSAGE_CHILDREN). `--depth` and `--large` also time `refine verify --no-simulate` on the result
(another fresh process), and give the CPU seconds of every process involved next to the wall
time: on a shared machine, CPU / cores is the better estimate of an idle machine's wall time. A TP the config's heads cannot be split over is skipped. Prints markdown tables.
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


def one(model: str, config: str, tp: int, sp: bool, layers: int | None, meta: bool, flat: bool, out: Path) -> dict:
    """Export once in this process; the timings and the peak RSS of this process and its workers."""
    start = time.perf_counter()
    cpu = time.process_time()
    sys.path.insert(0, str(REPO))
    import exporters

    result = exporters.export_model(model, config, tp, sp, out, layers=layers, meta=meta, flat=flat)
    total = time.perf_counter() - start
    ranks = result.seconds["ranks"]
    functions = result.manifest["layers"]
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu": time.process_time() - cpu + workers.ru_utime + workers.ru_stime,
            "seq": result.seconds["seq"], "rank_mean": sum(ranks) / len(ranks), "rank_max": max(ranks),
            "ranks_total": sum(ranks), "total": total,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
            "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "functions": len(functions["ranks"][0]["functions"]) if functions else 0,
            "bytes": sum(p.stat().st_size for p in out.iterdir())}


def run_one(model: str, config: str, tp: int, sp: bool, layers: int | None, meta: bool, flat: bool,
            verify: bool) -> dict | str:
    """`one` in a fresh process (and `refine verify` in another); a one-line error on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, __file__, "--one", json.dumps([model, config, tp, sp, layers, meta, flat, str(out)])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        if verify:
            start, before = time.perf_counter(), _children_cpu()
            proc = subprocess.run([sys.executable, "-m", "refine.cli", "verify", str(out), "--no-simulate"],
                                  capture_output=True, text=True, cwd=REPO)
            row["verify"] = time.perf_counter() - start
            row["verify_cpu"] = _children_cpu() - before
            first = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or ["?"])[0]
            row["verdict"] = first.split(": ", 1)[-1].split(" ", 1)[0].lower()
        return row


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _fmt_rss(r: dict) -> str:
    return f"{r['rss_mb']:.0f} / {r['worker_rss_mb']:.0f}"


def zoo_table(args: argparse.Namespace) -> int:
    from exporters.configs import CONFIGS

    heads, kv = CONFIGS[args.config].heads, CONFIGS[args.config].kv_heads
    plan = "TP+SP" if args.sp else "TP"
    form = "flat" if args.flat else "layers as functions"
    print(f"config {args.config!r}, plan {plan}, {form}, python {platform.python_version()}, one fresh process "
          "per row (seconds; peak RSS MB of the exporting process / its largest rank worker)\n")
    print("| model | tp | seq export s | per-rank export s (mean / max) | all ranks s | total s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for model in args.models:
        for tp in args.tp:
            if heads % tp or kv % tp:
                print(f"| {model} | {tp} | skipped: {heads} heads / {kv} KV heads | | | | |")
                continue
            r = run_one(model, args.config, tp, args.sp, None, False, args.flat, verify=False)
            if isinstance(r, str):
                failed += 1
                print(f"| {model} | {tp} | {r} | | | | |")
                continue
            print(f"| {model} | {tp} | {r['seq']:.2f} | {r['rank_mean']:.2f} / {r['rank_max']:.2f} | "
                  f"{r['ranks_total']:.2f} | {r['total']:.2f} | {_fmt_rss(r)} |", flush=True)
    return 1 if failed else 0


def scaling_table(title: str, rows: list[tuple[str, str, int, bool, int | None, bool]]) -> int:
    """Function-form exports (model, config, tp, sp, layers, meta), each then verified."""
    print(f"{title}, python {platform.python_version()}, one fresh process per export and per verify "
          "(seconds, imports included; peak RSS MB of the exporting process / its largest rank worker)\n")
    print("| config | layers | tp | plan | functions per rank | export s (CPU s) | seq s | all ranks s (workers) | "
          "peak RSS MB | files MB | verify s (CPU s) | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    failed = 0
    for model, config, tp, sp, layers, meta in rows:
        r = run_one(model, config, tp, sp, layers, meta, False, verify=True)
        depth = layers if layers is not None else "config"
        label = config + (" --meta" if meta else "")
        plan = "TP+SP" if sp else "TP"
        if isinstance(r, str):
            failed += 1
            print(f"| {label} | {depth} | {tp} | {plan} | {r} | | | | | | | |")
            continue
        print(f"| {label} | {depth} | {tp} | {plan} | {r['functions']} | {r['total']:.1f} ({r['cpu']:.1f}) | "
              f"{r['seq']:.1f} | {r['ranks_total']:.1f} | {_fmt_rss(r)} | {r['bytes'] / 1e6:.1f} | "
              f"{r['verify']:.1f} ({r['verify_cpu']:.1f}) | {r['verdict']} |", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "qwen2", "gpt2"])
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--sp", action="store_true", help="TP+SP plans instead of TP")
    parser.add_argument("--flat", action="store_true", help="every layer inline (the zoo table)")
    parser.add_argument("--depth", action="store_true", help="tiny llama at several depths, layers as functions")
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 8, 32, 126])
    parser.add_argument("--large", action="store_true", help="Llama 3 sizes with --meta, TP 8 + SP")
    parser.add_argument("--configs", nargs="+", default=["llama3-8b", "llama3-70b", "llama3-405b"])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        model, config, tp, sp, layers, meta, flat, out = json.loads(args.one)
        print(json.dumps(one(model, config, tp, sp, layers, meta, flat, Path(out))))
        return 0
    sys.path.insert(0, str(REPO))
    if args.depth:
        rows = [("llama", "tiny", tp, False, n, False) for n in args.layers for tp in args.tp]
        return scaling_table("tiny llama (hidden 64), TP plans, layers as functions", rows)
    if args.large:
        rows = [("llama", c, 8, True, None, True) for c in args.configs]
        return scaling_table("Llama 3 sizes, --meta (no weight data), TP 8 + SP, layers as functions", rows)
    return zoo_table(args)


if __name__ == "__main__":
    sys.exit(main())
