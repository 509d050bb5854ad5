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

The sequential program is the zoo model's training step (exporters/train.py): token
cross-entropy, mean over the counted tokens. Example labels ignore some tokens, unevenly
between the ranks, and refine.json declares that labels may take `IGNORE_INDEX`, so that
both `--check` and refine's counterexamples meet a batch whose ranks count differently.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from exporters.configs import ZooConfig, check_plan, zoo_config
from exporters.errors import ExportError, named_bug

if TYPE_CHECKING:
    from exporters.api import ExportResult

DP_MODELS = ("gpt2", "llama", "qwen2")
BATCH_AXIS = 0
IGNORE_INDEX = -100  # torch's cross-entropy default: a label that does not count


@dataclass(frozen=True)
class DataParallelBug:
    """One injected data-parallel mistake."""

    name: str
    bug_class: int
    title: str


DATA_PARALLEL_BUGS: dict[str, DataParallelBug] = {
    b.name: b for b in (
        DataParallelBug("dp_local_token_count", 10, "every rank normalises its loss by its own token count and the "
                        "gradients are averaged (right only when every rank counts the same number of tokens)"),
        DataParallelBug("dp_grad_avg", 14, "gradients all-reduced with avg although the loss is already normalised "
                        "by the global token count (an extra 1/DP)"),
        DataParallelBug("dp_grad_not_reduced", 4, "gradients not all-reduced across the data-parallel ranks"),
    )
}


def data_parallel_bug(name: str | None) -> DataParallelBug | None:
    """The bug named `name` (None for none); an ExportError for an unknown name."""
    return None if name is None else named_bug(DATA_PARALLEL_BUGS, name, "data-parallel")


def validate_data_parallel(model: str, config: str, dp: int, *, layers: int | None = None, train: bool = True,
                           bug: str | None = None) -> ZooConfig:
    """The config, if `dp` ranks split its batch evenly; an ExportError naming the clash otherwise."""
    cfg = zoo_config(model, config, layers)
    data_parallel_bug(bug)
    if bug is not None and not train:
        raise ExportError(f"data-parallel bug {bug!r} is in the training step: pass --train")
    check_plan("data parallelism", DP_MODELS, model, dp, "DP", cfg.batch, "batch", config)
    return cfg


class DataParallelStep:
    """A rank's training step, mixed into the zoo model's own class (so that parameters keep their
    sequential FQNs): the replica's loss share, and its gradients reduced over the group.

    `computes_loss` and the `finalize_*` hooks are how exporters/train.py traces a step whose
    loss and gradients are not the plain mean and autograd's gradients."""

    computes_loss = True
    bug: DataParallelBug | None = None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input_ids)  # type: ignore[misc]  # the zoo model's forward
        flat_logits, flat_labels = logits.flatten(0, -2).float(), labels.flatten()
        if self._bug("dp_local_token_count"):
            return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
        total = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        counted = (flat_labels != IGNORE_INDEX).sum()
        return total / funcol.all_reduce(counted, "sum", dist.group.WORLD)

    def finalize_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(loss, "avg" if self._bug("dp_local_token_count") else "sum", dist.group.WORLD)

    def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._bug("dp_grad_not_reduced"):
            return grads
        op = "avg" if self._bug("dp_local_token_count") or self._bug("dp_grad_avg") else "sum"
        return {fqn: funcol.all_reduce(g, op, dist.group.WORLD) for fqn, g in grads.items()}

    def _bug(self, name: str) -> bool:
        return self.bug is not None and self.bug.name == name


@functools.cache
def _step_class(model_class: type[nn.Module]) -> type[nn.Module]:
    return type(f"DataParallel{model_class.__name__}", (DataParallelStep, model_class), {})


def rank_module(model: str, config: str, seed: int, rank: int, *, layers: int | None = None, meta: bool = False,
                train: bool = True, bug: DataParallelBug | None = None) -> nn.Module:
    """Rank `rank`'s replica of the zoo model built from `seed` (the sequential weights), as a
    data-parallel step with `train`; every replica is the same program (its batch slice is its input)."""
    from exporters import zoo

    del rank
    replica = zoo.build(model, config, seed, layers=layers, meta=meta)
    if train:
        replica.__class__ = _step_class(type(replica))
        replica.bug = bug
    return replica.eval()


def example_labels(labels: torch.Tensor, dp: int) -> torch.Tensor:
    """`labels` with some tokens ignored, a different number on each rank's batch slice (rank d
    of D ignores d + 1 tokens of its first row), so that per-rank token counts differ."""
    labels = labels.clone()
    rows = labels.shape[BATCH_AXIS] // dp
    for d in range(dp):
        labels[d * rows, : min(d + 1, labels.shape[1] - 1)] = IGNORE_INDEX
    return labels


def export_data_parallel(
    model: str,
    config: str,
    dp: int,
    out: Path | str,
    seed: int = 0,
    *,
    train: bool = True,
    bug: str | None = None,
    meta: bool = False,
    layers: int | None = None,
    flat: bool = False,
    workers: int | None = None,
) -> ExportResult:
    """Export a zoo model over `dp` data-parallel ranks (module doc) to the model directory `out`:
    one training step with `train` (the bug `bug` of DATA_PARALLEL_BUGS injected into the ranks if
    given), else the forward (each rank's logits: its batch slice). Options as in
    `exporters.export_model`."""
    from exporters import plans, zoo
    from exporters.api import bug_words, export

    cfg = validate_data_parallel(model, config, dp, layers=layers, train=train, bug=bug)
    injected = data_parallel_bug(bug)
    depth = f", {cfg.layers} layers" if layers is not None else ""
    inputs = zoo.example_inputs(model, config, seed, meta=meta, labels=train)
    batch_slice = {"layout": "shard", "axis": BATCH_AXIS}
    input_layouts = {"input_ids": batch_slice}
    if train:
        input_layouts["labels"] = {**batch_slice, "range": [0, cfg.vocab], "also": [IGNORE_INDEX]}  # ignored tokens too
        if not meta:
            inputs = (inputs[0], example_labels(inputs[1], dp))
    step = ("one training step (loss normalised by the global token count, gradients all-reduced with sum)"
            if train else "forward")
    return export(
        zoo.build(model, config, seed, layers=layers, meta=meta),
        functools.partial(rank_module, model, config, seed, layers=layers, meta=meta, train=train, bug=injected),
        inputs,
        dp,
        out,
        **({} if train else {"output_names": ["logits"], "output_layouts": {"logits": dict(batch_slice)}}),
        input_layouts=input_layouts,
        input_ranges={"input_ids": cfg.vocab, "labels": cfg.vocab} if train else {"input_ids": cfg.vocab},
        description=f"{model} config {config!r}{depth}, DP over {dp} ranks, {step}, exported by "
        "exporters/data_parallel.py" + (" (meta: no weight data)" if meta else "")
        + (bug_words(injected) if injected is not None else ""),
        # no "tp": refine/reduced.py re-exports TP recipes only
        zoo={"model": model, "config": config, "dp": dp, "seed": seed, "layers": layers, "meta": meta,
             "flat": flat, "bug": bug, "train": train},
        layers=None if flat else plans.layer_stack(model),
        workers=workers,
        train=train,
    )
