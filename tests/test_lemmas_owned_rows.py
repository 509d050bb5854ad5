"""Numeric witnesses for expert parallelism without token movement (HF's AllReduceEP with its
`batched_mm` experts; rules/owned_rows.lp and the expert-id value lemmas of rules/values.lp),
each with refused twins.

Rank r of W holds experts [r*e, (r+1)*e) of E = W*e (the stacked weights sharded on axis 0).
Every rank routes every token (the router's TopK over E logits, a replica), and as HF writes it:

    off    = (ids // e) != r            the float floor-divide torch exports, then Equal and Not
    local  = where(off, e, ids % e)     the sentinel e for a foreign route
    w      = where(off, 0, weights)
    idx    = clip(local, 0, e - 1)      batched_mm's clamp;  sentinel = local >= e
    rows   = (W_up[idx] @ x) -> act -> (W_down[idx] @ .)      one expert per routed row
    out    = sum over the top-k slots of rows * where(sentinel, 0, w), all-reduced

- `value_block`, `value_window_mod`, `value_window_clip`, `value_window_compare`: the ownership
  indicator and the local ids from the ids' values;
- `owned_take`, `owned_elementwise`, `owned_matmul`, `owned_rows_moved` (the gate/up slices),
  `owned_times_masked`, `owned_rows_again`, `owned_piece`: the rows through the experts and the
  masked combine, all-reduced into the sequential output;
- the backward's pieces (`owned_negated`, transposes, row reductions, a concat, masked products,
  a clamp's backward `owned_where_masked`, two masked terms summed `owned_sum_masked`, the weight gradient's ScatterND at the local ids:
  `scatter_owned`).

Refused (a real numeric difference; not verified; whatever is derived holds): the global id where
the local one is needed, the next rank's block, the weights not masked, the clamp one row short,
the remainder taken by the wrong block size, the all-reduce missing.
"""

from __future__ import annotations


import numpy as np
import pytest
from onnx import TensorProto

from harness import Graph, rep, world_seed_grid
from test_lemmas_structure import In, everyone, iconst, make_case, refused, rng_for, shard, size, witness

FORWARD_LEMMAS = ("value_block", "value_window_mod", "value_window_clip", "value_window_compare", "owned_take",
                  "owned_elementwise", "owned_matmul", "owned_rows_moved", "owned_times_masked", "owned_rows_again",
                  "owned_piece", "allreduce_sum")


def routed(g: Graph, x: dict[str, str], topk: int) -> tuple[str, str]:
    """(weights [T, k], ids [T, k]): the router's top-k of its logits; with `_argmax`, k arg-maxes
    concatenated, each over the logits shifted by a constant (PhiMoE's sparsemixer picks so)."""
    if not x.get("_argmax"):
        values, ids = g.op_n("TopK", x["logits"], g.ints([topk]), outputs=2, axis=-1)
        return g.op("Softmax", values, axis=-1), ids
    picks = [g.op("ArgMax", g.op("Add", x["logits"], g.const(float(k))), axis=-1, keepdims=1) for k in range(topk)]
    ids = picks[0] if topk == 1 else g.op("Concat", *picks, axis=-1)
    weights = g.op("GatherElements", g.op("Softmax", x["logits"], axis=-1), ids, axis=-1)
    return weights, ids


def floor_div(g: Graph, ids: str, by: int) -> str:
    """ids // by as torch exports it on integers: floor(float(ids) / float(by)), cast back."""
    quotient = g.op("Div", g.op("Cast", ids, to=TensorProto.FLOAT), g.const(float(by)))
    return g.op("Cast", g.op("Floor", quotient), to=TensorProto.INT64)


def flat(g: Graph, t: str) -> str:
    return g.op("Reshape", t, g.ints([-1]))


