"""Numeric witnesses for rules/expert_major.lp: torchtitan's AllToAllTokenDispatcher, whose
receiver reorders the exchanged rows expert-major with an index computed from the exchanged
counts (`_permute`), runs the grouped GEMM at offsets from those counts, and scatters the rows
back at the same index (`_unpermute`), as the export writes it (torchtitan_shims.py shim 11,
exporters/capture/ragged.py, exporters/capture/dispatch_ops.py).

W ranks share the tokens (the router replicated); rank r keeps its slice of T / W tokens, counts
its routes per expert from its routing map (`zeros.scatter_(-1, ids, True).sum(0)`), sorts them
by expert id, exchanges the counts (an AllToAll) and the rows (AllToAllV), reorders the received
rank-major rows expert-major, runs its experts, scatters them back, returns them, weights them by
its sorted scores and scatter-adds them at `order // K` into its tokens; the token slices are
all-gathered.  The sequential program is torchtitan's local dispatch (EP 1): every route sorted,
the grouped GEMM at the routing map's offsets, the weighted rows scatter-added at `perm // K`.

Refused twins (a real numeric difference; not verified; whatever is derived holds): the segment
starts taken expert-major where the rank-major ones belong, the segment lengths rank-major, the
unpermute gathering at the index (not scattering), the groups' offsets from the counts the rank
sends; in the training step, the rows' gradient gathered at the index (not scatter-added to it),
the scores' gradient left in sorted order.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import Graph, rep, shard, simulate
from test_lemmas_exchanged_rows import SIZE_KEYS, exchange_sizes
from test_lemmas_owned_rows import flat, floor_div, routed
from test_lemmas_sorted_rows import group_gradient, grouped_swiglu, row_groups
from test_lemmas_structure import In, everyone, iconst, make_case, refused, same, witness

LEMMAS = ("placed_slice_rows", "exchanged_rows", "sorted_received_rows", "expert_major_groups", "sorted_groups",
          "sorted_owned_take", "sorted_group_mask", "placed_unsort_scatter", "returned_rows", "placed_take",
          "placed_token_sum")

BUGS = {
    "starts_expert_major": "each segment's input start taken from the expert-major cumsum, not the rank-major one",
    "lens_rank_major": "the segments' lengths read rank-major (the counts unflipped), not expert-major",
    "unpermute_as_gather": "the expert rows put back by gathering at the index, not scattering to it",
    "offsets_from_sent_counts": "the grouped GEMM's offsets from the counts the rank sends, not those it receives",
}


def routing_map_counts(g: Graph, ids: str, rows: int, topk: int, experts: int) -> str:
    """torchtitan's `zeros_like(scores, dtype=bool).scatter_(-1, ids, True).sum(0)`: each expert's
    number of routes among `rows` tokens' `topk` ids."""
    hit = g.op("ScatterElements", g.const(np.zeros([rows, experts]), np.bool_), ids,
               g.const(np.ones([rows, topk]), np.bool_), axis=-1)
    return g.op("ReduceSum", g.op("Cast", hit, to=TensorProto.INT64), g.ints([0]), keepdims=0)


def exclusive_cumsum(g: Graph, t: str) -> str:
    return g.op("Sub", g.op("CumSum", t, iconst(g, 0)), t)


def expert_major_index(g: Graph, received: str, world: int, e: int, capacity: int, bug: str | None) -> str:
    """torchtitan's `_permute` index at the static size: output row p of segment (l, s) (expert l,
    source s, expert-major) reads input row input_starts[s e + l] + p - output_starts[l W + s]."""
    flat_counts = flat(g, received)
    lens = flat(g, received if bug == "lens_rank_major" else g.op("Transpose", received, perm=[1, 0]))  # expert-major
    starts_in = flat(g, g.op("Transpose", g.op("Reshape", exclusive_cumsum(g, flat_counts), g.ints([world, e])),
                             perm=[1, 0]))
    starts_out = exclusive_cumsum(g, lens)
    if bug == "starts_expert_major":
        starts_in = starts_out
    rows = g.op("Range", iconst(g, 0), iconst(g, capacity), iconst(g, 1))
    passed = g.op("Cast", g.op("LessOrEqual", g.op("Unsqueeze", g.op("CumSum", lens, iconst(g, 0)), g.ints([0])),
                               g.op("Unsqueeze", rows, g.ints([1]))), to=TensorProto.INT64)
    segment = g.op("Clip", g.op("ReduceSum", passed, g.ints([1]), keepdims=0), "", iconst(g, world * e - 1))
    seg_ids = g.op("Gather", g.op("Range", iconst(g, 0), iconst(g, world * e), iconst(g, 1)), segment, axis=0)
    return g.op("Sub", g.op("Add", g.op("Gather", starts_in, seg_ids, axis=0), rows),
                g.op("Gather", starts_out, seg_ids, axis=0))


