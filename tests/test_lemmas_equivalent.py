"""Numeric witnesses for equivalent rewrites (issue 11): programs that compute the same values
as their sequential model in another spelling, and must verify.

1. Commuted operands (rules/core.lp, `sw(M)`): a rank computes f(B', A') where the sequential
   program computes f(A, B), f commutative (Add, Mul, Max, Min; And, Or, Xor, Equal).  The
   swapped rank node pairs like any other, so that every paired lemma applies: elementwise on
   shards (same shape, a sharded bias of lower rank, a broadcast replica), and the partial-sum
   lemmas (partial_add_once / partial_skip_add, partial_add_share, partial_mul_rep,
   partial_add_partial), with every rank swapped or only some.
2. One-sided chains of views (core.lp, `rank_view_chain`, `seq_view_chain`): Reshape, Flatten,
   Squeeze, Unsqueeze and Identity chains that end at their start's shape, on the rank side
   (slices, replicas and partial sums carried through) and on the sequential side, also after
   a paired Reshape (the chain's end, or a view on a sibling branch, meets a tensor that a
   lemma related).
3. Pairing where every data input is widely read (core.lp `least_read_data`): an unrolled scan's
   steps, each a Gather of one tensor at a constant step, pair step for step; the ranks taking
   the next step are refused.

Each positive case asserts that the relations the lemmas derive hold on the multi-rank
simulation (random shapes and asymmetric random values, world sizes 2..4, even and uneven
shards), that the named lemmas fired and were checked, no sanity violation, and the verdict.

Soundness negatives (the relation must NOT be derived, the simulator shows the rank computes
something else, the verdict is not `verified`): non-commutative ops with swapped operands
(Sub, Div, Pow, Less, MatMul); a view chain that ends at another shape of the same size
([a, b] -> [ab] -> [b, a]); a chain through a non-view op (Neg, Transpose: same end shape,
other values); and, on the facts, a chain whose end has an axis without a static size.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto

from harness import SWEEP, Graph, Outcome, Prog, in_turn, params_in_turn, partial, rep, run_case, shard, simulate
from refine.config import ShardLayout, shard_bounds
from refine.run.engine import solve
from refine.lowering.graphs import lower_models

FLOAT, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL

# (world size, seed, uneven shards): every world size, even and uneven shards (uneven at world 2
# too under benchmarks/sweep.py)
PARAMS = [(2, 0, False), (3, 1, True), (4, 2, False), *([(2, 3, True)] if SWEEP else [])]
params = pytest.mark.parametrize("world,seed,uneven", PARAMS,
                                 ids=[f"w{w}-s{s}-{'uneven' if u else 'even'}" for w, s, u in PARAMS])


def witness(p: Prog, name: str, lemmas: set[str], verified: bool = True) -> Outcome:
    """Every derived relation holds numerically, every lemma in `lemmas` fired and was checked."""
    out = run_case(p.case(name), p.seed)
    assert out.checked.ok, [vars(v) for v in out.checked.violations]
    missing = lemmas - out.checked.lemmas_checked
    assert not missing, f"{missing} not checked; fired: {sorted(out.lemmas_fired())}"
    assert not out.derived.get("sanity"), out.derived.get("sanity")
    assert not any("sw" in repr(atom) for atom in out.derived.get("rel_by")), "a virtual node id leaked into rel_by"
    if verified:
        assert out.report.verdict == "verified", out.report.failure
    return out


def related(out: Outcome, seq_t: str, rank_t: str) -> list[object]:
    """Layouts relating rank tensor rank_t (any rank, by name) to sequential tensor seq_t."""
    return [lay for s, t, lay in out.derived.get("rel") if s == f"seq:{seq_t}" and t.split(":", 1)[1] == rank_t]


def refuted(p: Prog, name: str, seq_out: str) -> Outcome:
    """A rank program that computes something else: every relation derived holds, none relates
    the ranks' (first) outputs to seq_out, nothing verifies, and the numbers differ."""
    case = p.case(name)
    rank_outs = [m.graph.output[0].name for m in case.loaded().ranks]  # as loaded (and simulated)
    out = run_case(case, p.seed)
    assert out.checked.ok, [vars(v) for v in out.checked.violations]
    assert not out.derived.get("sanity"), out.derived.get("sanity")
    assert out.report.verdict != "verified"
    for t in rank_outs:
        assert related(out, seq_out, t) == [], t
    json.dumps(out.report.model_dump(mode="json"))  # the report (with its closest lemma) serializes
    sim = simulate(case, p.seed)
    want = np.asarray(sim.seq[seq_out], dtype=np.float64)
    got = [np.asarray(sim.ranks[r][t], dtype=np.float64) for r, t in enumerate(rank_outs)]
    assert any(g.shape != want.shape or not np.allclose(g, want, rtol=1e-3, atol=1e-3) for g in got), \
        "the 'wrong' program computes the sequential value: not a meaningful negative"
    return out


