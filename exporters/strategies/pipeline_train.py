"""Pipeline-parallel (PP) training steps of zoo models: GPipe or 1F1B order, backward per micro-batch.

The stages are exporters/strategies/pipeline.py's (stage s of P holds a balanced contiguous split of the
layers; the first also embeds, the last applies the final norm and the LM head; GPT-2's tied
embedding is held by the first and the last stage). One training step, GPipe order:

- forward: for each of the M micro-batches (batch chunks), stage 0 embeds it, every stage runs
  its blocks on what it got and sends the activations on (`dist.Send` / `dist.Recv`); the last
  stage applies the head and computes the micro-batch's loss share: its tokens' summed
  cross-entropy over the number of counted tokens of the WHOLE batch (labels equal to
  IGNORE_INDEX do not count; the last stage holds every label), so the M shares add up to the
  sequential step's loss (mean over the batch's counted tokens), whatever tokens are ignored;
- backward: for each micro-batch in the same order, the last stage differentiates its loss share
  through its layers and sends the gradient of its input (what it received) to the previous
  stage, which receives it and backpropagates it through its own layers, and so on to stage 0;
  every stage adds up its parameter gradients over the micro-batches;
- the tied embedding (GPT-2's wte = lm_head): stage 0 holds the gradient through the embedding
  lookup, the last stage the gradient through the LM head; both all-reduce it with sum over the
  embedding group {first stage, last stage} (Megatron's embedding group), so each holds the whole
  gradient of the one sequential parameter.

Outputs: `loss` on the last stage, `grad.<fqn>` for each parameter a stage holds (refine.json:
a replica on the stages that hold it), and the values each stage sends (`sent.K` forward,
`sent_grad.K` backward; outputs so that the sends stay in the program, exporters/capture/collectives.py)
and the gradients it receives (`received_grad.K`: so that a receive stays in the program, as the
real job posts it, even where a bug leaves its value unused).

How it is traced: exporters/capture/train.py's make_fx over eager autograd (trace_step), the stage
running its own step (its `training_step` hook). The point-to-point custom ops have no
autograd, so a stage's backward is written per segment: one `torch.autograd.grad` per
micro-batch over the stage's layers (from its loss share on the last stage, else from the
received output gradient), with the Send / Recv between segments placed by hand.

Bug twins (exporters/strategies/pipeline.py PIPELINE_BUGS with `train`, docs/bugs.md class 13):
`pp_tied_grad_not_reduced` (the embedding group's all-reduce left out), `pp_grad_not_accumulated`
(only the last micro-batch's parameter gradients kept), `pp_loss_not_scaled` (each micro-batch's
loss the mean over its own tokens: the sum over micro-batches M times the sequential mean),
`pp_1f1b_send_first` (1F1B's steady state sending before receiving: a deadlock).

Schedules (`schedule`): GPipe (above), or 1F1B (`order="1f1b"`, `--schedule 1f1b`): each stage
runs a few forwards ahead, then alternates one forward and one backward.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from refine.exporters.capture.pipeline_step import SCHEDULES, keep_step_frames, step_class
from refine.exporters.capture.pipeline_step import schedule as schedule  # (re-exported: its order is tested here)
from refine.exporters.strategies.data_parallel import IGNORE_INDEX, example_labels
from refine.exporters.errors import ExportError
from refine.exporters.strategies.pipeline import GPT2Stage, LlamaStage, PipelineBug, pipeline_bug, stage_layers, validate_pipeline

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult



keep_step_frames(GPT2Stage.embed, GPT2Stage.run_blocks, GPT2Stage.head, LlamaStage.embed, LlamaStage.run_blocks,
                 LlamaStage.head)


def tied_parameters(model: nn.Module) -> set[str]:
    """The parameters of `model` under more than one name (a tied embedding and LM head), each by
    its first name (named_parameters'); a pipeline holds them on its first and last stage."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return {aliases[0] for aliases in names.values() if len(aliases) > 1}


def embedding_group(stages: int) -> Any:
    """The process group of the first and the last stage (the ranks holding the tied embedding):
    the world with two stages."""
    return dist.group.WORLD if stages == 2 else dist.new_group([0, stages - 1])


def stage_train_module(model: str, config: str, seed: int, stage: int, stages: int, micro_batches: int, *,
                       layers: int | None = None, bug: PipelineBug | None = None, order: str = "gpipe") -> nn.Module:
    """Stage `stage`'s training step (module doc) of the zoo model built from `seed`."""
    from refine.exporters.zoo import models as zoo

    full = zoo.build(model, config, seed, layers=layers)
    stage_class = GPT2Stage if model == "gpt2" else LlamaStage
    module = stage_class(full, stage, stages, micro_batches, bug)
    group = embedding_group(stages)  # (every rank makes the group, as torch.distributed requires)
    module.__class__ = step_class(stage_class)
    module.bug = bug  # type: ignore[assignment]
    module.schedule = order  # type: ignore[assignment]
    module.tied = tuple(fqn for fqn in dict(module.named_parameters()) if fqn in tied_parameters(full))  # type: ignore[assignment]
    module.embedding_group = group if module.tied else None  # type: ignore[assignment]
    return module.eval()


def export_pipeline_train(
    model: str,
    config: str,
    pp: int,
    micro_batches: int,
    out: Path | str,
    seed: int = 0,
    *,
    layers: int | None = None,
    bug: str | None = None,
    workers: int | None = None,
    order: str = "gpipe",
) -> ExportResult:
    """Export one training step of a zoo model as `pp` pipeline stages running `micro_batches`
    micro-batches in `order` (`schedule`: gpipe or 1f1b) to the model directory `out`, with the
    pipeline training bug `bug` injected into the stages if given. Every layer is inline."""
    from refine.exporters.zoo import models as zoo
    from refine.exporters.capture.export import bug_words, export

    if order not in SCHEDULES:
        raise ExportError(f"unknown pipeline schedule {order!r}: one of {', '.join(SCHEDULES)}")
    if bug == "pp_1f1b_send_first" and order != "1f1b":
        raise ExportError("pipeline bug 'pp_1f1b_send_first' is a 1F1B bug: pass --schedule 1f1b")
    cfg = validate_pipeline(model, config, pp, micro_batches, layers=layers, bug=bug, train=True)
    injected = pipeline_bug(bug, micro_batches, train=True) if bug is not None else None
    depth = f", {cfg.layers} layers" if layers is not None else ""
    split = ", ".join(f"{r.start}..{r.stop - 1}" for r in stage_layers(cfg.layers, pp))
    input_ids, labels = zoo.example_inputs(model, config, seed, labels=True)
    labels = example_labels(labels, micro_batches)  # some tokens ignored, unevenly between micro-batches
    return export(
        zoo.build(model, config, seed, layers=layers),
        functools.partial(stage_train_module, model, config, seed, stages=pp, micro_batches=micro_batches,
                          layers=layers, bug=injected, order=order),  # rank -> its stage
        (input_ids, labels),
        pp,
        out,
        # labels may take the ignore index, so that counterexamples meet micro-batches that count differently
        input_layouts={"labels": {"layout": "rep", "range": [0, cfg.vocab], "also": [IGNORE_INDEX]}},
        input_ranges={"input_ids": cfg.vocab, "labels": cfg.vocab},
        description=f"{model} config {config!r}{depth}, PP over {pp} stages (layers {split}), {micro_batches} "
        f"micro-batch{'es' if micro_batches > 1 else ''} in {'GPipe' if order == 'gpipe' else '1F1B'} order, one training step (loss normalised by the "
        "batch's token count, gradients accumulated over the micro-batches"
        + (", the tied embedding's all-reduced over the first and last stage" if model == "gpt2" else "")
        + "), exported by `refine export`" + (bug_words(injected) if injected is not None else ""),
        zoo={"model": model, "config": config, "pp": pp, "micro_batches": micro_batches, "seed": seed,
             "layers": layers, "meta": False, "flat": True, "bug": bug, "train": True,
             **({"schedule": order} if order != "gpipe" else {})},
        layers=None,
        workers=workers,
        train=True,
    )
