"""Arithmetic spellings: a value kept while its gradient is rescaled (`b + (b / k - b).detach()`),
a replicated tensor added to a row slice of a sharded one (an MoE router's gradient term), a
linear layer with its bias as `torch.addmm` (Gemm with transB), a mean written as a sum over a
count."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group, seeded

B, H, W = 4, 8, 2
ROWS = {"x": {"layout": "shard", "axis": 0}}


class Quarter(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) / 4


class DetachedScale(torch.nn.Module):
    """relu(x) / 4 in value, relu(x)'s gradient: `b + (b / k - b).detach()` (k = 4; the twin, 2)."""

    def __init__(self, k: float = 4.0) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = torch.relu(x)
        return b + (b / self.k - b).detach()


class AddRows(torch.nn.Module):
    """y = x + r: x [B, H] (rows split between the ranks), r replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("r", torch.randn(B * W // 2, H, generator=torch.Generator().manual_seed(7)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.r


class AddRowsRanks(AddRows):
    """Rank k adds its own rows of r to its rows of x (`first` True, the twin: rows 0.. on every rank)."""

    def __init__(self, rank: int, first: bool = False) -> None:
        super().__init__()
        n = self.r.shape[0] // W
        self.rows = slice(0, n) if first else slice(rank * n, (rank + 1) * n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.r[self.rows]


class Addmm(torch.nn.Module):
    """nn.Linear written as torch.addmm(b, x, W^T): a Gemm with a bias and transB."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2 * H, H))
        self.b = torch.nn.Parameter(torch.randn(2 * H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.b, x, self.w.t())


class ColumnLinear(Addmm):
    """Rank r's rows of W and b (F.linear), its output columns all-gathered; `bias_of` (the
    twin): another rank's bias rows."""

    def __init__(self, rank: int, bias_of: int | None = None) -> None:
        super().__init__()
        self.rank, self.bias_of = rank, rank if bias_of is None else bias_of

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = 2 * H // W
        y = F.linear(x, self.w[self.rank * n:(self.rank + 1) * n], self.b[self.bias_of * n:(self.bias_of + 1) * n])
        return funcol.all_gather_tensor(y.t().contiguous(), 0, group(W)).t()


class MeanRows(torch.nn.Module):
    """The mean of x over its rows, `x.mean(0)`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(0)


class SumOverCount(torch.nn.Module):
    """Each rank sums its rows, all-reduces, divides by the number of rows of the whole batch
    (`n`: the twin divides by its own rows)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x.sum(0), "sum", group(W)) / self.n


def _x() -> tuple[torch.Tensor]:
    return (torch.randn(B, H, generator=torch.Generator().manual_seed(8)),)


SPELLINGS = [
    Spelling("deepspeed_detached_gradient_scale", "deepspeed", "b + (b / k - b).detach(): a value kept, its gradient scaled",
             14, "the wrong k", W, Quarter, lambda r: DetachedScale(), lambda r: DetachedScale(2.0), _x, ROWS),
    Spelling("torchtitan_replica_plus_row_slice", "torchtitan", "a replicated tensor's row slice added to a sharded one", 12,
             "every rank adds the first rows", W, AddRows, AddRowsRanks, lambda r: AddRowsRanks(r, first=True), _x, ROWS),
    Spelling("hf_addmm_bias_trans_b", "hf", "torch.addmm(b, x, W.t()): Gemm with a bias and transB", 1,
             "another rank's bias rows", W, lambda: seeded(Addmm), lambda r: seeded(lambda: ColumnLinear(r)),
             lambda r: seeded(lambda: ColumnLinear(r, bias_of=1 - r)), _x),
    Spelling("nanogpt_mean_as_sum_over_count", "nanogpt", "a mean as the all-reduced sum over the global count", 10,
             "divided by the local count", W, MeanRows, lambda r: SumOverCount(B), lambda r: SumOverCount(B // W), _x, ROWS),
]
