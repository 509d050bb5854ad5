"""Numeric witnesses for routed rows moved between ranks by a ragged all-to-all (rules/
exchanged_rows.lp): HF's AllToAllEP with its batched_mm experts, as the export writes it
(exporters/capture/ragged.py), each with refused twins.

W ranks share the batch (the router replicated); rank r keeps its slice of T / W tokens, sorts its
N = T K / W routes by expert id, counts them per expert, exchanges the counts (an AllToAll), sends
each expert block to its owner (AllToAllV), runs the received rows through its experts as top-1
with the expert ids a repeat_interleave of the received counts, sends the rows back with the
counts swapped, puts them back in route order, weights and sums them per token and all-gathers
the tokens.  The sequential program runs HF's batched_mm experts on every route.

Refused (a real numeric difference; not verified; whatever is derived holds): the rows put back
at the forward order (a gather where the scatter belongs), the expert ids from the counts the rank
sends instead of those it receives, global block indices where local expert ids belong.

The training step's backward, as autograd writes it: the upstream gradient into the sorted slice
(a gather at the order), the exchanges with their counts swapped, each expert's weight gradient a
scatter-add at the received local ids, the tokens' gradient a scatter-add at order // K; refused:
the tokens' gradient scattered at the order itself (each row at its route, not its token), the
weight gradient scattered at the block indices.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import Graph, rep, shard, world_seed_grid
from test_lemmas_owned_rows import combine, expert_rows, flat, floor_div, moe_sizes, routed
from test_lemmas_structure import In, everyone, iconst, make_case, refused, witness

LEMMAS = ("sorted_slice_rows", "exchanged_rows", "received_ids", "sorted_window_clip", "sorted_owned_take",
          "owned_matmul", "owned_elementwise", "owned_times_indicator", "returned_rows", "unsorted_slice")

BUGS = {
    "combine_at_forward_order": "the returned rows gathered at the sort's order, not scattered back by it",
    "ids_from_sent_counts": "the expert ids repeated by the counts the rank sends, not those it receives",
    "global_block_ids": "each received row's block index (sender, expert) where its local expert id belongs",
}


def stacked_sizes(g: Graph, sent: str, received: str, world: int) -> tuple[str, str]:
    """HF's `torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()`: the two rows of the
    stacked row sums (exporters/capture/ragged.py keeps them as tensors)."""
    both = g.op("Reshape", g.op("Concat", g.op("ReduceSum", sent, g.ints([1]), keepdims=0),
                                g.op("ReduceSum", received, g.ints([1]), keepdims=0), axis=0), g.ints([2, world]))
    return tuple(g.op("Squeeze", g.op("Slice", both, g.ints([i]), g.ints([i + 1]), g.ints([0])), g.ints([0]))
                 for i in (0, 1))  # type: ignore[return-value]


def repeated_ids(g: Graph, counts: str, e: int, world: int, capacity: int, tiled: bool = True) -> str:
    """`arange(e).repeat(W).repeat_interleave(counts.flat)` at the static size (ragged.py
    repeated_at_size): each row's block index clipped, then the tiled range at it."""
    ends = g.op("CumSum", g.op("Reshape", counts, g.ints([-1])), iconst(g, 0))
    rows = g.op("Unsqueeze", g.op("Range", iconst(g, 0), iconst(g, capacity), iconst(g, 1)), g.ints([1]))
    passed = g.op("Cast", g.op("LessOrEqual", g.op("Unsqueeze", ends, g.ints([0])), rows), to=TensorProto.INT64)
    block = g.op("Clip", g.op("ReduceSum", passed, g.ints([1]), keepdims=0), "", iconst(g, world * e - 1))
    arange = g.op("Range", iconst(g, 0), iconst(g, e), iconst(g, 1))
    table = g.op("Tile", arange, g.ints([world])) if tiled else g.op("Range", iconst(g, 0), iconst(g, world * e), iconst(g, 1))
    return g.op("Gather", table, block, axis=0)


