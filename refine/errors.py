"""The one exception type for bad input: the CLI turns it into one line and exit code 2."""

from __future__ import annotations

import re
from pathlib import Path


class InputError(Exception):
    """Bad user input (a file, a config, a model) that refine cannot work with.

    Carries the file it is about so the CLI can print `FILE: problem` and nothing else.
    """

    def __init__(self, path: str | Path | None, problem: str) -> None:
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)

    def one_line(self, fallback: str | Path) -> str:
        """`<file>: <problem>` on one line. An error that names no file (clingo's, which only
        locate the problem in their message) is attributed to the rule file the message names,
        else to `fallback`: the input the command was given."""
        path = self.path
        if path is None:
            found = _CLINGO_FILE.search(self.problem)
            path = found.group(1) if found else str(fallback)
        return f"{path}: {' '.join(self.problem.split())}"


# clingo locates its messages as `FILE:LINE:COL...`; a rule file named there is the culprit
_CLINGO_FILE = re.compile(r"(\S+\.lp):\d+:\d+")
