"""Numeric witnesses for a tensor-parallel rank that runs its batch in micro-batches (a pipeline
stage of TP ranks: torchtitan's PP x TP): each micro-batch is a window of the sequential program
(rules/windows.lp, seeded by the rank's even cuts of a replicated data input), and the rank holds
a TP shard of each window.

Covered: window_concat (the micro-batches' shards concatenated in order are the shard of the
whole), the chunk of a tensor whose every value is decided (kval on a window: SDPA's
fully-masked-row guard passes the chunk's scores), and elementwise's bc clause (an op whose
operands are all constant along an axis is constant along it). Each has a refused twin: the
micro-batches concatenated out of order, a guard that is not decided, an operand that varies
along the axis.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import Case, Graph, rep, shard
from test_lemmas_structure import (
    In,
    cross_entropy,
    lookup_backward,
    make_case,
    refused,
    rng_for,
    size,
    token_ids,
    witness,
)

CASES = [(2, 2, 0), (3, 2, 1), (2, 3, 2)]  # (TP ranks, micro-batches, seed)


def stage(world: int, micro: int, seed: int, *, order: list[int] | None = None,
          masked_rows: tuple[int, ...] = ()) -> tuple[Case, str]:
    """y = tanh(where(mask, 0, x @ w)) with w column-parallel and mask a constant of each side's own
    shape (SDPA's fully-masked-row guard, all false: decided); each rank runs the batch in `micro`
    micro-batches (cut from the replicated x) and concatenates its shards of the micro-batches'
    outputs in `order` (default: in order). `masked_rows`: batch rows the sequential mask sets
    true (then it is not the ranks' all-false guard)."""
    rng = rng_for("micro_batches", world, micro, seed)
    b, s, h = micro * size(rng, 2, 3), size(rng, 2, 3), size(rng, 2, 4)  # (chunks of 2 rows or more)
    f = world * size(rng, 1, 2)
    inputs = {"x": In([b, s, h], rep()), "w": In([h, f], shard(1))}

    def guarded(g: Graph, x: str, w: str, rows: int, masked: tuple[int, ...], cols: int) -> str:
        # (the side's own rows and columns: a rank's mask is no slice of the sequential one that
        # a constant's value alone relates, so only the decided value lets the guard pass)
        mask = np.zeros((rows, s, cols), dtype=bool)
        mask[list(masked)] = True
        return g.op("Tanh", g.op("Where", g.const(mask, np.bool_), g.const(0.0), g.op("MatMul", x, w)))

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(guarded(g, x["x"], x["w"], b, masked_rows, f))
        rows = b // micro
        parts = [guarded(g, g.op("Slice", x["x"], g.ints([k * rows]), g.ints([(k + 1) * rows]), g.ints([0])), x["w"],
                         rows, (), f // world) for k in range(micro)]
        return g.output(g.op("Concat", *[parts[k] for k in (order or range(micro))], axis=0))

    case, y, _ = make_case(f"micro_batches-{world}-{micro}-{seed}", world, inputs, body)
    case.outputs = {y: shard(2)}
    return case, y


@pytest.mark.parametrize("world,micro,seed", CASES)
def test_tp_rank_concatenates_its_micro_batches(world: int, micro: int, seed: int) -> None:
    """Each micro-batch's guarded scores are the rank's columns of that window (the guard decided
    false on the window passes the scores), and their concatenation in order is the rank's columns
    of the whole."""
    case, y = stage(world, micro, seed)
    out = witness(case, seed, "window_concat", "seq_passes", "rank_passes", "matmul_column_parallel")
    assert any(isinstance(t, str) and lay[:2] == ("sl", 2) for t, lay in out.relations_of(y)), out.relations_of(y)


@pytest.mark.parametrize("world,micro,seed", CASES[:2])
def test_micro_batches_concatenated_out_of_order_are_refused(world: int, micro: int, seed: int) -> None:
    """The last micro-batch first: the rank's rows are not the shard of the whole in order."""
    case, y = stage(world, micro, seed, order=[micro - 1, *range(micro - 1)])
    refused(case, seed, y, y, [case.ranks[r].outputs[0] for r in range(world)],
            wrong=lambda t, lay: isinstance(t, str) and not lay[:2] == ("sl", 2))


def test_guard_that_is_not_decided_is_refused() -> None:
    """The sequential mask sets the last row true where the ranks' is all false: the last
    window's guard is not all false, nothing passes its scores, and the outputs differ."""
    case, y = stage(2, 2, 3, masked_rows=(-1,))
    refused(case, 3, y, y, [case.ranks[r].outputs[0] for r in range(2)])


def constant_rows(world: int, seed: int, varying: bool = False) -> tuple[Case, str]:
    """y = (expand(c, [n, h]) + d) * x with x split by rows: c one row, d one row (or, `varying`, n
    rows of which every rank takes the first n / world: not its own rows) -- the sum constant
    along axis 0 unless varying. Returns the case and the sum."""
    rng = rng_for("constant_rows", world, seed)
    n, h = world * size(rng, 1, 3), size(rng, 2, 4)
    inputs = {"c": In([1, h], rep()), "d": In([n if varying else 1, h], rep()), "x": In([n, h], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        rows = n if r is None else n // world
        d = x["d"] if r is None or not varying else g.op("Slice", x["d"], g.ints([0]), g.ints([rows]), g.ints([0]))
        total = g.op("Add", g.op("Expand", x["c"], g.ints([rows, h])), d)
        g.output(g.op("Mul", total, x["x"]))
        return total

    case, total, _ = make_case(f"constant_rows-{world}-{seed}-{varying}", world, inputs, body)
    return case, total


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_op_of_operands_constant_along_an_axis(world: int, seed: int) -> None:
    """A row expanded to a rank's n / world rows plus a row: constant along the rows, so any n /
    world of the sequential rows (bc), the rank's own among them."""
    case, total = constant_rows(world, seed)
    out = witness(case, seed, "elementwise", "expand_broadcast")
    assert any(lay[:2] == ("bc", 0) for _, lay in out.relations_of(total)), out.relations_of(total)


def test_operand_that_varies_along_the_axis_is_refused() -> None:
    """The added rows vary along the axis and every rank takes the first ones: no bc, not verified."""
    case, total = constant_rows(3, 2, varying=True)
    y = case.seq.outputs[0]
    refused(case, 2, total, y, [case.ranks[r].outputs[0] for r in range(3)], wrong=lambda t, lay: lay[0] == "bc")


# --- the loss and the lookup's gradient of a micro-batch, vocab-parallel ------------------------

def micro_cross_entropy(world: int, micro: int, seed: int, bug: str | None = None) -> tuple[Case, list[str]]:
    """seq: Megatron's cross-entropy (test_lemmas_structure.cross_entropy) of logits x @ w [n, V]
    against labels in [0, V): the per-row loss and the logits' gradient. Rank r: x and the labels
    cut into `micro` micro-batches, each micro-batch's cross-entropy on the rank's vocab columns
    (w column-parallel), the micro-batches' losses and gradients concatenated in order. The pick
    and the scatter of each micro-batch run off their axis on a window of the rows; its row max
    and row sum reduce without keepdims. `bug`: one of cross_entropy's mistakes."""
    rng = rng_for("micro_ce", world, micro, seed)
    rows_k, h, vocab = size(rng, 2, 3), size(rng, 2, 4), world * size(rng, 2, 3)
    n, cols = micro * rows_k, vocab // world
    inputs = {"x": In([n, h], rep()), "w": In([h, vocab], shard(1)), "labels": token_ids([n], vocab)}

    def body(g: Graph, x: dict[str, str], r: int | None) -> list[str]:
        if r is None:
            loss, grad = cross_entropy(g, g.op("MatMul", x["x"], x["w"]), x["labels"], n, 0, vocab, None)
            return [g.output(loss), g.output(grad)]
        losses, grads = [], []
        for k in range(micro):
            xs, ids = (g.op("Slice", x[name], g.ints([k * rows_k]), g.ints([(k + 1) * rows_k]), g.ints([0]))
                       for name in ("x", "labels"))
            loss, grad = cross_entropy(g, g.op("MatMul", xs, x["w"]), ids, rows_k, r * cols, (r + 1) * cols, world, bug)
            losses.append(loss)
            grads.append(grad)
        return [g.output(g.op("Concat", *losses, axis=0)), g.output(g.op("Concat", *grads, axis=0))]

    case, outs, _ = make_case(f"micro_ce-{world}-{micro}-{seed}-{bug}", world, inputs, body)
    case.outputs = {outs[0]: rep(), outs[1]: shard(1)}
    return case, outs


@pytest.mark.parametrize("world,micro,seed", CASES)
def test_vocab_parallel_cross_entropy_of_micro_batches(world: int, micro: int, seed: int) -> None:
    """Each micro-batch's target pick and its gradient's scatter are the pick and scatter of that
    window of the rows (GatherElements / ScatterElements off their axis), its row max and sum
    without keepdims the window's: the losses a replica, the gradients a vocab shard, in order."""
    case, outs = micro_cross_entropy(world, micro, seed)
    out = witness(case, seed, "row_take", "owned_sum", "scatter_owned", "window_concat", "allreduce_max")
    assert any(lay[:2] == ("sl", 1) for _, lay in out.relations_of(outs[1])), out.relations_of(outs[1])


@pytest.mark.parametrize("bug", ["misshifted", "unmasked_pick", "unmasked_update"])
def test_vocab_parallel_cross_entropy_of_micro_batches_bugs_are_refused(bug: str) -> None:
    """The labels shifted one too far, the pick not zeroed where another rank owns the label, the
    backward subtracting 1 on every rank: refused on the micro-batches' windows as on the whole."""
    case, outs = micro_cross_entropy(2, 2, 4, bug)
    out = refused(case, 4, outs[1] if bug == "unmasked_update" else outs[0], outs[1] if bug == "unmasked_update" else outs[0],
                  [g.outputs[1 if bug == "unmasked_update" else 0] for g in case.ranks])
    assert out.report.verdict != "verified"


def micro_lookup_backward(world: int, micro: int, seed: int, bug: str | None = None) -> tuple[Case, str]:
    """seq: the gradient of a lookup take(W, ids) (test_lemmas_structure.lookup_backward: the rows
    of grad scattered, added, into a zero table at the ids). Rank r: ids and grad cut into `micro`
    micro-batches, each micro-batch's rows scattered into the rank's vocab rows (the foreign ids'
    rows zeroed), the micro-batches' tables added: a vocab shard of the sum over all the tokens."""
    rng = rng_for("micro_lookup_bw", world, micro, seed)
    vocab, batch_k, seq_len, hidden = world * size(rng, 2, 3), size(rng, 1, 2), size(rng, 2, 4), size(rng, 2, 3)
    batch, rows = micro * batch_k, vocab // world
    inputs = {"ids": token_ids([batch, seq_len], vocab), "grad": In([batch, seq_len, hidden], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(lookup_backward(g, x["ids"], x["grad"], 0, vocab, hidden, False, True))
        total = None
        for k in range(micro):
            ids, grad = (g.op("Slice", x[name], g.ints([k * batch_k]), g.ints([(k + 1) * batch_k]), g.ints([0]))
                         for name in ("ids", "grad"))
            table = lookup_backward(g, ids, grad, r * rows, (r + 1) * rows, hidden, False, False, bug)
            total = table if total is None else g.op("Add", total, table)
        assert total is not None
        return g.output(total)

    case, y, _ = make_case(f"micro_lookup_bw-{world}-{micro}-{seed}-{bug}", world, inputs, body)
    case.outputs = {y: shard(0)}
    return case, y


@pytest.mark.parametrize("world,micro,seed", CASES)
def test_vocab_parallel_lookup_gradient_of_micro_batches(world: int, micro: int, seed: int) -> None:
    """Each micro-batch's scatter is its chunk's term of the sequential scatter over all the
    tokens (the ScatterND chunk term), the rank's rows of it; the micro-batches' terms added in
    turn are the rank's rows of the whole."""
    case, y = micro_lookup_backward(world, micro, seed)
    # (scatter_owned relates each micro-batch's scatter to its chunk's term, which the simulator
    # does not compute: the term's rows, chunk_term's psl, are what is checked)
    out = witness(case, seed, "chunk_term:psl", "partial_slice_add_adjacent")
    assert "scatter_owned" in out.lemmas_fired()
    assert any(lay[:2] == ("sl", 0) for _, lay in out.relations_of(y)), out.relations_of(y)


def test_lookup_gradient_of_micro_batches_with_unmasked_rows_is_refused() -> None:
    """The foreign ids' gradient rows added into local row 0 in each micro-batch: refused."""
    case, y = micro_lookup_backward(2, 2, 5, "unmasked_rows")
    refused(case, 5, y, y, [g.outputs[0] for g in case.ranks])


# --- a sum over the rows and the sequence, each rank its run of the sequence ------------------

def micro_sequence_sum(world: int, micro: int, seed: int, bug: str | None = None) -> tuple[Case, str]:
    """seq: g = sum of x over its rows and its sequence, reshaped to [h] (an SP norm's weight
    gradient). Rank r: each micro-batch's rows of its run of the sequence summed (keepdims), reshaped
    to [h], and the micro-batches' sums added in turn: its piece of g, the ranks' pieces
    all-reduced to g. `bug`: "twice" adds micro-batch 0's sum where micro-batch 1's belongs."""
    rng = rng_for("micro_seq_sum", world, micro, seed)
    rows_k, s, h = size(rng, 1, 2), world * size(rng, 2, 3), size(rng, 2, 4)  # (runs of 2 or more)
    n, run = micro * rows_k, s // world
    inputs = {"x": In([n, s, h], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Reshape", g.op("ReduceSum", x["x"], g.ints([0, 1]), keepdims=1), g.ints([h])))
        sums = []
        for k in range(micro):
            rows = g.op("Slice", x["x"], g.ints([k * rows_k]), g.ints([(k + 1) * rows_k]), g.ints([0]))
            mine = g.op("Slice", rows, g.ints([r * run]), g.ints([(r + 1) * run]), g.ints([1]))
            sums.append(g.op("Reshape", g.op("ReduceSum", mine, g.ints([0, 1]), keepdims=1), g.ints([h])))
        if bug == "twice":
            sums[1] = sums[0]
        total = sums[0]
        for term in sums[1:]:
            total = g.op("Add", total, term)
        return g.output(g.coll("AllReduce", total, list(range(world))))

    case, y, _ = make_case(f"micro_seq_sum-{world}-{micro}-{seed}-{bug}", world, inputs, body)
    case.outputs = {y: rep()}
    return case, y


@pytest.mark.parametrize("world,micro,seed", CASES)
def test_pieces_of_the_chunks_terms_added_up(world: int, micro: int, seed: int) -> None:
    """Each micro-batch's sum over the rank's run of the sequence is a piece of that chunk's term
    of the whole sum (reduce_sum_sharded on the term), and the rank's pieces of every chunk's term,
    added in chunk order through the reshape, are its piece of the whole: the ranks' pieces add up."""
    case, y = micro_sequence_sum(world, micro, seed)
    # (reduce_sum_sharded relates each micro-batch's sum to its chunk's term, which the simulator
    # does not compute: the pieces of the whole, chunk_term_pieces' psum, are what is checked)
    out = witness(case, seed, "chunk_term_pieces:psum")
    assert {"chunk_term_pieces", "reduce_sum_sharded"} <= out.lemmas_fired()
    assert any(lay[0] == "psum" for _, lay in out.relations_of(y)), out.relations_of(y)


def test_a_chunk_term_added_twice_is_refused() -> None:
    """Micro-batch 0's piece added where micro-batch 1's belongs: not the rank's piece of the sum.
    (Each micro-batch's own sum, its Reshape's output, is a true piece of the sum's atom grid,
    rules/windows.lp's nest style: only the added-up total and the all-reduce may not be pieces.)"""
    case, y = micro_sequence_sum(2, 2, 6, "twice")
    refused(case, 6, y, y, [g.outputs[0] for g in case.ranks],
            wrong=lambda t, lay: lay[0] == "psum" and not t.split(":", 1)[1].startswith("reshape"))
