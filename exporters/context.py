"""Context-parallel (CP) export of the zoo GPT-2, forward only: variant (a), all-gather of K/V,
and variant (b), ring attention (`ring=True`, below).

Rank r of CP holds the tokens [r*S/CP, (r+1)*S/CP) of every sequence (`input_ids` is declared
`{"layout": "shard", "axis": 1}`). It embeds them with the positions of its slice (an arange
offset by its start), runs every block on its own tokens, and in each attention layer gathers
the keys and values of every rank along the sequence (torch's all_gather_into_tensor gathers
dim 0: `k.movedim(2, 0)` is gathered and moved back, which exporters/collectives.py turns into
Transpose, dist.AllGather(axis=0), Transpose). Its queries are the global positions
start .. start + S/CP - 1, so the causal mask keeps key j for query i iff j <= start + i:
`torch.ones(S/CP, S).tril(diagonal=start)`. LayerNorms, MLPs and residuals are per token and
need nothing; the logits stay sequence-sharded (`logits` is declared shard along axis 1).

What the programs share with the sequential model (the zoo's MegatronGPT2): every parameter,
under its sequential FQN (the rank module holds the built model's own wte, wpe, h, ln_f and the
tied lm_head; each block's attention is a `ContextParallelAttention`, a GPT2Attention holding
the same projections with a CP forward), replicated on every rank.

Ring attention (`ring=True`, `RingAttention`): no gather. Rank r starts with its own key/value
block and, at step t = 0 .. CP-1, holds the block of rank (r - t) mod CP (keys
[src*S/CP, (src+1)*S/CP)). Each step scores its queries against the block, masks them with the
block's causal mask (query X + i keeps key U + j iff U + j <= X + i,
fully masked for a block after the rank's own: the block's columns of the rank's rows of the
causal mask, `tril(diagonal=X)` of ones(S/CP, S)), and merges the block into the running
(max m, sum l, output o) with the online-softmax rule:
    m' = max(m, rowmax(s));  p = exp(s - m');  l' = l * exp(m - m') + rowsum(p);
    o' = o * exp(m - m') + p @ v
and finally returns o / l. Between steps the blocks move one rank up the ring with point-to-point
calls (exporters.collectives.send / recv, tag 0, keys then values): rank r sends to r + 1 and
receives from r - 1. A send completes only when its receive is posted, so even ranks send
before they receive and odd ranks receive before they send (an odd rank computes with the
output of its send, the block it hands on, which keeps the send in the program). rules/ring.lp
proves the merge right: docs in that file.

Bug twins (docs/bugs.md class 9), injected into the ranks only (the sequential model and
refine.json stay those of the correct export):
- `cp_positions_not_offset`: every rank embeds positions 0 .. S/CP - 1;
- `cp_mask_not_offset`: every rank masks with the causal mask of its local queries numbered
  from 0 (`tril()` without the offset: query i sees keys 0..i).
Ring-only twins (`ring=True`):
- `ring_mask_not_offset`: every block is masked with the columns of the rank's own block
  (the diagonal block of the causal mask), not those of the block's source rank;
- `ring_no_rescale`: the running sum and output are added to the block's without the
  exp(m - m') rescale;
- `ring_block_twice`: the first block is merged again into the running sums that were
  initialised with it (its keys counted twice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from exporters.collectives import recv, send
from exporters.configs import ZooConfig, check_plan, zoo_config
from exporters.errors import PlanBug, named_bug
from exporters.zoo import GPT2Attention, MegatronGPT2

if TYPE_CHECKING:
    from exporters.api import ExportResult

CP_MODELS = ("gpt2",)
SEQ_AXIS = 1  # of input_ids [batch, seq] and of the logits [batch, seq, vocab]


@dataclass(frozen=True)
class ContextBug(PlanBug):
    """One injected context-parallel mistake (docs/bugs.md class 9)."""

    bug_class: ClassVar[int] = 9


CONTEXT_BUGS: dict[str, ContextBug] = {
    b.name: b for b in (
        ContextBug("cp_positions_not_offset", "every rank embeds positions 0 .. S/CP - 1 instead of its slice's"),
        ContextBug("cp_mask_not_offset", "every rank applies the causal mask of its local queries numbered from 0 "
                   "(tril() without its slice's offset)"),
    )
}

RING_BUGS: dict[str, ContextBug] = {
    b.name: b for b in (
        ContextBug("ring_mask_not_offset", "ring attention masks every key/value block with the causal mask's "
                   "columns of the rank's own block (not offset by the block's source rank)"),
        ContextBug("ring_no_rescale", "ring attention adds a block's partial sums to the running ones without the "
                   "exp(m_old - m_new) rescale"),
        ContextBug("ring_block_twice", "ring attention merges its first key/value block again into the running sums "
                   "initialised with it (its keys counted twice)"),
    )
}


def context_bug(name: str | None, ring: bool = False) -> ContextBug | None:
    """The bug named `name` (None for none); an ExportError for an unknown name (the ring twins
    only with `ring`)."""
    return None if name is None else named_bug({**CONTEXT_BUGS, **RING_BUGS} if ring else CONTEXT_BUGS, name,
                                               "context-parallel")


def validate_context(model: str, config: str, cp: int, *, layers: int | None = None) -> ZooConfig:
    """The config, if `cp` ranks split its sequence evenly; an ExportError naming the clash otherwise."""
    cfg = zoo_config(model, config, layers)
    check_plan("context parallelism", CP_MODELS, model, cp, "CP", cfg.seq_len, "sequence length", config)
    return cfg


def gather_sequence(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `axis` in rank order: torch gathers along dim 0, so
    the axis is moved to the front, gathered, and moved back."""
    front = x.movedim(axis, 0).contiguous()
    gathered = funcol.all_gather_tensor(front, 0, dist.group.WORLD)
    return gathered.movedim(0, axis)


