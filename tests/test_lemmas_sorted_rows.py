"""Numeric witnesses for routed rows sorted by expert on each side (rules/sorted_rows.lp): HF's
`grouped_mm` experts under expert parallelism (AllReduceEP), each with refused twins.

Rank r of W holds experts [r*e, (r+1)*e) of E = W*e.  Every rank sees every route; the sequential
program sorts the routes by expert id, the rank by its local id (the sentinel e for a foreign
route), and each runs HF's grouped_mm experts as the export writes them:

    vals, perm = sort(ids)                        a full-axis TopK (ascending, stable)
    rows = x[perm // K], w = weights[perm]
    counts = histc(vals, bins=B, min=0, max=B-1)  as torchlib writes it (edges, clipped values)
    offs = cumsum(counts);  group(i) = #{offs <= i}
    rows @ W[min(group, B-1)] * (group < B)       the grouped GEMM (exporters/capture/dispatch_ops.py)
    sentinel rows zeroed (the rank), rows * w, back by the inverse permutation, summed over the
    top-k slots, all-reduced.

Refused (a real numeric difference; not verified; whatever is derived holds): the combine taking
the forward permutation where the inverse belongs, the rank sorting the global ids, the counts
over a range one expert short, the cumulative sum exclusive (each group's end one group early).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from harness import Graph, rep, shard, world_seed_grid
from test_lemmas_owned_rows import flat, floor_div, moe_inputs, moe_sizes, routed
from test_lemmas_structure import In, everyone, iconst, make_case, refused, witness

FORWARD_LEMMAS = ("sort_window", "sort_indices", "sorted_ids_cast", "owned_index", "sorted_take", "owned_rows_again", "sorted_groups",
                  "sorted_group_mask", "sorted_owned_take", "owned_matmul", "owned_elementwise", "owned_times_masked",
                  "owned_of_masked", "unsorted_take", "owned_piece", "allreduce_sum")

BUGS = {
    "forward_permutation": "the combine gathers at the forward permutation, not its inverse",
    "global_ids_sorted": "the rank sorts the global ids, and groups them by its local experts",
    "counts_short": "the counts over [0, B - 2]: the last local expert's routes in no group",
    "offsets_exclusive": "the cumulative sum exclusive: each group's rows one group early",
}


def histc_edges(bins: int) -> np.ndarray:
    """torchlib's edges for histc(min=0, max=bins-1): linspace, the last nudged up."""
    delta = (bins - 1) / bins
    edges = np.array([delta * i for i in range(bins + 1)], dtype=np.float32)
    edges[-1] = np.nextafter(edges[-1], np.float32(np.inf), dtype=np.float32)
    return edges


def counts(g: Graph, vals: str, bins: int) -> str:
    """torch.histc(vals.float(), bins, min=0, max=bins-1) as torchlib writes it."""
    v = g.op("Cast", vals, to=TensorProto.FLOAT)
    inside = g.op("And", g.op("GreaterOrEqual", v, g.const(0.0)), g.op("LessOrEqual", v, g.const(float(bins - 1))))
    clipped = g.op("Where", g.op("And", inside, g.op("Not", g.op("IsNaN", v))), v, g.const(-1.0))
    below = g.op("Cast", g.op("Less", g.op("Unsqueeze", clipped, g.ints([0])),
                              g.op("Unsqueeze", g.const(histc_edges(bins)), g.ints([1]))), to=TensorProto.FLOAT)
    sums = g.op("ReduceSum", below, g.ints([1]), keepdims=0)
    return g.op("Sub", g.op("Slice", sums, g.ints([1]), g.ints([bins + 1]), g.ints([0])),
                g.op("Slice", sums, g.ints([0]), g.ints([bins]), g.ints([0])))


def row_groups(g: Graph, offs: str, routes: int) -> str:
    rows = g.op("Range", iconst(g, 0), iconst(g, routes), iconst(g, 1))
    ends = g.op("Unsqueeze", g.op("Cast", offs, to=TensorProto.INT64), g.ints([0]))
    passed = g.op("LessOrEqual", ends, g.op("Unsqueeze", rows, g.ints([1])))
    return g.op("ReduceSum", g.op("Cast", passed, to=TensorProto.INT64), g.ints([1]), keepdims=0)