# ============================================================================================
# 1. commuted operands


def swaps(p: Prog, which: str) -> list[bool]:
    """Which ranks swap the operands: all of them, or every other one (both pairings at once)."""
    return [which == "all" or r % 2 == 0 for r in range(p.world)]


# every variant x which x op once, the params in turn (each variant and op at every world size,
# even and uneven; under SWEEP every case at every param)
COMMUTED = params_in_turn(PARAMS, [(which, variant, op) for variant in ["same_shape", "sharded_bias", "broadcast_replica"]
                                   for which in ["all", "some"] for op in ["Add", "Mul", "Max", "Min"]])


@pytest.mark.parametrize("world,seed,uneven,which,variant,op", COMMUTED,
                         ids=[f"{op}-{variant}-{which}-w{w}-s{s}-{'uneven' if u else 'even'}"
                              for w, s, u, which, variant, op in COMMUTED])
def test_commuted_elementwise(world: int, seed: int, uneven: bool, which: str, variant: str, op: str) -> None:
    """seq f(x, y); ranks f(y_r, x_r), x sharded: f(x, y)[sl] = f(y[sl], x[sl])."""
    p = Prog(world, seed, uneven)
    m = p.dim()
    n, sizes = p.split()
    x = p.input([m, n], shard(1, sizes))
    if variant == "same_shape":
        y = p.input([m, n], shard(1, sizes))
    elif variant == "sharded_bias":       # rank 1, aligned with x's last axis
        y = p.input([n], shard(0, sizes))
    else:                                 # [m, 1]: broadcast along the sharded axis
        y = p.input([m, 1], rep())
    p.seq.output(p.seq.op(op, x, y))
    for g, swap in zip(p.ranks, swaps(p, which)):
        p.out_sl(g, g.op(op, *((y, x) if swap else (x, y))), 1, sizes is None)
    witness(p, f"commuted_{op}_{variant}", {"elementwise"})


@in_turn(PARAMS, op=["And", "Or", "Xor", "Equal"])
def test_commuted_boolean_and_equality(world: int, seed: int, uneven: bool, op: str) -> None:
    """And/Or/Xor of booleans, Equal of small integers (values 0..3: equal often), commuted."""
    p = Prog(world, seed, uneven)
    b = p.dim()
    a, sizes = p.split()
    dtype = INT64 if op == "Equal" else BOOL
    x = p.input([a, b], shard(0, sizes), dtype)
    y = p.input([b], rep(), dtype)
    p.seq.output(p.seq.op(op, x, y))
    for g in p.ranks:
        p.out_sl(g, g.op(op, y, x), 0, sizes is None)
    witness(p, f"commuted_{op}", {"elementwise"})


def row_parallel(p: Prog, m: int, n: int) -> tuple[str, list[str]]:
    """x @ w with the contraction axis sharded: a partial sum, one piece per rank."""
    k, sizes = p.split()
    x = p.input([m, k], shard(1, sizes))
    w = p.input([k, n], shard(0, sizes))
    return p.seq.op("MatMul", x, w), [g.op("MatMul", x, w) for g in p.ranks]


