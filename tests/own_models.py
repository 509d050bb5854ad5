"""Plain PyTorch modules written for refine's tests the way a user writes them: small models,
their tensor-parallel plans (DTensor `parallelize_module` and Megatron-style modules of their
own with functional collectives), data-parallel losses, positions, experts and pipeline stages,
each with the mistakes people make (tests/test_own_bugs.py). Nothing here is refine's zoo.

Every injected mistake is on a line marked `# BUG(name)`: the line a report must name. The
rank programs get the mistake through an attribute the plan sets on the rank's copy (`bug`,
`sp`, `cp`, `ep`); the sequential model runs the plain code.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from refine.exporters.capture.collectives import recv, send


def world() -> dist.ProcessGroup:
    return dist.group.WORLD


# --- Megatron-style building blocks of one's own -------------------------------------------------


class SumFromRanks(torch.autograd.Function):
    """Megatron's reduce-from-region: the partial sums all-reduced in the forward, the replicated
    gradient passed through in the backward."""

    @staticmethod
    def forward(ctx, y, op):
        return funcol.all_reduce(y, op, world())  # BUG(reduce_op)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce(y: torch.Tensor, op: str = "sum") -> torch.Tensor:
    return SumFromRanks.apply(y, op)


class CopyToRanks(torch.autograd.Function):
    """Megatron's copy-to-region: the identity forward, the input gradient all-reduced in backward."""

    @staticmethod
    def forward(ctx, x, forget):
        ctx.forget = forget
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.forget:
            return grad, None
        return funcol.all_reduce(grad, "sum", world()), None


class ReduceGrad(torch.autograd.Function):
    """The identity forward; the gradient all-reduced in backward (a replicated weight used on
    the rank's own tokens)."""

    @staticmethod
    def forward(ctx, w):
        return w

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", world())


class RowParallel(nn.Module):
    """A row-parallel linear of one's own: the rank's columns of the weight (a DTensor shard from
    RowwiseParallel) on its slice of the activations, the partial sums all-reduced."""

    def __init__(self, linear: nn.Module, bug: str | None = None) -> None:
        super().__init__()
        self.weight, self.bias, self.bug = linear.weight, linear.bias, bug

    def forward(self, h):
        w = self.weight.to_local()
        if self.bias is None:
            return all_reduce(h @ w.t())
        b = self.bias.to_local()
        if self.bug == "bias_first":
            return all_reduce(h @ w.t() + b)  # BUG(bias_first)
        y = h @ w.t()  # BUG(missing_allreduce)
        if self.bug == "missing_allreduce":
            return y + b
        if self.bug == "all_gather":
            return funcol.all_gather_tensor(y, 0, world())[: h.shape[0]] + b  # BUG(all_gather)
        if self.bug in ("max", "avg"):
            return all_reduce(y, self.bug) + b
        if self.bug == "half":
            return all_reduce(y * 0.5) + b  # BUG(half)
        if self.bug == "autograd_allreduce":
            return funcol.all_reduce(y, "sum", world()) + b  # BUG(autograd_allreduce)
        if self.bug == "wrong_group":
            return funcol.all_reduce(y, "sum", self.pair) + b  # BUG(wrong_group)
        return all_reduce(y) + b


class ColParallel(nn.Module):
    """A column-parallel linear of one's own (the rank's rows of a ColwiseParallel weight); its
    input copied to the ranks (gradients all-reduced in backward) unless sequence parallelism's
    all-gather stands in for the copy."""

    def __init__(self, linear: nn.Module, bug: str | None = None, copy: bool = True) -> None:
        super().__init__()
        self.weight, self.bias, self.bug, self.copy = linear.weight, linear.bias, bug, copy

    def forward(self, x):
        if self.copy:
            x = CopyToRanks.apply(x, self.bug == "copy_no_allreduce")
        return F.linear(x, self.weight.to_local(), self.bias.to_local())  # BUG(copy_no_allreduce)


# --- an MLP and its plans ---------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d: int = 16, f: int = 32, bias: bool = True, residual: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d, bias=bias)
        self.residual = residual

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        return x + y if self.residual else y


