"""refine: prove that a distributed model implementation refines its sequential model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refine.report.schema import Report

__version__ = "0.1.0"


def verify(model_dir: str | Path, *, rules: list[str | Path] | None = None, simulate: bool = True,
           memo: bool = True) -> Report:
    """Verify a model directory (seq.onnx, rank*.onnx, refine.json) as `refine verify` does and
    return its report (`report.verdict`: verified, refuted or unproven). Bad input raises
    refine.errors.InputError, whose text names the file and the problem."""
    from refine.pipeline import verify_dir  # (imported here: `import refine` stays light)

    return verify_dir(Path(model_dir), [Path(r) for r in rules] if rules else None, simulate=simulate, memo=memo)
