"""A progress display for long runs: silent for the first second, then a rich spinner line
on stderr naming the current step (lowering, solving the main graphs, layer template k, ...).
Only on a terminal (mode `auto`), and never with --quiet, so logs and pipes stay clean; mode
`plain` (`--progress plain`, for CI logs) prints one line per step on stderr instead."""

from __future__ import annotations

import enum
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

DELAY_SECONDS = 1.0


class ProgressMode(str, enum.Enum):
    auto = "auto"
    plain = "plain"
    none = "none"


@contextmanager
def progress_display(quiet: bool, delay: float = DELAY_SECONDS, force: bool = False,
                     mode: ProgressMode = ProgressMode.auto) -> Iterator[Callable[[str], None]]:
    """Yield a callback taking a step description; the display appears once `delay` seconds
    have passed (if the job is still running) and disappears when it ends."""
    console = Console(stderr=True)
    if quiet or mode == ProgressMode.none:
        yield lambda _step: None
        return
    if mode == ProgressMode.plain:
        yield _plain_lines()
        return
    if not (force or console.is_terminal):
        yield lambda _step: None
        return
    display = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                       console=console, transient=True)
    task = display.add_task("starting", total=None)
    start = time.perf_counter()
    shown = threading.Event()
    lock = threading.Lock()

    def show() -> None:
        with lock:
            if not shown.is_set():
                display.start()
                shown.set()

    timer = threading.Timer(delay, show)
    timer.daemon = True
    timer.start()

    def step(description: str) -> None:
        display.update(task, description=description)
        if time.perf_counter() - start >= delay:
            show()

    try:
        yield step
    finally:
        timer.cancel()
        with lock:
            if shown.is_set():
                display.stop()


def _plain_lines() -> Callable[[str], None]:
    """One `refine: [elapsed] step` line on stderr per step, flushed (a log keeps them all)."""
    start = time.perf_counter()

    def step(description: str) -> None:
        print(f"refine: [{time.perf_counter() - start:6.1f}s] {description}", file=sys.stderr, flush=True)

    return step