class CheckpointedMLPs(nn.Module):
    """Two MLP blocks under activation checkpointing (torch.utils.checkpoint, non-reentrant): the
    backward recomputes each block's forward, constants and all."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLP(), MLP()])
        self.register_buffer("gain", torch.tensor([0.5, 2.0]).repeat(8), persistent=False)  # (read as a constant)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(lambda h, b=block: b(h) * self.gain, x, use_reentrant=False)
        return x


def checkpointed_plan(model: nn.Module, mesh) -> nn.Module:
    return parallelize_module(model, mesh, {f"blocks.{i}.{n}": style for i in range(2)
                                            for n, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))},
                              src_data_rank=None)


class MaskedPool(nn.Module):
    """An encoder block over padded sequences: the MLP on every token, then the mean over the
    tokens the padding mask keeps (its backward copies each sequence's gradient to its tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.head = nn.Linear(16, 3)

    def forward(self, x, attention_mask):
        h = self.mlp(x)
        m = attention_mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def masked_pool_plan(model: nn.Module, mesh) -> nn.Module:
    return parallelize_module(model, mesh, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()},
                              src_data_rank=None)


def tp_plan(model: nn.Module, mesh) -> nn.Module:
    """The DTensor plan: up column-parallel, down row-parallel."""
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)


def row_plan(bug: str | None):
    """The DTensor plan with `down` replaced by RowParallel (with `bug`)."""

    def plan(model: nn.Module, mesh) -> nn.Module:
        model = tp_plan(model, mesh)
        model.down = RowParallel(model.down, bug)
        if bug == "wrong_group":  # pairs of ranks where the whole group must sum
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            model.down.pair = pairs[dist.get_rank() // 2]
        return model

    return plan


class PreMLP(nn.Module):
    """A replicated projection, then an MLP: its gradient needs the MLP's input gradient whole."""

    def __init__(self, d: int = 16, f: int = 32) -> None:
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.mlp = MLP(d, f)

    def forward(self, x):
        return self.mlp(torch.tanh(self.pre(x)))


def megatron_plan(bug: str | None):
    def plan(model: nn.Module, mesh) -> nn.Module:
        tp_plan(model.mlp, mesh)
        model.mlp.up = ColParallel(model.mlp.up, bug)
        model.mlp.down = RowParallel(model.mlp.down)
        return model

    return plan


# --- sequence parallelism: a norm over the rank's tokens ---------------------------------------------


class NormMLP(nn.Module):
    """LayerNorm then an MLP, on [s, b, d] (sequence first, as Megatron lays it out)."""

    def __init__(self, d: int = 16, f: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d, f, bias=False, residual=False)
        self.sp: str | None = None

    def forward(self, x):
        if self.sp is None:
            return self.mlp(self.norm(x))
        mine = x.chunk(dist.get_world_size(), 0)[dist.get_rank()]
        weight, bias = self.norm.weight, self.norm.bias
        if self.sp == "reduced":
            weight, bias = ReduceGrad.apply(weight), ReduceGrad.apply(bias)
        h = F.layer_norm(mine, (x.shape[-1],), weight, bias)  # BUG(sp_norm)
        return self.mlp(funcol.all_gather_tensor_autograd(h, 0, world()))


def sp_plan(how: str):
    def plan(model: nn.Module, mesh) -> nn.Module:
        model.sp = how
        tp_plan(model.mlp, mesh)
        model.mlp.up = ColParallel(model.mlp.up, copy=False)  # (the all-gather's backward reduce-scatters)
        model.mlp.down = RowParallel(model.mlp.down)
        return model

    return plan


# --- attention ----------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4, kv_heads: int = 4, fused: bool = False, sdpa: bool = False,
                 alibi: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.fused, self.sdpa = heads, kv_heads, d // heads, fused, sdpa
        self.alibi = alibi
        if fused:
            self.qkv = nn.Linear(d, 3 * d, bias=False)
        else:
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
            self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.bug: str | None = None

    def forward(self, x):
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, -1)  # BUG(fused_qkv)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.bug == "global_heads":
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # BUG(global_heads)
        else:
            q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        if self.bug in ("kv_first", "kv_own"):  # k and v replicated: each rank takes its own heads
            n = self.kv_heads // dist.get_world_size()
            start = 0 if self.bug == "kv_first" else dist.get_rank() * n
            k, v = k[:, start:start + n], v[:, start:start + n]  # BUG(kv_first)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        if self.sdpa:  # torch's fused attention, causal (nanoGPT's)
            return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        if self.bug == "local_scale":  # the head size from the rank's local width
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.o.weight.to_local().shape[1] // self.heads)  # BUG(local_scale)
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if self.alibi:  # BLOOM's linear position bias, a slope per head: the rank's heads' slopes
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / self.heads) for h in range(self.heads)])
            n = q.shape[1]
            start = 0 if self.bug == "alibi_first" or n == self.heads else dist.get_rank() * n
            slopes = slopes[start:start + n]  # BUG(alibi_first)
            scores = scores + slopes[:, None, None] * torch.arange(s, dtype=scores.dtype)[None, None, :]
        att = torch.softmax(scores, -1)
        return self.o((att @ v).transpose(1, 2).reshape(b, s, -1))


