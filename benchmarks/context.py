"""Cost of a long-context attention layer under context parallelism (issue 16: a 128k-token
attention layer at CP 8, shapes only, verifies in under 10 s): the zoo GPT-2 with one layer at
a sequence length of --seq-len tokens (batch 1, --hidden wide, --heads heads), exported on the meta
device (`export_context_parallel(meta=True)`) in both variants, (a) K/V all-gathered and (b) ring
attention, each export and `refine verify` (memo on, `--no-simulate`) in a fresh process. Prints
a markdown table: export wall and peak RSS, verdict, lower, run, verify wall and peak RSS.

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

from scale import run_step, verify  # noqa: E402

EXPORT = """
import sys
from dataclasses import replace
from exporters import configs
from exporters.context import export_context_parallel
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
                    step, report = verify(out, memo=True)
                    rows.append((variant, seq_len, cp, exported.seconds, exported.peak_mb, report.get("verdict"),
                                 report.get("lower_seconds", 0.0), report.get("run_seconds", 0.0), step.seconds,
                                 step.peak_mb))
                    print(f"done: {variant} {seq_len} CP {cp}", file=sys.stderr, flush=True)
    print(f"gpt2, 1 layer, batch 1, hidden {args.hidden}, {args.heads} heads, meta weights, forward; verify: memo on, "
          "`--no-simulate`\n")
    print("| variant | tokens | CP | export s | export MB | verdict | lower s | run s | verify wall s | verify MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, seq_len, cp, ex_s, ex_mb, verdict, lower, run, wall, peak in rows:
        name = "(a) all-gather" if variant == "gather" else "(b) ring"
        print(f"| {name} | {seq_len} | {cp} | {ex_s:.1f} | {ex_mb:.0f} | {verdict} | {lower:.2f} | {run:.2f} | "
              f"{wall:.1f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
