"""Data-parallel (DP) training steps of zoo models: every rank a full replica on its batch slice.

Rank d of D holds every parameter (a replica) and rows [d*B/D, (d+1)*B/D) of the batch (token
ids and labels). One training step, as Megatron-Core computes it with per-token loss
normalisation: the rank sums the token cross-entropy over its own tokens, divides by the number
of counted tokens in the WHOLE batch (its own count all-reduced with sum over the DP group:
labels equal to `IGNORE_INDEX` do not count, as in torch's cross-entropy), differentiates that,
and all-reduces every gradient with sum. The reported `loss` is the ranks' shares all-reduced
with sum. So the step equals the sequential step on the whole batch (mean over its counted
tokens), value for value, whatever labels are ignored.

The bug twins (`DATA_PARALLEL_BUGS`, BUGS.md classes 10, 14 and 4) are the classic ones: a rank
normalising by its own token count and averaging (DDP's default: right only when every rank
counts the same number of tokens), gradients averaged where the loss is already normalised
globally (an extra 1/D), gradients not reduced at all.

With `micro_batches` M > 1 the rank accumulates gradients over M micro-batches of its slice
(exporters/capture/train.py unrolls M backward passes and sums them): each micro-batch's loss is its
tokens' summed cross-entropy over the token count of the whole global batch, so the sum of the M
shares is the step's loss. Its bug twins (class 10): a micro-batch's mean over its own tokens
divided by M (right only when every micro-batch counts the same tokens), and the micro-batch
means summed without the 1/M.

The sequential program is the zoo model's training step (exporters/capture/train.py): token
cross-entropy, mean over the counted tokens. Example labels ignore some tokens, unevenly
between the ranks, and refine.json declares that labels may take `IGNORE_INDEX`, so that
both `--check` and refine's counterexamples meet a batch whose ranks count differently.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine.exporters.capture.train import IGNORE_INDEX
from refine.exporters.zoo.configs import ZooConfig, check_plan, zoo_config
from refine.exporters.errors import ExportError, named_bug

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

DP_MODELS = ("gpt2", "llama", "qwen2")
BATCH_AXIS = 0


@dataclass(frozen=True)
class DataParallelBug:
    """One injected data-parallel mistake."""

    name: str
    bug_class: int
    title: str
    min_micro_batches: int = 1
    fsdp: bool = False  # a bug of the sharded-parameter step (`fsdp`)


DATA_PARALLEL_BUGS: dict[str, DataParallelBug] = {
    b.name: b for b in (
        DataParallelBug("dp_local_token_count", 10, "every rank normalises its loss by its own token count and the "
                        "gradients are averaged (right only when every rank counts the same number of tokens)"),
        DataParallelBug("dp_grad_avg", 14, "gradients all-reduced with avg although the loss is already normalised "
                        "by the global token count (an extra 1/DP)"),
        DataParallelBug("dp_grad_not_reduced", 4, "gradients not all-reduced across the data-parallel ranks"),
        DataParallelBug("ga_local_token_count", 10, "each micro-batch's loss is the mean over its own tokens divided by "
                        "the number of micro-batches (right only when every micro-batch counts the same tokens)", 2),
        DataParallelBug("ga_sum_of_means", 10, "the micro-batches' mean losses are summed over the accumulation steps "
                        "(no 1/M: the gradients are M times too large)", 2),
        DataParallelBug("fsdp_grad_not_reduced", 4, "FSDP: the parameter all-gather's backward keeps the rank's slice "
                        "of its own gradient (no reduce-scatter: each shard's gradient covers the rank's batch slice "
                        "only)", fsdp=True),
        DataParallelBug("fsdp_grad_avg", 14, "FSDP: the gradients reduce-scattered with avg although the loss is "
                        "already normalised by the global token count (an extra 1/DP)", fsdp=True),
    )
}


def data_parallel_bug(name: str | None) -> DataParallelBug | None:
    """The bug named `name` (None for none); an ExportError for an unknown name."""
    return None if name is None else named_bug(DATA_PARALLEL_BUGS, name, "data-parallel")


def validate_data_parallel(model: str, config: str, dp: int, *, layers: int | None = None, train: bool = True,
                           bug: str | None = None, micro_batches: int = 1, batch: int | None = None,
                           fsdp: bool = False) -> ZooConfig:
    """The config (with `batch` if given), if `dp` ranks and `micro_batches` accumulation steps
    split its batch evenly (and `fsdp` comes with a training step, and its bugs with it); an
    ExportError naming the clash otherwise."""
    cfg = zoo_config(model, config, layers)
    if batch is not None:
        if batch < 1:
            raise ExportError(f"--batch must be at least 1, got {batch}")
        cfg = replace(cfg, batch=batch)
    injected = data_parallel_bug(bug)
    if (bug is not None or micro_batches > 1) and not train:
        raise ExportError("gradient accumulation and the data-parallel bugs are in the training step: pass --train")
    if micro_batches < 1:
        raise ExportError(f"--micro-batches must be at least 1, got {micro_batches}")
    if injected is not None and micro_batches < injected.min_micro_batches:
        raise ExportError(f"data-parallel bug {bug!r} needs --micro-batches {injected.min_micro_batches} or more")
    if fsdp and not train:
        raise ExportError("--fsdp shards the parameters and reduce-scatters their gradients: pass --train")
    if injected is not None and injected.fsdp != fsdp:
        raise ExportError(f"data-parallel bug {bug!r} is " + ("an FSDP step's: pass --fsdp" if injected.fsdp
                                                               else "a replicated step's: drop --fsdp"))
    check_plan("data parallelism", DP_MODELS, model, dp, "DP", cfg.batch, "batch", config,
               least=1 if micro_batches > 1 else 2)
    if (cfg.batch // dp) % micro_batches:
        raise ExportError(f"--micro-batches {micro_batches} does not divide a rank's {cfg.batch // dp} batch rows")
    return cfg


class DataParallelStep:
    """A rank's training step, mixed into the zoo model's own class (so that parameters keep their
    sequential FQNs): the replica's loss share, and its gradients reduced over the group.

    `computes_loss` and the `finalize_*` hooks are how exporters/capture/train.py traces a step whose
    loss and gradients are not the plain mean and autograd's gradients."""

    computes_loss = True
    bug: DataParallelBug | None = None
    micro_batches = 1
    fsdp = False  # parameters sharded along axis 0 at rest, all-gathered for use (unshard_params)
    group: Any = None  # the DP process group the token count and the loss are reduced over (None: the world)
    grad_group: Any = None  # the one the gradients are all-reduced over (None: `group`)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                all_labels: torch.Tensor | None = None) -> torch.Tensor:
        """The loss share of `labels`' tokens; `all_labels`: the rank's whole slice when
        `labels` is one micro-batch of it (exporters/capture/train.py)."""
        logits = super().forward(input_ids)  # type: ignore[misc]  # the zoo model's forward
        flat_logits, flat_labels = logits.flatten(0, -2).float(), labels.flatten()
        if self._bug("dp_local_token_count") or self._bug("ga_sum_of_means"):
            return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
        if self._bug("ga_local_token_count"):
            return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX) / self.micro_batches
        total = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        counted_labels = flat_labels if all_labels is None else all_labels.flatten()
        counted = (counted_labels != IGNORE_INDEX).sum()  # (an int64 count, as torch's mean counts them)
        return total / funcol.all_reduce(counted, "sum", self._group())

    def finalize_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(loss, "avg" if self._averages() else "sum", self._group())

    def unshard_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """FSDP: each parameter all-gathered from the ranks' shards; the gather's backward
        reduce-scatters the gradient (sum), so each rank gets its shard of the whole batch's."""
        if not self.fsdp:
            return params
        reduction = None if self._bug("fsdp_grad_not_reduced") else "avg" if self._bug("fsdp_grad_avg") else "sum"
        return {fqn: GatherShards.apply(_local_tensor(p), reduction) for fqn, p in params.items()}

    def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._bug("dp_grad_not_reduced") or self.fsdp:  # (FSDP: reduce-scattered by the gather's backward)
            return grads
        op = "avg" if self._averages() or self._bug("dp_grad_avg") else "sum"
        group = self.grad_group if self.grad_group is not None else self._group()
        return {fqn: funcol.all_reduce(g, op, group) for fqn, g in grads.items()}

    def _group(self) -> Any:
        """The DP group: the whole world unless the ranks also split otherwise (a TP x DP mesh's column)."""
        return self.group if self.group is not None else dist.group.WORLD

    def _averages(self) -> bool:
        """DDP's way: every rank's mean loss, averaged over the ranks."""
        return self._bug("dp_local_token_count") or self._bug("ga_local_token_count") or self._bug("ga_sum_of_means")

    def _bug(self, name: str) -> bool:
        return self.bug is not None and self.bug.name == name


