"""The one exception of the exporters: a request that cannot be exported as asked.

Kept apart from torch so that `refine export` can report bad arguments (one line, exit 2)
before importing anything heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

T = TypeVar("T")

class ExportError(Exception):
    """Bad arguments or a model/plan the exporter cannot turn into a model directory."""


class LayerFormError(ExportError):
    """A layer whose call cannot be a layer function (its result is not one tensor): the model
    still exports with its layers inline."""



@dataclass(frozen=True)
class PlanBug:
    """A mistake a plan's exporter injects into the rank programs: its name (`--bug`), what the
    ranks then do wrong, and its class in docs/bugs.md (each plan's subclass sets it)."""

    name: str
    title: str
    bug_class: ClassVar[int]


class NamedBug(Protocol):
    """What a report says of an injected bug (any plan's: the zoo's, Megatron-Core's, a strategy's)."""

    name: str
    title: str
    bug_class: int | None


def named_bug(bugs: Mapping[str, T], name: str, plan: str) -> T:
    """The bug `name` of a plan's catalogue; an ExportError listing the known ones otherwise."""
    if name not in bugs:
        raise ExportError(f"unknown {plan} bug {name!r} (known: {', '.join(bugs)})")
    return bugs[name]


def capture_error(what: str, exc: BaseException) -> ExportError:
    """One line for a model torch cannot capture: what, the exception's first line, and the
    innermost frame of the user's own code (not torch's, not the exporters'), so a tracing
    failure in a forked worker is not a page of traceback."""
    import os
    import traceback

    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    here = os.path.dirname(os.path.abspath(__file__))
    user = [f for f in traceback.extract_tb(exc.__traceback__)
            if not os.path.abspath(f.filename).startswith(here + os.sep)
            and f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.startswith("<")]
    at = f" (at {user[-1].filename}:{user[-1].lineno})" if user else ""
    return ExportError(f"{what} cannot be captured: {type(exc).__name__}: {first}{at}")