def dispatch(g: Graph, ids_r: str, rows: str, z: dict[str, int], world: int, bug: str | None = None):
    """HF's AllToAllEP dispatch of a rank's flat ids and token rows: (order, the sorted rows sent,
    (send sizes, recv sizes), the received rows, the received local ids)."""
    e, topk, routes, capacity = z["e"], z["topk"], z["routes"], z["capacity"]
    _, order = g.op_n("TopK", ids_r, g.ints([routes]), outputs=2, axis=-1, largest=0, sorted=1)
    send = g.op("Gather", rows, floor_div(g, order, topk), axis=0)
    ones = g.op("Expand", iconst(g, 1), g.ints([routes]))
    hist = g.op("ScatterElements", g.const(np.zeros([world * e]), np.int64), ids_r, ones, axis=0, reduction="add")
    sent = g.op("Reshape", hist, g.ints([world, e]))
    received = g.coll("AllToAll", sent, everyone(world), split_axis=0, concat_axis=0)
    sizes = stacked_sizes(g, sent, received, world)
    recv = g.all_to_all_v(send, *sizes, everyone(world), capacity)
    local = repeated_ids(g, sent if bug == "ids_from_sent_counts" else received, e, world, capacity,
                         tiled=bug not in ("global_block_ids", "gradient_at_block_ids"))
    return order, sizes, recv, local


SIZE_KEYS = ("e", "topk", "hidden", "share", "tokens", "routes", "capacity", "experts")