class GatherShards(torch.autograd.Function):
    """FSDP's parameter all-gather (along axis 0, over the DP group); its backward reduce-scatters
    the gradient with `reduction` (sum: FSDP's), or, with None (a bug), keeps the rank's own slice
    of its own gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, reduction: str | None) -> torch.Tensor:
        ctx.reduction = reduction
        return funcol.all_gather_tensor(shard, 0, dist.group.WORLD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.reduction is None:  # BUG (fsdp_grad_not_reduced)
            return grad.chunk(dist.get_world_size())[dist.get_rank()], None
        return funcol.reduce_scatter_tensor(grad, ctx.reduction, 0, dist.group.WORLD), None


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def shard_parameters(module: nn.Module, rank: int, world: int) -> None:
    """Every parameter replaced by chunk `rank` of `world` along axis 0, as a DTensor sharded on
    a 1-D mesh of the world (so that the export declares each parameter, and its gradient, as
    `shard` axis 0); tied parameters stay tied."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    sharded: dict[int, nn.Parameter] = {}
    for fqn, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in sharded:
            local = p.detach().chunk(world, dim=0)[rank].clone()
            sharded[id(p)] = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                             shape=p.shape, stride=p.stride()))
        owner, _, leaf = fqn.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, sharded[id(p)])


