"""Losses as frameworks write them: the sequential loss as `F.cross_entropy` against a
vocab-parallel cross-entropy on the ranks (Megatron's algorithm), label smoothing, and data
parallelism's normalizations (DDP's local mean averaged, global counts, `ones_like(...).sum()`)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group, seeded

V, B, H, TP, DP = 16, 6, 8, 2, 2
LABELS = {"layout": "rep", "range": [0, V]}


class CrossEntropy(torch.nn.Module):
    """The sequential loss: `F.cross_entropy(logits, labels)` (HF's, nanoGPT's, torchtitan's)."""

    def __init__(self, smoothing: float = 0.0) -> None:
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, label_smoothing=self.smoothing)


class VocabParallelCrossEntropy(torch.nn.Module):
    """Megatron's vocab-parallel cross-entropy on a vocabulary shard of the logits: the max and
    the sum of exponentials all-reduced, the target's logit picked where the rank owns it.
    `local_max`: the max not all-reduced (each rank shifts by its own max: wrong). `smoothing`
    averages -log p over the whole vocabulary (`smoothing_local`: over the rank's shard, as
    Megatron's own code did: wrong)."""

    def __init__(self, rank: int, local_max: bool = False, smoothing: float = 0.0, smoothing_local: bool = False) -> None:
        super().__init__()
        self.lo, self.hi = rank * (V // TP), (rank + 1) * (V // TP)
        self.local_max, self.smoothing, self.smoothing_local = local_max, smoothing, smoothing_local

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        m = logits.max(dim=-1).values
        if not self.local_max:
            m = funcol.all_reduce(m, "max", group(TP))
        z = logits - m.unsqueeze(-1)
        sum_exp = funcol.all_reduce(z.exp().sum(dim=-1), "sum", group(TP))
        inside = (labels >= self.lo) & (labels < self.hi)
        local = torch.where(inside, labels - self.lo, torch.zeros_like(labels))
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        picked = funcol.all_reduce(torch.where(inside, picked, torch.zeros_like(picked)), "sum", group(TP))
        loss = (sum_exp.log() - picked).mean()
        if self.smoothing:  # (as F.cross_entropy reduces: each term's mean over the batch, then mixed)
            z_sum = z.sum(dim=-1)
            if self.smoothing_local:
                mean_neg_logp = sum_exp.log() - z_sum / (V // TP)
            else:
                mean_neg_logp = sum_exp.log() - funcol.all_reduce(z_sum, "sum", group(TP)) / V
            loss = (1 - self.smoothing) * loss + self.smoothing * mean_neg_logp.mean()
        return loss


def _logits_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, V, generator=g), torch.randint(0, V, (B,), generator=g)


VOCAB = {"logits": {"layout": "shard", "axis": 1}, "labels": LABELS}


class Classifier(torch.nn.Module):
    """A linear head and `F.cross_entropy`: the mean over the batch (the sequential step)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(H, V)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), labels)


class DDPLoss(Classifier):
    """DistributedDataParallel's semantics: each rank's loss is the mean over its own batch
    slice, all-reduced with avg (equal slices: the global mean). `op` sum: the means added."""

    def __init__(self, op: str = "avg") -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(super().forward(x, labels), self.op, group(DP))


class GlobalCountLoss(Classifier):
    """The loss summed per rank, divided by the number of samples of the whole batch (written
    `torch.ones_like(labels).sum()`, all-reduced), the shares all-reduced with sum. `local`:
    the count not all-reduced (each rank divides by its own count)."""

    def __init__(self, local: bool = False) -> None:
        super().__init__()
        self.local = local

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(self.head(x), labels, reduction="none").sum()
        count = torch.ones_like(labels).sum().to(total.dtype)
        if not self.local:
            count = funcol.all_reduce(count, "sum", group(DP))
        return funcol.all_reduce(total / count, "sum", group(DP))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(B * DP // 2, H, generator=g), torch.randint(0, V, (B * DP // 2,), generator=g)


BATCH = {"x": {"layout": "shard", "axis": 0}, "labels": {"layout": "shard", "axis": 0, "range": [0, V]}}

SPELLINGS = [
    Spelling("hf_cross_entropy_vs_vocab_parallel", "hf", "F.cross_entropy against Megatron's vocab-parallel loss", 5,
             "the max not all-reduced", TP, CrossEntropy, VocabParallelCrossEntropy,
             lambda r: VocabParallelCrossEntropy(r, local_max=True), _logits_and_labels, VOCAB),
    Spelling("hf_label_smoothing_vs_vocab_parallel", "hf", "F.cross_entropy(label_smoothing=0.1), vocab-parallel done right",
             5, "smoothing averaged over the local vocabulary (Megatron-LM issue 737)", TP,
             lambda: CrossEntropy(0.1), lambda r: VocabParallelCrossEntropy(r, smoothing=0.1),
             lambda r: VocabParallelCrossEntropy(r, smoothing=0.1, smoothing_local=True), _logits_and_labels, VOCAB),
    Spelling("ddp_local_mean_avg", "hf", "DDP: the local mean all-reduced with avg", 10,
             "the local means all-reduced with sum", DP, lambda: seeded(Classifier), lambda r: seeded(DDPLoss),
             lambda r: seeded(lambda: DDPLoss("sum")), _batch, BATCH),
    Spelling("ddp_ones_like_count", "deepspeed", "the sample count as ones_like(labels).sum(), all-reduced", 10,
             "the count not all-reduced", DP, lambda: seeded(Classifier), lambda r: seeded(GlobalCountLoss),
             lambda r: seeded(lambda: GlobalCountLoss(local=True)), _batch, BATCH),
]
