"""A torchtitan pipeline stage's training step (`--framework torchtitan --pp N --train`).

torchtitan's trainer runs pipeline parallelism through torch's schedules
(`pp_forward_backward_step`): each rank holds one model chunk (`pipeline_llm`'s split, made by
exporters/frameworks/torchtitan.py `pipeline_part`), the batch is cut into micro-batches, the
last stage computes each micro-batch's loss with the trainer's loss function over the step's
global count of valid tokens (`loss_fn(pred, labels, global_valid_tokens)`: the local sum over the
global count, so the micro-batches' losses add up to the step's), and the step's loss is their sum.

torch's schedules run their sends and receives through torch.distributed's point-to-point calls,
which cannot be traced; the step is therefore the one exporters/capture/pipeline_step.py writes out
(the same micro-batch cut, forwards, sends, per-segment backwards and gradient sums, in GPipe or
1F1B order), with torchtitan's own code where the model and the loss are: the chunk's forward is
torchtitan's `Decoder.forward` (which skips the modules the split removed: the first stage embeds
the tokens, the last applies the norm and the output projection), and the loss is torchtitan's
`CrossEntropyLoss`. The order of the calls does not change any value; torch's 1F1B posts its
sends and receives together, where refine's 1F1B receives before it sends (no deadlock either way).
"""

from __future__ import annotations

from typing import Any

import torch

from refine.exporters.capture.pipeline_step import PipelineTrainStep, keep_step_frames, step_class
from refine.exporters.errors import ExportError


def local(t: torch.Tensor) -> torch.Tensor:
    """What a pipeline stage sends of its output (torch's PipelineStage: `to_local_if_dtensor`)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def residual_stream(model_cfg: Any) -> Any:
    """The SpmdLayout of the activations between decoder blocks: the embedding's output as
    torchtitan's sharding config redistributes it (None where it sets none)."""
    sharding = getattr(model_cfg.tok_embeddings, "sharding_config", None)
    return None if sharding is None else sharding.out_dst_shardings


def trainer_input(tokens: torch.Tensor, dims: Any) -> torch.Tensor:
    """The token ids as the trainer hands them to the model: under full_dtensor a DTensor
    (`post_dataloading_process`: `full_dtensor.parallelize_inputs`), else themselves."""
    if dims.spmd_backend != "full_dtensor":
        return tokens
    from torchtitan.distributed import full_dtensor

    return full_dtensor.parallelize_inputs(dims, tokens, tokens, {})[0]


def as_stage_input(received: torch.Tensor, stream: Any, dims: Any) -> torch.Tensor:
    """A received activation as torch's PipelineStage hands it to the stage: under full_dtensor the
    DTensor it rebuilds from the sender's metadata (`DTensor.from_local` on the stage's own mesh
    with the sender's output placements: those of the decoder's residual stream, `stream`, the
    layout torchtitan's config gives the embedding's output, `out_dst_shardings`, which every block
    keeps); under spmd_types (or with no such layout) the plain tensor."""
    if dims.spmd_backend != "full_dtensor" or stream is None:
        return received
    from torch.distributed.tensor import DTensor
    from torchtitan.protocols.sharding import resolve_placements

    mesh = dims.resolve_shared_mesh([stream])
    return received if mesh is None else DTensor.from_local(received, mesh, resolve_placements(stream, mesh),
                                                           run_check=False)


SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe"}  # torchtitan's schedule names -> refine's orders


