"""Pipeline meshes with data and context parallelism: PP x DP x CP x TP (docs/layout4d.md, issue 43).

`refine export --model llama --pp P --dp D --cp C --tp T --train [--micro-batches M] [--schedule 1f1b]`
extends the PP x TP training step (exporters/strategies/pipeline_mesh_train.py) with two more dims:

- **The mesh** is `{"shape": [P, D, C, T], "dims": ["pp", "dp", "cp", "tp"]}`, torchtitan's order
  (its ParallelDims: pp, dp, cp, tp), row-major, TP innermost: global rank
  r = ((s*D + d)*C + c)*T + t. A dim of size 1 is left out of the mesh (PP x TP stays `[P, T]`).
- **DP**: rank (s, d, c, t) takes batch rows [d*B/D, (d+1)*B/D) (`input_ids` and `labels` shard
  axis 0 over dp), cut into its M micro-batches.
- **CP** (Llama only, RoPE): it takes sequence slice c (shard axis 1 over cp, `then` after the
  batch rows where both are split), rotates its queries and keys with the positions of its slice
  and all-gathers the rotated keys and the values over its CP group {ranks (s, d, *, t)}, masking
  with the causal mask offset by the slice's start (exporters/strategies/context_llama.py's
  LlamaCausalAttention); the gathers' backward reduce-scatters the keys' and values' gradients.
  The sequential model is then context_llama's CausalLlama (HF's modules under their FQNs, the
  causal mask from `tril`), as for a CP export.
- **The data group** of (s, t) is every rank (s, *, *, t): the ranks holding the same stage's same
  TP piece for other batch rows and sequence slices. The loss is each rank's summed token
  cross-entropy over the token count all-reduced over it; the reported loss and every gradient
  (after the TP plan's own reductions and the micro-batch sums) are all-reduced with sum over it,
  as Megatron reduces gradients over its data-parallel-with-context group
  (exporters/capture/pipeline_step.py's `data_group`).
- Stages pass activations and their gradients between the same (d, c, t) of consecutive stages.

Row dp=0 is captured (each of its ranks holds its own chunk of the weights), each distinct layer a
forward and a backward function (`--flat`: every layer inline); the
other DP rows are its copies with their groups moved (the same programs on their own batch rows),
declared in refine.json (`row_copies`) and not written; `refine verify` verifies on row 0 alone
(docs/rows.md, column calls and declared copies). With a bug injected every rank is captured and
written.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refine.exporters.errors import ExportError
from refine.exporters.strategies.pipeline import PIPELINE_BUGS, LlamaStage, PipelineBug, pipeline_bug

DIMS = ("pp", "dp", "cp", "tp")  # torchtitan's ParallelDims order, TP innermost


@dataclass(frozen=True)
class MeshShape:
    """The sizes of a PP x DP x CP x TP mesh and its rank arithmetic (module doc)."""

    pp: int
    tp: int
    dp: int = 1
    cp: int = 1

    def size(self, dim: str) -> int:
        return int(getattr(self, dim))

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh's dims: pp and tp always, dp and cp where they split anything."""
        return tuple(d for d in DIMS if d in ("pp", "tp") or self.size(d) > 1)

    @property
    def world(self) -> int:
        return prod(self.size(d) for d in DIMS)

    def json(self) -> dict[str, Any]:
        """refine.json's `mesh`."""
        return {"shape": [self.size(d) for d in self.dims], "dims": list(self.dims)}

    def coordinates(self, rank: int) -> dict[str, int]:
        """{dim: coordinate} of global rank `rank` over all four dims (row-major, TP fastest)."""
        out: dict[str, int] = {}
        for dim in reversed(DIMS):
            rank, out[dim] = divmod(rank, self.size(dim))
        return {d: out[d] for d in DIMS}

    def rank(self, coords: dict[str, int]) -> int:
        """The global rank at `coords` (every dim)."""
        r = 0
        for dim in DIMS:
            r = r * self.size(dim) + coords[dim]
        return r

    def line(self, rank: int, *along: str) -> list[int]:
        """The ranks that differ from `rank` only along the dims `along`, in row-major order."""
        coords = self.coordinates(rank)
        free = [d for d in DIMS if d in along]
        out = [coords]
        for dim in free:
            out = [{**c, dim: k} for c in out for k in range(self.size(dim))]
        return sorted(self.rank(c) for c in out)

    def lines(self, *along: str) -> list[list[int]]:
        """Every line along `along`, each once, ordered by its first rank."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world):
            line = self.line(r, *along)
            seen.setdefault(line[0], line)
        return [seen[k] for k in sorted(seen)]

    def words(self) -> str:
        return " x ".join(f"{d.upper()} {self.size(d)}" for d in DIMS if d in self.dims)


@dataclass(frozen=True)
class MeshBug:
    """One injected mistake of a pipeline mesh's training step that needs more than the pipeline:
    in the data group's reductions (exporters/capture/pipeline_step.py reads its name) or inside a
    stage (ContextLlamaStage and pipeline_mesh_train's plan read it). `where` and `needs` word the
    refusal when the mesh lacks what `fits` asks for."""

    name: str
    title: str
    bug_class: int
    where: str
    needs: str
    fits: Callable[[MeshShape], bool]


def _data_group_bug(name: str, title: str, bug_class: int) -> MeshBug:
    return MeshBug(name, title, bug_class, "the reductions over the data group", "--dp or --cp",
                   lambda mesh: mesh.dp * mesh.cp > 1)


def _context_bug(name: str, title: str, bug_class: int) -> MeshBug:
    return MeshBug(name, title, bug_class, "the context parallel attention", "--cp", lambda mesh: mesh.cp > 1)


MESH_BUGS: dict[str, MeshBug] = {
    b.name: b for b in (
        _data_group_bug("mesh_grad_avg", "the gradients are all-reduced with avg over the data group (dp x cp) "
                        "after the loss was normalised by the whole batch's token count: each gradient is the sum "
                        "over the group's size", 14),
        _data_group_bug("mesh_local_token_count", "each rank divides its loss by its own tokens' count, not by the "
                        "count all-reduced over the data group (dp x cp)", 10),
        MeshBug("mesh_tp_reduce_missing", "the last stage's first layer leaves its attention output projection's "
                "row-parallel all-reduce out: each TP rank adds its partial sum to the residual", 1,
                "the tensor parallel layers", "--tp", lambda mesh: mesh.tp > 1),
        MeshBug("mesh_cp_gather_over_dp", "each attention all-gathers its keys and values over the dp line of the "
                "mesh instead of the cp line (the same size): a rank attends to another DP row's sequence chunk", 11,
                "the context parallel attention", "--cp and --dp of the same size",
                lambda mesh: mesh.dp == mesh.cp > 1),
        _context_bug("mesh_cp_positions_not_offset", "every CP rank numbers its rotary positions from 0, not from "
                     "its sequence chunk's start", 9),
    )
}


def mesh_bug(name: str, micro_batches: int, mesh: MeshShape) -> PipelineBug | MeshBug:
    """The training-step bug `name`: a mesh bug (the mesh must have what it needs), else a pipeline
    bug (refine.exporters.strategies.pipeline.PIPELINE_BUGS); an ExportError otherwise."""
    if name in MESH_BUGS:
        bug = MESH_BUGS[name]
        if not bug.fits(mesh):
            raise ExportError(f"bug {name!r} is in {bug.where}: pass {bug.needs}")
        return bug
    if name not in PIPELINE_BUGS:
        raise ExportError(f"unknown pipeline mesh bug {name!r} (known: {', '.join([*PIPELINE_BUGS, *MESH_BUGS])})")
    return pipeline_bug(name, micro_batches, mesh.tp, train=True)


def validate_mesh_shape(model: str, config_seq_len: int, batch: int, mesh: MeshShape, micro_batches: int) -> None:
    """An ExportError naming the first clash of the extra dims with the model and its batch."""
    if mesh.dp < 1 or mesh.cp < 1:
        raise ExportError(f"--dp and --cp must be at least 1, got {mesh.dp} and {mesh.cp}")
    if batch % (mesh.dp * micro_batches):
        raise ExportError(f"DP {mesh.dp} x {micro_batches} micro-batch(es) does not divide the batch {batch}: "
                          "pass --batch")
    if mesh.cp > 1 and model != "llama":
        raise ExportError(f"--cp with --pp exports llama only (RoPE positions per sequence slice), not {model}")
    if config_seq_len % mesh.cp:
        raise ExportError(f"CP {mesh.cp} does not divide the sequence length {config_seq_len}")


def new_groups(mesh: MeshShape, rank: int, *along: str, ends: bool = False) -> Any:
    """This rank's process group along `along` (with `ends`, of the first and last rank of its line
    only: a rank between them gets the group it is not a member of). Only this rank's own line's
    group is made: each capture runs one rank in its own (fake) process group and reads a group's
    members, never its name, so making every line's group (world-size many calls per captured rank
    at 16,384 ranks) buys nothing."""
    line = mesh.line(rank, *along)
    return dist.new_group([line[0], line[-1]] if ends else line)


def rank_inputs(mesh: MeshShape, rank: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A rank's piece of the [batch, sequence] inputs: its DP batch rows, its CP sequence slice."""
    c = mesh.coordinates(rank)
    rows, cols = tensors[0].shape[0] // mesh.dp, tensors[0].shape[1] // mesh.cp
    return tuple(t[c["dp"] * rows:(c["dp"] + 1) * rows, c["cp"] * cols:(c["cp"] + 1) * cols].contiguous()
                 for t in tensors)


