"""Numeric witnesses for the clamp-then-mask vocab-parallel embedding (torchtitan's
`Embedding`, torchtitan/models/common/embedding.py) and the lemmas its training step needs
(rules/embedding.lp, rules/core.lp), each with refused twins.

- `vocab_parallel_clamped_gather`: rank r holds rows [X, Y) of the table, looks up
  clip(ids - X, 0, Y - X - 1) (a valid local row for every id) and multiplies the rows by the
  0/1 mask (ids >= X) & (ids < Y); the ranks' pieces, all-reduced, are the sequential lookup.
  Written with the mask cast before or after its unsqueeze, the Mul's operands either way, even
  and uneven rows, worlds 2..4.
- `owned_rows_mul` and `scatter_owned` at clamped indices: the lookup's gradient, the upstream
  gradient times the mask scattered (add) into zeros at the clamped ids, is the rank's rows of the
  sequential scatter.
- `scatter_owned` with an update of -1 where the rank owns the label (`owned - 1` of the foreign
  indicator: torchtitan's vocab-parallel cross-entropy backward) against the sequential -1.
- `even_share`: every one of the W ranks holding S / W holds piece [r, r+1) of S (sum = S).

Refused (a real numeric difference; no relation of the wrong kind for the sequential tensor; not
verified; whatever is derived holds): no declared id range, negative ids allowed, the clamp's
upper bound one row short, its lower bound 1, the mask of the next rank's rows, no mask at all,
the foreign mask (zeroing the owned rows); the gradient's updates not masked; the cross-entropy
update taken from the next rank's range; S / 2 on each of 3 ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from onnx import TensorProto

from harness import Graph, rep
from test_lemmas_structure import (INT64, In, bounds_of, iconst, make_case, refused, rng_for, seeds, sharded,
                                   size, token_ids, vocab_parallel_case, witness)

GRID = [(2, 0, False), (3, 1, True), (4, 2, False), (2, 1, True)]


def owned_mask(g: Graph, ids: str, start: int, end: int) -> str:
    """(ids >= start) & (ids < end)."""
    return g.op("And", g.op("GreaterOrEqual", ids, iconst(g, start)), g.op("Less", ids, iconst(g, end)))


def clamped(g: Graph, ids: str, start: int, end: int, lo: int = 0, hi_short: int = 0) -> str:
    """clip(ids - start, lo, end - start - 1 - hi_short) (torchtitan: lo 0, hi_short 0)."""
    return g.op("Clip", g.op("Sub", ids, iconst(g, start)), iconst(g, lo), iconst(g, end - start - 1 - hi_short))


def float_row_mask(g: Graph, mask: str, cast_first: bool) -> str:
    """mask[..., None] as a float (`mask.unsqueeze(-1).to(out.dtype)`, or cast, then unsqueezed)."""
    if cast_first:
        return g.op("Unsqueeze", g.op("Cast", mask, to=TensorProto.FLOAT), g.ints([-1]))
    return g.op("Cast", g.op("Unsqueeze", mask, g.ints([-1])), to=TensorProto.FLOAT)


def torchtitan_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """torchtitan's: rows = take(W_r, clip(ids - start, 0, rows - 1)); rows * mask[..., None]."""
    rows = g.op("Gather", table, clamped(g, ids, start, end), axis=0)
    return g.op("Mul", rows, float_row_mask(g, owned_mask(g, ids, start, end), False))


def cast_first_swapped_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The mask cast before its unsqueeze, and the Mul's operands swapped."""
    rows = g.op("Gather", table, clamped(g, ids, start, end), axis=0)
    return g.op("Mul", float_row_mask(g, owned_mask(g, ids, start, end), True), rows)


@pytest.mark.parametrize("world,seed,uneven", GRID)
@pytest.mark.parametrize("form", [torchtitan_form, cast_first_swapped_form], ids=lambda f: f.__name__)
def test_clamped_vocab_parallel_embedding(world: int, seed: int, uneven: bool, form: Callable[..., str]) -> None:
    case, _, _ = vocab_parallel_case(f"vpc_{form.__name__}", world, seed, uneven, form)
    witness(case, seed, "value_compare", "value_bool", "value_offset", "vocab_parallel_clamped_gather", "allreduce_sum")


def short_clamp_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The clamp's upper bound one row short: the last owned id looks up the row before its own."""
    rows = g.op("Gather", table, clamped(g, ids, start, end, hi_short=1), axis=0)
    return g.op("Mul", rows, float_row_mask(g, owned_mask(g, ids, start, end), False))


def low_clamp_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The clamp's lower bound 1: the first owned id looks up the second row."""
    rows = g.op("Gather", table, clamped(g, ids, start, end, lo=1), axis=0)
    return g.op("Mul", rows, float_row_mask(g, owned_mask(g, ids, start, end), False))


