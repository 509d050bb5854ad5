"""Norms under sequence and tensor parallelism, spelled as HF (RMSNorm by hand: `x *
rsqrt(mean(x^2) + eps) * w`), torchtitan (`F.rms_norm`, `nn.LayerNorm`) and Megatron (a
LayerNorm on the rank's sequence chunk) write them."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group, seeded

B, S, H, W = 2, 4, 8, 2
EPS = 1e-6


class HfRmsNorm(torch.nn.Module):
    """LlamaRMSNorm as HF writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + EPS))


class SequenceChunkNorm(HfRmsNorm):
    """The norm on the rank's sequence chunk (sequence parallelism), the chunks all-gathered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return funcol.all_gather_tensor(y.transpose(0, 1).contiguous(), 0, group(W)).transpose(0, 1)


class HiddenShardNorm(HfRmsNorm):
    """The twin: the norm over a hidden shard (TP's columns) without all-reducing the squares."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.cols = slice(rank * H // W, (rank + 1) * H // W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x[..., self.cols]
        y = self.weight[self.cols] * (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + EPS))
        return funcol.all_gather_tensor(y.permute(2, 0, 1).contiguous(), 0, group(W)).permute(1, 2, 0)


class HiddenShardNormReduced(HiddenShardNorm):
    """The norm over a hidden shard with the squares' sum all-reduced (the mean over all of H)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x[..., self.cols]
        variance = funcol.all_reduce(xs.pow(2).sum(-1, keepdim=True), "sum", group(W)) / H
        y = self.weight[self.cols] * (xs * torch.rsqrt(variance + EPS))
        return funcol.all_gather_tensor(y.permute(2, 0, 1).contiguous(), 0, group(W)).permute(1, 2, 0)


class TorchRmsNorm(torch.nn.Module):
    """torchtitan's: F.rms_norm."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (H,), self.weight, EPS)


class TorchRmsNormChunk(TorchRmsNorm):
    def __init__(self, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, (H,), self.weight, self.eps)
        return funcol.all_gather_tensor(y.transpose(0, 1).contiguous(), 0, group(W)).transpose(0, 1)


def _x() -> tuple[torch.Tensor]:
    return (torch.randn(B, S, H, generator=torch.Generator().manual_seed(9)),)


SEQUENCE = {"x": {"layout": "shard", "axis": 1}}

SPELLINGS = [
    Spelling("hf_rmsnorm_sequence_parallel", "hf", "HF's hand-written RMSNorm on sequence chunks", 4,
             "the norm over a hidden shard, squares not all-reduced", W, lambda: seeded(HfRmsNorm),
             lambda r: seeded(SequenceChunkNorm), lambda r: seeded(lambda: HiddenShardNorm(r)), _x, SEQUENCE),
    Spelling("megatron_rmsnorm_hidden_shard_reduced", "megatron", "RMSNorm over a hidden shard, squares all-reduced", 1,
             "the squares not all-reduced", W, lambda: seeded(HfRmsNorm), lambda r: seeded(lambda: HiddenShardNormReduced(r)),
             lambda r: seeded(lambda: HiddenShardNorm(r)), _x),
    Spelling("torchtitan_rms_norm_sequence_parallel", "torchtitan", "F.rms_norm on sequence chunks", 14,
             "another epsilon on the ranks", W, lambda: seeded(TorchRmsNorm), lambda r: seeded(TorchRmsNormChunk),
             lambda r: seeded(lambda: TorchRmsNormChunk(1.0)), _x, SEQUENCE),
]
