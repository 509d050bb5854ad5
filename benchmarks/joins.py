"""Which rules' joins grow faster than the world size: the tool that found issue 17's world size
squared joins (benchmarks/RESULTS.md, "world size squared joins").

clingo's Python API reports nothing per rule, and a rule's cost is not its derived atoms but the
body matches its grounder tries (a join that walks every rank's tensors related to S for each
new atom on one rank is world size squared while its result stays linear). So this uses a clingo
built from source with a counting patch (benchmarks/clingo_binder_counts.patch: every rule
instantiator counts the body literal matches it tries and prints them at exit). Build it once:

    python benchmarks/joins.py build /tmp/counting-clingo      # the installed clingo's version

then verify the same model at two world sizes, every solve's program written out, each ground
by the counting clingo with the rule files, and print the rules by steps at the larger size with
their growth exponent against the world size (about 1: linear; about 2: a world size squared
join to rewrite, docs/facts.md "Cost: joins that grow with the world size"):

    python benchmarks/joins.py compare --clingo /tmp/counting-clingo/bin/clingo SMALL_DIR LARGE_DIR
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

PATCH = HERE / "clingo_binder_counts.patch"
_ANNOTATION = re.compile(r"\[\d+/\d+\]|@(NEW|OLD|ALL)|:\[[\d,]*\]")  # sizes, binder kinds, dependencies


def rule_key(instantiator: str) -> str:
    """One key per rule: clingo prints an instantiator as `head <~ lit , lit , ...` in the join
    order it chose (which may differ between world sizes) and makes one instantiator per
    recursive body literal; the key is the head and the set of body literals, unannotated."""
    head, _, body = instantiator.partition(" <~ ")
    literals = sorted({_ANNOTATION.sub("", lit).strip() for lit in body.rstrip(".").split(" , ")} - {"#inc_base", "#end"})
    return f"{head} :- {', '.join(literals)}"


def build(prefix: Path) -> Path:
    """Download the installed clingo's source release, apply the counting patch, build the app."""
    import clingo

    prefix.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", f"clingo=={clingo.__version__}", "--no-binary", ":all:",
                    "--no-deps", "-d", str(prefix)], check=True)
    sdist = next(prefix.glob("clingo-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(prefix, filter="data")
    source = prefix / sdist.name.removesuffix(".tar.gz")
    subprocess.run(["patch", "-p1", "-i", str(PATCH)], cwd=source, check=True)
    build_dir = source / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DCLINGO_BUILD_WITH_PYTHON=OFF", "-DCLINGO_BUILD_WITH_LUA=OFF", "-DCLINGO_BUILD_APPS=ON"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "clingo", "-j", "2"], check=True)
    binary = prefix / "bin" / "clingo"
    binary.parent.mkdir(exist_ok=True)
    binary.unlink(missing_ok=True)
    binary.symlink_to(build_dir / "bin" / "clingo")
    return binary


def dump_solves(model_dir: Path, out: Path) -> None:
    """Verify `model_dir` in this process (memo on, no counterexample search) and write every
    solve's facts and generated rules to out/NNN.lp (the rule files are added when grounding)."""
    import itertools

    from refine.run import engine, memo
    from refine.cli.main import app
    from refine.lowering.facts import to_clingo_lines

    out.mkdir(parents=True, exist_ok=True)
    numbers = itertools.count()
    solve = engine.solve

    def writing(facts, extra_rule_dirs=None, program="", raw=frozenset()):
        (out / f"{next(numbers):03d}.lp").write_text("\n".join(to_clingo_lines(facts)) + "\n" + program + "\n")
        return solve(facts, extra_rule_dirs, program, raw)

    engine.solve = memo.solve = writing
    sys.argv = ["refine", "verify", str(model_dir), "--no-simulate", "--quiet"]
    try:
        app()
    except SystemExit as stop:
        if stop.code not in (0, 1, None):
            raise


def steps_of(clingo_binary: Path, programs: Path) -> Counter[str]:
    """Binder steps per rule (its instantiators together), summed over every dumped solve."""
    from refine.run.engine import rule_files

    rules = [str(p) for p in rule_files(None)]
    steps: Counter[str] = Counter()
    for program in sorted(programs.glob("*.lp")):
        run = subprocess.run([str(clingo_binary), "-q", str(program), *rules], capture_output=True, text=True)
        for line in run.stderr.splitlines():
            if line.startswith("binder-steps\t"):
                _, count, text = line.split("\t", 2)
                steps[rule_key(text)] += int(count)
    return steps


def world_size(model_dir: Path) -> int:
    return len(list(model_dir.glob("rank*.onnx")))


def compare(clingo_binary: Path, small: Path, large: Path, rows: int) -> None:
    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, model in enumerate((small, large)):
            out = Path(tmp) / str(i)
            subprocess.run([sys.executable, __file__, "dump", str(model), str(out)], check=True,
                           stdout=subprocess.DEVNULL)
            counts.append(steps_of(clingo_binary, out))
    n_small, n_large = world_size(small), world_size(large)
    few, many = counts
    print(f"binder steps: {sum(few.values()):,} at world size {n_small}, {sum(many.values()):,} at {n_large}\n")
    print("| steps (large) | steps (small) | growth exponent | rule (head :- body literals, sorted) |")
    print("|---|---|---|---|")
    def exponent(text: str) -> float | None:
        base = few.get(text, 0)
        return math.log(many[text] / base) / math.log(n_large / n_small) if base and n_large != n_small else None

    def row(text: str) -> str:
        e = exponent(text)
        return f"| {many[text]:,} | {few.get(text, 0):,} | {'-' if e is None else f'{e:.2f}'} | `{text[:140]}` |"

    for text, _ in many.most_common(rows):
        print(row(text))
    faster = sorted((t for t in many if (exponent(t) or 0) >= 1.2), key=lambda t: -many[t])[:rows]
    print(f"\nrules growing faster than the world size (exponent >= 1.2): {len(faster)}\n")
    for text in faster:
        print(row(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build the counting clingo").add_argument("prefix", type=Path)
    dump = commands.add_parser("dump", help="write every solve's program of one verification")
    dump.add_argument("model_dir", type=Path)
    dump.add_argument("out", type=Path)
    cmp = commands.add_parser("compare", help="binder steps per rule at two world sizes")
    cmp.add_argument("--clingo", type=Path, required=True, help="the counting clingo (`build`)")
    cmp.add_argument("--rows", type=int, default=20)
    cmp.add_argument("small", type=Path)
    cmp.add_argument("large", type=Path)
    args = parser.parse_args()
    if args.command == "build":
        print(build(args.prefix))
    elif args.command == "dump":
        dump_solves(args.model_dir, args.out)
    else:
        compare(args.clingo, args.small, args.large, args.rows)


if __name__ == "__main__":
    main()
