"""Cost of a long-context attention layer under context parallelism (issue 16: a 128k-token
attention layer at CP 8, shapes only, verifies in under 10 s): the zoo GPT-2 with one layer at
a sequence length of --seq-len tokens (batch 1, --hidden wide, --heads heads), exported on the meta
device (`export_context_parallel(meta=True)`) in both variants, (a) K/V all-gathered and (b) ring
attention, each export and `refine verify` (memo on, `--no-simulate`) in a fresh process. Prints
a markdown table: export wall and peak RSS, verdict, lower, run, verify wall, CPU and peak RSS.

    python benchmarks/context.py                                   # 131072 tokens, CP 8
    python benchmarks/context.py --seq-len 8192 32768 131072 --cp 8
    python benchmarks/context.py --variants ring --cp 4 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

REFINE = [sys.executable, "-m", "refine.cli.main"]


@dataclass
class Step:
    seconds: float  # wall
    cpu: float  # user + system seconds of the process and its children
    peak_mb: float
    code: int
    output: str


def run_step(args: list[str]) -> Step:
    """Run one command: wall and CPU time, peak RSS (wait4) and exit code (CPU time as well as
    wall: on a shared machine the wall time says more about the neighbours)."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    return Step(time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
                os.waitstatus_to_exitcode(status), output)


def verify(model_dir: Path) -> tuple[Step, dict]:
    report_path = model_dir.parent / f"{model_dir.name}.json"
    step = run_step([*REFINE, "verify", str(model_dir), "--quiet", "--no-simulate", "--json", str(report_path)])
    report = json.loads(report_path.read_text()) if report_path.exists() else {"verdict": f"error {step.code}"}
    return step, report

EXPORT = """
import sys
from dataclasses import replace
from refine.exporters.zoo import configs
from refine.exporters.strategies.context_export import export_context_parallel
seq_len, cp, hidden, heads, ring, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "ring", sys.argv[6]
configs.CONFIGS["cp-bench"] = replace(configs.CONFIGS["tiny"], hidden=hidden, heads=heads, kv_heads=heads,
                                      intermediate=4 * hidden, layers=1, batch=1, seq_len=seq_len, vocab=128)
export_context_parallel("gpt2", "cp-bench", cp, out, meta=True, ring=ring)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[131072])
    parser.add_argument("--cp", type=int, nargs="+", default=[8])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--variants", nargs="+", default=["gather", "ring"], choices=["gather", "ring"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in args.seq_len:
            for cp in args.cp:
                for variant in args.variants:
                    out = Path(tmp) / f"{variant}_{seq_len}_cp{cp}"
                    command = [sys.executable, "-c", EXPORT, str(seq_len), str(cp), str(args.hidden), str(args.heads),
                               variant, str(out)]
                    exported = run_step(command)
                    if exported.code != 0:
                        raise SystemExit(f"export failed ({variant}, {seq_len} tokens, CP {cp}):\n{exported.output[-3000:]}")
                    step, report = verify(out)
                    rows.append((variant, seq_len, cp, exported.seconds, exported.peak_mb, report.get("verdict"),
                                 report.get("lower_seconds", 0.0), report.get("run_seconds", 0.0), step.seconds,
                                 step.cpu, step.peak_mb))
                    print(f"done: {variant} {seq_len} CP {cp}", file=sys.stderr, flush=True)
    print(f"gpt2, 1 layer, batch 1, hidden {args.hidden}, {args.heads} heads, meta weights, forward; verify: memo on, "
          "`--no-simulate`\n")
    print("| variant | tokens | CP | export s | export MB | verdict | lower s | run s | verify wall s | verify CPU s | "
          "verify MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for variant, seq_len, cp, ex_s, ex_mb, verdict, lower, run, wall, cpu, peak in rows:
        name = "(a) all-gather" if variant == "gather" else "(b) ring"
        print(f"| {name} | {seq_len} | {cp} | {ex_s:.1f} | {ex_mb:.0f} | {verdict} | {lower:.2f} | {run:.2f} | "
              f"{wall:.1f} | {cpu:.1f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
