"""What is wrong, in plain words: recognise the bug pattern behind a failed proof.

refine/diagnosis.py says *where* the relation breaks (the first failing sequential node, the
lemma that came closest). This module says *what* the ranks do wrong there, for the classes
of docs/bugs.md that leave a recognisable shape in the relations: partial sums that nothing
adds up (a missing all-reduce), a replica added to partial sums before the all-reduce (a bias
counted once per rank), partial sums combined by the wrong collective or reduction or over
too few ranks, an extra factor on the rank side, a reshape that moves the sharded axis. Each
pattern reads the relations the fixpoint derived and the rank programs' structure; none is
trusted for the verdict (only the proof and the counterexample decide), so a pattern that
does not match simply says nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from refine import layouts
from refine.report import Diagnosis, Failure

if TYPE_CHECKING:
    from refine.diagnosis import _Index

Rels = dict[str, list[tuple[str, object]]]
_SUMMING = {"AllReduce", "ReduceScatter"}


def what_is_wrong(ix: _Index, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """The first pattern that matches the failure at seq node or output `failing` (a seq id)."""
    for pattern in _PATTERNS:
        found = pattern(ix, rels, failure, failing)
        if found is not None:
            return found
    return None


# --- helpers over the index ------------------------------------------------------------------------


def _short(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def _line(ix: _Index, node: str | None) -> str:
    """`file:line` of a node, or ''."""
    loc = ix.loc.get(node) if node else None
    return f"{loc.file}:{loc.line}" if loc is not None and loc.file else ""


def _where(ix: _Index, node: str) -> str:
    return f", {_line(ix, node)}" if _line(ix, node) else ""


def _found(ix: _Index, pattern: str, bug_class: int, node: str | None, summary: str) -> Diagnosis:
    """The diagnosis, its rank-side node (if known) named and located."""
    return Diagnosis(pattern=pattern, bug_class=bug_class, rank_node=_short(node) if node else None,
                     location=ix.loc.get(node) if node else None, summary=summary)


def _collective(ix: _Index, node: str) -> str | None:
    """The kind of a `dist` collective node (AllReduce, ...), None for any other node."""
    op = ix.op.get(node, "")
    return op.split(".", 1)[1] if op.startswith("dist.") else None


_WORDS = {"AllReduce": "an all-reduce", "AllGather": "an all-gather", "ReduceScatter": "a reduce-scatter",
          "AllToAll": "an all-to-all"}


def _graph_of_rank(ix: _Index, rank: int) -> str:
    return next((g for g, r in ix.rank_of_graph.items() if r == rank), "")


def _kind(lay: object) -> str:
    return layouts.kind(lay)  # type: ignore[arg-type]


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}..{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _attr(ix: _Index, node: str, name: str) -> str | None:
    """An attribute of a collective, read off its signature (`...|group=[0, 1];reduce_op=sum`)."""
    sig = ix.sig.get(node, "")
    for part in sig.split("|", 1)[-1].split(";"):
        key, _, value = part.partition("=")
        if key == name:
            return value
    return None


_VALUE_KEEPING = {"Add", "Sub", "Mul", "Div", "Identity", "Reshape", "Cast", "Neg", "Transpose", "Unsqueeze",
                  "Squeeze", "Flatten", "Expand", "Slice", "Split", "SplitToSequence", "SequenceAt", "Concat",
                  "ConcatFromSequence"}  # (ops that move or combine values: a sum after them still sums them)


def _along_values(ix: _Index, tensor: str, steps: int = 6) -> list[str]:
    """The nodes reached from `tensor` through at most `steps` elementwise or view ops (what
    an all-reduce right after a bias Add would still sum), those ops included."""
    found: list[str] = []
    frontier = [tensor]
    for _ in range(steps):
        nxt = []
        for t in frontier:
            for node in ix.consumers.get(t, []):
                if node in found:
                    continue
                found.append(node)
                if ix.op.get(node) in _VALUE_KEEPING:
                    nxt.extend(ix.out_slot.get(node, {}).values())
        frontier = nxt
    return found


def _partial_pieces(ix: _Index, rels: Rels, s: str) -> dict[int, str]:
    """rank -> the rank tensor that holds a partial-sum piece of seq tensor `s` (one per rank)."""
    pieces: dict[int, str] = {}
    for t, lay in rels.get(s, []):
        if _kind(lay) == "psum":
            pieces.setdefault(ix.rank_of_graph.get(t.split(":", 1)[0], -1), t)
    return pieces


def _seq_inputs_of(ix: _Index, failing: str | None) -> list[str]:
    """The failing node's inputs, or for a failing output, the output itself."""
    if failing is None:
        return []
    if failing in ix.inputs:
        return list(ix.inputs[failing])
    return [failing]


