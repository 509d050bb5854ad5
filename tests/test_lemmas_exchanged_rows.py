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


def exchange_case(name: str, world: int, seed: int, bug: str | None = None):
    """seq: HF's batched_mm experts on every route; rank r: HF's AllToAllEP dispatch of its token
    slice, batched_mm experts on the received rows (top-1, unit weights masked by the sentinel),
    the combine, the all-gather of the token slices."""
    z = moe_sizes(name, world, seed, 1 if bug is None else 2)  # (a twin needs two experts a rank to tell ids apart)
    e, topk, hidden = z["e"], z["topk"], z["hidden"]
    share = z["tokens"] // 2 + 1
    tokens = world * share
    routes = share * topk
    capacity = world * routes
    experts = world * e
    inputs = {"x": In([tokens, hidden], rep()), "logits": In([tokens, experts], rep()),
              "w_up": In([experts, 2 * z["half"], hidden], shard(0)), "w_down": In([experts, hidden, z["half"]], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        x = {**x, "_shape": (tokens, hidden), "_half": z["half"]}
        weights, ids = routed(g, x, topk)
        if r is None:
            _, _, down = expert_rows(g, x, flat(g, ids), topk)
            return g.output(combine(g, down, flat(g, weights), tokens, topk, hidden))

        def mine(t: str) -> str:
            return g.op("Slice", t, g.ints([r * share]), g.ints([(r + 1) * share]), g.ints([0]))

        x_r, ids_r, w_r = mine(x["x"]), flat(g, mine(ids)), mine(weights)
        _, order = g.op_n("TopK", ids_r, g.ints([routes]), outputs=2, axis=-1, largest=0, sorted=1)
        send = g.op("Gather", x_r, floor_div(g, order, topk), axis=0)
        ones = g.op("Expand", iconst(g, 1), g.ints([routes]))
        hist = g.op("ScatterElements", g.const(np.zeros([experts]), np.int64), ids_r, ones, axis=0, reduction="add")
        sent = g.op("Reshape", hist, g.ints([world, e]))
        received = g.coll("AllToAll", sent, everyone(world), split_axis=0, concat_axis=0)
        send_sizes, recv_sizes = stacked_sizes(g, sent, received, world)
        rows = g.all_to_all_v(send, send_sizes, recv_sizes, everyone(world), capacity)
        local = repeated_ids(g, sent if bug == "ids_from_sent_counts" else received, e, world, capacity,
                             tiled=bug != "global_block_ids")
        idx = g.op("Clip", local, iconst(g, 0), iconst(g, e - 1))
        _, _, down = expert_rows(g, {**x, "x": rows, "_shape": (capacity, hidden)}, idx, 1)
        unit = g.op("Where", g.op("Unsqueeze", g.op("GreaterOrEqual", local, iconst(g, e)), g.ints([1])), g.const(0.0),
                    g.op("Expand", g.const(1.0), g.ints([capacity, 1])))
        out = g.op("ReduceSum", g.op("Reshape", g.op("Mul", down, unit), g.ints([capacity, 1, hidden])), g.ints([1]),
                   keepdims=0)
        back = g.all_to_all_v(out, recv_sizes, send_sizes, everyone(world), routes)
        if bug == "combine_at_forward_order":
            tok = g.op("Gather", back, order, axis=0)
        else:
            tok = g.op("ScatterND", g.const(np.zeros([routes, hidden])), g.op("Unsqueeze", order, g.ints([1])), back)
        weighted = g.op("Mul", g.op("Reshape", tok, g.ints([share, topk, hidden])), g.op("Unsqueeze", w_r, g.ints([-1])))
        y = g.op("ReduceSum", weighted, g.ints([1]), keepdims=0)
        return g.output(g.coll("AllGather", y, everyone(world), axis=0))

    return make_case(name, world, inputs, body)


@pytest.mark.parametrize("world,seed", world_seed_grid())
def test_hf_all_to_all_ep_batched_mm(world: int, seed: int) -> None:
    case, _, _ = exchange_case("exchanged_rows", world, seed)
    witness(case, seed, *LEMMAS)


@pytest.mark.parametrize("world,seed", [(2, 1), (3, 1)])
@pytest.mark.parametrize("bug", list(BUGS))
def test_hf_all_to_all_ep_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, y, outs = exchange_case(f"exchanged_rows_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)
