"""`refine zoo --framework transformers`: HF model types under HF's own TP plan, one entry each.

An entry `hf_{model_type}_tp{N}[_ep[_a2a][_grouped]][_train]` is the export of exporters/frameworks/transformers.py
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
    ep: bool = False  # and HF's expert-parallel plan over the same ranks (AllReduceEP)
    ep_experts: str = "batched_mm"  # HF's experts implementation under EP: batched_mm or grouped_mm
    ep_implementation: str = "all_reduce"  # HF's dispatch under EP: all_reduce (AllReduceEP) or all_to_all (AllToAllEP)

    @property
    def experts(self) -> str | None:
        """HF's experts implementation under EP (`batched_mm`: the owned-rows layouts; HF's default
        `grouped_mm`: each side sorts the routes, docs/moe.md), else the model's."""
        return self.ep_experts if self.ep else None

    @property
    def name(self) -> str:
        ep = ("_ep" + ("_a2a" if self.ep_implementation == "all_to_all" else "")
              + ("_grouped" if self.ep_experts == "grouped_mm" else "")) if self.ep else ""
        return f"hf_{self.model_type}_tp{self.tp}{ep}{'_train' if self.train else ''}"

    def expectation(self) -> dict[str, str]:
        return {"verdict": "verified"}

    def describe(self) -> str:
        return "verified"

    def validate(self) -> None:
        validate(self.model_type, TINY, self.tp, train=self.train, ep=self.tp if self.ep else None, experts=self.experts,
                 ep_implementation=self.dispatch)

    @property
    def dispatch(self) -> str | None:
        """HF's expert-parallel dispatch, as export_model_type takes it (None: the default, all_reduce)."""
        return self.ep_implementation if self.ep and self.ep_implementation != "all_reduce" else None

    def manifest(self) -> dict[str, object]:
        """The `zoo` record export_model_type writes into export.json (is_current compares it)."""
        return {"framework": "transformers", "model": self.model_type, "config": TINY, "tp": self.tp,
                "seed": self.seed, "train": self.train, "flat": False, "ep": self.ep, "experts": self.experts, "bug": None,
                **({"ep_implementation": self.dispatch} if self.dispatch else {})}

    def export_to(self, out: Path) -> None:
        from refine.exporters.frameworks.transformers import export_model_type

        export_model_type(self.model_type, self.tp, out, seed=self.seed, train=self.train,
                          ep=self.tp if self.ep else None, experts=self.experts, ep_implementation=self.dispatch)


def _split(values: str | None, what: str, known: Iterable[str]) -> list[str]:
    known = list(known)
    items = [v.strip() for v in (values or "").split(",") if v.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise ExportError(f"unknown {what} {', '.join(map(repr, unknown)) or '(empty)'}"
                          + (f" (known: {', '.join(known)})" if len(known) < 20 else
                             " (`refine zoo --framework transformers --list` lists them)"))
    return list(dict.fromkeys(items))


EP_EXPERTS = ("batched_mm", "grouped_mm")
EP_DISPATCHES = ("all_reduce", "all_to_all")


def select(model_types: str | None = None, tps: str | None = None, steps: str | None = None,
           seed: int = 0, ep: bool = False, experts: str | None = None,
           ep_implementations: str | None = None) -> tuple[list[TransformersEntry], dict[str, str]]:
    """The entries of the chosen model types (default and `all`: every type with a plan), TP
    degrees (default 2) and steps (default infer), with `ep` under HF's expert-parallel plan
    too (the types that ship one; `experts`: HF's experts implementations there, default
    batched_mm; `ep_implementations`: HF's dispatches, default all_reduce), and the chosen model
    types left out with their reasons (model type -> one line)."""
    for flag, given in (("--experts", experts), ("--ep-implementation", ep_implementations)):
        if given is not None and not ep:
            raise ExportError(f"{flag} chooses HF's expert parallelism under --ep: add --ep")
    chosen_experts = _split(experts or "batched_mm", "experts implementation", EP_EXPERTS)
    chosen_dispatches = _split(ep_implementations or "all_reduce", "expert-parallel dispatch", EP_DISPATCHES)
    with_plan = model_types_with_plan()
    chosen = with_plan if model_types in (None, "all") else _split(model_types, "model type", with_plan)
    degrees = [int(t) for t in _split(tps or ",".join(map(str, DEFAULT_TPS)), "TP degree", map(str, TPS))]
    chosen_steps = _split(steps or "infer", "step", STEPS)
    entries: list[TransformersEntry] = []
    skipped: dict[str, str] = {}
    for model_type in chosen:
        for step in chosen_steps:
            for tp in degrees:
                for implementation in chosen_experts:
                    for dispatch in chosen_dispatches:
                        entry = TransformersEntry(model_type, tp, step, seed, ep, implementation, dispatch)
                        try:
                            entry.validate()
                        except ExportError as exc:
                            skipped.setdefault(entry.name, str(exc))
                            continue
                        entries.append(entry)
    if not entries:
        raise ExportError("no entry: " + "; ".join(f"{k}: {v}" for k, v in list(skipped.items())[:3]))
    return entries, skipped