def other_mask_form(g: Graph, ids: str, table: str, start: int, end: int, other: tuple[int, int]) -> str:
    """The right rows, multiplied by the next rank's mask."""
    rows = g.op("Gather", table, clamped(g, ids, start, end), axis=0)
    return g.op("Mul", rows, float_row_mask(g, owned_mask(g, ids, *other), False))


def unmasked_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """The clamped rows, never masked: a foreign id adds the first or last local row."""
    return g.op("Gather", table, clamped(g, ids, start, end), axis=0)


def foreign_mask_form(g: Graph, ids: str, table: str, start: int, end: int, **_: object) -> str:
    """Multiplied by the foreign mask (not owned): the owned rows are the ones zeroed."""
    foreign = g.op("Or", g.op("Less", ids, iconst(g, start)), g.op("GreaterOrEqual", ids, iconst(g, end)))
    rows = g.op("Gather", table, clamped(g, ids, start, end), axis=0)
    return g.op("Mul", rows, float_row_mask(g, foreign, False))


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 2)])
@pytest.mark.parametrize("form", [short_clamp_form, low_clamp_form, other_mask_form, unmasked_form, foreign_mask_form],
                         ids=lambda f: f.__name__)
def test_clamped_embedding_bugs_are_refused(world: int, seed: int, form: Callable[..., str]) -> None:
    case, y, outs = vocab_parallel_case(f"neg_vpc_{form.__name__}", world, seed, False, form)
    out = refused(case, seed, y, y, outs)
    assert "vocab_parallel_clamped_gather" not in out.lemmas_fired()


@seeds
@pytest.mark.parametrize("declared", ["no range", "negative ids"])
def test_clamped_embedding_needs_ids_in_range(seed: int, declared: str) -> None:
    """The sequential Gather wraps a negative id (row V-1) while every rank clamps and masks it:
    without ids declared in [0, V) the lemma must not fire."""

    def ids(vocab: int) -> In:
        shape = [2, 6]
        return In(shape, rep(), INT64) if declared == "no range" else token_ids(shape, vocab, lo=-vocab)

    case, y, outs = vocab_parallel_case("vpc_range", 2, seed, False, torchtitan_form, ids)
    if declared == "no range":
        from harness import run_case

        out = run_case(case, seed)
        assert out.checked.ok and out.report.verdict != "verified"
    else:
        out = refused(case, seed, y, y, outs)
    assert "vocab_parallel_clamped_gather" not in out.lemmas_fired()


# --- the lookup's gradient: masked rows scattered (add) at the clamped ids ---------------------------


def lookup_gradient_case(name: str, world: int, seed: int, uneven: bool, masked: bool = True):
    """seq: ScatterND(zeros[V, H], ids[..., None], g, add) (embedding_dense_backward); rank r (rows
    [X, Y)): ScatterND(zeros[Y - X, H], clip(ids - X, 0, Y - X - 1)[..., None], g * mask[..., None],
    add), the table gradient's rows, declared a shard along axis 0."""
    rng = rng_for(name, world, seed, uneven)
    vocab, layout = sharded(rng, 0, world, uneven, least=2)
    b, s, h = size(rng, 1, 3), size(rng, 2, 5), size(rng)
    inputs = {"ids": token_ids([b, s], vocab), "g": In([b, s, h], rep())}
    spans = bounds_of(layout, vocab, world)

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        rows = vocab if r is None else spans[r][1] - spans[r][0]
        zeros = g.const(np.zeros((rows, h), np.float32))
        if r is None:
            return g.output(g.op("ScatterND", zeros, g.op("Unsqueeze", x["ids"], g.ints([-1])), x["g"], reduction="add"))
        start, end = spans[r]
        index = g.op("Unsqueeze", clamped(g, x["ids"], start, end), g.ints([-1]))
        updates = g.op("Mul", x["g"], float_row_mask(g, owned_mask(g, x["ids"], start, end), False)) if masked else x["g"]
        return g.output(g.op("ScatterND", zeros, index, updates, reduction="add"))

    case, seq_out, rank_outs = make_case(name, world, inputs, body)
    case.outputs = {seq_out: dict(layout)}  # type: ignore[attr-defined]
    return case, seq_out, rank_outs


@pytest.mark.parametrize("world,seed,uneven", GRID)
def test_lookup_gradient_at_clamped_ids(world: int, seed: int, uneven: bool) -> None:
    case, _, _ = lookup_gradient_case("vpc_grad", world, seed, uneven)
    witness(case, seed, "owned_rows_mul", "scatter_owned", verified=False)


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_lookup_gradient_unmasked_is_refused(world: int, seed: int) -> None:
    """The upstream gradient scattered unmasked: a foreign id's row lands on a clamped local row."""
    case, y, outs = lookup_gradient_case("neg_vpc_grad", world, seed, False, masked=False)
    sim_rows = refused(case, seed, y, y, outs, wrong=lambda t, lay: True)
    assert "scatter_owned" not in sim_rows.lemmas_fired()


