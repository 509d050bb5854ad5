"""Data-parallel and accumulation normalizations as frameworks write them: gradient
accumulation over micro-batches (HF Trainer's num_items_in_batch), DeepSpeed's loss divided by
the world size then summed, torchtitan's global count of non-ignored tokens."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group, seeded

V, H, DP, M = 8, 6, 2, 2
ROWS = 4  # per rank


class Head(torch.nn.Module):
    """F.cross_entropy of a linear head, mean over the non-ignored tokens (ignore_index -100)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(H, V)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), labels, ignore_index=-100)


class Accumulated(Head):
    """M micro-batches of the rank's rows: each micro-batch's summed loss over the tokens of the
    whole batch (the count all-reduced), summed over micro-batches and ranks (HF Trainer with
    num_items_in_batch). `mean_each` (the twin): each micro-batch's own mean, divided by M (the
    pre-fix Trainer)."""

    def __init__(self, mean_each: bool = False) -> None:
        super().__init__()
        self.mean_each = mean_each

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = funcol.all_reduce((labels != -100).sum().float(), "sum", group(DP))
        total = 0
        for xm, lm in zip(x.chunk(M), labels.chunk(M)):
            if self.mean_each:
                total = total + F.cross_entropy(self.head(xm), lm, ignore_index=-100) / (M * DP)
            else:
                total = total + F.cross_entropy(self.head(xm), lm, ignore_index=-100, reduction="sum") / count
        return funcol.all_reduce(total, "sum", group(DP))


class WorldScaled(Head):
    """DeepSpeed's: the rank's mean loss divided by the world size, all-reduced with sum (the
    twin: then averaged, divided twice)."""

    def __init__(self, op: str = "sum") -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(super().forward(x, labels) / DP, self.op, group(DP))


def _batch(ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10)
    labels = torch.randint(0, V, (ROWS * DP,), generator=g)
    if ignored:
        labels[1] = -100
    return torch.randn(ROWS * DP, H, generator=g), labels


def _layouts(ignored: bool) -> dict:
    labels = {"layout": "shard", "axis": 0, "range": [0, V], **({"also": [-100]} if ignored else {})}
    return {"x": {"layout": "shard", "axis": 0}, "labels": labels}


SPELLINGS = [
    Spelling("hf_trainer_accumulation_global_items", "hf", "gradient accumulation, each micro-batch's sum over the global count",
             10, "each micro-batch's mean divided by M", DP, lambda: seeded(Head), lambda r: seeded(Accumulated),
             lambda r: seeded(lambda: Accumulated(mean_each=True)), lambda: _batch(True), _layouts(True)),
    Spelling("deepspeed_loss_over_world_summed", "deepspeed", "the mean loss divided by the world size, all-reduced with sum",
             14, "then averaged (divided twice)", DP, lambda: seeded(Head), lambda r: seeded(WorldScaled),
             lambda r: seeded(lambda: WorldScaled("avg")), lambda: _batch(False), _layouts(False)),
]
