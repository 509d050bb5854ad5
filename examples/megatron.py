"""Hand-written Megatron-style tensor-parallel layers, and the bugs people write with them.

Everything here is ordinary PyTorch: each rank's module computes on its local shard with
plain tensors and communicates with `torch.distributed._functional_collectives` on the
world group (funcol.all_reduce / all_gather_tensor / reduce_scatter_tensor), exactly as
Megatron-LM's `ColumnParallelLinear` / `RowParallelLinear` do. No DTensor plan runs the
computation; DTensor is used only to *store* each parameter, so that the parameter says
which slice of the sequential tensor the rank holds (Shard(0): rows, Shard(1): columns,
Replicate: all of it). `refine.exporters.export` reads refine.json's input layouts off those
placements (exporters/capture/layouts.py), so no layout is declared by hand here, and the
parameter names are those of the sequential twin (`up_proj.weight`, ...), which is how
`refine.exporters.export` pairs a rank's initializer with its sequential FQN.

Layers (world = the fake process group `refine.exporters.export` creates for each rank):
- `ColumnParallelLinear(in, out, bias, gather_output=False)`: weight [out, in] and bias
  [out] sharded along out (Shard(0)); y_local = x @ W_r^T + b_r; with `gather_output` the
  shards are all-gathered along the last axis.
- `RowParallelLinear(in, out, bias, input_is_parallel=True)`: weight sharded along in
  (Shard(1)), bias replicated; y = all_reduce(x_r @ W_r^T) + b (the bias AFTER the sum).

Blocks, each with a sequential twin (plain nn.Linear, same parameter names) and a
`from_sequential(seq)` classmethod that cuts the sequential weights into the rank's module:
- `SeqMLP` / `TPMLP`: up_proj (column) -> gelu -> down_proj (row).
- `SeqAttention` / `TPAttention`: q/k/v column-parallel (heads split across ranks), softmax
  attention per local head, o_proj row-parallel, residual.
- `SeqEmbedding` / `TPEmbedding`: Megatron's `VocabParallelEmbedding` (rank r holds rows
  [start, end) of the table, masks the ids it does not own, all-reduce), written with
  masked_fill (`TPEmbeddingWhere`: with torch.where). The ids are declared in [0, vocab).

Buggy variants (each a small subclass; the line marked `# BUG` is the wrong statement):
- `TPMLPBiasBeforeAllReduce` (BUGS.md class 3): every rank adds the full bias before the
  all-reduce, so the sum holds TP x bias.
- `TPMLPMissingAllReduce`, `TPAttentionMissingAllReduce` (class 1): the row-parallel layer
  forgets the all-reduce; the partial sums are used as if complete (in the attention block,
  added to the replicated residual).
- `TPAttentionInnerSplit` (class 8): the local q/k/v [b, s, h/tp] are reshaped to
  [b, s, nh, hd/tp] (all heads, a slice of each head's dims) instead of [b, s, nh/tp, hd].
- `TPEmbeddingOffByOne`: the owned range starts one row late (`ids <= start` is foreign);
  `TPEmbeddingUnmasked`: the foreign ids' rows (local row 0) are never zeroed.
- `TPAttentionFusedQKV` with `SeqAttentionFusedQKV` (class 6): one fused qkv Linear of out
  3h sharded as a plain contiguous column shard, then split locally into q, k, v; rank 0
  then holds all of q and half of k, not a third of each.

`CASES` names every (sequential, rank) pair with its example inputs; `build(name)` returns
(seq_module, rank_module_factory, example_inputs) ready for `refine.exporters.export`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

# tiny shapes: batch 2 x 4 tokens, hidden 16 = 4 heads of dim 4, MLP hidden 32
BATCH, SEQ_LEN, HIDDEN, HEADS, FFN = 2, 4, 16, 4, 32
VOCAB, TOKENS = 24, 16  # the embedding: 24 rows, batch 2 x 16 token ids


# --- parameters that know which slice they are -----------------------------------------------


def _mesh():
    """A 1-D device mesh over the whole (fake) world; built inside the rank factory."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard(full: torch.Tensor, dim: int | None) -> nn.Parameter:
    """This rank's piece of the sequential tensor `full`, stored as a DTensor parameter:
    chunk `rank` along `dim` (Shard(dim)), or all of it when `dim` is None (Replicate)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    if dim is None:
        local, placement = full.detach().clone(), Replicate()
    else:
        local, placement = full.detach().chunk(world, dim)[rank].clone(), Shard(dim)
    return nn.Parameter(DTensor.from_local(local, _mesh(), [placement], run_check=False))


def _local(p: torch.Tensor | None) -> torch.Tensor | None:
    """The plain local tensor a rank computes with."""
    return None if p is None else p.to_local()


# --- the two layers ----------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y = x @ W^T + b with W's rows (the output features) split across ranks.

    Input replicated [..., in]; output [..., out/tp] (or [..., out] with `gather_output`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.load_(nn.Linear(in_features, out_features, bias=bias))

    def load_(self, linear: nn.Linear) -> ColumnParallelLinear:
        """Cut the sequential `linear`'s weights: rows of W and of b (Shard(0))."""
        self.weight = _shard(linear.weight, 0)
        self.bias = _shard(linear.bias, 0) if linear.bias is not None else None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, _local(self.weight), _local(self.bias))
        if self.gather_output:
            y = funcol.all_gather_tensor(y, -1 % y.dim(), dist.group.WORLD)
        return y


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b with W's columns (the input features) split across ranks.

    Input [..., in/tp] (or replicated [..., in] when not `input_is_parallel`: each rank takes
    its chunk); output replicated [..., out]. The bias is replicated and added once, AFTER
    the all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        self.load_(nn.Linear(in_features, out_features, bias=bias))

    def load_(self, linear: nn.Linear) -> RowParallelLinear:
        """Cut the sequential `linear`'s weights: columns of W (Shard(1)), b replicated."""
        self.weight = _shard(linear.weight, 1)
        self.bias = _shard(linear.bias, None) if linear.bias is not None else None
        return self

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            return x
        return x.chunk(dist.get_world_size(), -1)[dist.get_rank()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(self._scatter(x), _local(self.weight))
        y = funcol.all_reduce(partial, "sum", dist.group.WORLD)
        if self.bias is not None:
            y = y + _local(self.bias)
        return y


# --- blocks ------------------------------------------------------------------------------------


class Block(nn.Module):
    """A sequential block: what it takes (hidden states x [BATCH, SEQ_LEN, HIDDEN]) and the
    extra arguments `refine.exporters.export` needs for it (none)."""

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (torch.randn(BATCH, SEQ_LEN, HIDDEN),)

    def export_options(self) -> dict[str, Any]:
        return {}


# --- MLP -----------------------------------------------------------------------------------------


class SeqMLP(Block):
    """The sequential MLP: down_proj(gelu(up_proj(x)))."""

    def __init__(self, hidden: int = HIDDEN, ffn: int = FFN, bias: bool = True):
        super().__init__()
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class TPMLP(nn.Module):
    """Megatron MLP: column-parallel up_proj, gelu on the shard, row-parallel down_proj."""

    row_parallel = RowParallelLinear  # subclasses swap in a buggy layer

    def __init__(self, hidden: int = HIDDEN, ffn: int = FFN, bias: bool = True):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, ffn, bias=bias)
        self.down_proj = self.row_parallel(ffn, hidden, bias=bias)

    @classmethod
    def from_sequential(cls, seq: SeqMLP) -> TPMLP:
        """This rank's module, holding its cut of `seq`'s weights."""
        tp = cls(seq.up_proj.in_features, seq.up_proj.out_features, seq.up_proj.bias is not None)
        tp.up_proj.load_(seq.up_proj)
        tp.down_proj.load_(seq.down_proj)
        return tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


