"""Context-parallel (CP) export of the zoo GPT-2, forward only: variant (a), all-gather of K/V,
variant (b), ring attention (`ring=True`, below), and zig-zag chunks with all-gathered K/V
(`zigzag=True`, below); with (a), the forward training loss instead of the logits (`loss=True`,
below), or one training step (`train=True`, below). The zoo Llama (RoPE) has variants (a) and
(b), the loss and the training step: exporters/strategies/context_llama.py (each rank's rotary positions and
causal mask offset by its slice's start); zig-zag chunks are built for GPT-2 only.

Rank r of CP holds the tokens [r*S/CP, (r+1)*S/CP) of every sequence (`input_ids` is declared
`{"layout": "shard", "axis": 1}`). It embeds them with the positions of its slice (an arange
offset by its start), runs every block on its own tokens, and in each attention layer gathers
the keys and values of every rank along the sequence (torch's all_gather_into_tensor gathers
dim 0: `k.movedim(2, 0)` is gathered and moved back, which exporters/capture/collectives.py turns into
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
calls (refine.exporters.capture.collectives.send / recv, tag 0, keys then values): rank r sends to r + 1 and
receives from r - 1. A send completes only when its receive is posted, so even ranks send
before they receive and odd ranks receive before they send (an odd rank computes with the
output of its send, the block it hands on, which keeps the send in the program). rules/ring.lp
proves the merge right: docs in that file.

Zig-zag (load-balanced) CP (`zigzag=True`, `ZigZagGPT2`), as Megatron-Core and
TransformerEngine cut the sequence: 2*CP chunks of S/(2CP) tokens, rank r computes chunks r and
2CP-1-r, so that every rank has the same causal work. The token ids are replicated (`rep`): each
rank cuts its two chunks out of them (Megatron's get_batch_on_this_cp_rank) and runs them through
every block as two tensors (`ZigZagBlock`: per token on each, attention on both; exported inline,
a layer function returns one tensor). Each attention layer all-gathers the keys (values) of the
first chunks and of the second chunks, cuts the members' blocks back out of each gather, and
concatenates the first chunks in rank order (chunks 0 .. CP-1) and the second in reverse rank
order (chunks CP .. 2CP-1): the whole sequence in order (`gather_zigzag`; TransformerEngine's
all-gather CP reorders its gathered chunks the same way). Each chunk's queries are masked from
its own start (`tril(diagonal=start)`), and embedded at its own positions. refine.json has no
layout for a rank holding chunks r and 2CP-1-r, so rank r then trades its second chunk's logits
with rank CP-1-r (Send/Recv; the lower rank sends first), whose second chunk is CP + r: its
logits are chunks r and CP + r, the sequence's 2 blocks' chunk r each, declared
`{"layout": "shard", "axis": 1, "stride": 2}`; a rank that sent returns the send's output as
`sent.0` to keep it in the program. Ring attention over zig-zag chunks is not built.

The training loss (`loss=True`, SequenceLoss / ContextParallelLoss): the sequential model returns
token cross-entropy of its logits against `labels`, mean over the counted tokens (a label -100,
IGNORE_INDEX, does not count). The labels are a model input made by the data pipeline before any
split, the token ids shifted left by one with the last position ignored (`shifted_labels`), as
Megatron's batch carries them. Rank r gets labels [r*S/CP, (r+1)*S/CP) alongside its token ids
(both declared shard axis 1), sums its tokens' cross-entropy, divides by the counted tokens of the
whole sequence (its count all-reduced with sum) and all-reduces that share with sum: the loss, a
replica (exporters/strategies/data_parallel.py's loss over sequence slices instead of batch rows; the rows of
a sequence slice flattened are blocks of the rows, summed by rules/reduce.lp reduce_sum_blocks).
With `train=True` (ContextParallelStep) the rank runs one training step on its loss share, traced
by exporters/capture/train.py: the K/V all-gathers are torch's autograd all-gather, whose backward
reduce-scatters the rank's partial gradient of the gathered keys and values back onto their
owners (rules/collectives.lp reduce_scatter_transposed), every parameter's gradient (a sum over
the rank's tokens) is all-reduced with sum over the CP group, and the reported loss is the shares
all-reduced. The sequential program is the zoo model's training step (exporters/capture/train.py).

Bug twins (docs/bugs.md class 9), injected into the ranks only (the sequential model and
refine.json stay those of the correct export):
- `cp_positions_not_offset`: every rank embeds positions 0 .. S/CP - 1;
- `cp_mask_not_offset`: every rank masks with the causal mask of its local queries numbered
  from 0 (`tril()` without the offset: query i sees keys 0..i).
Loss twin (`loss=True` or `train=True`):
- `cp_labels_shifted_after_split`: each rank makes its labels by shifting its own slice of the
  token ids (the last token of its slice gets no label: the boundary token, the next rank's first,
  is lost), instead of using the labels shifted before the split.
Zig-zag-only twins (`zigzag=True`; with it the two above number both chunks from 0):
- `zigzag_mask_not_offset`: the second chunk's causal mask is offset as if the rank's chunks
  were contiguous, by chunk r's start instead of chunk 2CP-1-r's;
- `zigzag_positions_not_offset`: the same for the second chunk's positions;
- `zigzag_chunk_order`: the second chunks of keys and values are concatenated in rank order
  (chunks 2CP-1 .. CP where CP .. 2CP-1 belong).
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
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine.exporters.capture.collectives import recv, send
from refine.exporters.zoo.configs import ZooConfig, check_plan, zoo_config
from refine.exporters.strategies.data_parallel import IGNORE_INDEX
from refine.exporters.errors import ExportError, PlanBug, named_bug
from refine.exporters.zoo.models import GPT2Attention, MegatronGPT2

if TYPE_CHECKING:
    pass

CP_MODELS = ("gpt2",)  # every CP variant (all-gather, ring, zig-zag, loss, training step); the zoo's catalogue
# every variant but zig-zag also for llama: exporters/strategies/context_llama.py (RoPE)
CP_ALLGATHER_MODELS = ("gpt2", "llama")
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


LOSS_BUGS: dict[str, ContextBug] = {
    b.name: b for b in (
        ContextBug("cp_labels_shifted_after_split", "each rank makes its labels by shifting its own slice of the "
                   "token ids (the last token of its slice gets no label: the next rank's first token is lost), "
                   "instead of the labels shifted before the split and sliced alongside the token ids"),
    )
}


ZIGZAG_BUGS: dict[str, ContextBug] = {
    b.name: b for b in (
        ContextBug("zigzag_mask_not_offset", "zig-zag: the second chunk's causal mask is offset as if the rank's "
                   "chunks were contiguous (by chunk r's start, not chunk 2N-1-r's)"),
        ContextBug("zigzag_positions_not_offset", "zig-zag: the second chunk's positions start at chunk r's start, "
                   "not chunk 2N-1-r's"),
        ContextBug("zigzag_chunk_order", "zig-zag: the ranks' second chunks of keys and values are concatenated in "
                   "ascending rank order (chunks 2N-1 .. N, not N .. 2N-1)"),
    )
}


def context_bug(name: str | None, ring: bool = False, zigzag: bool = False, loss: bool = False) -> ContextBug | None:
    """The bug named `name` (None for none); an ExportError for an unknown name (the ring twins
    only with `ring`, the zig-zag twins only with `zigzag`, the loss twins only with `loss`)."""
    if name is None:
        return None
    bugs = {**CONTEXT_BUGS, **RING_BUGS} if ring else {**CONTEXT_BUGS, **ZIGZAG_BUGS} if zigzag else CONTEXT_BUGS
    if loss:
        bugs = {**bugs, **LOSS_BUGS}
    return named_bug(bugs, name, "context-parallel")


def validate_context(model: str, config: str, cp: int, *, layers: int | None = None, ring: bool = False,
                     zigzag: bool = False, loss: bool = False, train: bool = False) -> ZooConfig:
    """The config, if `cp` ranks split its sequence evenly (zig-zag: into 2 * cp chunks); an
    ExportError naming the clash otherwise."""
    if ring and zigzag:
        raise ExportError("--ring with --zigzag (ring attention over zig-zag chunks) is not built; "
                          "zig-zag CP all-gathers K/V")
    if loss and train:
        raise ExportError("--loss exports the forward loss, --train the training step (its loss and gradients): "
                          "pass one of them")
    for flag, given in (("--loss", loss), ("--train", train)):
        if given and (ring or zigzag):
            raise ExportError(f"{flag} with --ring or --zigzag is not built; the CP loss all-gathers K/V over "
                              "contiguous sequence slices")
    cfg = zoo_config(model, config, layers)
    check_plan("context parallelism", CP_ALLGATHER_MODELS, model, cp, "CP", cfg.seq_len, "sequence length", config)
    if model != "gpt2" and zigzag:
        raise ExportError(f"--zigzag is built for gpt2 only; {model} CP all-gathers K/V or passes them round a ring")
    if zigzag and cfg.seq_len % (2 * cp):
        raise ExportError(f"zig-zag CP {cp} cuts the sequence into {2 * cp} chunks: {2 * cp} does not divide the "
                          f"sequence length {cfg.seq_len} of config {config!r}")
    return cfg


def gather_sequence(x: torch.Tensor, axis: int, differentiable: bool = False, group: Any = None) -> torch.Tensor:
    """Every rank's `x` concatenated along `axis` in rank order: torch gathers along dim 0, so
    the axis is moved to the front, gathered, and moved back. `differentiable` (a training step):
    torch's autograd all-gather, whose backward reduce-scatters the gradient (sum) the same way.
    `group`: the CP group (None: the world)."""
    front = x.movedim(axis, 0).contiguous()
    gather = funcol.all_gather_tensor_autograd if differentiable else funcol.all_gather_tensor
    gathered = gather(front, 0, dist.group.WORLD if group is None else group)
    return gathered.movedim(0, axis)


class ContextParallelAttention(GPT2Attention):
    """The zoo's causal self-attention on a rank's slice of the sequence: the zoo attention's
    own projections, its keys and values gathered from every rank, its mask offset by `start`
    (`differentiable`: gathered by torch's autograd all-gather, for a training step)."""

    def __init__(self, attn: GPT2Attention, rank: int, cp: int, bug: ContextBug | None,
                 differentiable: bool = False) -> None:
        nn.Module.__init__(self)
        self.head_dim = attn.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.c_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.c_proj
        self.rank, self.cp, self.bug, self.differentiable = rank, cp, bug, differentiable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        # [b, heads, S, head_dim]: every rank's keys
        k, v = gather_sequence(k, 2, self.differentiable), gather_sequence(v, 2, self.differentiable)
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

    def heads(self, x: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [b, heads, s, head_dim] of the rank's tokens (a subclass rotates q and k here)."""
        b, s, _ = x.shape
        return tuple(p(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # type: ignore[return-value]
                     for p in (self.q_proj, self.k_proj, self.v_proj))

    def block_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The scaled scores of the queries against one key block (as the sequential attention scales them)."""
        return torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5)

    def block_values(self, v: torch.Tensor) -> torch.Tensor:
        """The values one block's probabilities weigh (a subclass repeats GQA heads here)."""
        return v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention [b, heads, s, head_dim]."""
        b, _, s, _ = out.shape
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor, *extra: object) -> torch.Tensor:
        # (the loop stays in forward: torch records a node's line in the module's forward only)
        q, k, v = self.heads(x, *extra)
        s = q.shape[2]
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
            scores = self.block_scores(q, k)
            first = start if bug == "ring_mask_not_offset" else src * s  # BUG: the own block's columns
            scores = scores.masked_fill(masked[:, first:first + s], fill)
            m_block = scores.amax(dim=-1, keepdim=True)
            m_new = m_block if m is None else torch.maximum(m, m_block)
            p = torch.exp(scores - m_new)
            l_block, o_block = p.sum(dim=-1, keepdim=True), torch.matmul(p, self.block_values(v))
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
        return self.project_out(o / l)


class ContextParallelGPT2(MegatronGPT2):
    """Rank `rank` of `cp` of a MegatronGPT2 (`full`, whose modules it takes over) under context
    parallelism: its forward takes the rank's tokens [batch, S/CP] and returns their logits."""

    def __init__(self, full: MegatronGPT2, rank: int, cp: int, bug: ContextBug | None = None,
                 ring: bool = False, differentiable: bool = False) -> None:
        nn.Module.__init__(self)
        self.rank, self.cp, self.bug = rank, cp, bug
        # registered in the sequential order (wte, wpe, h, ln_f, lm_head): the same FQNs
        self.wte, self.wpe, self.h, self.ln_f, self.lm_head = full.wte, full.wpe, full.h, full.ln_f, full.lm_head
        for block in self.h:
            block.attn = (RingAttention(block.attn, rank, cp, bug) if ring else
                          ContextParallelAttention(block.attn, rank, cp, bug, differentiable))

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


# --- the training loss over sequence slices (`loss=True`) -------------------------------------


class SequenceLoss:
    """The sequential training loss, mixed into the zoo model's own class (its parameters keep
    their FQNs): token cross-entropy of the logits against `labels`, mean over the counted tokens
    (exporters/capture/train.py token_cross_entropy; a label IGNORE_INDEX does not count). The labels are
    the token ids shifted left by one with the last position ignored, made by the data pipeline
    before any split (`shifted_labels`), a model input as Megatron's batch has them."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from refine.exporters.capture.train import token_cross_entropy

        return token_cross_entropy(super().forward(input_ids), labels)  # type: ignore[misc]


class ContextParallelLoss:
    """A CP rank's share of the training loss, mixed into ContextParallelGPT2: its tokens' summed
    cross-entropy over the counted tokens of the WHOLE sequence (its count all-reduced with sum
    over the CP group), the shares all-reduced with sum: the sequential mean, whatever tokens the
    labels ignore (exporters/strategies/data_parallel.py's loss, over sequence slices instead of batch rows).
    The labels are the rank's slice of the sequence's labels (input `labels`, sliced alongside
    input_ids along the sequence)."""

    bug: ContextBug | None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.loss_share(input_ids, labels), "sum", dist.group.WORLD)

    def loss_share(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The rank's tokens' summed cross-entropy over the whole sequence's counted tokens."""
        logits = super().forward(input_ids)  # type: ignore[misc]
        if self.bug is not None and self.bug.name == "cp_labels_shifted_after_split":
            # BUG: the labels made from the rank's own slice of the token ids, after the split
            labels = shifted_labels(input_ids)
        flat_labels = labels.flatten()
        total = F.cross_entropy(logits.flatten(0, -2).float(), flat_labels, ignore_index=IGNORE_INDEX,
                                reduction="sum")
        counted = (flat_labels != IGNORE_INDEX).sum()  # (an int64 count, as torch's mean counts them)
        return total / funcol.all_reduce(counted, "sum", dist.group.WORLD)


class ContextParallelStep(ContextParallelLoss):
    """A CP rank's training step (exporters/capture/train.py traces it: `computes_loss` and the
    `finalize_*` hooks, as exporters/strategies/data_parallel.py's DataParallelStep): the loss share is
    differentiated (through the K/V all-gathers, whose backward reduce-scatters each rank's
    partial gradient of the gathered keys and values), the reported loss is the shares
    all-reduced, and every gradient, a sum over the rank's tokens, is all-reduced with sum over
    the CP group (Megatron all-reduces the gradients over the CP ranks with the DP ones)."""

    computes_loss = True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_share(input_ids, labels)

    def finalize_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(loss, "sum", dist.group.WORLD)

    def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {fqn: funcol.all_reduce(g, "sum", dist.group.WORLD) for fqn, g in grads.items()}


def shifted_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The labels of next-token prediction: the token ids shifted left by one along the sequence,
    the last position IGNORE_INDEX (it has no next token)."""
    ignored = torch.full_like(input_ids[:, :1], IGNORE_INDEX)
    return torch.cat([input_ids[:, 1:], ignored], dim=SEQ_AXIS)


@functools.cache
def _mixed(mixin: type, model_class: type[nn.Module]) -> type[nn.Module]:
    return type(f"{mixin.__name__}{model_class.__name__}", (mixin, model_class), {})


def with_loss(module: nn.Module, mixin: type) -> nn.Module:
    """`module` turned, in place, into one whose forward(input_ids, labels) returns the loss
    (`mixin` mixed into its class, so its parameters keep their FQNs)."""
    module.__class__ = _mixed(mixin, type(module))
    return module


def gather_zigzag(first: torch.Tensor, second: torch.Tensor, axis: int, cp: int,
                  ascending: bool = False) -> torch.Tensor:
    """The whole sequence along `axis` from every rank's two zig-zag chunks: rank j holds chunk
    j (`first`) and chunk 2*cp-1-j (`second`). Each is all-gathered along dim 0 (torch gathers
    dim 0 only: the members' tensors stacked, in rank order) and cut back into the members'
    blocks; the first chunks in rank order are chunks 0 .. cp-1, the second chunks in reverse
    rank order are chunks cp .. 2cp-1 (`ascending`: the zigzag_chunk_order twin, rank order).
    TransformerEngine's all-gather CP reorders its gathered chunks the same way (index_select)."""
    firsts = funcol.all_gather_tensor(first.contiguous(), 0, dist.group.WORLD).chunk(cp, dim=0)
    seconds = funcol.all_gather_tensor(second.contiguous(), 0, dist.group.WORLD).chunk(cp, dim=0)
    return torch.cat([*firsts, *(seconds if ascending else reversed(seconds))], dim=axis)


def zigzag_starts(rank: int, cp: int, chunk: int, bug: ContextBug | None, what: str) -> tuple[int, int]:
    """The first global positions of rank `rank`'s two chunks (chunk `rank` and chunk
    2*cp-1-rank, `chunk` tokens each) as its `what` ("positions" or "mask") offsets them, bugs
    included."""
    name = bug.name if bug is not None else None
    if name == f"cp_{what}_not_offset":
        return 0, 0  # BUG: both chunks numbered from 0
    if name == f"zigzag_{what}_not_offset":
        return rank * chunk, rank * chunk  # BUG: the second chunk offset as chunk r's, as if contiguous
    return rank * chunk, (2 * cp - 1 - rank) * chunk


class ZigZagAttention(GPT2Attention):
    """The zoo's causal self-attention on a rank's two zig-zag chunks (`xa`: chunk r, `xb`: chunk
    2*cp-1-r): the zoo attention's own projections, the keys and values of every rank's chunks
    gathered into sequence order (gather_zigzag), each chunk's queries masked from its own start."""

    def __init__(self, attn: GPT2Attention, rank: int, cp: int, bug: ContextBug | None) -> None:
        nn.Module.__init__(self)
        self.head_dim = attn.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.c_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.c_proj
        self.rank, self.cp, self.bug = rank, cp, bug

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        return tuple(p(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # type: ignore[return-value]
                     for p in (self.q_proj, self.k_proj, self.v_proj))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Queries at global positions start .. start + s - 1 against every key: key j is kept
        for query i iff j <= start + i."""
        b, _, s, _ = q.shape
        scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5)
        causal = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=start)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, xa: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (qa, ka, va), (qb, kb, vb) = self.heads(xa), self.heads(xb)
        ascending = self.bug is not None and self.bug.name == "zigzag_chunk_order"  # BUG: chunks 2N-1 .. N
        k = gather_zigzag(ka, kb, 2, self.cp, ascending)  # [b, heads, S, head_dim]: every key, in order
        v = gather_zigzag(va, vb, 2, self.cp, ascending)
        start_a, start_b = zigzag_starts(self.rank, self.cp, xa.shape[1], self.bug, "mask")
        return self.attend(qa, k, v, start_a), self.attend(qb, k, v, start_b)


class ZigZagBlock(nn.Module):
    """A zoo GPT-2 block (its own ln_1, attn, ln_2, mlp: the same FQNs) run on a rank's two
    zig-zag chunks: per token on each, the attention on both together."""

    def __init__(self, block: nn.Module, rank: int, cp: int, bug: ContextBug | None) -> None:
        super().__init__()
        self.ln_1, self.ln_2, self.mlp = block.ln_1, block.ln_2, block.mlp
        self.attn = ZigZagAttention(block.attn, rank, cp, bug)

    def forward(self, xa: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.attn(self.ln_1(xa), self.ln_1(xb))
        xa, xb = xa + a, xb + b
        return xa + self.mlp(self.ln_2(xa)), xb + self.mlp(self.ln_2(xb))


class ZigZagGPT2(MegatronGPT2):
    """Rank `rank` of `cp` of a MegatronGPT2 (`full`, whose modules it takes over) under zig-zag
    (load-balanced) context parallelism: the sequence is cut into 2*cp chunks of S/(2cp) tokens
    and the rank computes chunks `rank` and 2*cp-1-rank (so every rank has the same causal work).
    Its forward takes the whole token ids (replicated, as Megatron's get_batch_on_this_cp_rank
    cuts a rank's chunks from the whole batch), embeds its two chunks at their positions, runs
    every block on them (ZigZagBlock), and trades its second chunk's logits with rank cp-1-r
    (`swap`), so that it returns the logits of chunks r and cp + r: a stride-2 shard of the
    sequence (refine.json has no layout for two chunks r and 2cp-1-r), and, when it sent,
    `sent.0`, the send's output."""

    def __init__(self, full: MegatronGPT2, rank: int, cp: int, bug: ContextBug | None = None) -> None:
        nn.Module.__init__(self)
        self.rank, self.cp, self.bug = rank, cp, bug
        # registered in the sequential order (wte, wpe, h, ln_f, lm_head): the same FQNs
        self.wte, self.wpe = full.wte, full.wpe
        self.h = nn.ModuleList(ZigZagBlock(block, rank, cp, bug) for block in full.h)
        self.ln_f, self.lm_head = full.ln_f, full.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        c = input_ids.shape[1] // (2 * self.cp)  # tokens per chunk
        a, b = self.rank * c, (2 * self.cp - 1 - self.rank) * c  # the rank's chunks start here
        pos_a, pos_b = zigzag_starts(self.rank, self.cp, c, self.bug, "positions")
        xa = self.wte(input_ids[:, a:a + c]) + self.wpe(torch.arange(pos_a, pos_a + c, device=input_ids.device))
        xb = self.wte(input_ids[:, b:b + c]) + self.wpe(torch.arange(pos_b, pos_b + c, device=input_ids.device))
        for block in self.h:
            xa, xb = block(xa, xb)
        la, lb = self.lm_head(self.ln_f(xa)), self.lm_head(self.ln_f(xb))
        second, sent = self.swap(lb)
        # chunks r and cp + r: rank r's piece of the logits cut into 2 blocks (a stride-2 shard)
        logits = torch.cat([la, second], dim=SEQ_AXIS)
        return logits if sent is None else (logits, sent)

    def swap(self, lb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(chunk cp + r's logits, the send's output or None): rank r trades its second chunk
        (2cp-1-r) with rank cp-1-r, whose second chunk is cp + r (the middle rank of an odd cp
        holds its own). The lower rank of a pair sends first, the higher receives first (a send
        waits for its receive); the send's output is returned (`sent`) to keep it in the program."""
        partner = self.cp - 1 - self.rank
        if partner == self.rank:
            return lb, None
        if self.rank < partner:
            sent = send(lb, partner)
            return recv(torch.zeros_like(lb), partner), sent
        received = recv(torch.zeros_like(lb), partner)
        return received, send(lb, partner)


def zigzag_outputs(rank: int, cp: int) -> list[str]:
    """A zig-zag rank's output names: `logits`, and `sent.0` (its swap's send) unless it is the
    middle rank of an odd cp, which sends nothing."""
    return ["logits"] if 2 * rank == cp - 1 else ["logits", "sent.0"]