class TorchtitanStage:
    """The parts of a torchtitan model chunk as exporters/capture/pipeline_step.py runs them: the chunk's
    own forward does it all (embedding on the first stage, norm and output on the last), so
    `embed` and `head` pass their input through."""

    chunk_class: type[torch.nn.Module]
    loss_fn: Any
    peers: list[int]  # stage -> the global rank of this rank's partner there (torchtitan's pp mesh)

    def forward(self, tokens: torch.Tensor, part: str) -> torch.Tensor:
        """(PipelineTrainStep's, its first argument named as torchtitan's forward names the token
        ids: the programs' input names.)"""
        return PipelineTrainStep.forward(self, tokens, part)  # type: ignore[arg-type]

    dims: Any  # torchtitan's ParallelDims: under full_dtensor the stage boundary carries DTensors
    stream: Any  # the residual stream's SpmdLayout (a received activation's placements)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return trainer_input(tokens, self.dims)

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        if not self.first:  # type: ignore[attr-defined]
            x = as_stage_input(x, self.stream, self.dims)
        return self.chunk_class.forward(self, x)  # type: ignore[arg-type]

    def _send_on(self, x: torch.Tensor) -> torch.Tensor:
        """(PipelineStage sends a DTensor's local tensor.)"""
        return PipelineTrainStep._send_on(self, local(x))  # type: ignore[arg-type]

    def _receive_grad(self, sent: torch.Tensor) -> torch.Tensor:
        """(PipelineStage receives a DTensor's gradient as its local tensor.)"""
        return PipelineTrainStep._receive_grad(self, local(sent))  # type: ignore[arg-type]

    def _as_seed(self, received: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """(... and rebuilds the DTensor with the output's placements.)"""
        from torch.distributed.tensor import DTensor

        if not isinstance(end, DTensor):
            return received
        return DTensor.from_local(received, end.device_mesh, end.placements, run_check=False, shape=end.shape,
                                  stride=end.stride())

    def head(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def peer(self, stage: int) -> int:
        """The global rank of this rank's partner on stage `stage` (its place on torchtitan's pp mesh)."""
        return self.peers[stage]

    def _loss_share(self, logits: torch.Tensor, labels: torch.Tensor, all_labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as torchtitan's trainer computes it under PP: its tokens' summed
        cross-entropy over the step's count of valid tokens (`global_valid_tokens`)."""
        from torchtitan.components.loss import IGNORE_INDEX

        from torch.distributed.tensor import DTensor

        counted = all_labels
        if self._bug("pp_loss_micro_batch_tokens"):  # type: ignore[attr-defined]
            counted = labels  # BUG: the micro-batch's own count of valid tokens, not the step's
        loss, _ = self.loss_fn(logits, trainer_input(labels, self.dims), (counted != IGNORE_INDEX).sum())
        return loss.full_tensor() if isinstance(loss, DTensor) else loss


keep_step_frames(TorchtitanStage.run_blocks, TorchtitanStage._loss_share)


def pipeline_train_step(part: torch.nn.Module, stage: int, peers: list[int], micro_batches: int, dim: int,
                        vocab_size: int, schedule: str, bug: Any = None, seq_parts: int = 1, dims: Any = None,
                        stream: Any = None) -> None:
    """Make `part` (stage `stage`'s chunk) run its stage's training step (module doc) when
    exporters/capture/train.py traces it, with the twin `bug` (exporters/frameworks/torchtitan_bugs.py)
    if it is a pipeline one."""
    from torchtitan.components.loss import CrossEntropyLoss

    if schedule not in SCHEDULES:
        raise ExportError(f"--framework torchtitan --pp --train: torchtitan's {schedule} schedule is not supported "
                          f"yet (one of {', '.join(SCHEDULES)})")
    chunk_class = type(part)
    dtype = next(p.dtype for p in part.parameters())
    part.__class__ = step_class(chunk_class, TorchtitanStage)
    part.chunk_class = chunk_class  # type: ignore[assignment]
    part.loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab_size).build()  # type: ignore[assignment]
    part.stage, part.stages, part.micro_batches = stage, len(peers), micro_batches  # type: ignore[assignment]
    part.peers = peers  # type: ignore[assignment]
    part.dims, part.stream = dims, stream  # type: ignore[assignment]
    part.first, part.last = stage == 0, stage == len(peers) - 1  # type: ignore[assignment]
    part.hidden, part.act_dtype, part.seq_parts = dim, dtype, seq_parts  # type: ignore[assignment]
    part.bug = bug if bug is not None and bug.pp else None  # type: ignore[assignment]
    part.schedule, part.tied, part.embedding_group = SCHEDULES[schedule], (), None  # type: ignore[assignment]