def expert_rows(g: Graph, x: dict[str, str], idx: str, topk: int) -> tuple[str, str, str]:
    """(up rows before the act, act rows, down rows): each routed row through the expert at idx
    (batched_mm: the weights gathered per row, one batched product, the fused gate/up split)."""
    tokens, hidden = x["_shape"]
    xs = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", x["x"], g.ints([1])), g.ints([tokens, topk, hidden])),
              g.ints([tokens * topk, hidden]))
    up = g.op("Squeeze", g.op("MatMul", g.op("Gather", x["w_up"], idx, axis=0), g.op("Unsqueeze", xs, g.ints([-1]))),
              g.ints([-1]))
    half = x["_half"]
    if x.get("_interleaved"):  # gpt-oss: gate_up[..., ::2], gate_up[..., 1::2]
        gate = g.op("Slice", up, g.ints([0]), g.ints([2 * half]), g.ints([1]), g.ints([2]))
        lin = g.op("Slice", up, g.ints([1]), g.ints([2 * half]), g.ints([1]), g.ints([2]))
    else:
        gate = g.op("Slice", up, g.ints([0]), g.ints([half]), g.ints([1]))
        lin = g.op("Slice", up, g.ints([half]), g.ints([2 * half]), g.ints([1]))
    if x.get("_interleaved"):  # gpt-oss: gate.clamp(max=limit), its optional min left out
        gate = g.op("Clip", gate, "", g.const(0.5))
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), lin)
    down = g.op("Squeeze", g.op("MatMul", g.op("Gather", x["w_down"], idx, axis=0), g.op("Unsqueeze", act, g.ints([-1]))),
                g.ints([-1]))
    if x.get("_interleaved"):  # a norm of each expert's output (muse_spark's post_expert_norm): x / rms(x)
        mean_square = g.op("ReduceMean", g.op("Mul", down, down), g.ints([-1]), keepdims=1)
        down = g.op("Mul", down, g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean_square, g.const(1e-6)))))
    return up, act, down


def combine(g: Graph, down: str, weights: str, tokens: int, topk: int, hidden: int) -> str:
    weighted = g.op("Mul", down, g.op("Unsqueeze", weights, g.ints([-1])))
    return g.op("ReduceSum", g.op("Reshape", weighted, g.ints([tokens, topk, hidden])), g.ints([1]), keepdims=0)


def hf_dispatch(g: Graph, ids: str, weights: str, r: int, e: int, world: int, bug: str | None = None) -> tuple[str, str]:
    """(local ids clamped into the rank's rows, flat weights masked to the owned routes): HF's
    AllReduceEP then batched_mm; `bug` one of BUGS."""
    block = e + 1 if bug == "wrong_block" else e
    mine = (r + 1) % world if bug == "next_rank_block" else r
    off = g.op("Not", g.op("Equal", floor_div(g, ids, block), iconst(g, mine)))
    local = g.op("Where", off, iconst(g, e), g.op("Mod", ids, iconst(g, block)))
    masked = weights if bug == "weights_not_masked" else g.op("Where", off, g.const(0.0), weights)
    local_flat = flat(g, ids if bug == "global_ids" else local)
    sentinel = g.op("GreaterOrEqual", local_flat, iconst(g, e))
    idx = g.op("Clip", local_flat, iconst(g, 0), iconst(g, e - 2 if bug == "clip_short" else e - 1))
    w = flat(g, masked)
    return idx, (w if bug == "weights_not_masked" else g.op("Where", sentinel, g.const(0.0), w))


BUGS = {
    "global_ids": "the router's global id indexes the rank's local weights (clamped into them)",
    "next_rank_block": "the ownership test and the local ids of the next rank's block",
    "weights_not_masked": "a foreign route's weight kept: it adds a local expert's row",
    "clip_short": "the clamp one row short: the last local expert's routes read the one before",
    "wrong_block": "ids // (e + 1) and ids % (e + 1): the block size off by one",
}


