"""Numeric witnesses for rules/context.lp: the position ids and causal mask of a rank that holds
rows [X, Y) of the sequence (context parallelism) are rows [X, Y) of the sequential ones.

Lemmas: `static_index_rows` (a rank's static integer tensor, read as an affine function of its
indices -- an arange, its offset, its unsqueeze / expand, differences of such -- is rows [X, Y)
of a sequential one), `static_mask_rows` (the same for a mask compared from such tensors, through
Not), `static_broadcast` (one constant expanded to fewer indices of a broadcast axis, or to the
same sizes: a replica), `broadcast_slice` (rules/core.lp: those fewer indices are the shard an
output declares).

Positives (random sizes, uneven rows on odd seeds, a random start, step and diagonal, world sizes
2, 3, 4, asymmetric random activations, run through the multi-rank simulator): the lemma fired,
every relation derived held on the numbers, the whole program verifies. Position ids are built
four ways (an arange from X, an arange from 0 plus X, an arange minus a constant, an arange
unsqueezed and expanded over the batch), and masks three (torch's tril decomposition
`not((cols - rows <= k + X) & ones)`, HF's `cols > rows` comparison of offset aranges, and the
same mask spelled `cols - rows > k + X` on the ranks against `not(cols - rows <= k)` on the
sequential side, which only the forms relate).

Negatives (each a real numeric difference, never verified, nothing wrong derived): positions
not offset (every rank 0..E-1, the CP bug twin), offset by one, with another step; a mask not
offset, off by one either way, offset along the keys instead of the queries; a mask and-ed with
an all-false tensor where the sequential one has all-true.

Ring attention (rules/ring.lp): the ranks hold query rows [X, Y) and pass their key/value blocks
round the ring with Send/Recv, merging per-block partial attention by the online-softmax rule.
Lemma `ring_attention` (O(All, M) / L(All, M) = softmax(Z) @ V, rows [X, Y)) and the facts of
rules/ring.lp it rests on (ring_blk, ring_exp, ring_sum, ring_out: score blocks, exp(Z - M)
terms, block sums and outputs over circular key intervals for a reference M, their rescale and
merge), every one checked here on the simulator (`ring_facts_hold`): the positives in both ring
directions, with the running max or a running mean as the reference, uneven rows; the negatives
(a missing or wrong-signed rescale, a block merged twice or missing, a block's exp taken against
one reference and its merge against another, a block masked with the rank's own columns) are
real numeric differences that do not verify, and everything derived for them still holds.

The world x seed grid is one seed per world size by default (2-0, 3-1, 4-2: even and uneven
rows); `python benchmarks/sweep.py` runs every world size with every seed 0, 1, 2.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest

from harness import Case, Graph, in_turn, run_case, shard, simulate, world_seed_grid
from refine.diagnose.witness import _value
from test_lemmas_structure import In, composition, make_case, refused, rep, rng_for, size, witness

WORLDS = (2, 3, 4)
SEEDS = (0, 1, 2)
grid = pytest.mark.parametrize("world,seed", world_seed_grid(WORLDS, SEEDS))  # all 9 under benchmarks/sweep.py


def iconst(g: Graph, value: int) -> str:
    return g.const(value, np.int64)


def rows_of(rng: np.random.Generator, world: int, uneven: bool,
            least: int = 1) -> tuple[int, list[tuple[int, int]], dict]:
    """A sequence of S tokens cut into one run of at least `least` rows per rank: (S, [(X, Y) per
    rank], layout of axis 1)."""
    if uneven:
        sizes = composition(rng, size(rng, least * world + 1, 3 * world), world, least)
    else:
        sizes = [size(rng, least, 3)] * world
    bounds, lo = [], 0
    for s in sizes:
        bounds.append((lo, lo + s))
        lo += s
    return lo, bounds, shard(1, sizes=sizes if uneven else None)


def buggy(case: Case, seed: int, y: str, outs: list[str], axis: int) -> bool:
    """The ranks' outputs, concatenated along `axis` as declared, differ from the sequential output."""
    sim = simulate(case, seed)
    rebuilt = np.concatenate([sim.ranks[r][t] for r, t in enumerate(outs)], axis=axis)
    return rebuilt.shape != sim.seq[y].shape or not np.allclose(rebuilt, sim.seq[y], rtol=1e-4, atol=1e-4)


