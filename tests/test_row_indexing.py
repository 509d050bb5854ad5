"""exporters/capture/row_indexing.py: `x[arange(N), idx]` reads and writes rewritten as gather/scatter
in a traced graph, value for value; any other indexing left alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from refine.exporters.capture import row_indexing  # noqa: E402

aten = torch.ops.aten
ROWS, COLS = 6, 5


def pick(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x[torch.arange(x.shape[0]), idx]


def subtract_at(x: torch.Tensor, idx: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Megatron's backward: grad_2d[arange_1d, masked_target_1d] -= softmax_update."""
    y = x.clone()
    rows = torch.arange(y.shape[0])
    y[rows, idx] -= u
    return y * 2.0


def assign_at(x: torch.Tensor, idx: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[torch.arange(y.shape[0]), idx] = u
    return y


def columns_first(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The arange indexes the columns: not a row pick."""
    return x[idx[:COLS] % ROWS, torch.arange(x.shape[1])]


def shifted_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """arange(1, N + 1) % N walks the rows out of order: not a row pick."""
    return x[torch.arange(1, x.shape[0] + 1) % x.shape[0], idx]


def traced(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.fx.GraphModule:
    from torch.func import functionalize

    return make_fx(functionalize(fn, remove="mutations"), tracing_mode="fake")(*args)


def targets(gm: torch.fx.GraphModule) -> set[object]:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, COLS, generator=g), torch.randint(0, COLS, (ROWS,), generator=g), torch.randn(ROWS, generator=g)


@pytest.mark.parametrize("fn,arity,expect", [(pick, 2, aten.gather.default), (subtract_at, 3, aten.scatter.src),
                                             (assign_at, 3, aten.scatter.src)],
                         ids=["read", "subtract", "assign"])
def test_row_indexing_becomes_gather_or_scatter_with_the_same_values(fn, arity: int, expect: object) -> None:
    args = example()[:arity]
    gm = traced(fn, *args)
    assert row_indexing.rewrite(gm) >= 1
    found = targets(gm)
    assert expect in found and aten.index.Tensor not in found and aten.index_put.default not in found
    assert torch.allclose(gm(*args), fn(*args), atol=0, rtol=0)


def test_subtraction_at_the_picked_entries_is_a_difference_with_a_scatter_into_zeros() -> None:
    """x[I] -= u becomes x - scatter(zeros, I, u): the form the verifier's scatter lemma reads."""
    args = example()
    gm = traced(subtract_at, *args)
    row_indexing.rewrite(gm)
    scatters = [n for n in gm.graph.nodes if n.target is aten.scatter.src]
    assert len(scatters) == 1 and scatters[0].args[0].target is aten.zeros_like.default


@pytest.mark.parametrize("fn", [columns_first, shifted_rows], ids=["columns_first", "shifted_rows"])
def test_other_indexing_is_left_alone(fn) -> None:
    args = example()[:2]
    gm = traced(fn, *args)
    before = targets(gm)
    assert row_indexing.rewrite(gm) == 0
    assert targets(gm) == before and aten.index.Tensor in before
