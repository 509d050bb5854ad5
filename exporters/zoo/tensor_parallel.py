"""A zoo model under its TP (or TP+SP) plan: `export_model`, and the per-rank factory the
strategies reuse (`zoo_rank_factory`: the model built from its seed and parallelized by its
DTensor plan, with a bug injected where asked)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from refine.exporters.capture.export import ExportResult, bug_words, export
from refine.exporters.capture.layouts import REP
from refine.exporters.zoo import models as zoo
from refine.exporters.zoo import plans
from refine.exporters.zoo.bugs import Bug
from refine.exporters.zoo.configs import validate


def zoo_rank_factory(
    model: str, config: str, tp: int, sp: bool, seed: int, *, layers: int | None = None, meta: bool = False,
    bug: Bug | None = None, mesh: Callable[[], Any] | None = None,
) -> Callable[[int], torch.nn.Module]:
    """rank -> the zoo model built from `seed` and parallelized by its plan on a 1-D mesh of `tp`
    (with `bug` injected into the plan and the parallelized module: exporters/zoo/bugs.py). `mesh`
    returns the 1-D DeviceMesh of `tp` ranks the plan runs on, if not the whole world (the `tp`
    dim of a TP x DP mesh, exporters/strategies/mesh.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if bug is not None and not bug.applies(model, sp):
        raise ValueError(f"bug {bug.name!r} does not apply to {model} under the {'TP+SP' if sp else 'TP'} plan")

    def factory(rank: int) -> torch.nn.Module:
        device_mesh = mesh() if mesh is not None else init_device_mesh("cpu", (tp,))
        module = zoo.build(model, config, seed, layers=layers, meta=meta)
        plan = plans.make_plan(model, module, sp)
        if bug is not None:
            bug.edit_plan(model, plan, sp)
        # src_data_rank=None: every rank keeps its own chunk of the identically seeded weights
        parallelize_module(module, device_mesh, plan, src_data_rank=None)
        if bug is not None and bug.edit_module is not None:
            bug.edit_module(model, module)
        return module

    return factory


def export_model(
    model: str = "llama",
    config: str = "tiny",
    tp: int = 2,
    sp: bool = False,
    out: Path | str = Path("out"),
    seed: int = 0,
    *,
    layers: int | None = None,
    meta: bool = False,
    flat: bool = False,
    workers: int | None = None,
    bug: Bug | None = None,
    train: bool = False,
) -> ExportResult:
    """Export a zoo model under its TP (or TP+SP) plan to the model directory `out`.

    Each distinct decoder layer becomes one ONNX local function per program (`flat`: every
    layer inline instead); `layers` overrides the config's layer count; `meta` exports
    without weight data; `workers` as in `export`; `bug` (exporters/zoo/bugs.py) is injected into
    every rank and recorded in the description and the manifest; `train` exports one training
    step (loss and every gradient, exporters/capture/train.py) on the config's batch and random labels."""
    cfg = validate(model, config, tp, sp, layers=layers, meta=meta)
    plan = "TP+SP" if sp else "TP"
    depth = f", {cfg.layers} layers" if layers is not None else ""
    inputs = zoo.example_inputs(model, config, seed, meta=meta, labels=train)
    outputs: dict[str, Any] = {} if train else {"output_names": ["logits"], "output_layouts": {"logits": dict(REP)}}
    step = "one training step" if train else "forward"
    return export(
        zoo.build(model, config, seed, layers=layers, meta=meta),
        zoo_rank_factory(model, config, tp, sp, seed, layers=layers, meta=meta, bug=bug),
        inputs,
        tp,
        out,
        **outputs,
        input_ranges={"input_ids": cfg.vocab, "labels": cfg.vocab},
        description=f"{model} config {config!r}{depth}, {plan} over {tp} ranks, {step}, exported by `refine export`"
        + (" (meta: no weight data)" if meta else "") + (bug_words(bug) if bug is not None else ""),
        zoo={"model": model, "config": config, "tp": tp, "sp": sp, "seed": seed, "layers": layers, "meta": meta,
             "flat": flat, "bug": bug.name if bug is not None else None, "train": train},
        layers=None if flat else plans.layer_stack(model),
        workers=workers,
        train=train,
    )
