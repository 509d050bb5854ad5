"""Exporters: PyTorch models and their parallel plans -> refine model directories.

    refine.exporters.export(seq_module, rank_module_factory, example_inputs, world_size, out_dir)
    refine.exporters.export_model(model="llama", config="tiny", tp=2, sp=False, out=Path("out"))
    refine.exporters.check(out_dir)        # numeric proof that the export is right
    refine.exporters.export_train(model, loss_fn, batch, world_size, out_dir, data_parallel="ddp")  # your own step

One module per concern: `capture` (torch -> ONNX, fake process groups), `collectives`
(c10d ops -> `dist` ops), `layouts` (DTensor placements -> refine.json), `rename`
(tensor names; readable node and tensor names for reports), `own` (your own module's forward or
training step, DDP/FSDP semantics), `configs`/`zoo`/`plans` (the model zoo and its TP/SP plans),
`api` (export, atomic writing), `numeric` (the numeric check). Attributes are imported lazily so
that `refine.exporters.errors` and `refine.exporters.zoo.configs` work without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export", "export_model", "export_train", "export_forward", "reference_step", "check", "ExportError", "ExportResult", "CheckResult", "MODELS", "CONFIGS"]

_WHERE = {
    "export": "refine.exporters.capture.export",
    "export_model": "refine.exporters.zoo.tensor_parallel",
    "export_train": "refine.exporters.strategies.own",
    "export_forward": "refine.exporters.strategies.own",
    "reference_step": "refine.exporters.strategies.own",
    "ExportResult": "refine.exporters.capture.export",
    "check": "refine.exporters.capture.numeric",
    "CheckResult": "refine.exporters.capture.numeric",
    "ExportError": "refine.exporters.errors",
    "MODELS": "refine.exporters.zoo.configs",
    "CONFIGS": "refine.exporters.zoo.configs",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'exporters' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
