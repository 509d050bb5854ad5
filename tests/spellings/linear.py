"""Tensor-parallel linear layers as frameworks spell them on plain tensors with functional
collectives: Megatron's column- and row-parallel layers (bias after the all-reduce, or on rank 0
only, as vLLM's RowParallelLinear adds it), a fused QKV weight split per rank, SwiGLU's fused
gate/up, sequence parallelism's reduce-scatter, ZeRO-3's all-gathered weight shards."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from . import Spelling, group, seeded

B, H, FF, TP = 4, 8, 12, 2


class Mlp(torch.nn.Module):
    """y = relu(x W1^T + b1) W2^T + b2 (nn.Linear's weights: [out, in])."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(H, FF), torch.nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MegatronMlp(Mlp):
    """Column-parallel up (rows of W1, b1), row-parallel down (columns of W2), the partial sum
    all-reduced. `bias`: where b2 is added: after the all-reduce, on rank 0 only before it
    (vLLM), or (the twin) on every rank before it."""

    def __init__(self, rank: int, bias: str = "after") -> None:
        super().__init__()
        self.rank, self.bias = rank, bias
        n = FF // TP
        self.cols = slice(rank * n, (rank + 1) * n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(F.linear(x, self.up.weight[self.cols], self.up.bias[self.cols]))
        part = F.linear(h, self.down.weight[:, self.cols])
        if self.bias == "every_rank" or (self.bias == "rank0" and self.rank == 0):
            part = part + self.down.bias
        out = funcol.all_reduce(part, "sum", group(TP))
        return out + self.down.bias if self.bias == "after" else out


class Attention(torch.nn.Module):
    """q, k, v = x W_qkv^T split in three (nanoGPT's c_attn), y = q * sigmoid(k) + v (a stand-in
    that reads all three): the fused weight's rows are [Q | K | V]."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(H, 3 * H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(H, dim=-1)
        return q * torch.sigmoid(k) + v


class FusedQkvRanks(Attention):
    """Rank r takes its rows of each of Q, K, V from the fused weight ([q_r | k_r | v_r], as
    Megatron interleaves them per rank), computes its columns, all-gathers them. `plain` (the
    twin): rows [r * 3H/TP, (r+1) * 3H/TP) of [Q | K | V] (a plain column shard)."""

    def __init__(self, rank: int, plain: bool = False) -> None:
        super().__init__()
        self.rank, self.plain = rank, plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, w = H // TP, self.qkv.weight
        if self.plain:
            mine = w[self.rank * 3 * n:(self.rank + 1) * 3 * n]
        else:
            mine = torch.cat([w[p * H + self.rank * n:p * H + (self.rank + 1) * n] for p in range(3)])
        q, k, v = F.linear(x, mine).split(n, dim=-1)
        y = q * torch.sigmoid(k) + v
        return funcol.all_gather_tensor(y.t().contiguous(), 0, group(TP)).t()


class SwiGlu(torch.nn.Module):
    """y = (silu(x Wg^T) * (x Wu^T)) Wd^T with gate and up fused in one weight [Wg | Wu]."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(H, 2 * FF, bias=False)
        self.down = torch.nn.Linear(FF, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class SwiGluRanks(SwiGlu):
    """Rank r's rows of the gate and of the up halves (stride 2, as Megatron shards fc1), its
    columns of down, all-reduced; `plain` (the twin): a plain shard of [Wg | Wu]."""

    def __init__(self, rank: int, plain: bool = False) -> None:
        super().__init__()
        self.rank, self.plain = rank, plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, w = FF // TP, self.gate_up.weight
        rows = w[self.rank * 2 * n:(self.rank + 1) * 2 * n] if self.plain else \
            torch.cat([w[self.rank * n:(self.rank + 1) * n], w[FF + self.rank * n:FF + (self.rank + 1) * n]])
        g, u = F.linear(x, rows).chunk(2, dim=-1)
        part = F.linear(F.silu(g) * u, self.down.weight[:, self.rank * n:(self.rank + 1) * n])
        return funcol.all_reduce(part, "sum", group(TP))


class RowParallelSequence(torch.nn.Module):
    """y = x W^T on [S, H] tokens; sequence parallelism: the row-parallel partial reduce-scattered
    along the sequence (each rank its sequence chunk). `scatter_axis` 1 (the twin): along the
    hidden axis."""

    def __init__(self, rank: int | None = None, scatter_axis: int = 0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, H, bias=False)
        self.rank, self.axis = rank, scatter_axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            return self.lin(x)
        n = H // TP
        part = F.linear(x[:, self.rank * n:(self.rank + 1) * n], self.lin.weight[:, self.rank * n:(self.rank + 1) * n])
        out = funcol.reduce_scatter_tensor(part if self.axis == 0 else part.t().contiguous(), "sum", 0, group(TP))
        return out if self.axis == 0 else out.t()


class Zero3(torch.nn.Module):
    """ZeRO-3 / FSDP: each rank holds rows [r n, (r+1) n) of W, all-gathers them before use;
    `axis` 1 (the twin): the shards gathered along the wrong axis, then reshaped."""

    def __init__(self, rank: int | None = None, axis: int = 0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(H, FF, bias=False)
        self.rank, self.axis = rank, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            return self.lin(x)
        n = FF // TP
        shard = self.lin.weight[self.rank * n:(self.rank + 1) * n]
        if self.axis == 0:
            full = funcol.all_gather_tensor(shard.contiguous(), 0, group(TP))
        else:
            full = funcol.all_gather_tensor(shard.t().contiguous(), 0, group(TP)).reshape(FF, H)
        return F.linear(x, full)


def _x(rows: int = B, cols: int = H) -> tuple[torch.Tensor]:
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(6)),)


SPELLINGS = [
    Spelling("megatron_row_parallel_bias_after", "megatron", "row-parallel bias added after the all-reduce", 3,
             "the bias added on every rank before the all-reduce", TP, lambda: seeded(Mlp),
             lambda r: seeded(lambda: MegatronMlp(r)), lambda r: seeded(lambda: MegatronMlp(r, "every_rank")), _x),
    Spelling("vllm_row_parallel_bias_rank0", "vllm", "row-parallel bias added on rank 0 only, before the all-reduce", 3,
             "the bias added on every rank before the all-reduce", TP, lambda: seeded(Mlp),
             lambda r: seeded(lambda: MegatronMlp(r, "rank0")), lambda r: seeded(lambda: MegatronMlp(r, "every_rank")), _x),
    Spelling("megatron_fused_qkv_per_rank", "megatron", "fused QKV weight, each rank's q, k, v rows", 6,
             "the fused weight split as a plain column shard", TP, lambda: seeded(Attention),
             lambda r: seeded(lambda: FusedQkvRanks(r)), lambda r: seeded(lambda: FusedQkvRanks(r, plain=True)), _x),
    Spelling("megatron_swiglu_fused_gate_up", "megatron", "SwiGLU with fused gate/up, strided rows per rank", 6,
             "the fused gate/up weight split as a plain shard", TP, lambda: seeded(SwiGlu),
             lambda r: seeded(lambda: SwiGluRanks(r)), lambda r: seeded(lambda: SwiGluRanks(r, plain=True)), _x),
    Spelling("megatron_sequence_parallel_reduce_scatter", "megatron", "row-parallel partial reduce-scattered along the sequence", 2,
             "reduce-scattered along the hidden axis", TP, lambda: seeded(RowParallelSequence),
             lambda r: seeded(lambda: RowParallelSequence(r)), lambda r: seeded(lambda: RowParallelSequence(r, 1)),
             lambda: _x(2 * TP, H), {}, {"output": {"layout": "shard", "axis": 0}}),
    Spelling("deepspeed_zero3_gathered_weight", "deepspeed", "ZeRO-3 weight shards all-gathered before the matmul", 2,
             "the shards gathered along the wrong axis", TP, lambda: seeded(Zero3), lambda r: seeded(lambda: Zero3(r)),
             lambda r: seeded(lambda: Zero3(r, axis=1)), _x),
]
