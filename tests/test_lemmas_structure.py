"""Numeric witnesses for the structural lemmas: rules/shape.lp, reduce.lp, norm.lp, collectives.lp.

Every lemma name these four files derive (`rel_by(..., name)`) has at least one positive case
here: a sequential program and per-rank programs built with random sizes (a numpy rng seeded
per test; sizes 2..7, shard dims a multiple of the world size, or uneven shards via
`shard(axis, sizes=[...])` where the lemma and the collectives allow it), world sizes 2, 3, 4,
a few seeds each. A positive case asserts that the lemma fired AND that the relation it
derived held on the multi-rank simulation (`checked.lemmas_checked`), that no derived relation
is numerically wrong (`checked.ok`), that no sanity invariant broke, and, where the program is
complete, that the whole program verifies.  Partial results are always completed by a
collective (or tile as graph outputs), so the witness check can combine them.

Covered: Transpose with and without perm; Reshape splitting a sharded axis on its OUTER factor
(heads, also with 0/-1 in the shape), merging axes, Flatten, Squeeze/Unsqueeze (axes as an
int64 input, opset 18); Slice/Split on another axis, and on the sharded axis rank-locally and on
the sequential side; Concat on both sides, a fused sequential Concat vs separate rank tensors,
a rank concatenating adjacent parts; Expand (with broadcast leading axes); Gather with data
sharded before/after the gathered axis and with sharded indices; Reduce* over unsharded axes
(keepdims 0/1, axes as an input at opset 18 and as an attribute at opset 17), ReduceSum/Max
over the sharded axis, ReduceSum/Mean of partial sums, ReduceMax of partial maxes; Softmax and
LogSoftmax; LayerNormalization (opset 17+, with and without bias); AllReduce sum/max/min,
AllGather, ReduceScatter, AllToAll, including sub-groups of the world (world 4, groups [0,1]
and [2,3], and a second level over [0,2] and [1,3]) and a reversed group order done right;
Broadcast from any root; Send/Recv along a chain of stages (in a scrambled order too) and in a
ring, carrying shards and partial sums, and micro-batches sent in order;
the vocab-parallel embedding (values.lp, embedding.lp) written three ways (Megatron's
masked_fill form, torch.where with the owned mask, Not/Greater/LessOrEqual/Add), even and
uneven rows.

Soundness negatives (each is a real numeric difference between the sequential output and the
ranks', checked on the simulation; no relation of the wrong kind may be derived for the
specific sequential tensor; the whole program must not verify; every relation that IS derived
must still hold numerically): Reshape splitting the sharded axis on the INNER factor (BUGS.md
class 8) and merging axes where the sharded axis is the inner one; Softmax, ReduceMean and
LayerNorm over the sharded axis; an integer ReduceMean of partial sums (truncation); Gather
along the sharded axis; AllReduce over the wrong group
(four pieces, reduced within [0,1] and [2,3] only); AllGather on the wrong axis; AllGather,
AllToAll and ReduceScatter+AllGather with a group order that does not match the shard order; a
rank concatenating its parts out of order; ReduceScatter
on an axis whose chunks do not match the consumer's; collectives whose members disagree on the
attributes, and a member that never makes the call (both reported as collective mismatches;
there the simulator itself refuses to run the programs); the vocab-parallel embedding without
a declared id range or with negative ids allowed, an owned range off by one, foreign rows not
zeroed or filled with 1, ids shifted one row too far, and the local ids, the zeroing mask or
both taken from the next rank's rows; point-to-point calls that cannot run together (a ring
where every rank sends first, a Send to a rank that expects nothing, a tag the receiver does
not use) and a stage sending its micro-batches out of order.
"""

from __future__ import annotations

from pathlib import Path

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

import refine.kit.cases
from harness import Case, Graph, Outcome, in_turn, partial, rep, run_case, shard, simulate, world_seed_grid
from refine import dist
from refine.run.engine import solve
from refine.kit.rulebook import inventory
from refine.lowering.graphs import lower_models
from refine.diagnose.diagnosis import build_report
from refine.report.render import render_text
from refine.report.schema import Report
from refine.diagnose.simulate import SimulationError

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
WORLDS = (2, 3, 4)
SEEDS = (0, 1, 2)
grid = pytest.mark.parametrize("world,seed", world_seed_grid(WORLDS, SEEDS))  # all 9 under benchmarks/sweep.py
seeds = pytest.mark.parametrize("seed", SEEDS)

RULE_FILES = ("shape.lp", "reduce.lp", "norm.lp", "collectives.lp", "values.lp", "embedding.lp", "routing.lp", "ranges.lp")
WITNESSED = {
    "transpose", "reshape", "reshape_keep_axis", "slice", "block_slice", "repeat_group", "rank_slice", "rank_whole_slice", "seq_slice", "concat", "seq_concat", "rank_concat",
    "expand", "gather", "reduce", "reduce_sum_sharded", "reduce_max_sharded", "reduce_linear",
    "reduce_max_partial", "softmax", "norm", "allreduce_sum", "allreduce_max", "allreduce_idempotent",
    "allreduce_sum_of_replicas", "allgather", "reduce_scatter", "all_to_all",
    "allreduce_avg", "allreduce_avg_of_replicas", "reduce_scatter_avg", "reduce_scatter_avg_of_replicas",
    "reduce_scatter_sum_of_replicas", "reduce_scatter_avg_block",
    "allgather_block", "reduce_scatter_block", "allgather_transposed", "allgather_unit_axis",
    "broadcast", "recv", "send",
    "value_compare", "value_bool", "value_offset", "value_window", "vocab_parallel_gather", "replica_op",
    "rank_concat_blocks", "partial_concat", "expand_broadcast", "value_view", "row_take", "owned_sum", "owned_rows", "scatter_owned", "seq_passes", "rank_passes",
    "pad",  # its witnesses: tests/test_lemmas_backward.py
    "reduce_scatter_slices", "reduce_scatter_avg_slices",  # their witnesses: tests/test_lemmas_fsdp_tp.py
}


# --------------------------------------------------------------------------------------------
# Building cases


@dataclass
class In:
    """A declared graph input: sequential shape, layout (harness rep/shard/partial), dtype."""

    shape: list[int]
    layout: dict
    dtype: int = FLOAT


