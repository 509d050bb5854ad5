"""Moving data between layouts as frameworks write it: ZeRO-2's reduce-scatter then all-gather
of a gradient (an all-reduce in two steps), the heads split by a view after a column-parallel projection (nanoGPT's
`view(B, S, nh, hd)`), and GQA's key/value heads repeated for the query heads a rank holds."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from . import Spelling, group, seeded

B, S, NH, HD, W = 2, 4, 4, 4, 2


class Heads(torch.nn.Module):
    """x [B, S, NH, HD] -> relu per head, unchanged layout (a stand-in for attention's per-head work)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


class Zero2Sum(torch.nn.Module):
    """A gradient-like sum over the batch, x^T x * 3 (each rank's term: its rows' x^T x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.t() @ x) * 3


class Zero2(Zero2Sum):
    """ZeRO-2: the partial reduce-scattered (each rank the sum of its rows), scaled, then
    all-gathered: an all-reduce in two steps; `gather_axis` 1 (the twin): gathered on the columns."""

    def __init__(self, gather_axis: int = 0) -> None:
        super().__init__()
        self.axis = gather_axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = x.t() @ x
        mine = funcol.reduce_scatter_tensor(p * 3, "sum", 0, group(W))
        if self.axis == 0:
            return funcol.all_gather_tensor(mine, 0, group(W))
        return funcol.all_gather_tensor(mine.t().contiguous(), 0, group(W)).t().reshape(p.shape)


class ViewHeads(torch.nn.Module):
    """q = x @ Wq, split into heads by a view: [B, S, H] -> [B, S, NH, HD] (nanoGPT)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = torch.nn.Parameter(torch.randn(NH * HD, NH * HD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.wq).view(B, S, NH, HD)


class ViewHeadsRanks(ViewHeads):
    """Column-parallel Wq: the rank's NH/W heads' columns, viewed as [B, S, NH/W, HD] (`flat`, the
    twin: viewed as [B, S, NH, HD/W], splitting every head's dims instead), gathered on the heads."""

    def __init__(self, rank: int, flat: bool = False) -> None:
        super().__init__()
        n = NH * HD // W
        self.cols, self.flat = slice(rank * n, (rank + 1) * n), flat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x @ self.wq[:, self.cols]
        q = q.view(B, S, NH, HD // W) if self.flat else q.view(B, S, NH // W, HD)
        axis = 3 if self.flat else 2
        moved = q.movedim(axis, 0).contiguous()
        return funcol.all_gather_tensor(moved, 0, group(W)).movedim(0, axis)


class Gqa(torch.nn.Module):
    """Query heads NH over key/value heads KV = NH/2: each query head h reads kv head h // 2;
    y = q * repeat_interleave(k, 2) (per-head product stand-in)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q * k.repeat_interleave(NH // k.shape[1], dim=1)


class GqaRanks(Gqa):
    """Rank r holds query heads [r NH/W, (r+1) NH/W) and the kv heads they read; `offset` (the
    twin): kv heads from the wrong offset."""

    def __init__(self, rank: int, offset: int = 0) -> None:
        super().__init__()
        self.rank, self.offset = rank, offset

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        kv = NH // 2 // W
        start = (self.rank * kv + self.offset) % (NH // 2)
        mine = k[:, start:start + kv]
        y = q * mine.repeat_interleave(2, dim=1)
        return funcol.all_gather_tensor(y.transpose(0, 1).contiguous(), 0, group(W)).transpose(0, 1)


def _x() -> tuple[torch.Tensor]:
    return (torch.randn(B, S, NH, HD, generator=torch.Generator().manual_seed(13)),)


def _rows() -> tuple[torch.Tensor]:
    return (torch.randn(2 * W, 2 * W, generator=torch.Generator().manual_seed(16)),)


def _hidden() -> tuple[torch.Tensor]:
    return (torch.randn(B, S, NH * HD, generator=torch.Generator().manual_seed(14)),)


def _qk() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(15)
    return torch.randn(B, NH, S, HD, generator=g), torch.randn(B, NH // 2, S, HD, generator=g)


SPELLINGS = [
    Spelling("deepspeed_zero2_reduce_scatter_all_gather", "deepspeed", "ZeRO-2: reduce-scatter then all-gather of a partial",
             2, "the shards gathered on the wrong axis", W, Zero2Sum, lambda r: Zero2(), lambda r: Zero2(gather_axis=1), _rows,
             {"x": {"layout": "shard", "axis": 0}}),
    Spelling("nanogpt_view_heads_after_column_parallel", "nanogpt", "heads split by a view after a column-parallel projection",
             8, "the view splits every head's dims", W, lambda: seeded(ViewHeads), lambda r: seeded(lambda: ViewHeadsRanks(r)),
             lambda r: seeded(lambda: ViewHeadsRanks(r, flat=True)), _hidden),
    Spelling("vllm_gqa_kv_heads_per_rank", "vllm", "GQA: each rank's kv heads repeated for its query heads", 7,
             "kv heads from the next rank's offset", W, Gqa, lambda r: GqaRanks(r), lambda r: GqaRanks(r, offset=1), _qk,
             {"q": {"layout": "shard", "axis": 1}}),
]