def _rank_kinds(rels: Rels) -> dict[str, dict[str, str]]:
    """rank tensor -> layout kind -> a seq tensor it relates to so."""
    kinds: dict[str, dict[str, str]] = {}
    for s, related in rels.items():
        for t, lay in related:
            kinds.setdefault(t, {}).setdefault(_kind(lay), s)
    return kinds


_CONTRACTIONS = ("MatMul", "Gemm", "Einsum", "ReduceSum", "Conv")


def _origin(ix: _Index, kinds: dict[str, dict[str, str]], t: str) -> str | None:
    """The rank node where a partial sum arises: up from `t`, through the inputs that are
    partial pieces too, to the contraction (MatMul, Gemm, ReduceSum, ...) that makes it."""
    node = ix.producer.get(t)
    for _ in range(16):
        if node is None or ix.op.get(node) in _CONTRACTIONS:
            return node
        up = [x for x in ix.inputs.get(node, []) if "psum" in kinds.get(x, {})]
        if not up or up[0] not in ix.producer:
            return node
        node = ix.producer[up[0]]
    return node


# --- the patterns ------------------------------------------------------------------------------------


def _missing_allreduce(ix: _Index, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Partial sums on every rank, and no summing collective soon after the contraction that
    makes them (through ops that only move or combine values)."""
    kinds = _rank_kinds(rels)
    for s in _seq_inputs_of(ix, failing):
        pieces = _partial_pieces(ix, rels, s)
        if len(pieces) < 2 or len(pieces) < ix.world_size:
            continue
        origins = {r: _origin(ix, kinds, t) for r, t in sorted(pieces.items())}
        rank = next((r for r, o in origins.items() if o is not None and ix.op.get(o) in _CONTRACTIONS), min(pieces))
        t, origin = pieces[rank], origins[rank]
        start = ix.out_slot.get(origin, {}).get(0, t) if origin else t
        if any(_collective(ix, n) in _SUMMING for n in _along_values(ix, start, 8)):
            continue  # summed soon after they arise: something else is wrong (e.g. added to before the sum)
        after = f" after `{_short(origin)}`" + (f" ({_line(ix, origin)})" if _line(ix, origin) else "") if origin else ""
        return _found(ix, "missing_allreduce", 1, origin,
                      f"an all-reduce (sum) is missing{after}: the ranks' `{_short(t)}` are partial sums "
                      f"(each of {_ranks_text(list(pieces))} holds a part of the sum) and nothing adds them up")
    return None


def _replica_before_allreduce(ix: _Index, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """A rank Add of a partial-sum piece and a replica, summed by an all-reduce afterwards:
    the replica is counted once per rank."""
    kinds = _rank_kinds(rels)
    for node, op in ix.op.items():
        if op not in ("Add", "Sub") or node.startswith("seq:") or ix.node_graph.get(node) == "seq":
            continue
        ins = [ix.in_slot[node].get(i) for i in (0, 1)]
        if None in ins:
            continue
        partial = [t for t in ins if "psum" in kinds.get(t, {})]
        whole = [t for t in ins if "rep" in kinds.get(t, {}) and t not in partial]
        if not partial or not whole:
            continue
        summed = [n for n in _along_values(ix, ix.out_slot[node][0])
                  if _collective(ix, n) in _SUMMING and (_attr(ix, n, "reduce_op") or "sum") == "sum"]
        if not summed:
            continue
        members = ix.group_members.get(ix.coll.get(summed[0], ("", "", 0))[1], []) or list(range(ix.world_size))
        if not all(f"{_graph_of_rank(ix, r)}:{_short(node)}" in ix.op for r in members):
            continue  # added on some ranks only (rank 0's bias, say): counted once, as it should be
        count = len(members)
        added = _short(whole[0])
        return _found(ix, "replica_before_allreduce", 3, node,
                      f"`{added}` is added on every rank before the all-reduce (`{_short(node)}`{_where(ix, node)}): "
                      f"the sum counts it {count} times; add it after the all-reduce, or on one rank only, "
                      f"or divided by {count}")
    return None


def _wrong_combination(ix: _Index, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Partial sums fed to a collective that does not sum them all: another kind (all-gather),
    another reduction (max, avg), or a group that misses some pieces."""
    for s in _seq_inputs_of(ix, failing) + [t for n in [failing] if n for t in ix.out_slot.get(n, {}).values()]:
        for src in (s, *(i for i in ix.inputs.get(ix.producer.get(s, ""), []))):
            pieces = _partial_pieces(ix, rels, src)
            if len(pieces) < 2:
                continue
            for rank, t in sorted(pieces.items()):
                for node in ix.consumers.get(t, []):
                    kind = _collective(ix, node)
                    if kind is None:
                        continue
                    members = ix.group_members.get(ix.coll.get(node, ("", "", 0))[1], [])
                    reduce_op = _attr(ix, node, "reduce_op") or "sum"
                    where = f"`{_short(node)}`{_where(ix, node)}"
                    what = f"the ranks hold partial sums of `{_short(src)}`"
                    if kind not in _SUMMING:
                        text = (f"{what} and combine them with {_WORDS.get(kind, kind)} ({where}), which does not "
                                f"add them up: partial sums need an all-reduce (sum)")
                    elif reduce_op != "sum":
                        extra = f" (an extra 1/{len(members)})" if reduce_op == "avg" else ""
                        text = f"{what} and reduce them with {reduce_op} ({where}){extra}: partial sums need sum"
                    elif not set(pieces) <= set(members):
                        text = (f"{what} on {_ranks_text(list(pieces))}, but {where} reduces over "
                                f"{_ranks_text(members)} only: the collective is over the wrong group")
                    else:
                        continue
                    cls = 2 if kind not in _SUMMING or reduce_op == "max" else 14 if reduce_op == "avg" else 11
                    return _found(ix, "wrong_collective", cls, node, text)
    return None


def _extra_factor(ix: _Index, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """An input the ranks hold scaled by a constant factor the sequential model lacks."""
    for s in _seq_inputs_of(ix, failing):
        for t, lay in rels.get(s, []):
            if _kind(lay) != "scaled" or any(_kind(other) != "scaled" for t2, other in rels.get(s, []) if t2 == t):
                continue
            if not any(_short(n) == _short(failing or "") for n in ix.consumers.get(t, [])):
                continue  # the ranks feed the scaled value to the failing node's counterpart
            p, q = lay[1], lay[2]  # type: ignore[index]
            node = ix.producer.get(t)
            where = f" (`{_short(node)}`{_where(ix, node)})" if node else ""
            return _found(ix, "extra_factor", 14, node,
                          f"the ranks multiply `{_short(s)}` by {p}/{q}{where}, a factor the sequential model does not have")
    return None


def _reshape_moves_shard(ix: _Index, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """A Reshape of a tensor sharded on one axis whose per-rank result is not the sequential
    result cut on one axis: the shard moved inside another axis."""
    if failing is None or ix.op.get(failing) != "Reshape":
        return None
    data = ix.in_slot.get(failing, {}).get(0)
    out = ix.out_slot.get(failing, {}).get(0)
    if data is None or out is None:
        return None
    seq_out = _dims(ix, out)
    for t, lay in rels.get(data, []):
        if _kind(lay) != "sl":
            continue
        axis = lay[1]  # type: ignore[index]
        rank_node = next((n for n in ix.consumers.get(t, []) if ix.op.get(n) == "Reshape"), None)
        if rank_node is None:
            continue
        rank_out = _dims(ix, ix.out_slot[rank_node][0])
        if len(rank_out) != len(seq_out):
            continue
        differ = [a for a, (x, y) in enumerate(zip(seq_out, rank_out)) if x != y]
        group = _split_axes(_dims(ix, data), seq_out, axis)
        if len(differ) != 1 or group is None or differ[0] not in group or differ[0] == group[0]:
            continue  # (cutting the outer factor keeps the shard on one axis: not this bug)
        inner, outer = differ[0], group[0]
        hint = ""
        if outer is not None and seq_out[outer] % (seq_out[inner] // rank_out[inner] or 1) == 0:
            hint = (f"; keeping axis {inner} whole and dividing axis {outer} instead "
                    f"({seq_out[outer]} -> {seq_out[outer] * rank_out[inner] // seq_out[inner]}) keeps the shard on one axis")
        return _found(ix, "reshape_moves_shard", 8, rank_node,
                      f"the reshape moves the sharded axis: each rank reshapes its slice of `{_short(data)}` "
                      f"(axis {axis}) to {rank_out} where the sequential model has {seq_out}, so axis {inner} is cut "
                      f"({seq_out[inner]} -> {rank_out[inner]}) inside every piece and the ranks' results are not "
                      f"whole pieces of one axis{hint}")
    return None


def _split_axes(before: list[int], after: list[int], axis: int) -> list[int] | None:
    """The axes of `after` that axis `axis` of `before` is split into, where the axes before it
    are kept as they are (a reshape [b, s, h*d] -> [b, s, h, d] splits axis 2 into 2, 3)."""
    if axis >= len(before) or before[:axis] != after[:axis]:
        return None
    size, axes = 1, []
    for a in range(axis, len(after)):
        size *= after[a]
        axes.append(a)
        if size == before[axis]:
            return axes
        if size > before[axis]:
            return None
    return None


def _dims(ix: _Index, t: str) -> list[int]:
    return [ix.dims.get((t, a), 0) for a in range(ix.ndim.get(t, 0))]


def _rank_only_scaling(ix: _Index, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """A rank node next to the failing one that multiplies (or divides) by a constant, with no
    counterpart in the sequential model."""
    for rank_node in failure.rank_nodes:
        node = f"{_graph_of_rank(ix, rank_node.rank)}:{rank_node.node}"
        if rank_node.op not in ("Mul", "Div") or f"seq:{rank_node.node}" in ix.op:
            continue
        ins = ix.in_slot.get(node, {})
        const = next((t for t in ins.values() if t in ix.consts), None)
        data = next((t for t in ins.values() if t not in ix.consts), None)
        if const is None or data is None:
            continue
        verb = "multiply" if rank_node.op == "Mul" else "divide"
        return _found(ix, "extra_factor", 14, node,
                      f"the ranks {verb} `{_short(data)}` by a constant (`{rank_node.node}`{_where(ix, node)}) "
                      "that the sequential model does not apply")
    return None


_PATTERNS: list[Callable[[_Index, Rels, Failure, str | None], Diagnosis | None]] = [
    _replica_before_allreduce, _wrong_combination, _missing_allreduce, _extra_factor, _rank_only_scaling,
    _reshape_moves_shard,
]
