"""`refine zoo`: a directory of zoo entries, model x TP x plan, and buggy twins of each.

An entry is a model directory named `{model}_tp{N}[_sp][_train]` (the correct export; `_train`:
one training step, loss and every gradient, rather than the forward) or
`{model}_tp{N}[_sp][_train]__{bug}` (the same model with one bug of exporters/bugs.py injected
into its rank modules). Bugs of the backward pass are exported as training steps only. Its refine.json carries the verdict it must get: `verified` for a correct
export, `refuted` for a bug (a real bug must never verify, and the numeric search finds it).

Selecting a slice (`models`, `tps`, `plans`, `bugs`) is pure Python, so `refine zoo` rejects
a bad selection before importing torch. An entry is written all or nothing (exported into a
hidden sibling, its expectation added, then renamed into place); an entry already present with
the same zoo manifest is kept unless `force`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from exporters.configs import validate
from exporters.errors import ExportError

MODELS = ("llama", "gpt2", "qwen2")
TPS = (2, 4, 8)
PLANS = ("tp", "sp")
STEPS = ("infer", "train")
CORRECT = "none"  # the bug selection's name for the correct export
BUG_NAMES = ("missing_allreduce", "wrong_reduce_op", "bias_before_allreduce", "kv_wrong_offset",
             "global_head_count", "wrong_group", "avg_allreduce")  # exporters/bugs.py, without torch
TRAIN_BUG_NAMES = ("missing_grad_allreduce", "grad_avg_allreduce", "sp_norm_grad_unreduced")  # backward bugs
GPT2_ONLY = {"bias_before_allreduce", "global_head_count"}
SP_ONLY = {"sp_norm_grad_unreduced", "sp_norm_grad_reduced"}
# the injection machinery with the bug taken out: must verify (selectable, not in the default zoo)
CONTROL_NAMES = ("faulty_rowwise_none", "kv_own_offset", "faulty_colwise_sum", "sp_norm_grad_reduced")
TRAIN_ONLY = {*TRAIN_BUG_NAMES, "faulty_colwise_sum", "sp_norm_grad_reduced"}  # no effect on a forward export


@dataclass(frozen=True)
class ZooEntry:
    """One zoo entry: a zoo model, its TP degree and plan, and the bug injected (None: correct)."""

    model: str
    tp: int
    plan: Literal["tp", "sp"]
    bug: str | None = None
    config: str = "tiny"
    seed: int = 0
    step: Literal["infer", "train"] = "infer"

    @property
    def name(self) -> str:
        base = f"{self.model}_tp{self.tp}{'_sp' if self.plan == 'sp' else ''}{'_train' if self.step == 'train' else ''}"
        return f"{base}__{self.bug}" if self.bug else base

    @property
    def expect(self) -> str:
        return "refuted" if self.bug and self.bug not in CONTROL_NAMES else "verified"

    def manifest(self) -> dict[str, object]:
        """The `zoo` record of export.json: how to rebuild this entry."""
        return {"model": self.model, "config": self.config, "tp": self.tp, "sp": self.plan == "sp",
                "seed": self.seed, "bug": self.bug, "train": self.step == "train"}


def _split(values: str | Iterable[str] | None, known: Iterable[str], what: str) -> list[str]:
    """A comma-separated (or repeated) selection, checked against `known`; None: all of them."""
    known = list(known)
    if values is None:
        return known
    items = [item.strip() for value in ([values] if isinstance(values, str) else values) for item in value.split(",") if item.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise ExportError(f"unknown {what} {', '.join(map(repr, unknown)) or '(empty)'} (known: {', '.join(known)})")
    return list(dict.fromkeys(items))


def select(models: str | Iterable[str] | None = None, tps: str | int | Iterable[str | int] | None = None,
           plans: str | Iterable[str] | None = None, bugs: str | Iterable[str] | None = None,
           config: str = "tiny", seed: int = 0, steps: str | Iterable[str] | None = None) -> list[ZooEntry]:
    """The entries of a slice of the zoo, in a stable order. `bugs` names bugs of
    exporters/bugs.py and `none` (the correct export); a bug that does not apply to a model
    (GPT-2 only), a plan (SP only) or a step (backward bugs: training steps only) is left out
    there. `steps` (default: infer) picks forward exports, training steps or both; by default
    forward entries get the forward bugs and training entries the backward ones. An empty
    slice is an ExportError."""
    chosen_models = _split(models, MODELS, "model")
    tp_texts = None if tps is None else [str(t) for t in ([tps] if isinstance(tps, (str, int)) else tps)]
    chosen_tps = [int(t) for t in _split(tp_texts, [str(t) for t in TPS], "TP degree")]
    chosen_plans = _split(plans, PLANS, "plan")
    chosen_steps = _split(steps if steps is not None else "infer", STEPS, "step")
    known = (CORRECT, *BUG_NAMES, *TRAIN_BUG_NAMES, *CONTROL_NAMES)
    chosen_bugs = _split(bugs, known, "bug") if bugs is not None else None
    entries = []
    for step in chosen_steps:
        step_bugs = chosen_bugs or [CORRECT, *(TRAIN_BUG_NAMES if step == "train" else BUG_NAMES)]
        for model in chosen_models:
            for tp in chosen_tps:
                for plan in chosen_plans:
                    validate(model, config, tp, plan == "sp")
                    for bug in step_bugs:
                        if ((bug in GPT2_ONLY and model != "gpt2") or (bug in SP_ONLY and plan != "sp")
                                or (bug in TRAIN_ONLY and step != "train")):
                            continue
                        entries.append(ZooEntry(model, tp, plan, None if bug == CORRECT else bug, config, seed,  # type: ignore[arg-type]
                                                step))  # type: ignore[arg-type]
    if not entries:
        raise ExportError("the selection holds no zoo entry (the chosen bugs apply to none of the chosen models)")
    return entries


def _manifest_of(entry_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((entry_dir / "export.json").read_text()).get("zoo")
    except (OSError, ValueError, AttributeError):
        return None


def is_current(entry: ZooEntry, out: Path) -> bool:
    """The entry's directory exists, complete, from the same zoo recipe."""
    entry_dir = out / entry.name
    recorded = _manifest_of(entry_dir)
    return ((entry_dir / "refine.json").is_file() and isinstance(recorded, dict)
            and all(recorded.get(k) == v for k, v in entry.manifest().items()))


