"""What is wrong, in plain words: recognise the bug pattern behind a failed proof.

refine/diagnose/diagnosis.py says *where* the relation breaks (the first failing sequential node, the
lemma that came closest). This module says *what* the ranks do wrong there, for the classes
of docs/bugs.md that leave a recognisable shape in the relations: partial sums that nothing
adds up (a missing all-reduce), a replica added to partial sums before the all-reduce (a bias
counted once per rank), partial sums combined by the wrong collective or reduction (max; avg,
an extra 1/TP) or over too few ranks, an extra factor on the rank side, a reshape that moves
the sharded axis, every rank slicing the same piece of a replica where each needs its own. Each
pattern reads the relations the fixpoint derived and the rank programs' structure; none is
trusted for the verdict (only the proof and the counterexample decide), so a pattern that
does not match simply says nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from refine import layouts
from refine.diagnose.index import FactIndex
from refine.report.render import mesh_group_words
from refine.report.schema import Diagnosis, Failure

Rels = dict[str, list[tuple[str, object]]]
_SUMMING = {"AllReduce", "ReduceScatter"}


def what_is_wrong(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None,
                  ring_stuck: list[tuple[object, ...]] | None = None) -> Diagnosis | None:
    """Where a ring attention's merge stops (`ring_stuck`, rules/ring.lp), if it does: that rank
    node is the bug's; else the first pattern that matches the failure at seq node or output
    `failing` (a seq id)."""
    ring = stopped_ring(ix, ring_stuck or [])
    if ring is not None:
        return ring
    for pattern in _PATTERNS:
        found = pattern(ix, rels, failure, failing)
        if found is not None:
            return found
    return None


# --- helpers over the index ------------------------------------------------------------------------


def _short(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def _line(ix: FactIndex, node: str | None) -> str:
    """`file:line` of a node, or ''."""
    loc = ix.loc.get(node) if node else None
    return f"{loc.file}:{loc.line}" if loc is not None and loc.file else ""


def _where(ix: FactIndex, node: str) -> str:
    return f", {_line(ix, node)}" if _line(ix, node) else ""


def _named(ix: FactIndex, node: str) -> str:
    """`node` (file:line): a rank node as the summaries name it."""
    return f"`{_short(node)}`" + (f" ({_line(ix, node)})" if _line(ix, node) else "")


def _found(ix: FactIndex, pattern: str, bug_class: int | None, node: str | None, summary: str) -> Diagnosis:
    """The diagnosis, its rank-side node (if known) named and located."""
    return Diagnosis(pattern=pattern, bug_class=bug_class, rank_node=_short(node) if node else None,
                     location=ix.loc.get(node) if node else None, summary=summary)


def _collective(ix: FactIndex, node: str) -> str | None:
    """The kind of a `dist` collective node (AllReduce, ...), None for any other node."""
    op = ix.op.get(node, "")
    return op.split(".", 1)[1] if op.startswith("dist.") else None


_WORDS = {"AllReduce": "an all-reduce", "AllGather": "an all-gather", "ReduceScatter": "a reduce-scatter",
          "AllToAll": "an all-to-all"}


def _graph_of_rank(ix: FactIndex, rank: int) -> str:
    return next((g for g, r in ix.rank_of_graph.items() if r == rank), "")


def _rank_of(ix: FactIndex, t: str) -> int:
    """The rank whose program holds rank tensor `t` (-1 for a sequential one)."""
    return ix.rank_of_graph.get(t.split(":", 1)[0], -1)


def _kind(lay: object) -> str:
    return layouts.kind(lay)  # type: ignore[arg-type]


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}..{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _attr(ix: FactIndex, node: str, name: str) -> str | None:
    """An attribute of a collective, read off its signature (`...|group=[0, 1];reduce_op=sum`)."""
    sig = ix.sig.get(node, "")
    for part in sig.split("|", 1)[-1].split(";"):
        key, _, value = part.partition("=")
        if key == name:
            return value
    return None


_MOVING = {"Identity", "Reshape", "Cast", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Slice",
           "Split", "SplitToSequence", "SequenceAt", "Concat", "ConcatFromSequence"}  # (ops that only move values)
_VALUE_KEEPING = _MOVING | {"Add", "Sub", "Mul", "Div", "Neg"}  # (a sum after these still sums what they combine)


def _along_values(ix: FactIndex, tensor: str, steps: int = 6, through: set[str] = _VALUE_KEEPING) -> list[str]:
    """The nodes reached from `tensor` through at most `steps` ops of `through` (by default
    elementwise or view ops: what an all-reduce right after a bias Add would still sum), those
    ops included, nearest first."""
    found: list[str] = []
    frontier = [tensor]
    for _ in range(steps):
        nxt = []
        for t in frontier:
            for node in ix.consumers.get(t, []):
                if node in found:
                    continue
                found.append(node)
                if ix.op.get(node) in through:
                    nxt.extend(ix.out_slot.get(node, {}).values())
        frontier = nxt
    return found


def _partial_tensors(ix: FactIndex, rels: Rels, s: str) -> dict[int, list[str]]:
    """rank -> every rank tensor that holds a partial-sum piece of seq tensor `s` (a partial
    sum and its views: the one a collective reads may be any of them)."""
    pieces: dict[int, list[str]] = {}
    for t, lay in rels.get(s, []):
        if _kind(lay) == "psum":
            pieces.setdefault(_rank_of(ix, t), []).append(t)
    return pieces


def _partial_pieces(ix: FactIndex, rels: Rels, s: str) -> dict[int, str]:
    """rank -> the rank tensor that holds a partial-sum piece of seq tensor `s` (one per rank)."""
    return {r: ts[0] for r, ts in _partial_tensors(ix, rels, s).items()}


def _seq_inputs_of(ix: FactIndex, failing: str | None) -> list[str]:
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


def _origin(ix: FactIndex, kinds: dict[str, dict[str, str]], t: str) -> str | None:
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


def _missing_allreduce(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
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
        after = f" after {_named(ix, origin)}" if origin else ""
        return _found(ix, "missing_allreduce", 1, origin,
                      f"an all-reduce (sum) is missing{after}: the ranks' `{_short(t)}` are partial sums "
                      f"(each of {_ranks_text(list(pieces))} holds a part of the sum) and nothing adds them up")
    return None


def _replica_before_allreduce(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
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


def _wrong_combination(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Partial sums fed (directly, or through ops that only move values) to a collective that
    does not sum them all: another kind (all-gather), another reduction (max, avg), or a group
    that misses some pieces."""
    kinds = _rank_kinds(rels)
    for s in _seq_inputs_of(ix, failing) + [t for n in [failing] if n for t in ix.out_slot.get(n, {}).values()]:
        for src in (s, *(i for i in ix.inputs.get(ix.producer.get(s, ""), []))):
            tensors = _partial_tensors(ix, rels, src)
            if len(tensors) < 2:
                continue
            pieces = _piece_holders(ix, rels, src)
            for _rank, held in sorted(tensors.items()):
                for t in held:
                    for node in _along_values(ix, t, 6, _MOVING):
                        found = _misused_collective(ix, kinds, src, sorted(tensors), t, node, pieces)
                        if found is not None:
                            return found
    return None


