"""Context-parallel (CP) exports, GPT-2's (exporters/strategies/context.py) and Llama's
(exporters/strategies/context_llama.py) alike: the sequential and rank models of each variant and
`export_context_parallel`, which writes the model directory (forward logits; with the loss, the
forward loss; with a step, the training step)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from refine.exporters.zoo.configs import ZooConfig
from refine.exporters.strategies.data_parallel import IGNORE_INDEX
from refine.exporters.strategies.context import (
    context_bug,
    ContextBug,
    ContextParallelGPT2,
    ContextParallelLoss,
    ContextParallelStep,
    SEQ_AXIS,
    SequenceLoss,
    shifted_labels,
    validate_context,
    with_loss,
    ZigZagGPT2,
    zigzag_outputs,
)

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult



def sequential_model(model: str, config: str, seed: int, *, layers: int | None = None,
                     meta: bool = False) -> nn.Module:
    """The sequential model of a CP export: the zoo model (llama: run by CausalLlama's forward
    over its own modules, exporters/strategies/context_llama.py)."""
    from refine.exporters.zoo import models as zoo

    full = zoo.build(model, config, seed, layers=layers, meta=meta)
    if model == "llama":
        from refine.exporters.strategies.context_llama import CausalLlama

        return CausalLlama(full).eval()
    return full


def loss_model(model: str, config: str, seed: int, *, layers: int | None = None, meta: bool = False) -> nn.Module:
    """The sequential model of a CP loss export: the zoo model returning its training loss."""
    return with_loss(sequential_model(model, config, seed, layers=layers, meta=meta), SequenceLoss)


def rank_module(model: str, config: str, seed: int, rank: int, cp: int, *, layers: int | None = None,
                meta: bool = False, bug: ContextBug | None = None, ring: bool = False,
                zigzag: bool = False, loss: bool = False, train: bool = False) -> nn.Module:
    """Rank `rank` of the zoo model built from `seed` (the same weights as the sequential one);
    with `loss` its forward(input_ids, labels) returns the training loss (ContextParallelLoss),
    with `train` its loss share, as a training step (ContextParallelStep)."""
    from refine.exporters.zoo import models as zoo

    full = zoo.build(model, config, seed, layers=layers, meta=meta)
    if model == "llama":
        from refine.exporters.strategies.context_llama import CausalLlama

        rank_model = CausalLlama(full, rank, cp, bug, differentiable=train, ring=ring)
        if train:
            return with_loss(rank_model, ContextParallelStep).eval()
        return (with_loss(rank_model, ContextParallelLoss) if loss else rank_model).eval()
    if zigzag:
        return ZigZagGPT2(full, rank, cp, bug).eval()
    rank_model = ContextParallelGPT2(full, rank, cp, bug, ring, differentiable=train)
    if train:
        return with_loss(rank_model, ContextParallelStep).eval()
    return (with_loss(rank_model, ContextParallelLoss) if loss else rank_model).eval()


def export_context_parallel(
    model: str,
    config: str,
    cp: int,
    out: Path | str,
    seed: int = 0,
    *,
    bug: str | None = None,
    meta: bool = False,
    layers: int | None = None,
    flat: bool = False,
    workers: int | None = None,
    ring: bool = False,
    zigzag: bool = False,
    loss: bool = False,
    train: bool = False,
) -> ExportResult:
    """Export a zoo model under context parallelism over `cp` ranks (module doc) to the model
    directory `out`, with the bug `bug` (CONTEXT_BUGS) injected into the ranks if given. Each
    distinct block becomes one ONNX local function per program, as in `export_model` (`flat`:
    every block inline instead); `layers` overrides the config's layer count; `meta` exports
    without weight data; `workers` as in `refine.exporters.export`; `ring`: variant (b), ring attention
    (RingAttention, point-to-point K/V blocks and the online-softmax merge) instead of the
    all-gather of K/V (RING_BUGS are its own twins); `zigzag`: load-balanced chunks (ZigZagGPT2:
    rank r computes chunks r and 2*cp-1-r of 2*cp, ZIGZAG_BUGS are its own twins; not with `ring`);
    `loss`: the forward training loss instead of the logits (SequenceLoss, ContextParallelLoss:
    labels sliced alongside input_ids, LOSS_BUGS its own twins; not with `ring` or `zigzag`);
    `train`: one training step instead (ContextParallelStep: the loss and every gradient, each
    all-reduced over the ranks; LOSS_BUGS its twins too)."""
    from refine.exporters.zoo import plans, models as zoo
    from refine.exporters.capture.export import bug_words, export

    cfg = validate_context(model, config, cp, layers=layers, ring=ring, zigzag=zigzag, loss=loss, train=train)
    injected = context_bug(bug, ring, zigzag, loss or train)
    depth = f", {cfg.layers} layers" if layers is not None else ""
    if zigzag:
        return _export_zigzag(model, config, cp, out, seed, cfg, injected, bug=bug, meta=meta, layers=layers,
                              flat=flat, workers=workers)
    if loss or train:
        return _export_loss(model, config, cp, out, seed, cfg, injected, bug=bug, meta=meta, layers=layers,
                            flat=flat, workers=workers, train=train)
    return export(
        sequential_model(model, config, seed, layers=layers, meta=meta),
        functools.partial(rank_module, model, config, seed, cp=cp, layers=layers, meta=meta, bug=injected,
                          ring=ring),  # rank -> module
        zoo.example_inputs(model, config, seed, meta=meta),
        cp,
        out,
        output_names=["logits"],
        output_layouts={"logits": {"layout": "shard", "axis": SEQ_AXIS}},
        input_layouts={"input_ids": {"layout": "shard", "axis": SEQ_AXIS}},
        input_ranges={"input_ids": cfg.vocab},
        description=f"{model} config {config!r}{depth}, CP over {cp} ranks ("
        + ("ring attention: key/value blocks passed round the ring, merged by the online softmax" if ring else
           "keys and values all-gathered along the sequence")
        + "), forward, exported by exporters/strategies/context.py"
        + (" (meta: no weight data)" if meta else "") + (bug_words(injected) if injected is not None else ""),
        # no "tp": refine/diagnose/reduced.py re-exports TP recipes only
        zoo={"model": model, "config": config, "cp": cp, "seed": seed, "layers": layers, "meta": meta,
             "flat": flat, "bug": bug, "train": False, **({"ring": True} if ring else {})},
        layers=None if flat else plans.layer_stack(model),
        workers=workers,
    )


def _export_zigzag(model: str, config: str, cp: int, out: Path | str, seed: int, cfg: ZooConfig,
                   injected: ContextBug | None, *, bug: str | None, meta: bool, layers: int | None, flat: bool,
                   workers: int | None) -> ExportResult:
    """export_context_parallel(..., zigzag=True): the token ids replicated (each rank cuts its two
    chunks), the logits a stride-2 shard along the sequence (rank r: chunks r and cp + r, after
    ZigZagGPT2.swap); every block inline (`flat` or not)."""
    from refine.exporters.zoo import models as zoo
    from refine.exporters.capture.export import bug_words, export

    depth = f", {cfg.layers} layers" if layers is not None else ""
    return export(
        zoo.build(model, config, seed, layers=layers, meta=meta),
        functools.partial(rank_module, model, config, seed, cp=cp, layers=layers, meta=meta, bug=injected,
                          zigzag=True),  # rank -> module
        zoo.example_inputs(model, config, seed, meta=meta),
        cp,
        out,
        output_names=["logits"],
        output_layouts={"logits": {"layout": "shard", "axis": SEQ_AXIS, "stride": 2}},
        rank_output_names=functools.partial(zigzag_outputs, cp=cp),
        input_ranges={"input_ids": cfg.vocab},
        description=f"{model} config {config!r}{depth}, zig-zag CP over {cp} ranks (rank r computes sequence "
        f"chunks r and {2 * cp - 1}-r of {2 * cp}; keys and values all-gathered back into sequence "
        f"order; second chunks' logits traded between ranks r and {cp - 1}-r: logits a stride-2 shard), "
        "forward, exported by exporters/strategies/context.py"
        + (" (meta: no weight data)" if meta else "") + (bug_words(injected) if injected is not None else ""),
        zoo={"model": model, "config": config, "cp": cp, "seed": seed, "layers": layers, "meta": meta,
             "flat": True, "bug": bug, "train": False, "zigzag": True},
        layers=None,  # inline: a zig-zag block takes and returns two tensors (its two chunks), a layer
        # function one
        workers=workers,
    )


def _export_loss(model: str, config: str, cp: int, out: Path | str, seed: int, cfg: ZooConfig,
                 injected: ContextBug | None, *, bug: str | None, meta: bool, layers: int | None, flat: bool,
                 workers: int | None, train: bool = False) -> ExportResult:
    """export_context_parallel(..., loss=True): input_ids and labels (the token ids shifted before
    the split, last position ignored) sliced along the sequence, the loss a replica on every rank;
    with `train`, one training step: the loss and every gradient, replicas (the sequential program
    is the zoo model's training step, exporters/capture/train.py)."""
    from refine.exporters.zoo import plans, models as zoo
    from refine.exporters.capture.export import bug_words, export

    depth = f", {cfg.layers} layers" if layers is not None else ""
    (input_ids,) = zoo.example_inputs(model, config, seed, meta=meta)
    labels = torch.zeros_like(input_ids) if meta else shifted_labels(input_ids)
    seq_slice = {"layout": "shard", "axis": SEQ_AXIS}
    what = ("one training step (loss and every gradient, the gradients all-reduced with sum; the K/V all-gathers' "
            "backward reduce-scatters)" if train else "forward training loss")
    return export(
        sequential_model(model, config, seed, layers=layers, meta=meta) if train else
        loss_model(model, config, seed, layers=layers, meta=meta),
        functools.partial(rank_module, model, config, seed, cp=cp, layers=layers, meta=meta, bug=injected,
                          loss=not train, train=train),  # rank -> module
        (input_ids, labels),
        cp,
        out,
        **({} if train else {"output_names": ["loss"], "output_layouts": {"loss": {"layout": "rep"}}}),
        # labels may be the ignore index (the sequence's last position, and any the pipeline masks)
        input_layouts={"input_ids": seq_slice, "labels": {**seq_slice, "range": [0, cfg.vocab], "also": [IGNORE_INDEX]}},
        input_ranges={"input_ids": cfg.vocab, "labels": cfg.vocab},
        description=f"{model} config {config!r}{depth}, CP over {cp} ranks (keys and values all-gathered along the "
        f"sequence), {what} (token cross-entropy against labels sliced alongside the token ids, "
        "each rank's sum over the global token count, all-reduced), exported by exporters/strategies/context.py"
        + (" (meta: no weight data)" if meta else "") + (bug_words(injected) if injected is not None else ""),
        zoo={"model": model, "config": config, "cp": cp, "seed": seed, "layers": layers, "meta": meta,
             "flat": flat, "bug": bug, "train": train, "loss": not train},
        layers=None if flat else plans.layer_stack(model),
        workers=workers,
        train=train,
    )