def moe_sizes(name: str, world: int, seed: int, least_experts: int = 1) -> dict[str, int]:
    rng = rng_for(name, world, seed)
    e = size(rng, least_experts, 3)
    return {"e": e, "topk": min(size(rng, 1, 2), world * e), "tokens": size(rng, 3, 6), "hidden": size(rng, 2, 4),
            "half": size(rng, 2, 3)}


def moe_inputs(z: dict[str, int], world: int) -> dict[str, In]:
    experts = world * z["e"]
    return {"x": In([z["tokens"], z["hidden"]], rep()), "logits": In([z["tokens"], experts], rep()),
            "w_up": In([experts, 2 * z["half"], z["hidden"]], shard(0)),
            "w_down": In([experts, z["hidden"], z["half"]], shard(0))}


def moe_case(name: str, world: int, seed: int, bug: str | None = None, reduce: bool = True, interleaved: bool = False,
             argmax: bool = False):
    """seq: the experts on every routed row; rank r: HF's AllReduceEP + batched_mm over its experts
    (`interleaved`: the fused gate/up split by strided slices, as gpt-oss does, and each expert's
    output normalised, as muse_spark does; `argmax`: the
    experts picked by arg-maxes, as PhiMoE does)."""
    z = moe_sizes(name, world, seed, 2 if bug == "clip_short" else 1)
    tokens, topk, hidden = z["tokens"], z["topk"], z["hidden"]

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        x = {**x, "_shape": (tokens, hidden), "_half": z["half"], "_interleaved": interleaved, "_argmax": argmax}
        weights, ids = routed(g, x, topk)
        if r is None:
            _, _, down = expert_rows(g, x, flat(g, ids), topk)
            return g.output(combine(g, down, flat(g, weights), tokens, topk, hidden))
        idx, w = hf_dispatch(g, ids, weights, r, z["e"], world, bug)
        _, _, down = expert_rows(g, x, idx, topk)
        out = combine(g, down, w, tokens, topk, hidden)
        return g.output(g.coll("AllReduce", out, everyone(world)) if reduce else out)

    return make_case(name, world, moe_inputs(z, world), body)


@pytest.mark.parametrize("world,seed", world_seed_grid())
@pytest.mark.parametrize("interleaved,argmax", [(False, False), (True, False), (False, True)],
                         ids=["halves", "interleaved", "argmax"])