def check_shardable(model: nn.Module, dp: int) -> None:
    """FSDP needs every parameter's axis 0 split evenly between the ranks."""
    for fqn, p in model.named_parameters():
        if p.dim() == 0 or p.shape[0] % dp:
            raise ExportError(f"--fsdp: parameter {fqn} of shape {list(p.shape)} cannot be split evenly between "
                              f"{dp} ranks along axis 0")


@functools.cache
def _step_class(model_class: type[nn.Module]) -> type[nn.Module]:
    return type(f"DataParallel{model_class.__name__}", (DataParallelStep, model_class), {})


def as_step(module: nn.Module, *, bug: DataParallelBug | None = None, micro_batches: int = 1, fsdp: bool = False,
            group: Any = None, grad_group: Any = None) -> nn.Module:
    """`module` (a zoo model, parallelized or not) turned, in place, into a data-parallel training
    step (DataParallelStep mixed into its class, so its parameters keep their FQNs) over the DP
    process group `group` (None: the world), its gradients all-reduced over `grad_group` (None:
    `group`)."""
    module.__class__ = _step_class(type(module))
    module.bug, module.micro_batches, module.fsdp = bug, micro_batches, fsdp  # type: ignore[assignment]
    module.group, module.grad_group = group, grad_group  # type: ignore[assignment]
    return module


def rank_module(model: str, config: str, seed: int, rank: int, *, layers: int | None = None, meta: bool = False,
                train: bool = True, micro_batches: int = 1, bug: DataParallelBug | None = None,
                fsdp: bool = False) -> nn.Module:
    """Rank `rank`'s replica of the zoo model built from `seed` (the sequential weights), as a
    data-parallel step with `train`; every replica is the same program (its batch slice is its
    input). With `fsdp` the replica holds shard `rank` of every parameter (shard_parameters)."""
    from refine.exporters.zoo import models as zoo

    replica = zoo.build(model, config, seed, layers=layers, meta=meta)
    if train:
        as_step(replica, bug=bug, micro_batches=micro_batches, fsdp=fsdp)
    if fsdp:
        shard_parameters(replica, rank, dist.get_world_size())
    return replica.eval()


def example_labels(labels: torch.Tensor, parts: int) -> torch.Tensor:
    """`labels` with some tokens ignored, a different number in each of `parts` equal row blocks
    (a rank's slice, or one micro-batch of it: block k ignores k + 1 tokens of its first row), so
    that token counts differ between ranks and micro-batches."""
    labels = labels.clone()
    rows = labels.shape[BATCH_AXIS] // parts
    for k in range(parts):
        labels[k * rows, : min(k + 1, labels.shape[1] - 1)] = IGNORE_INDEX
    return labels