# --- attention -------------------------------------------------------------------------------------


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v over [b, heads, s, d] tensors."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class SeqAttention(Block):
    """One attention block: x + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, bias: bool = True):
        super().__init__()
        self.hidden, self.heads, self.head_dim = hidden, heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=bias)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, nh, s, hd]
        b, s, _ = t.shape
        return t.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        o = _attend(q, k, v, self.head_dim).transpose(1, 2).reshape(b, s, self.hidden)
        return x + self.o_proj(o)


class TPAttention(nn.Module):
    """Megatron attention: q/k/v column-parallel (rank r owns heads r*nh/tp .. (r+1)*nh/tp - 1),
    attention on the local heads, o_proj row-parallel (all-reduce), residual on the replica."""

    row_parallel = RowParallelLinear  # subclasses swap in a buggy layer

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, bias: bool = True):
        super().__init__()
        tp = dist.get_world_size()
        assert heads % tp == 0, f"{heads} heads cannot be split over {tp} ranks"
        self.hidden, self.heads, self.head_dim = hidden, heads, hidden // heads
        self.local_heads = heads // tp
        self.q_proj = ColumnParallelLinear(hidden, hidden, bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, hidden, bias=bias)
        self.v_proj = ColumnParallelLinear(hidden, hidden, bias=bias)
        self.o_proj = self.row_parallel(hidden, hidden, bias=bias)

    @classmethod
    def from_sequential(cls, seq: SeqAttention) -> TPAttention:
        tp = cls(seq.hidden, seq.heads, seq.q_proj.bias is not None)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(tp, name).load_(getattr(seq, name))
        return tp

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:  # [b, s, h/tp] -> [b, nh/tp, s, hd]
        b, s, _ = t.shape
        return t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (self._split_heads(t) for t in self._qkv(x))
        o = _attend(q, k, v, self.head_dim).transpose(1, 2).reshape(b, s, -1)  # [b, s, h/tp]
        return x + self.o_proj(o)


# --- vocab-parallel embedding ---------------------------------------------------------------------------


class SeqEmbedding(Block):
    """The sequential embedding: embed(ids) = W[ids] for token ids in [0, vocab)."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, self.embed.num_embeddings, (BATCH, TOKENS)),)

    def export_options(self) -> dict[str, Any]:
        """The ids are token ids: refine.json declares their range [0, vocab) (a rank's masked rows
        sum to the table's rows only for ids that are not negative), and `check` draws them from it."""
        vocab = self.embed.num_embeddings
        return {"input_layouts": {"ids": {"layout": "rep", "range": [0, vocab]}}, "input_ranges": {"ids": vocab}}


