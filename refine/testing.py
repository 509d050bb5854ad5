"""refine in your own test suite: `assert_refines` fails a test with what is wrong, in words.

    from refine.testing import assert_refines

    def test_my_tp_plan():
        assert_refines(MyBlock(), my_parallelize, (torch.randn(2, 8, 16),), world_size=2)

It exports the model as the ranks run it (refine.exporters.export_forward, or with `train=True`
export_train: one training step, the loss and every gradient), verifies the export, and fails
the test unless the verdict is VERIFIED. The failure message is the report's head: the verdict,
what is wrong in plain words (the bug class, the user's tensors, the user's line), the first
failing node and where it is; an UNPROVEN verdict fails too (nothing was proven). Under pytest
the failure is `pytest.fail` (no traceback into refine); elsewhere an AssertionError.

Needs the torch extra. The export goes to a temporary directory, kept only if `out` names one.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refine.report.schema import Report

MESSAGE_LINES = 8  # the report's head: verdict, what is wrong, outputs, first failure


def assert_refines(model: Any, parallelize: Callable[..., Any] | None, example_inputs: Mapping[str, Any] | Sequence[Any],
                   world_size: int, train: bool = False, *, loss_fn: Callable[[Any, Any], Any] | None = None,
                   data_parallel: str | None = None, micro_batches: int = 1, out: str | Path | None = None,
                   **export_options: Any) -> Report:
    """Export `model` under `parallelize(model, mesh)` (or `data_parallel`) on `world_size` ranks,
    verify it, and fail the calling test with the report's head unless it is VERIFIED.

    `train`: one training step with `loss_fn(outputs, batch)` (default: token cross-entropy of the
    outputs against the last entry of `example_inputs`, the labels) instead of the forward.
    `out`: keep the export there (for `refine verify out --html ...`). Other keywords go to the
    exporter. Returns the report of a verified model."""
    from refine.exporters.strategies import own
    from refine.pipeline import verify_dir

    with tempfile.TemporaryDirectory(prefix="refine-test-") as scratch:
        where = Path(out) if out is not None else Path(scratch) / type(model).__name__
        if train:
            own.export_train(model, loss_fn or own.default_loss, example_inputs, world_size, where, parallelize=parallelize,
                             data_parallel=data_parallel, micro_batches=micro_batches, **export_options)  # type: ignore[arg-type]
        else:
            if loss_fn is not None or micro_batches != 1:
                raise ValueError("assert_refines: loss_fn and micro_batches are for a training step (train=True)")
            own.export_forward(model, example_inputs, world_size, where, parallelize=parallelize,
                               data_parallel=data_parallel, **export_options)  # type: ignore[arg-type]
        report = verify_dir(where)
    if report.verdict != "verified":
        _fail(failure_message(report, kept=out))
    return report


def failure_message(report: Report, kept: str | Path | None = None) -> str:
    """What a failed `assert_refines` says: the head of the text report (verdict, what is wrong,
    the first failure and its line), and where the export is if it was kept."""
    from refine.report.render import render_text

    lines = render_text(report, verbose=False).splitlines()
    wanted = ("  what is wrong", "  first failure", "    why:", "  counterexample", "  collectives")
    bad = [line for line in lines if line.startswith("  output ") and "NOT" in line]
    head = [lines[0], *(line for line in lines if line.startswith(wanted[:1])), *bad[:1],
            *([f"  ... and {len(bad) - 1} more output(s) not rebuilt"] if len(bad) > 1 else []),
            *(line for line in lines if line.startswith(wanted[1:]))][:MESSAGE_LINES]
    where = f"\n  (the export: {kept}; `refine verify {kept}` for the whole report)" if kept is not None else ""
    return "refine: the ranks do not refine the sequential model\n" + "\n".join(head) + where


def _fail(message: str) -> None:
    """Fail the calling test: pytest.fail without refine's traceback under pytest, else AssertionError."""
    try:
        import pytest
    except ImportError:
        raise AssertionError(message) from None
    pytest.fail(message, pytrace=False)
