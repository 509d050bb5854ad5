"""`refine zoo --framework torchtitan`: torchtitan's Llama 3 and Qwen3-MoE plans and their twins, one entry each.

An entry `tt_{model}_{plan}[_{backend}][_train][__{bug}]` is the export of
exporters/frameworks/torchtitan.py (config tiny, tiny-cp for CP: torchtitan's own parallelize path), forward or one
training step, with one twin of exporters/frameworks/torchtitan_bugs.py or none; its refine.json
carries the verdict it must get (`verified`, `refuted` for a bug). Pure Python: a bad selection is
rejected before torch is imported. Entries are written by refine.exporters.zoo.entries' `generate`,
as the zoo's are (all or nothing, kept when current).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refine.exporters.errors import ExportError
from refine.exporters.frameworks.entry import FrameworkEntry
from refine.exporters.frameworks.torchtitan_bugs import BUGS, torchtitan_bug


# --- refine zoo --framework torchtitan -----------------------------------------------------------------

STEPS = ("infer", "train")


@dataclass(frozen=True)
class TorchtitanEntry(FrameworkEntry):
    """One zoo entry: torchtitan's Llama 3 or Qwen3-MoE (config tiny) under a plan, forward or one
    training step, with an optional twin; named `tt_{model}_{plan}[_{backend}][_train][__{bug}]`."""

    plan: str  # a key of PLANS: "tp2sp" (TP 2 + SP), "tp2" (TP 2), "pp2" (PP 2, 2 micro-batches), ..., "qwen3_moe_tp2"
    backend: str = "spmd_types"
    step: str = "infer"
    bug: str | None = None
    seed: int = 0

    @property
    def options(self) -> dict[str, object]:
        return PLANS[self.plan]

    @property
    def config(self) -> str:
        return PLAN_CONFIGS.get(self.plan, "tiny-cp" if "cp" in self.options else "tiny")

    @property
    def model(self) -> str:
        return str(self.options.get("model", "llama3"))

    @property
    def name(self) -> str:
        backend = "" if self.backend == "spmd_types" else f"_{self.backend}"
        plan = self.plan.removeprefix(f"{self.model}_")
        return f"tt_{self.model}_{plan}{backend}{'_train' if self.train else ''}" + (f"__{self.bug}" if self.bug else "")

    def expectation(self) -> dict[str, str]:
        bug = BUGS.get(self.bug) if self.bug else None
        if bug is not None and bug.bug_class is not None:
            return {"verdict": "refuted"}
        return {"verdict": "verified"}

    def describe(self) -> str:
        return self.expectation()["verdict"]

    def validate(self) -> None:
        from refine.exporters.zoo.configs import validate_torchtitan_ep, validate_torchtitan

        degrees = {k: v for k, v in self.options.items() if k != "ep"}
        cfg = validate_torchtitan(self.config, backend=self.backend, **degrees)  # type: ignore[arg-type]
        validate_torchtitan_ep(int(self.options.get("ep", 1)), tp=int(self.options.get("tp", 1)),  # type: ignore[call-overload]
                    fsdp=int(self.options.get("fsdp", 1)), model=self.model, num_experts=cfg.num_experts)  # type: ignore[call-overload]
        if self.bug is not None:
            torchtitan_bug(self.bug, sp=bool(self.options.get("sp")), train=self.train, backend=self.backend,
                           cp=int(self.options.get("cp", 1)), pp=int(self.options.get("pp", 1)),  # type: ignore[call-overload]
                           tp=int(self.options.get("tp", 1)), model=self.model,  # type: ignore[call-overload]
                           fsdp=int(self.options.get("fsdp", 1)), ep=int(self.options.get("ep", 1)))  # type: ignore[call-overload]

    def manifest(self) -> dict[str, object]:
        """The `zoo` record export_torchtitan writes into export.json (is_current compares a part of it)."""
        return {"framework": "torchtitan", "model": self.model, "config": self.config, "backend": self.backend,
                "seed": self.seed, "train": self.train, "bug": self.bug, **self.options}

    def export_to(self, out: Path) -> None:
        from refine.exporters.frameworks.torchtitan import export_torchtitan

        export_torchtitan(self.config, out, backend=self.backend, train=self.train, bug=self.bug, seed=self.seed,
                          **self.options)  # type: ignore[arg-type]


PLANS: dict[str, dict[str, object]] = {"tp2": {"tp": 2}, "tp2sp": {"tp": 2, "sp": True},
                                       "pp2": {"pp": 2, "micro_batches": 2},
                                       "pp2tp2": {"pp": 2, "tp": 2, "micro_batches": 2},
                                       "cp2": {"cp": 2},
                                       "cp2tp2": {"cp": 2, "tp": 2},
                                       "fsdp2tp2": {"fsdp": 2, "tp": 2},
                                       # Qwen3-MoE: each expert's hidden units over TP, and its experts over EP
                                       # (torchtitan's all-to-all dispatcher, exported at static capacity)
                                       "qwen3_moe_tp2": {"model": "qwen3_moe", "tp": 2},
                                       "qwen3_moe_tp2sp": {"model": "qwen3_moe", "tp": 2, "sp": True},
                                       "qwen3_moe_tp2sp_ep2": {"model": "qwen3_moe", "tp": 2, "sp": True, "ep": 2},
                                       "qwen3_moe_tp2sp_ep2_seq": {"model": "qwen3_moe", "tp": 2, "sp": True, "ep": 2}}
PLAN_CONFIGS = {"qwen3_moe_tp2sp_ep2_seq": "tiny-seq"}  # (a plan's config other than tiny / tiny-cp)
BACKENDS = ("spmd_types", "full_dtensor")  # the default and the DTensor backend the zoo exports


def select(steps: str | None = None, seed: int = 0) -> list[TorchtitanEntry]:
    """Every plan on both backends, forward and training step, and each twin where it applies."""
    wanted = [s.strip() for s in (steps or ",".join(STEPS)).split(",") if s.strip()]
    if not wanted or set(wanted) - set(STEPS):
        raise ExportError(f"--steps: among {', '.join(STEPS)}, not {steps!r}")
    entries: list[TorchtitanEntry] = []
    for plan, options in PLANS.items():
        for backend in BACKENDS:
            for step in wanted:
                if "model" in options and backend != "spmd_types":
                    continue
                entries.append(TorchtitanEntry(plan, backend, step, seed=seed))
                # (full_dtensor shards every parameter over cp with FSDP: FSDP's twin applies there too)
                sharded = "fsdp" in options or ("cp" in options and backend == "full_dtensor")
                for bug in BUGS.values():
                    fits = (backend in bug.backends and (not bug.sp or bool(options.get("sp")))
                            and (bug.cp == ("cp" in options) or bug.fsdp) and bug.pp == ("pp" in options)
                            and (not bug.tp or "tp" in options) and bug.moe == ("model" in options)
                            and not (bug.tp_experts and "ep" in options)
                            and bug.fsdp == sharded
                            and (not bug.pp or int(options.get("micro_batches", 1)) > 1))  # type: ignore[call-overload]
                    # a backward bug in the training step only, a forward one in the forward, a
                    # correct variant in both
                    if fits and (bug.bug_class is None or bug.train == (step == "train")):
                        entries.append(TorchtitanEntry(plan, backend, step, bug.name, seed=seed))
    return entries
