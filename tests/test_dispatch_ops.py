"""exporters/capture/dispatch_ops.py: MoE dispatch's stable sort and grouped GEMM translated to
ONNX with the values torch computes (ties in the sort, empty groups, every row in one group,
the weights' gradient), run by the reference evaluator refine's simulator uses."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from refine.exporters.capture.tracing import quiet, to_onnx  # noqa: E402


class StableArgsort(torch.nn.Module):
    def __init__(self, descending: bool) -> None:
        super().__init__()
        self.descending = descending

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, order = torch.sort(ids, dim=-1, descending=self.descending, stable=True)
        return values, order


class GroupedExperts(torch.nn.Module):
    """torchtitan's GroupedExperts' product: rows grouped by expert at offsets, bfloat16."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs).float()


class GroupedWeightGrad(torch.nn.Module):
    """The weights' gradient of the grouped product: per group, its rows of x by its rows of g."""

    def forward(self, x: torch.Tensor, g: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x.bfloat16().t(), g.bfloat16(), offs=offs).float()


def onnx_run(module: torch.nn.Module, args: tuple[torch.Tensor, ...], names: list[str],
             feeds: tuple[torch.Tensor, ...] | None = None) -> list[np.ndarray]:
    """Export with `args`, run the ONNX program on `feeds` (default: the same values)."""
    with quiet():
        model = to_onnx(module, args, names)
    inputs = [i.name for i in model.graph.input]
    values = feeds if feeds is not None else args
    return ReferenceEvaluator(model).run(None, {n: v.numpy() for n, v in zip(inputs, values)})


@pytest.mark.parametrize("descending", [False, True])
def test_stable_sort_keeps_tied_elements_in_order(descending: bool) -> None:
    """Expert ids repeat (ties everywhere): the order within a tie is the original one."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 3, (2, 12), generator=gen)
    values, order = onnx_run(StableArgsort(descending), (ids,), ["values", "order"])
    want_values, want_order = torch.sort(ids, dim=-1, descending=descending, stable=True)
    assert np.array_equal(values, want_values.numpy())
    assert np.array_equal(order, want_order.numpy())


def _counts(*sizes: int) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64)


@pytest.mark.parametrize("counts", [(3, 0, 5, 4), (12, 0, 0, 0), (0, 0, 0, 12), (1, 2, 3, 6), (3, 0, 5, 2)])
def test_grouped_mm_multiplies_each_row_by_its_groups_weights(counts: tuple[int, ...]) -> None:
    """Exported at one routing, run at others (the counts are an input): each row times its own
    group's weights, empty groups included; rows past the last end (torch leaves them
    unwritten) zero."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(12, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    (got,) = onnx_run(GroupedExperts(), (x, w, _counts(3, 3, 3, 3)), ["y"], (x, w, _counts(*counts)))
    routed = sum(counts)
    want = GroupedExperts()(x, w, _counts(*counts))[:routed]
    assert np.allclose(got[:routed], want.numpy(), rtol=1e-2, atol=1e-2)
    assert not got[routed:].any()
    # and not some other group's weights: the rows of the first non-empty group differ under a shift
    shifted = GroupedExperts()(x, torch.roll(w, 1, dims=0), _counts(*counts))[:routed]
    assert not np.allclose(got[:routed], shifted.numpy(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("counts", [(3, 0, 5, 4), (12, 0, 0, 0), (2, 2, 2, 2)])
def test_grouped_mm_weight_gradient_sums_each_groups_rows(counts: tuple[int, ...]) -> None:
    """The 2-D by 2-D form: group g's rows only (rows past the last end count nowhere)."""
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(12, 16, generator=gen), torch.randn(12, 8, generator=gen)
    (got,) = onnx_run(GroupedWeightGrad(), (x, g, _counts(3, 3, 3, 3)), ["y"], (x, g, _counts(*counts)))
    ends = np.cumsum(counts)
    starts = ends - np.array(counts)
    xb, gb = x.bfloat16().float().numpy(), g.bfloat16().float().numpy()
    want = np.stack([xb[s:e].T @ gb[s:e] for s, e in zip(starts, ends)])
    assert got.shape == (4, 16, 8)
    assert np.allclose(got, want, rtol=2e-2, atol=2e-2)
