"""Exporters: PyTorch models and their parallel plans -> refine model directories.

    exporters.export(seq_module, rank_module_factory, example_inputs, world_size, out_dir)
    exporters.export_model(model="llama", config="tiny", tp=2, sp=False, out=Path("out"))
    exporters.check(out_dir)        # numeric proof that the export is right

One module per concern: `capture` (torch -> ONNX, fake process groups), `collectives`
(c10d ops -> `dist` ops), `layouts` (DTensor placements -> refine.json), `rename`
(tensor names; readable node names for reports), `configs`/`zoo`/`plans` (the model zoo and its TP/SP plans),
`api` (export, atomic writing), `numeric` (the numeric check). Attributes are imported lazily so
that `exporters.errors` and `exporters.configs` work without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export", "export_model", "check", "ExportError", "ExportResult", "CheckResult", "MODELS", "CONFIGS"]

_WHERE = {
    "export": "exporters.api",
    "export_model": "exporters.api",
    "ExportResult": "exporters.api",
    "check": "exporters.numeric",
    "CheckResult": "exporters.numeric",
    "ExportError": "exporters.errors",
    "MODELS": "exporters.configs",
    "CONFIGS": "exporters.configs",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'exporters' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
