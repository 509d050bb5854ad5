"""Numeric witnesses for the lemmas a training step's backward needs (exporters/capture/train.py):
`pad` (rules/shape.lp: a shard passes through a constant Pad that pads its axis by zero, a
replica stays a replica, a partial sum passes through a Pad with value 0 or none), `expand` of a
partial sum or maximum (rules/shape.lp), `regrouped_sum` (rules/elementwise.lp: three terms summed
in another grouping and order, through a view), `replica_op`
(rules/routing.lp: replicated ScatterElements without a reduction with one index per row on the
scatter axis, a loss's labels; replicated ScatterND / ScatterElements accumulating with add, mul,
max or min, an embedding's gradient) and `norm` (rules/norm.lp: LayerNormalization's Mean and
InvStdDev outputs, like Y, keep a shard on an axis before the normalized ones, and replicas).

Positives (random shapes and values from a seeded rng, world sizes 2 to 4): the lemma fired and
held on the multi-rank simulator (`checked.lemmas_checked`), and the verdict is verified.
Soundness negatives (a shard padded on its own axis, a partial sum padded with a nonzero value,
ScatterND without a reduction, ScatterElements with two indices per row not from TopK,
LayerNormalization over the sharded axis): nothing related to the tensor, not verified.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

from harness import Case, Graph, Outcome, partial, rank_shape, rep, run_case, shard, simulate

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
In = tuple[list[int], dict, int]  # sequential shape, declared layout, dtype


def rng_for(name: str, *key: int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(name.encode()), *key])


def dim(rng: np.random.Generator, lo: int = 2, hi: int = 5) -> int:
    return int(rng.integers(lo, hi + 1))


def build(name: str, world: int, inputs: dict[str, In], body: Callable[[Graph, dict, int | None], Any]
          ) -> tuple[Case, Any]:
    """body(g, inputs, r) builds one side (r None: the sequential one); returns the case and
    what body returned on the sequential side."""
    seq = Graph()
    seq_ret = body(seq, {n: seq.input(n, s, d) for n, (s, _, d) in inputs.items()}, None)
    ranks = [Graph() for _ in range(world)]
    for r, g in enumerate(ranks):
        body(g, {n: g.input(n, rank_shape(s, lay, r, world), d) for n, (s, lay, d) in inputs.items()}, r)
    return Case(name, seq, ranks, {n: lay for n, (_, lay, _) in inputs.items()}), seq_ret


def kinds(out: Outcome, seq_t: str) -> set[str]:
    return {lay if isinstance(lay, str) else str(lay[0]) for _, lay in out.relations_of(seq_t)}


def witness(case: Case, seed: int, lemma: str) -> Outcome:
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert lemma in out.checked.lemmas_checked, f"fired: {sorted(out.lemmas_fired())}"
    assert out.derived.get("sanity") == [], out.derived.get("sanity")
    assert out.report.verdict == "verified", out.report.failure
    return out


def refused(case: Case, seed: int, seq_t: str, buggy: bool, verdict: str | None = None) -> Outcome:
    """Nothing related to seq_t, not verified, whatever was derived holds; `buggy`: the simulator
    shows that the ranks' first outputs are not the sequential one."""
    if buggy:
        sim = simulate(case, seed)
        want = sim.seq[case.seq.outputs[0]]
        got = [sim.ranks[r][g.outputs[0]] for r, g in enumerate(case.ranks)]
        assert not all(v.shape == want.shape and np.allclose(v, want, atol=1e-5) for v in got), "not buggy"
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == [], out.derived.get("sanity")
    assert out.relations_of(seq_t) == [], out.relations_of(seq_t)
    assert out.report.verdict != "verified"
    assert verdict is None or out.report.verdict == verdict, out.report.verdict
    return out


# --- Pad (rules/shape.lp) -----------------------------------------------------------------