def grouped(g: Graph, rows: str, weights: str, group: str, bins: int) -> str:
    """rows @ weights[group]^T, zero past the last group (dispatch_ops._rows_by_groups)."""
    chosen = g.op("Gather", g.op("Transpose", weights, perm=[0, 2, 1]), g.op("Min", group, g.ints([bins - 1])), axis=0)
    product = g.op("Squeeze", g.op("MatMul", g.op("Unsqueeze", rows, g.ints([1])), chosen), g.ints([1]))
    inside = g.op("Cast", g.op("Unsqueeze", g.op("Less", group, g.ints([bins])), g.ints([1])), to=TensorProto.FLOAT)
    return g.op("Mul", product, inside)


def grouped_swiglu(g: Graph, x: dict[str, str], rows: str, group: str, bins: int, half: int):
    """The experts' SwiGLU on grouped rows: silu(rows @ w_gate[g]^T) * (rows @ w_up[g]^T) @ w_down[g]^T
    (the fused w_up holds the gate's then the up's rows).  Returns (out, act, backward), backward(d_out)
    the rows' gradient as autograd writes the grouped GEMMs' (dispatch_ops._rows_by_groups)."""
    up = grouped(g, rows, x["w_up"], group, bins)
    gate = g.op("Slice", up, g.ints([0]), g.ints([half]), g.ints([1]))
    lin = g.op("Slice", up, g.ints([half]), g.ints([2 * half]), g.ints([1]))
    sig = g.op("Sigmoid", gate)
    silu = g.op("Mul", gate, sig)
    act = g.op("Mul", silu, lin)

    def backward(d_out: str) -> str:
        d_act = grouped(g, d_out, g.op("Transpose", x["w_down"], perm=[0, 2, 1]), group, bins)
        d_silu = g.op("Mul", sig, g.op("Add", g.op("Mul", gate, g.op("Sub", g.const(1.0), sig)), g.const(1.0)))
        d_up = g.op("Concat", g.op("Mul", g.op("Mul", d_act, lin), d_silu), g.op("Mul", d_act, silu), axis=1)
        return grouped(g, d_up, g.op("Transpose", x["w_up"], perm=[0, 2, 1]), group, bins)

    return grouped(g, act, x["w_down"], group, bins), act, backward


def grouped_mm_experts(g: Graph, x: dict[str, str], ids: str, weights: str, bins: int, sentinel: int | None,
                       z: dict[str, int], bug: str | None = None) -> str:
    """HF's grouped_mm_experts_forward on flat ids and weights (the rank's: local ids, the foreign
    routes' weights masked; `sentinel` the rank's e, None on the sequential side); with `b_up` in
    `x`, gpt-oss's biases, gathered per row at the sorted ids (the rank's clamped into its
    experts: `expert_ids_g.clamp_(max=e - 1)`)."""
    tokens, topk, hidden, half = z["tokens"], z["topk"], z["hidden"], z["half"]
    routes = tokens * topk
    vals, perm = g.op_n("TopK", ids, g.ints([routes]), outputs=2, axis=-1, largest=0, sorted=1)
    rows = g.op("Gather", x["x"], floor_div(g, perm, topk), axis=0)
    w = g.op("Gather", weights, perm, axis=0)
    hist = counts(g, vals, bins - 1 if bug == "counts_short" else bins)
    if bug == "counts_short":  # (one count fewer: the last group's end repeated)
        hist = g.op("Concat", hist, g.const(np.zeros([1], np.float32)), axis=0)
    offs = g.op("CumSum", g.op("Cast", hist, to=TensorProto.INT32), iconst(g, 0),
                **({"exclusive": 1} if bug == "offsets_exclusive" else {}))
    group = row_groups(g, offs, routes)
    mask = None if sentinel is None else g.op("Unsqueeze", g.op("GreaterOrEqual", vals, iconst(g, sentinel)),
                                               g.ints([1]))

    def masked(t: str) -> str:
        return t if mask is None else g.op("Where", mask, g.const(0.0), t)

    up = grouped(g, masked(rows), x["w_up"], group, bins)
    if "b_up" in x:
        cap = iconst(g, (sentinel or 1) - 1)
        if sentinel is None:
            index = vals
        elif x.get("_clamp_as_where"):  # (a training step's trace: clamp's reference, integers' isnan false)
            never = g.op("Expand", g.const(np.zeros([1]), np.bool_), g.ints([z["tokens"] * z["topk"]]))
            index = g.op("Where", g.op("Or", g.op("LessOrEqual", vals, cap), never), vals, cap)
        else:
            index = g.op("Clip", vals, "", cap)
        up = g.op("Add", up, g.op("Gather", x["b_up"], index, axis=0))
    up = masked(up)
    gate = g.op("Slice", up, g.ints([0]), g.ints([half]), g.ints([1]))
    lin = g.op("Slice", up, g.ints([half]), g.ints([2 * half]), g.ints([1]))
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), lin)
    down = masked(grouped(g, act, x["w_down"], group, bins))
    weighted = g.op("Mul", down, g.op("Unsqueeze", w, g.ints([1])))
    inverse = g.op("ScatterND", g.const(np.zeros([routes]), np.int64), g.op("Unsqueeze", perm, g.ints([-1])),
                   g.op("Range", iconst(g, 0), iconst(g, routes), iconst(g, 1)))
    back = g.op("Gather", weighted, perm if bug == "forward_permutation" else inverse, axis=0)
    return g.op("ReduceSum", g.op("Reshape", back, g.ints([tokens, topk, hidden])), g.ints([1]), keepdims=0)


