"""One training step as an ONNX program (`to_onnx`): the step traced (refine.exporters.capture.train),
its distinct layers outlined as a forward and a backward local function each where asked
(refine.exporters.capture.train_layers)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import torch
from torch import nn

from refine.exporters.capture import train, train_layers
from refine.exporters.capture.tracing import meta_weights_to_inputs, quiet, translate
from refine.exporters.errors import ExportError, capture_error


def to_onnx(
    module: nn.Module,
    args: Sequence[torch.Tensor],
    translation_table: dict[Callable[..., Any], Callable[..., Any]] | None = None,
    *,
    layers: str | None = None,
    info: dict[str, Any] | None = None,
) -> onnx.ModelProto:
    """One training step of `module` on `args` = (*model inputs, labels) as an ONNX program.

    The program's inputs are the model inputs and `labels`; parameters and buffers are
    initializers named by FQN (typed inputs without data on the meta device), as in the
    forward export; outputs are `train.output_names(module)`. `layers` names the ModuleList whose
    distinct layers become a forward and a backward local function each, captured once
    (refine.exporters.capture.train_layers)."""
    seconds: dict[str, float] = {}
    names = train.output_names(module)
    table = dict(translation_table or {})
    tracer = None
    if layers is not None:
        tracer = train_layers.TrainTracer(module, layers)
        table.update(train_layers.translation_table())
    try:
        with quiet():
            start = time.perf_counter()
            try:
                with tracer.active() if tracer else contextlib.nullcontext():
                    gm, params, buffers, values = train.trace_step(module, args, tracer)
            except ExportError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever stops the trace is the model's reason
                raise capture_error(f"the training step of {type(module).__name__}", exc) from None
            seconds["trace"] = time.perf_counter() - start
            start = time.perf_counter()
            user_inputs = train.input_names(module, len(args) - 1)
            try:
                ep = train.exported_program(gm, params, buffers, values, user_inputs)
            except ExportError:
                raise
            except Exception as exc:  # noqa: BLE001 - one line naming the step, not a traceback
                raise capture_error(f"the training step of {type(module).__name__} (as a program)", exc) from None
            program = translate(ep, tuple(args), names, table)
            meta_weights_to_inputs(program)
            model = program.model_proto
            seconds["onnx"] = time.perf_counter() - start
            if tracer is not None:
                start = time.perf_counter()
                summary = train_layers.outline(model, tracer)
                seconds["outline"] = time.perf_counter() - start
                if info is not None:
                    info["layers"] = summary
    finally:
        if tracer is not None:
            tracer.close()
    if info is not None:
        info["seconds"] = seconds
    return model
