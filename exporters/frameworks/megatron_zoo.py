"""`refine zoo --framework megatron-core`: Megatron-Core's GPTModel under its plans and its twins, one entry each.

An entry `mc_{plan}[_train][__{bug}]` is the export of exporters/frameworks/megatron.py (Megatron's
own GPTModel: GPT style, Llama style, or its MoELayer with the allgather token dispatcher),
forward or one training step, with one twin of exporters/frameworks/megatron_bugs.py or none;
its refine.json carries the verdict it must get (`verified`, `refuted` for a bug). Each twin sits
on the plan and step it is a mistake of (TWIN_PLANS). Pure Python: a bad selection is rejected
before torch is imported. Entries are written by refine.exporters.zoo.entries' `generate`, as the
zoo's are (all or nothing, kept when current).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refine.exporters.errors import ExportError
from refine.exporters.frameworks.entry import FrameworkEntry
from refine.exporters.frameworks.megatron_bugs import MEGATRON_BUGS, megatron_bug

STEPS = ("infer", "train")

# plan -> the export's arguments (config, TP degree, sequence parallelism)
PLANS: dict[str, dict[str, object]] = {
    "gpt_tp2": {"config": "tiny", "tp": 2},
    "gpt_tp2sp": {"config": "tiny", "tp": 2, "sp": True},
    "llama_tp2": {"config": "tiny-llama", "tp": 2},
    # Megatron's MoELayer: its allgather token dispatcher, each expert's hidden units over TP
    "moe_tp2sp": {"config": "tiny-moe", "tp": 2, "sp": True},
    # ... with a shared expert (SharedExpertMLP: a TP MLP beside the routed experts, added after the combine)
    "moe_shared_tp2sp": {"config": "tiny-moe-shared", "tp": 2, "sp": True},
}
# twin -> the plan it is injected into (its step: a training step's twin where the bug needs one)
TWIN_PLANS = {"bias_before_allreduce": "gpt_tp2", "bias_after_allreduce": "gpt_tp2", "qkv_stride_3": "gpt_tp2",
              "missing_allreduce": "llama_tp2", "glu_stride_1": "llama_tp2",
              "ce_gathered_logits": "gpt_tp2", "ce_label_smoothing": "gpt_tp2", "ce_unmasked_backward": "gpt_tp2",
              "sp_norm_grad_unreduced": "gpt_tp2sp", "sp_scatter_as_slice": "gpt_tp2sp",
              "moe_router_grad_unreduced": "moe_tp2sp"}


@dataclass(frozen=True)
class MegatronEntry(FrameworkEntry):
    """One zoo entry: Megatron-Core's GPTModel under a plan, forward or one training step, with an
    optional twin; named `mc_{plan}[_train][__{bug}]`."""

    plan: str  # a key of PLANS
    step: str = "infer"
    bug: str | None = None
    seed: int = 0

    @property
    def options(self) -> dict[str, object]:
        return PLANS[self.plan]

    @property
    def name(self) -> str:
        return f"mc_{self.plan}{'_train' if self.train else ''}" + (f"__{self.bug}" if self.bug else "")

    def expectation(self) -> dict[str, str]:
        bug = MEGATRON_BUGS.get(self.bug) if self.bug else None
        return {"verdict": "refuted" if bug is not None and bug.bug_class is not None else "verified"}

    def describe(self) -> str:
        return self.expectation()["verdict"]

    def validate(self) -> None:
        from refine.exporters.zoo.configs import MegatronMoEConfig, validate_megatron_moe

        cfg = validate_megatron_moe(str(self.options["config"]), int(self.options["tp"]),  # type: ignore[call-overload]
                                    bool(self.options.get("sp")), 1, None, train=self.train)
        if self.bug is not None:
            megatron_bug(self.bug, cfg.style, bool(self.options.get("sp")), self.train, isinstance(cfg, MegatronMoEConfig))

    def manifest(self) -> dict[str, object]:
        """The `zoo` record export_megatron writes into export.json (is_current compares a part of it)."""
        return {"framework": "megatron-core", "config": self.options["config"], "tp": self.options["tp"],
                "sp": bool(self.options.get("sp")), "seed": self.seed, "train": self.train, "bug": self.bug}

    def export_to(self, out: Path) -> None:
        from refine.exporters.frameworks.megatron import export_megatron

        export_megatron(str(self.options["config"]), int(self.options["tp"]), bool(self.options.get("sp")),  # type: ignore[call-overload]
                        out, self.seed, bug=self.bug, train=self.train)


def select(steps: str | None = None, seed: int = 0) -> list[MegatronEntry]:
    """Every plan, forward and training step, and each twin on its plan: a twin that needs a
    training step (a backward or loss mistake) in the training step, any other in the forward."""
    wanted = [s.strip() for s in (steps or ",".join(STEPS)).split(",") if s.strip()]
    if not wanted or set(wanted) - set(STEPS):
        raise ExportError(f"--steps: among {', '.join(STEPS)}, not {steps!r}")
    entries: list[MegatronEntry] = []
    for plan in PLANS:
        for step in wanted:
            entries.append(MegatronEntry(plan, step, seed=seed))
            for bug, at in TWIN_PLANS.items():
                if at == plan and ("train" in (MEGATRON_BUGS[bug].needs or "")) == (step == "train"):
                    entries.append(MegatronEntry(plan, step, bug, seed=seed))
    return entries
