"""Batch throughput on the zoo: entries verified per minute with 1 and 2 jobs, locally and
(with --ray) as tasks on a Ray cluster.

    python benchmarks/batch.py [--out DIR] [--models llama,gpt2,qwen2] [--tp 2,4,8] [--plans tp,sp]
                               [--bugs ...] [--jobs 1 2] [--timeout 600] [--ray ADDRESS]

Generates the zoo (or the slice selected; `refine zoo` selection syntax) into DIR with
refine.exporters.zoo.entries, keeping entries already current, then runs `refine.batch.local.run_batch` on it,
cache off, once per jobs count. Prints two markdown tables: what the zoo took to export, and
per jobs count (and where: the local pool, or the Ray cluster at ADDRESS, started beforehand
with `ray start --head`) the batch's wall time, entries per minute and how many entries got
their expected verdict (those that did not are listed after the table).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/refine-zoo"))
    parser.add_argument("--models")
    parser.add_argument("--tp")
    parser.add_argument("--plans")
    parser.add_argument("--bugs")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--ray", metavar="ADDRESS", help="also run the batch on the Ray cluster at ADDRESS")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from refine.exporters.zoo import entries as zoo_gen
    from refine.batch import entries as batch_entries, local, output

    entries = zoo_gen.select(args.models, args.tp, args.plans, args.bugs)
    start = time.perf_counter()
    generated = zoo_gen.generate(entries, args.out,
                                 on_entry=lambda e, what: print(f"{what:>7} {e.name}", file=sys.stderr, flush=True))
    gen_seconds = time.perf_counter() - start
    export_seconds = []
    for e in entries:
        try:
            s = json.loads((args.out / e.name / "export.json").read_text())["seconds"]
            export_seconds.append(s["seq"] + sum(s["ranks"]))
        except (OSError, KeyError, ValueError):
            pass
    print(f"Machine: {platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, "
          f"Python {platform.python_version()}; zoo slice: {len(entries)} entries in {args.out}\n")
    print("| entries | written now | kept | failed | generation wall s | mean export s per entry (seq + sum of ranks) |")
    print("|---|---|---|---|---|---|")
    mean = sum(export_seconds) / len(export_seconds) if export_seconds else float("nan")
    print(f"| {len(entries)} | {len(generated.written)} | {len(generated.kept)} | {len(generated.failed)} "
          f"| {gen_seconds:.0f} | {mean:.1f} |")
    for name, problem in generated.failed.items():
        print(f"\nexport failed: {name}: {problem}")

    print("\n| where | jobs | entries | verified | refuted | unproven | other | as expected | wall s | entries/min |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    misses: dict[str, str] = {}
    for where in ["local"] + (["ray"] if args.ray else []):
        for jobs in args.jobs:
            options = batch_entries.BatchOptions(jobs=jobs, timeout=args.timeout, use_cache=False,
                                         ray=args.ray if where == "ray" else None)
            report = local.run_batch(args.out, options)
            counts = report.counts()
            other = sum(n for s, n in counts.items() if s not in ("verified", "refuted", "unproven"))
            expected = sum(e.ok for e in report.entries)
            n = len(report.entries)
            print(f"| {where} | {jobs} | {n} | {counts['verified']} | {counts['refuted']} | {counts['unproven']} | {other} "
                  f"| {expected}/{n} | {report.seconds:.1f} | {60 * n / report.seconds:.1f} |", flush=True)
            misses.update({e.entry: f"{e.status} (expected {e.expected}){': ' + output.detail(e) if output.detail(e) else ''}"
                           for e in report.entries if not e.ok})
    if misses:
        print("\nNot as expected:")
        for name, what in sorted(misses.items()):
            print(f"- {name}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
