"""Batch windows seeded by a rank's own cut of a replicated input (refine/lowering/graphs.py
`_sliced_replica_windows`, rules/windows.lp): a pipeline stage cuts input_ids into its
micro-batches, and every such cut makes that input's chunks exist as virtual tensors. A seed
defines chunks; it must never relate one. These are random programs over such cuts, judged by
the multi-rank simulator, not by what the rules were meant to do:

- every rank cuts a replicated x along an axis (its own axis and chunk where the program is
  wrong: two ranks cutting along different axes, the same chunk twice, chunks out of order),
  runs a random chain of ops on the cut (elementwise, broadcast Mul, MatMul on rows or
  contracting the cut axis, Softmax, a keepdims ReduceSum, Transpose, LayerNormalization), and
  rebuilds by an AllGather along the cut (or an AllReduce of partial sums);
- every relation refine derives must hold on the numbers (Outcome.checked), and VERIFIED only
  where the ranks' outputs equal the sequential one.

The grid must contain both verdicts (a fuzz that never verifies proves nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from harness import SWEEP, Graph, rep, run_case, simulate
from refine.kit.cases import Case
from refine.diagnose.simulate import SimulationError

FLOAT = TensorProto.FLOAT
PROGRAMS = 48 if SWEEP else 20


@dataclass
class Cut:
    """How rank r cuts x: chunk `chunk` of `parts` along `axis`."""

    axis: int
    chunk: int
    parts: int


def cuts_for(rng: np.random.Generator, world: int, ndim: int) -> tuple[list[Cut], str]:
    """One cut per rank: the right plan (rank r takes chunk r of `world` along one axis), or a
    wrong one (the flaw named)."""
    axis = int(rng.integers(ndim))
    right = [Cut(axis, r, world) for r in range(world)]
    flaw = str(rng.choice(["none", "none", "none", "two_axes", "same_chunk", "order"]))
    if flaw == "two_axes":
        other = (axis + 1 + int(rng.integers(ndim - 1))) % ndim
        return [Cut(other if r % 2 else axis, r, world) for r in range(world)], flaw
    if flaw == "same_chunk":
        return [Cut(axis, 0, world) for _ in range(world)], flaw
    if flaw == "order":
        return [Cut(axis, (r + 1) % world, world) for r in range(world)], flaw
    return right, flaw


def program(seed: int) -> tuple[Case, str]:
    """A random program over cuts of x [d0, d1, d2] (each dim a multiple of the world)."""
    rng = np.random.default_rng([7, seed])
    world = int(rng.integers(2, 5))
    shape = [world * int(rng.integers(1, 3)) for _ in range(3)]
    cuts, flaw = cuts_for(rng, world, 3)
    width = int(rng.integers(2, 5))
    steps = [str(s) for s in rng.choice(["tanh", "mul", "matmul", "softmax", "reduce", "transpose", "norm"],
                                        size=int(rng.integers(1, 4)))]
    perm = [int(p) for p in rng.permutation(3)]
    reduce_axes = sorted({int(a) for a in rng.choice(3, size=int(rng.integers(1, 3)), replace=False)})
    softmax_axis = int(rng.integers(3))
    seq = Graph()
    ranks = [Graph() for _ in range(world)]

    def side(g: Graph, r: int | None) -> str:
        x = g.input("x", shape, FLOAT)
        w = g.input("w", [shape[2]], FLOAT)
        m = g.input("m", [shape[2], width], FLOAT)
        cut = cuts[r] if r is not None else cuts[0]
        axis, partial = cuts[0].axis, False  # (every rank rebuilds as rank 0's cut asks: one collective)
        if r is not None:
            size = shape[cut.axis] // cut.parts
            x = g.op("Slice", x, g.ints([cut.chunk * size]), g.ints([(cut.chunk + 1) * size]), g.ints([cut.axis]))
            if cut.axis == 2:  # (the weight along the last axis: its matching chunk)
                w = g.op("Slice", w, g.ints([cut.chunk * size]), g.ints([(cut.chunk + 1) * size]), g.ints([0]))
        for step in steps:
            if partial:
                break  # (a partial sum through a non-linear op is not what these programs test)
            if step == "tanh":
                x = g.op("Tanh", x)
            elif step == "mul":
                x = g.op("Mul", x, w)
            elif step == "matmul":
                if cut.axis == 2 and r is not None:  # contracting the cut axis: the matching rows of m
                    size = shape[2] // cut.parts
                    m = g.op("Slice", m, g.ints([cut.chunk * size]), g.ints([(cut.chunk + 1) * size]), g.ints([0]))
                x, partial = g.op("MatMul", x, m), axis == 2
                break  # (m's rows match x's last axis only once)
            elif step == "softmax":
                x = g.op("Softmax", x, axis=softmax_axis)
            elif step == "reduce":
                x, partial = g.op("ReduceSum", x, g.ints(reduce_axes), keepdims=1), axis in reduce_axes
                break
            elif step == "transpose":
                x = g.op("Transpose", x, perm=perm)
                axis = perm.index(axis)
                break  # (w and m match the last axis of the untransposed x)
            elif step == "norm":
                x = g.op("LayerNormalization", x, w, axis=-1)
        if r is not None:
            group = list(range(world))
            x = g.coll("AllReduce", x, group, reduce_op="sum") if partial else g.coll("AllGather", x, group, axis=axis)
        return g.output(x)

    side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    layouts = {"x": rep(), "w": rep(), "m": rep()}
    return Case(f"cut-{seed}-{flaw}-{'-'.join(steps)}", seq, ranks, layouts), flaw


def test_programs_over_cuts_verify_only_where_the_numbers_agree() -> None:
    verdicts: dict[str, int] = {}
    for seed in range(PROGRAMS):
        case, _flaw = program(seed)
        try:
            sim = simulate(case, seed)
        except SimulationError:  # (ranks whose cuts make the collective's shapes differ: not a program)
            verdicts["not runnable"] = verdicts.get("not runnable", 0) + 1
            continue
        want = sim.seq[case.seq.outputs[0]]
        agree = all(sim.ranks[r][g.outputs[0]].shape == want.shape
                    and np.allclose(sim.ranks[r][g.outputs[0]], want, atol=1e-4) for r, g in enumerate(case.ranks))
        out = run_case(case, seed)
        assert out.checked.ok, (case.name, out.checked.violations)
        assert out.derived.get("sanity") == [], (case.name, out.derived.get("sanity"))
        verdict = out.report.verdict
        assert verdict != "verified" or agree, f"{case.name}: VERIFIED, but the ranks' outputs differ"
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    assert verdicts.get("verified", 0) >= PROGRAMS // 5, verdicts
    assert sum(n for v, n in verdicts.items() if v not in ("verified", "not runnable")) >= PROGRAMS // 5, verdicts


def test_pieces_cut_along_two_axes_do_not_add() -> None:
    """Rank 0 cuts rows [0:2) of x [4, 4], rank 1 columns [2:4); both reduce their cut over both
    axes and all-reduce: each is a chunk's term of the total, of two different decompositions (rows,
    columns), so the sum counts x[0:2, 2:4] twice and misses x[2:4, 0:2]."""
    seq, ranks = Graph(), [Graph(), Graph()]

    def side(g: Graph, r: int | None) -> str:
        x = g.input("x", [4, 4], FLOAT)
        if r is not None:
            x = g.op("Slice", x, g.ints([2 * r]), g.ints([2 * r + 2]), g.ints([r]))
        x = g.op("ReduceSum", x, g.ints([0, 1]), keepdims=1)
        return g.output(g.coll("AllReduce", x, [0, 1], reduce_op="sum") if r is not None else x)

    side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    case = Case("two-axis-cuts", seq, ranks, {"x": rep()})
    sim = simulate(case, 0)
    assert not np.allclose(sim.ranks[0][ranks[0].outputs[0]], sim.seq[seq.outputs[0]])
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"


def micro_batched_mesh_case(swapped: bool) -> Case:
    """A 2 x 2 (dp, tp) mesh: x [8, 3] split by rows over dp, w [3, 4] by columns over tp. Rank
    (d, t) cuts its 4 rows into 2 micro-batches, multiplies each by its columns of w, all-gathers
    the columns over its TP row and puts the two back in order (`swapped`: in the wrong order); y
    is declared the rows over dp. Each micro-batch is a slice of a DP chunk and its product a TP
    slice of that: only windows of 4 chunks (seeded by the cut of x's shard) state it."""
    seq, ranks = Graph(), [Graph() for _ in range(4)]

    def side(g: Graph, r: int | None) -> str:
        x, w = g.input("x", [8, 3] if r is None else [4, 3], FLOAT), g.input("w", [3, 4] if r is None else [3, 2], FLOAT)
        if r is None:
            return g.output(g.op("MatMul", x, w))
        row = [r - r % 2, r - r % 2 + 1]
        chunks = [g.coll("AllGather", g.op("MatMul", g.op("Slice", x, g.ints([2 * k]), g.ints([2 * k + 2]), g.ints([0])),
                                           w), row, axis=1) for k in (0, 1)]
        return g.output(g.op("Concat", *(reversed(chunks) if swapped else chunks), axis=0))

    out = side(seq, None)
    for r, g in enumerate(ranks):
        side(g, r)
    case = Case(f"micro-batched-mesh-{'swapped' if swapped else 'in-order'}", seq, ranks,
                {"x": {"layout": "shard", "axis": 0, "over": "dp"}, "w": {"layout": "shard", "axis": 1, "over": "tp"}},
                mesh={"shape": [2, 2], "dims": ["dp", "tp"]})
    case.outputs = {out: {"layout": "shard", "axis": 0, "over": "dp"}}
    return case


def test_micro_batches_of_a_dp_shard_are_windows() -> None:
    """The rank's own cut of its DP rows seeds windows of D*M chunks: VERIFIED in order, not
    VERIFIED with the micro-batches swapped (and every relation derived holds on the numbers)."""
    for swapped in (False, True):
        case = micro_batched_mesh_case(swapped)
        out = run_case(case, 0)
        assert out.checked.ok, (case.name, out.checked.violations)
        assert (out.report.verdict == "verified") is not swapped, (case.name, out.report.verdict)
