"""`refine zoo --framework transformers`: HF model types under HF's own TP plan, one entry each.

An entry `hf_{model_type}_tp{N}[_train]` is the export of exporters/frameworks/transformers.py
(a tiny config of the model type, HF's plan as shipped), forward or one training step, and it
must verify: HF's plan is taken to be correct, so a REFUTED entry is either a refine defect or
a bug in transformers (`--check` tells which: a numeric mismatch of torch's own TP run is
transformers'). Selecting is done on configs only (transformers_configs.validate, no model
built): a model type whose tiny config does not build, that ships no plan, has no causal-LM
class, is a mixture-of-experts model (issue 42) or whose heads the plan cannot split is left
out, each with its reason (`left_out`). Entries are written by refine.exporters.zoo.entries'
`generate`, as the zoo's are (all or nothing, kept when current).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from refine.exporters.errors import ExportError
from refine.exporters.frameworks.entry import FrameworkEntry
from refine.exporters.frameworks.transformers_configs import TINY, model_types_with_plan, validate

TPS = (2, 4, 8)
STEPS = ("infer", "train")
DEFAULT_TPS = (2,)


@dataclass(frozen=True)
class TransformersEntry(FrameworkEntry):
    """One model type of HF's zoo at one TP degree and step (its plan as shipped, correct)."""

    model_type: str
    tp: int
    step: str = "infer"
    seed: int = 0
    ep: bool = False  # and HF's expert-parallel plan over the same ranks (AllReduceEP, `batched_mm` experts)

    @property
    def experts(self) -> str | None:
        """HF's experts implementation: `batched_mm` under EP (the owned-rows layouts; HF's default
        `grouped_mm`, which sorts the routes by local id, verifies too: docs/moe.md), else the model's."""
        return "batched_mm" if self.ep else None

    @property
    def name(self) -> str:
        return f"hf_{self.model_type}_tp{self.tp}{'_ep' if self.ep else ''}{'_train' if self.train else ''}"

    def expectation(self) -> dict[str, str]:
        return {"verdict": "verified"}

    def describe(self) -> str:
        return "verified"

    def validate(self) -> None:
        validate(self.model_type, TINY, self.tp, train=self.train, ep=self.tp if self.ep else None, experts=self.experts)

    def manifest(self) -> dict[str, object]:
        """The `zoo` record export_model_type writes into export.json (is_current compares it)."""
        return {"framework": "transformers", "model": self.model_type, "config": TINY, "tp": self.tp,
                "seed": self.seed, "train": self.train, "flat": False, "ep": self.ep, "experts": self.experts, "bug": None}

    def export_to(self, out: Path) -> None:
        from refine.exporters.frameworks.transformers import export_model_type

        export_model_type(self.model_type, self.tp, out, seed=self.seed, train=self.train,
                          ep=self.tp if self.ep else None, experts=self.experts)


def _split(values: str | None, what: str, known: Iterable[str]) -> list[str]:
    known = list(known)
    items = [v.strip() for v in (values or "").split(",") if v.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise ExportError(f"unknown {what} {', '.join(map(repr, unknown)) or '(empty)'}"
                          + (f" (known: {', '.join(known)})" if len(known) < 20 else
                             " (`refine zoo --framework transformers --list` lists them)"))
    return list(dict.fromkeys(items))


def select(model_types: str | None = None, tps: str | None = None, steps: str | None = None,
           seed: int = 0, ep: bool = False) -> tuple[list[TransformersEntry], dict[str, str]]:
    """The entries of the chosen model types (default and `all`: every type with a plan), TP
    degrees (default 2) and steps (default infer), with `ep` under HF's expert-parallel plan
    too (the types that ship one), and the chosen model types left out with their reasons
    (model type -> one line)."""
    with_plan = model_types_with_plan()
    chosen = with_plan if model_types in (None, "all") else _split(model_types, "model type", with_plan)
    degrees = [int(t) for t in _split(tps or ",".join(map(str, DEFAULT_TPS)), "TP degree", map(str, TPS))]
    chosen_steps = _split(steps or "infer", "step", STEPS)
    entries: list[TransformersEntry] = []
    skipped: dict[str, str] = {}
    for model_type in chosen:
        for step in chosen_steps:
            for tp in degrees:
                entry = TransformersEntry(model_type, tp, step, seed, ep)
                try:
                    entry.validate()
                except ExportError as exc:
                    skipped.setdefault(entry.name, str(exc))
                    continue
                entries.append(entry)
    if not entries:
        raise ExportError("no entry: " + "; ".join(f"{k}: {v}" for k, v in list(skipped.items())[:3]))
    return entries, skipped