def group_gradient(g: Graph, rows_a: str, rows_b: str, group: str, bins: int) -> str:
    """out[gr] = rows_a^T (rows_b masked to group gr): each expert's weight gradient as the export
    writes the grouped GEMM's backward (dispatch_ops._groups_of_rows)."""
    member = g.op("Cast", g.op("Equal", g.op("Unsqueeze", g.op("Range", iconst(g, 0), iconst(g, bins), iconst(g, 1)),
                                             g.ints([1])),
                               g.op("Unsqueeze", group, g.ints([0]))), to=TensorProto.FLOAT)
    masked = g.op("Mul", g.op("Unsqueeze", member, g.ints([2])), g.op("Unsqueeze", rows_b, g.ints([0])))
    return g.op("MatMul", g.op("Unsqueeze", g.op("Transpose", rows_a, perm=[1, 0]), g.ints([0])), masked)


def sorted_case(name: str, world: int, seed: int, bug: str | None = None, biases: bool = False,
                clamp_as_where: bool = False):
    """seq: HF's grouped_mm experts over all E experts; rank r: HF's AllReduceEP dispatch (local
    ids, the sentinel e, foreign weights masked), the grouped_mm experts over its e, all-reduced
    (`biases`: gpt-oss's per-expert biases of the up projection; `clamp_as_where`: the rank's clamp
    of its sorted ids as a training step's trace writes it)."""
    z = moe_sizes(name, world, seed, 2 if bug == "counts_short" else 1)
    e, topk = z["e"], z["topk"]

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        x = {**x, "_shape": (z["tokens"], z["hidden"]), "_clamp_as_where": clamp_as_where}
        weights, ids = routed(g, x, topk)
        if r is None:
            return g.output(grouped_mm_experts(g, x, flat(g, ids), flat(g, weights), world * e, None, z))
        off = g.op("Not", g.op("Equal", floor_div(g, ids, e), iconst(g, r)))
        local = g.op("Where", off, iconst(g, e), g.op("Mod", ids, iconst(g, e)))
        masked = g.op("Where", off, g.const(0.0), weights)
        out = grouped_mm_experts(g, x, flat(g, ids if bug == "global_ids_sorted" else local), flat(g, masked), e, e,
                                 z, bug)
        return g.output(g.coll("AllReduce", out, everyone(world)))

    inputs = moe_inputs(z, world)
    if biases:
        inputs["b_up"] = In([world * e, 2 * z["half"]], shard(0))
    return make_case(name, world, inputs, body)


@pytest.mark.parametrize("world,seed", world_seed_grid())
@pytest.mark.parametrize("biases,clamp_as_where", [(False, False), (True, False), (True, True)],
                         ids=["mixtral", "gpt_oss_biases", "gpt_oss_biases_traced_clamp"])