def pads_for(rng: np.random.Generator, ndim: int, zero_axis: int | None = None) -> list[int]:
    """Random begins then ends in [0, 2], zero on `zero_axis`, not all zero."""
    begins, ends = [int(v) for v in rng.integers(0, 3, ndim)], [int(v) for v in rng.integers(0, 3, ndim)]
    if zero_axis is not None:
        begins[zero_axis] = ends[zero_axis] = 0
    other = 1 if zero_axis in (None, 0) else 0
    ends[other] = ends[other] or 1
    return begins + ends


def pad(g: Graph, x: str, pads: list[int], value: float | None, mode: bool = True) -> str:
    args = [x, g.ints(pads)] + ([g.const(value)] if value is not None else [])
    return g.op("Pad", *args, **({"mode": "constant"} if mode else {}))


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 2)])
@pytest.mark.parametrize("value", ["absent", "const"])
def test_pad_keeps_shard_on_unpadded_axis(world: int, seed: int, value: str) -> None:
    """pad(S[sl on A]) = pad(S)[sl on A] when the pads are zero on A (even and uneven shards)."""
    rng = rng_for("pad_shard", world, seed, len(value))
    axis, shape = int(rng.integers(0, 4)), [dim(rng) for _ in range(4)]
    sizes = [dim(rng, 1, 3) for _ in range(world)] if seed % 2 else None
    shape[axis] = sum(sizes) if sizes else world * dim(rng, 1, 2)
    pads, v = pads_for(rng, 4, axis), float(rng.normal()) if value == "const" else None
    case, y = build(f"pad_shard-{seed}", world, {"x": (shape, shard(axis, sizes), FLOAT)},
                    lambda g, x, r: g.output(pad(g, x["x"], pads, v, mode=seed != 1)))
    assert kinds(witness(case, seed, "pad"), y) == {"sl"}


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 2)])
def test_pad_of_replica(world: int, seed: int) -> None:
    """pad(S, c) = pad(S, c): a replica padded on any axes with the same constant."""
    rng = rng_for("pad_rep", world, seed)
    shape, pads, v = [dim(rng) for _ in range(3)], pads_for(rng, 3), float(rng.normal())
    case, y = build(f"pad_rep-{seed}", world, {"x": (shape, rep(), FLOAT)},
                    lambda g, x, r: g.output(pad(g, x["x"], pads, v)))
    assert kinds(witness(case, seed, "pad"), y) == {"rep"}


@pytest.mark.parametrize("world,seed,value,reduce", [(2, 0, "absent", True), (3, 1, "zero", True),
                                                     (4, 2, "zero", False), (2, 3, "absent", False)])
def test_pad_of_partial_sum(world: int, seed: int, value: str, reduce: bool) -> None:
    """pad(sum_k x_k, 0) = sum_k pad(x_k, 0) on any axes; the ranks all-reduce it, or output the
    padded pieces (the output rebuilds as their sum)."""
    rng = rng_for("pad_psum", world, seed)
    shape, pads = [dim(rng) for _ in range(3)], pads_for(rng, 3)

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = pad(g, x["x"], pads, 0.0 if value == "zero" else None)
        g.output(g.coll("AllReduce", y, list(range(world))) if reduce and r is not None else y)
        return y

    case, y = build(f"pad_psum-{seed}", world, {"x": (shape, partial(), FLOAT)}, body)
    assert "psum" in kinds(witness(case, seed, "pad"), y)


def test_pad_of_sharded_axis_is_refused() -> None:
    """Padding the sharded axis pads every rank's chunk: not the chunks of pad(S)."""
    world, seed = 3, 1
    rng = rng_for("pad_bad_shard", world, seed)
    axis, shape = int(rng.integers(0, 3)), [dim(rng) for _ in range(3)]
    shape[axis] = world * dim(rng, 1, 2)
    pads = pads_for(rng, 3)
    pads[axis + 3] += 1
    case, y = build(f"pad_bad_shard-{seed}", world, {"x": (shape, shard(axis), FLOAT)},
                    lambda g, x, r: g.output(pad(g, x["x"], pads, None)))
    refused(case, seed, y, buggy=True)