@params
@pytest.mark.parametrize("which", ["all", "some"])
def test_commuted_bias_added_once(world: int, seed: int, uneven: bool, which: str) -> None:
    """seq s + b; rank 0 adds b first (b + T_0), the others pass their pieces on."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    s, ts = row_parallel(p, m, n)
    b = p.input([n], rep())
    p.seq.output(p.seq.op("Add", s, b))
    for r, (g, t, swap) in enumerate(zip(p.ranks, ts, swaps(p, which))):
        p.out_ps(g, (g.op("Add", b, t) if swap else g.op("Add", t, b)) if r == 0 else t)
    witness(p, "commuted_add_once", {"partial_add_once", "partial_skip_add", "allreduce_sum"})


@params
def test_commuted_bias_share(world: int, seed: int, uneven: bool) -> None:
    """seq s + b; every rank adds its share first: (b * |piece|/K) + T_k."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    k, sizes = p.split()
    x, w = p.input([m, k], shard(1, sizes)), p.input([k, n], shard(0, sizes))
    b = p.input([n], rep())
    p.seq.output(p.seq.op("Add", p.seq.op("MatMul", x, w), b))
    bounds = shard_bounds(ShardLayout.model_validate(shard(0, sizes)), k, world)
    for g, (lo, hi) in zip(p.ranks, bounds):
        share = g.op("Mul", g.const(np.float32(hi - lo) / np.float32(k)), b)  # constant first too
        p.out_ps(g, g.op("Add", share, g.op("MatMul", x, w)))
    witness(p, "commuted_add_share", {"partial_add_share", "rank_scale"})


