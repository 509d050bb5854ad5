"""Numeric witnesses for the layout-algebra lemmas of rules/core.lp, elementwise.lp, matmul.lp.

Every lemma name derived in those three files gets at least one positive witness: a small
sequential ONNX program and per-rank programs with random shapes (a seeded numpy rng per
test; world sizes 2, 3 and 4; even shards and uneven `shard(axis, sizes=[..])` shards) built
so that the lemma fires.  Each witness asserts that
  * no derived relation is contradicted by the multi-rank simulator (`checked.ok`),
  * the lemma fired AND was checked numerically (`lemmas_checked`; partial sums are completed
    by an AllReduce so that their pieces tile [0, D)),
  * no sanity violation, and (the programs are complete and correct) the verdict is verified.

Covered: declared (rep, even/uneven shard, partial sum, partial max), full_slice (AllGather,
a rank-side no-op Slice), unit_scale, elementwise (unary, binary both orders, rank-1 bias on a
sharded last axis, size-1 and absent broadcast axes, scalar constant, Where, Clip without min,
all-replicated), partial_linear_unary (Neg, Identity), partial_cast (float->double,
float->float, int64->float, double->float), partial_add_partial (Add, Sub, broadcasting),
partial_mul_rep (both orders, broadcast, constant), partial_div_rep, partial_add_once /
partial_skip_add (Add both orders, Sub), partial_add_share (÷TP, ×1/TP, uneven row-parallel
shares, both orders), partial_max_monotone (7 monotone ops), rank_scale (Mul both orders, Div,
chained, scalar and [1] constants), matmul_rep (incl. equal constant weights),
matmul_column_parallel / matmul_row_slice / matmul_row_parallel (2-D and batched with
broadcasting batch dims), matmul_batch (both sliced, absent / size-1 broadcast batch dims,
either operand sliced, 4-D), matmul_partial (both orders); Gemm (transA x transB x
{replicated, column, row, contraction} x {no C, empty C, replicated / sliced / broadcast C},
and a row-parallel Gemm adding its share of the bias), which lowering rewrites into
Transpose / MatMul / Mul / Add (refine/lowering/canonical.py): those witnesses simulate the rewritten
programs, so the tensors the rewrite adds are checked too.
Partial sources are both declared partials and row-parallel MatMul outputs.

Soundness negatives (the relation must NOT be derived, the simulator shows the program really
computes something else, and the verdict is not `verified`): bias added to a partial on every
rank (BUGS.md class 3, MatMul and Gemm); rank 0 adds the bias once while another rank adds a
share, or rank 0 adds a share while the others skip (styles must not mix); rank 0 computes
T_0 + b but all-reduces T_0 (piece 0 never `skips`); Relu / Exp / Sigmoid of a partial, Neg of
a partial max; partial x partial (Mul and MatMul); Sub with the partial on the right; S1 - S2
with the other ranks passing on pieces of S2; bias ÷ the wrong factor (÷3 at TP=2, ...);
MatMul whose A and B are sliced on different K ranges; column-parallel (MatMul+Add and Gemm)
with the bias sliced on the wrong range; elementwise operands sliced on different ranges;
integer Div (rank_scale and partial_div_rep hold in real arithmetic only: integer Div truncates).
Finally, an inventory test keeps this file in step with the lemma names of the three files.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from harness import (
    SWEEP,
    Graph,
    Outcome,
    Prog,
    bounds,
    in_turn,
    params_in_turn,
    partial,
    rank_shape,
    rep,
    run_case,
    shard,
    simulate,
)
from onnx import TensorProto

from refine.run.engine import builtin_rules_dir

FLOAT, DOUBLE, INT64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64

# (world size, seed, uneven shards): every positive witness runs under each of these (every world
# size, even and uneven shards; uneven at world 2 too under benchmarks/sweep.py).
PARAMS = [(2, 0, False), (3, 1, True), (4, 2, False), *([(2, 3, True)] if SWEEP else [])]
PARAM_IDS = [f"w{w}-s{s}-{'uneven' if u else 'even'}" for w, s, u in PARAMS]
params = pytest.mark.parametrize("world,seed,uneven", PARAMS, ids=PARAM_IDS)


# --------------------------------------------------------------------------------------------
# building programs


def sh(axis: int, sizes: list[int] | None) -> dict:
    return shard(axis, sizes)


# --------------------------------------------------------------------------------------------
# checking


def witness(p: Prog, name: str, lemmas: set[str], verified: bool = True) -> Outcome:
    """Run the case; every lemma in `lemmas` must fire and hold numerically (on the programs as
    lowered: a Gemm's rewrite included)."""
    case = p.case(name, lemmas)
    out = run_case(case, p.seed)  # (simulated as lowered: refine/kit/cases.py simulate_loaded)
    assert out.checked.ok, [vars(v) for v in out.checked.violations]
    missing = lemmas - out.checked.lemmas_checked
    assert not missing, f"{missing} not checked; fired: {sorted(out.lemmas_fired())}"
    assert not out.derived.get("sanity"), out.derived.get("sanity")
    if verified:
        assert out.report.verdict == "verified", out.report.failure
    return out


def layouts_of(out: Outcome, seq_t: str, r: int, rank_t: str) -> list[object]:
    return [lay for s, t, lay in out.derived.get("rel") if s == f"seq:{seq_t}" and t == f"r{r}:{rank_t}"]


def kinds(lays: list[object]) -> set[str]:
    return {lay if isinstance(lay, str) else lay[0] for lay in lays}


def refuted(p: Prog, name: str, seq_out: str, rank_outs: list[str]) -> Outcome:
    """A wrong program: sound relations only, not verified, seq_out not rebuilt from the ranks,
    and the numbers confirm that the ranks' outputs differ from the sequential one."""
    case = p.case(name)
    out = run_case(case, p.seed)
    assert out.checked.ok, [vars(v) for v in out.checked.violations]
    assert not out.derived.get("sanity"), out.derived.get("sanity")
    assert out.report.verdict != "verified"
    for r, t in enumerate(rank_outs):
        assert "rep" not in kinds(layouts_of(out, seq_out, r, t)), (r, t)
    sim = simulate(case, p.seed)
    want = np.asarray(sim.seq[seq_out], dtype=np.float64)
    got = [np.asarray(sim.ranks[r][t], dtype=np.float64) for r, t in enumerate(rank_outs)]
    assert any(g.shape != want.shape or not np.allclose(g, want, rtol=1e-3, atol=1e-3) for g in got), \
        "the 'buggy' program computes the sequential value: not a meaningful negative"
    return out


# --------------------------------------------------------------------------------------------
# partial-sum sources: (seq tensor, one piece per rank), all pieces of one decomposition


def declared_partial(p: Prog, shape: list[int], dtype: int = FLOAT) -> tuple[str, list[str]]:
    x = p.input(shape, partial(), dtype, name="p")
    return x, [x] * p.world


def row_parallel(p: Prog, m: int, n: int, k: tuple[int, list[int] | None], batch: list[int] = ()) -> tuple[str, list[str]]:
    """x @ w with x sharded on K (last axis) and w on K (rows): a `pure` partial, pieces of K."""
    K, sizes = k
    x = p.input([*batch, m, K], sh(len(batch) + 1, sizes), name="x")
    w = p.input([K, n], sh(0, sizes), name="w")
    return p.seq.op("MatMul", x, w), [g.op("MatMul", x, w) for g in p.ranks]


def some_partial(p: Prog, m: int, n: int, how: str) -> tuple[str, list[str]]:
    return declared_partial(p, [m, n]) if how == "declared" else row_parallel(p, m, n, p.split())


SOURCES = pytest.mark.parametrize("how", ["declared", "rowpar"])


# ============================================================================================
# core.lp


@params
def test_declared(world: int, seed: int, uneven: bool) -> None:
    p = Prog(world, seed, uneven)
    a, b = p.dim(), p.dim()
    D, sizes = p.split()
    x = p.input([a, b], rep())
    axis = int(p.rng.integers(0, 2))
    y = p.input([a, D] if axis else [D, b], sh(axis, sizes))
    s = p.input([a, b], partial("sum"))
    mx = p.input([a, b], partial("max"))
    for t in (x, y, s, mx):  # the inputs themselves are the outputs
        p.seq.output(t)
    for g in p.ranks:
        g.output(x)
        p.out_sl(g, y, axis, sizes is None)
        p.out_ps(g, s)
        p.out_ps(g, mx, "max")
    witness(p, "declared", {"declared", "allreduce_sum", "allreduce_max"})


@params
def test_full_slice_allgather(world: int, seed: int, uneven: bool) -> None:
    """AllGather of chunks tiling the axis gives sl(A, 0, D), which is the tensor itself."""
    p = Prog(world, seed, False)  # AllGather needs even chunks
    a, b, c = p.dim(), p.dim(), p.dim()
    D, _ = p.split()
    axis = int(p.rng.integers(0, 3))
    shape = [a, b, c]
    shape[axis] = D
    x = p.input(shape, sh(axis, None))
    p.seq.output(p.seq.op("Tanh", x))
    gathered = []
    for g in p.ranks:
        gathered.append(g.coll("AllGather", x, p.group, axis=axis))
        g.output(g.op("Tanh", gathered[-1]))
    out = witness(p, "full_slice_ag", {"full_slice", "allgather", "elementwise"})
    for r, t in enumerate(gathered):
        assert sorted(map(str, layouts_of(out, x, r, t))) == sorted(["rep", str(("sl", axis, 0, D))])


@params
def test_full_slice_rank_noop_slice(world: int, seed: int, uneven: bool) -> None:
    """A rank-side Slice that cuts nothing is lowered as the full range of axis 0."""
    p = Prog(world, seed, uneven)
    a, b = p.dim(), p.dim()
    x = p.input([a, b], rep())
    p.seq.output(p.seq.op("Sigmoid", x))
    for g in p.ranks:
        t = g.op("Slice", x, g.ints([0]), g.ints([1 << 30]), g.ints([1]))
        g.output(g.op("Sigmoid", t))
    witness(p, "full_slice_noop", {"full_slice", "rank_slice", "elementwise"})


UNIT_SCALES = [(2.0, "Div", 2.0), (0.5, "Mul", 2.0), (3.0, "Mul", 1 / 3), (1.0, None, None), (-4.0, "Div", -4.0)]


@in_turn(PARAMS, **{"c1,op2,c2": UNIT_SCALES})
def test_unit_scale(world: int, seed: int, uneven: bool, c1: float, op2: str | None, c2: float | None) -> None:
    """Scale by c on the rank, undo it: (P/P) * L = L, then a paired op consumes it."""
    p = Prog(world, seed, uneven)
    a = p.dim()
    D, sizes = p.split()
    x = p.input([a, D], sh(1, sizes))
    p.seq.output(p.seq.op("Tanh", x))
    for g in p.ranks:
        t = g.op("Mul", g.const(c1), x)
        if op2:
            t = g.op(op2, t, g.const(c2))
        p.out_sl(g, g.op("Tanh", t), 1, sizes is None)
    witness(p, "unit_scale", {"unit_scale", "rank_scale", "elementwise"})


# ============================================================================================
# elementwise.lp: layouts that commute with every elementwise op


@in_turn(PARAMS, op=["Relu", "Exp", "Neg", "Sqrt", "Abs"])
def test_elementwise_unary_on_shard(world: int, seed: int, uneven: bool, op: str) -> None:
    p = Prog(world, seed, uneven)
    shape = [p.dim(), p.dim(), p.dim()]
    axis = int(p.rng.integers(0, 3))
    shape[axis], sizes = p.split()
    x = p.input(shape, sh(axis, sizes))
    xin = p.seq.op("Abs", x) if op == "Sqrt" else x
    p.seq.output(p.seq.op(op, xin))
    for g in p.ranks:
        gin = g.op("Abs", x) if op == "Sqrt" else x
        p.out_sl(g, g.op(op, gin), axis, sizes is None)
    witness(p, "ew_unary", {"elementwise", "declared"})


@in_turn(PARAMS, order=["x_first", "bias_first"], op=["Add", "Mul", "Sub", "Div", "Max"])
def test_elementwise_bias_on_sharded_last_axis(world: int, seed: int, uneven: bool, order: str, op: str) -> None:
    """x [m, n] sharded on n, a rank-1 bias [n] sharded alike: (x op b)[:, X:Y]."""
    p = Prog(world, seed, uneven)
    m = p.dim()
    n, sizes = p.split()
    x = p.input([m, n], sh(1, sizes))
    b = p.input([n], sh(0, sizes))
    args = (x, b) if order == "x_first" else (b, x)
    p.seq.output(p.seq.op(op, *args))
    for g in p.ranks:
        p.out_sl(g, g.op(op, *args), 1, sizes is None)
    witness(p, "ew_bias", {"elementwise"})


@in_turn(PARAMS, variant=["size1_col", "size1_row", "absent_axis", "scalar_const", "where", "clip_no_min"])
def test_elementwise_broadcast_replicated(world: int, seed: int, uneven: bool, variant: str) -> None:
    """A replicated operand whose axis along the shard is absent or of size 1 broadcasts alike."""
    p = Prog(world, seed, uneven)
    a, m = p.dim(), p.dim()
    n, sizes = p.split()
    if variant == "size1_col":      # x [m, n] shard n; s [m, 1] rep
        x, axis = p.input([m, n], sh(1, sizes)), 1
        s = p.input([m, 1], rep())
        args = (s, x)
    elif variant == "size1_row":    # x [n, m] shard rows; s [1, m] rep
        x, axis = p.input([n, m], sh(0, sizes)), 0
        s = p.input([1, m], rep())
        args = (x, s)
    elif variant == "absent_axis":  # x [n, a, m] shard axis 0; s [a, m] rep (no axis 0 at all)
        x, axis = p.input([n, a, m], sh(0, sizes)), 0
        s = p.input([a, m], rep())
        args = (s, x)
    elif variant in ("scalar_const", "clip_no_min"):
        x, axis = p.input([a, n], sh(1, sizes)), 1
        args = ()
    else:                           # Where(cond [1, n] sharded, x [m, n] sharded, y [m, 1] rep)
        x, axis = p.input([m, n], sh(1, sizes)), 1
        cond = p.input([1, n], sh(1, sizes), TensorProto.BOOL)
        y = p.input([m, 1], rep())
        args = (cond, x, y)

    def build(g: Graph) -> str:
        if variant == "scalar_const":
            return g.op("Mul", x, g.const(1.75))
        if variant == "clip_no_min":  # an absent optional input slot
            return g.op("Clip", x, "", g.const(0.5))
        return g.op("Where" if variant == "where" else "Add", *args)

    p.seq.output(build(p.seq))
    for g in p.ranks:
        p.out_sl(g, build(g), axis, sizes is None)
    witness(p, "ew_broadcast", {"elementwise"})


@params
def test_elementwise_all_replicated(world: int, seed: int, uneven: bool) -> None:
    p = Prog(world, seed, uneven)
    x, y = p.input([p.dim(), 1], rep()), p.input([p.dim()], rep())
    p.seq.output(p.seq.op("Pow", p.seq.op("Abs", x), y))
    for g in p.ranks:
        g.output(g.op("Pow", g.op("Abs", x), y))
    witness(p, "ew_rep", {"elementwise"})


# ============================================================================================
# elementwise.lp: partial sums under linear ops


@in_turn(PARAMS, how=["declared", "rowpar"], op=["Neg", "Identity"])
def test_partial_linear_unary(world: int, seed: int, uneven: bool, how: str, op: str) -> None:
    p = Prog(world, seed, uneven)
    s, ts = some_partial(p, p.dim(), p.dim(), how)
    p.seq.output(p.seq.op(op, s))
    for g, t in zip(p.ranks, ts):
        p.out_ps(g, g.op(op, t))
    witness(p, "partial_linear_unary", {"partial_linear_unary", "allreduce_sum"})


@in_turn(PARAMS, **{"src,to": [(FLOAT, DOUBLE), (FLOAT, FLOAT), (INT64, FLOAT), (DOUBLE, FLOAT)]})
def test_partial_cast(world: int, seed: int, uneven: bool, src: int, to: int) -> None:
    p = Prog(world, seed, uneven)
    s, ts = declared_partial(p, [p.dim(), p.dim()], src)
    p.seq.output(p.seq.op("Cast", s, to=to))
    for g, t in zip(p.ranks, ts):
        p.out_ps(g, g.op("Cast", t, to=to))
    witness(p, "partial_cast", {"partial_cast", "allreduce_sum"})


@in_turn(PARAMS, op=["Add", "Sub"], variant=["rowpar", "declared_broadcast"])
def test_partial_add_partial(world: int, seed: int, uneven: bool, op: str, variant: str) -> None:
    """sum_k T1_k (+/-) sum_k T2_k = sum_k (T1_k (+/-) T2_k): pieces must coincide."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    if variant == "rowpar":       # two row-parallel products over the same K split
        k = p.split()
        s1, t1 = row_parallel(p, m, n, k)
        s2, t2 = row_parallel(p, m, n, k)
    else:                         # two declared partials, the second broadcast [n] -> [m, n]
        s1, t1 = declared_partial(p, [m, n])
        s2, t2 = declared_partial(p, [n])
    for a, b in ((s1, s2), (s2, s1)):
        p.seq.output(p.seq.op(op, a, b))
    for g, a, b in zip(p.ranks, t1, t2):
        p.out_ps(g, g.op(op, a, b))
        p.out_ps(g, g.op(op, b, a))
    witness(p, "partial_add_partial", {"partial_add_partial", "allreduce_sum"})


@in_turn(PARAMS, how=["declared", "rowpar"], variant=["partial_first", "rep_first", "col_bcast", "const"])
def test_partial_mul_rep(world: int, seed: int, uneven: bool, how: str, variant: str) -> None:
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    s, ts = some_partial(p, m, n, how)
    r = None if variant == "const" else p.input([m, 1] if variant == "col_bcast" else [n], rep())

    def mul(g: Graph, t: str) -> str:
        if variant == "const":
            return g.op("Mul", g.const(np.full([1, n], 0.75)), t)
        return g.op("Mul", r, t) if variant == "rep_first" else g.op("Mul", t, r)

    p.seq.output(mul(p.seq, s))
    for g, t in zip(p.ranks, ts):
        p.out_ps(g, mul(g, t))
    witness(p, "partial_mul_rep", {"partial_mul_rep", "allreduce_sum"})


@in_turn(PARAMS, how=["declared", "rowpar"], shape=["full", "row", "col"])
def test_partial_div_rep(world: int, seed: int, uneven: bool, how: str, shape: str) -> None:
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    s, ts = some_partial(p, m, n, how)
    d = p.input({"full": [m, n], "row": [n], "col": [m, 1]}[shape], rep())
    p.seq.output(p.seq.op("Div", s, d))
    for g, t in zip(p.ranks, ts):
        p.out_ps(g, g.op("Div", t, d))
    witness(p, "partial_div_rep", {"partial_div_rep", "allreduce_sum"})


def _bias_graphs(p: Prog, how: str, seq_op: str, order: str, rank_term) -> tuple[str, list[str]]:
    """seq: S op b (or b op S); rank r: rank_term(g, r, piece, b) -> the tensor it all-reduces."""
    m, n = p.dim(), p.dim()
    s, ts = some_partial(p, m, n, how)
    b = p.input([n], rep(), name="b")
    y = p.seq.op(seq_op, *((s, b) if order == "partial_first" else (b, s)))
    p.seq.output(y)
    outs = [p.out_ps(g, rank_term(g, r, t, b)) for r, (g, t) in enumerate(zip(p.ranks, ts))]
    return y, outs


@in_turn(PARAMS, how=["declared", "rowpar"],
         **{"op,order": [("Add", "partial_first"), ("Add", "bias_first"), ("Sub", "partial_first")]})
def test_partial_add_once_and_skip(world: int, seed: int, uneven: bool, how: str, op: str, order: str) -> None:
    """Rank 0 adds the replicated bias to piece 0; every other rank passes its piece on."""
    p = Prog(world, seed, uneven)

    def term(g: Graph, r: int, t: str, b: str) -> str:
        if r:
            return t
        return g.op(op, *((t, b) if order == "partial_first" else (b, t)))

    _bias_graphs(p, how, op, order, term)
    witness(p, "partial_add_once", {"partial_add_once", "partial_skip_add", "allreduce_sum"})


@in_turn(PARAMS, order=["partial_first", "bias_first"], scale=["div_d", "mul_share", "mul_then_div"])
def test_partial_add_share(world: int, seed: int, uneven: bool, order: str, scale: str) -> None:
    """Every piece [A,B) of D adds (B-A)/D of the bias; uneven row-parallel pieces too."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    K, sizes = p.split()
    s, ts = row_parallel(p, m, n, (K, sizes))
    b = p.input([n], rep(), name="b")
    p.seq.output(p.seq.op("Add", *((s, b) if order == "partial_first" else (b, s))))
    chunks = bounds(sh(0, sizes), K, world)
    for (lo, hi), g, t in zip(chunks, p.ranks, ts):
        if scale == "div_d":          # b / (K / (hi-lo))
            share = g.op("Div", b, g.const(K / (hi - lo)))
        elif scale == "mul_share":    # b * ((hi-lo) / K), read back as a simple fraction
            share = g.op("Mul", g.const((hi - lo) / K), b)
        else:                         # (b * (hi-lo)) / K
            share = g.op("Div", g.op("Mul", b, g.const(float(hi - lo))), g.const(float(K)))
        p.out_ps(g, g.op("Add", *((t, share) if order == "partial_first" else (share, t))))
    witness(p, "partial_add_share", {"partial_add_share", "rank_scale", "allreduce_sum"})


@params
def test_partial_add_share_declared(world: int, seed: int, uneven: bool) -> None:
    """A declared partial has D = world pieces of size 1: each rank adds bias / world."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    s, ts = declared_partial(p, [m, n])
    b = p.input([m, 1], rep(), name="b")
    p.seq.output(p.seq.op("Add", s, b))
    for g, t in zip(p.ranks, ts):
        p.out_ps(g, g.op("Add", t, g.op("Div", b, g.const(float(world)))))
    witness(p, "partial_add_share_declared", {"partial_add_share", "rank_scale", "allreduce_sum"})


MONOTONE = ["Relu", "Exp", "Sigmoid", "Tanh", "Erf", "Identity", "Softplus"]


@params
def test_partial_max_monotone(world: int, seed: int, uneven: bool) -> None:
    """max_k f(T_k) = f(max_k T_k) for every non-decreasing f in the library."""
    p = Prog(world, seed, uneven)
    x = p.input([p.dim(), p.dim()], partial("max"))
    for op in MONOTONE:
        p.seq.output(p.seq.op(op, x))
    for g in p.ranks:
        for op in MONOTONE:
            p.out_ps(g, g.op(op, x), "max")
    witness(p, "partial_max_monotone", {"partial_max_monotone", "allreduce_max"})


# --------------------------------------------------------------------------------------------
# elementwise.lp: rank-local scaling


@params
@pytest.mark.parametrize("layout", ["rep", "shard"])
def test_rank_scale(world: int, seed: int, uneven: bool, layout: str) -> None:
    """c * T, T * c, T / c and chains of them relate to S by scaled(P, Q, L)."""
    p = Prog(world, seed, uneven)
    a = p.dim()
    D, sizes = p.split()
    x = p.input([a, D], rep() if layout == "rep" else sh(1, sizes))
    p.seq.output(p.seq.op("Identity", x))
    scaled = []
    for g in p.ranks:
        g.output(g.op("Identity", x))
        t1 = g.op("Mul", x, g.const(3.0))                    # 3/1
        t2 = g.op("Mul", g.const([0.25]), t1)                # 3/4, a [1] constant, other order
        t3 = g.op("Div", t2, g.const(-1.5))                  # -1/2
        g.output(t3)
        scaled.append((t1, t2, t3))
    out = witness(p, "rank_scale", {"rank_scale", "declared"})
    for r, ts in enumerate(scaled):
        got = [[lay for lay in layouts_of(out, x, r, t) if kinds([lay]) == {"scaled"}] for t in ts]
        assert [len(g) for g in got] == [1, 1, 1], got
        assert [lay[1] / lay[2] for (lay,) in got] == [3.0, 0.75, -0.5]


# ============================================================================================
# matmul.lp


@in_turn(PARAMS, variant=["2d", "batched_a", "batched_b", "const_weight"])
def test_matmul_rep(world: int, seed: int, uneven: bool, variant: str) -> None:
    p = Prog(world, seed, uneven)
    b, m, k, n = p.dim(), p.dim(), p.dim(), p.dim()
    x = p.input([b, m, k] if variant == "batched_a" else [m, k], rep())
    if variant == "const_weight":
        wv = p.rng.standard_normal([k, n]).astype(np.float32)
        p.seq.output(p.seq.op("MatMul", x, p.seq.const(wv)))
        for g in p.ranks:
            g.output(g.op("MatMul", x, g.const(wv)))
    else:
        w = p.input([b, k, n] if variant == "batched_b" else [k, n], rep())
        p.seq.output(p.seq.op("MatMul", x, w))
        for g in p.ranks:
            g.output(g.op("MatMul", x, w))
    witness(p, "matmul_rep", {"matmul_rep"})


@in_turn(PARAMS, variant=["2d", "batched_a", "batched_b", "bias"])
def test_matmul_column_parallel(world: int, seed: int, uneven: bool, variant: str) -> None:
    """A (B[..., X:Y]) = (A B)[..., X:Y]; a bias sliced alike keeps the slice."""
    p = Prog(world, seed, uneven)
    bt, m, k = p.dim(), p.dim(), p.dim()
    n, sizes = p.split()
    x = p.input([bt, m, k] if variant == "batched_a" else [m, k], rep())
    w = p.input([bt, k, n], sh(2, sizes)) if variant == "batched_b" else p.input([k, n], sh(1, sizes))
    bias = p.input([n], sh(0, sizes)) if variant == "bias" else None
    lemmas = {"matmul_column_parallel"} | ({"elementwise"} if bias else set())

    def build(g: Graph) -> str:
        y = g.op("MatMul", x, w)
        return g.op("Add", y, bias) if bias else y

    p.seq.output(build(p.seq))
    last = 2 if variant.startswith("batched") else 1
    for g in p.ranks:
        p.out_sl(g, build(g), last, sizes is None)
    witness(p, "matmul_col", lemmas)


@params
@pytest.mark.parametrize("variant", ["2d", "batched_a", "batched_b"])
def test_matmul_row_slice(world: int, seed: int, uneven: bool, variant: str) -> None:
    """(A[..., X:Y, :]) B = (A B)[..., X:Y, :]."""
    p = Prog(world, seed, uneven)
    bt, k, n = p.dim(), p.dim(), p.dim()
    m, sizes = p.split()
    x = p.input([bt, m, k], sh(1, sizes)) if variant == "batched_a" else p.input([m, k], sh(0, sizes))
    w = p.input([bt, k, n] if variant == "batched_b" else [k, n], rep())
    p.seq.output(p.seq.op("MatMul", x, w))
    axis = 1 if variant.startswith("batched") else 0
    for g in p.ranks:
        p.out_sl(g, g.op("MatMul", x, w), axis, sizes is None)
    witness(p, "matmul_row_slice", {"matmul_row_slice"})


@params
@pytest.mark.parametrize("variant", ["2d", "batched_a", "batched_b"])
def test_matmul_row_parallel(world: int, seed: int, uneven: bool, variant: str) -> None:
    """A B = sum_k A[:, Xk:Yk] B[Xk:Yk, :]: pieces of the contraction, completed by AllReduce."""
    p = Prog(world, seed, uneven)
    bt, m, n = p.dim(), p.dim(), p.dim()
    K, sizes = p.split()
    x = p.input([bt, m, K], sh(2, sizes)) if variant == "batched_a" else p.input([m, K], sh(1, sizes))
    w = p.input([bt, K, n], sh(1, sizes)) if variant == "batched_b" else p.input([K, n], sh(0, sizes))
    p.seq.output(p.seq.op("MatMul", x, w))
    for g in p.ranks:
        p.out_ps(g, g.op("MatMul", x, w))
    witness(p, "matmul_row_parallel", {"matmul_row_parallel", "allreduce_sum"})


@in_turn(PARAMS, variant=["both", "b_absent", "b_size1", "a_rep", "4d", "a_size1"])
def test_matmul_batch(world: int, seed: int, uneven: bool, variant: str) -> None:
    """(A B)[b] = A[b] B[b]; an operand without (or with a size-1) batch axis broadcasts."""
    p = Prog(world, seed, uneven)
    m, k, n, b1 = p.dim(), p.dim(), p.dim(), p.dim()
    B, sizes = p.split()
    out_axis = 0
    if variant == "both":
        a, w = p.input([B, m, k], sh(0, sizes)), p.input([B, k, n], sh(0, sizes))
    elif variant == "b_absent":
        a, w = p.input([B, m, k], sh(0, sizes)), p.input([k, n], rep())
    elif variant == "b_size1":
        a, w = p.input([B, m, k], sh(0, sizes)), p.input([1, k, n], rep())
    elif variant == "a_rep":
        a, w = p.input([m, k], rep()), p.input([B, k, n], sh(0, sizes))
    elif variant == "4d":         # A [b1, B, m, k] sliced on axis 1, B [B, k, n] on axis 0
        a, w, out_axis = p.input([b1, B, m, k], sh(1, sizes)), p.input([B, k, n], sh(0, sizes)), 1
    else:                         # A [b1, 1, m, k] replicated, B [B, k, n] sliced
        a, w, out_axis = p.input([b1, 1, m, k], rep()), p.input([B, k, n], sh(0, sizes)), 1
    p.seq.output(p.seq.op("MatMul", a, w))
    for g in p.ranks:
        p.out_sl(g, g.op("MatMul", a, w), out_axis, sizes is None)
    witness(p, "matmul_batch", {"matmul_batch"})


@in_turn(PARAMS, how=["declared", "rowpar"], order=["partial_left", "partial_right"])
def test_matmul_partial(world: int, seed: int, uneven: bool, how: str, order: str) -> None:
    """(sum_k T_k) B = sum_k T_k B and A (sum_k T_k) = sum_k A T_k."""
    p = Prog(world, seed, uneven)
    m, k, n = p.dim(), p.dim(), p.dim()
    if order == "partial_left":
        s, ts = some_partial(p, m, k, how)
        other = p.input([p.dim(), k, n], rep())          # batched replicated right operand
        args = lambda t: (t, other)
    else:
        s, ts = some_partial(p, k, n, how)
        other = p.input([m, k], rep())
        args = lambda t: (other, t)
    p.seq.output(p.seq.op("MatMul", *args(s)))
    for g, t in zip(p.ranks, ts):
        p.out_ps(g, g.op("MatMul", *args(t)))
    witness(p, "matmul_partial", {"matmul_partial", "allreduce_sum"})


GEMM_CASES = [
    ("rep", "none"), ("rep", "full"), ("rep", "row_vec"),
    ("col", "none"), ("col", "sliced_vec"), ("col", "sliced_full"), ("col", "col_size1"), ("col", "scalar"),
    ("row", "none"), ("row", "row_vec"), ("row", "sliced_full"), ("row", "sliced_col_size1"),
    ("psum", "none"), ("psum", "empty"),
]


GEMM_CORE_LEMMAS = {"rep": {"matmul_rep"}, "col": {"matmul_column_parallel"}, "row": {"matmul_row_slice"},
                    "psum": {"matmul_row_parallel", "allreduce_sum"}}


TRANS = [(0, 0), (0, 1), (1, 0), (1, 1)]
# every (core, C) x transA/transB once, at world 2 (even) and 3 (uneven) in turn, each core's
# transposes rotated by one so that every transpose pair runs with both (under SWEEP: each at both)
GEMM_GRID = params_in_turn(PARAMS[:2], [(*TRANS[(j + k) % 4], core, c) for k, (core, c) in enumerate(GEMM_CASES)
                                        for j in range(4)])


@pytest.mark.parametrize("world,seed,uneven,ta,tb,core,c", GEMM_GRID,
                         ids=[f"{core}-{c}-t{ta}{tb}-w{w}-s{s}-{'uneven' if u else 'even'}"
                              for w, s, u, ta, tb, core, c in GEMM_GRID])
def test_gemm(world: int, seed: int, uneven: bool, ta: int, tb: int, core: str, c: str) -> None:
    """Y = alpha op(A) op(B) + beta C with transA/transB, with and without C: lowering rewrites it
    into Transpose / MatMul / Mul / Add (refine/lowering/canonical.py), whose lemmas relate Y."""
    p = Prog(world, seed, uneven)
    M, K, N = p.dim(), p.dim(), p.dim()
    D, sizes = p.split()
    if core == "col":
        N = D
    elif core == "row":
        M = D
    elif core == "psum":
        K = D
    a_shape, b_shape = ([K, M] if ta else [M, K]), ([N, K] if tb else [K, N])
    a_lay = {"row": sh(ta, sizes), "psum": sh(1 - ta, sizes)}.get(core, rep())
    b_lay = {"col": sh(1 - tb, sizes), "psum": sh(tb, sizes)}.get(core, rep())
    a, b = p.input(a_shape, a_lay, name="a"), p.input(b_shape, b_lay, name="b")
    cin = {
        "full": ([M, N], rep()), "row_vec": ([N], rep()), "col_size1": ([M, 1], rep()), "scalar": ([], rep()),
        "sliced_vec": ([N], sh(0, sizes)), "sliced_full": ([M, N], sh(1 if core == "col" else 0, sizes)),
        "sliced_col_size1": ([M, 1], sh(0, sizes)),
    }.get(c)
    inputs = [a, b]
    if cin is not None:
        inputs.append(p.input(cin[0], cin[1], name="c"))
    elif c == "empty":
        inputs.append("")
    alpha = float(p.rng.choice([1.0, 0.5, 2.0]))
    attrs = {"transA": ta, "transB": tb, "alpha": alpha}
    if cin is not None:
        attrs["beta"] = float(p.rng.choice([1.0, 0.25, -1.0]))
    p.seq.output(p.seq.op("Gemm", *inputs, **attrs))
    for g in p.ranks:
        y = g.op("Gemm", *inputs, **attrs)
        if core == "psum":
            p.out_ps(g, y)
        elif core == "rep":
            g.output(y)
        else:
            p.out_sl(g, y, 1 if core == "col" else 0, sizes is None)
    witness(p, "gemm", GEMM_CORE_LEMMAS[core] | ({"transpose"} if ta or tb else set()))


# ============================================================================================
# soundness negatives


def _mlp_bias(p: Prog, rank_term) -> tuple[str, list[str], list[str]]:
    """Row-parallel x @ w, seq adds bias b; rank_term(g, r, piece, b) is what rank r all-reduces.
    Returns (seq sum tensor, rank all-reduce outputs, rank terms)."""
    m, n = p.dim(4, 7), p.dim(4, 7)
    s, ts = row_parallel(p, m, n, p.split())
    b = p.input([n], rep(), name="b")
    y = p.seq.op("Add", s, b)
    p.seq.output(y)
    terms = [rank_term(g, r, t, b) for r, (g, t) in enumerate(zip(p.ranks, ts))]
    outs = [p.out_ps(g, t) for g, t in zip(p.ranks, terms)]
    return y, outs, terms


@params
def test_neg_bias_on_every_rank(world: int, seed: int, uneven: bool) -> None:
    """BUGS.md class 3: every rank adds the full bias to its partial -> TP x bias."""
    p = Prog(world, seed, uneven)
    y, outs, terms = _mlp_bias(p, lambda g, r, t, b: g.op("Add", t, b))
    out = refuted(p, "neg_bias_every_rank", y, outs)
    for r in range(1, world):  # a piece other than 0 carrying the whole bias relates to nothing
        assert layouts_of(out, y, r, terms[r]) == []


@params
@pytest.mark.parametrize("which", ["once_then_share", "share_then_skip"])
def test_neg_mixed_bias_styles(world: int, seed: int, uneven: bool, which: str) -> None:
    """Rank 0 adds the whole bias (once) while rank 1 adds a 1/TP share (even), or rank 0 adds
    a share while the others skip: the styles differ, so no tiling may sum them."""
    p = Prog(world, seed, False)

    def term(g: Graph, r: int, t: str, b: str) -> str:
        share = lambda: g.op("Div", b, g.const(float(world)))
        if which == "once_then_share":
            return g.op("Add", t, b) if r == 0 else g.op("Add", t, share()) if r == 1 else t
        return g.op("Add", t, share()) if r == 0 else t

    y, outs, terms = _mlp_bias(p, term)
    out = refuted(p, "neg_mixed_styles", y, outs)

    def styles(r: int) -> set[str]:
        return {str(lay[4][0]) for lay in layouts_of(out, y, r, terms[r]) if kinds([lay]) == {"psum"}}

    # each term is a (true) piece of its own style, and no tiling mixes them into the output (a
    # share of the bias is also an even share of it, so its term a `plus` of two pieces)
    if which == "once_then_share":
        assert styles(0) == {"once"} and styles(1) - {"plus"} == {"even"}
    else:
        assert styles(0) - {"plus"} == {"even"}
    assert (f"seq:{y}", "out") not in out.derived.get("complete")


@in_turn(PARAMS, how=["declared", "rowpar"], op=["Relu", "Exp", "Sigmoid"])
def test_neg_nonlinear_of_partial(world: int, seed: int, uneven: bool, how: str, op: str) -> None:
    p = Prog(world, seed, uneven)
    s, ts = some_partial(p, p.dim(4, 7), p.dim(4, 7), how)
    y = p.seq.op(op, s)
    p.seq.output(y)
    terms = [g.op(op, t) for g, t in zip(p.ranks, ts)]
    outs = [p.out_ps(g, t) for g, t in zip(p.ranks, terms)]
    out = refuted(p, "neg_nonlinear", y, outs)
    assert out.relations_of(y) == []


@params
def test_neg_nonmonotone_of_partial_max(world: int, seed: int, uneven: bool) -> None:
    """max_k -T_k != -(max_k T_k): Neg is linear but decreasing."""
    p = Prog(world, seed, uneven)
    x = p.input([p.dim(4, 7), p.dim(4, 7)], partial("max"))
    y = p.seq.op("Neg", x)
    p.seq.output(y)
    outs = [p.out_ps(g, g.op("Neg", x), "max") for g in p.ranks]
    out = refuted(p, "neg_neg_of_max", y, outs)
    assert out.relations_of(y) == []


@params
@pytest.mark.parametrize("op", ["Mul", "MatMul"])
def test_neg_partial_times_partial(world: int, seed: int, uneven: bool, op: str) -> None:
    p = Prog(world, seed, uneven)
    n = p.dim(4, 7)
    s1, t1 = declared_partial(p, [n, n])
    s2, t2 = declared_partial(p, [n, n])
    y = p.seq.op(op, s1, s2)
    p.seq.output(y)
    outs = [p.out_ps(g, g.op(op, a, b)) for g, a, b in zip(p.ranks, t1, t2)]
    out = refuted(p, "neg_partial_times_partial", y, outs)
    assert out.relations_of(y) == []


@params
@SOURCES
def test_neg_sub_partial_on_right(world: int, seed: int, uneven: bool, how: str) -> None:
    """b - S: rank 0 computes b - T_0, the others pass T_k on (they would have to negate it)."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(4, 7), p.dim(4, 7)
    s, ts = some_partial(p, m, n, how)
    b = p.input([m, n], rep(), name="b")
    y = p.seq.op("Sub", b, s)
    p.seq.output(y)
    outs = [p.out_ps(g, g.op("Sub", b, t) if r == 0 else t) for r, (g, t) in enumerate(zip(p.ranks, ts))]
    out = refuted(p, "neg_sub_rhs", y, outs)
    assert out.relations_of(y) == []


@params
def test_neg_sub_rhs_piece_passed_on(world: int, seed: int, uneven: bool) -> None:
    """S1 - S2: rank 0 computes T1_0 - S2 (S2 all-reduced), then the other ranks must pass on
    their pieces of S1; passing on pieces of S2 (the right operand) adds them with the wrong sign."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(4, 7), p.dim(4, 7)
    s1, t1 = declared_partial(p, [m, n])
    s2, t2 = declared_partial(p, [m, n])
    y = p.seq.op("Sub", s1, s2)
    p.seq.output(y)
    outs = []
    for r, g in enumerate(p.ranks):
        full2 = g.coll("AllReduce", t2[r], p.group)
        outs.append(p.out_ps(g, g.op("Sub", t1[r], full2) if r == 0 else t2[r]))
    out = refuted(p, "neg_sub_rhs_passed_on", y, outs)
    for r in range(1, world):
        assert layouts_of(out, y, r, t2[r]) == []


@params
def test_neg_bias_added_but_dropped(world: int, seed: int, uneven: bool) -> None:
    """Rank 0 computes T_0 + b but all-reduces T_0: every rank passes its piece on, none adds b.
    Piece 0 itself must never count as `skipped`."""
    p = Prog(world, seed, uneven)

    def term(g: Graph, r: int, t: str, b: str) -> str:
        if r == 0:
            g.output(g.op("Add", t, b))  # computed, but not what goes into the sum
        return t

    y, outs, terms = _mlp_bias(p, term)
    out = refuted(p, "neg_bias_dropped", y, outs)
    assert layouts_of(out, y, 0, terms[0]) == []


@pytest.mark.parametrize("world,factor", [(2, 3.0), (2, 1.5), (3, 2.0), (3, 4.0), (4, 2.0)])
def test_neg_bias_wrong_share(world: int, factor: float) -> None:
    """bias / 3 at TP=2 (and the like) is not the share of an even decomposition."""
    p = Prog(world, world, False)
    y, outs, terms = _mlp_bias(p, lambda g, r, t, b: g.op("Add", t, g.op("Div", b, g.const(factor))))
    out = refuted(p, "neg_bias_wrong_share", y, outs)
    for r in range(world):
        assert layouts_of(out, y, r, terms[r]) == [], r
    assert "partial_add_share" not in out.lemmas_fired()


def _wrong_chunk(g: Graph, r: int, world: int, t: str, axis: int, per: int) -> str:
    """Rank r takes chunk (r+1) % world of its replicated t along axis (a rotated shard)."""
    lo = ((r + 1) % world) * per
    return g.op("Slice", t, g.ints([lo]), g.ints([lo + per]), g.ints([axis]))


@params
def test_neg_matmul_k_ranges_differ(world: int, seed: int, uneven: bool) -> None:
    """A sliced on K as [Xr, Yr), B sliced on K as the next rank's range: sum_r A_r B_{r+1}."""
    p = Prog(world, seed, False)
    m, n, per = p.dim(4, 7), p.dim(4, 7), p.dim(2, 3)
    K = per * world
    x = p.input([m, K], sh(1, None))
    w = p.input([K, n], rep())
    y = p.seq.op("MatMul", x, w)
    p.seq.output(y)
    prods = [g.op("MatMul", x, _wrong_chunk(g, r, world, w, 0, per)) for r, g in enumerate(p.ranks)]
    outs = [p.out_ps(g, t) for g, t in zip(p.ranks, prods)]
    out = refuted(p, "neg_matmul_k", y, outs)
    assert out.relations_of(y) == []
    assert "rank_slice" in out.checked.lemmas_checked  # the rotated B slices were understood


@params
@pytest.mark.parametrize("via", ["MatMul+Add", "Gemm"])
def test_neg_column_parallel_bias_wrong_range(world: int, seed: int, uneven: bool, via: str) -> None:
    p = Prog(world, seed, False)
    m, k, per = p.dim(4, 7), p.dim(), p.dim(2, 3)
    n = per * world
    x, w, b = p.input([m, k], rep()), p.input([k, n], sh(1, None)), p.input([n], rep(), name="b")

    def build(g: Graph, bias: str) -> tuple[str, str]:
        if via == "Gemm":
            y = g.op("Gemm", x, w, bias)
            return y, y
        core = g.op("MatMul", x, w)
        return core, g.op("Add", core, bias)

    core, y = build(p.seq, b)
    p.seq.output(y)
    outs, cores = [], []
    for r, g in enumerate(p.ranks):
        c_r, y_r = build(g, _wrong_chunk(g, r, world, b, 0, per))
        cores.append(c_r)
        outs.append(g.coll("AllGather", y_r, p.group, axis=1))
        g.output(outs[-1])
    out = refuted(p, "neg_col_bias", y, outs)
    assert out.relations_of(y) == []
    if via == "MatMul+Add":  # the product itself is fine: the bias is what's wrong
        assert all(kinds(layouts_of(out, core, r, cores[r])) == {"sl"} for r in range(world))


@params
@pytest.mark.parametrize("op", ["Add", "Mul", "Max"])
def test_neg_elementwise_ranges_differ(world: int, seed: int, uneven: bool, op: str) -> None:
    p = Prog(world, seed, False)
    m, per = p.dim(4, 7), p.dim(2, 3)
    n = per * world
    x, z = p.input([m, n], sh(1, None)), p.input([m, n], rep())
    y = p.seq.op(op, x, z)
    p.seq.output(y)
    outs = []
    for r, g in enumerate(p.ranks):
        outs.append(g.coll("AllGather", g.op(op, x, _wrong_chunk(g, r, world, z, 1, per)), p.group, axis=1))
        g.output(outs[-1])
    out = refuted(p, "neg_ew_ranges", y, outs)
    assert out.relations_of(y) == []


@params
def test_neg_integer_div_rank_scale(world: int, seed: int, uneven: bool) -> None:
    """(x / 2) * 2 with int64 x truncates: it is not x, so no scaled relation may come of a Div."""
    p = Prog(world, seed, uneven)
    x = p.input([p.dim(4, 7), p.dim(4, 7)], rep(), INT64)
    y = p.seq.op("Identity", x)
    p.seq.output(y)
    outs, halves = [], []
    for g in p.ranks:
        halves.append(g.op("Div", x, g.const(2, np.int64)))
        outs.append(g.op("Identity", g.op("Mul", halves[-1], g.const(2, np.int64))))
        g.output(outs[-1])
    out = refuted(p, "neg_int_div_scale", y, outs)
    for r in range(world):
        assert layouts_of(out, x, r, halves[r]) == []


@params
def test_neg_integer_div_of_partial(world: int, seed: int, uneven: bool) -> None:
    """(a + b) / 2 != a / 2 + b / 2 in integer division."""
    p = Prog(world, seed, uneven)
    s, ts = declared_partial(p, [p.dim(6, 8), p.dim(6, 8)], INT64)  # small ints: make mismatches likely
    y = p.seq.op("Div", s, p.seq.const(2, np.int64))
    p.seq.output(y)
    outs = [p.out_ps(g, g.op("Div", t, g.const(2, np.int64))) for g, t in zip(p.ranks, ts)]
    out = refuted(p, "neg_int_div_partial", y, outs)
    assert out.relations_of(y) == []


@params
def test_neg_gemm_contraction_with_c_on_every_rank(world: int, seed: int, uneven: bool) -> None:
    """Class 3 through Gemm: every rank's Gemm adds beta * C to its contraction piece."""
    p = Prog(world, seed, uneven)
    M, N = p.dim(4, 7), p.dim(4, 7)
    K, sizes = p.split()
    a, b, c = p.input([M, K], sh(1, sizes)), p.input([K, N], sh(0, sizes)), p.input([N], rep())
    y = p.seq.op("Gemm", a, b, c)
    p.seq.output(y)
    terms = [g.op("Gemm", a, b, c) for g in p.ranks]
    outs = [p.out_ps(g, t) for g, t in zip(p.ranks, terms)]
    out = refuted(p, "neg_gemm_c", y, outs)
    # rank 0's term is piece 0 carrying C once (true); the others' carry C again and relate to nothing
    for r in range(1, world):
        assert layouts_of(out, y, r, terms[r]) == []


# ============================================================================================
# one-sided Identity, CastLike


@params
@pytest.mark.parametrize("op", ["Identity", "Reshape", "CastLike"])
def test_seq_identity_and_rank_identity(world: int, seed: int, uneven: bool, op: str) -> None:
    """seq: relu(id(x)) ; ranks: id(relu(x_shard)) -- each side has an Identity, a Reshape to
    the shape it already has, or a CastLike to its own type (the copy back of an in-place
    collective), that the other lacks (a clone, a wait, DTensor's no-op view)."""
    p = Prog(world, seed, uneven)
    shape = [p.dim(), p.dim()]
    shape[1], sizes = p.split()
    x = p.input(shape, sh(1, sizes))

    def ident(g: Graph, t: str, s: list[int]) -> str:
        if op == "CastLike":
            return g.op("CastLike", t, g.op("Neg", t))
        return g.op("Identity", t) if op == "Identity" else g.op("Reshape", t, g.ints(s))

    y = p.seq.op("Relu", ident(p.seq, x, shape))
    p.seq.output(y)
    for r, g in enumerate(p.ranks):
        local = rank_shape(shape, p.layouts[x], r, world)
        p.out_sl(g, ident(g, g.op("Relu", x), local), 1, sizes is None)
    witness(p, "identity", {"seq_identity", "rank_identity"})


@params
def test_neg_castlike_to_another_type_is_no_identity(world: int, seed: int, uneven: bool) -> None:
    """A rank-only CastLike to an integer type truncates (x * 2.5 cast to int64, back to float):
    not an identity."""
    p = Prog(world, seed, uneven)
    x = p.input([p.dim(2, 4), p.dim(2, 4)], rep())
    y = p.seq.op("Mul", x, p.seq.const(2.5))
    p.seq.output(y)
    outs = []
    for g in p.ranks:
        ints = g.op("CastLike", g.op("Mul", x, g.const(2.5)), g.const([1], np.int64))
        outs.append(g.output(g.op("Cast", ints, to=TensorProto.FLOAT)))
    out = run_case(p.case("neg_castlike_identity"), p.seed)
    assert out.checked.ok
    assert all(t.split(":", 1)[1] != outs[0] for t, _ in out.relations_of(y))
    assert out.report.verdict != "verified"


@params
def test_neg_reshape_to_other_shape_is_no_identity(world: int, seed: int, uneven: bool) -> None:
    """A rank-only Reshape [a, b] -> [b, a] (same size, other shape) is not an identity."""
    p = Prog(world, seed, uneven)
    a = p.dim(2, 4)
    x = p.input([a, a + 1], rep())
    y = p.seq.op("Relu", x)
    p.seq.output(y)
    outs = [g.output(g.op("Reshape", g.op("Relu", x), g.ints([a + 1, a]))) for g in p.ranks]
    out = run_case(p.case("neg_reshape_identity"), p.seed)
    assert out.checked.ok
    assert all(t.split(":", 1)[1] != outs[0] for t, _ in out.relations_of(y))
    assert out.report.verdict != "verified"


@params
def test_cast_like_takes_values_of_input_0(world: int, seed: int, uneven: bool) -> None:
    """CastLike(x, like) has x's values and like's type; a sliced x stays sliced, a constant x
    cast like a sliced tensor is a replica (HF's RMSNorm casts its epsilon this way). Lowered as
    the Cast to like's type it is (refine/lowering/normal_forms.py), the elementwise lemma's."""
    p = Prog(world, seed, uneven)
    shape = [p.dim(), p.dim()]
    shape[0], sizes = p.split()
    x = p.input(shape, sh(0, sizes))
    like = p.input([p.dim()], rep(), DOUBLE)
    for g in [p.seq, *p.ranks]:
        eps = g.const(0.5)
        z = g.op("CastLike", x, like)  # sliced, now double
        y = g.op("Add", z, g.op("CastLike", eps, z))  # the constant, cast like a sliced tensor
        if g is p.seq:
            g.output(y)
        else:
            p.out_sl(g, y, 0, sizes is None)
    witness(p, "cast_like", {"elementwise"})


@params
def test_gemm_bias_share(world: int, seed: int, uneven: bool) -> None:
    """Row-parallel Gemm whose C is the bias times each rank's share (bias / TP when even): after
    the rewrite, a contraction piece plus a share of the bias (DTensor's RowwiseParallel)."""
    p = Prog(world, seed, uneven)
    M, N = p.dim(2, 5), p.dim(2, 5)
    K, sizes = p.split()
    a, b, c = p.input([M, K], sh(1, sizes)), p.input([K, N], sh(0, sizes)), p.input([N], rep())
    p.seq.output(p.seq.op("Gemm", a, b, c))
    for r, (lo, hi) in enumerate(bounds(sh(0, sizes), K, world)):
        g = p.ranks[r]
        share = g.op("Mul", c, g.const(np.float32(hi - lo) / np.float32(K)))
        p.out_ps(g, g.op("Gemm", a, b, share))
    witness(p, "gemm_bias_share", {"matmul_row_parallel", "partial_add_share", "rank_scale"})


@params
def test_neg_gemm_full_bias_on_every_rank_is_no_share(world: int, seed: int, uneven: bool) -> None:
    """Gemm(A_k, B_k, C) on every rank adds C world times."""
    p = Prog(world, seed, uneven)
    M, N = p.dim(2, 5), p.dim(2, 5)
    K, sizes = p.split()
    a, b, c = p.input([M, K], sh(1, sizes)), p.input([K, N], sh(0, sizes)), p.input([N], rep())
    y = p.seq.op("Gemm", a, b, c)
    p.seq.output(y)
    terms = [g.op("Gemm", a, b, g.op("Mul", c, g.const(1.0))) for g in p.ranks]
    outs = [p.out_ps(g, t) for g, t in zip(p.ranks, terms)]
    out = refuted(p, "neg_gemm_full_bias", y, outs)
    assert "partial_add_share" not in out.lemmas_fired()  # C * 1 is the whole bias, no share
    for r in range(1, world):
        assert layouts_of(out, y, r, terms[r]) == []


# ============================================================================================
# inventory


WITNESSED = {
    "declared", "full_slice", "unit_scale", "elementwise", "partial_linear_unary", "partial_cast",
    "partial_add_partial", "partial_mul_rep", "partial_div_rep", "partial_add_once", "partial_skip_add",
    "partial_add_share", "partial_max_monotone", "rank_scale", "matmul_rep", "matmul_column_parallel",
    "matmul_row_slice", "matmul_row_parallel", "matmul_batch", "matmul_partial",
    "seq_identity", "rank_identity",
    "rank_view_chain", "seq_view_chain",  # witnessed in test_lemmas_equivalent.py
    "regrouped_sum",  # witnessed in test_lemmas_backward.py
    "matmul_row_blocks",  # witnessed in test_lemmas_structure.py (strided shards)
}


def test_every_lemma_of_the_algebra_files_has_a_witness() -> None:
    names: set[str] = set()
    for f in ("core.lp", "elementwise.lp", "matmul.lp"):
        text = re.sub(r"%[^\n]*", "", (builtin_rules_dir() / f).read_text())
        for head in re.findall(r"rel_by\(([^.]*?)\)\s*:-", text, flags=re.DOTALL):
            names.add(head.rsplit(",", 1)[1].strip())
    elsewhere = {name for name, module in WITNESSED_ELSEWHERE.items()
                 if re.search(rf"[\"']{name}[\"']", (Path(__file__).parent / module).read_text())}
    assert names - WITNESSED - elsewhere == set(), "lemmas without a witness in this file"
    assert WITNESSED - names == set(), "witnessed lemmas no longer in the rules"


# lemmas of these files whose witnesses live with the programs that need them
WITNESSED_ELSEWHERE = {name: "test_lemmas_data_parallel.py" for name in
                       ("partial_where_zero", "partial_add_adjacent", "whole_piece")}
WITNESSED_ELSEWHERE |= {name: "test_lemmas_pipeline.py" for name in ("partial_slice_add_adjacent", "whole_piece_slice")}
WITNESSED_ELSEWHERE |= {name: "test_lemmas_scaled_sums.py" for name in ("seq_scale", "scaled_additive", "chain_terms")}
WITNESSED_ELSEWHERE |= {"even_share": "test_lemmas_vocab_clamp.py"}
WITNESSED_ELSEWHERE |= {"transposes_undone": "test_lemmas_equivalent.py"}
WITNESSED_ELSEWHERE |= {"broadcast_slice": "test_lemmas_context.py"}