def attn_plan(bug: str | None, shard_kv: bool = True, fused: bool = False):
    def plan(model: nn.Module, mesh) -> nn.Module:
        model.bug = bug
        cols = ({"qkv": ColwiseParallel()} if fused else
                {"q": ColwiseParallel(), **({"k": ColwiseParallel(), "v": ColwiseParallel()} if shard_kv else {})})
        return parallelize_module(model, mesh, {**cols, "o": RowwiseParallel()}, src_data_rank=None)

    return plan


# --- a classifier, for data parallelism ---------------------------------------------------------------


class Classifier(nn.Module):
    def __init__(self, d: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(d, 32)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class ConvNet(nn.Module):
    """A small image classifier as people write one: a convolution, batch norm, a max-pool, a
    grouped strided convolution, a linear head (data-parallel: every rank its own images)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(8 * 2 * 2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        return self.head(torch.flatten(F.relu(self.conv2(x)), 1))


def sharded_logits_plan(model: nn.Module, mesh) -> nn.Module:
    """The classes split over the ranks and the loss taken on each rank's shard: the head's
    column-parallel output kept local (no `output_layouts=Replicate()`, no loss_parallel)."""
    return parallelize_module(model, mesh, {"head": ColwiseParallel()}, src_data_rank=None)  # BUG(sharded_logits)


def summed_ce(out, batch):
    return F.cross_entropy(out, batch["labels"], reduction="sum")  # BUG(sum_loss)


def token_ce(out, batch):
    return F.cross_entropy(out, batch["labels"])  # BUG(local_count)


def mse(out, batch):
    return F.mse_loss(out, batch["target"])


# --- context parallelism: positions -------------------------------------------------------------------


class PosModel(nn.Module):
    def __init__(self, seq: int = 8, d: int = 16) -> None:
        super().__init__()
        self.pos = nn.Embedding(seq, d)
        self.proj = nn.Linear(d, d)
        self.cp: str | None = None

    def forward(self, x):  # x [b, s, d]
        if self.cp is None:
            return self.proj(x + self.pos(torch.arange(x.shape[1])))
        r, k = dist.get_rank(), dist.get_world_size()
        mine = x.chunk(k, 1)[r]
        n = mine.shape[1]
        start = 0 if self.cp == "not_offset" else r * n
        positions = torch.arange(start, start + n)  # BUG(cp_positions)
        h = self.proj(mine + self.pos(positions))
        return funcol.all_gather_tensor(h.transpose(0, 1).contiguous(), 0, world()).transpose(0, 1)


def cp_plan(how: str):
    def plan(model: nn.Module, mesh) -> nn.Module:
        model.cp = how
        return model

    return plan


# --- expert parallelism: routing weights --------------------------------------------------------------


class MoE(nn.Module):
    """Dense dispatch: every expert on every token, weighted by its routing column."""

    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(experts))
        self.ep: str | None = None

    def forward(self, x):  # x [t, d]
        weights = torch.softmax(self.router(x), -1)
        if self.ep is None:
            return sum(weights[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        r, k = dist.get_rank(), dist.get_world_size()
        n = len(self.experts) // k
        out = 0
        for j in range(n):
            e = r * n + j
            column = j if self.ep == "local_ids" else e
            out = out + weights[:, column:column + 1] * self.experts[e](x)  # BUG(ep_ids)
        return all_reduce(out)


def ep_plan(how: str):
    def plan(model: nn.Module, mesh) -> nn.Module:
        model.ep = how
        r, n = dist.get_rank(), len(model.experts) // dist.get_world_size()
        for e, expert in enumerate(model.experts):  # a rank holds its own experts only
            if not r * n <= e < (r + 1) * n:
                expert.weight = None
        return model

    return plan


# --- pipeline stages ----------------------------------------------------------------------------------


class TwoLayers(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.first = nn.Linear(d, d)
        self.second = nn.Linear(d, d)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class Stage(nn.Module):
    """Stage `rank` of two: the first runs `first` and sends its output on; the second receives
    it and runs `second`."""

    def __init__(self, model: TwoLayers, rank: int, bug: str | None = None) -> None:
        super().__init__()
        self.rank, self.bug = rank, bug
        if rank == 0 or bug == "layer_twice":
            self.first = model.first
        if rank == 1:
            self.second = model.second

    def forward(self, x):
        if self.rank == 0:
            return send(torch.relu(self.first(x)), 1)
        h = recv(torch.zeros_like(x), 0)
        if self.bug == "layer_twice":
            h = torch.relu(self.first(h))  # BUG(layer_twice)
        return self.second(h)
