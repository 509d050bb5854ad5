"""Can the rank programs' communication calls run together? A static check of their order.

Every collective and point-to-point call blocks until all its members have made it (a Send
until its Recv is posted, as NCCL's send). Each rank makes its calls in program order (the
graph's node order, which lowering records as `topo`), so the calls deadlock when no order of
completions lets every rank finish: two ranks that both send first, say, or calls on two groups
taken in opposite orders. rules/sanity.lp reports a call that some member never makes; this
module finds the cyclic waits among calls that every member does make, without running
anything (so also for `--meta` exports that are never simulated).

The calls of layer bodies (a memoized lowering's templates) are not in the facts it reads; a
deadlock among the calls it does see is a deadlock of the whole programs all the same (more
calls never unblock a cyclic wait), so a finding is never wrong, only possibly incomplete.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from refine.dist import channel_of, group_of_id
from refine.facts import FactSet
from refine.render import group_text

Call = tuple[str, int]  # (group id, call number on it)


class Waiting(NamedTuple):
    """A rank blocked for good in one call."""

    rank: int
    group: str
    seq: int
    op: str
    node: str  # node id (graph-prefixed)

    def words(self) -> str:
        name = self.node.split(":", 1)[-1]
        return f"rank {self.rank} waits in {self.op} call #{self.seq} of {describe_group(self.group)} (node {name!r})"


def describe_group(gid: str) -> str:
    """A group id in words: `group [0,1]`, or `the sends from rank 0 to rank 1 (tag 3)`."""
    channel = channel_of(gid)
    if channel is not None:
        return "the sends from rank {} to rank {} (tag {})".format(*channel)
    return f"group {group_text(group_of_id(gid))}"


def stuck_calls(facts: FactSet) -> list[Waiting]:
    """The call each rank is left waiting in if the programs' calls cannot all complete, else []."""
    rows = facts.rows
    rank_of = {g: int(r) for g, kind, r in rows["graph"] if kind == "rank"}
    position = {n: int(i) for _g, n, i in rows["topo"]}  # (node ids carry their graph)
    members: dict[str, list[int]] = defaultdict(list)
    for gid, _index, rank in sorted(rows["group_member"], key=lambda row: (row[0], row[1])):
        members[str(gid)].append(int(rank))
    program: dict[int, list[tuple[Call, str, str]]] = defaultdict(list)  # rank -> (call, op, node)
    for g, n, kind, gid, seq in rows["coll"]:
        if g in rank_of:
            program[rank_of[g]].append(((str(gid), int(seq)), str(kind), str(n)))
    for calls in program.values():
        calls.sort(key=lambda c: position.get(c[2], 0))
    heads = {r: 0 for r in program}
    progressed = True
    while progressed:
        progressed = False
        waiting: dict[Call, set[int]] = defaultdict(set)
        for r, i in heads.items():
            if i < len(program[r]):
                waiting[program[r][i][0]].add(r)
        for call, ranks in waiting.items():
            if ranks == set(members[call[0]]):
                for r in ranks:
                    heads[r] += 1
                progressed = True
    waits = []
    for r in sorted(heads):
        if heads[r] < len(program[r]):
            (gid, seq), op, node = program[r][heads[r]]
            waits.append(Waiting(r, gid, seq, op, node))
    return waits

