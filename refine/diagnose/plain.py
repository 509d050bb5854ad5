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
from fractions import Fraction

from refine import layouts
from refine.diagnose.index import FactIndex
from refine.config import Mesh
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


_VIEW_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Expand", "Transpose", "Cast"}


def _upstream(ix: FactIndex, t: str, through: set[str], steps: int = 16) -> list[str]:
    """`t` and the tensors it is made from through ops of `through` (input 0 of each), nearest first."""
    chain = [t]
    for _ in range(steps):
        node = ix.producer.get(chain[-1])
        source = ix.in_slot.get(node, {}).get(0) if node is not None and ix.op.get(node) in through else None
        if source is None:
            break
        chain.append(source)
    return chain


def _name(ix: FactIndex, t: str) -> str:
    """A tensor in the user's words: the tensor it is a view of, by its name (a reshape or a
    transpose of a parameter is that parameter; an exported `down.bias (view)` is `down.bias`)."""
    return _short(_upstream(ix, t, _VIEW_OPS)[-1])


def _described(ix: FactIndex, t: str) -> str:
    """`name` of a tensor, and where a name without a module path does not say what it is, the
    named tensor it is made from or the node that reads it (`Softmax` of `router/MatMul`)."""
    name = _name(ix, t)
    if "/" in name or "." in name or t in ix.graph_inputs or t in ix.graph_outputs:
        return f"`{name}`"
    todo, seen = list(ix.inputs.get(ix.producer.get(t, ""), [])), set()
    while todo and len(seen) < 32:
        x = todo.pop(0)
        if x in seen:
            continue
        seen.add(x)
        near = _name(ix, x)
        if ("/" in near or x in ix.graph_inputs) and x not in ix.consts:
            return f"`{name}` (of `{near}`)"
        todo.extend(ix.inputs.get(ix.producer.get(x, ""), []))
    reader = next((n for n in ix.consumers.get(t, []) if "/" in _short(n)), None)
    return f"`{name}` (read by `{_short(reader)}`)" if reader else f"`{name}`"


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


def _psum_piece(lay: object) -> tuple[tuple, object] | None:
    """(its batch chunk, or (), and the partial-sum layout) of a partial-sum piece, of a batch
    chunk (a DP x TP mesh, rules/windows.lp), of a chunk of one (a DP row's sequence chunk over
    cp: the chunks' (axis, index, count) in turn) or of the whole tensor; None for another layout."""
    chunk: tuple = ()
    while _kind(lay) == "chunk":
        chunk, lay = chunk + tuple(lay[1:4]), lay[4]  # type: ignore[index]
    return (chunk, lay) if _kind(lay) == "psum" else None


def _partial_tensors(ix: FactIndex, rels: Rels, s: str) -> dict[int, list[str]]:
    """rank -> every rank tensor that holds a partial-sum piece of seq tensor `s` (a partial
    sum and its views: the one a collective reads may be any of them)."""
    pieces: dict[int, list[str]] = {}
    for t, lay in rels.get(s, []):
        if _psum_piece(lay) is not None:
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
            if _psum_piece(lay) is not None:
                kinds[t].setdefault("psum", s)  # (a batch chunk's partial sum too)
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
        holders = {_rank_of(ix, t) for t, _ in rels.get(s, [])}
        line = mesh_group_words(sorted(pieces), ix.mesh)  # (every rank, or a mesh group: a pipeline stage's)
        if len(pieces) < 2 or set(pieces) != holders or (len(pieces) < ix.world_size and line is None):
            continue
        origins = {r: _origin(ix, kinds, t) for r, t in sorted(pieces.items())}
        rank = next((r for r, o in origins.items() if o is not None and ix.op.get(o) in _CONTRACTIONS), min(pieces))
        t, origin = pieces[rank], origins[rank]
        if origin is not None and _collective(ix, origin) in _SUMMING:
            continue  # (shares of a value a reduction already summed: not a missing sum)
        start = ix.out_slot.get(origin, {}).get(0, t) if origin else t
        if any(_collective(ix, n) in _SUMMING for n in _along_values(ix, start, 8)):
            continue  # summed soon after they arise: something else is wrong (e.g. added to before the sum)
        after = f" after {_named(ix, origin)}" if origin else ""
        partial = _name(ix, start) if origin and ix.op.get(origin) in _CONTRACTIONS else _name(ix, t)
        grads = [o for n in _along_values(ix, start, 8, _VALUE_KEEPING | set(_SLICING))
                 for o in ix.out_slot.get(n, {}).values() if o in ix.rank_outputs and _short(o).startswith(GRAD)]
        grads += [start] if start in ix.rank_outputs and _short(start).startswith(GRAD) else []
        if grads:  # (a parameter's gradient, left as each rank's part: its own rows, tokens or batch slice)
            param = _short(grads[0])[len(GRAD):]
            return _found(ix, "unreduced_gradient", 4, origin,
                          f"the gradient of `{param}` is a partial sum on every rank{after}: each of "
                          f"{_ranks_text(list(pieces))} holds only its own part (its tokens, rows or batch slice) and "
                          "nothing adds them up; a parameter used on sharded activations needs its gradient reduced "
                          "over those ranks (all-reduce, or FSDP's reduce-scatter)")
        return _found(ix, "missing_allreduce", 1, origin,
                      f"an all-reduce (sum) is missing{after}: the ranks' `{partial}` are partial sums "
                      f"(each of {_ranks_text(list(pieces))}{f' ({line})' if line else ''} holds a part of the sum) "
                      "and nothing adds them up")
    return None