class MeshPeers:
    """Mixed into a pipeline stage (exporters/strategies/pipeline.py) on a 4-D mesh: its sends and
    receives go to the same (dp, cp, tp) position of the neighbouring stage."""

    mesh: MeshShape
    global_rank: int
    send_shift: int
    stage: int

    def peer(self, stage: int) -> int:
        coords = self.mesh.coordinates(self.global_rank)
        shift = self.send_shift if stage > self.stage else 0  # the pp_wrong_tp_peer twin
        return self.mesh.rank({**coords, "pp": stage, "tp": (coords["tp"] + shift) % self.mesh.tp})


class ContextLlamaStage(LlamaStage):
    """A Llama stage under context parallelism: each held layer's attention is
    LlamaCausalAttention over the CP group (its keys and values all-gathered, the causal mask
    offset by the slice's start), the rotary tables those of the slice's positions."""

    def __init__(self, full: nn.Module, stage: int, stages: int, micro_batches: int, bug: PipelineBug | None,
                 tp: int, tp_rank: int, *, cp: int, cp_rank: int, cp_group: Any) -> None:
        from refine.exporters.strategies.context_llama import LlamaCausalAttention

        super().__init__(full, stage, stages, micro_batches, bug, tp, tp_rank)
        self.cp, self.cp_rank = cp, cp_rank
        for i in self.blocks:
            layer = self.model.layers[i]
            layer.self_attn = LlamaCausalAttention(layer.self_attn, cp_rank, cp, None, differentiable=True,
                                                   group=cp_group)

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]  # this rank's tokens
        start = 0 if self.bug is not None and self.bug.name == "mesh_cp_positions_not_offset" else self.cp_rank * s  # BUG
        positions = torch.arange(start, start + s, device=x.device)
        embeddings = self.model.rotary_emb(x, positions.unsqueeze(0))  # RoPE tables of the slice's positions
        for i in self.blocks:
            x = self.model.layers[i](x, position_embeddings=embeddings)
        return x


def sequential_model(model: str, full: nn.Module, mesh: MeshShape) -> nn.Module:
    """The sequential model the ranks refine: the zoo model, or with CP its CausalLlama (the same
    modules and FQNs; the causal mask the CP attention offsets)."""
    if mesh.cp == 1:
        return full
    from refine.exporters.strategies.context_llama import CausalLlama

    return CausalLlama(full)
