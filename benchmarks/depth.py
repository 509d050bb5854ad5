"""How lower and run time grow with depth, with layer memoization on and off: a stack of L
MLP blocks (rms norm, column-parallel up, ReLU, row-parallel down, all-reduce, bias, residual)
written as layer functions (examples/layered.py), at TP 2 and 8.

    python benchmarks/depth.py [--layers 1 8 32 126] [--tp 2 8]

`memo off` inlines every call and verifies the flat graphs (`refine verify --no-memo`).
Prints a markdown table: facts lowered, lower and run seconds, template and main solves, and
the calls left out of the whole main solve (instantiated along their chain, docs/layers.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

from refine.lowering.program import lower_program
from refine.run.memo import run_program
from refine.diagnose.diagnosis import build_report

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _layered():
    spec = importlib.util.spec_from_file_location("examples_layered", EXAMPLES / "layered.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules.setdefault("examples_layered", module)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 32, 126])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    layered = _layered()
    print("| layers | tp | memo | facts | lower s | run s | template solves | main solves | calls left out | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            for layers in args.layers:
                d = layered.write(Path(tmp) / f"L{layers}_tp{tp}", layers, tp)
                for memo in (True, False):
                    t0 = time.perf_counter()
                    program = lower_program(d, memo)
                    t1 = time.perf_counter()
                    run = run_program(program)
                    t2 = time.perf_counter()
                    report = build_report(d.name, program.main, run.derived)
                    print(f"| {layers} | {tp} | {'on' if memo else 'off'} | {program.count()} | {t1 - t0:.3f} | "
                          f"{t2 - t1:.3f} | {run.template_solves} | {run.main_solves} | {run.elided} | {report.verdict} |", flush=True)


if __name__ == "__main__":
    main()
