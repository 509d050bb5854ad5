"""Hand-written Megatron-style tensor-parallel layers, and the bugs people write with them.

Everything here is ordinary PyTorch: each rank's module computes on its local shard with
plain tensors and communicates with `torch.distributed._functional_collectives` on the
world group (funcol.all_reduce / all_gather_tensor / reduce_scatter_tensor), exactly as
Megatron-LM's `ColumnParallelLinear` / `RowParallelLinear` do. No DTensor plan runs the
computation; DTensor is used only to *store* each parameter, so that the parameter says
which slice of the sequential tensor the rank holds (Shard(0): rows, Shard(1): columns,
Replicate: all of it). `exporters.export` reads refine.json's input layouts off those
placements (exporters/layouts.py), so no layout is declared by hand here, and the
parameter names are those of the sequential twin (`up_proj.weight`, ...), which is how
`exporters.export` pairs a rank's initializer with its sequential FQN.

Layers (world = the fake process group `exporters.export` creates for each rank):
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

Buggy variants (each a small subclass; the line marked `# BUG` is the wrong statement):
- `TPMLPBiasBeforeAllReduce` (BUGS.md class 3): every rank adds the full bias before the
  all-reduce, so the sum holds TP x bias.
- `TPMLPMissingAllReduce`, `TPAttentionMissingAllReduce` (class 1): the row-parallel layer
  forgets the all-reduce; the partial sums are used as if complete (in the attention block,
  added to the replicated residual).
- `TPAttentionInnerSplit` (class 8): the local q/k/v [b, s, h/tp] are reshaped to
  [b, s, nh, hd/tp] (all heads, a slice of each head's dims) instead of [b, s, nh/tp, hd].
- `TPAttentionFusedQKV` with `SeqAttentionFusedQKV` (class 6): one fused qkv Linear of out
  3h sharded as a plain contiguous column shard, then split locally into q, k, v; rank 0
  then holds all of q and half of k, not a third of each.

`CASES` names every (sequential, rank) pair with its example inputs; `build(name)` returns
(seq_module, rank_module_factory, example_inputs) ready for `exporters.export`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

# tiny shapes: batch 2 x 4 tokens, hidden 16 = 4 heads of dim 4, MLP hidden 32
BATCH, SEQ_LEN, HIDDEN, HEADS, FFN = 2, 4, 16, 4, 32


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


# --- MLP -----------------------------------------------------------------------------------------


class SeqMLP(nn.Module):
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


class SeqAttention(nn.Module):
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


# --- cases for exporters.export ------------------------------------------------------------------------

# name -> (sequential class, rank class, constructor keywords); every block takes
# x [BATCH, SEQ_LEN, HIDDEN]. The `_nobias` twins are the same blocks without biases.
CASES: dict[str, tuple[type[nn.Module], type[nn.Module], dict[str, bool]]] = {
    "mlp": (SeqMLP, TPMLP, {}),
    "mlp_nobias": (SeqMLP, TPMLP, {"bias": False}),
    "attn": (SeqAttention, TPAttention, {}),
    "attn_nobias": (SeqAttention, TPAttention, {"bias": False}),
    "mlp_bias_before_allreduce": (SeqMLP, TPMLPBiasBeforeAllReduce, {}),
    "mlp_missing_allreduce": (SeqMLP, TPMLPMissingAllReduce, {"bias": False}),
    "mlp_missing_allreduce_bias": (SeqMLP, TPMLPMissingAllReduce, {}),
    "attn_missing_allreduce": (SeqAttention, TPAttentionMissingAllReduce, {"bias": False}),
    "attn_inner_split": (SeqAttention, TPAttentionInnerSplit, {"bias": False}),
    "attn_fused_qkv": (SeqAttentionFusedQKV, TPAttentionFusedQKV, {"bias": False}),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, Callable[[int], nn.Module], tuple[torch.Tensor]]:
    """(seq_module, rank_module_factory, example_inputs) for `exporters.export`."""
    seq_cls, rank_cls, kwargs = CASES[name]
    torch.manual_seed(seed)
    seq = seq_cls(**kwargs).eval()
    x = torch.randn(BATCH, SEQ_LEN, HIDDEN)
    return seq, lambda rank: rank_cls.from_sequential(seq), (x,)