@params
@pytest.mark.parametrize("variant", ["mul_rep", "add_partials"])
def test_commuted_partial_products_and_sums(world: int, seed: int, uneven: bool, variant: str) -> None:
    """seq s * w -> ranks w * T_k;  seq s1 + s2 -> ranks T2_k + T1_k."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    if variant == "mul_rep":
        s, ts = row_parallel(p, m, n)
        w = p.input([m, 1], rep())
        p.seq.output(p.seq.op("Mul", s, w))
        for g, t in zip(p.ranks, ts):
            p.out_ps(g, g.op("Mul", w, t))
        lemma = "partial_mul_rep"
    else:  # declared partials: the same pieces on every rank
        s1, s2 = p.input([m, n], partial()), p.input([m, n], partial())
        p.seq.output(p.seq.op("Add", s1, s2))
        for g in p.ranks:
            p.out_ps(g, g.op("Add", s2, s1))
        lemma = "partial_add_partial"
    witness(p, f"commuted_{variant}", {lemma, "allreduce_sum"})


@params
def test_commuted_residual_mlp(world: int, seed: int, uneven: bool) -> None:
    """A Megatron MLP whose ranks write both Adds the other way round:
    seq x + relu(x @ w1 + b1) @ w2;  rank k: allreduce(relu(b1_k + x @ w1_k) @ w2_k) + x."""
    p = Prog(world, seed, uneven)
    m, h = p.dim(), p.dim()
    f, sizes = p.split()
    x = p.input([m, h], rep())
    w1, b1 = p.input([h, f], shard(1, sizes)), p.input([f], shard(0, sizes))
    w2 = p.input([f, h], shard(0, sizes))
    s = p.seq
    s.output(s.op("Add", x, s.op("MatMul", s.op("Relu", s.op("Add", s.op("MatMul", x, w1), b1)), w2)))
    for g in p.ranks:
        down = g.op("MatMul", g.op("Relu", g.op("Add", b1, g.op("MatMul", x, w1))), w2)
        g.output(g.op("Add", g.coll("AllReduce", down, p.group, reduce_op="sum"), x))
    witness(p, "commuted_mlp", {"elementwise", "matmul_row_parallel", "allreduce_sum"})


@in_turn(PARAMS, op=["Sub", "Div", "Pow", "Less", "MatMul"])
def test_neg_noncommutative_swapped(world: int, seed: int, uneven: bool, op: str) -> None:
    """f(x, y) on the sequential side, f(y, x) on the ranks, f not commutative: no relation."""
    p = Prog(world, seed, uneven)
    n = p.dim(3, 6)
    x, y = p.input([n, n], rep()), p.input([n, n], rep())
    pos = {"Pow", "Div"}  # positive bases and divisors: finite values either way
    a = p.seq.op("Abs", x) if op in pos else x
    bb = p.seq.op("Abs", y) if op in pos else y
    z = p.seq.output(p.seq.op(op, a, bb))
    for g in p.ranks:
        ga, gb = (g.op("Abs", x), g.op("Abs", y)) if op in pos else (x, y)
        g.output(g.op(op, gb, ga))
    refuted(p, f"neg_swapped_{op}", z)


@params
def test_neg_commuted_operand_from_another_rank(world: int, seed: int, uneven: bool) -> None:
    """seq x + y, x and y sharded alike; each rank swaps the operands but takes y's shard of
    the next rank: the swapped pair must still demand the same range in both slots."""
    p = Prog(world, seed, False)
    m, n = p.dim(), p.world * 2
    x = p.input([m, n], shard(1))
    y = p.input([m, n], rep())
    z = p.seq.output(p.seq.op("Add", x, y))
    for r, g in enumerate(p.ranks):
        nxt = (r + 1) % world
        ys = g.op("Slice", y, g.ints([2 * nxt]), g.ints([2 * nxt + 2]), g.ints([1]))
        g.output(g.op("Add", ys, x))
    refuted(p, "neg_commuted_wrong_shard", z)


# ============================================================================================
# 2. one-sided chains of views


def chain(g: Graph, t: str, shape: list[int], variant: str) -> str:
    """Views of t (of `shape`) that end at `shape` again."""
    a = shape[0]
    flat = int(np.prod(shape))
    if variant == "reshape_reshape":
        return g.op("Reshape", g.op("Reshape", t, g.ints([flat])), g.ints(shape))
    if variant == "flatten_reshape":
        return g.op("Reshape", g.op("Flatten", t, axis=1), g.ints(shape))
    if variant == "unsqueeze_squeeze":
        return g.op("Squeeze", g.op("Unsqueeze", t, g.ints([1])), g.ints([1]))
    if variant == "three_with_identity":
        u = g.op("Reshape", t, g.ints([a, -1, 1]))
        return g.op("Reshape", g.op("Identity", g.op("Reshape", u, g.ints([flat]))), g.ints(shape))
    raise ValueError(variant)


VIEW_VARIANTS = ["reshape_reshape", "flatten_reshape", "unsqueeze_squeeze", "three_with_identity"]


@in_turn(PARAMS, variant=VIEW_VARIANTS, axis=[0, 2])
def test_rank_view_chain(world: int, seed: int, uneven: bool, variant: str, axis: int) -> None:
    """seq relu(x); ranks view back(view(relu(x_r))): the chain's end is relu(x)'s shard."""
    p = Prog(world, seed, uneven)
    shape = [p.dim(), p.dim(), p.dim()]
    shape[axis], sizes = p.split()
    x = p.input(shape, shard(axis, sizes))
    p.seq.output(p.seq.op("Relu", x))
    for r, g in enumerate(p.ranks):
        local = p.local(shape, p.layouts[x], r)
        p.out_sl(g, chain(g, g.op("Relu", x), local, variant), axis, sizes is None)
    witness(p, f"rank_view_{variant}", {"rank_view_chain"})


@in_turn(PARAMS, variant=VIEW_VARIANTS)
def test_seq_view_chain(world: int, seed: int, uneven: bool, variant: str) -> None:
    """seq relu(view back(view(x))); ranks relu(x_r)."""
    p = Prog(world, seed, uneven)
    shape = [p.dim(), p.dim(), p.dim()]
    shape[1], sizes = p.split()
    x = p.input(shape, shard(1, sizes))
    p.seq.output(p.seq.op("Relu", chain(p.seq, x, shape, variant)))
    for g in p.ranks:
        p.out_sl(g, g.op("Relu", x), 1, sizes is None)
    witness(p, f"seq_view_{variant}", {"seq_view_chain"})


@params
def test_rank_view_chain_of_partials(world: int, seed: int, uneven: bool) -> None:
    """A rank flattens its partial and views it back before the all-reduce: still its piece."""
    p = Prog(world, seed, uneven)
    m, n = p.dim(), p.dim()
    s, ts = row_parallel(p, m, n)
    p.seq.output(p.seq.op("Relu", s))
    for g, t in zip(p.ranks, ts):
        back = chain(g, t, [m, n], "reshape_reshape")
        g.output(g.op("Relu", g.coll("AllReduce", back, p.group, reduce_op="sum")))
    witness(p, "rank_view_partials", {"rank_view_chain", "allreduce_sum"})


@params
@pytest.mark.parametrize("branch", ["same", "sibling"])
def test_rank_view_chain_meets_paired_reshape(world: int, seed: int, uneven: bool, branch: str) -> None:
    """seq relu(flatten(x)); ranks flatten x_r (the paired Reshape relates it), then view that as
    [m_r, n] and flatten it again -- or, on a sibling branch, view x_r as [m_r, n, 1] and flatten
    that: the second flat tensor has the first one's root and shape, so it is the first."""
    p = Prog(world, seed, uneven)
    n = p.dim()
    m, sizes = p.split()
    x = p.input([m, n], shard(0, sizes))
    p.seq.output(p.seq.op("Relu", p.seq.op("Reshape", x, p.seq.ints([m * n]))))
    for r, g in enumerate(p.ranks):
        ml = p.local([m, n], p.layouts[x], r)[0]
        flat = g.op("Reshape", x, g.ints([ml * n]))
        other = g.op("Reshape", flat, g.ints([ml, n])) if branch == "same" else g.op("Reshape", x, g.ints([ml, n, 1]))
        again = g.op("Reshape", other, g.ints([ml * n]))
        p.out_sl(g, g.op("Relu", again), 0, sizes is None)
    witness(p, "rank_view_after_pair", {"reshape", "rank_view_chain"})