def test_hf_grouped_mm_under_all_reduce_ep(world: int, seed: int, biases: bool, clamp_as_where: bool) -> None:
    case, _, _ = sorted_case(f"sorted_rows_forward_{biases}", world, seed, biases=biases, clamp_as_where=clamp_as_where)
    witness(case, seed, *FORWARD_LEMMAS, *(("sorted_window_clip",) if biases else ()))


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
@pytest.mark.parametrize("bug", list(BUGS))
def test_hf_grouped_mm_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, y, outs = sorted_case(f"sorted_rows_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)


BACKWARD_LEMMAS = ("sorted_scatter", "unsorted_scatter", "owned_scatter_piece", "sorted_group_gradient",
                   "owned_times_masked", "owned_piece", "allreduce_sum")
BACKWARD_BUGS = {
    "gradient_at_forward_permutation": "the upstream gradient scattered at the forward permutation, not its inverse",
    "group_gradient_off_by_one": "each expert's weight gradient from the rows of the next group",
    "gate_gradient_at_up_columns": "gpt-oss: the gate's gradient scattered into the up projection's columns 1, 3, ..",
    "bias_gradient_at_route_order_ids": "gpt-oss: the down bias's gradient scattered at the ids in route order, "
                                        "its rows in sorted order",
}
GPT_OSS_BUGS = ("gate_gradient_at_up_columns", "bias_gradient_at_route_order_ids")
BUG_OUTPUT = {"gradient_at_forward_permutation": 0, "gate_gradient_at_up_columns": 2, "bias_gradient_at_route_order_ids": 3}


def sorted_backward_case(name: str, world: int, seed: int, bug: str | None = None, gpt_oss: bool = False,
                         constant_columns: bool = False):
    """The backward of HF's grouped_mm experts as autograd writes it, upstream gradient g [T, H]:
    into sorted order (a scatter-add at the inverse permutation), the routing weights' gradient
    (back at the permutation), the down weights' gradient per group, the tokens' gradient (a
    scatter-add at perm // K); the rank's all-reduced, the weights' gradient shard(0).  `gpt_oss`:
    the gate is the interleaved [:, ::2] of the up projection, whose gradient a strided slice's
    backward scatters back off the route axis (transpose, ScatterND of the columns, transpose), and
    the down projection's bias, gathered at the sorted ids, has its gradient scattered there
    (shard(0) too); `constant_columns`: those columns a constant index, not a sliced range."""
    z = moe_sizes(name, world, seed)
    tokens, topk, hidden, half, e = z["tokens"], z["topk"], z["hidden"], z["half"], z["e"]
    routes = tokens * topk
    inputs = {**moe_inputs(z, world), "g": In([tokens, hidden], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        weights, ids = routed(g, x, topk)
        bins = world * e if r is None else e
        if r is None:
            local, masked_w = flat(g, ids), flat(g, weights)
        else:
            off = g.op("Not", g.op("Equal", floor_div(g, ids, e), iconst(g, r)))
            local = flat(g, g.op("Where", off, iconst(g, e), g.op("Mod", ids, iconst(g, e))))
            masked_w = flat(g, g.op("Where", off, g.const(0.0), weights))
        vals, perm = g.op_n("TopK", local, g.ints([routes]), outputs=2, axis=-1, largest=0, sorted=1)
        tok = floor_div(g, perm, topk)
        rows, w = g.op("Gather", x["x"], tok, axis=0), g.op("Gather", masked_w, perm, axis=0)
        group = row_groups(g, g.op("CumSum", g.op("Cast", counts(g, vals, bins), to=TensorProto.INT32), iconst(g, 0)),
                           routes)
        mask = None if r is None else g.op("Unsqueeze", g.op("GreaterOrEqual", vals, iconst(g, e)), g.ints([1]))

        def masked(t: str) -> str:
            return t if mask is None else g.op("Where", mask, g.const(0.0), t)

        up = masked(grouped(g, masked(rows), x["w_up"], group, bins))
        act = g.op("Slice", up, g.ints([0]), g.ints([2 * half if gpt_oss else half]), g.ints([1]),
                   *([g.ints([2])] if gpt_oss else []))
        down = masked(grouped(g, act, x["w_down"], group, bins))
        inverse = g.op("ScatterND", g.const(np.zeros([routes]), np.int64), g.op("Unsqueeze", perm, g.ints([-1])),
                       g.op("Range", iconst(g, 0), iconst(g, routes), iconst(g, 1)))
        upstream = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", x["g"], g.ints([1])), g.ints([tokens, topk, hidden])),
                        g.ints([routes, hidden]))
        at = perm if bug == "gradient_at_forward_permutation" else inverse
        sorted_g = g.op("ScatterND", g.const(np.zeros([routes, hidden])), g.op("Unsqueeze", at, g.ints([-1])), upstream,
                        reduction="add")
        d_w = g.op("ScatterND", g.const(np.zeros([routes])), g.op("Unsqueeze", perm, g.ints([-1])),
                   g.op("ReduceSum", g.op("Mul", sorted_g, down), g.ints([1]), keepdims=0), reduction="add")
        d_down = masked(g.op("Mul", sorted_g, g.op("Unsqueeze", w, g.ints([1]))))
        member_group = g.op("Add", group, iconst(g, 1)) if bug == "group_gradient_off_by_one" else group
        d_w_down = group_gradient(g, act, d_down, member_group, bins)
        d_act = masked(grouped(g, d_down, g.op("Transpose", x["w_down"], perm=[0, 2, 1]), group, bins))
        if gpt_oss:  # (the gate's gradient into the up projection's columns 0, 2, ..: a strided slice's backward)
            first = 1 if bug == "gate_gradient_at_up_columns" and r is not None else 0
            if constant_columns:
                columns = g.const(np.arange(first, 2 * half, 2)[:, None], np.int64)
            else:
                columns = g.op("Unsqueeze", g.op("Slice", g.op("Range", iconst(g, 0), iconst(g, 2 * half), iconst(g, 1)),
                                                 g.ints([first]), g.ints([2 * half]), g.ints([0]), g.ints([2])),
                               g.ints([1]))
            d_up = g.op("Transpose", g.op("ScatterND", g.op("Transpose", g.const(np.zeros([routes, 2 * half])), perm=[1, 0]),
                                          columns, g.op("Transpose", d_act, perm=[1, 0])), perm=[1, 0])
            d_rows = grouped(g, d_up, g.op("Transpose", x["w_up"], perm=[0, 2, 1]), group, bins)
        else:
            w_gate_t = g.op("Transpose", g.op("Slice", x["w_up"], g.ints([0]), g.ints([half]), g.ints([1])), perm=[0, 2, 1])
            d_rows = grouped(g, d_act, w_gate_t, group, bins)
        d_x = g.op("ScatterND", g.const(np.zeros([tokens, hidden])), g.op("Unsqueeze", tok, g.ints([-1])), d_rows,
                   reduction="add")
        outs = [d_w, d_w_down, d_x]
        if gpt_oss:  # (the down bias's gradient, at the sorted ids: the rank's clamped into its experts)
            ids_at = vals if r is None else g.op("Clip", local if bug == "bias_gradient_at_route_order_ids" else vals,
                                                 "", iconst(g, e - 1))
            outs.append(g.op("ScatterND", g.const(np.zeros([bins, hidden])), g.op("Unsqueeze", ids_at, g.ints([-1])),
                             d_down, reduction="add"))
        if r is not None:
            d_w = g.op("Where", flat(g, off), g.const(0.0), d_w)
            outs[0], outs[2] = (g.coll("AllReduce", t, everyone(world)) for t in (d_w, d_x))
        return [g.output(t) for t in outs]

    case, seq_outs, rank_outs = make_case(name, world, inputs, body)
    case.outputs = {seq_outs[1]: shard(0), **({seq_outs[3]: shard(0)} if gpt_oss else {})}
    return case, seq_outs, rank_outs


@pytest.mark.parametrize("world,seed", world_seed_grid())
@pytest.mark.parametrize("gpt_oss,constant_columns", [(False, False), (True, False), (True, True)],
                         ids=["mixtral", "gpt_oss", "gpt_oss_constant_columns"])
def test_hf_grouped_mm_backward_under_all_reduce_ep(world: int, seed: int, gpt_oss: bool, constant_columns: bool) -> None:
    case, _, _ = sorted_backward_case(f"sorted_rows_backward_{gpt_oss}_{constant_columns}", world, seed, gpt_oss=gpt_oss,
                                      constant_columns=constant_columns)
    witness(case, seed, *BACKWARD_LEMMAS, *(("window_id_gradient", "owned_rows_moved") if gpt_oss else ()))


@pytest.mark.parametrize("world,seed", [(2, 1), (3, 1)])
@pytest.mark.parametrize("bug", list(BACKWARD_BUGS))
def test_hf_grouped_mm_backward_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, ys, outs = sorted_backward_case(f"sorted_rows_backward_{bug}", world, seed, bug, gpt_oss=bug in GPT_OSS_BUGS)
    which = BUG_OUTPUT.get(bug, 1)
    refused(case, seed, ys[which], ys[which], [o[which] for o in outs])
