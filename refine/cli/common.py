"""What every command shares: how a problem ends the command (one line on stderr, exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

from refine.errors import InputError


def usage_error(problem: str) -> NoReturn:
    """A problem with the options themselves (no file to name): one line on stderr, exit 2."""
    typer.echo(f"refine: error: {' '.join(problem.split())}", err=True)
    raise typer.Exit(2)


def fail(exc: InputError, fallback: Path) -> NoReturn:
    """Print `refine: error: <file>: <problem>` as one line on stderr and exit 2.

    An error that names no file (clingo's, which only locate the problem in their message)
    is attributed to the rule file the message names, else to `fallback`: the input the
    command was given.
    """
    typer.echo(f"refine: error: {exc.one_line(fallback)}", err=True)
    raise typer.Exit(2)
