"""Can the rank programs' communication calls run together? A static check of their order.

Every collective and point-to-point call blocks until all its members have made it (a Send
until its Recv is posted, as NCCL's send). Each rank makes its calls in program order: the
main graph's node order (which lowering records as `topo`), with the calls inside a layer
call made where the layer is called, in its body's order (`body_coll` facts of a memoized
lowering). The k-th call a rank makes on a group meets the k-th call every other member makes
on it. So the programs cannot run together when a member never makes a call the others make,
when the members make it as different ops, or when no order of completions lets every rank
finish (a deadlock: two ranks that both send first, calls on two groups taken in opposite
orders), wherever the calls are: in the main graph or inside layer functions.

One more condition is about what the proof reads, not what runs: the lemmas match calls
within one solve, by their numbers there: the main graphs' calls numbered in the main graphs,
a call site's layer calls' calls numbered in their bodies (the site's template). Where two
members' calls have one number in one solve but are not the same call of the programs (a
main-graph call on one rank made inside a layer call on the other), the proof would relate
values the programs never exchange, and nothing may be verified. Calls the proof does not
match at all (a pipeline stage's Send inside its layer, the Recv inside the next stage's) only
leave the values they carry unrelated.

rules/sanity.lp checks the calls of each solve on their own (a missing call, members that
disagree on the attributes); this module checks the whole schedule every rank runs.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from refine.dist import channel_of, group_of_id
from refine.lowering.facts import FactSet
from refine.report.render import group_text

Call = tuple[str, int]  # (group id, the call's number among every call a member makes on it)


@dataclass(frozen=True)
class ScheduledCall:
    """One call a rank makes, where it makes it and how the proof numbers it."""

    rank: int
    group: str
    seq: int  # the rank's how-manieth call on the group, counting the calls inside layer calls
    kind: str  # AllReduce, Send, ...
    node: str  # the main-graph node id: the call itself, or the layer call it is made inside
    inner: str = ""  # the call's node name in the layer's body ("" for a main-graph call)
    local: int = 0  # its number among the calls on the group in its own graph: the main graph's, or the body's
    site: str | None = None  # the call site joining the layer call (None for a main-graph call or an unjoined call)
    module: str = ""
    file: str = ""
    line: int = 0

    @property
    def name(self) -> str:
        """The call as reports name it: `attn/Send` in the main graph, `model.layers.3/Send_2`
        inside a layer call (the simulator's names for an inlined body)."""
        node = self.node.split(":", 1)[-1]
        return f"{node}/{self.inner}" if self.inner else node

    @property
    def place(self) -> tuple[str, str, int]:
        """Where the proof matches it: as main call number `local`, or as body call number
        `local` of one call site's template (an unjoined layer call's calls are matched nowhere)."""
        if not self.inner:
            return ("main", "", self.local)
        return ("site", self.site if self.site is not None else f"unjoined {self.node}", self.local)

    def where(self) -> str:
        """`node 'attn/Send' at file.py:12`, or `node 'Send_2' in layer call model.layers.3 at file.py:12`."""
        text = f"node {self.inner!r} in layer call {self.node.split(':', 1)[-1]}" if self.inner else f"node {self.name!r}"
        return f"{text} at {self.file}:{self.line}" if self.file else text


class Waiting:
    """A rank blocked for good in one call."""

    def __init__(self, call: ScheduledCall) -> None:
        self.call = call
        self.rank, self.group, self.seq, self.op = call.rank, call.group, call.seq, call.kind

    def words(self) -> str:
        return f"rank {self.rank} waits in {self.op} call #{self.seq} of {describe_group(self.group)} ({self.call.where()})"


def describe_group(gid: str) -> str:
    """A group id in words: `group [0,1]`, or `the sends from rank 0 to rank 1 (tag 3)`."""
    channel = channel_of(gid)
    if channel is not None:
        return "the sends from rank {} to rank {} (tag {})".format(*channel)
    return f"group {group_text(group_of_id(gid))}"


def rank_schedules(facts: FactSet) -> dict[int, list[ScheduledCall]]:
    """Every call each rank makes, in the order it makes them (calls inside layer calls where
    the layer is called), numbered on their groups."""
    rows = facts.rows
    rank_of = {g: int(r) for g, kind, r in rows["graph"] if kind == "rank"}
    bodies: dict[tuple[str, str], list[tuple[int, str, str, str, str, str, int]]] = defaultdict(list)
    for g, fn, index, name, kind, gid, module, file, line in rows["body_coll"]:
        bodies[(str(g), str(fn))].append((int(index), str(name), str(kind), str(gid), str(module), str(file), int(line)))
    for calls in bodies.values():
        calls.sort()
    position = {str(n): int(i) for g, n, i in rows["topo"] if g in rank_of}
    site_of = {str(n): str(c) for c, g, n in rows["call_node"]}
    coll_nodes = {str(n) for _g, n, _k, _gid, _s in rows["coll"]}
    loc = {str(n): (str(m), str(f), int(ln)) for _g, n, m, f, ln in rows["loc"] if n in coll_nodes}
    steps: dict[str, list[tuple[int, list[ScheduledCall]]]] = defaultdict(list)  # graph -> (position, calls)
    for g, n, kind, gid, local in rows["coll"]:
        if g in rank_of:
            m, f, ln = loc.get(str(n), ("", "", 0))
            call = ScheduledCall(rank_of[g], str(gid), -1, str(kind), str(n), local=int(local), module=m, file=f, line=ln)
            steps[str(g)].append((position.get(str(n), 0), [call]))
    for g, n, op in rows["node"]:
        body = bodies.get((str(g), str(op)))
        if body is None or g not in rank_of:
            continue
        counted: dict[str, int] = defaultdict(int)
        inner = []
        for _index, name, kind, gid, module, file, line in body:
            inner.append(ScheduledCall(rank_of[g], gid, -1, kind, str(n), inner=name, local=counted[gid],
                                       site=site_of.get(str(n)), module=module, file=file, line=line))
            counted[gid] += 1
        steps[str(g)].append((position.get(str(n), 0), inner))
    schedules: dict[int, list[ScheduledCall]] = {}
    for g, placed in steps.items():
        placed.sort(key=lambda step: step[0])
        numbered: dict[str, int] = defaultdict(int)
        calls = []
        for _pos, made in placed:
            for call in made:
                calls.append(_numbered(call, numbered[call.group]))
                numbered[call.group] += 1
        schedules[rank_of[g]] = calls
    return schedules


def _numbered(call: ScheduledCall, seq: int) -> ScheduledCall:
    return ScheduledCall(call.rank, call.group, seq, call.kind, call.node, call.inner, call.local, call.site,
                         call.module, call.file, call.line)


@dataclass
class ScheduleCheck:
    """What keeps the rank programs' calls from running together as the proof matched them."""

    problems: list[str] = field(default_factory=list)  # one sentence each
    calls: dict[Call, tuple[dict[int, ScheduledCall], str]] = field(default_factory=dict)  # the calls named: member rank -> its call, and what is wrong with it
    group_members: dict[str, list[int]] = field(default_factory=dict)

    def add(self, call: Call, by_rank: dict[int, ScheduledCall], problem: str, sentence: str) -> None:
        if len(self.problems) < 3:
            self.problems.append(sentence)
            self.calls[call] = (by_rank, problem)


def check_schedule(facts: FactSet) -> ScheduleCheck:
    """The calls the members cannot make together (one never makes it, they make it as
    different ops), the calls a solve matches otherwise than the programs do, else the cyclic
    waits among the calls."""
    schedules = rank_schedules(facts)
    members: dict[str, list[int]] = defaultdict(list)
    mirrored = {(str(gid), int(index)) for gid, index, _of, _row in facts.rows["mirror_member"]}
    for gid, index, rank in sorted(facts.rows["group_member"], key=lambda row: (row[0], row[1])):
        if (str(gid), int(index)) not in mirrored:  # (a row image of a lowered member: it makes the call
            members[str(gid)].append(int(rank))     # when that member does, docs/rows.md)
    made: dict[Call, dict[int, ScheduledCall]] = defaultdict(dict)
    for rank, calls in schedules.items():
        for call in calls:
            made[(call.group, call.seq)][rank] = call
    check = ScheduleCheck(group_members=dict(members))
    for (gid, seq), by_rank in sorted(made.items()):
        missing = [r for r in members[gid] if r not in by_rank]
        kinds = {c.kind for c in by_rank.values()} if channel_of(gid) is None else set()
        first = next(iter(by_rank.values()))
        what = f"{describe_group(gid)} call #{seq}"
        if missing:
            check.add((gid, seq), by_rank, "rank(s) " + ", ".join(map(str, missing)) + " never make this call "
                      "(the others would wait forever)", f"{what}: rank {missing[0]} never makes it" + (
                          f" (nor ranks {', '.join(map(str, missing[1:]))})" if len(missing) > 1 else "")
                      + f"; rank {first.rank} makes it at {first.where()}")
        elif len(kinds) > 1:
            check.add((gid, seq), by_rank, "members make it as different ops", f"{what}: members make it as different "
                      "ops: " + "; ".join(f"rank {r} {c.kind} at {c.where()}" for r, c in sorted(by_rank.items())))
    if not check.problems:
        _misread_matches(schedules, check)
    if not check.problems:
        stuck = _stuck(schedules, members)
        if stuck:
            check.problems.append("these calls cannot run together (each waits for another): "
                                  + "; ".join(w.words() for w in stuck))
            for w in stuck:
                waiting = sorted(v.rank for v in stuck if (v.group, v.seq) == (w.group, w.seq))
                others = [r for r in members[w.group] if r not in waiting]
                check.calls[(w.group, w.seq)] = (made[(w.group, w.seq)], f"rank(s) {', '.join(map(str, waiting))} wait "
                                                 f"in it; rank(s) {', '.join(map(str, others))} never reach it (each "
                                                 "waits in another call)")
    return check


def _misread_matches(schedules: dict[int, list[ScheduledCall]], check: ScheduleCheck) -> None:
    """The lemmas match calls within one solve, by their number there: the main graphs', or one
    call site's bodies' (`ScheduledCall.place`). Where two ranks' calls have one number in one
    solve but are not the same call of the programs (each rank's k-th call on the group), the
    proof would relate values the programs never exchange: a main-graph call on one rank made
    inside a layer call on the other, say."""
    by_place: dict[tuple, dict[int, ScheduledCall]] = defaultdict(dict)
    for calls in schedules.values():
        for call in calls:
            kind, site, local = call.place
            if kind == "site" and site.startswith("unjoined"):
                continue  # (no solve matches the calls of a layer call no call site joins)
            by_place[(kind, site, call.group, local)][call.rank] = call
    for (kind, site, gid, local), by_rank in sorted(by_place.items(), key=lambda item: str(item[0])):
        if len({c.seq for c in by_rank.values()}) < 2:
            continue
        solve = "the main graphs" if kind == "main" else f"the bodies of layer call site {site.split(':', 1)[-1]}"
        check.add((gid, min(c.seq for c in by_rank.values())), by_rank,
                  "the proof would match calls the programs do not",
                  f"{describe_group(gid)}: the proof matches the calls numbered {local} in {solve}, but the programs do "
                  "not (the k-th call a rank makes on a group meets every member's k-th): " + "; ".join(
                      f"rank {r} makes {c.where()} as its call #{c.seq}" for r, c in sorted(by_rank.items()))
                  + " (`refine verify --no-memo` matches the inlined calls)")
        if len(check.problems) >= 3:
            return


def _stuck(schedules: dict[int, list[ScheduledCall]], members: dict[str, list[int]]) -> list[Waiting]:
    """Complete every call all of whose members wait in it, until none can be: the calls the
    ranks are left waiting in (a deadlock), else []. Each rank arrives at its calls one by one,
    so the work is the number of calls made, whatever the world size."""
    heads = {r: 0 for r in schedules}
    arrived: dict[Call, set[int]] = defaultdict(set)
    complete: deque[Call] = deque()

    def arrive(r: int) -> None:
        if heads[r] < len(schedules[r]):
            call = schedules[r][heads[r]]
            key = (call.group, call.seq)
            arrived[key].add(r)
            if len(arrived[key]) == len(members.get(call.group, ())):
                complete.append(key)

    for r in schedules:
        arrive(r)
    while complete:
        for r in arrived.pop(complete.popleft()):
            heads[r] += 1
            arrive(r)
    return [Waiting(schedules[r][heads[r]]) for r in sorted(heads) if heads[r] < len(schedules[r])]
