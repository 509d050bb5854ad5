"""Scaling of the whole path (export, lower, run) with depth, memoization on and off, and the
Llama 3 presets end to end. Every step runs in a fresh process (`refine export`, `refine
verify --json`), so that times include imports and peak memory is that step's own.

    python benchmarks/scale.py                       # layers 1 8 32 126 x TP 2 8, tiny Llama
    python benchmarks/scale.py --presets llama3-8b llama3-70b llama3-405b --layers --tp 8
    python benchmarks/scale.py --layers 1 8 --tp 2 --no-plain
    python benchmarks/scale.py --train --layers 1 2 4 --tp 8 --no-plain          # training steps
    python benchmarks/scale.py --train --layers --tp 8 --presets llama3-405b --preset-layers 1 2
    python benchmarks/scale.py --framework megatron-core --layers --tp 8 --presets llama3-405b  # Megatron's GPTModel

Tables (markdown): per (layers, TP): export seconds and peak RSS, then for memo on / off the
verdict, lower and run seconds (from the report) and the verify process's wall time and peak
RSS. Per preset (`--meta --tp N --sp`): export and verify wall and peak, end to end.
`--train` exports one training step (`refine export --train`) everywhere; `--preset-layers`
overrides the presets' depth; `--framework megatron-core` exports Megatron-Core's GPTModel
(`refine export --framework megatron-core`, its configs) instead of the zoo's Llama.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REFINE = [sys.executable, "-m", "refine.cli.main"]
MODEL = ["--model", "llama"]  # or ["--framework", "megatron-core"] (--framework)


@dataclass
class Step:
    seconds: float
    peak_mb: float
    code: int
    output: str


def run_step(args: list[str]) -> Step:
    """Run one command; its wall time, its own peak RSS (wait4) and exit code."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Step(time.perf_counter() - start, usage.ru_maxrss / 1024, proc.returncode, output)


def export(out: Path, config: str, tp: int, *, layers: int | None = None, sp: bool = False, meta: bool = False,
           train: bool = False) -> Step:
    args = [*REFINE, "export", *MODEL, "--config", config, "--tp", str(tp), "--out", str(out)]
    args += ["--layers", str(layers)] if layers is not None else []
    args += ["--sp"] if sp else []
    args += ["--meta"] if meta else []
    args += ["--train"] if train else []
    step = run_step(args)
    if step.code != 0:
        raise SystemExit(f"export failed ({' '.join(args)}):\n{step.output}")
    return step


def verify(model_dir: Path, memo: bool) -> tuple[Step, dict]:
    report_path = model_dir.parent / f"{model_dir.name}.{'memo' if memo else 'plain'}.json"
    args = [*REFINE, "verify", str(model_dir), "--quiet", "--no-simulate", "--json", str(report_path)]
    args += [] if memo else ["--no-memo"]
    step = run_step(args)
    report = json.loads(report_path.read_text()) if report_path.exists() else {"verdict": f"error {step.code}"}
    return step, report


def depth_table(layer_counts: list[int], tps: list[int], plain: bool, tmp: Path, train: bool = False) -> None:
    print("| layers | tp | export s | export MB | memo | verdict | lower s | run s | main solves | calls left out | verify wall s | verify MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    memo_run: dict[tuple[int, int], float] = {}
    for tp in tps:
        for layers in layer_counts:
            out = tmp / f"llama_L{layers}_tp{tp}"
            ex = export(out, "tiny", tp, layers=layers, train=train)
            for memo in (True, False) if plain else (True,):
                step, report = verify(out, memo)
                stats = report.get("memo") or {}
                if memo:
                    memo_run[(tp, layers)] = report.get("run_seconds", 0.0)
                print(f"| {layers} | {tp} | {ex.seconds:.1f} | {ex.peak_mb:.0f} | {'on' if memo else 'off'} | "
                      f"{report['verdict']} | {report.get('lower_seconds', 0):.2f} | {report.get('run_seconds', 0):.2f} | "
                      f"{stats.get('main_solves', 1)} | {stats.get('elided_calls', 0)} | "
                      f"{step.seconds:.1f} | {step.peak_mb:.0f} |", flush=True)
    deepest, shallowest = max(layer_counts), min(layer_counts)
    for tp in tps:
        if deepest != shallowest and memo_run.get((tp, shallowest)):
            ratio = memo_run[(tp, deepest)] / memo_run[(tp, shallowest)]
            print(f"\nmemo on, TP {tp}: run at {deepest} layers / at {shallowest} = "
                  f"{memo_run[(tp, deepest)]:.2f} s / {memo_run[(tp, shallowest)]:.2f} s = {ratio:.2f}x", flush=True)


def preset_table(presets: list[str], tp: int, tmp: Path, train: bool = False,
                 depths: list[int | None] | None = None) -> None:
    print("| preset | layers | tp | sp | step | export s | export MB | verdict | lower s | run s | verify wall s | verify MB | end to end s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for preset in presets:
        for layers in depths or [None]:
            out = tmp / f"{preset}_L{layers}_tp{tp}"
            ex = export(out, preset, tp, layers=layers, sp=True, meta=True, train=train)
            step, report = verify(out, True)
            print(f"| {preset} | {layers or 'all'} | {tp} | yes | {'train' if train else 'forward'} | {ex.seconds:.1f} | "
                  f"{ex.peak_mb:.0f} | {report['verdict']} | {report.get('lower_seconds', 0):.2f} | "
                  f"{report.get('run_seconds', 0):.2f} | {step.seconds:.1f} | {step.peak_mb:.0f} | "
                  f"{ex.seconds + step.seconds:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[1, 8, 32, 126])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--no-plain", action="store_true", help="memoization on only")
    parser.add_argument("--presets", nargs="*", default=[], help="e.g. llama3-8b llama3-70b llama3-405b (--meta --sp)")
    parser.add_argument("--preset-layers", type=int, nargs="*", default=None, help="the presets' depths (default: theirs)")
    parser.add_argument("--train", action="store_true", help="export one training step (refine export --train)")
    parser.add_argument("--framework", choices=["zoo", "megatron-core"], default="zoo",
                        help="megatron-core: Megatron-Core's GPTModel and its configs")
    args = parser.parse_args()
    if args.framework == "megatron-core":
        MODEL[:] = ["--framework", "megatron-core"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.layers:
            depth_table(args.layers, args.tp, not args.no_plain, Path(tmp), args.train)
        if args.presets:
            if args.layers:
                print()
            preset_table(args.presets, max(args.tp), Path(tmp), args.train, args.preset_layers)


if __name__ == "__main__":
    main()
