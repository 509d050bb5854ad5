"""`refine export --module path/to/file.py:factory`: the user's own module, from a file of theirs.

`factory()` takes no argument and returns a dict: `model` (an nn.Module), `batch` (a dict of
named tensors, or a tuple), and optionally `loss_fn` (needed for `--train`), `parallelize`
(the TP plan `--tp` applies) and `ranges` (integer inputs' values, as export_train takes them).
The command line says how it runs: `--tp N` (the plan on N ranks), `--dp N` (DDP), `--dp N
--fsdp` (FSDP2), `--tp T --dp D --train` (a DP x TP mesh: the plan in each row, DDP over each
column), `--micro-batches M`, `--train` (one training step, else the forward); the export itself
is exporters/strategies/own.py's (own_mesh.py's for the mesh).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from refine.exporters.errors import ExportError

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult
    from refine.exporters.capture.numeric import CheckResult


class ModuleSpec(BaseModel):
    """What a factory returns (checked: a misspelt key is an error, not ignored)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    model: Any
    batch: Any
    loss_fn: Callable[..., Any] | None = None
    parallelize: Callable[..., Any] | None = None
    ranges: dict[str, Any] | None = None


def load_factory(spec: str) -> Callable[[], Any]:
    """The function `factory` of `path/to/file.py:factory`, the file imported as a module of its
    own (its directory first on sys.path, so that it may import its neighbours)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise ExportError(f"--module {spec!r}: expected path/to/file.py:factory")
    path = Path(path_text)
    if not path.is_file() or path.suffix != ".py":
        raise ExportError(f"--module {spec!r}: {path} is not a Python file")
    module_name = f"refine_user_{path.stem}"
    found = importlib.util.spec_from_file_location(module_name, path)
    if found is None or found.loader is None:
        raise ExportError(f"--module {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(found)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.resolve().parent))
    try:
        found.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: its error, in one line
        raise ExportError(f"--module {spec!r}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ExportError(f"--module {spec!r}: {path} has no function {name!r}")
    return factory


def module_spec(spec: str) -> ModuleSpec:
    """Call the factory of `spec` and check what it returns."""
    built = load_factory(spec)()
    try:
        return ModuleSpec.model_validate(built if isinstance(built, dict) else {"model": built})
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise ExportError(f"--module {spec!r}: the factory's dict: {'.'.join(map(str, problem['loc']))}: "
                          f"{problem['msg']} (keys: model, batch, loss_fn, parallelize, ranges)") from None


def export_from_file(spec: str, out: Path, *, tp: int | None, dp: int | None, fsdp: bool, micro_batches: int,
                     train: bool, check: bool) -> tuple[ExportResult, CheckResult | None]:
    """Export the module `spec` names as the options say (module doc); with `check`, the numeric
    check of the export against torch too."""
    from refine.exporters.capture.numeric import check as numeric_check
    from refine.exporters.strategies import own

    parts = module_spec(spec)
    mesh = tp is not None and dp is not None
    if mesh and (not train or fsdp):
        raise ExportError("--module: --tp with --dp is a DP x TP mesh of DDP training steps: pass --train, no --fsdp")
    if tp is not None and parts.parallelize is None:
        raise ExportError(f"--module {spec!r}: --tp needs the factory to return a `parallelize` (your TP plan)")
    world = (tp or 1) * (dp or 1)
    data_parallel = ("fsdp" if fsdp else "ddp") if dp is not None else None
    parallelize = parts.parallelize if tp is not None else None
    if train:
        if parts.loss_fn is None:
            raise ExportError(f"--module {spec!r}: --train needs the factory to return a `loss_fn(outputs, batch)`")
        result = own.export_train(parts.model, parts.loss_fn, parts.batch, world, out, parallelize=parallelize,
                                  data_parallel=data_parallel, micro_batches=micro_batches,  # type: ignore[arg-type]
                                  ranges=parts.ranges, dp=dp if mesh else None)
        reference = own.reference_step(parts.model, parts.loss_fn, parts.batch)
    else:
        if fsdp or micro_batches != 1:
            raise ExportError("--module: --fsdp and --micro-batches are for a training step: pass --train")
        batch, ranges = _forward_inputs(parts)
        result = own.export_forward(parts.model, batch, world, out, parallelize=parallelize,
                                    data_parallel=data_parallel, ranges=ranges)  # type: ignore[arg-type]
        reference = parts.model
    return result, numeric_check(out, reference) if check else None


def _forward_inputs(parts: ModuleSpec) -> tuple[Any, dict[str, Any] | None]:
    """The batch and ranges of a forward export: a factory made for training (it returns a
    `loss_fn`) has entries only its loss reads (the labels), which the forward leaves out, as
    the training step does (own.BatchShape: the entries the forward names); without a loss,
    an entry the forward does not name stays an error."""
    from refine.exporters.strategies.own import BatchShape

    batch = parts.batch
    if parts.loss_fn is None or not isinstance(batch, dict):
        return batch, parts.ranges
    kept = {k: batch[k] for k in BatchShape.of(parts.model, batch).model_args}
    ranges = None if parts.ranges is None else {k: v for k, v in parts.ranges.items() if k in kept}
    return kept, ranges