def test_hf_all_reduce_ep_batched_mm(world: int, seed: int, interleaved: bool, argmax: bool) -> None:
    case, _, _ = moe_case(f"owned_rows_forward_{interleaved}_{argmax}", world, seed, interleaved=interleaved,
                          argmax=argmax)
    witness(case, seed, *FORWARD_LEMMAS)


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
@pytest.mark.parametrize("bug", list(BUGS))
def test_hf_all_reduce_ep_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    case, y, outs = moe_case(f"owned_rows_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_without_the_all_reduce_each_rank_holds_a_piece(world: int, seed: int) -> None:
    """Without the all-reduce each rank's masked sum is its piece of the output (the output is
    the sum of the ranks' outputs, a decomposition refine.json's outputs allow), never a replica."""
    case, y, _ = moe_case("owned_rows_no_reduce", world, seed, reduce=False)
    out = witness(case, seed, "owned_piece")
    kinds = {lay if isinstance(lay, str) else lay[0] for _, lay in out.relations_of(y)}
    assert "psum" in kinds and "rep" not in kinds, kinds


BACKWARD_LEMMAS = ("owned_times_masked", "owned_rows_moved", "owned_matmul", "owned_negated", "owned_rows_again",
                   "owned_where_masked", "owned_sum_masked", "owned_piece", "scatter_owned", "allreduce_sum")


def moe_backward_case(name: str, world: int, seed: int):
    """The backward of the experts as autograd writes it for batched_mm, upstream gradient g [T, H]:
    the down weights' gradient (per-row outer products scattered, add, into zeros at the local
    ids: each rank its own experts' rows), the routing weights' gradient (negated: a softmax's
    backward starts so), and the input's gradient through the fused gate/up (a concat along the
    rows), the last two all-reduced."""
    z = moe_sizes(name, world, seed)
    tokens, topk, hidden, half, e = z["tokens"], z["topk"], z["hidden"], z["half"], z["e"]
    inputs = {**moe_inputs(z, world), "g": In([tokens, hidden], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        x = {**x, "_shape": (tokens, hidden), "_half": half}
        weights, ids = routed(g, x, topk)
        idx, w = (flat(g, ids), flat(g, weights)) if r is None else hf_dispatch(g, ids, weights, r, e, world)
        up, act, down = expert_rows(g, x, idx, topk)
        rows = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", x["g"], g.ints([1])), g.ints([tokens, topk, hidden])),
                    g.ints([tokens * topk, hidden]))
        gm = g.op("Mul", rows, g.op("Unsqueeze", w, g.ints([-1])))
        w_down_t = g.op("Transpose", g.op("Gather", x["w_down"], idx, axis=0), perm=[0, 2, 1])
        d_act = g.op("Squeeze", g.op("MatMul", w_down_t, g.op("Unsqueeze", gm, g.ints([-1]))), g.ints([-1]))
        # a clamp's backward (gpt-oss's gate.clamp(max=limit)): the gradient where the gate passes, else 0
        d_act = g.op("Where", g.op("Less", g.op("Slice", up, g.ints([0]), g.ints([half]), g.ints([1])), g.const(0.3)),
                     d_act, g.const(0.0))
        outer = g.op("MatMul", g.op("Unsqueeze", gm, g.ints([-1])), g.op("Unsqueeze", act, g.ints([1])))
        zeros = g.const(np.zeros([e if r is not None else world * e, hidden, half], np.float32))
        d_w_down = g.op("ScatterND", zeros, g.op("Unsqueeze", idx, g.ints([-1])), outer, reduction="add")
        d_w = g.op("ReduceSum", g.op("Mul", rows, down), g.ints([1]), keepdims=0)
        if r is not None:
            sentinel = g.op("GreaterOrEqual", flat(g, g.op("Where", g.op("Not", g.op("Equal", floor_div(g, ids, e),
                                                                                     iconst(g, r))),
                                                             iconst(g, e), g.op("Mod", ids, iconst(g, e)))),
                            iconst(g, e))
            d_w = g.op("Where", sentinel, g.const(0.0), d_w)
        d_w = g.op("Neg", d_w)
        gate = g.op("Slice", up, g.ints([0]), g.ints([half]), g.ints([1]))
        d_gate = g.op("Add", g.op("Mul", d_act, gate), g.op("Mul", d_act, act))  # (two masked terms summed)
        d_up = g.op("Concat", d_gate, g.op("Mul", d_act, act), axis=1)
        w_up_t = g.op("Transpose", g.op("Gather", x["w_up"], idx, axis=0), perm=[0, 2, 1])
        d_x = g.op("Squeeze", g.op("MatMul", w_up_t, g.op("Unsqueeze", d_up, g.ints([-1]))), g.ints([-1]))
        d_x = g.op("ReduceSum", g.op("Reshape", d_x, g.ints([tokens, topk, hidden])), g.ints([1]), keepdims=0)
        if r is not None:
            d_w, d_x = (g.coll("AllReduce", t, everyone(world)) for t in (d_w, d_x))
        return [g.output(t) for t in (d_w_down, d_w, d_x)]

    case, seq_outs, rank_outs = make_case(name, world, inputs, body)
    case.outputs = {seq_outs[0]: shard(0)}
    return case, seq_outs, rank_outs


@pytest.mark.parametrize("world,seed", world_seed_grid())
def test_hf_all_reduce_ep_backward(world: int, seed: int) -> None:
    case, _, _ = moe_backward_case("owned_rows_backward", world, seed)
    witness(case, seed, *BACKWARD_LEMMAS)