def exchange_sizes(name: str, world: int, seed: int, bug: str | None,
                   sequences: int = 1) -> tuple[dict[str, int], dict[str, int], dict[str, In]]:
    """(moe_sizes, the exchange's sizes, the inputs) of the AllToAllEP cases: W slices of `share`
    tokens (a multiple of `sequences`: each rank's window of each sequence), `routes` routes a
    slice, the receive capacity W routes; two experts a rank for a twin (to tell ids apart)."""
    z = moe_sizes(name, world, seed, 1 if bug is None else 2)
    share = -(-(z["tokens"] // 2 + 1) // sequences) * sequences
    routes = share * z["topk"]
    sizes = {**z, "share": share, "tokens": world * share, "routes": routes, "capacity": world * routes,
             "experts": world * z["e"]}
    tokens, hidden, experts, half = sizes["tokens"], z["hidden"], sizes["experts"], z["half"]
    inputs = {"x": In([tokens, hidden], rep()), "logits": In([tokens, experts], rep()),
              "w_up": In([experts, 2 * half, hidden], shard(0)), "w_down": In([experts, hidden, half], shard(0))}
    return z, sizes, inputs


def combined(g: Graph, out: str, order: str, counts: tuple[str, str], w_r: str, sizes: dict[str, int], world: int,
             bug: str | None) -> str:
    """HF's `_combine_tokens`: the experts' rows sent back (the counts swapped), put back in route
    order (`tok[order] = back`; the twin gathers at the order), weighted and summed per token, and
    the token slices all-gathered."""
    routes, hidden, share, topk = sizes["routes"], sizes["hidden"], sizes["share"], sizes["topk"]
    back = g.all_to_all_v(out, counts[1], counts[0], everyone(world), routes)
    if bug == "combine_at_forward_order":
        tok = g.op("Gather", back, order, axis=0)
    else:
        tok = g.op("ScatterND", g.const(np.zeros([routes, hidden])), g.op("Unsqueeze", order, g.ints([1])), back)
    weighted = g.op("Mul", g.op("Reshape", tok, g.ints([share, topk, hidden])), g.op("Unsqueeze", w_r, g.ints([-1])))
    y = g.op("ReduceSum", weighted, g.ints([1]), keepdims=0)
    return g.coll("AllGather", y, everyone(world), axis=0)


def exchange_case(name: str, world: int, seed: int, bug: str | None = None, biased: bool = False):
    """seq: HF's batched_mm experts on every route; rank r: HF's AllToAllEP dispatch of its token
    slice, batched_mm experts on the received rows (top-1, unit weights masked by the sentinel),
    the combine, the all-gather of the token slices. `biased`: each expert's output bias added
    (gpt-oss's), and the rank's rows then masked by the sentinel (a `where`): the rows past the
    received ones hold a bias there, so no lemma may claim them zero."""
    z, sizes, inputs = exchange_sizes(name, world, seed, bug)
    e, topk, hidden, share, tokens, routes, capacity, experts = (sizes[k] for k in SIZE_KEYS)
    if biased:
        inputs["b_down"] = In([experts, hidden], shard(0))

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        x = {**x, "_shape": (tokens, hidden), "_half": z["half"]}
        weights, ids = routed(g, x, topk)
        if r is None:
            _, _, down = expert_rows(g, x, flat(g, ids), topk)
            if biased:
                down = g.op("Add", down, g.op("Gather", x["b_down"], flat(g, ids), axis=0))
            return g.output(combine(g, down, flat(g, weights), tokens, topk, hidden))

        def mine(t: str) -> str:
            return g.op("Slice", t, g.ints([r * share]), g.ints([(r + 1) * share]), g.ints([0]))

        x_r, ids_r, w_r = mine(x["x"]), flat(g, mine(ids)), mine(weights)
        order, (send_sizes, recv_sizes), rows, local = dispatch(g, ids_r, x_r, sizes, world, bug)
        idx = g.op("Clip", local, iconst(g, 0), iconst(g, e - 1))
        _, _, down = expert_rows(g, {**x, "x": rows, "_shape": (capacity, hidden)}, idx, 1)
        sentinel = g.op("Unsqueeze", g.op("GreaterOrEqual", local, iconst(g, e)), g.ints([1]))
        if biased:
            down = g.op("Where", sentinel, g.const(0.0), g.op("Add", down, g.op("Gather", x["b_down"], idx, axis=0)))
        unit = g.op("Where", sentinel, g.const(0.0), g.op("Expand", g.const(1.0), g.ints([capacity, 1])))
        out = g.op("ReduceSum", g.op("Reshape", g.op("Mul", down, unit), g.ints([capacity, 1, hidden])), g.ints([1]),
                   keepdims=0)
        return g.output(combined(g, out, order, (send_sizes, recv_sizes), w_r, sizes, world, bug))

    return make_case(name, world, inputs, body)


@pytest.mark.parametrize("world,seed", world_seed_grid())
@pytest.mark.parametrize("biased", [False, True], ids=["mixtral", "biased"])
def test_hf_all_to_all_ep_batched_mm(world: int, seed: int, biased: bool) -> None:
    case, _, _ = exchange_case(f"exchanged_rows_{biased}", world, seed, biased=biased)
    witness(case, seed, *LEMMAS)


@pytest.mark.parametrize("world,seed", [(2, 1), (3, 1)])
@pytest.mark.parametrize("bug", list(BUGS))
def test_hf_all_to_all_ep_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, y, outs = exchange_case(f"exchanged_rows_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)


BACKWARD_LEMMAS = ("sorted_slice_take", "exchanged_rows", "window_id_gradient", "returned_rows", "unsorted_token_sum",
                   "owned_times_indicator", "owned_matmul")
BACKWARD_BUGS = {
    "tokens_gradient_at_order": "the tokens' gradient scattered at the order itself, not at order // K",
    "gradient_at_block_ids": "each expert's weight gradient scattered at the received rows' block indices",
}


def expert_backward(g: Graph, xs: str, w_up: str, w_down: str, idx: str, d_down: str, half: int) -> tuple[str, str, str]:
    """The batched_mm experts' backward on rows xs through the experts at idx, upstream d_down: (the
    rows' gradient, each row's up-projection gradient [rows, 2h, H], each row's down-projection
    gradient [rows, H, h]), as autograd writes it (the outer products per row)."""
    w_up_rows, w_down_rows = g.op("Gather", w_up, idx, axis=0), g.op("Gather", w_down, idx, axis=0)
    up = g.op("Squeeze", g.op("MatMul", w_up_rows, g.op("Unsqueeze", xs, g.ints([-1]))), g.ints([-1]))
    gate = g.op("Slice", up, g.ints([0]), g.ints([half]), g.ints([1]))
    lin = g.op("Slice", up, g.ints([half]), g.ints([2 * half]), g.ints([1]))
    sig = g.op("Sigmoid", gate)
    silu = g.op("Mul", gate, sig)
    act = g.op("Mul", silu, lin)
    d_act = g.op("Squeeze", g.op("MatMul", g.op("Transpose", w_down_rows, perm=[0, 2, 1]),
                                 g.op("Unsqueeze", d_down, g.ints([-1]))), g.ints([-1]))
    d_w_down = g.op("MatMul", g.op("Unsqueeze", d_down, g.ints([-1])), g.op("Unsqueeze", act, g.ints([1])))
    d_silu = g.op("Mul", sig, g.op("Add", g.op("Mul", gate, g.op("Sub", g.const(1.0), sig)), g.const(1.0)))
    d_up = g.op("Concat", g.op("Mul", g.op("Mul", d_act, lin), d_silu), g.op("Mul", d_act, silu), axis=1)
    d_xs = g.op("Squeeze", g.op("MatMul", g.op("Transpose", w_up_rows, perm=[0, 2, 1]), g.op("Unsqueeze", d_up, g.ints([-1]))),
                g.ints([-1]))
    d_w_up = g.op("MatMul", g.op("Unsqueeze", d_up, g.ints([-1])), g.op("Unsqueeze", xs, g.ints([1])))
    return d_xs, d_w_up, d_w_down


def route_copies(g: Graph, t: str, tokens: int, topk: int, hidden: int) -> str:
    return g.op("Reshape", g.op("Expand", g.op("Unsqueeze", t, g.ints([1])), g.ints([tokens, topk, hidden])),
                g.ints([tokens * topk, hidden]))


def exchange_backward_case(name: str, world: int, seed: int, bug: str | None = None, top1: bool = False):
    """The backward of exchange_case's experts and combine for an upstream gradient g [T, H]: seq,
    HF's batched_mm experts' backward on every route; rank r, its slice's gradient into sorted
    order, exchanged, the experts' backward on the received rows (each expert's weight gradient at
    the local ids), exchanged back, scattered to the slice's tokens and all-gathered. `top1`: one
    slot a token (HunYuan-MoE's routing), the sequential sum over it written as HF's (`keepdim`,
    then a squeeze): the rank's scatter at `order // 1` puts each row back at its own route."""
    z = moe_sizes(name, world, seed, 1 if bug is None else 2)
    if bug == "tokens_gradient_at_order":  # (two slots a token: a route's index is not its token's)
        z["topk"] = 2
    if top1:
        z["topk"] = 1
    e, topk, hidden, half = z["e"], z["topk"], z["hidden"], z["half"]
    share = z["tokens"] // 2 + 1
    tokens, routes = world * share, share * topk
    capacity, experts = world * routes, world * e
    sizes = {**z, "routes": routes, "capacity": capacity}
    inputs = {"x": In([tokens, hidden], rep()), "logits": In([tokens, experts], rep()), "g": In([tokens, hidden], rep()),
              "w_up": In([experts, 2 * half, hidden], shard(0)), "w_down": In([experts, hidden, half], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        weights, ids = routed(g, x, topk)
        zeros_up, zeros_down = (np.zeros([e if r is not None else experts, *shape]) for shape in
                                ((2 * half, hidden), (hidden, half)))
        if r is None:
            idx = flat(g, ids)
            d_down = g.op("Mul", route_copies(g, x["g"], tokens, topk, hidden), g.op("Unsqueeze", flat(g, weights), g.ints([-1])))
            d_xs, d_w_up, d_w_down = expert_backward(g, route_copies(g, x["x"], tokens, topk, hidden), x["w_up"], x["w_down"],
                                                     idx, d_down, half)
            column = g.op("Unsqueeze", idx, g.ints([-1]))
            d_x = g.op("ReduceSum", g.op("Reshape", d_xs, g.ints([tokens, topk, hidden])), g.ints([1]), keepdims=int(top1))
            if top1:
                d_x = g.op("Squeeze", d_x, g.ints([1]))
            return [g.output(t) for t in (d_x, g.op("ScatterND", g.const(zeros_up), column, d_w_up, reduction="add"),
                                           g.op("ScatterND", g.const(zeros_down), column, d_w_down, reduction="add"))]

        def mine(t: str) -> str:
            return g.op("Slice", t, g.ints([r * share]), g.ints([(r + 1) * share]), g.ints([0]))

        x_r, ids_r, w_r, g_r = mine(x["x"]), flat(g, mine(ids)), mine(weights), mine(x["g"])
        order, (send_sizes, recv_sizes), rows, local = dispatch(g, ids_r, x_r, sizes, world, bug)
        idx = g.op("Clip", local, iconst(g, 0), iconst(g, e - 1))
        unit = g.op("Where", g.op("Unsqueeze", g.op("GreaterOrEqual", local, iconst(g, e)), g.ints([1])), g.const(0.0),
                    g.op("Expand", g.const(1.0), g.ints([capacity, 1])))
        copies = g.op("Expand", g.op("Unsqueeze", g_r, g.ints([1])), g.ints([share, topk, hidden]))
        d_tok = g.op("Reshape", g.op("Mul", copies, g.op("Unsqueeze", w_r, g.ints([-1]))), g.ints([routes, hidden]))
        d_recv = g.all_to_all_v(g.op("Gather", d_tok, order, axis=0), send_sizes, recv_sizes, everyone(world), capacity)
        d_down = g.op("Mul", d_recv, unit)
        xs = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", rows, g.ints([1])), g.ints([capacity, 1, hidden])),
                  g.ints([capacity, hidden]))
        d_xs, d_w_up, d_w_down = expert_backward(g, xs, x["w_up"], x["w_down"], idx, d_down, half)
        d_send = g.all_to_all_v(d_xs, recv_sizes, send_sizes, everyone(world), routes)
        at = order if bug == "tokens_gradient_at_order" else floor_div(g, order, topk)
        d_x_r = g.op("ScatterND", g.const(np.zeros([share if bug is None else routes, hidden])),
                     g.op("Unsqueeze", at, g.ints([1])), d_send, reduction="add")
        if bug == "tokens_gradient_at_order":  # (the rows at their routes: the first tokens' rows kept)
            d_x_r = g.op("Slice", d_x_r, g.ints([0]), g.ints([share]), g.ints([0]))
        column = g.op("Unsqueeze", idx if bug != "gradient_at_block_ids" else local, g.ints([-1]))
        if bug == "gradient_at_block_ids":
            column = g.op("Clip", column, iconst(g, 0), iconst(g, e - 1))
        return [g.output(t) for t in (g.coll("AllGather", d_x_r, everyone(world), axis=0),
                                      g.op("ScatterND", g.const(zeros_up), column, d_w_up, reduction="add"),
                                      g.op("ScatterND", g.const(zeros_down), column, d_w_down, reduction="add"))]

    case, seq_outs, rank_outs = make_case(name, world, inputs, body)
    case.outputs = {seq_outs[1]: shard(0), seq_outs[2]: shard(0)}
    return case, seq_outs, rank_outs


@pytest.mark.parametrize("world,seed", world_seed_grid())
def test_hf_all_to_all_ep_backward(world: int, seed: int) -> None:
    case, _, _ = exchange_backward_case("exchanged_rows_backward", world, seed)
    witness(case, seed, *BACKWARD_LEMMAS)


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_hf_all_to_all_ep_backward_top1(world: int, seed: int) -> None:
    """One slot a token: the tokens' gradient is the returned rows put back at their routes."""
    case, _, _ = exchange_backward_case("exchanged_rows_backward_top1", world, seed, top1=True)
    witness(case, seed, *(lm for lm in BACKWARD_LEMMAS if lm != "unsorted_token_sum"), "unsorted_slice")


@pytest.mark.parametrize("world,seed", [(2, 1), (3, 1)])
@pytest.mark.parametrize("bug", list(BACKWARD_BUGS))
def test_hf_all_to_all_ep_backward_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, ys, outs = exchange_backward_case(f"exchanged_rows_backward_{bug}", world, seed, bug)
    which = 0 if bug == "tokens_gradient_at_order" else 1
    refused(case, seed, ys[which], ys[which], [o[which] for o in outs])


# --- HF's grouped_mm experts on the received rows (HF's default experts) ------------------------------

GROUPED_LEMMAS = ("placed_slice_rows", "exchanged_rows", "received_ids", "received_sort", "sorted_received_rows",
                  "sorted_groups", "sorted_owned_take", "owned_matmul", "placed_unsort", "returned_rows",
                  "placed_slice", "placed_weighted")


def exchange_grouped_case(name: str, world: int, seed: int, bug: str | None = None):
    """seq: HF's grouped_mm experts on every route (the routes sorted by global id, the rows
    gathered at `perm // K`, weighted in sorted order, put back by the inverse); rank r: HF's
    AllToAllEP dispatch of its token slice, HF's grouped_mm experts on the received rows (top-1,
    unit weights: the receiver sorts its received rows again, by local id), the return, the
    combine, the all-gather of the token slices. Nothing on either side is in route order
    before the combine: the rank's rows relate to the sequential sorted rows through the
    sequential sort (pl, srt keys)."""
    from test_lemmas_sorted_rows import grouped_mm_experts

    z, sizes, inputs = exchange_sizes(name, world, seed, bug)
    e, topk, hidden, share, tokens, routes, capacity, experts = (sizes[k] for k in SIZE_KEYS)

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        x = {**x, "_shape": (tokens, hidden)}
        weights, ids = routed(g, x, topk)
        if r is None:
            return g.output(grouped_mm_experts(g, x, flat(g, ids), flat(g, weights), experts, None,
                                               {**z, "tokens": tokens}))

        def mine(t: str) -> str:
            return g.op("Slice", t, g.ints([r * share]), g.ints([(r + 1) * share]), g.ints([0]))

        x_r, ids_r, w_r = mine(x["x"]), flat(g, mine(ids)), mine(weights)
        order, (send_sizes, recv_sizes), rows, local = dispatch(g, ids_r, x_r, sizes, world, bug)
        unit = g.op("Expand", g.const(1.0), g.ints([capacity]))
        out = grouped_mm_experts(g, {**x, "x": rows}, local, unit, e, e, {**z, "tokens": capacity, "topk": 1},
                                 "forward_permutation" if bug == "receiver_forward_permutation" else None)
        return g.output(combined(g, out, order, (send_sizes, recv_sizes), w_r, sizes, world, bug))

    return make_case(name, world, inputs, body)


@pytest.mark.parametrize("world,seed", world_seed_grid())
def test_hf_all_to_all_ep_grouped_mm(world: int, seed: int) -> None:
    case, _, _ = exchange_grouped_case("exchanged_rows_grouped", world, seed)
    witness(case, seed, *GROUPED_LEMMAS)


GROUPED_BUGS = {**BUGS, "receiver_forward_permutation": "the receiver puts its sorted rows back at its sort's "
                                                             "permutation, not its inverse"}


@pytest.mark.parametrize("world,seed", [(2, 1), (3, 0)])
@pytest.mark.parametrize("bug", list(GROUPED_BUGS))
def test_hf_all_to_all_ep_grouped_mm_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, y, outs = exchange_grouped_case(f"exchanged_rows_grouped_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)


GROUPED_BACKWARD_LEMMAS = ("placed_weighted_gradient", "placed_slice_take", "exchanged_rows", "placed_resort",
                           "sorted_group_gradient", "placed_unsort_scatter", "returned_rows", "placed_token_sum",
                           "placed_weight_gradient", "window_id_gradient", "sorted_window_clip")
GROUPED_BACKWARD_BUGS = {
    "resort_at_permutation": "the receiver's upstream gradient scattered at its sort's permutation, not its inverse",
    "tokens_gradient_at_order": "the tokens' gradient scattered at the order itself, not at order // K",
    "bias_gradient_at_received_order_ids": "the biases' gradient scattered at the received ids, not the sorted ones",
}
GROUPED_BUG_OUTPUT = {"resort_at_permutation": 1, "tokens_gradient_at_order": 2, "bias_gradient_at_received_order_ids": 3}


def bias_gradient(g: Graph, ids: str, d_down: str, bins: int, hidden: int) -> str:
    """Each expert's bias gradient: the rows of `d_down` scatter-added at `ids` (gpt-oss's
    `bias[expert_ids_g]` backward)."""
    return g.op("ScatterND", g.const(np.zeros([bins, hidden])), g.op("Unsqueeze", ids, g.ints([-1])),
                d_down, reduction="add")


def exchange_grouped_backward_case(name: str, world: int, seed: int, bug: str | None = None):
    """The backward of exchange_grouped_case for an upstream gradient g [T, H], as autograd writes
    it: seq, HF's grouped_mm experts' backward on every route (the gradient scattered into sorted
    order at the inverse, weighted, the grouped GEMMs' backward, the routing weights' gradient
    back at the permutation, the tokens' gradient a scatter-add at perm // K); rank r, its slice's
    gradient weighted and gathered at the order, exchanged, scattered into the receiver's sorted
    order at its inverse, the grouped GEMMs' backward, scattered back at the receiver's
    permutation, exchanged back and scatter-added at order // K; the routing weights' gradient
    from the forward's returned rows. Outputs: the routing weights' gradient (flat), each expert's
    down weights' gradient (shard(0)), the tokens' gradient, each expert's down bias's gradient
    (gpt-oss: scatter-added at the sorted ids, the rank's clamped into its experts; shard(0))."""
    from test_lemmas_sorted_rows import counts, group_gradient, grouped_swiglu, row_groups

    z = moe_sizes(name, world, seed, 1 if bug is None else 2)
    if bug == "tokens_gradient_at_order":
        z["topk"] = 2
    e, topk, hidden, half = z["e"], z["topk"], z["hidden"], z["half"]
    share = z["tokens"] // 2 + 1
    tokens, routes = world * share, share * topk
    capacity, experts = world * routes, world * e
    sizes = {**z, "routes": routes, "capacity": capacity}
    inputs = {"x": In([tokens, hidden], rep()), "logits": In([tokens, experts], rep()), "g": In([tokens, hidden], rep()),
              "w_up": In([experts, 2 * half, hidden], shard(0)), "w_down": In([experts, hidden, half], shard(0))}

    def experts_backward(g: Graph, x: dict[str, str], rows: str, ids: str, bins: int, n: int, k: int,
                         d_out_sorted) -> tuple[str, str, str, str, str, str, str]:
        """(perm, its inverse, the sorted down rows, each expert's down gradient, the rows'
        gradient in sorted order, d_out in sorted order, the sorted ids) of HF's grouped_mm on `rows` [n, H] at
        `ids` (k routes a row), `d_out_sorted(perm, inverse, down)` the upstream into sorted order."""
        vals, perm = g.op_n("TopK", ids, g.ints([n]), outputs=2, axis=-1, largest=0, sorted=1)
        sorted_rows = g.op("Gather", rows, floor_div(g, perm, k), axis=0)
        group = row_groups(g, g.op("CumSum", g.op("Cast", counts(g, vals, bins), to=TensorProto.INT32), iconst(g, 0)), n)
        down, act, backward = grouped_swiglu(g, x, sorted_rows, group, bins, half)
        inverse = g.op("ScatterND", g.const(np.zeros([n]), np.int64), g.op("Unsqueeze", perm, g.ints([-1])),
                       g.op("Range", iconst(g, 0), iconst(g, n), iconst(g, 1)))
        d_down = d_out_sorted(perm, inverse, down)
        d_w_down = group_gradient(g, act, d_down, group, bins)
        return perm, inverse, down, d_w_down, backward(d_down), d_down, vals

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        weights, ids = routed(g, x, topk)
        if r is None:
            upstream = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", x["g"], g.ints([1])),
                                             g.ints([tokens, topk, hidden])), g.ints([tokens * topk, hidden]))
            w_flat = flat(g, weights)
            holder: dict[str, str] = {}

            def into_sorted(perm: str, inverse: str, down: str) -> str:
                sorted_g = g.op("ScatterND", g.const(np.zeros([tokens * topk, hidden])),
                                g.op("Unsqueeze", inverse, g.ints([-1])), upstream, reduction="add")
                holder["d_w"] = g.op("ScatterND", g.const(np.zeros([tokens * topk])), g.op("Unsqueeze", perm, g.ints([-1])),
                                     g.op("ReduceSum", g.op("Mul", sorted_g, down), g.ints([1]), keepdims=0), reduction="add")
                return g.op("Mul", sorted_g, g.op("Unsqueeze", g.op("Gather", w_flat, perm, axis=0), g.ints([1])))

            perm, _, _, d_w_down, d_rows, d_down, vals = experts_backward(g, x, x["x"], flat(g, ids), experts,
                                                                          tokens * topk, topk, into_sorted)
            d_x = g.op("ScatterND", g.const(np.zeros([tokens, hidden])),
                       g.op("Unsqueeze", floor_div(g, perm, topk), g.ints([-1])), d_rows, reduction="add")
            return [g.output(t) for t in (holder["d_w"], d_w_down, d_x, bias_gradient(g, vals, d_down, experts, hidden))]

        def mine(t: str) -> str:
            return g.op("Slice", t, g.ints([r * share]), g.ints([(r + 1) * share]), g.ints([0]))

        x_r, ids_r, w_r, g_r = mine(x["x"]), flat(g, mine(ids)), mine(weights), mine(x["g"])
        order, (send_sizes, recv_sizes), recv, local = dispatch(g, ids_r, x_r, sizes, world)
        copies = g.op("Expand", g.op("Unsqueeze", g_r, g.ints([1])), g.ints([share, topk, hidden]))
        d_tok = g.op("Reshape", g.op("Mul", copies, g.op("Unsqueeze", w_r, g.ints([-1]))), g.ints([routes, hidden]))
        d_recv = g.all_to_all_v(g.op("Gather", d_tok, order, axis=0), send_sizes, recv_sizes, everyone(world), capacity)
        unit = g.op("Expand", g.const(1.0), g.ints([capacity]))
        holder = {}

        def into_received_sorted(perm: str, inverse: str, down: str) -> str:
            at = perm if bug == "resort_at_permutation" else inverse
            holder["out"] = g.op("Gather", g.op("Mul", down, g.op("Unsqueeze", g.op("Gather", unit, perm, axis=0),
                                                                  g.ints([1]))), inverse, axis=0)
            resorted = g.op("ScatterND", g.const(np.zeros([capacity, hidden])), g.op("Unsqueeze", at, g.ints([-1])),
                            d_recv, reduction="add")
            return g.op("Mul", resorted, g.op("Unsqueeze", g.op("Gather", unit, perm, axis=0), g.ints([1])))

        perm, _, _, d_w_down, d_rows, d_down, vals = experts_backward(g, x, recv, local, e, capacity, 1,
                                                                      into_received_sorted)
        ids_at = g.op("Clip", local if bug == "bias_gradient_at_received_order_ids" else vals, "", iconst(g, e - 1))
        d_received = g.op("ScatterND", g.const(np.zeros([capacity, hidden])),
                          g.op("Unsqueeze", floor_div(g, perm, 1), g.ints([-1])), d_rows, reduction="add")
        d_send = g.all_to_all_v(d_received, recv_sizes, send_sizes, everyone(world), routes)
        at = order if bug == "tokens_gradient_at_order" else floor_div(g, order, topk)
        d_x_r = g.op("ScatterND", g.const(np.zeros([share if bug is None else routes, hidden])),
                     g.op("Unsqueeze", at, g.ints([1])), d_send, reduction="add")
        if bug == "tokens_gradient_at_order":
            d_x_r = g.op("Slice", d_x_r, g.ints([0]), g.ints([share]), g.ints([0]))
        # the routing weights' gradient: the forward's returned rows, put back in route order
        back = g.all_to_all_v(holder["out"], recv_sizes, send_sizes, everyone(world), routes)
        tok = g.op("ScatterND", g.const(np.zeros([routes, hidden])), g.op("Unsqueeze", order, g.ints([1])), back)
        g_routes = g.op("Reshape", copies, g.ints([routes, hidden]))
        d_w_r = g.op("ReduceSum", g.op("Mul", g_routes, tok), g.ints([1]), keepdims=0)
        return [g.output(t) for t in (g.coll("AllGather", d_w_r, everyone(world), axis=0), d_w_down,
                                      g.coll("AllGather", d_x_r, everyone(world), axis=0), bias_gradient(g, ids_at, d_down, e, hidden))]

    case, seq_outs, rank_outs = make_case(name, world, inputs, body)
    case.outputs = {seq_outs[1]: shard(0), seq_outs[3]: shard(0)}
    return case, seq_outs, rank_outs


@pytest.mark.parametrize("world,seed", world_seed_grid())
def test_hf_all_to_all_ep_grouped_mm_backward(world: int, seed: int) -> None:
    case, _, _ = exchange_grouped_backward_case("exchanged_rows_grouped_backward", world, seed)
    witness(case, seed, *GROUPED_BACKWARD_LEMMAS)


@pytest.mark.parametrize("world,seed", [(2, 1), (3, 0)])
@pytest.mark.parametrize("bug", list(GROUPED_BACKWARD_BUGS))
def test_hf_all_to_all_ep_grouped_mm_backward_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, ys, outs = exchange_grouped_backward_case(f"exchanged_rows_grouped_backward_{bug}", world, seed, bug)
    which = GROUPED_BUG_OUTPUT[bug]
    refused(case, seed, ys[which], ys[which], [o[which] for o in outs])


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_a_variadic_op_of_one_input_passes_it(op: str) -> None:
    """rules/ranges.lp: Max, Min, Sum and Mean of one input are the input (torch's index lowering
    writes a Max of the indices alone, which the receiver's sort feeds): each side's output holds
    its input's relation (seq_passes, rank_passes), checked on the numbers."""
    world, seed = 2, 0
    inputs = {"x": In([4, 6], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        y = g.op("Neg", g.op(op, x["x"]))
        return g.output(y if r is None else g.coll("AllGather", y, everyone(world), axis=0))

    case, _, _ = make_case(f"variadic_{op}", world, inputs, body)
    witness(case, seed, "seq_passes", "rank_passes")
