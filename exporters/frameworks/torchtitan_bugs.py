"""torchtitan's twins: the bug catalogue of `refine export --framework torchtitan --bug NAME`.

Pure Python (no torch), so that a bad name is rejected before anything heavy is imported. What
each bug edits in torchtitan's model config is in exporters/frameworks/torchtitan.py
(`inject_module`, `inject_typing`). The twins are of the kinds torchtitan's own history shows, each
put into layer 0 through torchtitan's config objects (its sharding config, its own
`ScaledBiasRowwiseLinear`), so that a report names torchtitan's module and line:

- `sp_norm_invariant` (class 4, training step, SP): the SP norm weight typed I (invariant) on
  TP, as `norm_config` types it without SP. Under spmd_types the type says how the gradient
  relates: R's gradient is a partial sum left for the data-parallel wrapper to reduce, I's is
  complete; the ranks' gradients are partial sums, so nothing sums them.
- `rowwise_bias_invariant` (class 4, training step): `attention.wo` is torchtitan's
  `ScaledBiasRowwiseLinear` (every rank adds bias / TP: the correct variant of class 3), its bias
  typed I where `rowwise_config` types it R: each rank's bias gradient is 1/TP of the whole one.
- `rowwise_plain_bias` (class 3, forward): `attention.wo` a plain `Linear` with a bias under
  `rowwise_config`: every rank adds the whole bias to its partial sum (TP times the bias).
- `cp_positions_dropped` (class 9, forward, CP): the data loader's positions not handed to the
  model (`positions=None`, as before torchtitan's trainer sharded them with the inputs): torchtitan's
  RoPE then takes the prefix of its cache, so every rank rotates its queries and keys by positions
  0 .. S/CP - 1 instead of its own run's. Put into the ranks' forward (`trainer_forward`).
- `pp_loss_micro_batch_tokens` (class 10, training step, PP): the last stage divides each
  micro-batch's summed loss by the micro-batch's own count of valid tokens instead of the step's
  `global_valid_tokens`: M micro-batch means summed, M times the step's loss and gradients. Put
  into the stage's loss (exporters/frameworks/torchtitan_pipeline.py).
- `pp_peer_stage_leader` (class 13, PP x TP): each rank sends to and receives from the first
  global rank of the neighbouring stage (`stage * TP`, as if a stage were one rank), where its
  partner is the same TP position there (its pp group's member, read off the pp mesh): TP rank 0
  of the next stage is sent to twice and TP rank 1's receive is never matched. Put into the
  stages' peers (exporters/frameworks/torchtitan.py `build`).

- `fsdp_grad_divided` (class 14, training step, FSDP): FSDP2's gradient division
  left on, as before torchtitan's `disable_fsdp_gradient_division`: the reduce-scatter averages over
  dp_shard where the loss already divides by the global count of valid tokens, so every gradient
  is 1/DP of the step's (under CP, where FSDP shards over cp too, 1/CP). Put into the FSDP
  emulation's reduce-scatter (exporters/frameworks/torchtitan_fsdp.py).

- `moe_experts_output_replicate` (class 1, forward, Qwen3-MoE): the routed experts' `local_map`
  output typed R on TP where `_routed_experts_sharding_configs` types it P. Each rank holds a
  slice of every expert's hidden units, so its combined rows are a partial sum; typed R, nothing
  sums them.
- `moe_router_grad_invariant` (class 4, training step, Qwen3-MoE): the router gate's weight typed I
  on TP where `_router_sharding_config` types it R. The experts' hidden units are split over TP, so
  each rank's gradient of the routing scores, and of the gate weight, is a partial sum; typed I it
  is taken as complete (the MoE router gradient left unreduced: issue 41's list of torchtitan's
  history).

The TP twins also apply inside the stages of a PP x TP export (`--pp 2 --tp 2`).

`rowwise_scaled_bias` is the correct variant the last two are twins of (bias / TP on every rank,
typed R): it must verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from refine.exporters.errors import ExportError


@dataclass(frozen=True)
class TorchtitanBug:
    """A twin of torchtitan's Llama 3 plan: its name, what goes wrong, its class in docs/bugs.md
    (None: a correct variant), and what it needs (a training step, sequence parallelism)."""

    name: str
    title: str
    bug_class: int | None
    train: bool = False  # shows only in a training step
    sp: bool = False  # needs --sp
    cp: bool = False  # needs --cp (and no other plan has it)
    pp: bool = False  # needs --pp (and no other plan has it)
    tp: bool = False  # needs --tp 2 or more (with --pp: its stages of TP ranks)
    moe: bool = False  # needs --model qwen3_moe (and no other model has it)
    tp_experts: bool = False  # needs the experts over TP (no --ep: under EP each rank holds whole experts)
    fsdp: bool = False  # needs --dp N --fsdp (and no other plan has it)
    backends: tuple[str, ...] = ("spmd_types",)
    kind: ClassVar[str] = "torchtitan"


BUGS: dict[str, TorchtitanBug] = {b.name: b for b in (
    TorchtitanBug("sp_norm_invariant", "layer 0's attention_norm weight typed I (invariant) on TP under sequence "
                  "parallelism: its gradient, a partial sum on each rank, is taken as complete", 4, train=True, sp=True),
    TorchtitanBug("rowwise_bias_invariant", "layer 0's attention.wo is ScaledBiasRowwiseLinear (bias / TP on every "
                  "rank) with its bias typed I on TP: each rank's bias gradient is 1/TP of the whole one", 4, train=True),
    TorchtitanBug("rowwise_plain_bias", "layer 0's attention.wo is a plain Linear with a bias under rowwise_config: "
                  "every rank adds the whole bias to its partial sum", 3),
    TorchtitanBug("cp_positions_dropped", "the ranks' forward is not handed the token positions under context "
                  "parallelism: every rank rotates its queries and keys by positions 0 .. S/CP - 1", 9, cp=True),
    TorchtitanBug("pp_loss_micro_batch_tokens", "the last pipeline stage divides each micro-batch's summed loss by "
                  "the micro-batch's own count of valid tokens, not the step's: the step's loss is the sum of the "
                  "micro-batches' means", 10, train=True, pp=True),
    TorchtitanBug("pp_peer_stage_leader", "each rank sends to and receives from the neighbouring stage's first "
                  "global rank (stage * TP), not the same TP position there: that rank is sent to twice, the others "
                  "wait", 13, pp=True, tp=True),
    TorchtitanBug("moe_experts_output_replicate", "layer 0's routed experts' output typed R (replicate) on TP, "
                  "not P: each rank's combined rows, a partial sum over its slice of every expert, are taken as "
                  "whole", 1, moe=True, tp_experts=True),
    TorchtitanBug("fsdp_grad_divided", "FSDP's gradient division left on (no disable_fsdp_gradient_division): "
                  "each reduce-scattered gradient divided by the dp_shard size, on top of the loss's division by "
                  "the global token count", 14, train=True, fsdp=True, backends=("spmd_types", "full_dtensor")),
    TorchtitanBug("moe_router_grad_invariant", "layer 0's MoE router gate weight typed I (invariant) on TP where "
                  "torchtitan's _router_sharding_config types it R: its gradient, a partial sum on each rank (the "
                  "experts' hidden units split over TP), is taken as complete", 4, train=True, moe=True),
    TorchtitanBug("rowwise_scaled_bias", "layer 0's attention.wo is ScaledBiasRowwiseLinear, its bias typed R as "
                  "rowwise_config types it (bias / TP on every rank)", None),
)}


def torchtitan_bug(name: str, *, sp: bool, train: bool, backend: str, cp: int = 1, pp: int = 1,
                   tp: int = 1, model: str = "llama3", fsdp: int = 1, ep: int = 1) -> TorchtitanBug:
    """The bug `name`, if it applies to this export; an ExportError saying why not otherwise."""
    if name not in BUGS:
        raise ExportError(f"unknown torchtitan bug {name!r} (known: {', '.join(BUGS)})")
    bug = BUGS[name]
    if bug.moe != (model == "qwen3_moe"):
        raise ExportError(f"torchtitan bug {name!r} is " + ("an MoE one: pass --model qwen3_moe --tp 2" if bug.moe
                                                             else "Llama 3's: drop --model qwen3_moe"))
    if bug.train and not train:
        raise ExportError(f"torchtitan bug {name!r} shows in the backward only: pass --train")
    if bug.tp_experts and ep > 1:
        raise ExportError(f"torchtitan bug {name!r} is about the experts split over TP: drop --ep")
    sharded = fsdp > 1 or (cp > 1 and backend == "full_dtensor")  # (full_dtensor shards over cp with FSDP too)
    if bug.fsdp != sharded:
        raise ExportError(f"torchtitan bug {name!r} is " + ("an FSDP one: pass --dp 2 --fsdp --train (or --cp 2 "
                                                             "--backend full_dtensor --train)" if bug.fsdp
                                                             else "not an FSDP one: drop --fsdp"))
    if bug.sp and not sp:
        raise ExportError(f"torchtitan bug {name!r} is a sequence-parallel one: pass --sp")
    if bug.cp != (cp > 1) and not bug.fsdp:  # (an FSDP bug shows wherever FSDP shards, over cp too)
        raise ExportError(f"torchtitan bug {name!r} is " + ("a context-parallel one: pass --cp 2" if bug.cp
                                                             else "a TP plan's: drop --cp"))
    if bug.pp and pp == 1:
        raise ExportError(f"torchtitan bug {name!r} is a pipeline one: pass --pp 2 --micro-batches 2")
    if not bug.pp and pp > 1 and tp == 1:
        raise ExportError(f"torchtitan bug {name!r} is not a pipeline one: drop --pp, or pass --tp 2 to put it into "
                          "the stages' TP ranks")
    if bug.tp and tp == 1:
        raise ExportError(f"torchtitan bug {name!r} needs TP ranks inside the stages: pass --tp 2")
    if backend not in bug.backends:
        raise ExportError(f"torchtitan bug {name!r} is written for the {', '.join(bug.backends)} backend")
    return bug