def _replica_before_allreduce(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """A rank Add of a partial-sum piece and a replica, summed by an all-reduce afterwards:
    the replica is counted once per rank."""
    kinds = _rank_kinds(rels)
    replicas: dict[str, set[str]] | None = None  # rank tensor -> the seq tensors it is a replica of
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
        if replicas is None:
            replicas = {}
            for s, related in rels.items():
                for t, lay in related:
                    if lay == "rep":
                        replicas.setdefault(t, set()).add(s)
        added_value = replicas.get(whole[0], set())
        if not all(any(replicas.get(x, set()) & added_value
                       for x in ix.inputs.get(f"{_graph_of_rank(ix, r)}:{_short(node)}", []))
                   for r in members):
            continue  # (not the same value on every rank: not one value counted once per rank)
        count = len(members)
        added = _name(ix, whole[0])
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
            chunks = {t: piece[0] for t, lay in rels.get(src, []) if (piece := _psum_piece(lay)) is not None}
            for _rank, held in sorted(tensors.items()):
                for t in held:
                    own = {k: v for k, v in pieces.items() if k[0] == chunks.get(t)}  # (pieces of t's batch chunk)
                    for node in _along_values(ix, t, 6, _MOVING):
                        found = _misused_collective(ix, kinds, src, sorted(tensors), t, node, own)
                        if found is not None:
                            return found
    return None


def _collective_near_failure(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """A collective near the failure (the report's collective calls) whose input is a partial-sum
    piece and which does not sum the pieces as it should: the same judgement as
    `_wrong_combination`, where the failure lands past the collective (its result already
    related otherwise, as a share of a later sum, say)."""
    kinds = _rank_kinds(rels)
    where = {t: (s, piece[0]) for s, related in rels.items() for t, lay in related
             if (piece := _psum_piece(lay)) is not None}
    for call in failure.collectives:
        for member in call.members:
            if member.node is None or member.input is None:
                continue
            graph = _graph_of_rank(ix, member.rank)
            t, node = f"{graph}:{member.input}", f"{graph}:{member.node}"
            if t not in where:
                continue
            src, chunk = where[t]
            own = {k: v for k, v in _piece_holders(ix, rels, src).items() if k[0] == chunk}
            found = _misused_collective(ix, kinds, src, sorted(_partial_tensors(ix, rels, src)), t, node, own)
            if found is not None:
                return found
    return None


def _piece_holders(ix: FactIndex, rels: Rels, s: str) -> dict[tuple, set[int]]:
    """Each partial-sum piece of seq tensor `s` (its [a, b) of d and style) -> the ranks holding it
    (on a mesh, the ranks of one TP group hold the same DP piece)."""
    holders: dict[tuple, set[int]] = {}
    for t, lay in rels.get(s, []):
        piece = _psum_piece(lay)
        if piece is not None:
            holders.setdefault((piece[0], *piece[1][1:]), set()).add(_rank_of(ix, t))  # type: ignore[index]
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
    the = f"the {_WORDS.get(kind, kind).split(' ', 1)[-1]} {_named(ix, node)}"  # (the all-reduce `...` (file:line))
    origin = _origin(ix, kinds, t)  # the contraction the partial sums come from, if it is one
    origin = origin if origin is not None and ix.op.get(origin) in _CONTRACTIONS else None
    what = f"the ranks hold partial sums of `{_short(origin) if origin else _name(ix, src)}`"
    if kind == "Send":  # a pipeline stage hands partial sums on
        text = (f"{what} and a pipeline stage sends them to the next one (`{_short(node)}`{_where(ix, node)}) "
                "before they are summed: all-reduce them over the stage's tensor-parallel group before the send")
        return _found(ix, "stage_sends_partial", 13, node, text)
    if kind not in _SUMMING:
        text = (f"{what} and combine them with {_WORDS.get(kind, kind)} (`{_short(node)}`{_where(ix, node)}), "
                "which does not add them up: partial sums need an all-reduce (sum)")
        return _found(ix, "wrong_collective", 2, node, text)
    if reduce_op == "avg" and origin is not None and ix.op.get(origin) == "ReduceSum":  # (a loss summed over rows)
        k = len(members) or len(ranks)
        text = (f"an extra factor 1/{k}: the ranks' `{_name(ix, ix.out_slot[origin][0])}` are sums over their own rows "
                f"({_named(ix, origin)}) and {the} averages them{_over(ix, members)}, so the result is 1/{k} of the sum "
                "over the whole batch (data parallelism averages the ranks' losses and gradients): make the loss a "
                "mean over the rank's rows, or divide the sum by the global count")
        return _found(ix, "wrong_collective", 14, origin, text)
    if reduce_op == "avg":
        return _averages(ix, node, f"1/{len(members) or len(ranks)}",
                         f"the ranks hold partial sums of `{_short(origin) if origin else _name(ix, src)}` and reduce them "
                         "with avg")
    if reduce_op != "sum":
        made = _named(ix, origin) if origin else f"`{_name(ix, src)}`"
        return _found(ix, "wrong_collective", 2, node,
                      f"the partial sums of {made} are combined with {reduce_op} by {the}; they must be summed")
    missed = [held for held in (pieces or {}).values() if not held & set(members)] if pieces else \
        ([set(ranks) - set(members)] if not set(ranks) <= set(members) else [])
    if missed:  # (a piece none of the members holds)
        text = (f"{what} on {_ranks_text(ranks)}, but {_named(ix, node)} reduces{_over(ix, members)} only: "
                "the collective is over the wrong group")
        return _found(ix, "wrong_collective", 11, node, text)
    return None


def _over(ix: FactIndex, members: list[int]) -> str:
    """` over [0, 2] (the dp group of tp=0)`: a call's group, in mesh coordinates where the model
    has a mesh of several dims; empty for an unknown group."""
    if not members:
        return ""
    line = mesh_group_words(members, ix.mesh)
    return f" over {_ranks_text(members)}" + (f" ({line})" if line else "")


def _extra_factor(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """An input the ranks hold scaled by a constant factor the sequential model lacks."""
    for s in _seq_inputs_of(ix, failing):
        for t, lay in rels.get(s, []):
            if _kind(lay) != "scaled" or any(_kind(other) != "scaled" for t2, other in rels.get(s, []) if t2 == t):
                continue
            if not any(_short(n) == _short(failing or "") for n in ix.consumers.get(t, [])):
                continue  # the ranks feed the scaled value to the failing node's counterpart
            p, q = lay[1], lay[2]  # type: ignore[index]
            node, factor_of = _factor_origin(ix, rels, t, (p, q), s)
            where = f" (`{_short(node)}`{_where(ix, node)})" if node else ""
            return _found(ix, "extra_factor", 14, node,
                          f"the ranks multiply `{_name(ix, factor_of)}` by {p}/{q}{where}, a factor the sequential "
                          "model does not have")
    return None


def _scaled_result(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """The failing node's own result held by the ranks scaled by a factor the sequential model
    lacks (FSDP's reduce-scatter with its division left on: every rank's gradient shard is 1/K of
    its piece, so nothing rebuilds the output): named at the collective that averages, where it
    entered through one."""
    for s in ix.out_slot.get(failing or "", {}).values():
        for t, lay in rels.get(s, []):
            if _kind(lay) != "scaled":
                continue
            node, factor_of = _factor_origin(ix, rels, t, (lay[1], lay[2]), s)  # type: ignore[index]
            if node is None or _collective(ix, node) is None or (_attr(ix, node, "reduce_op") or "sum") != "avg":
                continue
            factor = f"{lay[1]}/{lay[2]}"  # type: ignore[index]
            return _averages(ix, node, factor, f"the ranks' results are {factor} of their pieces of `{_name(ix, factor_of)}`; "
                             "a data-parallel reduction of gradients already divided by the global count sums them")
    return None


def _averages(ix: FactIndex, node: str, factor: str, why: str) -> Diagnosis:
    """Class 14 at collective `node`: it averages where it must sum, an extra `factor`."""
    members = ix.group_members.get(ix.coll.get(node, ("", "", 0))[1], [])
    the = f"the {_WORDS.get(_collective(ix, node) or '', 'collective').split(' ', 1)[-1]} {_named(ix, node)}"
    return _found(ix, "wrong_collective", 14, node,
                  f"an extra factor {factor}: {the} averages{_over(ix, members)} where it must sum ({why})")


def _factor_origin(ix: FactIndex, rels: Rels, t: str, factor: tuple[object, object], s: str) -> tuple[str | None, str]:
    """Where a rank's factor entered: the lemmas carry a factor through the ops linear in it
    (rules/scales.lp), so the node making the scaled tensor may only pass it on. Up from `t`'s
    producer, as long as an input of it carries the same factor, to the node whose inputs do not
    (the all-reduce of replicas, the Mul by a constant); with the sequential tensor its output is a
    scale of."""
    scaled: dict[str, str] = {}
    for seq, related in rels.items():
        for rank_t, lay in related:
            if _kind(lay) == "scaled" and (lay[1], lay[2]) == factor:  # type: ignore[index]
                scaled.setdefault(rank_t, seq)
    node, seq_of = ix.producer.get(t), s
    for _ in range(64):
        up = next((x for x in ix.in_slot.get(node or "", {}).values() if x in scaled), None)
        if node is None or up is None:
            break
        seq_of, node = scaled[up], ix.producer.get(up)
    return node, seq_of


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
                      f"the reshape moves the sharded axis: each rank reshapes ({_named(ix, rank_node)}) its slice of "
                      f"`{_name(ix, data)}` "
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
            if _root(ix, s) in _ROUTING:  # the routing weights of the first rank's experts
                return _found(ix, "expert_ids", 12, node,
                              f"every rank weights its experts with the same routing columns [{start}:{end}) of "
                              f"{_described(ix, s)}, taken by {_named(ix, node)}: the columns of the first rank's "
                              "experts; local expert ids are used where the routing weights need global ones "
                              "(or the reverse)")
            text = (f"every rank takes the same slice of `{_name(ix, s)}` instead of its own: the {ix.op[node]} "
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
    """A rank node next to the failing one (or making the input of a collective near it) that
    multiplies (or divides) by a constant, with no counterpart in the sequential model."""
    near = [f"{_graph_of_rank(ix, r.rank)}:{r.node}" for r in failure.rank_nodes]
    upstream = [made for call in failure.collectives for m in call.members if m.input
                for made in [ix.producer.get(f"{_graph_of_rank(ix, m.rank)}:{m.input}")] if made]
    for _ in range(3):  # (a few ops up from the collectives' inputs: a scale before the contraction)
        near += upstream
        upstream = [p for n in upstream for t in ix.inputs.get(n, []) if (p := ix.producer.get(t)) is not None]
    scaled = {t for related in rels.values() for t, lay in related
              if _kind(lay) == "scaled" and lay[1] != lay[2]}  # type: ignore[index]
    for node in dict.fromkeys(near):
        op = ix.op.get(node)
        if op not in ("Mul", "Div") or ix.op.get(f"seq:{_short(node)}") == op:
            continue  # (a scale the sequential model applies too)
        if ix.out_slot.get(node, {}).get(0) not in scaled:
            continue  # (only a factor the relations carry as one: not a rank's own way of computing a value)
        ins = ix.in_slot.get(node, {})
        const = next((t for t in ins.values() if t in ix.consts), None)
        data = next((t for t in ins.values() if t not in ix.consts), None)
        if const is None or data is None:
            continue
        verb = "multiply" if op == "Mul" else "divide"
        value = f"{ix.const_num[const][0]}/{ix.const_num[const][1]}" if const in ix.const_num else "a constant"
        return _found(ix, "extra_factor", 14, node,
                      f"the ranks {verb} `{_name(ix, data)}` by {value} (`{_short(node)}`{_where(ix, node)}), "
                      "a factor the sequential model does not apply")
    return None


# --- training steps: gradients, loss normalisation --------------------------------------------------

GRAD = "grad."  # a training step's gradient outputs: grad.<parameter> (exporters/capture/train.py)


def _output_name(ix: FactIndex, s: str) -> str | None:
    return next((name for t, name in ix.seq_outputs if t == s), None)


def _inputs_behind(ix: FactIndex, t: str, limit: int = 64) -> list[str]:
    """The graph inputs (data, not parameters: no `.` in the name) that rank or seq tensor `t`
    is computed from, nearest first (a count of `labels`)."""
    found: list[str] = []
    todo, seen = [t], set()
    while todo and len(seen) < limit:
        x = todo.pop(0)
        if x in seen:
            continue
        seen.add(x)
        if x in ix.graph_inputs and "." not in _short(x):
            found.append(_short(x))
        todo.extend(ix.inputs.get(ix.producer.get(x, ""), []))
    return found


def _unreduced_gradient(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 4: the gradient of a replicated parameter that the ranks' outputs hold as partial
    sums (each rank's part of the tokens or rows) and that no summing collective completes."""
    kinds = _rank_kinds(rels)
    for s in ix.out_slot.get(failing, {}).values() if failing else []:
        name = _output_name(ix, s)
        if name is None or not name.startswith(GRAD):
            continue
        param = name[len(GRAD):]
        if not any(lay == "rep" for _t, lay in rels.get(f"seq:{param}", [])):
            continue  # (a sharded parameter's gradient: another bug)
        held = {r: t for r, ts in _partial_tensors(ix, rels, s).items() for t in ts if t in ix.rank_outputs}
        if len(held) < 2 or len(held) < ix.world_size:
            continue
        origin = _origin(ix, kinds, held[min(held)])
        if origin and any(_collective(ix, n) in _SUMMING for n in _along_values(ix, ix.out_slot[origin][0], 8)):
            continue
        made = f" ({_named(ix, origin)})" if origin else ""
        return _found(ix, "unreduced_gradient", 4, origin,
                      f"the gradient of `{param}` is a partial sum on every rank: each of {_ranks_text(list(held))} "
                      f"holds only its own part{made} and nothing all-reduces it; a replicated parameter used on "
                      "sharded activations (sequence or context parallelism, a router on the rank's tokens) needs "
                      "its gradient all-reduced (sum) over those ranks")
    return None


def _sum_of_replicas(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 14: a summing collective near the failure over a value every rank already holds
    whole (a replica, or a replica times a constant): the group size times the value (torch's
    functional all_reduce in a training step, whose gradient is another all-reduce of the
    replicated gradient)."""
    whole: dict[str, str] = {}  # rank tensor -> a seq tensor it is (a multiple of) a replica of
    for s, related in rels.items():
        for t, lay in related:
            if lay == "rep" or (_kind(lay) == "scaled" and lay[3] == "rep"):  # type: ignore[index]
                whole.setdefault(t, s)
    near = [f"{_graph_of_rank(ix, m.rank)}:{m.node}" for call in failure.collectives for m in call.members if m.node]
    near += [n for s in _seq_inputs_of(ix, failing) for t, _lay in rels.get(s, []) for n in ix.consumers.get(t, [])]
    near += [ix.producer[t] for s in _seq_inputs_of(ix, failing) for t, _lay in rels.get(s, []) if t in ix.producer]
    for node in dict.fromkeys(near):
        if _collective(ix, node) not in _SUMMING or (_attr(ix, node, "reduce_op") or "sum") != "sum":
            continue
        source = ix.in_slot.get(node, {}).get(0)
        members = ix.group_members.get(ix.coll.get(node, ("", "", 0))[1], [])
        calls = ix.calls.get(ix.coll[node][1:], {})
        if source not in whole or len(members) < 2 or not all(
                ix.in_slot.get(calls.get(_graph_of_rank(ix, r), ""), {}).get(0) in whole for r in members):
            continue
        loc = ix.loc.get(node)
        backward = (" (in a training step, torch's functional all_reduce differentiates to another all-reduce: "
                    "where the forward summed partial sums, its backward must pass the replicated gradient "
                    "through, as an autograd.Function returning it unchanged does)") \
            if loc is not None and "(backward)" in loc.module else ""
        return _found(ix, "sum_of_replicas", 14, node,
                      f"{_WORDS.get(_collective(ix, node) or '', 'a collective')} {_named(ix, node)} sums "
                      f"`{_name(ix, source)}`, which every rank already holds whole, so the result counts it "
                      f"{len(members)} times{backward}")
    return None


def _other_constant(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 14: the ranks multiply (or divide) by another constant than the sequential model does
    at the same node (a scale computed from a rank's local sizes, say)."""
    op = ix.op.get(failing or "")
    if op not in ("Mul", "Div"):
        return None
    ins = ix.in_slot.get(failing, {})  # type: ignore[arg-type]
    consts = [i for i, t in ins.items() if t in ix.const_num]
    if len(consts) != 1 or len(ins) != 2:
        return None
    c = consts[0]
    data, mine = ins[1 - c], Fraction(*ix.const_num[ins[c]])
    for t, _lay in rels.get(data, []):
        for node in ix.consumers.get(t, []):
            theirs = ix.const_num.get(ix.in_slot.get(node, {}).get(c, ""))
            if ix.op.get(node) != op or theirs is None or Fraction(*theirs) == mine or not mine:
                continue
            ratio = Fraction(*theirs) / mine if op == "Mul" else mine / Fraction(*theirs)
            verb = "multiply" if op == "Mul" else "divide"
            return _found(ix, "other_constant", 14, node,
                          f"the ranks {verb} {_described(ix, data)} by {float(Fraction(*theirs)):.6g} "
                          f"({_named(ix, node)}) where the sequential model uses {float(mine):.6g}: an extra factor "
                          f"{float(ratio):.6g} (a scale computed from a rank's local sizes, say)")
    return None


def _local_count(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 10: each rank divides its partial sum (its loss over its own rows or tokens) by its
    own partial count, where the sequential model divides the whole sum by the whole count."""
    if failing is None or ix.op.get(failing) != "Div":
        return None
    num, den = ix.in_slot.get(failing, {}).get(0), ix.in_slot.get(failing, {}).get(1)
    sums = {t for ts in _partial_tensors(ix, rels, num or "").values() for t in ts}
    counts = _partial_tensors(ix, rels, den or "")
    if len({t for ts in counts.values() for t in ts}) < 2 or len(sums) < 2:
        return None  # (the pieces of a rank's rows, or of a micro-batch's: two at least)
    for rank in sorted(counts):
        for d in counts[rank]:
            for node in ix.consumers.get(d, []):
                if ix.op.get(node) != "Div" or ix.in_slot[node].get(1) != d or ix.in_slot[node].get(0) not in sums:
                    continue
                behind = _inputs_behind(ix, d)
                of = f" of `{behind[0]}`" if behind else ""
                return _found(ix, "local_count", 10, node,
                              f"each rank (or micro-batch) divides its own sum (`{_name(ix, num)}`) by its own count{of} "
                              f"(`{_name(ix, den)}`, {_named(ix, node)}): the ranks' shares are means over different "
                              "numbers of items (ignored labels, padding, uneven micro-batches), and averaging or "
                              "adding them is not the mean over the whole batch; divide every rank's sum by the "
                              "global count (its count all-reduced with sum) and sum the shares")
    return None


# --- layouts: fused projections, positions, routing --------------------------------------------------


def _sliced_source(ix: FactIndex, node: str) -> str | None:
    """The tensor a Slice/Split/SequenceAt node cuts its piece from (a SequenceAt's: the
    SplitToSequence's input)."""
    t = ix.in_slot.get(node, {}).get(0)
    producer = ix.producer.get(t or "")
    if producer is not None and ix.op.get(producer) == "SplitToSequence":
        return ix.in_slot.get(producer, {}).get(0)
    return t


def _fused_split(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 6: a fused projection ([Q|K|V], [gate|up]) cut into its parts on every rank from a
    plain shard of the fused axis: a rank's part holds pieces of another part."""
    if failing is None:
        return None
    cuts: dict[tuple[str, int], list[tuple[int, int, str, int]]] = {}  # (source, axis) -> seq parts
    for (n, out), (axis, start, end) in ix.slices.items():
        if ix.node_graph.get(n) == "seq" and (source := _sliced_source(ix, n)) is not None:
            cuts.setdefault((source, axis), []).append((start, end, n, out))
    for (source, axis), parts in sorted(cuts.items(), key=lambda kv: min(ix.topo.get(p[2], 0) for p in kv[1])):
        if len(parts) < 2:
            continue
        for t, lay in rels.get(source, []):
            if _kind(lay) != "sl" or lay[1] != axis:  # type: ignore[index]
                continue
            offset = lay[2]  # type: ignore[index]
            graph = t.split(":", 1)[0]
            for start, end, n, out in sorted(parts):
                rank_node = f"{graph}:{_short(n)}"
                spec = ix.slices.get((rank_node, out))
                if spec is None or spec[0] != axis or _sliced_source(ix, rank_node) != t:
                    continue
                lo, hi = offset + spec[1], offset + spec[2]
                if start <= lo and hi <= end:
                    continue  # (its piece of its own part)
                where = ", ".join(f"[{a}:{b})" for a, b, _n, _o in sorted(parts))
                return _found(ix, "fused_split", 6, rank_node,
                              f"`{_name(ix, source)}` is cut into {len(parts)} parts along axis {axis} ({where}) "
                              f"after a plain shard of that axis: rank {_rank_of(ix, t)} holds "
                              f"[{offset}:{offset + ix.dims.get((t, axis), 0)}) and its part [{spec[1]}:{spec[2]}) "
                              f"({_named(ix, rank_node)}) is [{lo}:{hi}) of the whole, not its piece of [{start}:{end}): "
                              "each rank's parts mix pieces of different parts (q, k and v, say); shard every part on "
                              "its own (an interleaved [q_r|k_r|v_r] layout) or project them separately")
    return None


_ROUTING = {"Softmax", "Sigmoid", "TopK", "LogSoftmax", "ScatterElements", "ScatterND"}  # (a router's weights,
# or the dense routing matrix scattered from the top-k choices)


def _root(ix: FactIndex, t: str) -> str | None:
    """The op that made `t`, looking through views (None for a graph input)."""
    for _ in range(16):
        node = ix.producer.get(t)
        if node is None:
            return None
        if ix.op.get(node) not in _VIEW_OPS:
            return ix.op.get(node)
        t = ix.in_slot.get(node, {}).get(0, "")
    return None


def _same_pieces_everywhere(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Every rank holds the same pieces of a tensor where each needs its own: positions not
    offset by the rank's place in the sequence (class 9), or routing weights of the first rank's
    experts (class 12; expert ids local where global ones are meant, or the reverse)."""
    world = ix.world_size
    for s in _seq_inputs_of(ix, failing):
        held: dict[int, dict[tuple[int, int, int], str]] = {}
        for t, lay in rels.get(s, []):
            if _kind(lay) == "sl":
                held.setdefault(_rank_of(ix, t), {}).setdefault(tuple(lay[1:]), t)  # type: ignore[arg-type,index]
        if sorted(held) != list(range(world)) or world < 2 or len({frozenset(p) for p in held.values()}) != 1:
            continue
        pieces = sorted(held[0])
        axis = pieces[0][0]
        size = ix.dims.get((s, axis), 0)
        if any(p[0] != axis for p in pieces) or sum(b - a for _x, a, b in pieces) * world != size:
            continue
        root = _root(ix, s)
        span = ", ".join(f"[{a}:{b})" for _x, a, b in pieces)
        made = held[0][pieces[0]]
        node = ix.producer.get(made)
        width = sum(b - a for _x, a, b in pieces)
        if root == "Range" or s in ix.consts:
            return _found(ix, "positions_not_offset", 9, node,
                          f"every rank uses positions {span} of {_described(ix, s)} (the first rank's), made by "
                          f"{_named(ix, node) if node else 'its input'}: rank 1 needs [{width}:{2 * width}) of "
                          f"axis {axis}; positions (and masks) must be offset by the rank's start in the sequence")
        if root in _ROUTING:
            return _found(ix, "expert_ids", 12, node,
                          f"every rank weights its experts with the same routing columns {span} of {_described(ix, s)} "
                          f"(the first rank's experts), taken by {_named(ix, node) if node else 'its input'}: rank 1's "
                          f"experts need [{width}:{2 * width}); local expert ids are used where the routing weights "
                          "need global ones (or the reverse)")
    return None


# --- groups and stages ---------------------------------------------------------------------------------


def _call_over_wrong_group(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 11: a reduction near the failure whose members are not the ranks holding the pieces
    its input is one of (diagnosis.py's `fits`: a sum's pieces, a batch chunk's terms)."""
    for call in failure.collectives:
        if not call.fits or not call.members or call.members[0].node is None or call.kind not in _SUMMING:
            continue
        first = call.members[0]
        node = f"{_graph_of_rank(ix, first.rank)}:{first.node}"
        over = _ranks_text(call.group) + (f" ({call.mesh_group})" if call.mesh_group else "")
        holders = _ranks_text(call.fits) + (f" ({call.fits_mesh_group})" if call.fits_mesh_group else "")
        return _found(ix, "wrong_group", 11, node,
                      f"{_WORDS.get(call.kind, call.kind)} {_named(ix, node)} reduces `{_name(ix, first.input) if first.input else '?'}`"
                      f" over {over}, but the pieces it must add are on {holders}: the collective is over the wrong "
                      "group")
    return None


_STAGE_WORK = {"MatMul", "Gemm", "Gather", "Conv", "Einsum"}


def _layer_on_two_stages(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 13: a pipeline stage runs a layer that an earlier stage (one that sends to it) runs
    too: the same module's weighted op in both programs (a wrong stage assignment)."""
    sends = {(m[0], m[1]) for n, (kind, grp, _k) in ix.coll.items() if kind == "Send"
             for m in [ix.group_members.get(grp, [])] if len(m) == 2}
    def layers(rank: int) -> list[str]:  # the modules whose weighted ops a rank runs, in program order
        graph = _graph_of_rank(ix, rank)
        ops = sorted((ix.topo_all.get(n, 0), loc.module) for n, g in ix.node_graph.items()
                     if g == graph and ix.op.get(n) in _STAGE_WORK for loc in [ix.loc.get(n)] if loc and loc.module)
        return list(dict.fromkeys(module for _i, module in ops))

    for first, then in sorted(sends):
        mine, theirs = layers(first), layers(then)
        if not mine or set(mine) == set(theirs):
            continue  # (both run every layer: a ring or context parallelism, not pipeline stages)
        here = {_short(n) for n, g in ix.node_graph.items() if g == _graph_of_rank(ix, first)}
        later = sorted((ix.topo_all.get(n, 0), n) for n, g in ix.node_graph.items() if g == _graph_of_rank(ix, then))
        for _i, node in later:
            name = _short(node)
            if "/" in name and ix.op.get(node) in _STAGE_WORK and name in here and f"seq:{name}" in ix.op:
                loc = ix.loc.get(node)
                module = loc.module if loc is not None and loc.module else name.rsplit("/", 1)[0]
                return _found(ix, "layer_on_two_stages", 13, node,
                              f"`{module}` runs on two pipeline stages: rank {first} runs it and sends on to rank "
                              f"{then}, which runs it again ({_named(ix, node)}); each layer belongs to one stage")
    return None


def _tied_terms_on_two_stages(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 13: a gradient's sum of two terms (a weight used twice: a tied embedding, its lookup
    and the LM head) whose terms are on different pipeline stages, and no collective adds them."""
    if failing is None or ix.op.get(failing) != "Add" or "(backward)" not in _short(failing):
        return None
    ins = [ix.in_slot.get(failing, {}).get(i) for i in (0, 1)]
    holders = [{_rank_of(ix, t) for t, _lay in rels.get(s, [])} if s else set() for s in ins]
    if not all(holders) or holders[0] & holders[1]:
        return None
    first = min(holders[0] | holders[1])
    last = _stage_counterpart(ix, first, holders[1] if first in holders[0] else holders[0])
    words = mesh_group_words([first, last], ix.mesh)
    made = next((ix.producer.get(t) for t, _lay in rels.get(ins[1] or "", []) if _rank_of(ix, t) in holders[1]), None)
    module = failure.location.module if failure.location is not None else _short(failing)
    return _found(ix, "tied_terms_on_two_stages", 13, made,
                  f"the gradient of a weight used on two pipeline stages ({module}) is the sum of two terms, one "
                  f"on {_ranks_text(sorted(holders[0]))} and one on {_ranks_text(sorted(holders[1]))}"
                  + (f" ({_named(ix, made)})" if made else "")
                  + f", and nothing adds them: all-reduce the tied weight's gradient over the stages that hold it "
                  f"(ranks {first} and {last}, {words or 'the embedding group'}"
                  + (", and the same at each other position" if ix.mesh and len(holders[0]) > 1 else "") + ")")


def _stage_counterpart(ix: FactIndex, rank: int, others: set[int]) -> int:
    """The rank of `others` (another stage's) at `rank`'s mesh coordinates but along pp: the other
    end of its embedding group. Without a pp dim in the mesh, the highest of `others`."""
    dims = [d for d, _size in ix.mesh]
    if "pp" not in dims:
        return max(others)
    mesh = Mesh(shape=[size for _d, size in ix.mesh], dims=dims)
    mine = mesh.coordinates(rank)
    same = [r for r in sorted(others) if all(c == mine[d] for d, c in mesh.coordinates(r).items() if d != "pp")]
    return same[-1] if same else max(others)


def _micro_batch_order(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """Class 13: a rank concatenates its micro-batches' results out of order (a stage sent, or
    received, the micro-batches in another order than the sequential batch has them): the
    concatenation's inputs are batch chunks whose numbers do not increase."""
    seq_tensors = [*_seq_inputs_of(ix, failing), *ix.out_slot.get(failing or "", {}).values()]
    for s in seq_tensors:
        chunk = {t: int(lay[2]) for t, lay in rels.get(s, []) if _kind(lay) == "chunk"  # type: ignore[index]
                 and isinstance(lay[2], int)}  # type: ignore[index]
        for t in chunk:
            for cat in ix.consumers.get(t, []):
                order = [chunk.get(x) for x in ix.inputs.get(cat, [])] if ix.op.get(cat) == "Concat" else []
                if len(order) < 2 or None in order or order == sorted(order):  # type: ignore[type-var]
                    continue
                first = next(i for i, k in enumerate(order) if k != sorted(order)[i])  # type: ignore[type-var]
                node = _received_from(ix, ix.inputs[cat][first]) or cat
                got = ", ".join(str(k + 1) for k in order)  # type: ignore[operator]
                return _found(ix, "micro_batch_order", 13, node,
                              f"rank {_rank_of(ix, t)} puts its micro-batches' results together in the order {got} "
                              f"({_named(ix, cat)}): micro-batch {order[first] + 1} arrives where micro-batch "  # type: ignore[operator]
                              f"{first + 1} belongs, sent by {_named(ix, node)}; a stage must send (and receive) the "
                              "micro-batches in the batch's order")
    return None


def _received_from(ix: FactIndex, t: str, steps: int = 64) -> str | None:
    """The Send (on the sending rank) of the nearest Recv upstream of rank tensor `t`, or that Recv."""
    todo, seen = [t], set()
    while todo and len(seen) < steps:
        x = todo.pop(0)
        node = ix.producer.get(x)
        if node is None or node in seen:
            continue
        seen.add(node)
        if ix.op.get(node) == "dist.Recv" and node in ix.coll:
            _kind_, group, call = ix.coll[node]
            return next((n for g, n in ix.calls.get((group, call), {}).items() if n != node), node)
        todo.extend(ix.inputs.get(node, []))
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


_SOFTMAX_STEPS = {"Exp", "Softmax", "LogSoftmax", "ReduceMax", "ReduceLogSumExp"}


def _feeds_softmax(ix: FactIndex, node: str, steps: int = 6) -> bool:
    """Whether a rank node's output reaches a softmax's steps (an Exp, a row max) within a few ops:
    a block of attention scores, not any tensor cut on two axes (a mesh's weight gradient)."""
    return any(ix.op.get(n) in _SOFTMAX_STEPS
               for n in _along_values(ix, ix.out_slot.get(node, {}).get(0, ""), steps, set(ix.op.values())))


def stopped_ring(ix: FactIndex, stuck: list[tuple[object, ...]]) -> Diagnosis | None:
    """Where a ring attention's online-softmax merge stops (the first such rank node in rank and
    program order) and what it does there, from rules/ring.lp's ring_stuck(G, M, Why)."""
    known = [(ix.rank_of_graph.get(str(g), 1 << 30), ix.topo_all.get(str(m), 1 << 30), str(m), str(why))
             for g, m, why in stuck if str(why) in _RING_STOPS
             and (str(why) != "block_operand" or _feeds_softmax(ix, str(m)))]
    if not known:
        return None
    rank, _, node, why = min(known)
    bug_class, does = _RING_STOPS[why]
    # (a key block's mask is any block-wise attention's, gathered or passed round a ring; the
    # merge of partial attentions is the ring's)
    what = "attention over key blocks" if why == "block_operand" else "ring attention"
    return _found(ix, f"ring_{why}", bug_class, node, f"{what}: the {ix.op.get(node, '?')} {_named(ix, node)} on "
                  f"rank {rank} {does}, so the ranks' outputs are not softmax(QK^T) V")


_ID_STEPS = {"Clip", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Concat", "Cast", "Max",
             "Min"}  # (what a rank does to ids before a lookup without making them local: clamps, views)


def _global_ids_on_local_rows(ix: FactIndex, rels: Rels, failure: Failure, failing: str | None) -> Diagnosis | None:
    """A rank holding rows [X:Y) of a table (X > 0 on some rank: its own block of experts, of a
    vocabulary) looks them up with the sequential ids themselves, only clamped or reshaped, never
    made local (`ids - X`, `ids % e`): an id of the rank's own block reads another row, and the
    ids of other blocks are clamped onto its rows."""
    if failing is None or ix.op.get(failing) != "Gather" or len(ix.inputs.get(failing, [])) < 2:
        return None
    table, ids = ix.inputs[failing][0], ix.inputs[failing][1]
    global_ids = {t for s in _upstream(ix, ids, _ID_STEPS) for t, lay in rels.get(s, []) if lay == "rep"}
    for t, lay in rels.get(table, []):
        if _kind(lay) != "sl" or lay[1] != 0 or lay[2] == 0:  # type: ignore[index]
            continue
        for node in ix.consumers.get(t, []):
            index = ix.in_slot.get(node, {}).get(1)
            if ix.op.get(node) != "Gather" or index is None or not set(_upstream(ix, index, _ID_STEPS)) & global_ids:
                continue
            start, end = lay[2], lay[3]  # type: ignore[index]
            return _found(ix, "expert_ids", 12, node,
                          f"rank {_rank_of(ix, t)} holds rows [{start}:{end}) of {_described(ix, table)} and looks "
                          f"them up ({_named(ix, node)}) with the global ids {_described(ix, ids)}, not made local "
                          f"(id - {start}): a global id where a local one belongs")
    return None


_PATTERNS: list[Callable[[FactIndex, Rels, Failure, str | None], Diagnosis | None]] = [
    _replica_before_allreduce, _wrong_combination, _collective_near_failure, _call_over_wrong_group, _unreduced_gradient, _local_count,
    _missing_allreduce, _sum_of_replicas, _extra_factor, _scaled_result, _other_constant, _rank_only_scaling, _fused_split,
    _same_slice_on_every_rank, _same_pieces_everywhere, _reshape_moves_shard, _global_ids_on_local_rows,
    _layer_on_two_stages,
    _micro_batch_order, _tied_terms_on_two_stages,
]