class ContextParallelAttention(GPT2Attention):
    """The zoo's causal self-attention on a rank's slice of the sequence: the zoo attention's
    own projections, its keys and values gathered from every rank, its mask offset by `start`."""

    def __init__(self, attn: GPT2Attention, rank: int, cp: int, bug: ContextBug | None) -> None:
        nn.Module.__init__(self)
        self.head_dim = attn.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.c_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.c_proj
        self.rank, self.cp, self.bug = rank, cp, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = gather_sequence(k, 2), gather_sequence(v, 2)  # [b, heads, S, head_dim]: every rank's keys
        scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5)
        start = self.rank * s  # query i is global position start + i: it sees keys 0 .. start + i
        if self.bug is not None and self.bug.name == "cp_mask_not_offset":
            causal = torch.ones(s, s * self.cp, dtype=torch.bool, device=x.device).tril()  # BUG: no offset
        else:
            causal = torch.ones(s, s * self.cp, dtype=torch.bool, device=x.device).tril(diagonal=start)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))


class RingAttention(GPT2Attention):
    """The zoo's causal self-attention on a rank's slice of the sequence, by ring attention
    (module doc): the key/value blocks travel round the ring, each merged into the running
    (max, sum, output) by the online-softmax rule."""

    def __init__(self, attn: GPT2Attention, rank: int, cp: int, bug: ContextBug | None) -> None:
        nn.Module.__init__(self)
        self.head_dim = attn.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.c_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.c_proj
        self.rank, self.cp, self.bug = rank, cp, bug

    def exchange(self, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                                 tuple[torch.Tensor, torch.Tensor]]:
        """((k, v) handed on to rank + 1, (k, v) received from rank - 1): the sent blocks are the
        sends' outputs (equal to k and v), which the caller scores with. Even ranks send first,
        odd ranks receive first (a send waits for its receive)."""
        nxt, prv = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        if self.rank % 2 == 0:
            ks, vs = send(k, nxt), send(v, nxt)
            return (ks, vs), (recv(torch.zeros_like(k), prv), recv(torch.zeros_like(v), prv))
        kr, vr = recv(torch.zeros_like(k), prv), recv(torch.zeros_like(v), prv)
        return (send(k, nxt), send(v, nxt)), (kr, vr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        bug = self.bug.name if self.bug is not None else None
        start, fill = self.rank * s, torch.finfo(q.dtype).min
        # the causal mask of this rank's queries (global positions start ..) against every key;
        # each block is scored against its columns
        masked = ~torch.ones(s, s * self.cp, dtype=torch.bool, device=x.device).tril(diagonal=start)
        m = l = o = None
        for t in range(self.cp):
            if t < self.cp - 1:
                (k, v), received = self.exchange(k, v)  # (k, v): the block this step scores
            src = (self.rank - t) % self.cp  # this step's block holds keys src*s .. src*s + s - 1
            scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5)
            first = start if bug == "ring_mask_not_offset" else src * s  # BUG: the own block's columns
            scores = scores.masked_fill(masked[:, first:first + s], fill)
            m_block = scores.amax(dim=-1, keepdim=True)
            m_new = m_block if m is None else torch.maximum(m, m_block)
            p = torch.exp(scores - m_new)
            l_block, o_block = p.sum(dim=-1, keepdim=True), torch.matmul(p, v)
            if m is None:
                l, o = l_block, o_block
                if bug == "ring_block_twice":  # BUG: the first block merged again into sums that hold it
                    alpha = torch.exp(m_new - m_new)
                    l, o = l * alpha + l_block, o * alpha + o_block
            elif bug == "ring_no_rescale":
                l, o = l + l_block, o + o_block  # BUG: no exp(m - m_new) rescale
            else:
                alpha = torch.exp(m - m_new)
                l, o = l * alpha + l_block, o * alpha + o_block
            m = m_new
            if t < self.cp - 1:
                k, v = received
        out = o / l
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))