class VocabParallelEmbedding(nn.Module):
    """Megatron's VocabParallelEmbedding: rank r holds rows [start, end) of the table (Shard(0)),
    looks up the ids it owns in its rows, zeroes the others, and the all-reduce sums the ranks'
    pieces. Megatron writes `masked[mask] = 0` and `out[mask, :] = 0.0` (NonZero + ScatterND once
    exported); `masked_fill` says the same and exports as Where."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        world, rank = dist.get_world_size(), dist.get_rank()
        assert vocab % world == 0, f"a vocabulary of {vocab} cannot be split over {world} ranks"
        per = vocab // world
        self.start, self.end = rank * per, (rank + 1) * per
        self.load_(nn.Embedding(vocab, hidden))

    def load_(self, embedding: nn.Embedding) -> VocabParallelEmbedding:
        """Cut the sequential table: this rank's rows (Shard(0))."""
        self.weight = _shard(embedding.weight, 0)
        return self

    def _foreign(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids whose rows another rank holds."""
        return (ids < self.start) | (ids >= self.end)

    def _zero_foreign(self, out: torch.Tensor, foreign: torch.Tensor) -> torch.Tensor:
        return out.masked_fill(foreign.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        foreign = self._foreign(ids)
        local = (ids - self.start).masked_fill(foreign, 0)
        out = self._zero_foreign(F.embedding(local, _local(self.weight)), foreign)
        return funcol.all_reduce(out, "sum", dist.group.WORLD)


class VocabParallelEmbeddingWhere(VocabParallelEmbedding):
    """The same with torch.where and the mask of the ids this rank owns."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        own = (ids >= self.start) & (ids < self.end)
        local = torch.where(own, ids - self.start, 0)
        out = torch.where(own[..., None], F.embedding(local, _local(self.weight)), 0.0)
        return funcol.all_reduce(out, "sum", dist.group.WORLD)


class TPEmbedding(nn.Module):
    """The rank's embedding block; subclasses swap in another layer."""

    layer = VocabParallelEmbedding

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        self.embed = self.layer(vocab, hidden)

    @classmethod
    def from_sequential(cls, seq: SeqEmbedding) -> TPEmbedding:
        tp = cls(seq.embed.num_embeddings, seq.embed.embedding_dim)
        tp.embed.load_(seq.embed)
        return tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class TPEmbeddingWhere(TPEmbedding):
    layer = VocabParallelEmbeddingWhere


# --- the bugs ---------------------------------------------------------------------------------------


class RowParallelLinearBiasBeforeAllReduce(RowParallelLinear):
    """Class 3: every rank adds the full bias to its partial sum; the all-reduce then adds it TP times."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(self._scatter(x), _local(self.weight), _local(self.bias))  # BUG: bias before the sum
        return funcol.all_reduce(partial, "sum", dist.group.WORLD)


class RowParallelLinearMissingAllReduce(RowParallelLinear):
    """Class 1: the all-reduce is forgotten; each rank returns its partial sum (+ bias) as the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self._scatter(x), _local(self.weight))  # BUG: no all-reduce of the partial sums
        if self.bias is not None:
            y = y + _local(self.bias)
        return y


class TPMLPBiasBeforeAllReduce(TPMLP):
    row_parallel = RowParallelLinearBiasBeforeAllReduce


class TPMLPMissingAllReduce(TPMLP):
    row_parallel = RowParallelLinearMissingAllReduce


class TPAttentionMissingAllReduce(TPAttention):
    row_parallel = RowParallelLinearMissingAllReduce


