"""A corpus of parallel code spelled the way frameworks spell it (issue 38): each entry a correct
rank program, its sequential model and a bug twin, written in the style of HF transformers,
torchtitan, Megatron-Core, DeepSpeed, vLLM or nanoGPT. refine must VERIFY every correct entry
and REFUTE every twin, whatever the spelling (tests/test_spellings.py; the whole table:
benchmarks/spellings.py).

Each module of this package lists its entries in `SPELLINGS`; `corpus()` gathers them."""

from __future__ import annotations

import importlib
import pkgutil
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

Factory = Callable[[int], torch.nn.Module]


@dataclass(frozen=True)
class Spelling:
    """One correct program and its bug twin. `seq()` builds the sequential model, `rank(r)` and
    `twin(r)` rank r's module (built while rank r's fake process group is up), `inputs()` the
    example inputs (the same every call)."""

    name: str
    style: str  # hf, torchtitan, megatron, deepspeed, vllm, nanogpt
    pattern: str  # what the spelling is, in a few words
    bug_class: int  # docs/bugs.md class of the twin
    bug: str  # what the twin gets wrong
    world: int
    seq: Callable[[], torch.nn.Module]
    rank: Factory
    twin: Factory
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    input_layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    output_layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    train: bool = False
    known_gap: str = ""  # non-empty: the correct program is UNPROVEN today, for this reason (never refuted)

    def export(self, out: Path, buggy: bool = False) -> Path:
        """The model directory of the correct program (or of the twin), written under `out`."""
        from refine.exporters import export

        target = out / (f"{self.name}__twin" if buggy else self.name)
        if target.exists():
            shutil.rmtree(target)
        export(self.seq(), self.twin if buggy else self.rank, self.inputs(), self.world, target,
               input_layouts=self.input_layouts, output_layouts=self.output_layouts, train=self.train, workers=0)
        return target


def corpus() -> list[Spelling]:
    """Every entry of every module of this package, in module order."""
    found: list[Spelling] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        found.extend(importlib.import_module(f"{__name__}.{info.name}").SPELLINGS)
    return found


def seeded(build: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    """`build()` under a fixed seed: the sequential model and every rank hold the same weights."""
    torch.manual_seed(seed)
    return build()


def group(world: int) -> list[int]:
    return list(range(world))
