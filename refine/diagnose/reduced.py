"""Counterexamples for models too big to simulate: the same export at reduced sizes.

A failed proof on a model whose values would not fit the `--sim-memory` cap (a llama3-8b or a
405B export, with or without weight data) cannot be decided by running it. A model directory
that `refine export` wrote records its recipe in export.json ("zoo": framework, model, config,
plan, seed, bug, training step). The same recipe with the config's `-reduced` sizes
(exporters/zoo/configs.py `reduced`: every attention head and key/value head kept, so the plan
splits it the same way; head size 2, small FFN and vocabulary, 2 layers) is the same program
with its dimensions scaled down; it is exported into a temporary directory and verified with
its own counterexample search. Its counterexample is reported as such, naming the reduced
config; the verdict becomes `refuted` only on one. Any other directory, or a machine without
the torch extra, keeps `not_run`.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from refine.report.schema import NumericCheck, Report

MANIFEST = "export.json"


def recipe(model_dir: Path) -> dict[str, Any] | None:
    """How `refine export` made this directory (export.json "zoo"), or None."""
    path = model_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        zoo = json.loads(path.read_text()).get("zoo")
    except (OSError, ValueError, AttributeError):
        return None
    return zoo if isinstance(zoo, dict) and "config" in zoo and "tp" in zoo else None


def reducible(model_dir: Path) -> str | None:
    """The reduced config name for this directory's recipe, if there is one and the exporters
    can run here (the torch extra; the megatron extra for Megatron-Core exports)."""
    zoo = recipe(model_dir)
    if zoo is None or importlib.util.find_spec("torch") is None:
        return None
    from refine.exporters.zoo.configs import CONFIGS, MEGATRON_CONFIGS, REDUCED

    megatron = zoo.get("framework") == "megatron-core"
    if megatron and importlib.util.find_spec("megatron") is None:
        return None
    name = str(zoo["config"]) + REDUCED
    return name if name in (MEGATRON_CONFIGS if megatron else CONFIGS) else None


def export_reduced(model_dir: Path, out: Path) -> Path:
    """Export this directory's recipe at its reduced config into `out` (one process)."""
    zoo = recipe(model_dir)
    config = reducible(model_dir)
    assert zoo is not None and config is not None
    layers = zoo.get("layers")  # (a recipe's own layer count, if smaller than the reduced config's)
    common = dict(config=config, tp=int(zoo["tp"]), sp=bool(zoo.get("sp")), out=out, seed=int(zoo.get("seed") or 0),
                  workers=0, train=bool(zoo.get("train")), flat=bool(zoo.get("flat")),
                  layers=min(int(layers), 2) if layers else None)
    if zoo.get("framework") == "megatron-core":
        from refine.exporters.frameworks.megatron import export_megatron

        return export_megatron(**common, bug=zoo.get("bug")).out_dir  # type: ignore[arg-type]
    from refine.exporters.zoo.tensor_parallel import export_model
    from refine.exporters.zoo.bugs import BUGS, CONTROLS

    name = zoo.get("bug")
    bug = None if name is None else {**BUGS, **CONTROLS}[name]
    return export_model(str(zoo["model"]), **common, bug=bug).out_dir  # type: ignore[arg-type]


def search(model_dir: Path, seeds: tuple[int, ...], sim_memory_gib: float, skipped: NumericCheck,
           verify_dir: Callable[..., Report]) -> NumericCheck:
    """The numeric check of this directory's recipe at reduced sizes (verified by `verify_dir`,
    refine.pipeline's), worded as such; `skipped` (why the real sizes were not simulated) when
    there is no recipe or the search fails."""
    config = reducible(model_dir)
    if config is None:
        return skipped
    with tempfile.TemporaryDirectory(prefix="refine-reduced-") as tmp:
        try:
            reduced_dir = export_reduced(model_dir, Path(tmp) / model_dir.name)
            report = verify_dir(reduced_dir, seeds=seeds, sim_memory_gib=sim_memory_gib)
        except Exception as exc:  # noqa: BLE001 - the search must never take the verdict down
            return skipped.model_copy(update={"summary": f"{skipped.summary}; the re-export at reduced sizes "
                                                         f"(config {config}) failed: {type(exc).__name__}: {exc}"})
    where = (f"on the same export at reduced sizes (config {config}: the same heads and plan, head size 2, "
             "2 layers), since the real sizes would not fit --sim-memory")
    if report.verdict == "verified":
        return skipped.model_copy(update={"summary": f"{skipped.summary}; {where}, the model verifies: no "
                                                     "counterexample (the failure at full size is a missing lemma there)"})
    numeric = report.numeric
    if numeric is None:
        return skipped
    return numeric.model_copy(update={"summary": f"{where}: {numeric.summary}", "reduced_config": config})