class TPAttentionInnerSplit(TPAttention):
    """Class 8: the local [b, s, h/tp] is viewed as all nh heads of hd/tp dims (the shard axis
    split on its inner factor) instead of nh/tp whole heads."""

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        tp = dist.get_world_size()
        return t.view(b, s, self.heads, self.head_dim // tp).transpose(1, 2)  # BUG: [b,s,nh,hd/tp]


class VocabParallelEmbeddingOffByOne(VocabParallelEmbedding):
    """An off-by-one in the owned range: the first row a rank owns counts as foreign, so the id
    `start` of every rank is zeroed on all ranks."""

    def _foreign(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids <= self.start) | (ids >= self.end)  # BUG: <= start


class VocabParallelEmbeddingUnmasked(VocabParallelEmbedding):
    """The foreign ids are looked up as local row 0 and never zeroed: every rank adds its first
    row for every id it does not own."""

    def _zero_foreign(self, out: torch.Tensor, foreign: torch.Tensor) -> torch.Tensor:
        return out  # BUG: the foreign rows are not zeroed


class TPEmbeddingOffByOne(TPEmbedding):
    layer = VocabParallelEmbeddingOffByOne


class TPEmbeddingUnmasked(TPEmbedding):
    layer = VocabParallelEmbeddingUnmasked


class SeqAttentionFusedQKV(SeqAttention):
    """The sequential block with q, k, v computed by one fused Linear(h, 3h) and split."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, bias: bool = True):
        super().__init__(hidden, heads, bias)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (self._split_heads(t) for t in self.qkv_proj(x).split(self.hidden, dim=-1))
        o = _attend(q, k, v, self.head_dim).transpose(1, 2).reshape(b, s, self.hidden)
        return x + self.o_proj(o)


class TPAttentionFusedQKV(TPAttention):
    """Class 6: the fused [3h, h] weight cut into contiguous row chunks (a plain column shard),
    then split locally into three; the correct cut takes rows r of each of q, k and v."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, bias: bool = True):
        super().__init__(hidden, heads, bias)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = ColumnParallelLinear(hidden, 3 * hidden, bias=bias)  # BUG: contiguous shard of [q; k; v]

    @classmethod
    def from_sequential(cls, seq: SeqAttentionFusedQKV) -> TPAttentionFusedQKV:
        tp = cls(seq.hidden, seq.heads, seq.o_proj.bias is not None)
        tp.qkv_proj.load_(seq.qkv_proj)
        tp.o_proj.load_(seq.o_proj)
        return tp

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv_proj(x).split(self.hidden // dist.get_world_size(), dim=-1)


# --- cases for refine.exporters.export ------------------------------------------------------------------------

# name -> (sequential class, rank class, constructor keywords); every block but the embedding
# takes x [BATCH, SEQ_LEN, HIDDEN] (Block.example_inputs). The `_nobias` twins are the same
# blocks without biases.
CASES: dict[str, tuple[type[Block], type[nn.Module], dict[str, bool]]] = {
    "mlp": (SeqMLP, TPMLP, {}),
    "mlp_nobias": (SeqMLP, TPMLP, {"bias": False}),
    "attn": (SeqAttention, TPAttention, {}),
    "attn_nobias": (SeqAttention, TPAttention, {"bias": False}),
    "mlp_bias_before_allreduce": (SeqMLP, TPMLPBiasBeforeAllReduce, {}),
    "mlp_missing_allreduce": (SeqMLP, TPMLPMissingAllReduce, {"bias": False}),
    "mlp_missing_allreduce_bias": (SeqMLP, TPMLPMissingAllReduce, {}),
    "attn_missing_allreduce": (SeqAttention, TPAttentionMissingAllReduce, {"bias": False}),
    "attn_missing_allreduce_bias": (SeqAttention, TPAttentionMissingAllReduce, {}),
    "attn_inner_split": (SeqAttention, TPAttentionInnerSplit, {"bias": False}),
    "attn_fused_qkv": (SeqAttentionFusedQKV, TPAttentionFusedQKV, {"bias": False}),
    "embed": (SeqEmbedding, TPEmbedding, {}),
    "embed_where": (SeqEmbedding, TPEmbeddingWhere, {}),
    "embed_off_by_one": (SeqEmbedding, TPEmbeddingOffByOne, {}),
    "embed_unmasked": (SeqEmbedding, TPEmbeddingUnmasked, {}),
}


def build(name: str, seed: int = 0) -> tuple[Block, Callable[[int], nn.Module], tuple[torch.Tensor, ...]]:
    """(seq_module, rank_module_factory, example_inputs) for `refine.exporters.export`; pass it
    `**seq_module.export_options()` too."""
    seq_cls, rank_cls, kwargs = CASES[name]
    torch.manual_seed(seed)
    seq = seq_cls(**kwargs).eval()
    return seq, lambda rank: rank_cls.from_sequential(seq), seq.example_inputs()