def experts(g: Graph, x: dict[str, str], rows: str, offsets: str, bins: int, half: int,
            d_out_of=None) -> tuple[str, str | None, str | None]:
    """torchtitan's GroupedExperts: silu(rows @ w1[g]^T) * (rows @ w3[g]^T) @ w2[g]^T, the groups
    at the offsets (the fused w_up holds w1 then w3).  (out, the down weights' gradient, the rows'
    gradient): with `d_out_of(out)` the upstream gradient of out, its backward as autograd writes
    the grouped GEMM's (exporters/capture/dispatch_ops.py)."""
    group = row_groups(g, offsets, int(x["_rows"]))
    # (torchtitan runs the GEMMs on `x_RD.bfloat16()`: a cast, which keeps a row's values but not
    # the zero of a row past the received ones; a float64 round trip here, exact on the numbers)
    rows = g.op("Cast", g.op("Cast", rows, to=TensorProto.DOUBLE), to=TensorProto.FLOAT)
    out, act, backward = grouped_swiglu(g, x, rows, group, bins, half)
    if d_out_of is None:
        return out, None, None
    d_out = d_out_of(out)
    d_w_down = group_gradient(g, d_out, act, group, bins)  # (torch's: the upstream transposed, the act rows per group)
    return out, d_w_down, backward(d_out)


def gather_tokens(g: Graph, grad: str, order: str, topk: int, hidden: int, routes: int) -> str:
    """The backward of scatter_tokens: `grad.gather(0, (order // K)[:, None].expand(-1, D))`."""
    index = g.op("Expand", g.op("Unsqueeze", floor_div(g, order, topk), g.ints([1])), g.ints([routes, hidden]))
    return g.op("GatherElements", grad, index, axis=0)


def scatter_tokens(g: Graph, rows: str, order: str, topk: int, tokens: int, hidden: int, routes: int) -> str:
    """`zeros(T, D).scatter_add_(0, (order // K)[:, None].expand(-1, D), rows)`."""
    index = g.op("Expand", g.op("Unsqueeze", floor_div(g, order, topk), g.ints([1])), g.ints([routes, hidden]))
    return g.op("ScatterElements", g.const(np.zeros([tokens, hidden])), index, rows, axis=0, reduction="add")


