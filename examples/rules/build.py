"""Build the two small models of the lemma tutorial (docs/first-lemma.md).

    python examples/rules/build.py --out DIR

Both run `CumSum` along the sequence (axis 1) of x [batch, seq, hidden], two ranks, and gather
the result back:

- `cumsum_tp2`: x sharded on the batch (axis 0), each rank sums its own rows along the sequence,
  AllGather on 0. Correct, but no bundled lemma handles CumSum: UNPROVEN without the tutorial's
  lemma, VERIFIED with it.
- `cumsum_on_shard`: x sharded on the sequence itself, each rank sums its own chunk only (rank 1
  forgets the running sum of rank 0's chunk), AllGather on 1. A bug: REFUTED with the sound
  lemma; an unsound lemma that ignores the axis would call it VERIFIED, and `refine verify
  --rules` catches that on the numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from refine.kit.cases import Case, Graph, shard  # noqa: E402

B, S, H, WORLD = 4, 6, 3, 2


def cumsum_model(name: str, shard_axis: int) -> Case:
    """seq: CumSum(x, 1); rank r: CumSum of its shard of x, then AllGather along the shard axis."""

    def side(rank: int | None) -> Graph:
        g = Graph()
        shape = [B, S, H]
        if rank is not None:
            shape[shard_axis] //= WORLD
        x = g.input("x", shape)
        y = g.op("CumSum", x, g.ints(1))
        g.output(y if rank is None else g.coll("AllGather", y, list(range(WORLD)), axis=shard_axis))
        return g

    return Case(name, side(None), [side(r) for r in range(WORLD)], {"x": shard(shard_axis)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for case in (cumsum_model("cumsum_tp2", 0), cumsum_model("cumsum_on_shard", 1)):
        print(case.save(args.out / case.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
