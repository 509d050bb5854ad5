"""The one exception type for bad input: the CLI turns it into one line and exit code 2."""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """Bad user input (a file, a config, a model) that refine cannot work with.

    Carries the file it is about so the CLI can print `FILE: problem` and nothing else.
    """

    def __init__(self, path: str | Path | None, problem: str) -> None:
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)
