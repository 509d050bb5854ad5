"""Mixture-of-experts layers with stacked expert weights (`w1: [E, d, f]`), as Megatron's
grouped experts and torchtitan's GroupedExperts hold them, run per expert by indexing `w1[e]`
or all at once by a batched matmul over the expert axis; expert parallelism gives each rank E/W
of the experts and all-reduces the experts' weighted outputs (dense dispatch)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from . import Spelling, group, seeded

B, D, FF, E, W = 4, 8, 6, 4, 2


class StackedExperts(torch.nn.Module):
    """y = sum_e gate_e(x) * relu(x @ w1[e]) @ w2[e]; this program runs experts [lo, hi) (all on
    the sequential side), by index (`batched` False) or by einsum over the expert axis. A rank
    holds its experts' slice of the stacked weights; `ids_global` (the twin) indexes its slice
    with the global expert ids."""

    def __init__(self, rank: int | None = None, batched: bool = False, ids_global: bool = False) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(E, D, FF))
        self.w2 = torch.nn.Parameter(torch.randn(E, FF, D))
        self.router = torch.nn.Linear(D, E, bias=False)
        n = E // W
        self.lo, self.hi = (0, E) if rank is None else (rank * n, (rank + 1) * n)
        self.rank, self.batched, self.ids_global = rank, batched, ids_global

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        w1, w2 = self.w1[self.lo:self.hi], self.w2[self.lo:self.hi]
        if self.batched:
            h = torch.relu(torch.einsum("bd,edf->ebf", x, w1))
            y = (torch.einsum("ebf,efd->ebd", h, w2) * gates[:, self.lo:self.hi].t().unsqueeze(-1)).sum(0)
        else:
            y = 0
            for e in range(self.lo, self.hi):
                local = e if self.ids_global else e - self.lo
                local = min(local, self.hi - self.lo - 1)
                y = y + gates[:, e:e + 1] * (torch.relu(x @ w1[local]) @ w2[local])
        return y if self.rank is None else funcol.all_reduce(y, "sum", group(W))


def _x() -> tuple[torch.Tensor]:
    return (torch.randn(B, D, generator=torch.Generator().manual_seed(5)),)


SPELLINGS = [
    Spelling("megatron_stacked_experts_by_index", "megatron", "stacked expert weights, w1[e] per expert, EP", 12,
             "global expert ids index the rank's local slice", W, lambda: seeded(StackedExperts),
             lambda r: seeded(lambda: StackedExperts(r)), lambda r: seeded(lambda: StackedExperts(r, ids_global=True)), _x),
    Spelling("torchtitan_stacked_experts_bmm", "torchtitan", "stacked expert weights, batched matmul over experts, EP", 12,
             "the gates of the first experts for every rank", W, lambda: seeded(lambda: StackedExperts(batched=True)),
             lambda r: seeded(lambda: StackedExperts(r, batched=True)),
             lambda r: seeded(lambda: _FirstGates(r)), _x),
]


class _FirstGates(StackedExperts):
    """The twin: every rank weights its experts with the gates of experts [0, E/W)."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, batched=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        w1, w2 = self.w1[self.lo:self.hi], self.w2[self.lo:self.hi]
        h = torch.relu(torch.einsum("bd,edf->ebf", x, w1))
        y = (torch.einsum("ebf,efd->ebd", h, w2) * gates[:, : self.hi - self.lo].t().unsqueeze(-1)).sum(0)
        return funcol.all_reduce(y, "sum", group(W))
