"""`refine zoo`: a directory of zoo entries, model x TP x plan, and buggy twins of each.

An entry is a model directory named `{model}_tp{N}[_sp][_train]` (the correct export; `_train`:
one training step, loss and every gradient, rather than the forward) or
`{model}_tp{N}[_sp][_train]__{bug}` (the same model with one bug of exporters/bugs.py injected
into its rank modules). Bugs of the backward pass are exported as training steps only. Its refine.json carries the verdict it must get: `verified` for a correct
export, `refuted` for a bug (a real bug must never verify, and the numeric search finds it).

The mesh plans `dp` and `dpsp` (selected by name only, or as `--mesh dp=D,tp=T`: not in the
default zoo) are the TP and TP+SP plans within each row of a DP x TP mesh (exporters/mesh.py),
DP 2 unless chosen: entries `{model}_tp{N}_dp{D}[_sp]` and their twins `..__mesh_wrong_group` (a
collective over the DP group instead of the TP group; under SP the reduce-scatter, so only where
D == N). The training step is the `dp` plan's only, `{model}_tp{N}_dp{D}_train` and its twin
`..__mesh_grad_over_tp` (the gradients' DP all-reduce over the TP group): refine does not prove
the TP+SP x DP step yet (UNPROVEN), so `dpsp` has no training entries. The `fsdp` plan (by name
only) is the FSDP / ZeRO-3 training step of exporters/data_parallel.py, DP 2 unless chosen and no
TP: `{model}_dp{D}_fsdp_train` and its twins `..__fsdp_grad_not_reduced`, `..__fsdp_grad_avg`; it
has no forward entries. A mesh or FSDP twin's refine.json also names the sequential node where
refine must report the failure.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from exporters.configs import check_plan, validate, zoo_config
from exporters.errors import ExportError

MODELS = ("llama", "gpt2", "qwen2")
TPS = (2, 4, 8)
PLANS = ("tp", "sp")
MESH_PLANS = ("dp", "dpsp")  # TP (TP+SP) within each row of a DP x TP mesh: exporters/mesh.py
FSDP_PLANS = ("fsdp",)  # the FSDP / ZeRO-3 training step over DP ranks: exporters/data_parallel.py
DP_PLANS = (*MESH_PLANS, *FSDP_PLANS)  # the plans that take DP degrees
# (plan, step) pairs the zoo leaves out, and why (a selection of only these is an error)
UNSUPPORTED = {("dpsp", "train"): "the TP+SP x DP training step is not in the zoo: refine cannot prove it yet "
                                  "(UNPROVEN); the TP x DP step is --plans dp --steps train",
               ("fsdp", "infer"): "fsdp is a training-step plan (FSDP shards the parameters for the step): "
                                  "it has no forward entries; pass --steps train"}
DPS = (2, 4, 8)
DEFAULT_DP = 2
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
MESH_BUG_NAMES = ("mesh_wrong_group",)  # exporters/mesh.py MESH_BUGS of the forward, without torch
MESH_TRAIN_BUG_NAMES = ("mesh_grad_over_tp",)  # ... and of the training step
FSDP_BUG_NAMES = ("fsdp_grad_not_reduced", "fsdp_grad_avg")  # exporters/data_parallel.py, `fsdp=True`
# where `refine verify` names a mesh twin's first failure: block 0's residual add after its MLP,
# the first sequential node the sum over the wrong group feeds (every zoo model, TP and TP+SP);
# a twin whose gradients are reduced over the wrong group (or not reduced, or averaged): a node
# of the token embedding's backward (every zoo model; mesh: TP 2 to 8)
_EMBEDDING_GRAD = {"llama": "model.embed_tokens (backward)/Transpose_3",
                   "qwen2": "model.embed_tokens (backward)/Transpose_3", "gpt2": "wte (backward)/Add"}
MESH_BUG_NODES = {"mesh_wrong_group": {"llama": "model.layers.0/Add_2", "qwen2": "model.layers.0/Add_2",
                                       "gpt2": "h.0/Add_2"},
                  "mesh_grad_over_tp": _EMBEDDING_GRAD}
FSDP_BUG_NODES = {"fsdp_grad_not_reduced": _EMBEDDING_GRAD, "fsdp_grad_avg": _EMBEDDING_GRAD}
_DP_BUG_NAMES = {*MESH_BUG_NAMES, *MESH_TRAIN_BUG_NAMES, *FSDP_BUG_NAMES}  # the mesh and FSDP plans' only


@dataclass(frozen=True)
class ZooEntry:
    """One zoo entry: a zoo model, its TP degree (1 under FSDP) and plan (and DP degree, on a mesh
    or under FSDP), and the bug injected (None: correct)."""

    model: str
    tp: int
    plan: Literal["tp", "sp", "dp", "dpsp", "fsdp"]
    bug: str | None = None
    config: str = "tiny"
    seed: int = 0
    step: Literal["infer", "train"] = "infer"
    dp: int | None = None  # the mesh and FSDP plans' DP degree (DEFAULT_DP if None)

    @property
    def sp(self) -> bool:
        return self.plan in ("sp", "dpsp")

    @property
    def fsdp(self) -> bool:
        return self.plan in FSDP_PLANS

    @property
    def dp_degree(self) -> int | None:
        """The DP degree of a mesh or FSDP plan; None for a TP plan."""
        return (self.dp or DEFAULT_DP) if self.plan in DP_PLANS else None

    @property
    def name(self) -> str:
        train = "_train" if self.step == "train" else ""
        if self.fsdp:
            base = f"{self.model}_dp{self.dp_degree}_fsdp{train}"
        else:
            dp = f"_dp{self.dp_degree}" if self.dp_degree else ""
            base = f"{self.model}_tp{self.tp}{dp}{'_sp' if self.sp else ''}{train}"
        return f"{base}__{self.bug}" if self.bug else base

    @property
    def expect(self) -> str:
        return "refuted" if self.bug and self.bug not in CONTROL_NAMES else "verified"

    @property
    def expect_node(self) -> str | None:
        """The sequential node the failure must name, where the zoo knows it (mesh and FSDP twins)."""
        return {**MESH_BUG_NODES, **FSDP_BUG_NODES}.get(self.bug or "", {}).get(self.model)

    def expectation(self) -> dict[str, str]:
        """refine.json's `expect`."""
        node = self.expect_node
        return {"verdict": self.expect, **({"node": node} if node else {})}

    def describe(self) -> str:
        """The expectation in words: `verified`, `refuted`, `refuted at NODE`."""
        node = self.expect_node
        return f"{self.expect} at {node}" if node else self.expect

    def validate(self) -> None:
        """An ExportError if the plan does not split the model (pure Python: before torch)."""
        cfg = zoo_config(self.model, self.config) if self.fsdp else validate(self.model, self.config, self.tp, self.sp)
        if self.dp_degree:
            check_plan("data parallelism", MODELS, self.model, self.dp_degree, "DP", cfg.batch, "batch", self.config)

    def default_bugs(self) -> tuple[str, ...]:
        """The twins of this plan and step when no bug is chosen."""
        if self.fsdp:
            return FSDP_BUG_NAMES
        if self.dp_degree:
            return MESH_TRAIN_BUG_NAMES if self.step == "train" else MESH_BUG_NAMES
        return TRAIN_BUG_NAMES if self.step == "train" else BUG_NAMES

    def applies(self, bug: str) -> bool:
        """Whether `bug` (or `none`) has an entry of this model, plan and step."""
        if self.dp_degree:  # under SP the wrong group's reduce-scatter keeps its output's shape only if D == T
            return bug == CORRECT or (bug in self.default_bugs()
                                      and (bug not in MESH_BUG_NAMES or not self.sp or self.dp_degree == self.tp))
        return not ((bug in GPT2_ONLY and self.model != "gpt2") or (bug in SP_ONLY and self.plan != "sp")
                    or (bug in TRAIN_ONLY and self.step != "train") or bug in _DP_BUG_NAMES)

    def manifest(self) -> dict[str, object]:
        """The `zoo` record of export.json: how to rebuild this entry."""
        if self.fsdp:  # (exporters/data_parallel.py's record)
            return {"model": self.model, "config": self.config, "dp": self.dp_degree, "seed": self.seed,
                    "bug": self.bug, "train": True, "fsdp": True}
        if self.dp_degree:  # (exporters/mesh.py's record)
            return {"model": self.model, "config": self.config, "mesh": {"dp": self.dp_degree, "tp": self.tp},
                    "sp": self.sp, "seed": self.seed, "bug": self.bug, "train": self.step == "train"}
        return {"model": self.model, "config": self.config, "tp": self.tp, "sp": self.plan == "sp",
                "seed": self.seed, "bug": self.bug, "train": self.step == "train"}


