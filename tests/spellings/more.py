"""More spellings: legacy in-place collectives (`dist.all_reduce(x, op=AVG)`), HF's repeat_kv
(expand + reshape) against repeat_interleave, a masked mean pooling with its own count per row,
the tanh-approximated GELU written by hand, a loss over `reduction="none"` summed over the
global count of non-ignored labels, and context parallelism's loss over each rank's tokens."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group, seeded

B, S, H, NH, KV, HD, V, W = 2, 4, 8, 4, 2, 3, 8, 2


class Relu2(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


class InPlaceAvg(torch.nn.Module):
    """Each rank holds the same value; `dist.all_reduce(y, op=AVG)` in place (Megatron-LM and
    DeepSpeed spell their reductions so); the twin uses SUM."""

    def __init__(self, op: str = "avg") -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) * 2
        dist.all_reduce(y, op=dist.ReduceOp.AVG if self.op == "avg" else dist.ReduceOp.SUM)
        return y


class RepeatInterleave(torch.nn.Module):
    """y = q * repeat_interleave(k, NH // KV) over the heads axis."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q * k.repeat_interleave(NH // KV, dim=1)


class RepeatKv(torch.nn.Module):
    """HF's repeat_kv: k[:, :, None].expand(B, KV, n, S, HD).reshape(B, KV * n, S, HD); the twin
    repeats the whole block (tile) instead of each head."""

    def __init__(self, tile: bool = False) -> None:
        super().__init__()
        self.tile = tile

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        n = NH // KV
        if self.tile:
            rep = k.repeat(1, n, 1, 1)
        else:
            rep = k[:, :, None, :, :].expand(B, KV, n, S, HD).reshape(B, KV * n, S, HD)
        return q * rep


class MaskedMean(torch.nn.Module):
    """Mean over each row's non-padded tokens: sum(x * m) / sum(m) (sentence embeddings)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(x.dtype)
        return (x * m).sum(1) / m.sum(1)


class MaskedMeanTwin(MaskedMean):
    """The twin: divided by the number of positions, padded ones included."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(x.dtype)
        return (x * m).sum(1) / S


class Gelu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class GeluByHand(torch.nn.Module):
    """nanoGPT's NewGELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); the twin drops 0.5."""

    def __init__(self, half: float = 0.5) -> None:
        super().__init__()
        self.half = half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.half * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class TokenLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(H, V)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), ignore_index=-100)


class ContextLoss(TokenLoss):
    """Context parallelism (torchtitan): each rank's tokens' summed loss over the count of
    non-ignored tokens of the whole sequence (all-reduced), the shares summed; `local` (the
    twin): each rank's mean, averaged (wrong when the ranks count different tokens)."""

    def __init__(self, local: bool = False) -> None:
        super().__init__()
        self.local = local

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.local:
            return funcol.all_reduce(super().forward(x, labels), "avg", group(W))
        logits, flat = self.head(x).flatten(0, 1), labels.flatten()
        total = F.cross_entropy(logits, flat, ignore_index=-100, reduction="none").sum()
        count = funcol.all_reduce((flat != -100).sum().to(total.dtype), "sum", group(W))
        return funcol.all_reduce(total / count, "sum", group(W))


class RowsLoss(TokenLoss):
    """Data parallelism over batch rows: `F.cross_entropy(..., reduction="none").sum()` over the
    count of non-ignored labels of the whole batch (all-reduced), the shares summed; `local` (the
    twin): over the rank's own count."""

    def __init__(self, local: bool = False) -> None:
        super().__init__()
        self.local = local

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, flat = self.head(x).flatten(0, 1), labels.flatten()
        total = F.cross_entropy(logits, flat, ignore_index=-100, reduction="none").sum()
        count = (flat != -100).sum().to(total.dtype)
        if not self.local:
            count = funcol.all_reduce(count, "sum", group(W))
        return funcol.all_reduce(total / count, "sum", group(W))


class WhereEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class WhereEmbeddingRanks(WhereEmbedding):
    """vLLM's VocabParallelEmbedding: ids outside [lo, hi) sent to row 0 by torch.where, the rows
    zeroed by torch.where, all-reduced; the twin forgets to zero the rows of the ids it does not
    own (each rank then adds its local row 0 for them)."""

    def __init__(self, rank: int, zero: bool = True) -> None:
        super().__init__()
        self.lo, self.hi, self.zero = rank * V // W, (rank + 1) * V // W, zero

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        own = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(own, ids - self.lo, torch.zeros_like(ids))
        rows = F.embedding(local, self.emb.weight[self.lo:self.hi])
        if self.zero:
            rows = torch.where(own.unsqueeze(-1), rows, torch.zeros_like(rows))
        return funcol.all_reduce(rows, "sum", group(W))


def _x() -> tuple[torch.Tensor]:
    return (torch.randn(B, S, H, generator=torch.Generator().manual_seed(17)),)


def _qk() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(18)
    return torch.randn(B, NH, S, HD, generator=g), torch.randn(B, KV, S, HD, generator=g)


def _pooled() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(19)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.int64)
    return torch.randn(2 * W, S, H, generator=g), mask


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 3] = -100
    return torch.randn(B, S, H, generator=g), labels


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(21)),)


ROWS = {"x": {"layout": "shard", "axis": 0}, "mask": {"layout": "shard", "axis": 0, "range": [0, 2]}}
BATCH_ROWS = {"x": {"layout": "shard", "axis": 0}, "labels": {"layout": "shard", "axis": 0, "range": [0, V], "also": [-100]}}
SEQUENCE = {"x": {"layout": "shard", "axis": 1}, "labels": {"layout": "shard", "axis": 1, "range": [0, V], "also": [-100]}}

SPELLINGS = [
    Spelling("megatron_in_place_all_reduce_avg", "megatron", "dist.all_reduce(y, op=AVG) in place on replicas", 14,
             "SUM where AVG was meant", W, Relu2, lambda r: InPlaceAvg(), lambda r: InPlaceAvg("sum"), _x),
    Spelling("hf_repeat_kv_expand_reshape", "hf", "repeat_kv (expand + reshape) against repeat_interleave", 7,
             "the kv block tiled instead of each head repeated", 1, RepeatInterleave, lambda r: RepeatKv(),
             lambda r: RepeatKv(tile=True), _qk),
    Spelling("hf_masked_mean_pooling", "hf", "mean over each row's own non-padded tokens, rows split", 10,
             "divided by every position, padding included", W, MaskedMean, lambda r: MaskedMean(), lambda r: MaskedMeanTwin(),
             _pooled, ROWS),
    Spelling("nanogpt_gelu_by_hand", "nanogpt", "the tanh GELU written by hand against F.gelu(approximate='tanh')", 14,
             "the factor 0.5 dropped", W, Gelu, lambda r: GeluByHand(), lambda r: GeluByHand(1.0), _x,
             {"x": {"layout": "shard", "axis": 1}}),
    Spelling("torchtitan_context_parallel_loss", "torchtitan", "CP loss: each rank's tokens over the global count", 10,
             "each rank's own mean, averaged", W, lambda: seeded(TokenLoss), lambda r: seeded(ContextLoss),
             lambda r: seeded(lambda: ContextLoss(local=True)), _tokens, SEQUENCE),
    Spelling("hf_cross_entropy_none_sum_global_count", "hf", "reduction='none' summed over the all-reduced count of valid labels",
             10, "divided by the rank's own count", W, lambda: seeded(TokenLoss), lambda r: seeded(RowsLoss),
             lambda r: seeded(lambda: RowsLoss(local=True)), _tokens, BATCH_ROWS),
    Spelling("vllm_vocab_parallel_embedding_where", "vllm", "vocab-parallel lookup masked by torch.where", 5,
             "the rows of ids another rank owns not zeroed", W, lambda: seeded(WhereEmbedding),
             lambda r: seeded(lambda: WhereEmbeddingRanks(r)), lambda r: seeded(lambda: WhereEmbeddingRanks(r, zero=False)),
             _ids, {"ids": {"layout": "rep", "range": [0, V]}}),
]
