"""The progress display: hidden off a terminal and with --quiet, shown once a step runs long."""

from __future__ import annotations

import io
import time

from rich.console import Console

from refine.report import progress as progress_module
from refine.report.progress import progress_display


def test_silent_off_a_terminal_and_when_quiet(capsys):
    for quiet in (False, True):
        with progress_display(quiet, delay=0.0) as step:
            step("solving")
            time.sleep(0.05)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_shown_after_the_delay(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(progress_module, "Console", lambda **_kw: Console(file=buffer, force_terminal=True, width=80))
    with progress_display(False, delay=0.05) as step:
        step("lowering")
        time.sleep(0.3)
        step("solving layer template T1")
        time.sleep(0.3)
    assert "solving layer template T1" in buffer.getvalue()


def test_not_shown_for_quick_runs(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(progress_module, "Console", lambda **_kw: Console(file=buffer, force_terminal=True, width=80))
    with progress_display(False, delay=5.0) as step:
        step("lowering")
    assert "lowering" not in buffer.getvalue()