def expert_major_case(name: str, world: int, seed: int, bug: str | None = None, train: bool = False,
                      sequences: int = 1):
    """seq: torchtitan's local dispatch over all E experts; rank r: its AllToAllTokenDispatcher
    (module doc).  With `train`, the backward for an upstream gradient g [T, H] as autograd writes
    it, and the outputs are the routing weights' gradient (flat), each expert's down weights'
    gradient (shard(0)) and the tokens' gradient: the combine's gather at `order // K`, the scores'
    gradient scattered at the order, the return's backward exchange, `_unpermute`'s backward (a
    gather at the index), the grouped GEMMs' backward, `_permute`'s (a scatter-add at the index),
    the dispatch's backward exchange and the tokens' scatter-add at `order // K`.  With
    `sequences` S > 1 the tokens are S sequences and each rank holds each sequence's window
    (sequence parallelism: a blocked window of the routes), its outputs gathered along the
    sequence."""
    z, sizes, inputs = exchange_sizes(name, world, seed, bug, sequences)
    e, topk, hidden, share, tokens, routes, capacity, experts_n = (sizes[k] for k in SIZE_KEYS)
    half = z["half"]
    if bug == "token_uncovered":  # (one token more than the ranks' slices hold)
        tokens += 1
        inputs = {**inputs, "x": In([tokens, hidden], rep()), "logits": In([tokens, experts_n], rep())}
    if train:
        inputs = {**inputs, "g": In([tokens, hidden], rep())}

    def column(g: Graph, t: str) -> str:
        return g.op("Unsqueeze", t, g.ints([1]))

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        weights, ids = routed(g, x, topk)
        held = {}  # (what the backward reads of the forward)
        def per_sequence(t: str, per_token: int) -> str:
            """The sequential t [T per_token, ..] viewed per sequence (torchtitan's out_TD.view(B, -1, D))."""
            rest = [] if per_token else [hidden]
            return t if sequences == 1 else g.op("Reshape", t, g.ints([sequences, -1, *rest]))

        if sequences > 1 and r is None:  # (the tokens as S sequences, viewed flat: torchtitan's x_BLD.view(T, D))
            def flat_tokens(t: str, cols: list[int]) -> str:
                return g.op("Reshape", g.op("Reshape", t, g.ints([sequences, tokens // sequences, *cols])),
                            g.ints([tokens, *cols]))
            x = {**x, "x": flat_tokens(x["x"], [hidden]), **({"g": flat_tokens(x["g"], [hidden])} if train else {})}
            weights, ids = flat_tokens(weights, [topk]), flat_tokens(ids, [topk])

        def weighted_by(scores: str):
            def d_out_of(back: str) -> str:
                held["back"] = back
                return g.op("Mul", held["d_weighted"], column(g, scores))
            return d_out_of

        if r is None:
            counts = routing_map_counts(g, ids, tokens, topk, experts_n)
            _, perm = g.op_n("TopK", flat(g, ids), g.ints([tokens * topk]), outputs=2, axis=-1, largest=0, sorted=1)
            scores = g.op("Gather", flat(g, weights), perm, axis=0)
            rows = g.op("Gather", x["x"], floor_div(g, perm, topk), axis=0)
            if train:
                held["d_weighted"] = gather_tokens(g, x["g"], perm, topk, hidden, tokens * topk)
            out, d_w_down, d_rows = experts(g, {**x, "_rows": tokens * topk}, rows, g.op("CumSum", counts, iconst(g, 0)),
                                            experts_n, half, weighted_by(scores) if train else None)
            if not train:
                return [g.output(per_sequence(scatter_tokens(g, g.op("Mul", out, column(g, scores)), perm, topk, tokens,
                                                             hidden, tokens * topk), 0))]
            d_scores = g.op("ReduceSum", g.op("Mul", held["d_weighted"], out), g.ints([1]), keepdims=0)
            d_w = g.op("ScatterND", g.const(np.zeros([tokens * topk])), column(g, perm), d_scores, reduction="add")
            d_x = g.op("ScatterND", g.const(np.zeros([tokens, hidden])), column(g, floor_div(g, perm, topk)), d_rows,
                       reduction="add")
            return [g.output(t) for t in (per_sequence(d_w, topk), d_w_down, per_sequence(d_x, 0))]

        width = share // sequences  # (each sequence's window on a rank)

        def mine(t: str, cols: list[int]) -> str:
            """This rank's tokens of t [T, *cols]: each sequence's window."""
            if sequences == 1:
                return g.op("Slice", t, g.ints([r * share]), g.ints([(r + 1) * share]), g.ints([0]))
            split = g.op("Reshape", t, g.ints([sequences, world * width, *cols]))
            return g.op("Reshape", g.op("Slice", split, g.ints([r * width]), g.ints([(r + 1) * width]), g.ints([1])),
                        g.ints([share, *cols]))

        def gathered(t: str, per_token: int) -> str:
            """Every rank's rows of t [share * per_token, ..], gathered along the sequence (per
            sequence: [S, L per_token, ..])."""
            if sequences == 1:
                return g.coll("AllGather", t, everyone(world), axis=0)
            rest = [] if per_token else [hidden]
            split = g.op("Reshape", t, g.ints([sequences, width * max(per_token, 1), *rest]))
            return g.coll("AllGather", split, everyone(world), axis=1)

        x_r, ids_r, w_r = mine(x["x"], [hidden]), mine(ids, [topk]), mine(weights, [topk])
        counts = routing_map_counts(g, ids_r, share, topk, experts_n)
        _, order = g.op_n("TopK", flat(g, ids_r), g.ints([routes]), outputs=2, axis=-1, largest=0, sorted=1)
        scores = g.op("Gather", flat(g, w_r), order, axis=0)
        send = g.op("Gather", x_r, floor_div(g, order, topk), axis=0)
        sent = g.op("Reshape", counts, g.ints([world, e]))
        received = g.coll("AllToAll", sent, everyone(world), split_axis=0, concat_axis=0)
        splits_in = g.op("ReduceSum", sent, g.ints([1]), keepdims=0)
        splits_out = g.op("ReduceSum", received, g.ints([1]), keepdims=0)
        recv = g.all_to_all_v(send, splits_in, splits_out, everyone(world), capacity)
        index = expert_major_index(g, received, world, e, capacity, bug)
        rows = g.op("Gather", recv, index, axis=0)
        totals = g.op("ReduceSum", sent if bug == "offsets_from_sent_counts" else received, g.ints([0]), keepdims=0)

        def returned(out: str) -> str:
            if bug == "unpermute_as_gather":
                unpermuted = g.op("Gather", out, index, axis=0)
            else:
                unpermuted = g.op("ScatterND", g.const(np.zeros([capacity, hidden])), column(g, index), out)
            return g.all_to_all_v(unpermuted, splits_out, splits_in, everyone(world), routes)

        def d_out_of(out: str) -> str:  # (the upstream of the experts' rows: back through the return)
            held["back"] = returned(out)
            d_back = g.op("Mul", held["d_weighted"], column(g, scores))
            return g.op("Gather", g.all_to_all_v(d_back, splits_in, splits_out, everyone(world), capacity), index, axis=0)

        if train:
            held["d_weighted"] = gather_tokens(g, mine(x["g"], [hidden]), order, topk, hidden, routes)
        out, d_w_down, d_rows = experts(g, {**x, "_rows": capacity}, rows, g.op("CumSum", totals, iconst(g, 0)), e, half,
                                        d_out_of if train else None)
        if not train:
            y = scatter_tokens(g, g.op("Mul", returned(out), column(g, scores)), order, topk, share, hidden, routes)
            return [g.output(gathered(y, 0))]
        d_scores = g.op("ReduceSum", g.op("Mul", held["d_weighted"], held["back"]), g.ints([1]), keepdims=0)
        d_w = d_scores if bug == "scores_gradient_sorted" else \
            g.op("ScatterND", g.const(np.zeros([routes])), column(g, order), d_scores, reduction="add")
        if bug == "permute_backward_as_gather":
            d_recv = g.op("Gather", d_rows, index, axis=0)
        else:
            d_recv = g.op("ScatterND", g.const(np.zeros([capacity, hidden])), column(g, index), d_rows, reduction="add")
        d_send = g.all_to_all_v(d_recv, splits_out, splits_in, everyone(world), routes)
        d_x = g.op("ScatterND", g.const(np.zeros([share, hidden])), column(g, floor_div(g, order, topk)), d_send,
                   reduction="add")
        return [g.output(gathered(d_w, topk)), g.output(d_w_down), g.output(gathered(d_x, 0))]

    case, seq_outs, rank_outs = make_case(name, world, inputs, body)
    if train:
        case.outputs = {seq_outs[1]: shard(0)}
        return case, seq_outs, rank_outs
    return case, seq_outs[0], [o[0] for o in rank_outs]


@pytest.mark.parametrize("world,seed,sequences", [(2, 0, 1), (2, 1, 1), (3, 0, 1), (4, 2, 1), (2, 0, 2), (3, 1, 2)])
def test_torchtitan_all_to_all_dispatcher(world: int, seed: int, sequences: int) -> None:
    """One sequence (each rank a slice of the routes), or two (each rank each sequence's window)."""
    case, _, _ = expert_major_case("expert_major", world, seed, sequences=sequences)
    witness(case, seed, *LEMMAS)


def refused_where_shown(name: str, world: int, bug: str, train: bool = False, which: int = 0) -> None:
    """Refused on the first seed whose routing shows the twin in output `which` (with few tokens
    a routing may hide it: a permutation that is its own inverse, as many rows sent as received)."""
    for seed in range(16):
        case, ys, outs = expert_major_case(f"{name}_{bug}", world, seed, bug, train=train)
        y, rank_outs = (ys[which], [o[which] for o in outs]) if train else (ys, outs)
        sim = simulate(case, seed)
        if not all(same(sim.ranks[r][t], sim.seq[y]) for r, t in enumerate(rank_outs)):
            refused(case, seed, y, y, rank_outs)
            return
    pytest.fail(f"no seed below 16 shows the twin {bug}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bug", list(BUGS))
def test_torchtitan_dispatcher_bugs_are_refused(world: int, bug: str) -> None:
    refused_where_shown("expert_major", world, bug)


BACKWARD_LEMMAS = ("placed_slice_rows", "placed_take", "exchanged_rows", "sorted_received_rows", "expert_major_groups",
                   "sorted_group_gradient", "placed_unsort_scatter", "returned_rows", "placed_unsorted_slice",
                   "placed_token_sum")
BACKWARD_BUGS = {
    "permute_backward_as_gather": "the rows' gradient put back by gathering at the index, not scatter-adding to it",
    "scores_gradient_sorted": "the scores' gradient left in the sorted order, not scattered back to the routes",
    "token_uncovered": "a token no rank's slice holds: each expert's weight gradient misses its routes",
}
BACKWARD_OUTPUT = {"permute_backward_as_gather": 2, "scores_gradient_sorted": 0, "token_uncovered": 1}


@pytest.mark.parametrize("world,seed,sequences", [(2, 0, 1), (3, 1, 1), (4, 2, 1), (2, 1, 2), (3, 0, 2)])
def test_torchtitan_dispatcher_training_step(world: int, seed: int, sequences: int) -> None:
    case, _, _ = expert_major_case("expert_major_train", world, seed, train=True, sequences=sequences)
    witness(case, seed, *BACKWARD_LEMMAS)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bug", list(BACKWARD_BUGS))
def test_torchtitan_dispatcher_backward_bugs_are_refused(world: int, bug: str) -> None:
    refused_where_shown("expert_major_train", world, bug, train=True, which=BACKWARD_OUTPUT[bug])
