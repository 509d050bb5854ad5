"""Cost of a pipeline mesh's training step against its number of ranks (issue 43, docs/layout4d.md):
`refine export --model llama --pp P --dp D --cp C --tp T --train` (exporters/strategies/mesh4d.py)
and `refine verify --no-simulate`, each in a fresh process (wall time and that process's own peak
RSS). Prints a markdown table and the growth exponent against ranks.

    python benchmarks/layout4d.py                                  # tiny Llama: the meshes below
    python benchmarks/layout4d.py --meshes 2,2,1,2 2,4,1,2 4,4,1,2  # (pp, dp, cp, tp) each
    python benchmarks/layout4d.py --config llama3-405b --meta --layers 8 --meshes 4,4,2,8  # 405B's shapes

Since stage 2 of docs/layout4d.md the exporter captures DP row 0, declares the other rows its copies
(refine.json `row_copies`: their files are not written),
and `refine verify` lowers and solves row 0 alone (the data group's all-reduce a column call,
docs/rows.md): the cost should stay flat as DP grows, and grow with the rest of the mesh (PP,
CP, TP). With both DP and CP a rank's tokens are a window of a window (rules/windows.lp). Layers
are functions, solved once per distinct layer and key (docs/layers.md); `--flat` inlines them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from math import prod
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale import REFINE, run_step  # noqa: E402
from world import growth_line  # noqa: E402

MESHES = ["2,2,1,2", "2,1,2,2", "2,4,1,2", "4,2,1,2", "2,2,2,2", "2,4,2,2", "2,8,2,2", "2,16,2,2"]  # (pp, dp, cp, tp)


def export_args(mesh: tuple[int, ...], args: argparse.Namespace, out: Path) -> list[str]:
    """The export command of one (pp, dp, cp, tp) mesh: a batch of one sequence per DP row with CP
    (one micro-batch), else two per row in two micro-batches."""
    pp, dp, cp, tp = mesh
    rows = 1 if cp > 1 else 2
    command = [*REFINE, "export", "--model", "llama", "--config", args.config, "--pp", str(pp), "--tp", str(tp),
               "--batch", str(dp * rows), "--micro-batches", str(rows), "--train", "--out", str(out)]
    command += ["--dp", str(dp)] if dp > 1 else []
    command += ["--cp", str(cp)] if cp > 1 else []
    command += ["--layers", str(args.layers)] if args.layers else []
    command += ["--flat"] if args.flat else []
    command += ["--meta"] if args.meta else []
    return command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="override the config's depth (at least --pp)")
    parser.add_argument("--meshes", nargs="+", default=MESHES, help="pp,dp,cp,tp of each mesh")
    parser.add_argument("--flat", action="store_true", help="every layer inline (default: layers as functions)")
    parser.add_argument("--meta", action="store_true", help="export without weight data (big configs: llama3-405b)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for text in args.meshes:
            mesh = tuple(int(x) for x in text.split(","))
            if len(mesh) != 4:
                raise SystemExit(f"--meshes: pp,dp,cp,tp, not {text!r}")
            out = Path(tmp) / "x".join(map(str, mesh))
            exported = run_step(export_args(mesh, args, out))
            if exported.code != 0:
                raise SystemExit(f"export failed ({text}):\n{exported.output[-3000:]}")
            report_path = out.parent / f"{out.name}.json"
            step = run_step([*REFINE, "verify", str(out), "--quiet", "--no-simulate", "--json", str(report_path)])
            report = json.loads(report_path.read_text()) if report_path.exists() else {"verdict": f"error {step.code}"}
            print(f"{text}: {report.get('verdict')}, export {exported.seconds:.1f}s, verify {step.seconds:.1f}s",
                  file=sys.stderr, flush=True)
            rows.append((prod(mesh), mesh, exported.seconds, exported.peak_mb, report.get("verdict"),
                         report.get("lower_seconds", 0.0), report.get("run_seconds", 0.0), step.seconds, step.peak_mb))
    print(f"llama config {args.config!r}{' (meta)' if args.meta else ''}{f', {args.layers} layers' if args.layers else ''}, "
          "one training step, "
          f"{'every layer inline' if args.flat else 'layers as functions'}, DP row 0 "
          "captured and verified (the other rows its copies, by symmetry), `--no-simulate`\n")
    print("| ranks | pp x dp x cp x tp | export s | export MB | verdict | lower s | run s | verify wall s | verify MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ranks, mesh, ex_s, ex_mb, verdict, lower, run, wall, peak in rows:
        print(f"| {ranks} | {' x '.join(map(str, mesh))} | {ex_s:.1f} | {ex_mb:.0f} | {verdict} | {lower:.2f} | "
              f"{run:.2f} | {wall:.1f} | {peak:.0f} |")
    by_ranks = sorted({r[0]: r for r in rows if r[1][2] == 1}.values())  # (the DP meshes, one per size)
    line = growth_line("ranks (PP x DP x TP)", [(r[0], r[2], r[5], r[6], r[7]) for r in by_ranks],
                       {"export": 1, "lower": 2, "run": 3, "verify": 4})
    if line:
        print(line)
    # the same row (pp x cp x tp) on more DP rows: the representatives fixed, only the copies grow
    rows_of = {(r[1][0], r[1][2], r[1][3]) for r in rows}
    for pp, cp, tp in sorted(rows_of):
        same_row = sorted(r for r in rows if (r[1][0], r[1][2], r[1][3]) == (pp, cp, tp))
        if len(same_row) > 1 and (pp, cp, tp) != (2, 2, 2):
            print(growth_line(f"ranks (DP grows on PP {pp} x CP {cp} x TP {tp}: {pp * cp * tp} representatives)",
                              [(r[0], r[2], r[5], r[6], r[7]) for r in same_row],
                              {"export": 1, "lower": 2, "run": 3, "verify": 4}))
    # against the representatives (DP row 0's ranks), one mesh per count (the most DP rows)
    by_row = sorted({r[0] // r[1][1]: (r[0] // r[1][1], *r[1:]) for r in sorted(rows)}.values())
    line = growth_line("representatives (DP row 0's ranks)", [(r[0], r[2], r[5], r[6], r[7]) for r in by_row],
                       {"export": 1, "lower": 2, "run": 3, "verify": 4})
    if line:
        print(line)
    by_dp = sorted(r for r in rows if r[1][0] == 2 and r[1][2] == 2 and r[1][3] == 2)  # (pp 2, cp 2, tp 2: DP grows)
    line = growth_line("ranks (DP grows on PP 2 x CP 2 x TP 2)", [(r[0], r[2], r[5], r[6], r[7]) for r in by_dp],
                       {"export": 1, "lower": 2, "run": 3, "verify": 4})
    if line:
        print(line)


if __name__ == "__main__":
    main()
