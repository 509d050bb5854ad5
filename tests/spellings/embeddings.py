"""Vocab-parallel embeddings and heads: Megatron's masked lookup (ids shifted into the local
range, masked, the rows zeroed, all-reduced), and a tied LM head on the embedding's row shard
(the logits vocab-parallel, gathered)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group, seeded

V, H, B, S, TP = 16, 6, 2, 4, 2


class Embed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class VocabParallelEmbed(Embed):
    """Megatron's VocabParallelEmbedding on plain tensors: rows [lo, hi) of the table; `zero`
    False (the twin): the rows of ids it does not own are not zeroed."""

    def __init__(self, rank: int, zero: bool = True) -> None:
        super().__init__()
        self.lo, self.hi, self.zero = rank * V // TP, (rank + 1) * V // TP, zero

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        local = (ids - self.lo).masked_fill(outside, 0)
        rows = F.embedding(local, self.emb.weight[self.lo:self.hi])
        if self.zero:
            rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return funcol.all_reduce(rows, "sum", group(TP))


class TiedHead(torch.nn.Module):
    """logits = h @ E^T with E the (tied) embedding table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.emb.weight.t()


class TiedHeadRanks(TiedHead):
    """Each rank's logits over its rows of E, all-gathered along the vocabulary (`rows_of`: the
    twin uses another rank's rows)."""

    def __init__(self, rank: int, rows_of: int | None = None) -> None:
        super().__init__()
        k = rank if rows_of is None else rows_of
        self.rows = slice(k * V // TP, (k + 1) * V // TP)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        part = h @ self.emb.weight[self.rows].t()
        return funcol.all_gather_tensor(part.permute(2, 0, 1).contiguous(), 0, group(TP)).permute(1, 2, 0)


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(11)),)


def _h() -> tuple[torch.Tensor]:
    return (torch.randn(B, S, H, generator=torch.Generator().manual_seed(12)),)


SPELLINGS = [
    Spelling("megatron_vocab_parallel_embedding", "megatron", "masked lookup in the rank's rows, all-reduced", 5,
             "the rows of ids it does not own not zeroed", TP, lambda: seeded(Embed),
             lambda r: seeded(lambda: VocabParallelEmbed(r)), lambda r: seeded(lambda: VocabParallelEmbed(r, zero=False)),
             _ids, {"ids": {"layout": "rep", "range": [0, V]}}),
    Spelling("hf_tied_lm_head_vocab_parallel", "hf", "tied LM head over the embedding's row shard, logits gathered", 13,
             "another rank's rows of the tied table", TP, lambda: seeded(TiedHead), lambda r: seeded(lambda: TiedHeadRanks(r)),
             lambda r: seeded(lambda: TiedHeadRanks(r, rows_of=1 - r)), _h),
]