def test_pad_of_partial_sum_with_nonzero_value_is_refused() -> None:
    """sum_k pad(x_k, 1) has `world` in the padding, pad(sum_k x_k, 1) has 1."""
    world, seed = 2, 0
    rng = rng_for("pad_bad_psum", world, seed)
    shape, pads = [dim(rng) for _ in range(3)], pads_for(rng, 3)

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = pad(g, x["x"], pads, 1.0)
        g.output(y if r is None else g.coll("AllReduce", y, list(range(world))))
        return y

    case, y = build(f"pad_bad_psum-{seed}", world, {"x": (shape, partial(), FLOAT)}, body)
    refused(case, seed, y, buggy=True)


# --- scatters (rules/routing.lp) ----------------------------------------------------------

def scatter_inputs(op: str, v: int, h: int, n: int, axis: int = 1) -> dict[str, In]:
    """All replicated, indices declared in [0, v): ScatterND puts n rows into D [v, h];
    ScatterElements puts n values into each of the h lines of D along `axis` (of size v)."""
    if op == "ScatterND":
        data, idx, upd = [v, h], [n, 1], [n, h]
    else:
        data, idx = ([h, v], [h, n]) if axis == 1 else ([v, h], [n, h])
        upd = idx
    return {"d": (data, rep(), FLOAT), "i": (idx, {"layout": "rep", "range": [0, v]}, INT64), "u": (upd, rep(), FLOAT)}


@pytest.mark.parametrize("world,seed,axis,reduction", [(2, 0, 1, None), (3, 1, 1, "none"),
                                                       (4, 2, 0, None), (2, 3, 0, "none")])
def test_scatter_one_index_per_row(world: int, seed: int, axis: int, reduction: str | None) -> None:
    """ScatterElements(D, I, U) of replicas, I of size 1 on the scatter axis (one label per row:
    no target written twice), is a replica; D random, or the loss gradient's zeros."""
    rng = rng_for("scatter_row", world, seed)
    inputs = scatter_inputs("ScatterElements", dim(rng, 3, 7), dim(rng), 1, axis)
    attrs = ({} if (axis, seed) == (0, 2) else {"axis": axis}) | ({"reduction": reduction} if reduction else {})

    def body(g: Graph, x: dict, r: int | None) -> str:
        d = g.const(np.zeros(inputs["d"][0])) if seed % 2 else x["d"]
        return g.output(g.op("ScatterElements", d, x["i"], x["u"], **attrs))

    case, y = build(f"scatter_row-{seed}", world, inputs, body)
    assert kinds(witness(case, seed, "replica_op"), y) == {"rep"}


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize("op", ["ScatterND", "ScatterElements"])
def test_scatter_with_reduction(reduction: str, op: str) -> None:
    """A scatter accumulating with add / mul / max / min does not depend on the order of its
    duplicate targets: replicated inputs give a replica (an embedding's gradient)."""
    seed = ["add", "mul", "max", "min"].index(reduction) + 4 * (op == "ScatterND")
    world, rng = 2 + seed % 3, rng_for("scatter_red", seed)
    v, h, n = dim(rng, 2, 3), dim(rng), dim(rng, 5, 8)  # n > v: duplicate indices
    inputs = scatter_inputs(op, v, h, n)
    attrs = {"reduction": reduction} | ({"axis": 1} if op == "ScatterElements" else {})
    case, y = build(f"scatter_{op}_{reduction}", world, inputs,
                    lambda g, x, r: g.output(g.op(op, x["d"], x["i"], x["u"], **attrs)))
    assert kinds(witness(case, seed, "replica_op"), y) == {"rep"}


@pytest.mark.parametrize("seed,op,reduction", [(0, "ScatterND", None), (1, "ScatterND", "none"),
                                               (2, "ScatterElements", "none")])
