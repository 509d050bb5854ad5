"""Cost against world size: the layered MLP stack (examples/layered.py, intermediate size widened
so that every degree divides it) verified at TP 2 .. 512, each in a fresh process, memo on,
no counterexample search. Prints a markdown table (lower, run, wall, peak RSS) and the fitted
growth exponent of run time and memory (least squares on log-log, over the three largest
world sizes), the issue-17 figures.

    python benchmarks/world.py                         # TP 2 8 32 128 512, 8 layers
    python benchmarks/world.py --tp 64 128 256 512 --layers 8

With `--mesh-tp T`, the forward of the tiny Llama on a DP x TP mesh instead (`refine export
--model llama --tp T --dp D --batch D --meta`, one batch row per DP row), D from `--dp`: world
sizes T*D up to 4,096 (TP 8 x DP 512). Its rows run the same programs, so `refine verify` checks
row 0 and the rest by symmetry (docs/rows.md); the table has the export's cost too.

    python benchmarks/world.py --mesh-tp 8 --dp 1 8 64 512
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale import REFINE, run_step, verify  # noqa: E402  (a fresh process: wall time, peak RSS, report)


def build(out: Path, layers: int, tp: int, ffn: int) -> None:
    subprocess.run([sys.executable, str(HERE.parent / "examples" / "layered.py"), str(out), "--layers", str(layers),
                    "--tp", str(tp), "--ffn", str(ffn)], check=True)


def exponent(xs: list[int], ys: list[float]) -> float:
    """The slope of log y against log x: cost grows like world_size ** slope."""
    return float(np.polyfit(np.log(xs), np.log(np.maximum(ys, 1e-3)), 1)[0])


def growth_line(what: str, rows: list[tuple], columns: dict[str, int]) -> str | None:
    """`growth over WHAT a..b: name ~ n^e, ...` fitted over the last three rows (x: column 0),
    each name's y the given column of the rows; None with fewer than two rows."""
    tail = rows[-3:]
    if len(tail) < 2:
        return None
    sizes = [r[0] for r in tail]
    fits = ", ".join(f"{name} ~ n^{exponent(sizes, [r[col] for r in tail]):.2f}" for name, col in columns.items())
    return f"\ngrowth over {what} {sizes[0]}..{sizes[-1]}: {fits}"


def mesh_table(tp: int, dps: list[int], tmp: Path) -> None:
    """The tiny Llama's forward at TP `tp` x DP d for each d: export and verify cost."""
    rows = []
    for dp in dps:
        out = tmp / f"llama_tp{tp}_dp{dp}"
        plan = ["--dp", str(dp), "--batch", str(dp)] if dp > 1 else []
        exported = run_step([*REFINE, "export", "--model", "llama", "--config", "tiny", "--tp", str(tp), *plan, "--meta",
                             "--out", str(out)])
        if exported.code != 0:
            raise SystemExit(f"export failed:\n{exported.output}")
        step, report = verify(out, memo=True)
        rows.append((tp * dp, dp, exported.seconds, report.get("verdict"), report.get("lower_seconds", 0.0),
                     report.get("run_seconds", 0.0), step.seconds, step.peak_mb, bool(report.get("rows"))))
        shutil.rmtree(out)  # (4,096 rank files are 3 GB)
    print(f"tiny Llama forward, TP {tp} inside each DP row, one batch row per DP row, meta weights, memo on, "
          "`--no-simulate`\n")
    print("| world size | DP | export s | verdict | rows by symmetry | lower s | run s | verify wall s | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, dp, ex, verdict, lower, run, wall, peak, symmetric in rows:
        print(f"| {world} | {dp} | {ex:.1f} | {verdict} | {'yes' if symmetric else 'no'} | {lower:.2f} | {run:.2f} | "
              f"{wall:.1f} | {peak:.0f} |")
    line = growth_line("world sizes", rows, {"verify wall": 6, "run": 5, "memory": 7})
    if line:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 8, 32, 128, 512])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mesh-tp", type=int, help="the tiny Llama on a DP x TP mesh with this TP degree instead")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 8, 64, 512], help="with --mesh-tp: the DP degrees")
    args = parser.parse_args()
    if args.mesh_tp:
        with tempfile.TemporaryDirectory() as tmp:
            mesh_table(args.mesh_tp, args.dp, Path(tmp))
        return
    ffn = max(16, 2 * max(args.tp))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            model = Path(tmp) / f"tp{tp}"
            build(model, args.layers, tp, ffn)
            step, report = verify(model, memo=True)
            rows.append((tp, report.get("verdict"), report.get("lower_seconds", 0.0), report.get("run_seconds", 0.0),
                         step.seconds, step.peak_mb))
    print(f"{args.layers} MLP layers as layer functions, intermediate size {ffn}, memo on, `--no-simulate`\n")
    print("| world size | verdict | lower s | run s | verify wall s | peak MB |")
    print("|---|---|---|---|---|---|")
    for tp, verdict, lower, run, wall, peak in rows:
        print(f"| {tp} | {verdict} | {lower:.2f} | {run:.2f} | {wall:.1f} | {peak:.0f} |")
    line = growth_line("world sizes", rows, {"run": 3, "wall": 4, "memory": 5})
    if line:
        print(line)


if __name__ == "__main__":
    main()
