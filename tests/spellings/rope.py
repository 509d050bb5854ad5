"""Rotary position embeddings from a cos/sin cache indexed by position ids (HF's, vLLM's
`cos_cache[position_ids]`), under context parallelism (each rank its slice of the sequence,
its positions offset) and under tensor parallelism (heads split)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from . import Spelling, group

B, NH, S, D, MAXP, W = 2, 4, 8, 4, 16, 2


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class CachedRope(torch.nn.Module):
    """q * cos + rotate_half(q) * sin with cos, sin = cache[position_ids]; `positions(n)` gives
    this program's position ids for n tokens."""

    def __init__(self) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        freqs = torch.outer(torch.arange(MAXP).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def positions(self, n: int) -> torch.Tensor:
        return torch.arange(n)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        pos = self.positions(q.shape[-2])
        cos, sin = self.cos_cached[pos], self.sin_cached[pos]
        return q * cos + rotate_half(q) * sin


class ContextSlice(CachedRope):
    """Rank r of a CP group: its slice's positions start at r * S/W (`offset` False: at 0)."""

    def __init__(self, rank: int, offset: bool = True) -> None:
        super().__init__()
        self.start = rank * (S // W) if offset else 0

    def positions(self, n: int) -> torch.Tensor:
        return torch.arange(n) + self.start


class HeadSlice(CachedRope):
    """A TP rank's heads, all positions, the heads all-gathered back (`gather` False: the twin
    returns its own heads as if they were all)."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        out = super().forward(q)
        return funcol.all_gather_tensor(out.transpose(0, 1).contiguous(), 0, group(W)).transpose(0, 1)


class HeadSliceTwin(CachedRope):
    """The twin: each rank rotates its heads with positions counted from its rank (a CP offset
    applied to a TP split)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def positions(self, n: int) -> torch.Tensor:
        return torch.arange(n) + self.rank

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        out = super().forward(q)
        return funcol.all_gather_tensor(out.transpose(0, 1).contiguous(), 0, group(W)).transpose(0, 1)


def _q() -> tuple[torch.Tensor]:
    return (torch.randn(B, NH, S, D, generator=torch.Generator().manual_seed(4)),)


SPELLINGS = [
    Spelling("hf_rope_cache_context_parallel", "hf", "cos/sin cache indexed by position ids, CP slices", 9,
             "positions not offset per rank", W, CachedRope, ContextSlice, lambda r: ContextSlice(r, offset=False), _q,
             {"q": {"layout": "shard", "axis": 2}}),
    Spelling("vllm_rope_cache_tensor_parallel", "vllm", "cos/sin cache indexed by position ids, heads split", 9,
             "each rank's positions offset by its rank", W, CachedRope, lambda r: HeadSlice(), HeadSliceTwin, _q,
             {"q": {"layout": "shard", "axis": 1}}),
]