def local_shape(inp: In, r: int, world: int) -> list[int]:
    shape = list(inp.shape)
    if inp.layout["layout"] == "shard":
        axis = inp.layout["axis"] % len(shape)
        shape[axis] = (inp.layout.get("sizes") or [shape[axis] // world] * world)[r]  # (strided: even too)
    return shape


def cuts(sizes: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) of consecutive parts of the given sizes."""
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


Body = Callable[[Graph, dict[str, str], "int | None"], Any]


def make_case(name: str, world: int, inputs: dict[str, In], body: Body) -> tuple[Case, Any, list[Any]]:
    """The body builds one side: r is None for the sequential program, else the rank.

    Returns the case, the body's return value on the sequential side and on every rank."""
    seq = Graph()
    seq_ret = body(seq, {n: seq.input(n, i.shape, i.dtype) for n, i in inputs.items()}, None)
    ranks, rank_rets = [], []
    for r in range(world):
        g = Graph()
        rank_rets.append(body(g, {n: g.input(n, local_shape(i, r, world), i.dtype) for n, i in inputs.items()}, r))
        ranks.append(g)
    return Case(name, seq, ranks, {n: i.layout for n, i in inputs.items()}), seq_ret, rank_rets


def rng_for(name: str, *key: int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(name.encode()), *key])


def size(rng: np.random.Generator, lo: int = 2, hi: int = 7) -> int:
    return int(rng.integers(lo, hi + 1))


def composition(rng: np.random.Generator, total: int, parts: int, least: int = 1) -> list[int]:
    """Random sizes >= least adding up to total."""
    assert total >= parts * least
    cut = sorted(rng.choice(np.arange(1, total - parts * (least - 1)), size=parts - 1, replace=False)) \
        if parts > 1 else []
    sizes = np.diff([0, *cut, total - parts * (least - 1)]) + (least - 1)
    return [int(s) for s in sizes]


def sharded(rng: np.random.Generator, axis: int, world: int, uneven: bool, least: int = 1) -> tuple[int, dict]:
    """(dimension, layout) of an axis sharded over `world` ranks, evenly or not."""
    if uneven:
        dim = size(rng, max(2, world * least), max(7, world * least + 1))
        return dim, shard(axis, sizes=composition(rng, dim, world, least))
    return world * size(rng, max(1, least), 2 + least), shard(axis)


def bounds_of(layout: dict, dim: int, world: int) -> list[tuple[int, int]]:
    return cuts(layout.get("sizes") or [dim // world] * world)


def everyone(world: int) -> list[int]:
    return list(range(world))


def scrambled(world: int) -> list[int]:
    """A group order that is not the shard order: [1, .., K-1, 0], or for 4 ranks [0, 2, 1, 3]
    (first and last member in place, so only the adjacency of the middle pieces is wrong)."""
    return [0, 2, 1, 3] if world == 4 else everyone(world)[1:] + [0]


# --------------------------------------------------------------------------------------------
# Running and asserting


def checked_clauses(out: Outcome) -> set[str]:
    """`lemma:kind` for every derived relation that held on the numbers (kind: rep, sl, psum, ...)."""
    unchecked = {(s, t, lay if kind(lay) not in ("psum", "pmax") else kind(lay)) for s, t, lay in out.checked.unchecked}
    rels = {(str(s), str(t), lay) for s, t, lay in out.derived.get("rel")}
    return {f"{lemma}:{kind(lay)}" for s, t, lay, lemma in out.derived.get("rel_by")
            if (s, t, lay) in rels and (s, t, lay if kind(lay) not in ("psum", "pmax") else kind(lay)) not in unchecked}


def witness(case: Case, seed: int, *lemmas: str, verified: bool = True) -> Outcome:
    """The lemmas fired and were checked on the numbers; nothing derived is wrong or insane.

    A lemma given as `name:kind` must have fired with a layout of that kind (one clause of it)."""
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    names = {lm.split(":")[0] for lm in lemmas}
    missing = names - out.checked.lemmas_checked
    missing |= {lm for lm in lemmas if ":" in lm} - checked_clauses(out)
    assert not missing, (f"not witnessed: {missing}; fired {sorted(out.lemmas_fired())}; "
                         f"checked {sorted(checked_clauses(out))}; unchecked {out.checked.unchecked}")
    assert out.derived.get("sanity") == []
    if verified:
        assert out.report.verdict == "verified", render_text(out.report)
    return out


def assert_rebuilt_from_rank_tensors(out: Outcome) -> None:
    """Every sequential output is rebuilt from some rank tensors (complete(S, any)): for cases
    whose ranks hold an output's pieces under other names, which the output rule (every rank's
    same-named output takes part, docs/model-dir.md) does not accept as a verdict."""
    complete = {str(s) for s, scope in out.derived.get("complete") if scope == "any"}
    outputs = {str(s) for name in ("output_ok", "output_bad") for (s,) in out.derived.get(name)}
    assert outputs and outputs <= complete, outputs - complete


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-4, atol=1e-4))


def refused(case: Case, seed: int, seq_tensor: str, seq_out: str, rank_outs: list[str],
            wrong: Callable[[str, object], bool] = lambda t, lay: True) -> Outcome:
    """A buggy program: a real numeric difference, no wrong relation for `seq_tensor`, not verified,
    and whatever was derived still holds."""
    sim = simulate(case, seed)
    assert not all(same(sim.ranks[r][t], sim.seq[seq_out]) for r, t in enumerate(rank_outs)), \
        "the negative case is not buggy: every rank computes the sequential output"
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    bad = [(t, lay) for t, lay in out.relations_of(seq_tensor) if wrong(t, lay)]
    assert not bad, f"unsound relations for {seq_tensor}: {bad}"
    assert out.report.verdict != "verified", render_text(out.report)
    return out


def static_report(case: Case) -> tuple[Report, Any]:
    """Lower, solve and report without simulating (for programs the simulator refuses to run)."""
    dist.register_schemas()
    facts = lower_models(case.loaded())
    derived = solve(facts)
    return build_report(case.name, facts, derived), derived


def kind(lay: object) -> str:
    return lay if isinstance(lay, str) else str(lay[0])  # type: ignore[index]


def reduce_all(g: Graph, x: str, r: int | None, world: int, op: str = "sum", group: list[int] | None = None) -> str:
    """On a rank, AllReduce over the group (default: the world); the sequential side is unchanged."""
    return x if r is None else g.coll("AllReduce", x, group or everyone(world), reduce_op=op)


def test_inventory_matches_rule_files() -> None:
    """Every lemma the four rule files derive has a witness here (and nothing here is stale)."""
    names = {lemma.name for lemma in inventory().lemmas if lemma.file.rsplit("/", 1)[-1] in RULE_FILES}
    for name, module in WITNESSED_ELSEWHERE.items():
        text = (Path(__file__).parent / module).read_text()
        assert f'"{name}"' in text or f'"{name}:' in text, (name, module)  # (a witness by name, or name:style)
    assert names - set(WITNESSED_ELSEWHERE) == WITNESSED


# lemmas of these files whose witnesses live with the programs that need them
WITNESSED_ELSEWHERE = {**{name: "test_lemmas_data_parallel.py"
                          for name in ("pick_sliced", "scatter_add_rows", "scatter_add_partial", "reduce_sum_blocks",
                                       "reduce_scatter_transposed")},
                       **{name: "test_lemmas_windows.py" for name in ("allreduce_slices", "allreduce_avg_slices",
                                                                      "allreduce_slices_scaled",
                                                                      "allreduce_avg_slices_scaled")},
                       "slice_step": "test_lemmas_strided.py", "scatter_slabs": "test_lemmas_permutations.py",
                       **{name: "test_lemmas_permutations.py" for name in ("scatter_write_partial", "slice_of_concat")},
                       **{name: "test_lemmas_vocab_clamp.py" for name in ("vocab_parallel_clamped_gather", "owned_rows_mul")},
                       **{name: "test_lemmas_scaled_sums.py" for name in ("reduce_scaled", "allreduce_sum_scaled",
                                                                          "allreduce_avg_scaled", "gather_owned_row")},
                       **{name: "test_lemmas_scales.py" for name in ("reduce_scatter_scaled", "reduce_scatter_avg_scaled")},
                       **{name: "test_lemmas_owned_rows.py" for name in ("value_block", "value_window_mod",
                                                                         "value_window_clip", "value_window_compare")}}


# ============================================================================================
# shape.lp
# ============================================================================================


@grid
@pytest.mark.parametrize("with_perm", [True, False])
def test_transpose(world: int, seed: int, with_perm: bool) -> None:
    rng = rng_for("transpose", world, seed, with_perm)
    axis = int(rng.integers(3))
    d, lay = sharded(rng, axis, world, uneven=seed % 2 == 1)
    shape = [size(rng) for _ in range(3)]
    shape[axis] = d
    perm = [int(p) for p in rng.permutation(3)] if with_perm else None
    attrs = {"perm": perm} if perm else {}
    inputs = {"x": In(shape, lay), "y": In([size(rng) for _ in range(3)], rep()),
              "p": In([size(rng) for _ in range(3)], partial())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(g.op("Transpose", x["x"], **attrs))
        g.output(g.op("Transpose", x["y"], **attrs))
        g.output(reduce_all(g, g.op("Transpose", x["p"], **attrs), r, world))

    case, _, _ = make_case("transpose", world, inputs, body)
    witness(case, seed, "transpose:sl", "transpose:rep", "transpose:psum", "allreduce_sum")


@grid
def test_reshape_split_heads_outer_factor(world: int, seed: int) -> None:
    """[b,s,h*dh] sharded by whole heads -> [b,s,h,dh] -> transpose -> back: the shard stays on h."""
    rng = rng_for("reshape_heads", world, seed)
    b, s, dh = size(rng), size(rng), size(rng, 2, 4)
    uneven = seed % 2 == 1
    heads = composition(rng, size(rng, world, 7), world) if uneven else [size(rng, 1, 2)] * world
    h = sum(heads)
    inputs = {"x": In([b, s, h * dh], shard(2, sizes=[n * dh for n in heads]) if uneven else shard(2))}
    wildcard = seed == 0  # a shape with 0 (copy) and -1 (infer), as exporters write it

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        nh = h if r is None else heads[r]
        q = g.op("Reshape", x["x"], g.ints([0, 0, -1, dh] if wildcard else [b, s, nh, dh]))
        t = g.output(g.op("Transpose", q, perm=[0, 2, 1, 3]))
        back = g.op("Transpose", t, perm=[0, 2, 1, 3])
        g.output(g.op("Reshape", back, g.ints([b, s, nh * dh])))

    case, _, _ = make_case("reshape_heads", world, inputs, body)
    witness(case, seed, "reshape:sl", "transpose:sl")


@grid
def test_reshape_merge_and_flatten(world: int, seed: int) -> None:
    """Merging axes where the sharded axis is the outer one of the group: the shard scales."""
    rng = rng_for("reshape_merge", world, seed)
    a, lay = sharded(rng, 0, world, uneven=seed % 2 == 1)
    b, c = size(rng), size(rng)
    d1, lay1 = sharded(rng, 1, world, uneven=seed % 2 == 0)
    e = size(rng)
    inputs = {"x": In([a, b, c], lay), "y": In([e, d1, c], lay1), "p": In([a, b, c], partial())}
    xb = bounds_of(lay, a, world)

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        ar = a if r is None else xb[r][1] - xb[r][0]
        g.output(g.op("Reshape", x["x"], g.ints([ar * b, c])))
        g.output(g.op("Reshape", x["x"], g.ints([ar, b * c])))
        for axis in (0, 1, 2):
            g.output(g.op("Flatten", x["x"], axis=axis))
        g.output(g.op("Flatten", x["y"], axis=1))  # [e, d1*c]: shard axis 1 is outer of (d1, c)
        g.output(reduce_all(g, g.op("Reshape", x["p"], g.ints([a * b * c])), r, world))

    case, _, _ = make_case("reshape_merge", world, inputs, body)
    witness(case, seed, "reshape:sl", "reshape:psum", "allreduce_sum")


@grid
def test_squeeze_unsqueeze(world: int, seed: int) -> None:
    rng = rng_for("squeeze", world, seed)
    axis = seed % 2
    d, lay = sharded(rng, axis, world, uneven=world != 2)
    shape = [size(rng), size(rng)]
    shape[axis] = d
    inputs = {"x": In(shape, lay), "p": In([size(rng), size(rng)], partial())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        u = g.output(g.op("Unsqueeze", x["x"], g.ints([0, 2])))  # [1, a, 1, b]
        g.output(g.op("Squeeze", u, g.ints([0, -2])))
        g.output(g.op("Unsqueeze", x["x"], g.ints([-1])))  # [a, b, 1]
        g.output(reduce_all(g, g.op("Unsqueeze", x["p"], g.ints([1])), r, world))

    case, _, _ = make_case("squeeze", world, inputs, body)
    witness(case, seed, "reshape:sl", "reshape:psum", "allreduce_sum")


@grid
def test_slice_and_split_on_another_axis(world: int, seed: int) -> None:
    rng = rng_for("slice_other", world, seed)
    a, lay = sharded(rng, 0, world, uneven=seed % 2 == 1)
    b = size(rng, 3, 7)
    lo = int(rng.integers(0, b - 1))
    hi = int(rng.integers(lo + 1, b + 1))
    if (lo, hi) == (0, b):
        lo = 1
    end = hi - b if hi < b and seed == 0 else hi  # a negative end, normalized by the lowering
    parts = composition(rng, b, int(rng.integers(2, 4)))
    inputs = {"x": In([a, b], lay), "p": In([size(rng), b], partial())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(g.op("Slice", x["x"], g.ints([lo]), g.ints([end]), g.ints([1])))
        # two axes named, only axis 1 cut (axis 0 is the whole range on every side)
        g.output(g.op("Slice", x["x"], g.ints([0, lo]), g.ints([2**62, hi]), g.ints([0, -1])))
        for t in g.op_n("Split", x["x"], g.ints(parts), outputs=len(parts), axis=1):
            g.output(t)
        g.output(reduce_all(g, g.op("Slice", x["p"], g.ints([lo]), g.ints([hi]), g.ints([1])), r, world))

    case, _, _ = make_case("slice_other", world, inputs, body)
    witness(case, seed, "slice:sl", "slice:psum", "allreduce_sum")


def _strided_matmul_case(name: str, world: int, seed: int, stride: int,
                         cut: Callable[[Graph, str, int, int | None], list[str]]) -> tuple[Case, Any, list[Any]]:
    """x [b, h] @ W^T, W [stride*F, h] declared strided (Megatron's partition_stride: rank k holds
    chunk k of every block), so that y = x W^T is blk(1, F, kF/N, (k+1)F/N) of the sequential y;
    `cut(g, y, F, r)` takes the pieces (F: the sequential block size, r None on the seq side)."""
    rng = rng_for(name, world, seed)
    b, h, block = size(rng), size(rng), world * size(rng, 1, 3)
    inputs = {"x": In([b, h], rep()), "w": In([stride * block, h], {"layout": "shard", "axis": 0, "stride": stride})}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        y = g.op("MatMul", x["x"], g.op("Transpose", x["w"], perm=[1, 0]))
        pieces = cut(g, y, block, r)
        for piece in pieces:
            g.output(g.op("Relu", piece))
        return pieces

    return make_case(name, world, inputs, body)


@grid
def test_block_slice_of_a_strided_shard(world: int, seed: int) -> None:
    """Megatron's SwiGLU fc1 (partition_stride 2): the strided weight's product is split into
    whole blocks on both sides, each block a plain shard. Seed 0: Split in two; 1: three blocks
    cut by Slice, one block and then two together (blk again); 2: the torch spelling,
    SplitToSequence + SequenceAt with unequal sizes [F, 2F] over three blocks."""
    stride = 2 if seed == 0 else 3

    def cut(g: Graph, y: str, block: int, r: int | None) -> list[str]:
        part = block if r is None else block // world
        if seed == 0:
            return g.op_n("Split", y, g.ints([part, part]), axis=1, outputs=2)
        if seed == 1:
            return [g.op("Slice", y, g.ints([lo * part]), g.ints([hi * part]), g.ints([1])) for lo, hi in ((1, 2), (0, 2))]
        chunks = g.op("SplitToSequence", y, g.ints([part, 2 * part]), axis=1)
        return [g.op("SequenceAt", chunks, g.const(k, np.int64)) for k in (0, 1)]

    case, _, _ = _strided_matmul_case("block_slice", world, seed, stride, cut)
    witness(case, seed, "block_slice:sl", *(["block_slice:blk"] if seed > 0 else []))


def _glu_backward_case(name: str, world: int, seed: int, swapped: bool = False) -> tuple[Case, Any, list[Any]]:
    """x [b, h] @ W^T with W [2F, h] strided (stride 2: rank k holds its gate and its up rows);
    the product split into gate and up, each transformed, concatenated back ([gate; up] on the
    sequential side, [gate_k; up_k] on rank k: `swapped` puts up first) and contracted with W
    again (the backward of SwiGLU's fc1 to its input), all-reduced on the ranks."""

    def cut(g: Graph, y: str, block: int, r: int | None) -> list[str]:
        part = block if r is None else block // world
        gate, up = g.op_n("Split", y, g.ints([part, part]), axis=1, outputs=2)
        gate, up = g.op("Relu", gate), g.op("Sigmoid", up)
        joined = g.op("Concat", *((up, gate) if swapped and r is not None else (gate, up)), axis=1)
        g.output(joined)
        back = g.op("MatMul", joined, "w")
        return [back if r is None else g.coll("AllReduce", back, everyone(world))]

    return _strided_matmul_case(name, world, seed, 2, cut)


@grid
def test_concat_of_block_pieces_and_its_contraction(world: int, seed: int) -> None:
    """A rank concatenating the same inner range of every block holds that blk of the sequential
    concatenation; contracting it with the strided weight gives a partial sum over the blocks'
    inner ranges, all-reduced to the sequential product."""
    case, _, _ = _glu_backward_case("glu_backward", world, seed)
    witness(case, seed, "rank_concat_blocks", "matmul_row_blocks", "allreduce_sum", "block_slice")


@grid
def test_concat_of_block_pieces_out_of_order_is_refused(world: int, seed: int) -> None:
    """[up_k; gate_k] where the sequential program has [gate; up]: not a blk of it."""
    case, seq_outs, rank_outs = _glu_backward_case("neg_glu_backward", world, seed, swapped=True)
    out = refused(case, seed, seq_outs[0], seq_outs[0], [o[0] for o in rank_outs])
    assert "rank_concat_blocks" not in out.lemmas_fired()


@grid
def test_slice_across_block_boundaries_of_a_strided_shard_is_refused(world: int, seed: int) -> None:
    """The ranks cut as if their rows were a plain shard (seed 0: all their rows taken as the first
    block's; 1: their first block's piece shifted by one row; 2: the sequential side cuts one row
    off the block boundary): no rank piece is related to the sequential block."""
    def cut(g: Graph, y: str, block: int, r: int | None) -> list[str]:
        part = block // world
        if r is None:
            lo = 1 if seed == 2 else 0
            return [g.op("Slice", y, g.ints([lo]), g.ints([lo + block]), g.ints([1]))]
        lo, hi = {0: (0, 2 * part), 1: (1, part + 1), 2: (0, part)}[seed]
        return [g.op("Slice", y, g.ints([lo]), g.ints([hi]), g.ints([1]))]

    case, seq_pieces, rank_pieces = _strided_matmul_case("neg_block_slice", world, seed, 2, cut)
    rank_outs = {str(p[0]) for p in rank_pieces}
    outcome = run_case(case, seed)
    assert outcome.checked.ok, outcome.checked.violations
    assert outcome.derived.get("sanity") == []
    wrong = [(t, lay) for t, lay in outcome.relations_of(seq_pieces[0]) if t.split(":", 1)[-1] in rank_outs]
    assert not wrong, wrong
    assert outcome.report.verdict != "verified", render_text(outcome.report)


@grid
def test_rank_slice_of_shard_and_of_replica(world: int, seed: int) -> None:
    """Each rank splits its own shard, and cuts its own part out of a replicated tensor."""
    rng = rng_for("rank_slice", world, seed)
    d, lay = sharded(rng, 0, world, uneven=seed % 2 == 1, least=2)
    c = size(rng)
    xb = bounds_of(lay, d, world)
    halves = [composition(rng, hi - lo, 2) for lo, hi in xb]
    dw = size(rng, world, 7)
    wb = cuts(composition(rng, dw, world))
    inputs = {"x": In([d, c], lay), "w": In([dw, c], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(x["x"])
            g.output(x["w"])
            return
        for t in g.op_n("Split", x["x"], g.ints(halves[r]), outputs=2, axis=0):
            g.output(t)
        lo, hi = wb[r]
        g.output(g.op("Slice", x["w"], g.ints([lo]), g.ints([hi]), g.ints([0])))

    case, _, _ = make_case("rank_slice", world, inputs, body)
    assert_rebuilt_from_rank_tensors(witness(case, seed, "rank_slice:sl", verified=False))


@grid
def test_rank_whole_slice_of_shard_and_of_partial(world: int, seed: int) -> None:
    """A rank slices the whole of an axis of its own tensor (a pipeline's one micro-batch): the
    slice is the tensor, a shard of x (cut on axis 0, whole on axis 1) and a partial p alike."""
    rng = rng_for("rank_whole_slice", world, seed)
    d, lay = sharded(rng, 0, world, uneven=False)  # (an all-gather of even pieces)
    c = size(rng)
    inputs = {"x": In([d, c], lay), "p": In([c, d], partial())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(g.op("Neg", x["x"]))
            g.output(g.op("Neg", x["p"]))
            return
        whole = g.op("Slice", x["x"], g.ints([0]), g.ints([c]), g.ints([1]))
        g.output(g.coll("AllGather", g.op("Neg", whole), everyone(world), axis=0))
        whole_p = g.op("Slice", x["p"], g.ints([0]), g.ints([c]), g.ints([0]))
        g.output(g.coll("AllReduce", g.op("Neg", whole_p), everyone(world), reduce_op="sum"))

    case, _, _ = make_case("rank_whole_slice", world, inputs, body)
    witness(case, seed, "rank_whole_slice")


@seeds
def test_rank_slice_of_part_of_an_axis_is_not_the_tensor(seed: int) -> None:
    """The same with one index of axis 1 left out: not the tensor, and not VERIFIED."""
    rng = rng_for("rank_part_slice", seed)
    world = 2
    d, lay = sharded(rng, 0, world, uneven=False)
    c = size(rng, 3)
    inputs = {"x": In([d, c], lay)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Neg", x["x"]))
        part = g.op("Slice", x["x"], g.ints([0]), g.ints([c - 1]), g.ints([1]))
        return g.output(g.coll("AllGather", g.op("Neg", part), everyone(world), axis=0))

    case, seq_out, rank_outs = make_case("rank_part_slice", world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified", render_text(out.report)


@pytest.mark.parametrize("family", ["cat", "sum"])
@pytest.mark.parametrize("gap", [False, True])
@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 2)])
def test_rebuilt_only_from_pieces_that_tile_the_axis(world: int, seed: int, family: str, gap: bool) -> None:
    """The report's chains (rules/report.lp: a cover step from E takes a piece starting at E):
    each rank cuts [lo, hi) out of a replicated W along axis 0 and outputs -W[lo:hi] (cat) or
    its sum over that axis (sum: a partial sum). Pieces that tile [0, D) rebuild the sequential
    -W or sum(W); with one index left out between two ranks' pieces, nothing is rebuilt."""
    rng = rng_for("tile_the_axis", world, seed)
    d, c = size(rng, world + 1, world + 6), size(rng)
    bounds = cuts(composition(rng, d - 1 if gap else d, world))
    if gap:  # every piece after the first moves up by one: index bounds[0][1] is nobody's
        bounds = [bounds[0]] + [(lo + 1, hi + 1) for lo, hi in bounds[1:]]
    inputs = {"w": In([d, c], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        w = x["w"] if r is None else g.op("Slice", x["w"], g.ints([bounds[r][0]]), g.ints([bounds[r][1]]), g.ints([0]))
        y = g.op("Neg", w) if family == "cat" else g.op("ReduceSum", w, g.ints([0]), keepdims=0)
        g.output(y)
        return y

    case, seq_out, _ = make_case(f"tile_{family}", world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    complete = {str(s) for s, scope in out.derived.get("complete") if scope == "any"}
    assert (f"seq:{seq_out}" in complete) is not gap, (bounds, d)


@grid
def test_seq_slice_and_split_of_sharded_axis(world: int, seed: int) -> None:
    """The sequential side splits at the shard boundaries and slices [lo:hi); ranks cut the overlap."""
    rng = rng_for("seq_slice", world, seed)
    d, lay = sharded(rng, 0, world, uneven=seed % 2 == 1)
    c = size(rng)
    xb = bounds_of(lay, d, world)
    lo = int(rng.integers(0, d))
    hi = int(rng.integers(lo + 1, d + 1))
    inputs = {"x": In([d, c], lay)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            for t in g.op_n("Split", x["x"], g.ints([h - l for l, h in xb]), outputs=world, axis=0):
                g.output(t)
            g.output(g.op("Slice", x["x"], g.ints([lo]), g.ints([hi]), g.ints([0])))
            return
        for _ in range(world):  # as many outputs as the sequential side (they correspond by position)
            g.output(g.op("Identity", x["x"]))
        x0, x1 = xb[r]
        a, b = max(lo, x0), min(hi, x1)
        g.output(g.op("Slice", x["x"], g.ints([a - x0]), g.ints([b - x0]), g.ints([0])) if a < b else g.op("Identity", x["x"]))

    case, _, _ = make_case("seq_slice", world, inputs, body)
    assert_rebuilt_from_rank_tensors(witness(case, seed, "seq_slice:sl", "rank_slice:sl", "full_slice", verified=False))


@grid
def test_concat_both_sides(world: int, seed: int) -> None:
    rng = rng_for("concat", world, seed)
    s_axis = int(rng.integers(3))
    c_axis = int(rng.choice([a for a in range(3) if a != s_axis]))
    d, lay = sharded(rng, s_axis, world, uneven=seed % 2 == 1)
    base = [size(rng) for _ in range(3)]
    base[s_axis] = d
    inputs = {}
    for i in range(int(rng.integers(2, 4))):
        shape = list(base)
        shape[c_axis] = size(rng)
        inputs[f"x{i}"] = In(shape, lay)
    reps = [size(rng), size(rng)]
    inputs["r0"], inputs["r1"] = In([reps[0], 3], rep()), In([reps[1], 3], rep())

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(g.op("Concat", *[x[n] for n in x if n.startswith("x")], axis=c_axis))
        g.output(g.op("Concat", x["r0"], x["r1"], axis=0))

    case, _, _ = make_case("concat", world, inputs, body)
    witness(case, seed, "concat:sl", "concat:rep")


def _partial_concat_case(name: str, world: int, seed: int, replica_operand: bool = False) -> tuple[Case, Any, list[Any]]:
    """Row-parallel products x_i @ w_i (each its own contraction, split alike: Megatron's experts'
    second projections) and a declared partial (its pieces [r, r + 1) of W: with even splits, the
    same fractions counted in another unit), concatenated on both sides along a random axis, then
    all-reduced on the ranks; `replica_operand`: a replicated operand joins the partials (each
    rank would add it once: W copies in the sum)."""
    rng = rng_for(name, world, seed)
    axis, n, uneven = int(rng.integers(2)), size(rng), seed % 2 == 1
    widths = [size(rng) for _ in range(int(rng.integers(2, 4)))]
    rows = [size(rng) for _ in widths]
    k, lay = sharded(rng, 1, world, uneven=uneven)
    inputs: dict[str, In] = {}
    for i, (m, w) in enumerate(zip(rows, widths)):
        m, w = (m, n) if axis == 0 else (n, w)
        inputs[f"x{i}"], inputs[f"w{i}"] = In([m, k], lay), In([k, w], shard(0, lay.get("sizes")))
    last = [size(rng), n] if axis == 0 else [n, size(rng)]
    if replica_operand or not uneven:
        inputs["p"] = In(last, rep() if replica_operand else partial())

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        products = [g.op("MatMul", x[f"x{i}"], x[f"w{i}"]) for i in range(len(widths))]
        joined = g.op("Concat", *products, *[x[n] for n in x if n == "p"], axis=axis)
        out = reduce_all(g, joined, r, world)
        g.output(out)
        return [out]

    return make_case(name, world, inputs, body)


@grid
def test_partial_concat(world: int, seed: int) -> None:
    """Concatenated partial sums of several contractions are a partial sum of the concatenation."""
    case, _, _ = _partial_concat_case("partial_concat", world, seed)
    witness(case, seed, "partial_concat:psum", "allreduce_sum")


@grid
def test_partial_concat_with_a_replica_is_refused(world: int, seed: int) -> None:
    """A replica concatenated with partials is summed W times by the all-reduce."""
    case, seq_outs, rank_outs = _partial_concat_case("neg_partial_concat", world, seed, replica_operand=True)
    out = refused(case, seed, seq_outs[0], seq_outs[0], [o[0] for o in rank_outs],
                  wrong=lambda t, lay: kind(lay) in ("rep", "psum"))  # (the replica is a slice of it: seq_concat)
    assert "partial_concat" not in out.lemmas_fired()


@grid
def test_seq_concat_fused_vs_separate_rank_tensors(world: int, seed: int) -> None:
    """The sequential program concatenates q|k|v; ranks keep their q, k shards and v separately."""
    rng = rng_for("seq_concat", world, seed)
    s = size(rng)
    dq, lq = sharded(rng, 1, world, uneven=seed % 2 == 1)
    dk, lk = sharded(rng, 1, world, uneven=seed % 2 == 0)
    inputs = {"q": In([s, dq], lq), "k": In([s, dk], lk), "v": In([s, size(rng)], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(g.op("Concat", x["q"], x["k"], x["v"], axis=1))
        else:
            for n in ("q", "k", "v"):
                g.output(x[n])

    case, _, _ = make_case("seq_concat", world, inputs, body)
    assert_rebuilt_from_rank_tensors(witness(case, seed, "seq_concat:sl", verified=False))


@grid
def test_rank_concat(world: int, seed: int) -> None:
    """A rank concatenates adjacent parts it cut out (of a replica, and of its own shard)."""
    rng = rng_for("rank_concat", world, seed)
    k = int(rng.integers(2, 4))
    dw = size(rng, k * world, max(7, k * world))
    pieces = cuts(composition(rng, dw, k * world))
    c = size(rng)
    d, lay = sharded(rng, 1, world, uneven=seed % 2 == 1, least=2)
    xb = bounds_of(lay, d, world)
    halves = [composition(rng, hi - lo, 2) for lo, hi in xb]
    inputs = {"w": In([dw, c], rep()), "x": In([c, d], lay)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(x["w"])
            g.output(x["x"])
            return
        mine = [g.op("Slice", x["w"], g.ints([lo]), g.ints([hi]), g.ints([0])) for lo, hi in pieces[r * k:(r + 1) * k]]
        g.output(g.op("Concat", *mine, axis=0))
        g.output(g.op("Concat", *g.op_n("Split", x["x"], g.ints(halves[r]), outputs=2, axis=1), axis=1))

    case, _, _ = make_case("rank_concat", world, inputs, body)
    witness(case, seed, "rank_concat", "rank_slice")


@grid
def test_expand(world: int, seed: int) -> None:
    rng = rng_for("expand", world, seed)
    axis = int(rng.choice([0, 2]))
    d, lay = sharded(rng, axis, world, uneven=seed % 2 == 1)
    shape = [size(rng), 1, size(rng)]
    shape[axis] = d
    b = size(rng)
    lead = [size(rng)] if seed != 1 else []
    xb = bounds_of(lay, d, world)
    c = size(rng)
    inputs = {"x": In(shape, lay), "y": In([1, c], rep())}
    ya = size(rng)

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        target = [*shape[:1], b, shape[2]]
        if r is not None:
            target[axis] = xb[r][1] - xb[r][0]
        g.output(g.op("Expand", x["x"], g.ints(lead + target)))
        g.output(g.op("Expand", x["y"], g.ints([ya, c])))

    case, _, _ = make_case("expand", world, inputs, body)
    witness(case, seed, "expand:sl", "expand:rep")


def _repeat_case(name: str, world: int, seed: int, seq_tiles: bool = False,
                 wrong_group: bool = False) -> tuple[Case, Any, list[Any]]:
    """GQA with fewer key/value groups than ranks, as Megatron-Core repeats them: k [b, G, d]
    (replicated) holds G groups and q [b, G*R, d] the query heads (sharded, rank r holding heads
    [r R', (r+1) R')); rank r slices its group X = r // m (m = world / G ranks per group) and
    repeats it R' times (Unsqueeze, Expand, seed 1: an Identity, Reshape; seed 2: R' = 1 and no
    repeat at all), where the sequential model repeats every group R = m R' times; each side adds
    the repeated k to its q.
    `seq_tiles`: the sequential side tiles the groups instead (Unsqueeze before the group axis);
    `wrong_group`: rank r takes group X + 1 (mod G)."""
    rng = rng_for(name, world, seed)
    groups = 2 if world % 2 == 0 else world
    per_group = world // groups
    r2 = 1 if seed == 2 else size(rng, 1, 2) + (1 if seq_tiles else 0)  # (tiling one copy is no tiling)
    reps, b, d = per_group * r2, size(rng), size(rng)
    inputs = {"k": In([b, groups, d], rep()), "q": In([b, groups * reps, d], shard(1))}

    def repeat(g: Graph, t: str, count: int, width: int) -> str:
        u = g.op("Unsqueeze", t, g.ints([2]))
        e = g.op("Expand", u, g.ints([b, width, count, d]))
        if seed == 1:
            e = g.op("Identity", e)
        return g.op("Reshape", e, g.ints([b, width * count, d]))

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            if seq_tiles:
                u = g.op("Unsqueeze", x["k"], g.ints([1]))
                y = g.op("Reshape", g.op("Expand", u, g.ints([b, reps, groups, d])), g.ints([b, reps * groups, d]))
            else:
                y = repeat(g, x["k"], reps, groups)
        else:
            group = (r // per_group + (1 if wrong_group else 0)) % groups
            own = g.op("Slice", x["k"], g.ints([group]), g.ints([group + 1]), g.ints([1]))
            y = own if seed == 2 else repeat(g, own, r2, 1)  # (one head per group: no repeat, as Megatron)
        return y, g.output(g.op("Add", x["q"], y))

    return make_case(name, world, inputs, body)


@grid
def test_repeat_of_one_group_is_a_run_of_the_sequential_repeat(world: int, seed: int) -> None:
    """GQA at TP > groups: each rank repeats its one key/value group for its own query heads."""
    case, _, _ = _repeat_case("repeat_group", world, seed)
    witness(case, seed, "repeat_group")


@grid
def test_repeat_of_the_wrong_group_or_a_tiled_sequential_is_refused(world: int, seed: int) -> None:
    """Seed 0: the sequential side tiles the groups (torch's repeat, not repeat_interleave) while
    the ranks repeat theirs; 1, 2: every rank repeats the next group (class 7's wrong offset), so
    its key heads do not belong to its query heads. Nothing wrong is derived (a run of the next
    group is a true relation to that group's sequential heads), and it does not verify."""
    tiles = seed == 0
    case, (y, out), ranks = _repeat_case("neg_repeat_group", world, seed, seq_tiles=tiles, wrong_group=not tiles)
    refused(case, seed, y, out, [o for _, o in ranks], wrong=lambda t, lay: tiles)


@grid
def test_gather(world: int, seed: int) -> None:
    """Data sharded after / before the gathered axis (same indices), and indices sharded."""
    rng = rng_for("gather", world, seed)
    v, e = size(rng, 4, 7), size(rng)  # v >= 4: sharded int64 indices are fed in [0, 4)
    d, lay = sharded(rng, 1, world, uneven=seed % 2 == 1)
    d0, lay0 = sharded(rng, 0, world, uneven=seed % 2 == 0)
    n, ln = sharded(rng, 0, world, uneven=seed % 2 == 1)
    idx2 = rng.integers(0, v, size=(size(rng, 1, 3), size(rng, 1, 3)))
    idx1 = rng.integers(0, v, size=(size(rng, 1, 4),))
    inputs = {"a": In([v, d], lay), "b": In([d0, v], lay0), "data": In([v, e], rep()),
              "dataT": In([e, v], rep()), "idx": In([n, size(rng, 1, 3)], ln, INT64)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(g.op("Gather", x["a"], g.const(idx2, np.int64), axis=0))  # [m1, m2, d]: sl on axis 2
        g.output(g.op("Gather", x["b"], g.const(idx1, np.int64), axis=1))  # [d0, m]: sl on axis 0
        g.output(g.op("Gather", x["data"], x["idx"]))  # [n, m, e]: indices sharded
        g.output(g.op("Gather", x["dataT"], x["idx"], axis=-1))  # [e, n, m]
        g.output(g.op("Gather", x["data"], g.const(idx1, np.int64), axis=0))  # replicated

    case, _, _ = make_case("gather", world, inputs, body)
    witness(case, seed, "gather:sl", "gather:rep")


# ============================================================================================
# reduce.lp
# ============================================================================================

REDUCE_VARIANTS = [("ReduceSum", "input"), ("ReduceMean", "input"), ("ReduceMax", "input"),
                   ("ReduceL2", "input"), ("ReduceMean", "attr"), ("ReduceMax", "attr")]


def reduce_node(g: Graph, op: str, x: str, axes: list[int] | None, keepdims: int, mode: str = "input") -> str:
    if axes is None:
        return g.op(op, x, keepdims=keepdims)
    if mode == "attr":
        return g.op(op, x, axes=axes, keepdims=keepdims)
    return g.op(op, x, g.ints(axes), keepdims=keepdims)


@in_turn(world_seed_grid(WORLDS, SEEDS), "world,seed", **{"op,mode": REDUCE_VARIANTS})
def test_reduce_keeps_shard(world: int, seed: int, op: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reducing axes other than the sharded one, keepdims 0 and 1; axes as input (opset 18) or
    attribute (opset 17, ReduceMean/ReduceMax)."""
    if mode == "attr":
        monkeypatch.setattr(refine.kit.cases, "OPSET", 17)  # the opset Graph.model writes
    rng = rng_for("reduce", world, seed, zlib.crc32(op.encode()), len(mode))
    axis = int(rng.integers(3))
    d, lay = sharded(rng, axis, world, uneven=seed % 2 == 1)
    shape = [size(rng) for _ in range(3)]
    shape[axis] = d
    others = [a for a in range(3) if a != axis]
    axes = [int(a) for a in rng.choice(others, size=int(rng.integers(1, 3)), replace=False)]
    spelled = [a - 3 if seed == 2 else a for a in axes]  # negative axes
    inputs = {"x": In(shape, lay), "y": In([size(rng), size(rng)], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        for keep in (0, 1):
            g.output(reduce_node(g, op, x["x"], spelled, keep, mode))
        g.output(reduce_node(g, op, x["y"], [1], int(seed % 2), mode))
        g.output(reduce_node(g, op, x["y"], None, 1))  # all axes

    case, _, _ = make_case("reduce", world, inputs, body)
    witness(case, seed, "reduce:sl", "reduce:rep")


@grid
@pytest.mark.parametrize("op,kind_,coll_op", [("ReduceSum", "reduce_sum_sharded", "sum"),
                                              ("ReduceMax", "reduce_max_sharded", "max")])
def test_reduce_over_sharded_axis_then_allreduce(world: int, seed: int, op: str, kind_: str, coll_op: str) -> None:
    """Sum / max over the sharded axis is a partial sum / max; AllReduce completes it."""
    rng = rng_for("reduce_sharded", world, seed, len(op))
    axis = int(rng.integers(3))
    d, lay = sharded(rng, axis, world, uneven=seed % 2 == 1)
    shape = [size(rng) for _ in range(3)]
    shape[axis] = d
    extra = [a for a in range(3) if a != axis][int(rng.integers(2))]
    inputs = {"x": In(shape, lay)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        for axes, keep in (([axis], 1), ([axis, extra], 0), (None, int(seed % 2))):
            g.output(reduce_all(g, reduce_node(g, op, x["x"], axes, keep), r, world, coll_op))

    case, _, _ = make_case("reduce_sharded", world, inputs, body)
    witness(case, seed, kind_, f"allreduce_{coll_op}:rep")


@grid
def test_reduce_linear(world: int, seed: int) -> None:
    """ReduceSum / ReduceMean of partial sums (declared, and made by a sharded ReduceSum)."""
    rng = rng_for("reduce_linear", world, seed)
    shape = [size(rng) for _ in range(3)]
    d, lay = sharded(rng, 2, world, uneven=seed % 2 == 1)
    inputs = {"p": In(shape, partial()), "x": In([shape[0], shape[1], d], lay), "q": In(shape, partial(), INT64)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(reduce_all(g, g.op("ReduceSum", x["p"], g.ints([1]), keepdims=seed % 2), r, world))
        g.output(reduce_all(g, g.op("ReduceSum", x["q"], g.ints([0, 2]), keepdims=1), r, world))  # exact on ints
        g.output(reduce_all(g, g.op("ReduceMean", x["p"], g.ints([0, 2]), keepdims=1), r, world))
        g.output(reduce_all(g, g.op("ReduceMean", x["p"], keepdims=0), r, world))
        s = g.op("ReduceSum", x["x"], g.ints([2]), keepdims=0)  # partial
        g.output(reduce_all(g, g.op("ReduceMean", s, g.ints([0]), keepdims=1), r, world))

    case, _, _ = make_case("reduce_linear", world, inputs, body)
    witness(case, seed, "reduce_linear:psum", "reduce_sum_sharded:psum", "allreduce_sum")


@grid
def test_reduce_max_partial(world: int, seed: int) -> None:
    rng = rng_for("reduce_max_partial", world, seed)
    shape = [size(rng) for _ in range(3)]
    d, lay = sharded(rng, 0, world, uneven=seed % 2 == 1)
    inputs = {"p": In(shape, partial("max")), "x": In([d, shape[1]], lay)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(reduce_all(g, g.op("ReduceMax", x["p"], g.ints([2, 0]), keepdims=seed % 2), r, world, "max"))
        m = g.op("ReduceMax", x["x"], g.ints([0]), keepdims=1)  # partial max
        g.output(reduce_all(g, g.op("ReduceMax", m, g.ints([1]), keepdims=0), r, world, "max"))

    case, _, _ = make_case("reduce_max_partial", world, inputs, body)
    witness(case, seed, "reduce_max_partial:pmax", "reduce_max_sharded:pmax", "allreduce_max")


@grid
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax(world: int, seed: int, op: str) -> None:
    rng = rng_for("softmax", world, seed, len(op))
    axis = int(rng.integers(3))
    d, lay = sharded(rng, axis, world, uneven=seed % 2 == 1)
    shape = [size(rng) for _ in range(3)]
    shape[axis] = d
    sm_axis = int(rng.choice([a for a in range(3) if a != axis]))
    attrs = {} if sm_axis == 2 and seed == 0 else {"axis": sm_axis - 3 if seed == 1 else sm_axis}
    inputs = {"x": In(shape, lay), "y": In([size(rng), size(rng)], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(g.op(op, x["x"], **attrs))
        g.output(g.op(op, x["y"], axis=0))

    case, _, _ = make_case("softmax", world, inputs, body)
    if op == "Softmax":
        witness(case, seed, "softmax:sl", "softmax:rep")
    else:  # lowered as its parts, x - max - log(sum(exp(x - max))) (refine/lowering/normal_forms.py)
        witness(case, seed, "reduce:sl", "reduce:rep", "elementwise:sl", "elementwise:rep")


# ============================================================================================
# norm.lp
# ============================================================================================


@grid
@pytest.mark.parametrize("with_bias", [True, False])
def test_layernorm(world: int, seed: int, with_bias: bool) -> None:
    rng = rng_for("layernorm", world, seed, with_bias)
    s_axis = int(rng.integers(2))
    d, lay = sharded(rng, s_axis, world, uneven=seed % 2 == 1)
    shape = [size(rng) for _ in range(3)]
    shape[s_axis] = d
    n_axis = int(rng.integers(s_axis + 1, 3))
    attrs = {} if n_axis == 2 and seed == 0 else {"axis": n_axis - 3 if seed == 2 else n_axis}
    ya, yb = size(rng), size(rng)
    inputs = {"x": In(shape, lay), "gamma": In(shape[n_axis:], rep()), "beta": In(shape[n_axis:], rep()),
              "y": In([ya, yb], rep()), "gy": In([yb], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        params = [x["gamma"], x["beta"]] if with_bias else [x["gamma"]]
        g.output(g.op("LayerNormalization", x["x"], *params, **attrs))
        g.output(g.op("LayerNormalization", x["y"], x["gy"]))

    case, _, _ = make_case("layernorm", world, inputs, body)
    witness(case, seed, "norm:sl", "norm:rep")


# ============================================================================================
# collectives.lp
# ============================================================================================


@grid
def test_allreduce_of_partials_declared(world: int, seed: int) -> None:
    rng = rng_for("allreduce_partial", world, seed)
    inputs = {"p": In([size(rng), size(rng)], partial()), "m": In([size(rng)], partial("max"))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(reduce_all(g, x["p"], r, world))
        g.output(reduce_all(g, x["m"], r, world, "max"))

    case, _, _ = make_case("allreduce_partial", world, inputs, body)
    witness(case, seed, "allreduce_sum", "allreduce_max")


@grid
def test_allreduce_of_replicas(world: int, seed: int) -> None:
    """max/min of equal values is the value; a sum of K replicas is K times the value."""
    rng = rng_for("allreduce_rep", world, seed)
    inputs = {"x": In([size(rng), size(rng)], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(reduce_all(g, x["x"], r, world, "max"))
        g.output(reduce_all(g, x["x"], r, world, "min"))
        if r is not None:
            g.output(g.coll("AllReduce", x["x"], everyone(world)))

    case, _, ranks = make_case("allreduce_rep", world, inputs, body)
    out = witness(case, seed, "allreduce_idempotent", "allreduce_sum_of_replicas:scaled")
    assert ("scaled", world, 1, "rep") in {lay for _, lay in out.relations_of("x")}


@grid
def test_avg_reductions(world: int, seed: int) -> None:
    """avg is the sum divided by the group size K (DDP's gradient all-reduce): of partials, an
    all-reduce gives S / K and a reduce-scatter chunk j of S / K, which the ranks multiply back
    by K; of replicas, an all-reduce gives the replica and a reduce-scatter its chunk j (a sum's
    reduce-scatter of replicas: K times the chunk)."""
    rng = rng_for("avg_reductions", world, seed)
    a, c = size(rng), size(rng, 1, 2)
    inputs = {"p": In([a, world * c], partial()), "x": In([world * c, a], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            for out in (x["p"], x["p"], x["x"], x["x"], x["x"]):
                g.output(g.op("Identity", out))
            return
        k = g.const(np.float32(world))
        group = everyone(world)
        g.output(g.op("Mul", g.coll("AllReduce", x["p"], group, reduce_op="avg"), k))
        scattered = g.coll("ReduceScatter", x["p"], group, axis=1, reduce_op="avg")
        g.output(g.coll("AllGather", g.op("Mul", scattered, k), group, axis=1))
        g.output(g.coll("AllReduce", x["x"], group, reduce_op="avg"))
        g.output(g.coll("AllGather", g.coll("ReduceScatter", x["x"], group, axis=0, reduce_op="avg"), group, axis=0))
        summed = g.coll("ReduceScatter", x["x"], group, axis=0, reduce_op="sum")
        g.output(g.coll("AllGather", g.op("Div", summed, k), group, axis=0))

    case, _, _ = make_case("avg_reductions", world, inputs, body)
    witness(case, seed, "allreduce_avg:scaled", "reduce_scatter_avg:scaled", "allreduce_avg_of_replicas",
            "reduce_scatter_avg_of_replicas", "reduce_scatter_sum_of_replicas:scaled")


@pytest.mark.parametrize("variant", ["avg_as_sum", "sum_of_replicas_as_avg"])
@grid
def test_avg_reductions_used_as_sums_are_refused(world: int, seed: int, variant: str) -> None:
    """The mean taken for the sum (partials all-reduced with avg and used as the whole: a loss or
    gradient 1/K too small), and replicas reduce-scattered with sum where the mean was meant (each
    chunk K times too large): not verified, and only true relations derived."""
    rng = rng_for("avg_refused", world, seed)
    a, c = size(rng), size(rng, 1, 2)
    layout = partial() if variant == "avg_as_sum" else rep()
    inputs = {"x": In([world * c, a], layout)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            y = g.op("Identity", x["x"])
            return y, g.output(y)
        group = everyone(world)
        if variant == "avg_as_sum":
            y = g.coll("AllReduce", x["x"], group, reduce_op="avg")
        else:
            y = g.coll("AllGather", g.coll("ReduceScatter", x["x"], group, axis=0, reduce_op="sum"), group, axis=0)
        return y, g.output(y)

    case, (s, out), ranks = make_case(f"avg_refused_{variant}", world, inputs, body)
    reduced = {f"r{r}:{y}" for r, (y, _) in enumerate(ranks)}
    refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: t in reduced and kind(lay) not in ("scaled", "psum"))


@seeds
def test_subgroups_allreduce_allgather(seed: int) -> None:
    """World 4 as a 2x2 grid: sums and gathers within [0,1] / [2,3], then gathers over [0,2] / [1,3]."""
    world = 4
    rng = rng_for("subgroups", seed)
    a = size(rng)
    dk = 2 * size(rng, 1, 3)
    dg = 4 * size(rng, 1, 2)
    inputs = {"x": In([a, dk], rep()), "y": In([dg, size(rng)], shard(0)), "z": In([a, size(rng)], rep())}
    row = lambda r: [0, 1] if r < 2 else [2, 3]  # noqa: E731
    col = lambda r: [0, 2] if r % 2 == 0 else [1, 3]  # noqa: E731

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(g.op("ReduceSum", x["x"], g.ints([1]), keepdims=0))
            g.output(g.op("ReduceMax", x["x"], g.ints([1]), keepdims=0))
            g.output(x["y"])
            g.output(x["z"])
            return
        half = dk // 2
        mine = g.op("Slice", x["x"], g.ints([(r % 2) * half]), g.ints([(r % 2 + 1) * half]), g.ints([1]))
        g.output(g.coll("AllReduce", g.op("ReduceSum", mine, g.ints([1]), keepdims=0), row(r)))
        g.output(g.coll("AllReduce", g.op("ReduceMax", mine, g.ints([1]), keepdims=0), row(r), reduce_op="max"))
        pair_ = g.coll("AllGather", x["y"], row(r), axis=0)  # rows [0, dg/2) or [dg/2, dg)
        g.output(g.coll("AllGather", pair_, col(r), axis=0))
        g.output(g.coll("AllReduce", x["z"], row(r), reduce_op="min"))

    case, _, _ = make_case("subgroups", world, inputs, body)
    out = witness(case, seed, "allreduce_sum", "allreduce_max", "allgather", "allreduce_idempotent", "rank_slice")
    starts = {lay[2] for t, lay in out.relations_of("y") if kind(lay) == "sl" and lay[3] - lay[2] == dg // 2}
    assert starts == {0, dg // 2}  # the first-level gathers: halves starting at 0 and at dg/2


@grid
def test_allgather(world: int, seed: int) -> None:
    rng = rng_for("allgather", world, seed)
    axis = int(rng.integers(3))
    shape = [size(rng) for _ in range(3)]
    shape[axis] = world * size(rng, 1, 2)
    inputs = {"x": In(shape, shard(axis))}
    spelled = axis - 3 if seed == 1 else axis

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        g.output(x["x"] if r is None else g.coll("AllGather", x["x"], everyone(world), axis=spelled))

    case, _, _ = make_case("allgather", world, inputs, body)
    witness(case, seed, "allgather", "full_slice")


def _moved_to(axis: int, to: int, ndim: int) -> list[int]:
    """The perm of x.movedim(axis, to): output axis `to` is input axis `axis`."""
    rest = [a for a in range(ndim) if a != axis]
    return rest[:to] + [axis] + rest[to:]


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for j, p in enumerate(perm):
        inv[p] = j
    return inv


@grid
def test_allgather_between_transposes(world: int, seed: int) -> None:
    """`all_gather(x.movedim(B, A), A).movedim(A, B)` (torch gathers on dim 0 only): the pieces
    are transposed, gathered on A, and transposed back; with an identity-like step (a
    contiguous clone, a wait) between some of them. Ranks 3 or 4, any B and A."""
    rng = rng_for("allgather_transposed", world, seed)
    ndim = 3 + seed % 2
    b_axis, a_axis = int(rng.integers(ndim)), int(rng.integers(ndim))
    shape = [size(rng) for _ in range(ndim)]
    shape[b_axis], layout = sharded(rng, b_axis, world, uneven=False)  # (AllGather takes equal pieces)
    perm = _moved_to(b_axis, a_axis, ndim)
    if seed == 1:  # any perm putting B at A, not only movedim's
        others = [a for a in rng.permutation(ndim).tolist() if a != b_axis]
        perm = others[:a_axis] + [b_axis] + others[a_axis:]
    inputs = {"x": In(shape, layout)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        h = g.op("Relu", x["x"])
        if r is None:
            g.output(h)
            return
        moved = g.op("Transpose", h, perm=perm)
        if seed != 0:
            moved = g.op("Identity", moved)
        gathered = g.coll("AllGather", moved, everyone(world), axis=a_axis)
        if seed != 1:
            gathered = g.op("Identity", gathered)
        g.output(g.op("Transpose", gathered, perm=_inverse(perm)))

    case, _, _ = make_case("allgather_transposed", world, inputs, body)
    witness(case, seed, "allgather_transposed")


def _refuse_transposed_gather(name: str, world: int, seed: int, perm_of_rank: Callable[[int], list[int]],
                              back: list[int]) -> None:
    """x [n, n, world*n] sharded on axis 2; each rank transposes its piece by perm_of_rank(r),
    gathers on axis 0 and transposes by `back`: a bug, and nothing may relate the ranks' results
    to x (the side axes are square so that every axis order is a valid shape)."""
    n = size(rng_for(name, world, seed))
    inputs = {"x": In([n, n, world * n], shard(2))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        h = g.op("Relu", x["x"])
        if r is None:
            return h, g.output(h)
        gathered = g.coll("AllGather", g.op("Transpose", h, perm=perm_of_rank(r)), everyone(world), axis=0)
        return h, g.output(g.op("Transpose", gathered, perm=back))

    case, (h, out), ranks = make_case(name, world, inputs, body)
    results = {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    refused(case, seed, h, out, [o for _, o in ranks], wrong=lambda t, lay: t in results)


@grid
def test_allgather_between_transposes_that_do_not_undo_each_other_is_refused(world: int, seed: int) -> None:
    """The second transpose is not the first one's inverse (seed 0: the same perm again; 1: the
    inverse of another perm; 2: the inverse with its last two axes swapped): the result's axes are
    in the wrong order."""
    perm = _moved_to(2, 0, 3)  # [2, 0, 1]
    back = {0: perm, 1: _inverse([2, 1, 0]), 2: [*_inverse(perm)[:1], *_inverse(perm)[:0:-1]]}[seed]
    _refuse_transposed_gather("neg_allgather_transposed", world, seed, lambda r: perm, back)


@grid
def test_allgather_between_transposes_with_different_perms_is_refused(world: int, seed: int) -> None:
    """Member 0 transposes its piece by one perm, the others by another perm that puts the same
    sharded axis at the gather axis: the gathered pieces are not one transpose of the gather,
    whichever perm undoes it."""
    first, others = [2, 0, 1], [2, 1, 0]
    back = _inverse(first if seed % 2 == 0 else others)
    _refuse_transposed_gather("neg_allgather_mixed", world, seed, lambda r: first if r == 0 else others, back)


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@grid
def test_sequence_parallel_gather_and_scatter(world: int, seed: int, reduce_op: str) -> None:
    """DTensor's sequence parallelism with torch collectives that only work on dim 0:
    x [b, s, h] sharded on the sequence -> AllGather along 0 -> cut back into members' blocks
    along 0 -> concat along 1 (= x); then row-parallel partials -> slice each along the sequence
    -> stack the slices along 0 -> ReduceScatter along 0 -> member j holds sequence chunk j
    (avg: chunk j divided by the group size, multiplied back)."""
    rng = rng_for("sp_gather_scatter", world, seed)
    b, h, k = size(rng), size(rng), world * size(rng, 1, 2)
    s_len = world * size(rng, 1, 2)
    chunk = s_len // world
    inputs = {"x": In([b, s_len, h], shard(1)), "w": In([h, k], shard(1)), "v": In([k, h], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(g.op("MatMul", g.op("Relu", g.op("MatMul", x["x"], x["w"])), x["v"]))
            return
        gathered = g.coll("AllGather", x["x"], everyone(world), axis=0)
        blocks = g.op_n("Split", gathered, g.ints([b] * world), outputs=world, axis=0)
        full = g.op("Concat", *blocks, axis=1)
        part = g.op("MatMul", g.op("Relu", g.op("MatMul", full, x["w"])), x["v"])
        pieces = g.op_n("Split", part, g.ints([chunk] * world), outputs=world, axis=1)
        y = g.coll("ReduceScatter", g.op("Concat", *pieces, axis=0), everyone(world), axis=0, reduce_op=reduce_op)
        g.output(g.op("Mul", y, g.const(np.float32(world))) if reduce_op == "avg" else y)

    case, _, _ = make_case("sp_gather_scatter", world, inputs, body)
    scatter = "reduce_scatter_block" if reduce_op == "sum" else "reduce_scatter_avg_block:scaled"
    out = witness(case, seed, "allgather_block", "rank_concat", "rank_slice:psl", scatter)
    assert any(kind(lay) == "psl" for _, _, lay in out.derived.get("rel"))


def _unit_axis_gather_case(name: str, world: int, seed: int, batch: int, shard_axis: int) -> tuple[Case, Any, list[Any]]:
    """x [batch, s, h] (seed 1, 2: with a leading axis of 2, so the gather axis is 1) sharded on
    `shard_axis`; the ranks gather along the axis before the sequence, then (seed 2: through an
    Identity) reshape the stack to x's shape, as DTensor does for a batch-1 sequence shard."""
    rng = rng_for(name, world, seed)
    s_len, h = world * size(rng, 1, 3), world * size(rng, 1, 3)
    lead = [2] if seed > 0 else []
    shape = [*lead, batch, s_len, h]
    axis = len(lead)  # the batch axis: the gather axis
    inputs = {"x": In(shape, shard(len(lead) + shard_axis))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        y = g.op("Relu", x["x"])
        if r is None:
            return y, g.output(y)
        gathered = g.coll("AllGather", y, everyone(world), axis=axis)
        if seed == 2:
            gathered = g.op("Identity", gathered)
        return y, g.output(g.op("Reshape", gathered, g.ints(shape)))

    return make_case(name, world, inputs, body)


@grid
def test_allgather_of_a_batch_one_sequence_shard_read_back_by_a_reshape(world: int, seed: int) -> None:
    """Sequence parallelism with batch 1: the dim-0 gather stacks the sequence chunks, and a
    Reshape to [1, s, h] reads them back as their concatenation (the whole sequence)."""
    case, _, _ = _unit_axis_gather_case("allgather_unit_axis", world, seed, batch=1, shard_axis=1)
    witness(case, seed, "allgather_unit_axis")


@grid
def test_allgather_stack_read_back_wrongly_is_refused(world: int, seed: int) -> None:
    """The same gather and Reshape where the stack is not the concatenation: a batch of 2 (the
    Reshape interleaves batch rows and sequence chunks), or the pieces cut along the hidden axis
    (two axes after the gathered one): nothing relates the result to x."""
    if seed == 0:
        case, (y, out), ranks = _unit_axis_gather_case("neg_allgather_unit_axis", world, 1, batch=2, shard_axis=1)
    else:
        case, (y, out), ranks = _unit_axis_gather_case("neg_allgather_unit_axis", world, seed, batch=1, shard_axis=2)
    results = {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    refused(case, seed, y, out, [o for _, o in ranks], wrong=lambda t, lay: t in results)


@grid
def test_sequence_parallel_scatter_in_wrong_block_order_is_refused(world: int, seed: int) -> None:
    """Stacking the partial's sequence slices in reverse before the reduce-scatter gives member j
    chunk n-1-j (derived as such); adding the rank's own sequence chunk j of a residual then mixes
    positions: no relation for the sum, and not verified."""
    rng = rng_for("neg_sp_scatter", world, seed)
    b, k = size(rng), world * size(rng, 1, 2)
    s_len = world * size(rng, 1, 2)
    inputs = {"xk": In([b, s_len, k], shard(2)), "res": In([b, s_len, 1], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        part = g.op("ReduceSum", x["xk"], g.ints([2]), keepdims=1)
        if r is not None:
            pieces = g.op_n("Split", part, g.ints([s_len // world] * world), outputs=world, axis=1)
            part = g.coll("ReduceScatter", g.op("Concat", *reversed(pieces), axis=0), everyone(world), axis=0)
        y = g.op("Add", part, x["res"])
        return y, g.output(y)

    case, (y, out), ranks = make_case("neg_sp_scatter", world, inputs, body)
    # (with an odd world the middle member's chunk is right, so some relations do hold; all
    # derived ones are checked numerically, and the program as a whole must not verify)
    refused(case, seed, y, out, [o for _, o in ranks], wrong=lambda t, lay: False)


@grid
def test_reduce_scatter(world: int, seed: int) -> None:
    """Partial sums (declared, or made by a sharded ReduceSum) -> ReduceScatter: member j gets chunk j."""
    rng = rng_for("reduce_scatter", world, seed)
    axis = int(rng.integers(2))
    shape = [size(rng), size(rng)]
    shape[axis] = world * size(rng, 1, 2)
    d, lay = sharded(rng, 2, world, uneven=seed % 2 == 1)
    inputs = {"p": In(shape, partial()), "x": In([*shape, d], lay)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(x["p"])
            g.output(g.op("ReduceSum", x["x"], g.ints([2]), keepdims=0))
            return
        chunk = g.coll("ReduceScatter", x["p"], everyone(world), axis=axis)
        g.output(g.coll("AllGather", chunk, everyone(world), axis=axis))
        s = g.op("ReduceSum", x["x"], g.ints([2]), keepdims=0)
        g.output(g.coll("ReduceScatter", s, everyone(world), axis=axis))

    case, _, _ = make_case("reduce_scatter", world, inputs, body)
    witness(case, seed, "reduce_scatter", "reduce_sum_sharded", "allgather")


def reversed_pieces_body(world: int, k: int, gather_group: list[int]) -> Body:
    """x replicated [a, k*world]: rank r sums columns of piece world-1-r, so that in the group
    [world-1, ..., 0] member j holds piece j; ReduceScatter(axis 0) in that group, AllGather."""
    group = everyone(world)[::-1]

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            s = g.op("ReduceSum", x["x"], g.ints([1]), keepdims=0)
            return s, g.output(s)
        j = world - 1 - r
        mine = g.op("Slice", x["x"], g.ints([j * k]), g.ints([(j + 1) * k]), g.ints([1]))
        c = g.coll("ReduceScatter", g.op("ReduceSum", mine, g.ints([1]), keepdims=0), group, axis=0)
        return c, g.output(g.coll("AllGather", c, gather_group, axis=0))

    return body


@grid
def test_reduce_scatter_in_reversed_group_order(world: int, seed: int) -> None:
    """Group [K-1, ..., 0]: member j (rank K-1-j) gets chunk j, and gathering in that order rebuilds."""
    rng = rng_for("reduce_scatter_rev", world, seed)
    a, k = world * size(rng, 1, 2), size(rng, 1, 2)
    case, (s, _), ranks = make_case("reduce_scatter_rev", world, {"x": In([a, k * world], rep())},
                                    reversed_pieces_body(world, k, everyone(world)[::-1]))
    out = witness(case, seed, "reduce_scatter", "allgather", "rank_slice", "reduce_sum_sharded")
    c = a // world
    chunks = {t: lay for t, lay in out.relations_of(s) if t in {f"r{r}:{cc}" for r, (cc, _) in enumerate(ranks)}}
    assert chunks == {f"r{r}:{cc}": ("sl", 0, (world - 1 - r) * c, (world - r) * c) for r, (cc, _) in enumerate(ranks)}


@grid
def test_all_to_all(world: int, seed: int) -> None:
    """Inputs tiling S along concat_axis come out as chunk j of S along split_axis on member j."""
    rng = rng_for("all_to_all", world, seed)
    ca, sa = (int(a) for a in rng.choice(3, size=2, replace=False))
    shape = [size(rng) for _ in range(3)]
    shape[ca] = world * size(rng, 1, 2)
    shape[sa] = world * size(rng, 1, 2)
    inputs = {"x": In(shape, shard(ca))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        # negative axes spelled ONNX-style on some seeds (collectives.lp normalizes them)
        split, concat = (sa - 3 if seed == 1 else sa), (ca - 3 if seed == 2 else ca)
        if r is None:
            g.output(x["x"])
        else:
            g.output(g.coll("AllToAll", x["x"], everyone(world), split_axis=split, concat_axis=concat))

    case, _, _ = make_case("all_to_all", world, inputs, body)
    out = witness(case, seed, "all_to_all")
    c = shape[sa] // world
    assert {lay for t, lay in out.relations_of("x") if not t.endswith(":x")} == \
        {("sl", sa, j * c, (j + 1) * c) for j in range(world)}


# ============================================================================================
# Soundness negatives
# ============================================================================================


@grid
def test_reshape_splitting_shard_on_inner_factor_is_refused(world: int, seed: int) -> None:
    """BUGS.md class 8: a rank holds a contiguous block of h*dh columns but reshapes it into all
    h heads with dh/K dims each; gathering those on the head-dim axis is not the sequential tensor."""
    rng = rng_for("neg_reshape_inner", world, seed)
    b, s = size(rng), size(rng)
    h, dh = world * size(rng, 1, 2), world * size(rng, 1, 2)
    inputs = {"x": In([b, s, h * dh], shard(2))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            q = g.op("Reshape", x["x"], g.ints([b, s, h, dh]))
            return q, g.output(g.op("Transpose", q, perm=[0, 2, 1, 3]))
        q = g.op("Reshape", x["x"], g.ints([b, s, h, dh // world]))  # BUG: the inner factor
        q = g.coll("AllGather", q, everyone(world), axis=3)
        return q, g.output(g.op("Transpose", q, perm=[0, 2, 1, 3]))

    case, (q, out), ranks = make_case("neg_reshape_inner", world, inputs, body)
    refused(case, seed, q, out, [o for _, o in ranks])


@grid
def test_reshape_merging_inner_sharded_axis_is_refused(world: int, seed: int) -> None:
    """Merging (a, b) where b is sharded: each rank's elements are strided in the merged axis.
    The verifier may say so (an interleaved `blk` layout, checked numerically) but never that
    they are a contiguous slice; all-gathering them along the merged axis is not the seq value."""
    rng = rng_for("neg_reshape_merge", world, seed)
    a, b = size(rng), world * size(rng, 1, 2)
    c = size(rng) if seed % 2 else None
    shape = [a, b] + ([c] if c else [])
    inputs = {"x": In(shape, shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        bl = b if r is None else b // world
        m = g.op("Reshape", x["x"], g.ints([a * bl] + ([c] if c else [])))
        if r is None:
            return m, g.output(m)
        return m, g.output(g.coll("AllGather", m, everyone(world), axis=0))

    case, (m, out), ranks = make_case("neg_reshape_merge", world, inputs, body)
    refused(case, seed, m, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) != "blk")


@grid
def test_reshape_interleaved_blocks_round_trip(world: int, seed: int) -> None:
    """Batched attention's view: [B, H, S] with H sharded -> [B*H, S] (each rank holds an
    interleaved `blk` of the merged axis) -> an op per row -> back to [B, H, S] (a slice again)."""
    rng = rng_for("blk_round_trip", world, seed)
    bsz, h, s_len = size(rng), world * size(rng, 1, 2), size(rng)
    inputs = {"x": In([bsz, h, s_len], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        hl = h if r is None else h // world
        merged = g.op("Reshape", x["x"], g.ints([bsz * hl, s_len]))
        y = g.op("Reshape", g.op("Softmax", merged, axis=-1), g.ints([bsz, hl, s_len]))
        return merged, g.output(y if r is None else g.coll("AllGather", y, everyone(world), axis=1))

    case, (merged, _), _ranks = make_case("blk_round_trip", world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert {"reshape", "softmax", "allgather"} <= out.checked.lemmas_checked
    assert any(kind(lay) == "blk" for _, lay in out.relations_of(merged))
    assert out.derived.get("sanity") == []
    assert out.report.verdict == "verified", render_text(out.report)


@grid
@pytest.mark.parametrize("op", ["Softmax", "ReduceMean", "LayerNormalization"])
def test_normalizing_over_sharded_axis_is_refused(world: int, seed: int, op: str) -> None:
    """Softmax / mean / layer norm need the whole axis: computed per shard they are wrong."""
    rng = rng_for("neg_norm", world, seed, len(op))
    a, b, d = size(rng), size(rng), world * size(rng, 1, 2)
    axis = 1 if op == "LayerNormalization" else 2
    inputs = {"x": In([a, d, b] if axis == 1 else [a, b, d], shard(axis)), "gamma": In([b], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if op == "Softmax":
            y = g.op("Softmax", x["x"], axis=-1)
            return y, g.output(y if r is None else g.coll("AllGather", y, everyone(world), axis=2))
        if op == "ReduceMean":
            y = g.op("ReduceMean", x["x"], g.ints([1, 2]), keepdims=0)
            return y, g.output(reduce_all(g, y, r, world))
        # LayerNorm over axes [1, 3) with a replicated scale on the last axis only (broadcast
        # over axis 1): the parameters are fine, only the normalized axes include the shard
        y = g.op("LayerNormalization", x["x"], x["gamma"], axis=1)
        return y, g.output(y if r is None else g.coll("AllGather", y, everyone(world), axis=1))

    case, (y, out), ranks = make_case(f"neg_{op}", world, inputs, body)
    # (the means of K even shards summed are K times the mean: a true scaled relation, never rep)
    refused(case, seed, y, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) != "scaled")


@grid
def test_integer_mean_of_partials_is_refused(world: int, seed: int) -> None:
    """ReduceMean truncates on integers: the mean of a sum is not the sum of the pieces' means."""
    rng = rng_for("neg_int_mean", world, seed)
    inputs = {"q": In([size(rng, 4, 7), size(rng, 5, 7)], partial(), INT64)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        y = g.op("ReduceMean", x["q"], g.ints([1]), keepdims=0)
        return y, g.output(reduce_all(g, y, r, world))

    case, (y, out), ranks = make_case("neg_int_mean", world, inputs, body)
    refused(case, seed, y, out, [o for _, o in ranks])


@grid
def test_gather_along_sharded_axis_is_refused(world: int, seed: int) -> None:
    rng = rng_for("neg_gather", world, seed)
    d, e = world * size(rng, 2, 3), size(rng)
    idx = rng.integers(0, d // world, size=(size(rng, 2, 4),))
    idx[0], idx[-1] = 0, d // world - 1
    inputs = {"x": In([d, e], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        y = g.op("Gather", x["x"], g.const(idx, np.int64), axis=0)
        return y, g.output(y if r is None else g.coll("AllGather", y, everyone(world), axis=1))

    case, (y, out), ranks = make_case("neg_gather", world, inputs, body)
    refused(case, seed, y, out, [o for _, o in ranks])


@grid
@pytest.mark.parametrize("order", [(1, 0), (0, 2, 1)])
def test_rank_concat_out_of_order_is_refused(world: int, seed: int, order: tuple[int, ...]) -> None:
    """A rank cuts adjacent parts of a replica and concatenates them out of order: two swapped,
    or the first in place and the last two swapped (each part starts where some other ends, so
    only the inputs' order tells the chain apart)."""
    rng = rng_for("neg_rank_concat", world, seed)
    m, c, k = size(rng, 1, 3), size(rng), len(order)
    inputs = {"w": In([k * m * world, c], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            return x["w"], g.output(x["w"])
        lo = k * m * r
        parts = [g.op("Slice", x["w"], g.ints([lo + i * m]), g.ints([lo + (i + 1) * m]), g.ints([0])) for i in range(k)]
        t = g.op("Concat", *[parts[i] for i in order], axis=0)  # BUG: out of order
        return t, g.output(g.coll("AllGather", t, everyone(world), axis=0))

    case, (w, out), ranks = make_case("neg_rank_concat", world, inputs, body)
    moved = {f"r{r}:{t}" for r, (t, _) in enumerate(ranks)} | {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    refused(case, seed, w, out, [o for _, o in ranks], wrong=lambda t, lay: t in moved)


@seeds
@pytest.mark.parametrize("op,coll_op", [("ReduceSum", "sum"), ("ReduceMax", "max")])
def test_allreduce_over_wrong_group_is_refused(seed: int, op: str, coll_op: str) -> None:
    """Four pieces spread over ranks 0..3, reduced within [0,1] and [2,3] only: half of the sum."""
    world = 4
    rng = rng_for("neg_group", seed, len(op))
    a, d = size(rng), 4 * size(rng, 1, 2)
    inputs = {"x": In([a, d], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        y = g.op(op, x["x"], g.ints([1]), keepdims=0)
        return y, g.output(reduce_all(g, y, r, world, coll_op, group=[0, 1] if r is not None and r < 2 else [2, 3]))

    case, (y, out), ranks = make_case("neg_group", world, inputs, body)
    refused(case, seed, y, out, [o for _, o in ranks], wrong=lambda t, lay: kind(lay) not in ("psum", "pmax"))


@grid
def test_allgather_on_wrong_axis_is_refused(world: int, seed: int) -> None:
    rng = rng_for("neg_ag_axis", world, seed)
    a, b = world * size(rng, 1, 2), size(rng)
    inputs = {"x": In([a, b, b], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            t = g.op("Transpose", x["x"], perm=[0, 2, 1])
            return t, g.output(t)
        t = g.op("Transpose", x["x"], perm=[0, 2, 1])
        return t, g.output(g.coll("AllGather", t, everyone(world), axis=1 + seed % 2))  # BUG: not axis 0

    case, (t, out), ranks = make_case("neg_ag_axis", world, inputs, body)
    gathered = {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    refused(case, seed, t, out, [o for _, o in ranks], wrong=lambda tt, lay: tt in gathered or kind(lay) != "sl")


@grid
def test_allgather_in_wrong_group_order_is_refused(world: int, seed: int) -> None:
    """Group [1, 0], [1, 2, 0], [0, 2, 1, 3]: the pieces are concatenated out of shard order."""
    rng = rng_for("neg_ag_order", world, seed)
    d = world * size(rng, 1, 2)
    inputs = {"x": In([d, size(rng)], shard(0))}
    group = scrambled(world)

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        return x["x"], g.output(x["x"] if r is None else g.coll("AllGather", x["x"], group, axis=0))

    case, (x, out), ranks = make_case("neg_ag_order", world, inputs, body)
    gathered = {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    refused(case, seed, x, out, [o for _, o in ranks], wrong=lambda t, lay: t in gathered)


@grid
def test_all_to_all_in_wrong_group_order_is_refused(world: int, seed: int) -> None:
    """AllToAll in a scrambled group order: each member concatenates the row blocks out of order."""
    rng = rng_for("neg_a2a_order", world, seed)
    d, e = world * size(rng, 1, 2), world * size(rng, 1, 2)
    inputs = {"x": In([d, e], shard(0))}
    group = scrambled(world)

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            return x["x"], g.output(x["x"])
        t = g.coll("AllToAll", x["x"], group, split_axis=1, concat_axis=0)
        return t, g.output(g.coll("AllGather", t, group, axis=1))

    case, (x, out), ranks = make_case("neg_a2a_order", world, inputs, body)
    moved = {f"r{r}:{t}" for r, (t, _) in enumerate(ranks)} | {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    refused(case, seed, x, out, [o for _, o in ranks], wrong=lambda t, lay: t in moved)


@grid
def test_reduce_scatter_chunks_on_wrong_axis_are_refused(world: int, seed: int) -> None:
    """ReduceScatter on axis 1, consumed as if it were chunks of axis 0 (gathered on axis 0)."""
    rng = rng_for("neg_rs_axis", world, seed)
    d0, d1 = world * size(rng, 1, 2), world * size(rng, 1, 2)
    inputs = {"p": In([d0, d1], partial())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            return x["p"], g.output(x["p"])
        c = g.coll("ReduceScatter", x["p"], everyone(world), axis=1)
        return c, g.output(g.coll("AllGather", c, everyone(world), axis=0))

    case, (p, out), ranks = make_case("neg_rs_axis", world, inputs, body)
    gathered = {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    res = refused(case, seed, p, out, [o for _, o in ranks], wrong=lambda t, lay: t in gathered)
    c = d1 // world  # the scatter itself is related, as chunks of axis 1
    assert {lay for t, lay in res.relations_of(p) if t.split(":")[1] in {cc for cc, _ in ranks}} == \
        {("sl", 1, j * c, (j + 1) * c) for j in range(world)}


@grid
def test_reduce_scatter_gathered_out_of_group_order_is_refused(world: int, seed: int) -> None:
    """Scattered in group [K-1, ..., 0] (rank r holds chunk K-1-r), gathered in rank order."""
    rng = rng_for("neg_rs_order", world, seed)
    a, k = world * size(rng, 1, 2), size(rng, 1, 2)
    case, (s, out), ranks = make_case("neg_rs_order", world, {"x": In([a, k * world], rep())},
                                      reversed_pieces_body(world, k, everyone(world)))
    gathered = {f"r{r}:{o}" for r, (_, o) in enumerate(ranks)}
    res = refused(case, seed, s, out, [o for _, o in ranks], wrong=lambda t, lay: t in gathered)
    assert "reduce_scatter" in res.checked.lemmas_checked


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", ["reduce_op", "axis", "missing"])
def test_mismatched_collective_calls_are_reported(world: int, variant: str) -> None:
    """Members that disagree on the attributes, or a member that never makes the call: the
    real runtime would fail or hang (the simulator refuses), and the report says so."""
    rng = rng_for("neg_mismatch", world, len(variant))
    d = world * size(rng, 1, 2)
    inputs = {"x": In([d, d], shard(0))}
    last = world - 1

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if variant == "axis":  # the last member gathers on axis 1, the others on axis 0
            return g.output(x["x"] if r is None else g.coll("AllGather", x["x"], everyone(world), axis=int(r == last)))
        y = g.op("ReduceSum", x["x"], g.ints([0]), keepdims=1)  # partial sums
        if r is None:
            return g.output(y)
        if variant == "reduce_op":  # the last member takes the max, the others the sum
            return g.output(g.coll("AllReduce", y, everyone(world), reduce_op="max" if r == last else "sum"))
        return g.output(y if r == last else g.coll("AllReduce", y, everyone(world)))  # the last never calls

    case, y, ranks = make_case(f"neg_mismatch_{variant}", world, inputs, body)
    with pytest.raises(SimulationError):
        simulate(case, 0)
    report, derived = static_report(case)
    assert report.verdict != "verified"
    expected = "never makes it" if variant == "missing" else "disagree"
    assert any(expected in m for m in report.collective_mismatches), report.collective_mismatches
    outs = {f"r{r}:{o}" for r, o in enumerate(ranks)}
    assert not [lay for s, t, lay in derived.get("rel") if s == f"seq:{y}" and t in outs and kind(lay) != "psum"]
    assert derived.get("sanity") == []


@grid
def test_whole_axis_slice_of_a_partial_is_the_partial(world: int, seed: int) -> None:
    """full_slice's psl clause: a rank Slice that keeps the whole axis of its partial sum
    (psl over [0, D)) is that partial, so the all-reduce after it still gives the replica."""
    rng = rng_for("psl_full", world, seed)
    m, n, k = size(rng), size(rng), world * size(rng, 1, 2)
    inputs = {"x": In([m, k], shard(1)), "w": In([k, n], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        y = g.op("MatMul", x["x"], x["w"])
        if r is not None:
            y = g.op("Slice", y, g.ints([0]), g.ints([n]), g.ints([1]))  # keeps all of axis 1
            y = g.coll("AllReduce", y, everyone(world))
        g.output(y)

    case, _, _ = make_case("psl_full", world, inputs, body)
    out = witness(case, seed, "rank_slice:psl", "full_slice", "allreduce_sum")
    assert any(kind(lay) == "psl" for _, _, lay in out.derived.get("rel"))


# --------------------------------------------------------------------------------------------
# vocab-parallel embedding (values.lp, embedding.lp)


def token_ids(shape: list[int], vocab: int, lo: int = 0) -> In:
    """Token ids declared in [lo, vocab)."""
    return In(shape, {"layout": "rep", "range": [lo, vocab]}, INT64)


def vocab_parallel_case(name: str, world: int, seed: int, uneven: bool, rank_body: Callable[..., str],
                        ids: Callable[[int], In] = token_ids) -> tuple[Case, str, list[str]]:
    """seq: take(W, ids); rank r: rank_body(g, ids, W_r, start, end, other=(start', end') of the
    next rank) gives the rank's piece of it, all-reduced. Returns the case, the seq output and the
    ranks' outputs."""
    rng = rng_for(name, world, seed, uneven)
    vocab, layout = sharded(rng, 0, world, uneven, least=2)  # >= 2 rows a rank: ids in [0, 4) fit at TP 2
    inputs = {"ids": ids(vocab) if ids is not token_ids else token_ids([size(rng), size(rng, 4, 9)], vocab),
              "w": In([vocab, size(rng)], layout)}
    spans = bounds_of(layout, vocab, world)

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Gather", x["w"], x["ids"], axis=0))
        other = spans[(r + 1) % world]  # the next rank's rows (for the bugs that use them)
        return g.output(g.coll("AllReduce", rank_body(g, x["ids"], x["w"], *spans[r], other=other), everyone(world)))

    return make_case(name, world, inputs, body)


def iconst(g: Graph, value: int) -> str:
    return g.const(value, np.int64)


def zero_foreign(g: Graph, table: str, local: str, mask: str, foreign: bool, axis: int = -1) -> str:
    """take(W_r, local), with the rows of the ids the mask marks (foreign: True) or spares zeroed."""
    rows = g.op("Gather", table, local, axis=0)
    mask = g.op("Unsqueeze", mask, g.ints([axis]))
    return g.op("Where", mask, g.const(0.0), rows) if foreign else g.op("Where", mask, rows, g.const(0.0))


def foreign_ids(g: Graph, ids: str, start: int, end: int) -> str:
    return g.op("Or", g.op("Less", ids, iconst(g, start)), g.op("GreaterOrEqual", ids, iconst(g, end)))


def local_ids(g: Graph, ids: str, start: int, end: int) -> str:
    return g.op("Where", foreign_ids(g, ids, start, end), iconst(g, 0), g.op("Sub", ids, iconst(g, start)))


def masked_fill_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """Megatron's: foreign = (ids < start) | (ids >= end); local = (ids - start).masked_fill(foreign, 0)."""
    return zero_foreign(g, table, local_ids(g, ids, start, end), foreign_ids(g, ids, start, end), True)


def where_own_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """own = (ids >= start) & (ids < end); local = where(own, ids - start, F), F a local row."""
    own = g.op("And", g.op("GreaterOrEqual", ids, iconst(g, start)), g.op("Less", ids, iconst(g, end)))
    local = g.op("Where", own, g.op("Sub", ids, iconst(g, start)), iconst(g, (end - start) // 2))
    return zero_foreign(g, table, local, own, False, axis=2)  # ids are 2-D: axis 2 is the last


def not_inclusive_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """foreign = not((ids > start - 1) & (ids <= end - 1)); local = where(foreign, 0, ids + (-start))."""
    own = g.op("And", g.op("Greater", ids, iconst(g, start - 1)), g.op("LessOrEqual", ids, iconst(g, end - 1)))
    foreign = g.op("Not", own)
    local = g.op("Where", foreign, iconst(g, 0), g.op("Add", iconst(g, -start), ids))
    return zero_foreign(g, table, local, foreign, True)


@grid
@pytest.mark.parametrize("form", [masked_fill_form, where_own_form, not_inclusive_form], ids=lambda f: f.__name__)
def test_vocab_parallel_embedding(world: int, seed: int, form: Callable[..., str]) -> None:
    """Rank r holds rows [start, end) of the table, looks up the ids it owns and zeroes the rest:
    the ranks' pieces sum to the sequential lookup, for ids declared in [0, vocab). (Seed 1:
    uneven rows.)"""
    case, _, _ = vocab_parallel_case(f"vpe_{form.__name__}", world, seed, seed == 1, form)
    witness(case, seed, "value_compare", "value_bool", "value_offset", "value_window", "vocab_parallel_gather",
            "allreduce_sum")


@seeds
@pytest.mark.parametrize("declared", ["no range", "negative ids"])
def test_vocab_parallel_embedding_needs_ids_in_range(seed: int, declared: str) -> None:
    """ONNX Gather wraps a negative id (row V-1 on the sequential side) while every rank masks it
    out: without ids declared in [0, V) the lemma must not fire."""
    world = 2

    def ids(vocab: int) -> In:
        shape = [2, 6]
        return In(shape, rep(), INT64) if declared == "no range" else token_ids(shape, vocab, lo=-vocab)

    case, y, outs = vocab_parallel_case("vpe_range", world, seed, False, masked_fill_form, ids)
    if declared == "no range":  # ids drawn from [0, 4): right on these numbers, but not proved
        out = run_case(case, seed)
        assert out.checked.ok and out.report.verdict != "verified"
        assert "vocab_parallel_gather" not in out.lemmas_fired()
    else:
        out = refused(case, seed, y, y, outs)
        assert "vocab_parallel_gather" not in out.lemmas_fired()


def off_by_one_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The owned range starts one late: ids <= start counts as foreign (row `start` is lost)."""
    foreign = g.op("Or", g.op("LessOrEqual", ids, iconst(g, start)), g.op("GreaterOrEqual", ids, iconst(g, end)))  # BUG
    local = g.op("Where", foreign, iconst(g, 0), g.op("Sub", ids, iconst(g, start)))
    return zero_foreign(g, table, local, foreign, True)


def unmasked_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The foreign ids look up local row 0, and their rows are never zeroed."""
    return g.op("Gather", table, local_ids(g, ids, start, end), axis=0)


def nonzero_fill_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The foreign rows are filled with 1, not 0."""
    foreign = foreign_ids(g, ids, start, end)
    rows = g.op("Gather", table, local_ids(g, ids, start, end), axis=0)
    return g.op("Where", g.op("Unsqueeze", foreign, g.ints([-1])), g.const(1.0), rows)


def misshifted_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The ids are shifted one row too far (id `start` looks up local row -1: the last one)."""
    foreign = foreign_ids(g, ids, start, end)
    local = g.op("Where", foreign, iconst(g, 0), g.op("Sub", ids, iconst(g, start + 1)))
    return zero_foreign(g, table, local, foreign, True)


def other_window_form(g: Graph, ids: str, table: str, start: int, end: int, other: tuple[int, int]) -> str:
    """Local ids (mask and shift) for the next rank's rows, zeroed with this rank's own mask."""
    return zero_foreign(g, table, local_ids(g, ids, *other), foreign_ids(g, ids, start, end), True)


def other_zero_mask_form(g: Graph, ids: str, table: str, start: int, end: int, other: tuple[int, int]) -> str:
    """The right local ids, zeroed with the next rank's mask."""
    return zero_foreign(g, table, local_ids(g, ids, start, end), foreign_ids(g, ids, *other), True)


def other_rows_form(g: Graph, ids: str, table: str, start: int, end: int, other: tuple[int, int]) -> str:
    """Everything done for the next rank's rows, on this rank's rows."""
    return masked_fill_form(g, ids, table, *other)


@in_turn([(2, 0), (3, 1), (4, 2)], "world,seed", form=[off_by_one_form, unmasked_form, nonzero_fill_form, misshifted_form,
                                                      other_window_form, other_zero_mask_form, other_rows_form])
def test_vocab_parallel_embedding_bugs_are_refused(world: int, seed: int, form: Callable[..., str]) -> None:
    """Refused; the only relation the lookup may get is `own` (rules/owned_rows.lp owned_take: the
    rows of the ids a rank owns, true before any masking, checked on the numbers like the rest)."""
    case, y, outs = vocab_parallel_case(f"neg_vpe_{form.__name__}", world, seed, False, form)
    out = refused(case, seed, y, y, outs, wrong=lambda t, lay: kind(lay) != "own")
    assert "vocab_parallel_gather" not in out.lemmas_fired()


def test_value_range_of_a_float_input_is_bad_input() -> None:
    """A range says what integer values an input takes; on a float input it is a mistake."""
    from refine.errors import InputError

    case, _, _ = make_case("float_range", 2, {"x": In([3], {"layout": "rep", "range": [0, 4]})},
                           lambda g, x, r: g.output(g.op("Relu", x["x"])))
    with pytest.raises(InputError, match="integer inputs only"):
        lower_models(case.loaded())


# --------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy and the lookup's backward (embedding.lp, ranges.lp)


def broadcast_to(g: Graph, x: str, shape: list[int]) -> str:
    """x[:, None] expanded to `shape` [N, C] (a row statistic against a row of logits)."""
    return g.op("Expand", g.op("Unsqueeze", x, g.ints([1])), g.ints(shape))


def cross_entropy(g: Graph, logits: str, labels: str, rows: int, start: int, end: int, world: int | None,
                  bug: str | None = None) -> tuple[str, str]:
    """Megatron's _VocabParallelCrossEntropy on logits [rows, end - start] (the vocab slice
    [start, end)), forward and backward: the per-row loss and the gradient of its sum. On the
    sequential side (world None: no collectives) start is 0 and end the vocabulary, and the masks
    are the constants the declared label range makes them. `bug` makes one mistake."""
    cols = end - start
    peak = g.op("ReduceMax", logits, g.ints([1]), keepdims=0)
    if world is not None and bug != "local_max":
        peak = g.coll("AllReduce", peak, everyone(world), reduce_op="max")
    shifted = g.op("Sub", logits, broadcast_to(g, peak, [rows, cols]))
    foreign = foreign_ids(g, labels, start, end)
    shift = start + 1 if bug == "misshifted" else start
    local = g.op("Where", foreign, iconst(g, 0), g.op("Sub", labels, iconst(g, shift)))
    picked = g.op("Squeeze", g.op("GatherElements", shifted, g.op("Unsqueeze", local, g.ints([1])), axis=1), g.ints([1]))
    predicted = picked if bug == "unmasked_pick" else g.op("Where", foreign, g.const(0.0), picked)
    exp = g.op("Exp", shifted)
    total = g.op("ReduceSum", exp, g.ints([1]), keepdims=0)
    if world is not None:
        predicted = g.coll("AllReduce", predicted, everyone(world))
        total = g.coll("AllReduce", total, everyone(world))
    loss = g.op("Sub", g.op("Log", total), predicted)
    softmax = g.op("Div", exp, broadcast_to(g, total, [rows, cols]))
    update = g.op("Sub", g.const(1.0), g.op("Cast", foreign, to=FLOAT))
    if bug == "unmasked_update":
        update = g.op("Expand", g.const(1.0), g.ints([rows]))
    zeros = g.op("Expand", g.const(0.0), g.ints([rows, cols]))
    onehot = g.op("ScatterElements", zeros, g.op("Unsqueeze", local, g.ints([1])), g.op("Unsqueeze", update, g.ints([1])),
                  axis=1)
    return loss, g.op("Sub", softmax, onehot)


def cross_entropy_case(name: str, world: int, seed: int, uneven: bool, bug: str | None = None) -> tuple[Case, Any, list[Any]]:
    """seq: the cross-entropy of logits [N, V] against labels in [0, V); rank r: the same on its
    vocab shard (uneven with `uneven`), the loss a replica and the gradient a shard."""
    rng = rng_for(name, world, seed, uneven)
    rows = size(rng, 3, 9)
    vocab, layout = sharded(rng, 1, world, uneven, least=2)
    spans = bounds_of(layout, vocab, world)
    inputs = {"logits": In([rows, vocab], layout), "labels": token_ids([rows], vocab)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        start, end = (0, vocab) if r is None else spans[r]
        loss, grad = cross_entropy(g, x["logits"], x["labels"], rows, start, end, None if r is None else world,
                                   None if r is None else bug)
        return [g.output(loss), g.output(grad)]

    return make_case(name, world, inputs, body)


@grid
def test_vocab_parallel_cross_entropy(world: int, seed: int) -> None:
    """Megatron's vocab-parallel cross-entropy, forward and backward: the loss (the target logit
    picked where a rank owns the label, all-reduced) is a replica, the gradient (softmax less one
    at the target, subtracted where a rank owns it) a vocab shard. (Seed 1: uneven shards.)"""
    case, _, _ = cross_entropy_case("vp_ce", world, seed, seed == 1)
    out = witness(case, seed, "expand_broadcast", "seq_passes", "value_view", "row_take", "owned_sum", "scatter_owned",
                  "value_compare", "value_window", "allreduce_max", "allreduce_sum")
    assert out.report.verdict == "verified"


@in_turn([(2, 0), (3, 1), (4, 2)], "world,seed", bug=["local_max", "misshifted", "unmasked_pick", "unmasked_update"])
def test_vocab_parallel_cross_entropy_bugs_are_refused(world: int, seed: int, bug: str) -> None:
    """The row max not all-reduced (expand_broadcast must not take a rank's own max for the
    global one), the labels shifted one too far, the picked logit not zeroed where another rank
    owns the label, the backward subtracting 1 on every rank."""
    case, seq_outs, rank_outs = cross_entropy_case(f"neg_vp_ce_{bug}", world, seed, False, bug)
    which = 1 if bug == "unmasked_update" else 0
    out = refused(case, seed, seq_outs[which], seq_outs[which], [outs[which] for outs in rank_outs])
    if bug == "unmasked_update":
        assert "scatter_owned" not in out.lemmas_fired()


@seeds
@pytest.mark.parametrize("declared", ["no range", "negative labels"])
def test_vocab_parallel_cross_entropy_needs_labels_in_range(seed: int, declared: str) -> None:
    """GatherElements and ScatterElements wrap a negative index (column V-1) on the sequential
    side while every rank masks it out, and without a declared range the sequential masks are no
    constants: the target pick and the backward scatter must not be related then."""
    world = 2
    rng = rng_for("vp_ce_range", seed, len(declared))
    rows = size(rng, 3, 6)
    vocab, layout = sharded(rng, 1, world, False, least=2)
    spans = bounds_of(layout, vocab, world)
    labels = In([rows], rep(), INT64) if declared == "no range" else token_ids([rows], vocab, lo=-vocab)
    inputs = {"logits": In([rows, vocab], layout), "labels": labels}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        start, end = (0, vocab) if r is None else spans[r]
        loss, grad = cross_entropy(g, x["logits"], x["labels"], rows, start, end, None if r is None else world)
        return [g.output(loss), g.output(grad)]

    case, _, _ = make_case(f"vp_ce_range_{declared.replace(' ', '_')}", world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    assert not {"row_take", "owned_sum", "scatter_owned"} & out.lemmas_fired()


@seeds
def test_scatter_with_two_indices_a_row_is_not_related(seed: int) -> None:
    """ScatterElements without a reduction and two indices a row: two updates may meet in one
    place, written in no defined order, so scatter_owned (one index a row) must not fire."""
    world = 2
    rng = rng_for("vp_scatter_two", seed)
    rows = size(rng, 3, 6)
    vocab, layout = sharded(rng, 1, world, False, least=2)
    spans = bounds_of(layout, vocab, world)
    inputs = {"labels": token_ids([rows, 2], vocab), "upd": In([rows, 2], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        start, end = (0, vocab) if r is None else spans[r]
        foreign = foreign_ids(g, x["labels"], start, end)
        local = g.op("Where", foreign, iconst(g, 0), g.op("Sub", x["labels"], iconst(g, start)))
        update = g.op("Where", foreign, g.const(0.0), x["upd"])
        zeros = g.op("Expand", g.const(0.0), g.ints([rows, end - start]))
        return g.output(g.op("ScatterElements", zeros, local, update, axis=1))

    case, _, _ = make_case("vp_scatter_two", world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert "scatter_owned" not in out.lemmas_fired() and out.report.verdict != "verified"


def lookup_backward(g: Graph, ids: str, grad: str, start: int, end: int, hidden: int, torch_form: bool,
                    sequential: bool, bug: str | None = None) -> str:
    """The gradient of take(W[start:end], local ids) with the foreign rows zeroed: the rows of
    `grad` scattered (added) into a zero table at the local ids (the sequential side: all ids,
    no masks). With `torch_form`, as torch's embedding_dense_backward decomposes it: ids checked
    against [0, rows) and -1 (padding), clamped, and the unchecked rows zeroed (masks the label
    range makes constants). `bug` makes one mistake."""
    rows = end - start
    local, kept = ids, grad
    if not sequential:
        foreign = foreign_ids(g, ids, start, end)
        local = g.op("Where", foreign, iconst(g, 0), g.op("Sub", ids, iconst(g, start)))
        if bug != "unmasked_rows":
            kept = g.op("Where", g.op("Unsqueeze", foreign, g.ints([-1])), g.const(0.0), grad)
    if torch_form:
        valid = g.op("And", g.op("And", g.op("GreaterOrEqual", local, iconst(g, 0)), g.op("Less", local, iconst(g, rows))),
                     g.op("Not", g.op("Equal", local, iconst(g, -1))))
        kept = g.op("Where", g.op("Not", g.op("Unsqueeze", valid, g.ints([-1]))), g.const(0.0), kept)
        local = g.op("Clip", local, iconst(g, 0), iconst(g, rows - 1))
    table = g.op("Expand", g.const(0.0), g.ints([rows, hidden]))
    return g.op("ScatterND", table, g.op("Unsqueeze", local, g.ints([-1])), kept, reduction="add")


def lookup_backward_case(name: str, world: int, seed: int, uneven: bool, torch_form: bool,
                         bug: str | None = None) -> tuple[Case, Any, list[Any]]:
    rng = rng_for(name, world, seed, uneven)
    vocab, layout = sharded(rng, 0, world, uneven, least=2)
    spans = bounds_of(layout, vocab, world)
    batch, seq_len, hidden = size(rng, 1, 3), size(rng, 3, 7), size(rng)
    inputs = {"ids": token_ids([batch, seq_len], vocab), "grad": In([batch, seq_len, hidden], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        start, end = (0, vocab) if r is None else spans[r]
        return g.output(lookup_backward(g, x["ids"], x["grad"], start, end, hidden, torch_form, r is None, bug))

    return make_case(name, world, inputs, body)


@grid
@pytest.mark.parametrize("torch_form", [False, True], ids=["plain", "torch_form"])
def test_vocab_parallel_lookup_backward(world: int, seed: int, torch_form: bool) -> None:
    """The table gradient of a vocab-parallel lookup: each rank adds the gradient rows of the ids
    it owns into its rows of the table (the others zeroed before the scatter): a row shard of the
    sequential scatter. The torch form's range checks are constants on both sides."""
    case, _, _ = lookup_backward_case("vp_lookup_bw", world, seed, seed == 1, torch_form)
    lemmas = ["owned_rows", "scatter_owned", "value_window"] + (["seq_passes", "rank_passes"] if torch_form else [])
    witness(case, seed, *lemmas)


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 2)])
@pytest.mark.parametrize("torch_form", [False, True], ids=["plain", "torch_form"])
def test_vocab_parallel_lookup_backward_with_unmasked_rows_is_refused(world: int, seed: int, torch_form: bool) -> None:
    """The foreign ids' gradient rows added into local row 0: not the rank's rows of the table."""
    case, y, outs = lookup_backward_case("neg_vp_lookup_bw", world, seed, False, torch_form, "unmasked_rows")
    out = refused(case, seed, y, y, outs)
    assert "scatter_owned" not in out.lemmas_fired()


# --------------------------------------------------------------------------------------------
# MoE routing (routing.lp)


def routing(g: Graph, logits: str, tokens: int, experts: int, k: int) -> list[str]:
    """What a replicated router computes from its logits [tokens, experts]: the top-k weights
    and experts, a dense routing matrix (scattered weights), the picked logits, one-hot experts,
    the best expert (ArgMax) and the worst (ArgMin)."""
    top_w, top_i = g.op_n("TopK", logits, g.ints([k]), outputs=2, axis=1)
    dense = g.op("ScatterElements", g.const(np.zeros((tokens, experts))), top_i, top_w, axis=1)
    picked = g.op("GatherElements", logits, top_i, axis=1)
    onehot = g.op("OneHot", top_i, g.const(experts, np.int64), g.const([0.0, 1.0]), axis=-1)
    best = g.op("ArgMax", logits, axis=1, keepdims=0)
    worst = g.op("ArgMin", logits, axis=1, keepdims=1, select_last_index=1)
    return [top_w, top_i, dense, picked, onehot, best, worst]


@grid
def test_replicated_routing(world: int, seed: int) -> None:
    """A replicated router: every rank picks and places exactly what the sequential one does."""
    rng = rng_for("routing", world, seed)
    tokens, experts = size(rng), size(rng, 3, 6)
    k = int(rng.integers(1, experts))
    inputs = {"logits": In([tokens, experts], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        return [g.output(t) for t in routing(g, x["logits"], tokens, experts, k)]

    case, outs, _ = make_case("routing", world, inputs, body)
    out = witness(case, seed, "replica_op")
    # every output of every op (TopK's two, ScatterElements, GatherElements, OneHot, ArgMax, ArgMin)
    related = {s.split(":", 1)[1] for s, t, lay, lemma in out.derived.get("rel_by") if lemma == "replica_op"}
    assert set(outs) <= related


@grid
def test_routing_on_a_shard_of_the_experts_is_refused(world: int, seed: int) -> None:
    """TopK over each rank's own experts (the logits sharded along the experts axis) is not the
    top-k of all experts."""
    rng = rng_for("neg_routing", world, seed)
    tokens, experts = size(rng), world * size(rng, 2, 3)
    inputs = {"logits": In([tokens, experts], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        top_w, _ = g.op_n("TopK", x["logits"], g.ints([2]), outputs=2, axis=1)
        return top_w, g.output(top_w)

    case, (top_w, out), ranks = make_case("neg_routing", world, inputs, body)
    refused(case, seed, top_w, out, [o for _, o in ranks])


@seeds
@pytest.mark.parametrize("indices", ["declared", "topk_other_axis"])
def test_scatter_without_distinct_indices_is_not_related(seed: int, indices: str) -> None:
    """ScatterElements without a reduction writes duplicate indices in no defined order: without
    indices distinct along the scatter axis, no relation.  (With an accumulating reduction the
    order does not matter in real arithmetic: tests/test_lemmas_backward.py.)"""
    world = 2
    rng = rng_for("scatter_dup", seed, len(indices))
    n = size(rng, 3, 5)
    inputs = {"x": In([n, n], rep()), "idx": In([n, 1], {"layout": "rep", "range": [0, n]}, INT64)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        base = g.op("Slice", x["x"], g.ints([0]), g.ints([2]), g.ints([0]))  # [2, n]
        if indices == "declared":  # any [2, n] indices in [0, n)
            idx, attrs = g.op("Concat", x["idx"], x["idx"], axis=1), {}
            idx = g.op("Slice", g.op("Transpose", idx, perm=[1, 0]), g.ints([0]), g.ints([n]), g.ints([1]))
        else:  # [2, n], distinct along axis 0 only
            idx, attrs = g.op_n("TopK", x["x"], g.ints([2]), outputs=2, axis=0)[1], {}
        return g.output(g.op("ScatterElements", base, idx, base, axis=1, **attrs))

    case, y, _ = make_case(f"scatter_{indices}", world, inputs, body)
    out = run_case(case, seed)
    assert out.checked.ok
    assert out.relations_of(y) == [] and out.report.verdict != "verified"


@pytest.mark.parametrize("world", [2, 3])
def test_slice_before_opset_10_reads_its_attributes(tmp_path, world: int) -> None:
    """Slice-1 (opsets 1 to 9) has starts, ends and axes as attributes, not inputs: the same
    slice lemmas apply, checked numerically (a row slice of a column-sharded input keeps the
    shard; a rank-side slice of a replica along the columns is that rank's shard)."""
    import json

    import onnx
    from onnx import helper

    from refine.lowering.graphs import lower_dir
    from refine.diagnose.simulate import simulate_dir
    from refine.diagnose.witness import check

    a, b = 5, 2 * world
    cols = b // world

    def program(width: int, rank: int | None) -> onnx.ModelProto:
        nodes = [helper.make_node("Slice", ["x"], ["rows"], name="rows", starts=[1], ends=[-1], axes=[0])]
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [a, width]),
                  helper.make_tensor_value_info("z", TensorProto.FLOAT, [a, b])]
        if rank is not None:  # the rank's columns of a replicated z
            nodes.append(helper.make_node("Slice", ["z"], ["mine"], name="mine", starts=[rank * cols],
                                          ends=[(rank + 1) * cols], axes=[1]))
        else:  # (outputs correspond by name)
            nodes.append(helper.make_node("Identity", ["z"], ["mine"], name="mine"))
        outputs = {"rows": [a - 2, width], "mine": [a, cols] if rank is not None else [a, b]}
        graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape)
                                                       for o, shape in outputs.items()])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])

    onnx.save(program(b, None), tmp_path / "seq.onnx")
    for r in range(world):
        onnx.save(program(cols, r), tmp_path / f"rank{r}.onnx")
    (tmp_path / "refine.json").write_text(json.dumps(
        {"world_size": world, "inputs": {"x": {"layout": "shard", "axis": 1}, "z": {"layout": "rep"}}}))
    facts = lower_dir(tmp_path)
    derived = solve(facts)
    rows = sorted((t, lay) for s, t, lay in derived.get("rel") if s == "seq:rows")
    assert rows == [(f"r{r}:rows", ("sl", 1, r * cols, (r + 1) * cols)) for r in range(world)]
    mine = sorted((t, lay) for s, t, lay in derived.get("rel") if s == "seq:z" and t.endswith(":mine"))
    assert mine == [(f"r{r}:mine", ("sl", 1, r * cols, (r + 1) * cols)) for r in range(world)]
    checked = check(derived, simulate_dir(tmp_path, 0), 0)
    assert checked.ok, checked.violations[:3]
    assert {"slice", "rank_slice"} <= checked.lemmas_checked


# --------------------------------------------------------------------------------------------
# Point-to-point calls and Broadcast


def _stage_chain_body(world: int, order: list[int]) -> Body:
    """A pipeline over the ranks in `order`: stage k (rank order[k]) multiplies by its weight
    w_k, receives its input from the stage before (the first reads x) and sends to the next; the
    last stage alone outputs y = x * w_0 * ... * w_(K-1), every other stage outputs nothing."""
    def body(g: Graph, x: dict[str, str], r: int | None) -> str | None:
        if r is None:
            h = x["x"]
            for k in range(world):
                h = g.op("Mul", h, x[f"w{k}"])
            return g.output(h)
        k = order.index(r)
        h = x["x"] if k == 0 else g.recv(x["x"], order[k - 1], tag=5)
        h = g.op("Mul", h, x[f"w{k}"])
        if k < world - 1:
            g.send(h, order[k + 1], tag=5)
            return None
        return g.output(h)
    return body


@grid
def test_pipeline_of_sends_and_recvs(world: int, seed: int) -> None:
    """Each stage's Recv gets what the stage before it sent (recv), and a Send's output is its
    input (send); over a scrambled stage order on 4 ranks too."""
    rng = rng_for("p2p_chain", world, seed)
    a, b = size(rng), size(rng)
    inputs = {"x": In([a, b], rep()), **{f"w{k}": In([a, b], rep()) for k in range(world)}}
    order = scrambled(world) if seed == 1 else everyone(world)
    case, _, _ = make_case("p2p_chain", world, inputs, _stage_chain_body(world, order))
    witness(case, seed, "recv", "send")


@grid
def test_recv_carries_any_layout(world: int, seed: int) -> None:
    """Every rank sends its shard (and its partial) to the next rank in a ring, which gathers and
    all-reduces what it received: the shards and pieces moved one member along, so the group
    order of the gather is rotated to match."""
    rng = rng_for("p2p_ring", world, seed)
    d, k = world * size(rng, 1, 2), world * size(rng, 1, 2)
    inputs = {"x": In([size(rng), d], shard(1)), "a": In([size(rng), k], shard(1)), "b": In([k, size(rng)], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        p = g.op("MatMul", x["a"], x["b"])
        if r is None:
            g.output(x["x"])
            g.output(p)
            return
        nxt, prev = (r + 1) % world, (r - 1) % world
        if r % 2 == 0:  # even ranks send first, odd ones receive first (a send waits for its receive)
            g.send(x["x"], nxt)
            g.send(p, nxt, tag=1)
        got_x, got_p = g.recv(x["x"], prev), g.recv(p, prev, tag=1)
        if r % 2:
            g.send(x["x"], nxt)
            g.send(p, nxt, tag=1)
        moved = [(m + 1) % world for m in range(world)]  # member J now holds piece J
        g.output(g.coll("AllGather", got_x, moved, axis=1))
        g.output(g.coll("AllReduce", got_p, moved))

    case, _, _ = make_case("p2p_ring", world, inputs, body)
    witness(case, seed, "recv:sl", "recv:psum", "allgather", "allreduce_sum")


@grid
def test_broadcast(world: int, seed: int) -> None:
    """Every member gets the root's value: a replica from any root, a shard from its owner."""
    rng = rng_for("broadcast", world, seed)
    d = world * size(rng, 1, 2)
    inputs = {"x": In([size(rng), size(rng)], rep()), "s": In([size(rng), d], shard(1))}
    group = scrambled(world) if seed == 2 else everyone(world)
    root = group[-1]

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(x["x"])
            g.output(g.op("Slice", x["s"], g.ints([root * (d // world)]), g.ints([(root + 1) * (d // world)]), g.ints([1])))
            return
        g.output(g.coll("Broadcast", x["x"], group, root=root))
        g.output(g.coll("Broadcast", x["s"], group, root=root))

    case, _, _ = make_case("broadcast", world, inputs, body)
    witness(case, seed, "broadcast:rep", "broadcast:sl")


@pytest.mark.parametrize("world,variant", [(w, v) for w in (2, 3) for v in ("crossed", "wrong_peer", "wrong_tag")
                                           if (w, v) != (2, "wrong_peer")])  # (two ranks have one peer each)
def test_point_to_point_calls_that_cannot_run_together(world: int, variant: str) -> None:
    """A ring where every rank sends before it receives (crossed: each send waits for a receive
    that is never posted), a Send to a rank that expects nothing, a tag the receiver does not
    use: the simulator refuses to run them and the static report says why, naming the calls."""
    rng = rng_for("neg_p2p", world, len(variant))
    inputs = {"x": In([size(rng), size(rng)], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Neg", x["x"]))
        nxt, prev = (r + 1) % world, (r - 1) % world
        if variant == "crossed" or r == 0:
            peer = (r + 2) % world if variant == "wrong_peer" else nxt
            g.send(x["x"], peer, tag=1 if variant == "wrong_tag" else 0)
        got = g.recv(x["x"], prev)
        if variant != "crossed" and r != world - 1:
            g.send(got, nxt)
        return g.output(g.op("Neg", got))

    case, _, _ = make_case(f"neg_p2p_{variant}", world, inputs, body)
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(case, 0)
    report, derived = static_report(case)
    assert report.verdict != "verified"
    expected = "cannot run together" if variant == "crossed" else "never makes it"
    assert any(expected in m for m in report.collective_mismatches), report.collective_mismatches
    assert report.failure is not None and report.failure.collectives
    if variant == "crossed":
        assert all(f"rank {r} waits in Send" in report.collective_mismatches[0] for r in range(world))
    assert derived.get("sanity") == []


@seeds
def test_pipeline_micro_batches_sent_out_of_order_is_refused(seed: int) -> None:
    """Two stages, two micro-batches: stage 0 sends its second micro-batch first, stage 1 takes
    the first arrival for the first micro-batch (class 13, a stage sending the wrong one)."""
    rng = rng_for("neg_p2p_micro", seed)
    b, h = 2 * size(rng, 1, 3), size(rng)
    inputs = {"x": In([b, h], rep()), "w0": In([h, h], rep()), "w1": In([h, h], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str | None:
        if r is None:
            return g.output(g.op("MatMul", g.op("MatMul", x["x"], x["w0"]), x["w1"]))
        halves = [g.op("Slice", x["x"], g.ints([k * b // 2]), g.ints([(k + 1) * b // 2]), g.ints([0])) for k in (0, 1)]
        if r == 0:
            for k in (1, 0) if bug else (0, 1):  # the bug: micro-batch 1 goes first
                g.send(g.op("MatMul", halves[k], x["w0"]), 1)
            return None
        got = [g.recv(halves[k], 0) for k in (0, 1)]
        return g.output(g.op("Concat", *[g.op("MatMul", t, x["w1"]) for t in got], axis=0))

    bug = False
    witness(make_case("p2p_micro", 2, inputs, body)[0], seed, "recv:sl", "send:sl", "rank_concat")
    bug = True
    case, y, (_, y1) = make_case("neg_p2p_micro", 2, inputs, body)
    sim = simulate(case, seed)
    assert not same(sim.ranks[1][y1], sim.seq[y])
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    assert not [lay for t, lay in out.relations_of(y) if t == f"r1:{y1}"]
    assert out.report.verdict != "verified"
    assert "recv" in out.checked.lemmas_checked


@seeds
@pytest.mark.parametrize("dims", [("dp", "tp"), ("tp", "dp")])
def test_layouts_over_a_mesh_dimension(seed: int, dims: tuple[str, str]) -> None:
    """On a 2 x 3 mesh, inputs sharded and partial `over` the tp dim (copied along dp): the ranks
    of each tp group gather their shards and sum their partials within the group, as the
    declaration says (the simulator draws each group's summands afresh)."""
    rng = rng_for("mesh_over", seed, len(dims[0]))
    shape = [2, 3] if dims == ("dp", "tp") else [3, 2]
    tp = shape[dims.index("tp")]
    mesh = {"shape": shape, "dims": list(dims)}
    world = 6
    coords = [dict(zip(dims, divmod(r, shape[1]))) for r in range(world)]
    groups = [[q for q in range(world) if coords[q]["dp"] == coords[r]["dp"]] for r in range(world)]
    d = tp * size(rng, 1, 2)
    inputs = {"s": In([size(rng), d], {**shard(1), "over": "tp"}), "p": In([size(rng), size(rng)], {**partial(), "over": "tp"})}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        if r is None:
            g.output(x["s"])
            g.output(x["p"])
            return
        g.output(g.coll("AllGather", x["s"], groups[r], axis=1))
        g.output(g.coll("AllReduce", x["p"], groups[r]))

    def local(inp: In, r: int, _world: int) -> list[int]:
        out = list(inp.shape)
        if inp.layout["layout"] == "shard":
            out[1] //= tp
        return out

    seq = Graph()
    body(seq, {n: seq.input(n, i.shape, i.dtype) for n, i in inputs.items()}, None)
    ranks = []
    for r in range(world):
        g = Graph()
        body(g, {n: g.input(n, local(i, r, world), i.dtype) for n, i in inputs.items()}, r)
        ranks.append(g)
    case = Case("mesh_over", seq, ranks, {n: i.layout for n, i in inputs.items()}, mesh=mesh)
    witness(case, seed, "allgather", "allreduce_sum", "declared:sl", "declared:psum")


def test_reshape_of_a_tensor_past_32_bit_sizes_derives_no_layout() -> None:
    """clingo's integers are 32-bit and wrap silently: x [4, 65537, 65536] has 2^32 + 65536
    elements after axis 0, which wraps to 65536, and with that flat size a rank's [2, 65537,
    65536] -> [131074, 65536] would read as blk(0, 4, 2r, 2r + 2) (every 4th row pair, a
    layout that passes the shape guard) where it is really a contiguous slice. rules/shape.lp
    forms no product past 2^31 - 1, so no reshape relation is derived there at all (shapes only:
    too big to simulate, so the derivation itself is checked)."""
    world, rows, mid, inner = 2, 4, 65537, 65536
    inputs = {"x": In([rows, mid, inner], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        n = rows if r is None else rows // world
        g.output(g.op("Reshape", x["x"], g.ints([n * mid, inner])))

    case, _, _ = make_case("reshape_past_int32", world, inputs, body)
    derived = solve(lower_models(case.loaded()))
    by_reshape = [(s, t, lay) for s, t, lay, lemma in derived.get("rel_by") if lemma == "reshape"]
    assert by_reshape == []


@grid
def test_reshape_keeping_the_sharded_axis(world: int, seed: int) -> None:
    """Axes before the sharded one merge or split, the sharded axis and those after it stay: the
    slice moves to the output axis of the same size with the same sizes after it (the lemma that
    needs no flat period, for tensors whose D*Q passes 32 bits)."""
    rng = rng_for("reshape_keep", world, seed)
    a, b, d = size(rng), size(rng), size(rng)
    c, lay = sharded(rng, 2, world, uneven=seed % 2 == 1)
    inputs = {"x": In([a, b, c, d], lay)}
    xb = bounds_of(lay, c, world)

    def body(g: Graph, x: dict[str, str], r: int | None) -> None:
        cr = c if r is None else xb[r][1] - xb[r][0]
        merged = g.output(g.op("Reshape", x["x"], g.ints([a * b, cr, d])))
        g.output(g.op("Reshape", merged, g.ints([b, a, cr, d])))

    case, _, _ = make_case("reshape_keep", world, inputs, body)
    witness(case, seed, "reshape_keep_axis", "reshape_keep_axis:sl")


def _constant_chunk_case(name: str, world: int, seed: int, shift: int = 0) -> tuple[Case, str, list[str]]:
    """Rows of X sharded over the ranks plus a per-row constant C: each rank holds the chunk of C
    at its rows (ALiBi's slopes cut by rank), or with `shift` the chunk of the rank `shift` after."""
    rng = rng_for(name, world, seed)
    n, c = size(rng, 1, 3), size(rng)
    table = rng.standard_normal((world * n, 1)).astype(np.float32) * 3.0 + 1.0
    inputs = {"x": In([world * n, c], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Add", x["x"], g.const(table)))
        lo = (r + shift) % world * n
        return g.output(g.op("Add", x["x"], g.const(table[lo:lo + n])))

    case, seq_out, rank_outs = make_case(name, world, inputs, body)
    return case, seq_out, rank_outs


@grid
def test_a_rank_constant_that_is_its_chunk_of_the_sequential_constant(world: int, seed: int) -> None:
    """A constant equal to chunk r of the sequential constant on rank r relates as that slice
    (rules/core.lp const_rel sl: the lowering's chunk hashes); the rows it is added to stay the
    rank's rows, checked on the numbers."""
    case, _, _ = _constant_chunk_case("const_chunk", world, seed)
    witness(case, seed)


@grid
def test_a_rank_constant_of_another_ranks_chunk_is_refused(world: int, seed: int) -> None:
    """Each rank holding the next rank's chunk of the constant (the same values, the wrong rows):
    no relation of the sum, not verified."""
    case, seq_out, rank_outs = _constant_chunk_case("neg_const_chunk", world, seed, shift=1)
    refused(case, seed, seq_out, seq_out, rank_outs)