def export_data_parallel(
    model: str,
    config: str,
    dp: int,
    out: Path | str,
    seed: int = 0,
    *,
    train: bool = True,
    micro_batches: int = 1,
    batch: int | None = None,
    bug: str | None = None,
    meta: bool = False,
    layers: int | None = None,
    flat: bool = False,
    workers: int | None = None,
    fsdp: bool = False,
) -> ExportResult:
    """Export a zoo model over `dp` data-parallel ranks (module doc) to the model directory `out`:
    one training step with `train`, accumulating gradients over `micro_batches` micro-batches (the
    bug `bug` of DATA_PARALLEL_BUGS injected into the ranks if given), else the forward (each
    rank's logits: its batch slice). With `fsdp` (FSDP / ZeRO-3) each rank holds shard k of every
    parameter along axis 0 and gets shard k of its gradient: the shards are all-gathered for use,
    and the gather's backward reduce-scatters the gradients. `batch` overrides the config's batch
    rows; other options as in `refine.exporters.export_model` (with accumulation or FSDP every layer is
    inline, as with `flat`)."""
    from refine.exporters.zoo import plans, models as zoo
    from refine.exporters.capture.export import bug_words, export

    cfg = validate_data_parallel(model, config, dp, layers=layers, train=train, bug=bug, micro_batches=micro_batches,
                                 batch=batch, fsdp=fsdp)
    injected = data_parallel_bug(bug)
    seq_module = zoo.build(model, config, seed, layers=layers, meta=meta)
    if fsdp:
        check_shardable(seq_module, dp)
    inline = flat or micro_batches > 1 or fsdp
    depth = f", {cfg.layers} layers" if layers is not None else ""
    inputs = zoo.example_inputs(model, config, seed, meta=meta, labels=train, batch=cfg.batch)
    batch_slice = {"layout": "shard", "axis": BATCH_AXIS}
    input_layouts = {"input_ids": batch_slice}
    if train:
        input_layouts["labels"] = {**batch_slice, "range": [0, cfg.vocab], "also": [IGNORE_INDEX]}  # ignored tokens too
        if not meta:
            inputs = (inputs[0], example_labels(inputs[1], dp * micro_batches))
    accumulation = f", gradients accumulated over {micro_batches} micro-batches" if micro_batches > 1 else ""
    reduced = "parameters sharded (FSDP), gradients reduce-scattered with sum" if fsdp else "gradients all-reduced with sum"
    step = (f"one training step (loss normalised by the global token count, {reduced}{accumulation})"
            if train else "forward")
    return export(
        seq_module,
        functools.partial(rank_module, model, config, seed, layers=layers, meta=meta, train=train,
                          micro_batches=micro_batches, bug=injected, fsdp=fsdp),
        inputs,
        dp,
        out,
        **({} if train else {"output_names": ["logits"], "output_layouts": {"logits": dict(batch_slice)}}),
        input_layouts=input_layouts,
        input_ranges={"input_ids": cfg.vocab, "labels": cfg.vocab} if train else {"input_ids": cfg.vocab},
        description=f"{model} config {config!r}{depth}, batch {cfg.batch}, DP over {dp} ranks, {step}, exported by "
        "exporters/strategies/data_parallel.py" + (" (meta: no weight data)" if meta else "")
        + (bug_words(injected) if injected is not None else ""),
        # no "tp": refine/diagnose/reduced.py re-exports TP recipes only
        zoo={"model": model, "config": config, "dp": dp, "micro_batches": micro_batches, "batch": cfg.batch,
             "seed": seed, "layers": layers, "meta": meta, "flat": inline, "bug": bug, "train": train, "fsdp": fsdp},
        # (accumulation runs each layer M times in one trace: refine.exporters.capture.layers outlines one run per
        # layer, so those exports are flat; FSDP's gathered parameters are no layer's own)
        layers=None if inline else plans.layer_stack(model),
        workers=workers,
        train=train,
        # every replica runs rank 0's program on its own batch slice; an FSDP rank holds its own
        # parameter shards (which the export reads off each rank's module)
        same_program=not fsdp,
    )
