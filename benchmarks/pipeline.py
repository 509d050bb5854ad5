"""Cost of a PP x TP export and its verification against the number of micro-batches (issue 16):
a zoo model as P pipeline stages of T tensor-parallel ranks (exporters/strategies/pipeline_mesh.py,
`export_pipeline_mesh`), M micro-batches in GPipe order, forward. Each export and each `refine
verify --no-simulate` runs in a fresh process (wall time and that process's own peak RSS); prints a
markdown table and the growth with M.

    python benchmarks/pipeline.py                                        # llama tiny, PP 2 x TP 2, M 1 2
    python benchmarks/pipeline.py --config llama3-405b --meta --pp 4 --tp 8 --micro-batches 1 2 4 --functions
    python benchmarks/pipeline.py --model gpt2 --pp 2 --tp 2 --micro-batches 1 2 --memo off

`--functions` exports each distinct layer once per program as an ONNX function (the only way a
126-layer stage captures in seconds); refine's memoization pairs a stage's layer calls with the
sequential calls of the same module path, one site per micro-batch (refine/lowering/program.py
`_call_sites`), and relays each chain across the Send/Recv between stages (refine/run/memo.py);
without it every layer is inline. `--memo off` verifies with `--no-memo` (layer calls inlined).
The issue's target: Llama-3.1-405B shapes, TP 8 x PP 4, 4 micro-batches, export + verify under 90 s and 4 GiB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale import REFINE, run_step  # noqa: E402
from world import growth_line  # noqa: E402


def export_command(args: argparse.Namespace, micro_batches: int, out: Path) -> list[str]:
    """A fresh Python process running export_pipeline_mesh (printing its summary and step seconds)."""
    call = (f"export_pipeline_mesh({args.model!r}, {args.config!r}, {args.pp}, {args.tp}, {micro_batches}, "
            f"{str(out)!r}, layers={args.layers!r}, meta={args.meta!r}, functions={args.functions!r}, "
            f"batch={args.batch or max(args.micro_batches)!r})")
    code = ("import json\nfrom refine.exporters.strategies.pipeline_mesh import export_pipeline_mesh\n"
            f"r = {call}\nprint(r.summary())\n"
            "s = r.seconds\nprint('SECONDS', json.dumps({'seq': s['seq'], 'ranks': sum(s['ranks']), "
            "'captured': s['captured']}))\n")
    return [sys.executable, "-c", code]


def verify(out: Path, memo: bool) -> tuple[object, dict]:
    report_path = out.parent / f"{out.name}.json"
    command = [*REFINE, "verify", str(out), "--quiet", "--no-simulate", "--json", str(report_path)]
    step = run_step(command + ([] if memo else ["--no-memo"]))
    report = json.loads(report_path.read_text()) if report_path.exists() else {"verdict": f"error {step.code}"}
    return step, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=None, help="override the config's depth")
    parser.add_argument("--batch", type=int, default=None, help="batch rows (default: the most micro-batches, one row each)")
    parser.add_argument("--meta", action="store_true", help="export on the meta device (no weight data)")
    parser.add_argument("--functions", action="store_true", help="each distinct layer one ONNX function per program")
    parser.add_argument("--memo", choices=["on", "off"], default="on", help="off: refine verify --no-memo")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.micro_batches:
            out = Path(tmp) / f"pp{args.pp}_tp{args.tp}_m{m}"
            exported = run_step(export_command(args, m, out))
            if exported.code != 0:
                raise SystemExit(f"export failed (M={m}):\n{exported.output[-3000:]}")
            step, report = verify(out, args.memo == "on")
            print(f"M={m}: {exported.output.strip().splitlines()[-2]}", file=sys.stderr, flush=True)
            rows.append((m, exported.seconds, exported.peak_mb, report.get("verdict"), report.get("lower_seconds", 0.0),
                         report.get("run_seconds", 0.0), step.seconds, step.peak_mb))
    print(f"{args.model} config {args.config!r}{f', {args.layers} layers' if args.layers else ''}, forward, PP {args.pp} x "
          f"TP {args.tp} ({args.pp * args.tp} ranks), GPipe, layers {'as functions' if args.functions else 'inline'}, "
          f"memo {args.memo}, `--no-simulate`{', meta weights' if args.meta else ''}\n")
    print("| micro-batches | export s | export MB | verdict | lower s | run s | verify wall s | verify MB | "
          "export + verify s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, ex_s, ex_mb, verdict, lower, run, wall, peak in rows:
        print(f"| {m} | {ex_s:.1f} | {ex_mb:.0f} | {verdict} | {lower:.2f} | {run:.2f} | {wall:.1f} | {peak:.0f} | "
              f"{ex_s + wall:.1f} |")
    line = growth_line("micro-batches", rows, {"export": 1, "lower": 4, "run": 5, "verify memory": 7})
    if line:
        print(line)


if __name__ == "__main__":
    main()