# ============================================================================================
# position ids: static_index_rows
# ============================================================================================


def positions(g: Graph, start: int, count: int, step: int, base: int, how: str, batch: int) -> str:
    """Position ids base + step * (start .. start + count - 1) (rank: start = X; seq: start = 0,
    count = S), spelled `how`."""
    first = base + step * start
    if how == "range":
        return g.op("Range", iconst(g, first), iconst(g, first + step * count), iconst(g, step))
    if how == "plus":  # arange(0, count) * step spelled as a range, plus the offset
        r = g.op("Range", iconst(g, 0), iconst(g, step * count), iconst(g, step))
        return g.op("Add", r, iconst(g, first))
    if how == "minus":  # an arange shifted by 5, shifted back
        r = g.op("Range", iconst(g, first + 5), iconst(g, first + 5 + step * count), iconst(g, step))
        return g.op("Sub", r, iconst(g, 5))
    assert how == "expand"  # HF: position_ids = arange(...).unsqueeze(0).expand(batch, -1)
    r = g.op("Range", iconst(g, first), iconst(g, first + step * count), iconst(g, step))
    return g.op("Expand", g.op("Unsqueeze", r, g.ints([0])), g.ints([batch, count]))


def position_case(name: str, world: int, seed: int, how: str, rank_start=None, rank_step=None, least: int = 1):
    """x [B, S, H] sharded on the sequence, W [P, H] replicated: y = x + W[positions]; rank r
    looks up its own rows' positions (rank_start(r, X) and rank_step(step) override them: bugs)."""
    rng = rng_for(f"ctx_positions_{how}", world, seed)
    uneven = seed % 2 == 1
    seq_len, bounds, lay = rows_of(rng, world, uneven, least)
    batch, hidden = size(rng, 1, 3), size(rng)
    step = int(rng.choice([1, 2, -1]))
    base = int(rng.integers(0, 3)) + (seq_len * 4 if step < 0 else 0)
    table = base + 4 * seq_len + 8  # room for the buggy twins' positions too
    inputs = {"x": In([batch, seq_len, hidden], lay), "w": In([table, hidden], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            start, count, st = 0, seq_len, step
        else:
            lo, hi = bounds[r]
            start, count = (rank_start(r, lo) if rank_start else lo), hi - lo
            st = rank_step(step) if rank_step else step
        pos = positions(g, start, count, st, base, how, batch)
        return g.output(g.op("Add", x["x"], g.op("Gather", x["w"], pos, axis=0)))

    case, y, outs = make_case(name, world, inputs, body)
    case.outputs = {y: dict(lay)}  # the sequential output's name
    return case, y, outs


@in_turn(world_seed_grid(WORLDS, SEEDS), "world,seed", how=["range", "plus", "minus", "expand"])
def test_rank_positions_are_rows_of_the_sequential_positions(world: int, seed: int, how: str) -> None:
    """arange(X, Y) = arange(0, S)[X:Y] (and the same through an offset, a shift undone, an
    unsqueeze and expand over the batch): the rank's lookup is rows [X, Y) of the sequential one."""
    case, _, _ = position_case(f"ctx_pos_{how}", world, seed, how)
    witness(case, seed, "static_index_rows:sl")


@grid
@pytest.mark.parametrize("bug", ["not_offset", "one_late", "one_early"])
def test_neg_positions_not_at_the_rank_rows(world: int, seed: int, bug: str) -> None:
    """Every rank's positions from 0 (docs/bugs.md class 9), or one off either way: no relation
    of the output, not verified (every relation derived still holds)."""
    shift = {"not_offset": lambda r, lo: 0, "one_late": lambda r, lo: lo + 1,
             "one_early": lambda r, lo: max(lo - 1, 0) if r else 1}[bug]
    case, y, outs = position_case(f"ctx_pos_{bug}", world, seed, "range", rank_start=shift)
    assert buggy(case, seed, y, outs, 1)
    refused(case, seed, y, y, outs, wrong=lambda t, lay: bug != "not_offset" or not t.startswith("r0:"))


@pytest.mark.parametrize("world", WORLDS)
def test_neg_positions_with_another_step(world: int) -> None:
    """The rank counts its positions by another step: the forms differ, nothing relates them
    (every rank holds two rows or more: one position alone has no step)."""
    case, y, outs = position_case("ctx_pos_step", world, 0, "range", rank_step=lambda s: 2 * s, least=2)
    assert buggy(case, 0, y, outs, 1)
    out = refused(case, seed=0, seq_tensor=y, seq_out=y, rank_outs=outs)
    assert "static_index_rows" not in out.lemmas_fired()


# ============================================================================================
# causal masks: static_mask_rows, static_broadcast
# ============================================================================================


def mask_of(g: Graph, how: str, q0: int, queries: int, k0: int, keys: int, diag: int, ones: bool = True) -> str:
    """The boolean mask of the scores [queries, keys] to fill (True = masked out) for queries
    q0 .. q0+queries-1 (global positions) against keys k0 ..: key j is kept for query i iff
    j <= i + diag. `how` spells it:
      tril:    torch's tril(ones(queries, keys), diagonal=q0 + diag) decomposed, negated
               (rows and cols both from 0; the offset is the diagonal);
      compare: HF's `cols > rows + diag` of offset aranges;
      not_le:  not(cols - rows <= q0 + diag), without the all-true operand;
      greater: the same mask written (cols - rows > q0 + diag)."""
    if how == "compare":
        rows = g.op("Range", iconst(g, q0 + diag), iconst(g, q0 + diag + queries), iconst(g, 1))
        cols = g.op("Range", iconst(g, k0), iconst(g, k0 + keys), iconst(g, 1))
        return g.op("Greater", g.op("Unsqueeze", cols, g.ints([0])), g.op("Unsqueeze", rows, g.ints([1])))
    rows = g.op("Range", iconst(g, 0), iconst(g, queries), iconst(g, 1))
    cols = g.op("Range", iconst(g, k0), iconst(g, k0 + keys), iconst(g, 1))
    sub = g.op("Sub", g.op("Unsqueeze", cols, g.ints([-2])), g.op("Unsqueeze", rows, g.ints([-1])))
    if how == "greater":
        return g.op("Greater", sub, iconst(g, q0 + diag))
    keep = g.op("LessOrEqual", sub, iconst(g, q0 + diag))
    if how == "not_le":
        return g.op("Not", keep)
    full = g.op("Expand", g.const(ones, np.bool_), g.ints([queries, keys]))
    return g.op("Not", g.op("And", keep, full))


def mask_case(name: str, world: int, seed: int, how: str, seq_how: str | None = None, rank_q0=None,
              rank_keys0=None, rank_ones: bool = True, causal: bool = False):
    """x [B, H, S, T] scores sharded on the queries (axis 2): y = where(mask, -50, x), the
    sequential mask for queries 0.., the rank's for its rows X.. (rank_q0(r, X), rank_keys0(r, X)
    and rank_ones override it: bugs; `causal`: the diagonal of a plain causal mask, under which
    every query but the last misses a key)."""
    rng = rng_for(f"ctx_mask_{how}_{seq_how}", world, seed)
    uneven = seed % 2 == 1
    seq_len, bounds, lay = rows_of(rng, world, uneven)
    lay = {**lay, "axis": 2}
    keys = seq_len + int(rng.integers(0, 3))   # keys may outnumber queries (a cached prefix)
    diag = (0 if causal else int(rng.integers(0, 3))) + keys - seq_len
    batch, heads = size(rng, 1, 2), size(rng, 1, 3)
    inputs = {"x": In([batch, heads, seq_len, keys], lay)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            mask = mask_of(g, seq_how or how, 0, seq_len, 0, keys, diag)
        else:
            lo, hi = bounds[r]
            q0 = rank_q0(r, lo) if rank_q0 else lo
            k0 = rank_keys0(r, lo) if rank_keys0 else 0
            mask = mask_of(g, how, q0, hi - lo, k0, keys, diag, rank_ones)
        return g.output(g.op("Where", mask, g.const(-50.0), x["x"]))

    case, y, outs = make_case(name, world, inputs, body)
    case.outputs = {y: dict(lay)}  # the sequential output's name
    return case, y, outs


@grid
@pytest.mark.parametrize("how", ["tril", "compare"])
def test_rank_causal_mask_is_rows_of_the_sequential_mask(world: int, seed: int, how: str) -> None:
    """The mask of queries X..Y-1 against every key is rows [X, Y) of the sequential mask
    (torch's tril: the all-true operand ones(E, T) is E rows of ones(S, T): static_broadcast)."""
    case, _, _ = mask_case(f"ctx_mask_{how}", world, seed, how)
    lemmas = ["static_mask_rows:sl"] + (["static_broadcast:bc"] if how == "tril" else [])
    witness(case, seed, *lemmas)


@grid
def test_rank_mask_spelled_otherwise_meets_the_sequential_mask(world: int, seed: int) -> None:
    """The ranks compute `cols - rows > X + k`, the sequential program `not(cols - rows <= k)`:
    no node pairs, the half-space forms (through Not) relate them."""
    case, _, _ = mask_case("ctx_mask_greater", world, seed, "greater", seq_how="not_le")
    out = witness(case, seed, "static_mask_rows:sl")
    assert "elementwise" in out.lemmas_fired()  # the Where; the masks themselves never pair


@in_turn(world_seed_grid(WORLDS, SEEDS), "world,seed", bug=["not_offset", "one_late", "one_early", "keys_offset"])
def test_neg_mask_not_at_the_rank_rows(world: int, seed: int, bug: str) -> None:
    """A mask not offset (every rank's queries from 0: docs/bugs.md class 9), off by one either
    way, or offset along the keys instead of the queries: not verified, nothing wrong derived."""
    q0 = {"not_offset": lambda r, lo: 0, "one_late": lambda r, lo: lo + 1, "one_early": lambda r, lo: lo - 1,
          "keys_offset": lambda r, lo: 0}[bug]
    keys0 = (lambda r, lo: lo) if bug == "keys_offset" else None
    case, y, outs = mask_case(f"ctx_mask_{bug}", world, seed, "tril", rank_q0=q0, rank_keys0=keys0, causal=True)
    assert buggy(case, seed, y, outs, 2)
    # (rank 0 is right where its rows start at 0 anyway)
    refused(case, seed, y, y, outs, wrong=lambda t, lay: bug in ("one_late", "one_early") or not t.startswith("r0:"))


@pytest.mark.parametrize("world", WORLDS)
def test_neg_mask_and_all_false(world: int) -> None:
    """The ranks and their mask with an all-false tensor (every score masked out) where the
    sequential program has all-true: the constants differ, static_broadcast does not relate them."""
    case, y, outs = mask_case("ctx_mask_false", world, 0, "tril", rank_ones=False, causal=True)
    assert buggy(case, 0, y, outs, 2)
    out = refused(case, 0, y, y, outs)
    assert "static_broadcast" not in out.lemmas_fired()


def broadcast_case(world: int, seed: int, rank_shift: float = 0.0, sharded: bool = False,
                   rows_short: int = 0) -> tuple[Case, str, list[str]]:
    """y = x + expand(c, x's shape) on both sides, c a random constant row ([1, M]) and x a
    replica: the two Expands are the same tensor (a frozen parameter's zero gradient is this with
    c = 0).  `sharded`: the output is expand(c) itself, declared sharded on axis 0 (even rows; the
    rank expands c to its rows only, `rows_short` fewer on the last rank).  `rank_shift` added to
    the last rank's constant: a different tensor."""
    rng = rng_for(f"ctx_broadcast_{sharded}", world, seed)
    rows, cols = size(rng) * (world if sharded else 1), size(rng)
    c = rng.standard_normal((1, cols)).astype(np.float32)
    inputs = {"x": In([rows, cols], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        const = c + np.float32(rank_shift if r == world - 1 else 0.0)
        if not sharded:
            return g.output(g.op("Add", x["x"], g.op("Expand", g.const(const), g.ints([rows, cols]))))
        local = rows if r is None else rows // world - (rows_short if r == world - 1 else 0)
        return g.output(g.op("Expand", g.const(const), g.ints([local, cols])))

    case, y, outs = make_case(f"ctx_broadcast_{sharded}", world, inputs, body)
    case.outputs = {y: shard(0) if sharded else rep()}
    return case, y, outs


@grid
def test_constant_expanded_alike_is_a_replica(world: int, seed: int) -> None:
    """Both sides expand one constant to the same sizes: the same tensor (static_broadcast, rep)."""
    case, _, _ = broadcast_case(world, seed)
    witness(case, seed, "static_broadcast:rep")


@grid
def test_constant_expanded_to_a_shard_is_the_shard(world: int, seed: int) -> None:
    """The ranks expand the constant to their rows only: any rows of the whole, so the shard the
    output declares (static_broadcast, then broadcast_slice)."""
    case, _, _ = broadcast_case(world, seed, sharded=True)
    witness(case, seed, "static_broadcast:bc", "broadcast_slice", "broadcast_slice:sl")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("bug", ["other_constant", "rows_short"])
def test_neg_constants_expanded_alike_differ(world: int, bug: str) -> None:
    """The last rank expands another constant (a replica, or its shard), or too few rows of it:
    not the sequential tensor, nothing relates the last rank's output as declared."""
    sharded = bug == "rows_short" or world % 2 == 0
    case, y, outs = broadcast_case(world, 0, rank_shift=0.5 if bug == "other_constant" else 0.0, sharded=sharded,
                                   rows_short=1 if bug == "rows_short" else 0)
    if sharded:
        sim = simulate(case, 0)
        assert np.concatenate([sim.ranks[r][t] for r, t in enumerate(outs)]).shape != sim.seq[y].shape \
            or bug == "other_constant"
    out = run_case(case, 0)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    last = f"r{world - 1}:"
    declared = ("sl" if sharded else "rep")
    assert not [lay for t, lay in out.relations_of(y) if t.startswith(last) and lay[0] == declared], \
        out.relations_of(y)


def test_forms_stay_per_graph() -> None:
    """A rank mask and a sequential one related by static_mask_rows come from forms of their own
    graph: the rank's rows are X.. only where its constants say so (rank 0's mask relates to rows
    [0, E), rank 1's to rows [X1, X1 + E))."""
    case, _, _ = mask_case("ctx_mask_rows", 2, 0, "tril")
    out = run_case(case, 0)
    rows = {(t.split(":")[0], lay) for s, t, lay, lemma in out.derived.get("rel_by") if lemma == "static_mask_rows"}
    assert {g for g, _ in rows} == {"r0", "r1"}
    starts = {g: lay[2] for g, lay in rows}
    assert starts["r0"] == 0 and starts["r1"] > 0


# ============================================================================================
# ring attention: rules/ring.lp
# ============================================================================================

RING_SHOW_LP = """% the facts of rules/ring.lp, shown so that the witnesses can check every one on the simulator
#show ring_blk_by/4.
#show ring_sum_by/8.
#show ring_out_by/9.
#show ring_exp/7.
#show ring_stuck/3.
"""


@functools.cache
def ring_show() -> Path:
    """A rule directory of #show lines alone (passed as extra rules: it derives nothing)."""
    folder = Path(tempfile.mkdtemp(prefix="ring_show_"))
    (folder / "show.lp").write_text(RING_SHOW_LP)
    return folder

RING_LEMMAS = {"ring_block_scores", "ring_block_slice", "ring_block_elementwise", "ring_block_sum",
               "ring_block_out", "ring_rescale", "ring_merge"}
FILL = -30.0  # the masked scores' value (a finite fill, as torch's finfo.min)


def ring_case(name: str, world: int, seed: int, variant: str = "max", reverse: bool = False):
    """q, k, v [B, H, S, d] sharded on the sequence (axis 2; uneven rows on odd seeds). The sequential
    program: O = softmax(where(cols > rows, FILL, q k^T * c)) @ v. Rank r: the rows [X, Y) of the
    mask against every key (static_mask_rows), and its key/value blocks passed round the ring
    (to r + 1, from r - 1; `reverse`: the other way), each block's columns sliced from the mask,
    merged by the online softmax. `variant`: max (the running max as the reference), mean (a
    running mean: any reference), and the bugs no_rescale, wrong_rescale, block_twice,
    block_missing, mixed_ref, mask_not_offset."""
    rng = rng_for(f"ring_{variant}_{reverse}", world, seed)
    uneven = seed % 2 == 1
    seq_len, bounds, lay = rows_of(rng, world, uneven)
    lay = {**lay, "axis": 2}
    batch, heads, d, dv = size(rng, 1, 2), size(rng, 1, 2), size(rng, 1, 3), size(rng, 1, 3)
    scale = float(rng.choice([0.5, 0.7, 1.3]))
    inputs = {"q": In([batch, heads, seq_len, d], lay), "k": In([batch, heads, seq_len, d], lay),
              "v": In([batch, heads, seq_len, dv], lay)}

    def scores(g: Graph, q: str, k: str, masked: str) -> str:
        s = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(scale))
        return g.op("Where", masked, g.const(FILL), s)

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            z = scores(g, x["q"], x["k"], mask_of(g, "compare", 0, seq_len, 0, seq_len, 0))
            return g.output(g.op("MatMul", g.op("Softmax", z, axis=-1), x["v"]))
        lo, hi = bounds[r]
        masked = mask_of(g, "compare", lo, hi - lo, 0, seq_len, 0)   # rows [X, Y) against every key
        step = 1 if reverse else -1
        nxt, prv = (r - step) % world, (r + step) % world
        k, v, m, l, o = x["k"], x["v"], None, None, None
        for t in range(world):
            src = (r + step * t) % world
            if t < world - 1:  # even ranks send first, odd ones receive first
                nb = bounds[(r + step * (t + 1)) % world]  # the block that arrives: the next step's
                shape_in = [batch, heads, nb[1] - nb[0]]
                bufs = [g.const(np.zeros(shape_in + [w], np.float32)) for w in (d, dv)]
                if r % 2 == 0:
                    k, v = g.send(k, nxt), g.send(v, nxt)
                got = [g.recv(bufs[0], prv), g.recv(bufs[1], prv)]
                if r % 2:
                    k, v = g.send(k, nxt), g.send(v, nxt)
            first = lo if variant == "mask_not_offset" else bounds[src][0]
            width = bounds[src][1] - bounds[src][0]
            cols = g.op("Slice", masked, g.ints([first]), g.ints([first + width]), g.ints([1]))
            z = scores(g, x["q"], k, cols)
            ref = "ReduceMean" if variant == "mean" else "ReduceMax"
            mb = g.op(ref, z, g.ints([3]), keepdims=1)
            mn = mb if m is None else (g.op("Max", m, mb) if variant != "mean" else g.op("Mul", g.op("Add", m, mb),
                                                                                         g.const(0.5)))
            p = g.op("Exp", g.op("Sub", z, mb if variant == "mixed_ref" and t > 0 else mn))
            lb, ob = g.op("ReduceSum", p, g.ints([3]), keepdims=1), g.op("MatMul", p, v)
            if m is None:
                l, o = lb, ob
                if variant == "block_twice":
                    a = g.op("Exp", g.op("Sub", mn, mn))
                    l, o = g.op("Add", g.op("Mul", l, a), lb), g.op("Add", g.op("Mul", o, a), ob)
            elif variant == "block_missing" and t == world - 1:
                pass  # the last block is scored but never merged
            elif variant == "no_rescale":
                l, o = g.op("Add", l, lb), g.op("Add", o, ob)
            else:
                a = g.op("Exp", g.op("Sub", mn, m) if variant == "wrong_rescale" else g.op("Sub", m, mn))
                l, o = g.op("Add", g.op("Mul", l, a), lb), g.op("Add", ob, g.op("Mul", a, o))
            m = mn
            if t < world - 1:
                k, v = got
        return g.output(g.op("Div", o, l))

    case, y, outs = make_case(name, world, inputs, body)
    case.outputs = {y: dict(lay)}
    return case, y, outs


def ring_facts_hold(case: Case, seed: int) -> tuple[object, set[str]]:
    """Solve with the facts of rules/ring.lp shown, simulate, and check every one of them on the
    numbers: (the outcome, the names of the ring lemmas that derived them)."""
    out = run_case(case, seed, rules=[ring_show()])
    assert out.checked.ok, out.checked.violations
    sim = simulate(case, seed)
    val = lambda t: _value(sim, t)  # noqa: E731
    fired: set[str] = set()

    def keys(z: np.ndarray, u: int, n: int) -> np.ndarray:
        return (u + np.arange(n)) % z.shape[-1]

    for s, t, (_, a, x0, y0, c, u, w), lemma in out.derived.get("ring_blk_by"):
        want = np.take(np.take(val(s), np.arange(x0, y0), axis=a), np.arange(u, w), axis=c)
        assert np.allclose(val(t), want, atol=1e-5), (s, t, lemma)
        fired.add(str(lemma))
    for z, t, x0, y0, u, n, m, lemma in out.derived.get("ring_sum_by"):
        zz = val(z)[..., x0:y0, :][..., keys(val(z), u, n)]
        want = np.exp(zz - val(m)).sum(axis=-1, keepdims=True)
        assert np.allclose(val(t), want, rtol=1e-4, atol=1e-5), (z, t, lemma)
        fired.add(str(lemma))
    for z, v, t, x0, y0, u, n, m, lemma in out.derived.get("ring_out_by"):
        kk = keys(val(z), u, n)
        want = np.exp(val(z)[..., x0:y0, :][..., kk] - val(m)) @ val(v)[..., kk, :]
        assert np.allclose(val(t), want, rtol=1e-4, atol=1e-5), (z, t, lemma)
        fired.add(str(lemma))
    for z, t, x0, y0, u, n, m in out.derived.get("ring_exp"):
        want = np.exp(val(z)[..., x0:y0, :][..., keys(val(z), u, n)] - val(m))
        assert np.allclose(val(t), want, rtol=1e-4, atol=1e-5), (z, t)
    return out, fired


@in_turn(world_seed_grid(WORLDS, SEEDS), "world,seed", variant=["max", "mean"], reverse=[False, True])
def test_ring_attention_merges_blocks_into_the_rows_of_the_attention(world: int, seed: int, variant: str,
                                                                     reverse: bool) -> None:
    """Every block's scores, exp terms, sums and outputs hold on the numbers, every ring lemma
    fired, and O / L is the rank's rows of softmax(Z) @ V (`ring_attention`): the program verifies,
    whatever the ring's direction and whether the reference is the running max or a running mean."""
    case, _, _ = ring_case(f"ring_{variant}", world, seed, variant, reverse)
    witness(case, seed, "ring_attention:sl")
    _, fired = ring_facts_hold(case, seed)
    assert fired == RING_LEMMAS, RING_LEMMAS - fired


@in_turn(world_seed_grid(WORLDS, SEEDS), "world,seed",
         bug=["no_rescale", "wrong_rescale", "block_twice", "block_missing", "mixed_ref", "mask_not_offset"])
def test_neg_ring_attention(world: int, seed: int, bug: str) -> None:
    """A merge without the rescale or with exp(m_new - m_old), the first block merged twice, the
    last block never merged, a block's terms against its own max but merged as if against the
    running one, every block masked with the rank's own columns: a numeric difference, not
    verified, nothing wrong derived (every fact of rules/ring.lp that is derived still holds)."""
    case, y, outs = ring_case(f"ring_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)
    out, _ = ring_facts_hold(case, seed)
    assert "ring_attention" not in out.lemmas_fired()
    # where the ring stops (ring_stuck, for failure reports): the op the bug is in
    stuck = {(str(m).split(":", 1)[1].split("_")[0], str(why)) for _g, m, why in out.derived.get("ring_stuck")}
    want = {"no_rescale": ("Add", "merge"), "block_twice": ("Add", "merge"), "mixed_ref": ("Add", "merge"),
            "wrong_rescale": ("Mul", "rescale"), "block_missing": ("Div", "finish"),
            "mask_not_offset": ("Where", "block_operand")}[bug]
    assert want in stuck, stuck


@in_turn(world_seed_grid(WORLDS, SEEDS), "world,seed", reverse=[False, True])
def test_ring_attention_is_stuck_nowhere(world: int, seed: int, reverse: bool) -> None:
    """A correct ring has no ring_stuck fact: the failure hints never fire on a proof."""
    case, _, _ = ring_case("ring_max", world, seed, "max", reverse)
    out = run_case(case, seed, rules=[ring_show()])
    assert out.derived.get("ring_stuck") == [], out.derived.get("ring_stuck")


# ============================================================================================
# zig-zag (load-balanced) chunks: allgather_block + rank_concat (rules/collectives.lp, shape.lp)
# ============================================================================================
# Rank r of N holds chunks r and 2N-1-r of 2N along the sequence (exporters/strategies/context.py,
# ZigZagGPT2). It all-gathers each of its two chunks along axis 0 (torch gathers dim 0 only: a
# stack of the members' tensors, in rank order), cuts the members' blocks back out (Split), and
# concatenates the first chunks in rank order and the second chunks in reverse rank order:
#   concat(first_0 .. first_{N-1}, second_{N-1} .. second_0) = chunks 0 .. 2N-1 = the whole axis.
# No rule of its own: a block cut out of a gather is that member's input (allgather_block), and
# adjacent slices concatenate (rank_concat). The negatives are real numeric differences.


def zigzag_case(name: str, world: int, seed: int, bug: str | None = None):
    """x [B, S, H] replicated, S = 2 * world * c; a [T, S] replicated. seq: y = a @ tanh(x).
    Rank r: tanh of its chunks r and 2N-1-r of x (Slice), each all-gathered, split into the
    members' blocks and concatenated into the sequence, then y = a @ that (replicated).
    Bugs: `ascending` (second chunks in rank order), `firsts_reversed` (first chunks in reverse
    rank order), `stride` (the rank takes chunks r and N+r, gathered as zig-zag)."""
    rng = rng_for(f"ctx_zigzag_{bug}", world, seed)
    c, batch, hidden, rows = size(rng, 1, 3), size(rng, 1, 3), size(rng), size(rng)
    seq_len = 2 * world * c
    inputs = {"x": In([batch, seq_len, hidden], rep()), "a": In([rows, seq_len], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("MatMul", x["a"], g.op("Tanh", x["x"])))
        second = world + r if bug == "stride" else 2 * world - 1 - r
        chunks = [g.op("Tanh", g.op("Slice", x["x"], g.ints([k * c]), g.ints([(k + 1) * c]), g.ints([1])))
                  for k in (r, second)]
        blocks = [g.op_n("Split", g.coll("AllGather", t, list(range(world)), axis=0), axis=0, outputs=world,
                         num_outputs=world) for t in chunks]
        firsts = blocks[0][::-1] if bug == "firsts_reversed" else blocks[0]
        seconds = blocks[1] if bug == "ascending" else blocks[1][::-1]
        whole = g.op("Concat", *firsts, *seconds, axis=1)
        return g.output(g.op("MatMul", x["a"], whole))

    case, y, outs = make_case(name, world, inputs, body)
    case.outputs = {y: rep()}
    return case, y, outs


@grid
def test_zigzag_chunks_gather_into_the_sequence(world: int, seed: int) -> None:
    """Each block cut out of a gather is that member's chunk, the first chunks in rank order and
    the second in reverse tile the sequence: the rank's concatenation is the whole of tanh(x)
    and the program verifies."""
    case, _, _ = zigzag_case("ctx_zigzag", world, seed)
    witness(case, seed, "allgather_block:sl", "rank_concat:sl")


@in_turn(world_seed_grid(WORLDS, SEEDS), "world,seed", bug=["ascending", "firsts_reversed", "stride"])
def test_neg_zigzag_chunks_out_of_order(world: int, seed: int, bug: str) -> None:
    """The second chunks in rank order (the zigzag_chunk_order twin), the first chunks reversed, or
    the chunks r and N+r gathered as zig-zag: a numeric difference, not verified, no relation of
    the output derived (every relation derived still holds)."""
    case, y, outs = zigzag_case(f"ctx_zigzag_{bug}", world, seed, bug)
    refused(case, seed, y, y, outs)
