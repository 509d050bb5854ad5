"""The spelling corpus (tests/spellings/, issue 38): every correct program and its bug twin,
exported and verified, as a table with the counts correct -> VERIFIED and twin -> REFUTED.

    python benchmarks/spellings.py [--only NAME ...] [--out DIR]

Needs the torch extra. Prints a markdown table; paste it into benchmarks/RESULTS.md with the date.
An entry with a known gap (`Spelling.known_gap`) is counted apart: its correct program may be
UNPROVEN, never REFUTED.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from refine.pipeline import verify_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from spellings import Spelling, corpus  # noqa: E402  (the corpus lives with the tests)


def run(spelling: Spelling, out: Path, buggy: bool) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        verdict = verify_dir(spelling.export(out, buggy)).verdict
    except Exception as exc:  # noqa: BLE001 - a row of the table, not a crash of the benchmark
        verdict = f"error: {type(exc).__name__}"
    return verdict, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="entries whose name contains one of these")
    parser.add_argument("--out", type=Path, default=None, help="where to export (default: a temporary directory)")
    args = parser.parse_args()
    chosen = [s for s in corpus() if not args.only or any(part in s.name for part in args.only)]
    out = args.out or Path(tempfile.mkdtemp(prefix="spellings-"))
    print("| entry | style | pattern | correct | twin (class) | s |")
    print("|---|---|---|---|---|---|")
    verified = refuted = gaps = 0
    for s in chosen:
        correct, t1 = run(s, out, False)
        twin, t2 = run(s, out, True)
        verified += correct == "verified"
        refuted += twin == "refuted"
        gaps += bool(s.known_gap) and correct != "verified"
        note = f" (known gap: {s.known_gap})" if s.known_gap and correct != "verified" else ""
        print(f"| {s.name} | {s.style} | {s.pattern} | {correct}{note} | {twin} ({s.bug_class}) | {t1 + t2:.1f} |",
              flush=True)
    print()
    print(f"{len(chosen)} pairs: correct -> VERIFIED {verified}/{len(chosen)} ({gaps} known gaps UNPROVEN), "
          f"twin -> REFUTED {refuted}/{len(chosen)}")


if __name__ == "__main__":
    main()