# --- the cross-entropy backward's target update: -1 where the rank owns the label ---------------------


def target_update_case(name: str, world: int, seed: int, other: bool = False):
    """seq: ScatterElements(zeros[N, V], t[N, 1], -1, axis 1) (nll_loss backward); rank r (vocab
    [X, Y)): ScatterElements(zeros[N, Y - X], where(t foreign, 0, t - X), float(t foreign) - 1,
    axis 1): torchtitan's `grad_input[row, local_labels] = out_of_range.float() - 1.0`."""
    rng = rng_for(name, world, seed)
    vocab, layout = sharded(rng, 1, world, False, least=2)
    n = size(rng, 2, 6)
    inputs = {"t": token_ids([n, 1], vocab)}
    spans = bounds_of(layout, vocab, world)

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        cols = vocab if r is None else spans[r][1] - spans[r][0]
        zeros = g.const(np.zeros((n, cols), np.float32))
        if r is None:
            return g.output(g.op("ScatterElements", zeros, x["t"], g.const(np.full((n, 1), -1.0, np.float32)), axis=1))
        start, end = spans[r]
        foreign = g.op("Or", g.op("Less", x["t"], iconst(g, start)), g.op("GreaterOrEqual", x["t"], iconst(g, end)))
        local = g.op("Where", foreign, iconst(g, 0), g.op("Sub", x["t"], iconst(g, start)))
        o_start, o_end = spans[(r + 1) % world] if other else (start, end)
        update_mask = g.op("Or", g.op("Less", x["t"], iconst(g, o_start)), g.op("GreaterOrEqual", x["t"], iconst(g, o_end)))
        update = g.op("Sub", g.op("Cast", update_mask, to=TensorProto.FLOAT), g.const(1.0))
        return g.output(g.op("ScatterElements", zeros, local, update, axis=1))

    case, seq_out, rank_outs = make_case(name, world, inputs, body)
    case.outputs = {seq_out: dict(layout)}  # type: ignore[attr-defined]
    return case, seq_out, rank_outs


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 2)])
def test_target_update_minus_one_where_owned(world: int, seed: int) -> None:
    case, _, _ = target_update_case("vpc_target", world, seed)
    witness(case, seed, "scatter_owned", verified=False)


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_target_update_of_another_range_is_refused(world: int, seed: int) -> None:
    case, y, outs = target_update_case("neg_vpc_target", world, seed, other=True)
    refused(case, seed, y, y, outs, wrong=lambda t, lay: str(lay).startswith("('sl'") or lay == "rep")


# --- even shares ----------------------------------------------------------------------------------


def share_case(name: str, world: int, seed: int, divisor: int):
    """seq: y = x * 3; every rank: y = (x * 3) / divisor, the output undeclared."""
    rng = rng_for(name, world, seed)
    inputs = {"x": In([size(rng), size(rng)], rep())}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        y = g.op("Mul", x["x"], g.const(3.0))
        return g.output(y if r is None else g.op("Div", y, g.const(float(divisor))))

    return make_case(name, world, inputs, body)


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1), (4, 2)])
def test_even_share_of_every_rank(world: int, seed: int) -> None:
    """S / W on each of the W ranks: piece [r, r+1) of S, the ranks' sum S. The relation holds, but
    even shares alone rebuild no output (rules/report.lp: W copies of S / W are also what a mean
    all-reduced where the sum was meant leaves): the share counts only inside a collective's sum."""
    case, _, _ = share_case("even_share", world, seed, world)
    witness(case, seed, "even_share", verified=False)


@pytest.mark.parametrize("world,seed,divisor", [(3, 0, 2), (2, 1, 4), (4, 2, 2)])
def test_uneven_share_is_refused(world: int, seed: int, divisor: int) -> None:
    """S / d on each of W != d ranks sums to (W / d) S."""
    case, y, outs = share_case("neg_even_share", world, seed, divisor)
    # (x itself is an even share of 3x, rightly: only the rank outputs, x * 3 / d, must relate to nothing)
    # (scaled relations, which rebuild nothing, are right: 3x / d is (1/d) x 3x)
    refused(case, seed, y, y, outs, wrong=lambda t, lay: str(t).split(":", 1)[-1] in outs
            and (lay == "rep" or (isinstance(lay, tuple) and lay[0] in ("sl", "psum", "blk"))))