def _piece_holders(ix: FactIndex, rels: Rels, s: str) -> dict[tuple, set[int]]:
    """Each partial-sum piece of seq tensor `s` (its [a, b) of d and style) -> the ranks holding it
    (on a mesh, the ranks of one TP group hold the same DP piece)."""
    holders: dict[tuple, set[int]] = {}
    for t, lay in rels.get(s, []):
        if _kind(lay) == "psum":
            holders.setdefault(tuple(lay[1:]), set()).add(_rank_of(ix, t))  # type: ignore[index]
    return holders


def _misused_collective(ix: FactIndex, kinds: dict[str, dict[str, str]], src: str, ranks: list[int], t: str,
                        node: str, pieces: dict[tuple, set[int]] | None = None) -> Diagnosis | None:
    """What is wrong with collective `node` reading rank tensor `t`, a partial-sum piece of seq
    tensor `src` held on `ranks` (`pieces`: which ranks hold each piece); None if it is no
    collective or sums the pieces as it should."""
    kind = _collective(ix, node)
    if kind is None:
        return None
    members = ix.group_members.get(ix.coll.get(node, ("", "", 0))[1], [])
    reduce_op = _attr(ix, node, "reduce_op") or "sum"
    what = f"the ranks hold partial sums of `{_short(src)}`"
    the = f"the {_WORDS.get(kind, kind).split(' ', 1)[-1]} {_named(ix, node)}"  # (the all-reduce `...` (file:line))
    origin = _origin(ix, kinds, t)  # the contraction the partial sums come from, if it is one
    origin = origin if origin is not None and ix.op.get(origin) in _CONTRACTIONS else None
    if kind not in _SUMMING:
        text = (f"{what} and combine them with {_WORDS.get(kind, kind)} (`{_short(node)}`{_where(ix, node)}), "
                "which does not add them up: partial sums need an all-reduce (sum)")
        return _found(ix, "wrong_collective", 2, node, text)
    if reduce_op == "avg":
        text = (f"an extra factor 1/{len(members) or len(ranks)}: {the} averages where it must sum "
                f"(the ranks hold partial sums of `{_short(origin or src)}` and reduce them with avg)")
        return _found(ix, "wrong_collective", 14, node, text)
    if reduce_op != "sum":
        made = _named(ix, origin) if origin else f"`{_short(src)}`"
        return _found(ix, "wrong_collective", 2, node,
                      f"the partial sums of {made} are combined with {reduce_op} by {the}; they must be summed")
    missed = [held for held in (pieces or {}).values() if not held & set(members)] if pieces else \
        ([set(ranks) - set(members)] if not set(ranks) <= set(members) else [])
    if missed:  # (a piece none of the members holds)
        line = mesh_group_words(members, ix.mesh)
        over = _ranks_text(members) + (f" ({line})" if line else "")
        text = (f"{what} on {_ranks_text(ranks)}, but {_named(ix, node)} reduces over {over} only: "
                "the collective is over the wrong group")
        return _found(ix, "wrong_collective", 11, node, text)
    return None


