"""How much `refine verify --jobs N` (issue 17: distinct layer templates solved in parallel
processes) could gain: in one verification, how many template solves could run at once.

The memoized run (refine/run/memo.py) walks the call sites in order and solves each new (template,
key) when the walk reaches it. A solve can start early only if its key was known when its walk
began (read off the last main solve), not written by an earlier solve of the same walk (the
previous layer's summary). Prints, per model directory, each walk's solves and how many of them
were ready at its start: solves that could run together.

    python benchmarks/waves.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from refine.run import memo
from refine.lowering.program import lower_program


def waves_of(model_dir: Path) -> tuple[int, list[tuple[int, int]]]:
    """(template solves, [(solves in a walk, of those ready at the walk's start)])."""
    waves: list[tuple[int, int]] = []
    walk = memo._learn_along_chains

    def counted(sites, rels, consts, summaries, learn, foresee=None):  # type: ignore[no-untyped-def]
        ready = {s.cid: memo.site_key(s, rels, consts) for s in sites}
        learned: list[bool] = []

        def spy(site: memo.Site, key: memo.Key) -> None:
            learned.append(ready.get(site.cid) == key)
            learn(site, key)

        found = walk(sites, rels, consts, summaries, spy, foresee)
        if learned:
            waves.append((len(learned), sum(learned)))
        return found

    memo._learn_along_chains = counted
    try:
        run = memo.run_program(lower_program(model_dir))
    finally:
        memo._learn_along_chains = walk
    return run.template_solves, waves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", type=Path, nargs="+")
    args = parser.parse_args()
    print("| model | template solves | walks: (solves, ready at the walk's start) | most at once |")
    print("|---|---|---|---|")
    for d in args.model_dirs:
        solves, waves = waves_of(d)
        print(f"| {d.name} | {solves} | {waves} | {max((r for _, r in waves), default=0)} |")


if __name__ == "__main__":
    main()
