"""Attention as new code writes it: `F.scaled_dot_product_attention` in the sequential model
(HF's default, torchtitan's), against an explicit softmax attention on the ranks, or SDPA on
both sides, heads split over tensor-parallel ranks and gathered back."""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group

B, NH, S, D, TP = 2, 4, 6, 8, 2
HEADS = {n: {"layout": "shard", "axis": 1} for n in "qkv"}


class Sdpa(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ExplicitHeads(torch.nn.Module):
    """Softmax attention written out on the rank's heads (nanoGPT's, Megatron's core attention),
    the heads all-gathered. `scale`: the factor the scores are divided by (sqrt of the head
    size; the twin takes the whole model's width)."""

    def __init__(self, scale: float = math.sqrt(D), causal_offset: int = 0) -> None:
        super().__init__()
        self.scale, self.offset = scale, causal_offset

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) / self.scale
        keep = torch.ones(S, S, dtype=torch.bool).tril(self.offset)
        scores = scores.masked_fill(~keep, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return funcol.all_gather_tensor(out.transpose(0, 1).contiguous(), 0, group(TP)).transpose(0, 1)


class SdpaHeads(torch.nn.Module):
    """SDPA on the rank's heads (HF's attention under a TP plan), the heads all-gathered;
    `causal` False: the twin forgets the mask."""

    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return funcol.all_gather_tensor(out.transpose(0, 1).contiguous(), 0, group(TP)).transpose(0, 1)


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(B, NH, S, D, generator=g) for _ in range(3))  # type: ignore[return-value]


# SDPA scales q and k by the square root of the scale each, before their product; the explicit
# attention divides the product (lowering gathers SDPA's two factors after its MatMul:
# refine/lowering/normal_forms.py, split_scale_product), and masks the scores with a negated causal
# mask (rules/core.lp's nw(M)).

SPELLINGS = [
    Spelling("hf_sdpa_vs_explicit_attention", "hf", "SDPA sequential, explicit softmax attention on the ranks", 14,
             "the scores divided by sqrt of the model width, not of the head size", TP, Sdpa,
             lambda r: ExplicitHeads(), lambda r: ExplicitHeads(scale=math.sqrt(D * NH)), _qkv, HEADS),
    Spelling("torchtitan_sdpa_both_sides", "torchtitan", "SDPA on both sides, heads split", 9,
             "the ranks' attention not causal", TP, Sdpa, lambda r: SdpaHeads(), lambda r: SdpaHeads(causal=False), _qkv,
             HEADS),
    Spelling("nanogpt_explicit_mask_offset", "nanogpt", "masked_fill with a tril mask, explicit on the ranks", 9,
             "the mask shifted by one (each query sees the next key)", TP, Sdpa, lambda r: ExplicitHeads(),
             lambda r: ExplicitHeads(causal_offset=1), _qkv, HEADS),
]