def _extra_factor(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
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


def _reshape_moves_shard(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
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


_SLICING = ("Slice", "Gather", "Split")


def _same_slice_on_every_rank(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Every rank slices the same shard-sized piece out of a tensor it holds whole (a Slice or
    Gather with one offset on all ranks, which the sequential model does not do) and feeds it
    to the failing node's counterpart as if it were its own piece: the pieces overlap and the
    rest of the tensor is never used (KV heads replicated with the wrong offsets, say)."""
    world = ix.world_size
    if failing is None or world < 2:
        return None
    kinds = _rank_kinds(rels)
    for s in _seq_inputs_of(ix, failing):
        whole = {t for t, lay in rels.get(s, []) if lay == "rep"}
        by_range: dict[tuple[int, int, int], dict[int, str]] = {}
        for t, lay in rels.get(s, []):
            if _kind(lay) == "sl":
                by_range.setdefault(tuple(lay[1:]), {}).setdefault(_rank_of(ix, t), t)  # type: ignore[arg-type,index]
        for (axis, start, end), held in sorted(by_range.items()):
            size = ix.dims.get((s, axis), 0)
            if sorted(held) != list(range(world)) or end <= start or (end - start) * world != size:
                continue  # (not one shard-sized piece per rank: not this bug)
            cuts = {r: ix.producer.get(t, "") for r, t in held.items()}
            if (any(ix.op.get(n) not in _SLICING or ix.in_slot.get(n, {}).get(0) not in whole for n in cuts.values())
                    or len({_short(n) for n in cuts.values()}) != 1):
                continue  # the same cut of the whole tensor, by the same code on every rank
            if any("rep" in kinds.get(t, {}) for t in held.values()):
                continue  # the sequential model takes that slice too (rotate-half, say): not a rank's piece
            if not all(any(ix.op.get(c) == ix.op.get(failing) for c in ix.consumers.get(t, [])) for t in held.values()):
                continue  # the ranks do not use it where the sequential model uses the whole tensor
            node = cuts[0]
            text = (f"every rank takes the same slice of `{_short(s)}` instead of its own: the {ix.op[node]} "
                    f"{_named(ix, node)} takes [{start}:{end}) of axis {axis} on {_ranks_text(list(held))}")
            own = _own_pieces(ix, rels, s, axis, end - start, failing)
            if own is not None:
                other, starts = own
                wrong = [r for r in sorted(starts) if starts[r] != start]
                needs = ", ".join(f"rank {r} needs [{starts[r]}:{starts[r] + end - start})" for r in wrong[:2])
                more = ", ..." if len(wrong) > 2 else ""
                text += f"; {needs}{more} (its piece of `{_short(other)}`, the same shape cut the same way)"
            text += f": together the ranks hold only [{start}:{end}) of the {size} on that axis"
            return _found(ix, "wrong_offset", 7, node, text)
    return None


def _own_pieces(ix: FactIndex, rels: Rels, s: str, axis: int, width: int,
                failing: str) -> tuple[str, dict[int, int]] | None:
    """Where each rank's own piece starts, read off the sequential tensors shaped like `s` that
    the ranks hold cut on `axis` in pieces of `width` (one each, covering the axis): (such a
    tensor, rank -> start), or None when there is none or they disagree. A tensor that the
    failing node's op also reads (the sibling of `s`, as q is of k) is named first."""
    shape = _dims(ix, s)
    found: list[tuple[str, dict[int, int]]] = []
    for other, related in rels.items():
        if other == s or _dims(ix, other) != shape:
            continue
        starts: dict[int, set[int]] = {}
        for t, lay in related:
            if _kind(lay) == "sl" and lay[1] == axis and lay[3] - lay[2] == width:  # type: ignore[index,operator]
                starts.setdefault(_rank_of(ix, t), set()).add(lay[2])  # type: ignore[index]
        if sorted(starts) != list(range(ix.world_size)) or any(len(v) != 1 for v in starts.values()):
            continue
        own = {r: min(v) for r, v in starts.items()}
        if sorted(own.values()) == list(range(0, shape[axis], width)):
            found.append((other, own))
    if not found or len({tuple(sorted(own.items())) for _, own in found}) != 1:
        return None
    op = ix.op.get(failing)
    found.sort(key=lambda f: (not any(ix.op.get(c) == op for c in ix.consumers.get(f[0], [])),
                              ix.topo.get(ix.producer.get(f[0], ""), -1)))
    return found[0]


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


def _dims(ix: FactIndex, t: str) -> list[int]:
    return [ix.dims.get((t, a), 0) for a in range(ix.ndim.get(t, 0))]


def _rank_only_scaling(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
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


# --- a ring attention that stops (rules/ring.lp's ring_stuck) -------------------------------------
# why -> (docs/bugs.md class or None, what the rank node does)
_RING_STOPS: dict[str, tuple[int | None, str]] = {
    "block_operand": (9, "combines a key block with an operand that is not that block's (a causal mask not offset "
                         "to the block's source rank, say)"),
    "merge": (None, "adds two partial attentions against different references (merged without the "
                    "exp(M_old - M_new) rescale) or over overlapping keys (a block merged twice)"),
    "rescale": (14, "rescales a partial attention by a factor other than exp(M_old - M_new) for its own reference "
                    "(a missing or wrong online-softmax rescale)"),
    "finish": (None, "divides the running output by its running sum before every key block is in it"),
}


def stopped_ring(ix: FactIndex, stuck: list[tuple[object, ...]]) -> Diagnosis | None:
    """Where a ring attention's online-softmax merge stops (the first such rank node in rank and
    program order) and what it does there, from rules/ring.lp's ring_stuck(G, M, Why)."""
    known = [(ix.rank_of_graph.get(str(g), 1 << 30), ix.topo_all.get(str(m), 1 << 30), str(m), str(why))
             for g, m, why in stuck if str(why) in _RING_STOPS]
    if not known:
        return None
    rank, _, node, why = min(known)
    bug_class, does = _RING_STOPS[why]
    # (a key block's mask is any block-wise attention's, gathered or passed round a ring; the
    # merge of partial attentions is the ring's)
    what = "attention over key blocks" if why == "block_operand" else "ring attention"
    return _found(ix, f"ring_{why}", bug_class, node, f"{what}: the {ix.op.get(node, '?')} {_named(ix, node)} on "
                  f"rank {rank} {does}, so the ranks' outputs are not softmax(QK^T) V")


_PATTERNS: list[Callable[[FactIndex, Rels, Failure, str | None], Diagnosis | None]] = [
    _replica_before_allreduce, _wrong_combination, _missing_allreduce, _extra_factor, _rank_only_scaling,
    _same_slice_on_every_rank, _reshape_moves_shard,
]