class ContextParallelGPT2(MegatronGPT2):
    """Rank `rank` of `cp` of a MegatronGPT2 (`full`, whose modules it takes over) under context
    parallelism: its forward takes the rank's tokens [batch, S/CP] and returns their logits."""

    def __init__(self, full: MegatronGPT2, rank: int, cp: int, bug: ContextBug | None = None,
                 ring: bool = False) -> None:
        nn.Module.__init__(self)
        self.rank, self.cp, self.bug = rank, cp, bug
        # registered in the sequential order (wte, wpe, h, ln_f, lm_head): the same FQNs
        self.wte, self.wpe, self.h, self.ln_f, self.lm_head = full.wte, full.wpe, full.h, full.ln_f, full.lm_head
        attention = RingAttention if ring else ContextParallelAttention
        for block in self.h:
            block.attn = attention(block.attn, rank, cp, bug)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]  # this rank's tokens
        start = self.rank * s
        if self.bug is not None and self.bug.name == "cp_positions_not_offset":
            pos = torch.arange(s, device=input_ids.device)  # BUG: every rank's positions start at 0
        else:
            pos = torch.arange(start, start + s, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def rank_module(model: str, config: str, seed: int, rank: int, cp: int, *, layers: int | None = None,
                meta: bool = False, bug: ContextBug | None = None, ring: bool = False) -> nn.Module:
    """Rank `rank` of the zoo model built from `seed` (the same weights as the sequential one)."""
    from exporters import zoo

    full = zoo.build(model, config, seed, layers=layers, meta=meta)
    return ContextParallelGPT2(full, rank, cp, bug, ring).eval()


def export_context_parallel(
    model: str,
    config: str,
    cp: int,
    out: Path | str,
    seed: int = 0,
    *,
    bug: str | None = None,
    meta: bool = False,
    layers: int | None = None,
    flat: bool = False,
    workers: int | None = None,
    ring: bool = False,
) -> ExportResult:
    """Export a zoo model under context parallelism over `cp` ranks (module doc) to the model
    directory `out`, with the bug `bug` (CONTEXT_BUGS) injected into the ranks if given. Each
    distinct block becomes one ONNX local function per program, as in `export_model` (`flat`:
    every block inline instead); `layers` overrides the config's layer count; `meta` exports
    without weight data; `workers` as in `exporters.export`; `ring`: variant (b), ring attention
    (RingAttention, point-to-point K/V blocks and the online-softmax merge) instead of the
    all-gather of K/V (RING_BUGS are its own twins)."""
    from exporters import plans, zoo
    from exporters.api import bug_words, export

    cfg = validate_context(model, config, cp, layers=layers)
    injected = context_bug(bug, ring)
    depth = f", {cfg.layers} layers" if layers is not None else ""
    return export(
        zoo.build(model, config, seed, layers=layers, meta=meta),
        functools.partial(rank_module, model, config, seed, cp=cp, layers=layers, meta=meta, bug=injected,
                          ring=ring),  # rank -> module
        zoo.example_inputs(model, config, seed, meta=meta),
        cp,
        out,
        output_names=["logits"],
        output_layouts={"logits": {"layout": "shard", "axis": SEQ_AXIS}},
        input_layouts={"input_ids": {"layout": "shard", "axis": SEQ_AXIS}},
        input_ranges={"input_ids": cfg.vocab},
        description=f"{model} config {config!r}{depth}, CP over {cp} ranks ("
        + ("ring attention: key/value blocks passed round the ring, merged by the online softmax" if ring else
           "keys and values all-gathered along the sequence")
        + "), forward, exported by exporters/context.py"
        + (" (meta: no weight data)" if meta else "") + (bug_words(injected) if injected is not None else ""),
        # no "tp": refine/reduced.py re-exports TP recipes only
        zoo={"model": model, "config": config, "cp": cp, "seed": seed, "layers": layers, "meta": meta,
             "flat": flat, "bug": bug, "train": False, **({"ring": True} if ring else {})},
        layers=None if flat else plans.layer_stack(model),
        workers=workers,
    )