@params
def test_neg_view_chain_to_another_shape(world: int, seed: int, uneven: bool) -> None:
    """[a, b] -> [ab] -> [b, a] on the ranks only: same size, another shape, not the identity."""
    p = Prog(world, seed, uneven)
    a = p.dim(2, 4)
    x = p.input([a, a + 1], rep())
    z = p.seq.output(p.seq.op("Relu", x))
    for g in p.ranks:
        g.output(g.op("Reshape", g.op("Reshape", g.op("Relu", x), g.ints([a * (a + 1)])), g.ints([a + 1, a])))
    out = refuted(p, "neg_view_other_shape", z)
    assert "rank_view_chain" not in out.lemmas_fired()


@params
@pytest.mark.parametrize("via", ["Neg", "Transpose"])
def test_neg_view_chain_through_another_op(world: int, seed: int, uneven: bool, via: str) -> None:
    """view back(f(view(relu(x)))) with f = Neg or a Transpose of the square view: the end has
    relu(x)'s shape, but f is not a view: no relation to relu(x)."""
    p = Prog(world, seed, uneven)
    a = p.dim(2, 5)
    x = p.input([a, a], rep())
    z = p.seq.output(p.seq.op("Relu", x))
    for g in p.ranks:
        if via == "Neg":
            mid = g.op("Neg", g.op("Reshape", g.op("Relu", x), g.ints([a * a])))
        else:
            mid = g.op("Reshape", g.op("Transpose", g.op("Reshape", g.op("Relu", x), g.ints([a, a, 1])),
                                       perm=[1, 0, 2]), g.ints([a * a]))
        g.output(g.op("Reshape", mid, g.ints([a, a])))
    out = refuted(p, f"neg_view_through_{via}", z)
    assert "rank_view_chain" not in out.lemmas_fired()


def test_neg_view_chain_end_without_static_size() -> None:
    """The same chain as a positive witness, with one axis of its end left without a static
    size (as shape inference leaves a symbolic axis): unknown is never assumed equal."""
    p = Prog(2, 0, False)
    shape = [4, 3, 2]
    x = p.input(shape, shard(0))
    p.seq.output(p.seq.op("Relu", x))
    ends = []
    for r, g in enumerate(p.ranks):
        ends.append(chain(g, g.op("Relu", x), p.local(shape, p.layouts[x], r), "reshape_reshape"))
        p.out_sl(g, ends[-1], 0, True)
    facts = lower_models(p.case("neg_view_unknown").loaded())
    assert "rank_view_chain" in {str(row[-1]) for row in solve(facts).get("rel_by")}
    ends_ids = {f"r{r}:{t}" for r, t in enumerate(ends)}
    facts.rows["dim"] = [row for row in facts.rows["dim"] if not (row[1] in ends_ids and row[2] == 1)]
    assert len(facts.rows["dim"]) > 0
    derived = solve(facts)
    assert "rank_view_chain" not in {str(row[-1]) for row in derived.get("rel_by")}
    assert not [t for _s, t, _l in derived.get("rel") if t in ends_ids]


# ============================================================================================
# 3. a negated condition with its branches swapped (core.lp, `nw(M)`)


