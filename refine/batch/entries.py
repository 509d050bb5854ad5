"""The entries of a `refine batch` run: every model directory under a root (a directory holding
refine.json, found recursively; hidden directories skipped), and with a plan (`--plan tp:N`) every
plain `.onnx` model no entry holds; what the run is asked (`BatchOptions`); what each entry gave
(`EntryResult`) and the whole batch (`BatchReport`)."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from refine.batch.autoshard import ShardPlan
from refine.config import CONFIG_NAME
from refine.errors import InputError
from refine.report.schema import Report, Verdict

if TYPE_CHECKING:
    pass

Status = Literal["verified", "refuted", "unproven", "nothing_sharded", "error", "timeout", "out_of_memory", "crashed"]
_PLAN = re.compile(r"^tp:(\d+)$")


def cores() -> int:
    """The cores this process may run on (the default --jobs)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class BatchOptions(BaseModel):
    """What `refine batch` was asked to do (everything but the root)."""

    model_config = ConfigDict(frozen=True)

    jobs: int = Field(default_factory=lambda: cores(), ge=1)
    timeout: float | None = Field(default=600.0, gt=0, description="seconds per entry; None: no limit")
    memory_mb: int | None = Field(default=None, gt=0, description="address-space cap per worker, MiB")
    rules: tuple[Path, ...] = ()
    simulate: bool = True
    memo: bool = True
    plan_tp: int | None = Field(default=None, ge=1, description="--plan tp:N: shard plain ONNX models over N ranks")
    use_cache: bool = True
    cache_dir: Path | None = Field(default=None, description="None: ROOT/.refine-cache")
    ray: str | None = Field(default=None, description="--ray: run entries as tasks on the Ray cluster at this address "
                            "(`auto`: the one this machine runs); None: local worker processes")

    @property
    def plan(self) -> str | None:
        return None if self.plan_tp is None else f"tp:{self.plan_tp}"


def parse_plan(text: str | None) -> int | None:
    """`tp:N` -> N (the only plan the sharder knows); bad text is an InputError."""
    if text is None:
        return None
    found = _PLAN.match(text.strip())
    if not found or int(found.group(1)) < 1:
        raise InputError(None, f"--plan {text!r}: expected tp:N with N >= 1 (Megatron-style tensor parallelism over N ranks)")
    return int(found.group(1))


class Entry(BaseModel):
    """One thing to verify: a model directory, or a plain ONNX model to shard first."""

    name: str = Field(description="path relative to the batch root")
    path: Path
    kind: Literal["dir", "onnx"]


class EntryResult(BaseModel):
    """What one entry gave: the core's report, or why there is none."""

    entry: str
    kind: Literal["dir", "onnx"] = "dir"
    status: Status
    expected: Verdict = "verified"
    expected_node: str | None = None
    seconds: float = 0.0
    cached: bool = False
    failing_node: str | None = None
    error: str | None = Field(default=None, description="one line: the core's error, or how the worker ended")
    report: Report | None = None
    plan: ShardPlan | None = Field(default=None, description="--plan: what the sharder sharded and left replicated")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """Did the entry give what it declares (verified, if it declares nothing)?"""
        if self.status != self.expected:
            return False
        return self.expected_node is None or self.failing_node == self.expected_node


class BatchReport(BaseModel):
    """A whole batch: options, timing and every entry's result, in entry order."""

    root: str
    refine_version: str
    rules_digest: str
    jobs: int
    timeout: float | None
    memory_mb: int | None
    plan: str | None
    seconds: float
    entries: list[EntryResult]

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def counts(self) -> Counter[str]:
        return Counter(e.status for e in self.entries)


# --- finding entries ---------------------------------------------------------------------------


def find_entries(root: Path, plan_tp: int | None = None) -> list[Entry]:
    """Every directory under `root` (itself included) holding refine.json, and with a plan every
    .onnx file outside them (a file anywhere inside a model directory belongs to that entry, as
    `_entry_files` says); hidden directories are skipped. Sorted by name."""
    if not root.is_dir():
        raise InputError(root, "not a directory (refine batch takes a directory of model directories)")
    found: list[Entry] = []
    model_dirs: set[Path] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        name = here.relative_to(root).as_posix()
        if CONFIG_NAME in filenames:
            model_dirs.add(here)
            found.append(Entry(name=root.name if name == "." else name, path=here, kind="dir"))
        elif plan_tp is not None and model_dirs.isdisjoint(here.parents):
            for f in sorted(filenames):
                if f.endswith(".onnx") and not f.startswith("."):
                    found.append(Entry(name=(here / f).relative_to(root).as_posix(), path=here / f, kind="onnx"))
    if not found:
        what = "no refine.json" + (" and no .onnx model" if plan_tp is not None else " (add --plan tp:N for plain ONNX models)")
        raise InputError(root, f"holds no entry to verify: {what} below it")
    return sorted(found, key=lambda e: e.name)


