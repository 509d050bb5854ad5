"""Context-parallel (CP) export of the zoo Llama (RoPE): keys and values all-gathered along the
sequence, as exporters/strategies/context.py does for GPT-2 (its module doc), forward logits, forward loss
(`loss=True`) or one training step (`train=True`).

The sequential model (`CausalLlama`) is the zoo's HF LlamaForCausalLM run by a forward of our
own over HF's own modules (the same FQNs, the same weights: `model.embed_tokens`,
`model.rotary_emb`, `model.layers.*` (HF's LlamaDecoderLayer, its norms and MLP), `model.norm`,
`lm_head`): position ids `arange(S)`, HF's rotary embedding of them (cos, sin) handed to every
layer, and in each layer an attention (`LlamaCausalAttention`) that runs HF's projections,
HF's `apply_rotary_pos_emb` and `repeat_kv`, and masks its scores with the causal mask built
from `torch.ones(S, S).tril()` (instead of HF's `create_causal_mask` machinery, whose packed-
sequence detection no lemma reads). tests/test_context_llama.py checks it computes HF's logits.

Rank r of CP holds the tokens [r*S/CP, (r+1)*S/CP) (`input_ids` declared shard on axis 1). It
takes the rotary cos/sin of the positions of its slice, `arange(start, start + S/CP)` with
start = r*S/CP (rules/context.lp: the sequential arange's rows [start, start + S/CP), which the
rotary tables' Mul, Concat, Cos and Sin keep), rotates its queries and its keys with them, then
all-gathers the rotated keys and the values of every rank along the sequence (a key is rotated
by its own position, on the rank that holds it), and masks query i (global position start + i)
to keys 0 .. start + i: `torch.ones(S/CP, S).tril(diagonal=start)`. Norms, MLPs and residuals are
per token; the logits stay sequence-sharded.

Bug twins (docs/bugs.md class 9), in the ranks only:
- `cp_positions_not_offset`: every rank takes the rotary cos/sin of positions 0 .. S/CP - 1;
- `cp_mask_not_offset`: every rank masks with `tril()` of its local queries numbered from 0.
With `loss` or `train`, `cp_labels_shifted_after_split` as for GPT-2 (exporters/strategies/context.py).

Ring attention (`ring=True`, `LlamaRingAttention`): exporters/strategies/context.py's RingAttention (its
point-to-point K/V blocks, online-softmax merge and twins `ring_mask_not_offset`,
`ring_no_rescale`, `ring_block_twice`) over the rotated keys; each block's K/V heads repeated for
GQA where it is scored and weighed. Zig-zag chunks are built for GPT-2 only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from refine.exporters.strategies.context import ContextBug, RingAttention, gather_sequence


class LlamaCausalAttention(nn.Module):
    """HF's LlamaAttention (its projections, `apply_rotary_pos_emb`, `repeat_kv`, scaling, a float32
    softmax) on rank `rank` of `cp`'s slice of the sequence: the rotated keys and the values
    gathered from every rank (cp > 1), the causal mask offset by the slice's start. With cp = 1,
    the sequential attention (no gather, the whole causal mask). Returns (output, None) as HF's
    attention does for its decoder layer. `group`: the CP group (None: the world)."""

    def __init__(self, attn: nn.Module, rank: int = 0, cp: int = 1, bug: ContextBug | None = None,
                 differentiable: bool = False, group: Any = None) -> None:
        super().__init__()
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.num_key_value_groups = attn.num_key_value_groups
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.rank, self.cp, self.bug, self.differentiable = rank, cp, bug, differentiable
        self.group = group

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                **_: object) -> tuple[torch.Tensor, None]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        b, s, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings  # the rotary tables of this rank's positions
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.cp > 1:  # [b, kv_heads, S, head_dim]: every rank's rotated keys, and values
            k, v = (gather_sequence(k, 2, self.differentiable, self.group),
                    gather_sequence(v, 2, self.differentiable, self.group))
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        start = self.rank * s  # query i is global position start + i: it sees keys 0 .. start + i
        if self.bug is not None and self.bug.name == "cp_mask_not_offset":
            causal = torch.ones(s, s * self.cp, dtype=torch.bool, device=q.device).tril()  # BUG: no offset
        else:
            causal = torch.ones(s, s * self.cp, dtype=torch.bool, device=q.device).tril(diagonal=start)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out), None


class LlamaRingAttention(RingAttention):
    """HF's LlamaAttention on rank `rank` of `cp`'s slice of the sequence by ring attention
    (exporters/strategies/context.py RingAttention, its merge and its twins): queries and keys rotated by
    the rank's own positions, the rotated key blocks (K/V heads) and value blocks passed round
    the ring, each block's K/V heads repeated for GQA before it is scored and weighed."""

    def __init__(self, attn: nn.Module, rank: int, cp: int, bug: ContextBug | None) -> None:
        nn.Module.__init__(self)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.num_key_value_groups = attn.num_key_value_groups
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.rank, self.cp, self.bug = rank, cp, bug

    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override]
                position_embeddings: tuple[torch.Tensor, torch.Tensor], **_: object) -> tuple[torch.Tensor, None]:
        return RingAttention.forward(self, hidden_states, position_embeddings), None

    def heads(self, x: torch.Tensor, *extra: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k rotated by the rank's positions' cos/sin (`extra`), and v."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        (cos, sin), = extra
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def block_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import repeat_kv

        return torch.matmul(q, repeat_kv(k, self.num_key_value_groups).transpose(2, 3)) * self.scaling

    def block_values(self, v: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import repeat_kv

        return repeat_kv(v, self.num_key_value_groups)


class CausalLlama(nn.Module):
    """Rank `rank` of `cp` of the zoo's HF Llama (`full`, whose modules it takes over: the same
    FQNs) under context parallelism, forward(input_ids of the rank's slice) -> their logits;
    with cp = 1 the sequential model of a Llama CP export (module doc)."""

    def __init__(self, full: nn.Module, rank: int = 0, cp: int = 1, bug: ContextBug | None = None,
                 differentiable: bool = False, ring: bool = False) -> None:
        super().__init__()
        self.rank, self.cp, self.bug = rank, cp, bug
        # registered in the HF model's order (model, lm_head): the same FQNs
        self.model, self.lm_head = full.model, full.lm_head
        for layer in self.model.layers:
            layer.self_attn = (LlamaRingAttention(layer.self_attn, rank, cp, bug) if ring else
                               LlamaCausalAttention(layer.self_attn, rank, cp, bug, differentiable))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]  # this rank's tokens
        start = self.rank * s
        if self.bug is not None and self.bug.name == "cp_positions_not_offset":
            positions = torch.arange(s, device=input_ids.device)  # BUG: every rank's positions start at 0
        else:
            positions = torch.arange(start, start + s, device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(x, positions.unsqueeze(0))  # RoPE tables of the slice's positions
        for layer in self.model.layers:
            x = layer(x, position_embeddings=(cos, sin))
        return self.lm_head(self.model.norm(x))