def test_scatter_without_reduction_not_taken(seed: int, op: str, reduction: str | None) -> None:
    """ScatterND without a reduction, and ScatterElements with two indices per row on the
    scatter axis that are not TopK's, may write a target twice in no defined order: unproven
    even with replicated inputs (the simulator's order agrees, so not refuted)."""
    rng = rng_for("scatter_none", seed)
    v, h = dim(rng, 3, 5), dim(rng)
    inputs = scatter_inputs(op, v, h, dim(rng, 2, 3) if op == "ScatterND" else 2)
    attrs = ({"reduction": reduction} if reduction else {}) | ({"axis": 1} if op == "ScatterElements" else {})
    case, y = build(f"scatter_none_{op}-{seed}", 2, inputs,
                    lambda g, x, r: g.output(g.op(op, x["d"], x["i"], x["u"], **attrs)))
    refused(case, seed, y, buggy=False, verdict="unproven")


# --- LayerNormalization's saved statistics (rules/norm.lp) --------------------------------

@pytest.mark.parametrize("world,seed,s_axis", [(2, 0, None), (3, 1, 0), (4, 2, 1), (2, 3, 0), (3, 4, 1)])
def test_layernorm_mean_and_inv_std(world: int, seed: int, s_axis: int | None) -> None:
    """LN(S[sl on A]) = LN(S)[sl on A] for A < axis, and LN(S) = LN(S), for all three outputs
    (Y, Mean, InvStdDev: statistics of each row, which keep the axes before `axis`)."""
    rng = rng_for("ln_stats", world, seed)
    shape = [dim(rng) for _ in range(3)]
    if s_axis is not None:
        shape[s_axis] = world * dim(rng, 1, 2)
    c = int(rng.integers(1 if s_axis is None else s_axis + 1, 3))  # the first normalized axis
    attrs = {} if c == 2 and seed == 0 else {"axis": c - 3 if seed % 2 else c}  # default, >= 0, < 0
    inputs = {"x": (shape, rep() if s_axis is None else shard(s_axis), FLOAT),
              "scale": (shape[c:], rep(), FLOAT), "bias": (shape[c:], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> list[str]:
        return [g.output(t) for t in g.op_n("LayerNormalization", x["x"], x["scale"], x["bias"], outputs=3, **attrs)]

    case, outs = build(f"ln_stats-{seed}", world, inputs, body)
    out = witness(case, seed, "norm")
    for t in outs:
        assert kinds(out, t) == {"rep" if s_axis is None else "sl"}, t


def test_layernorm_over_sharded_axis_is_refused() -> None:
    """A rank normalizing its chunk of the normalized axis gets its chunk's statistics, not the
    row's (scale and bias of shape [1], broadcast, so that they stay replicated)."""
    world, seed = 2, 0
    rng = rng_for("ln_bad", world, seed)
    shape = [dim(rng), dim(rng), world * dim(rng, 2, 3)]
    inputs = {"x": (shape, shard(2), FLOAT), "scale": ([1], rep(), FLOAT), "bias": ([1], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> list[str]:
        y, mean, inv_std = g.op_n("LayerNormalization", x["x"], x["scale"], x["bias"], outputs=3, axis=-1)
        return [g.output(t) for t in (mean, inv_std, y)]  # Mean first: same shape on both sides

    case, outs = build(f"ln_bad-{seed}", world, inputs, body)
    out = refused(case, seed, outs[0], buggy=True)
    assert all(out.relations_of(t) == [] for t in outs)


# --- expand of partials (rules/shape.lp) ----------------------------------------------------------


@pytest.mark.parametrize("world,seed,op", [(2, 0, "sum"), (3, 1, "sum"), (2, 2, "max")])
def test_expand_of_partial(world: int, seed: int, op: str) -> None:
    """expand(sum_k x_k) = sum_k expand(x_k) and expand(max_k x_k) = max_k expand(x_k): the ranks
    broadcast their pieces to the same shape, then reduce (or output the pieces)."""
    rng = rng_for("expand_partial", world, seed)
    b, h = dim(rng), dim(rng)

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = g.op("Expand", x["x"], g.ints([b, 1, h]))
        g.output(g.coll("AllReduce", y, list(range(world)), reduce_op=op) if r is not None and seed else y)
        return y

    case, y = build(f"expand_partial-{seed}", world, {"x": ([b, 1, 1], partial(op), FLOAT)}, body)
    assert {"psum" if op == "sum" else "pmax"} <= kinds(witness(case, seed, "expand"), y)


# --- regrouped sums (rules/elementwise.lp) ------------------------------------------------------------


@pytest.mark.parametrize("world,seed,layout,order", [(2, 0, "shard", "inner_right"), (3, 1, "rep", "inner_left"),
                                                    (2, 2, "shard", "swapped"), (4, 3, "shard", "view")])
def test_regrouped_sum(world: int, seed: int, layout: str, order: str) -> None:
    """(a + b) + c = a + (b + c) = (c + a) + b = ...: the ranks add the same three terms in another
    grouping and order (`view`: their inner sum read through a reshape to its own shape)."""
    rng = rng_for("regroup", world, seed)
    shape = [dim(rng), world * dim(rng, 1, 2), dim(rng)]
    lay = shard(1) if layout == "shard" else rep()
    inputs = {n: (shape, lay, FLOAT) for n in "abc"}

    def body(g: Graph, x: dict, r: int | None) -> str:
        a, b, c = x["a"], x["b"], x["c"]
        if r is None:
            y = g.op("Add", g.op("Add", a, b), c)
        elif order == "inner_right":
            y = g.op("Add", a, g.op("Add", b, c))
        elif order == "inner_left":
            y = g.op("Add", g.op("Add", b, c), a)
        elif order == "swapped":
            y = g.op("Add", g.op("Add", c, a), b)
        else:
            inner = g.op("Add", c, b)
            y = g.op("Add", a, g.op("Reshape", inner, g.ints(rank_shape(shape, lay, r, world))))
        return g.output(y)

    case, _ = build(f"regroup-{order}-{seed}", world, inputs, body)
    witness(case, seed, "regrouped_sum")


def test_regrouped_sum_of_other_terms_is_refused() -> None:
    """(a + b) + c against a + (b + b): one term differs, no regrouping relates them."""
    world, seed = 2, 0
    rng = rng_for("regroup_bad", world, seed)
    shape = [dim(rng), 2 * world, dim(rng)]
    inputs = {n: (shape, shard(1), FLOAT) for n in "abc"}

    def body(g: Graph, x: dict, r: int | None) -> str:
        a, b, c = x["a"], x["b"], x["c"]
        y = g.op("Add", g.op("Add", a, b), c) if r is None else g.op("Add", a, g.op("Add", b, b))
        return g.output(y)

    case, y = build(f"regroup_bad-{seed}", world, inputs, body)
    refused(case, seed, y, buggy=True)


# --- constants too large to fold that hold one value (refine/lowering/fold.py: splat_values) -------


@pytest.mark.parametrize("rank_fill", [0.0, 1.0])
def test_large_zeros_accumulated_into_are_equal_constants(rank_fill: float) -> None:
    """An embedding's gradient accumulates into zeros of vocab x hidden, too large to fold: equal
    one-value tensors (Expand, Transpose, Cast of one value) are equal constants, so the
    replicated scatter-add into them is a replica; zeros on one side and ones on the other are not."""
    world, seed = 2, 0
    rows, cols, n = 300, 256, 5  # 76800 elements: above fold.FOLD_LIMIT
    inputs = {"idx": ([n, 1], {"layout": "rep", "range": [0, rows]}, INT64), "upd": ([n, cols], rep(), FLOAT)}

    def body(g: Graph, x: dict, r: int | None) -> str:
        fill = 0.0 if r is None else rank_fill
        zeros = g.op("Expand", g.const(np.float64(fill), np.float64), g.ints([cols, rows]))
        data = g.op("Transpose", g.op("Cast", zeros, to=FLOAT), perm=[1, 0])
        return g.output(g.op("ScatterND", data, x["idx"], x["upd"], reduction="add"))

    case, y = build(f"splat-{rank_fill}", world, inputs, body)
    if rank_fill == 0.0:
        witness(case, seed, "replica_op")
    else:
        refused(case, seed, y, buggy=True)
