"""Training steps (the loss and every gradient) as frameworks write them: DDP's local mean with
gradients all-reduced with avg, HF's `reduction="none"` sum over the all-reduced count of valid
labels with gradients all-reduced with sum, and an expert-parallel step over stacked expert
weights (each rank holding its experts' rows, Megatron's dense dispatch: the combine's
all-reduce forward, its identity backward)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from . import Spelling, group, seeded

H, V, ROWS, DP = 6, 5, 4, 2
IGNORE = -100


class Classifier(torch.nn.Module):
    """A two-layer head and `F.cross_entropy` over the whole batch: the sequential step."""

    computes_loss = True

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(H, 2 * H)
        self.head = torch.nn.Linear(2 * H, V)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), labels, ignore_index=IGNORE)


class DDPStep(Classifier):
    """DistributedDataParallel: each rank's loss is its own mean, the gradients all-reduced with
    `op` (avg; the twin: sum, every gradient DP times too large) and the loss with avg."""

    def __init__(self, op: str = "avg") -> None:
        super().__init__()
        self.op = op

    def finalize_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(loss, "avg", group(DP))

    def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: funcol.all_reduce(g, self.op, group(DP)) for name, g in grads.items()}


class GlobalCountStep(Classifier):
    """HF Trainer's `num_items_in_batch`: the loss summed over the rank's tokens (reduction
    "none", ignored labels contribute 0), divided by the count of valid labels all-reduced over
    the ranks; the losses and the gradients all-reduced with sum. The twin divides by the rank's
    own count."""

    def __init__(self, local: bool = False) -> None:
        super().__init__()
        self.local = local

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(self.logits(x), labels, ignore_index=IGNORE, reduction="none")
        count = (labels != IGNORE).sum().to(per_token.dtype)
        if not self.local:
            count = funcol.all_reduce(count, "sum", group(DP))
        return per_token.sum() / count

    def finalize_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(loss, "sum", group(DP))

    def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: funcol.all_reduce(g, "sum", group(DP)) for name, g in grads.items()}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31)
    return torch.randn(ROWS * DP, H, generator=g), torch.randint(0, V, (ROWS * DP,), generator=g)


def _batch_with_ignored() -> tuple[torch.Tensor, torch.Tensor]:
    x, labels = _batch()
    labels[1] = IGNORE
    return x, labels


# DDP's equal local means need as many valid labels on every rank: none ignored. The global
# count needs no such promise: labels may be the ignore index anywhere.
BATCH = {"x": {"layout": "shard", "axis": 0}, "labels": {"layout": "shard", "axis": 0, "range": [0, V]}}
BATCH_IGNORED = {**BATCH, "labels": {**BATCH["labels"], "also": [IGNORE]}}

# --- expert parallelism over stacked expert weights --------------------------------------------

E, D, FF, EP = 4, 5, 3, 2


class _CombineExperts(torch.autograd.Function):
    """Megatron's reduce-from-region: the experts' outputs summed over the ranks; the gradient of
    each rank's share is the gradient of the sum (identity backward)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return funcol.all_reduce(y, "sum", group(EP))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


class StackedExperts(torch.nn.Module):
    """y = sum_e gate_e(x) relu(x @ w1[e]) @ w2[e], its logits' cross-entropy the loss. The
    router is fixed (a buffer); on a rank the stacked weights are DTensors sharded over the
    experts, each rank running its own experts by local index."""

    def __init__(self, rank: int | None = None, global_ids: bool = False) -> None:
        super().__init__()
        w1, w2 = torch.randn(E, D, FF), torch.randn(E, FF, D)
        self.register_buffer("router", torch.randn(D, E))
        if rank is None:
            self.w1, self.w2 = torch.nn.Parameter(w1), torch.nn.Parameter(w2)
            self.lo, self.hi = 0, E
        else:
            mesh = init_device_mesh("cpu", (EP,))
            self.w1 = torch.nn.Parameter(distribute_tensor(w1, mesh, [Shard(0)], src_data_rank=None))
            self.w2 = torch.nn.Parameter(distribute_tensor(w2, mesh, [Shard(0)], src_data_rank=None))
            self.lo, self.hi = rank * (E // EP), (rank + 1) * (E // EP)
        self.rank, self.global_ids = rank, global_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(x @ self.router, dim=-1)
        local = self.rank is not None
        w1 = self.w1.to_local() if local else self.w1
        w2 = self.w2.to_local() if local else self.w2
        y = torch.zeros_like(x)
        for e in range(self.lo, self.hi):
            row = min(e, self.hi - self.lo - 1) if self.global_ids else e - self.lo
            y = y + gates[:, e:e + 1] * (torch.relu(x @ w1[row]) @ w2[row])
        return _CombineExperts.apply(y) if local else y


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(32)
    return torch.randn(6, D, generator=g), torch.randint(0, D, (6,), generator=g)


SPELLINGS = [
    Spelling("ddp_training_step_local_mean", "hf", "DDP step: local mean loss, gradients all-reduced with avg", 14,
             "gradients all-reduced with sum", DP, lambda: seeded(Classifier), lambda r: seeded(DDPStep),
             lambda r: seeded(lambda: DDPStep("sum")), _batch, BATCH, train=True),
    Spelling("hf_none_sum_global_count_step", "hf",
             "step: reduction='none' summed over the all-reduced count of valid labels, gradients summed", 10,
             "divided by the rank's own count", DP, lambda: seeded(Classifier), lambda r: seeded(GlobalCountStep),
             lambda r: seeded(lambda: GlobalCountStep(local=True)), _batch_with_ignored, BATCH_IGNORED, train=True),
    Spelling("megatron_stacked_experts_step", "megatron", "EP step: stacked expert weights by local index, their gradients", 12,
             "global expert ids index the rank's local rows", EP, lambda: seeded(StackedExperts),
             lambda r: seeded(lambda: StackedExperts(r)), lambda r: seeded(lambda: StackedExperts(r, global_ids=True)),
             _tokens, {"labels": {"layout": "rep", "range": [0, D]}}, train=True),
]
