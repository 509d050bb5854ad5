"""Rank programs that never communicate although refine.json splits their weights.

A plan that shards a parameter and then runs no collective on some rank is almost never what its
author meant: that rank's pieces are never combined with the others'. The proof and the numbers
say so in their own terms (outputs not rebuilt, a counterexample); this says why it is likely,
before either: torchtitan's spmd_types backend outside its trainer's SPMD mesh region, for one,
runs every module with no collective at all, and the ranks then export, silently, as if they were
alone (issue 41). One warning line for the report, naming the ranks and a split input.
"""

from __future__ import annotations

from refine.lowering.program import Program

SPLIT_LAYOUTS = ("sl(", "blk(", "psum(", "pmax(", "psl(")


def silent_ranks_warning(program: Program) -> str | None:
    """The warning for `program` (None when every rank that holds a split input makes a call)."""
    main = program.main
    ranks = sorted(int(r) for _g, kind, r in main.rows["graph"] if kind == "rank")
    split = sorted({str(s).split(":", 1)[-1] for s, _t, layout in main.rows["input_rel"]
                    if str(layout).startswith(SPLIT_LAYOUTS)})
    if not split or len(ranks) < 2:
        return None
    if any(facts.rows["coll"] for facts in program.templates.values()):
        return None  # (calls inside layer templates: which rank makes them is the call sites'; no warning)
    talking = {str(row[0]) for row in main.rows["coll"]} | {str(row[0]) for row in main.rows["body_coll"]}
    silent = [r for r in ranks if f"r{r}" not in talking]
    if not silent:
        return None
    who = "no rank's program has" if len(silent) == len(ranks) else \
        f"the program{'s' if len(silent) > 1 else ''} of rank{'s' if len(silent) > 1 else ''} " \
        f"{', '.join(map(str, silent))} {'have' if len(silent) > 1 else 'has'}"
    return (f"refine.json splits {len(split)} input{'s' if len(split) > 1 else ''} between the ranks (e.g. "
            f"{split[0]}), but {who} a collective: the pieces are never combined. If the plan should "
            "communicate, the code that issues its collectives did not run while exporting (e.g. torchtitan's "
            "spmd_types backend outside the trainer's SPMD mesh region, set_current_spmd_mesh; a collective "
            "behind a process group of one rank)")