@params
@pytest.mark.parametrize("swapped", [True, False])
def test_negated_where_with_swapped_branches(world: int, seed: int, uneven: bool, swapped: bool) -> None:
    """seq where(x > 0, x, y); ranks where(not (x > 0), y, x) on their shards (a causal mask as
    `masked_fill(~tril, -inf)` against `where(tril, scores, -inf)`). Not swapping the branches
    (where(not c, x, y)) computes something else: refused."""
    p = Prog(world, seed, uneven)
    m = p.dim()
    n, sizes = p.split()
    x, y = p.input([m, n], shard(1, sizes)), p.input([m, n], shard(1, sizes))
    zero = np.float32(0.0)
    z = p.seq.output(p.seq.op("Where", p.seq.op("Greater", x, p.seq.const(zero)), x, y))
    for g in p.ranks:
        negated = g.op("Not", g.op("Greater", x, g.const(zero)))
        p.out_sl(g, g.op("Where", negated, *((y, x) if swapped else (x, y))), 1, sizes is None)
    if swapped:
        witness(p, "negated_where", {"elementwise"} if sizes else {"elementwise", "allgather"})
    else:
        refuted(p, "negated_where_unswapped", z)


# ============================================================================================
# 4. two transposes that undo each other on one side (core.lp, `transposes_undone`)


@params
@pytest.mark.parametrize("side", ["seq", "rank"])
def test_transposes_undone_on_one_side(world: int, seed: int, uneven: bool, side: str) -> None:
    """transpose_Q(transpose_P(x)) = x for Q the inverse of P (an identity between them), on the
    sequential side or on the ranks; the other side reads x as it is."""
    p = Prog(world, seed, uneven)
    m, k = p.dim(), p.dim()
    n, sizes = p.split()
    x = p.input([m, n, k], shard(1, sizes))

    def round_trip(g: Graph, t: str) -> str:
        return g.op("Transpose", g.op("Identity", g.op("Transpose", t, perm=[1, 2, 0])), perm=[2, 0, 1])

    p.seq.output(p.seq.op("Relu", round_trip(p.seq, x) if side == "seq" else x))
    for g in p.ranks:
        p.out_sl(g, g.op("Relu", round_trip(g, x) if side == "rank" else x), 1, sizes is None)
    witness(p, f"transposes_undone_{side}", {"transposes_undone"})


@params
def test_transposes_that_do_not_undo_each_other_are_refused(world: int, seed: int, uneven: bool) -> None:
    """transpose by [1, 2, 0] twice on a cube is [2, 0, 1], not the identity: no relation to x."""
    p = Prog(world, seed, uneven)
    a = p.dim(2, 4)
    x = p.input([a, a, a], rep())
    z = p.seq.output(p.seq.op("Relu", x))
    for g in p.ranks:
        g.output(g.op("Relu", g.op("Transpose", g.op("Transpose", x, perm=[1, 2, 0]), perm=[1, 2, 0])))
    out = refuted(p, "transposes_not_undone", z)
    assert "transposes_undone" not in out.lemmas_fired()


# ============================================================================================
# 3. Pairing where every data input is widely read (rules/core.lp `least_read_data`)
# ============================================================================================


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("shift", [0, 1])
def test_an_unrolled_scan_pairs_its_steps(world: int, shift: int) -> None:
    """A scan unrolled over T > 8 steps, each a Gather of step t from one tensor at the constant
    t (Mamba's selective scan as torch.export unrolls it): the tensor has more than 8 readers and
    each constant one, so the steps seed from the tensor and pair step for step by their
    constants; the result verifies. `shift`: the ranks take step t + 1 where the sequential
    program takes t (the last step wrapped to 0): not verified, and no relation claims it."""
    from test_lemmas_structure import In, make_case, rng_for, size, witness

    rng = rng_for(f"unrolled_scan_{shift}", world)
    steps, d = 10, world * size(rng, 1, 3)
    inputs = {"x": In([d, steps], shard(0))}

    def body(g, x, r):
        outs = []
        for t in range(steps):
            k = (t + shift) % steps if r is not None else t
            outs.append(g.op("Unsqueeze", g.op("Tanh", g.op("Gather", x["x"], g.const(k, np.int64), axis=1)),
                             g.ints([1])))
        y = g.op("Concat", *outs, axis=1)
        return g.output(y if r is None else g.coll("AllGather", y, list(range(world)), axis=0))

    case, y, _ = make_case(f"unrolled_scan_{shift}", world, inputs, body)
    if shift == 0:
        witness(case, 0, "gather")
        return
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    assert not [lay for _, lay in out.relations_of(y)], out.relations_of(y)