def export_entry(entry: ZooEntry, out: Path) -> Path:
    """Export one entry into `out/<name>` (replacing an older one), all or nothing."""
    import exporters
    from exporters import bugs

    validate(entry.model, entry.config, entry.tp, entry.plan == "sp")
    target = out / entry.name
    if target.exists() and not (target / "refine.json").is_file():
        raise ExportError(f"{target}: exists and is not a model directory; not replacing it")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=out))
    try:
        work = scratch / entry.name
        bug = (bugs.BUGS.get(entry.bug) or bugs.CONTROLS[entry.bug]) if entry.bug is not None else None
        exporters.export_model(entry.model, entry.config, entry.tp, entry.plan == "sp", work, entry.seed, bug=bug,
                               train=entry.step == "train")
        _add_expectation(work, entry)
        if target.exists():
            target.replace(scratch / "old")  # removed with the scratch directory
        work.replace(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _rewrite_json(path: Path, update: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    update(data)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _add_expectation(entry_dir: Path, entry: ZooEntry) -> None:
    from refine.config import CONFIG_NAME, ModelConfig

    def update(data: dict) -> None:
        data["expect"] = {"verdict": entry.expect}
        ModelConfig.model_validate(data)

    _rewrite_json(entry_dir / CONFIG_NAME, update)


@dataclass
class GenerateResult:
    """What `generate` did per entry: written (seconds), kept (already current), or failed."""

    written: dict[str, float]
    kept: list[str]
    failed: dict[str, str]


def generate(entries: list[ZooEntry], out: Path, force: bool = False,
             on_entry: Callable[[ZooEntry, str], None] | None = None) -> GenerateResult:
    """Export every entry not already current under `out` (all, with `force`). An entry that
    fails to export is recorded and the others go on."""
    result = GenerateResult({}, [], {})
    for entry in entries:
        if not force and is_current(entry, out):
            result.kept.append(entry.name)
            if on_entry:
                on_entry(entry, "kept")
            continue
        start = time.perf_counter()
        try:
            export_entry(entry, out)
        except Exception as exc:  # noqa: BLE001 - one entry's failure must not stop the zoo
            result.failed[entry.name] = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            if on_entry:
                on_entry(entry, "failed")
            continue
        result.written[entry.name] = time.perf_counter() - start
        if on_entry:
            on_entry(entry, "written")
    return result