def _split(values: str | Iterable[str] | None, known: Iterable[str], what: str,
           default: Iterable[str] | None = None) -> list[str]:
    """A comma-separated (or repeated) selection, checked against `known`; None: `default` (all of
    the known ones if None)."""
    known = list(known)
    if values is None:
        return list(known if default is None else default)
    items = [item.strip() for value in ([values] if isinstance(values, str) else values) for item in value.split(",") if item.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise ExportError(f"unknown {what} {', '.join(map(repr, unknown)) or '(empty)'} (known: {', '.join(known)})")
    return list(dict.fromkeys(items))


def _degrees(values: str | int | Iterable[str | int] | None, known: tuple[int, ...], what: str,
             default: tuple[int, ...] | None = None) -> list[int]:
    """A selection of degrees (`_split` of their texts)."""
    texts = None if values is None else [str(v) for v in ([values] if isinstance(values, (str, int)) else values)]
    return [int(v) for v in _split(texts, [str(k) for k in known], what,
                                   None if default is None else [str(d) for d in default])]


def _plans_and_steps(plans: str | Iterable[str] | None,
                     steps: str | Iterable[str] | None) -> tuple[list[str], list[str]]:
    """The chosen plans (default: the TP plans) and steps (default: infer)."""
    return (_split(plans, (*PLANS, *DP_PLANS), "plan", default=PLANS),
            _split(steps if steps is not None else "infer", STEPS, "step"))


def left_out(plans: str | Iterable[str] | None = None, steps: str | Iterable[str] | None = None) -> list[str]:
    """Why chosen plan and step pairs have no entries (UNSUPPORTED), one line each."""
    chosen_plans, chosen_steps = _plans_and_steps(plans, steps)
    return [UNSUPPORTED[(plan, step)] for step in chosen_steps for plan in chosen_plans
            if (plan, step) in UNSUPPORTED]


def parse_mesh(text: str) -> tuple[int, int]:
    """`dp=D,tp=T` (either order) as (D, T): the mesh spelling of `--plans dp --dp D --tp T`. The
    sizes are checked against the zoo's degrees by `select`; an ExportError for a bad spelling."""
    sizes: dict[str, int] = {}
    for item in text.split(","):
        dim, eq, size = (part.strip() for part in item.partition("="))
        if not eq or dim in sizes:
            raise ExportError(f"--mesh {text!r}: expected dp=D,tp=T, each dimension once")
        if not size.isdigit() or int(size) < 1:
            raise ExportError(f"--mesh {text!r}: the size of {dim or '(no name)'} must be a whole number >= 1, "
                              f"got {size!r}")
        sizes[dim] = int(size)
    if set(sizes) != {"dp", "tp"}:
        raise ExportError(f"--mesh {text!r}: the dimensions must be exactly dp and tp, got {', '.join(sizes)}")
    if sizes["dp"] * sizes["tp"] < 2:
        raise ExportError(f"--mesh {text!r}: a mesh of one rank is no parallel plan")
    return sizes["dp"], sizes["tp"]


def mesh_selection(mesh: str, plans: str | None, dps: str | None, tps: str | None) -> tuple[str, str, str]:
    """`refine zoo --mesh dp=D,tp=T` as the selection it spells, (plans, DP, TP) for `select`: the
    chosen mesh plans (default dp) at DP D and TP T. An ExportError if the degrees are given twice
    or a chosen plan is no mesh plan."""
    if dps is not None or tps is not None:
        raise ExportError("--mesh dp=D,tp=T gives the DP and TP degrees: drop --dp and --tp")
    chosen = _split(plans, (*PLANS, *DP_PLANS), "plan", default=MESH_PLANS[:1])
    if set(chosen) - set(MESH_PLANS):
        raise ExportError(f"--mesh is for the mesh plans ({', '.join(MESH_PLANS)}): drop --mesh or the other plans")
    dp, tp = parse_mesh(mesh)
    return ",".join(chosen), str(dp), str(tp)


def select(models: str | Iterable[str] | None = None, tps: str | int | Iterable[str | int] | None = None,
           plans: str | Iterable[str] | None = None, bugs: str | Iterable[str] | None = None,
           config: str = "tiny", seed: int = 0, steps: str | Iterable[str] | None = None,
           dps: str | int | Iterable[str | int] | None = None) -> list[ZooEntry]:
    """The entries of a slice of the zoo, in a stable order. `bugs` names bugs of
    exporters/bugs.py, exporters/mesh.py and exporters/data_parallel.py (FSDP), and `none` (the
    correct export); a bug that does not apply to a model (GPT-2 only), a plan (SP only; mesh bugs:
    mesh plans only; FSDP bugs: fsdp only) or a step (backward bugs: training steps only) is left
    out there. `plans` defaults to the TP plans; the mesh and FSDP plans take the DP degrees `dps`
    (default DEFAULT_DP), and fsdp no TP degree (its entries come after a model's others).
    `steps` (default: infer) picks forward exports, training steps or both; by default each entry
    gets its plan's and step's twins (`ZooEntry.default_bugs`). A plan and step pair in
    UNSUPPORTED is left out (`left_out` says why). An empty slice is an ExportError."""
    chosen_models = _split(models, MODELS, "model")
    chosen_tps = _degrees(tps, TPS, "TP degree")
    chosen_plans, chosen_steps = _plans_and_steps(plans, steps)
    chosen_dps = _degrees(dps, DPS, "DP degree", default=(DEFAULT_DP,))
    if dps is not None and not set(chosen_plans) & set(DP_PLANS):
        raise ExportError(f"a DP degree is for the mesh plans ({', '.join(MESH_PLANS)}) and {', '.join(FSDP_PLANS)}, "
                          "and none is chosen")
    if tps is not None and set(chosen_plans) <= set(FSDP_PLANS):
        raise ExportError(f"a TP degree is for the TP and mesh plans: {', '.join(FSDP_PLANS)} has none (DP only)")
    known = (CORRECT, *BUG_NAMES, *TRAIN_BUG_NAMES, *CONTROL_NAMES, *MESH_BUG_NAMES, *MESH_TRAIN_BUG_NAMES,
             *FSDP_BUG_NAMES)
    chosen_bugs = _split(bugs, known, "bug") if bugs is not None else None
    pairs = [(tp, plan) for tp in chosen_tps for plan in chosen_plans if plan not in FSDP_PLANS]
    pairs += [(1, plan) for plan in chosen_plans if plan in FSDP_PLANS]  # (one world: DP ranks only)
    entries = []
    for step in chosen_steps:
        for model in chosen_models:
            for tp, plan in pairs:
                if (plan, step) in UNSUPPORTED:
                    continue
                for dp in chosen_dps if plan in DP_PLANS else [None]:
                    entry = ZooEntry(model, tp, plan, None, config, seed, step, dp)  # type: ignore[arg-type]
                    entry.validate()
                    entries += [replace(entry, bug=None if bug == CORRECT else bug)
                                for bug in chosen_bugs or [CORRECT, *entry.default_bugs()] if entry.applies(bug)]
    if not entries:
        reasons = left_out(plans, steps)
        if len(reasons) == len(chosen_plans) * len(chosen_steps):  # nothing chosen is in the zoo
            raise ExportError("; ".join(reasons))
        raise ExportError("the selection holds no zoo entry (the chosen bugs apply to none of the chosen models, "
                          "plans and steps)")
    return entries


def _manifest_of(entry_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((entry_dir / "export.json").read_text()).get("zoo")
    except (OSError, ValueError, AttributeError):
        return None


def _expect_of(entry_dir: Path) -> object:
    try:
        return json.loads((entry_dir / "refine.json").read_text()).get("expect")
    except (OSError, ValueError, AttributeError):
        return None


def is_current(entry: ZooEntry, out: Path) -> bool:
    """The entry's directory exists, complete, from the same zoo recipe, with the same expectation."""
    entry_dir = out / entry.name
    recorded = _manifest_of(entry_dir)
    return (isinstance(recorded, dict) and all(recorded.get(k) == v for k, v in entry.manifest().items())
            and _expect_of(entry_dir) == entry.expectation())


def export_entry(entry: ZooEntry, out: Path) -> Path:
    """Export one entry into `out/<name>` (replacing an older one), all or nothing."""
    import exporters
    from exporters import bugs

    entry.validate()
    target = out / entry.name
    if target.exists() and not (target / "refine.json").is_file():
        raise ExportError(f"{target}: exists and is not a model directory; not replacing it")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=out))
    try:
        work = scratch / entry.name
        if entry.fsdp:
            from exporters.data_parallel import export_data_parallel

            export_data_parallel(entry.model, entry.config, entry.dp_degree or DEFAULT_DP, work, entry.seed,
                                 train=True, fsdp=True, bug=entry.bug)
        elif entry.dp_degree:
            from exporters.mesh import export_mesh

            export_mesh(entry.model, entry.config, entry.tp, entry.dp_degree, work, entry.seed, sp=entry.sp,
                        bug=entry.bug, train=entry.step == "train")
        else:
            bug = (bugs.BUGS.get(entry.bug) or bugs.CONTROLS[entry.bug]) if entry.bug is not None else None
            exporters.export_model(entry.model, entry.config, entry.tp, entry.sp, work, entry.seed, bug=bug,
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
        data["expect"] = entry.expectation()
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
