"""The user's call site: where calls that refine's exporters make on the user's behalf belong.

A training-step API issues collectives the user never wrote (DDP's gradient all-reduce, FSDP's
all-gather and reduce-scatter). Their source line in a report must be the user's, not a line
inside refine or torch: the innermost frame outside torch, transformers and refine when the
user called the API.
Rank programs are captured in forked workers, whose stacks hold no frame of the user's, so
the site is read once, in the calling process, and stamped on the ops while they are traced.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.fx.traceback as fx_traceback

import refine

_REFINE = (Path(refine.__file__).resolve().parent, Path(__file__).resolve().parents[1])  # refine/, the exporters


def user_call_site() -> str:
    """The innermost frame of the current stack outside torch, transformers and refine (all of it,
    the exporters too: this is called by refine's API on the user's behalf), as a one-frame stack
    trace in torch's format (`File "...", line N, in f`); '' if there is none."""
    stack = traceback.extract_stack()[:-1]
    for frame in reversed(stack):
        path = Path(frame.filename).resolve() if not frame.filename.startswith("<") else None
        if path is None or "/torch/" in path.as_posix() or "/transformers/" in path.as_posix():
            continue
        if any(path.is_relative_to(root) for root in _REFINE):
            continue
        return "".join(traceback.format_list([frame])).rstrip()
    return ""


def keep_frames_of(fn: Callable[..., Any]) -> None:
    """Keep the frames of the user's function `fn` (a loss) in the stack traces torch records while
    tracing: make_fx keeps only frames of functions named `forward` (and anchors registered like
    this), so an op of the user's loss would otherwise be located at the caller's line."""
    from torch.fx import proxy

    fn = getattr(fn, "func", fn)  # (a functools.partial's function)
    register = getattr(proxy, "_register_stack_trace_anchor", None)
    if register is not None and getattr(fn, "__code__", None) is not None:
        register(fn)


@contextlib.contextmanager
def traced_at(site: str, module_stack: Mapping[str, tuple[str, Any]] | None = None) -> Iterator[None]:
    """While tracing (make_fx under fx_traceback.preserve_node_meta, as exporters/capture/train.py
    traces a step), every op recorded inside the block gets `site` as its stack trace and, if
    given, `module_stack` as its module stack (so the node is named and located there)."""
    meta = fx_traceback.current_meta
    saved = {key: meta.get(key) for key in ("stack_trace", "nn_module_stack")}
    if site:
        meta["stack_trace"] = site
    if module_stack is not None:
        meta["nn_module_stack"] = dict(module_stack)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                meta.pop(key, None)
            else:
                meta[key] = value
