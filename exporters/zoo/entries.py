"""`refine zoo`: a directory of zoo entries, model x TP x plan, and buggy twins of each.

An entry is a model directory named `{model}_tp{N}[_sp][_train]` (the correct export; `_train`:
one training step, loss and every gradient, rather than the forward) or
`{model}_tp{N}[_sp][_train]__{bug}` (the same model with one bug of exporters/zoo/bugs.py injected
into its rank modules). Bugs of the backward pass are exported as training steps only. Its refine.json carries the verdict it must get: `verified` for a correct
export, `refuted` for a bug (a real bug must never verify, and the numeric search finds it).

The mesh plans `dp` and `dpsp` (selected by name only, or as `--mesh dp=D,tp=T`: not in the
default zoo) are the TP and TP+SP plans within each row of a DP x TP mesh (exporters/strategies/mesh.py),
DP 2 unless chosen: entries `{model}_tp{N}_dp{D}[_sp]` and their twins `..__mesh_wrong_group` (a
collective over the DP group instead of the TP group; under SP the reduce-scatter, so only where
D == N). The training step is the `dp` plan's only, `{model}_tp{N}_dp{D}_train` and its twin
`..__mesh_grad_over_tp` (the gradients' DP all-reduce over the TP group): refine does not prove
the TP+SP x DP step yet (UNPROVEN), so `dpsp` has no training entries. The `fsdp` plan (by name
only) is the FSDP / ZeRO-3 training step of exporters/strategies/data_parallel.py, DP 2 unless chosen and no
TP: `{model}_dp{D}_fsdp_train` and its twins `..__fsdp_grad_not_reduced`, `..__fsdp_grad_avg`; it
has no forward entries.

The plans of the other parallelisms (PARALLEL_PLANS, selected by name only, forward only, at fixed
degrees, each of the models its exporter takes): `pp`, pipeline parallelism over 2 stages with 2
micro-batches (exporters/strategies/pipeline.py; gpt2, llama, qwen2): `{model}_pp2` and its twins
`..__pp_micro_batch_order`, `..__pp_layer_twice`; `pptp`, those stages with TP 2 inside each, a
PP 2 x TP 2 mesh (exporters/strategies/pipeline_mesh.py): `{model}_pp2_tp2`, the same twins and
`..__pp_wrong_tp_peer`; `cp`, GPT-2 under context parallelism over 2 ranks with K/V all-gathered
(exporters/strategies/context.py): `gpt2_cp2`, twins `..__cp_positions_not_offset`, `..__cp_mask_not_offset`;
`ring`, the same with ring attention: `gpt2_cp2_ring`, twins `..__ring_mask_not_offset`,
`..__ring_no_rescale`, `..__ring_block_twice`; `zigzag`, the same with load-balanced (zig-zag)
chunks: `gpt2_cp2_zigzag`, twins `..__zigzag_mask_not_offset`, `..__zigzag_positions_not_offset`,
`..__zigzag_chunk_order`; `ep`, Mixtral under expert parallelism over 2 ranks
(exporters/strategies/expert.py; the zoo's only MoE model, in no other plan): `mixtral_ep2`, twins
`..__ep_global_expert_ids`, `..__ep_combine_wrong_indices`; `eptp`, Mixtral on an EP 2 x TP 2 mesh
(exporters/strategies/expert_mesh.py: attention TP within each row, experts over each column): `mixtral_ep2_tp2`,
the same twins and `..__ep_mesh_wrong_group`. One plan holds training steps rather than forwards:
`pptrain`, GPT-2's training step over 2 stages with 2 micro-batches (exporters/strategies/pipeline_train.py):
`gpt2_pp2_train`, twins `..__pp_tied_grad_not_reduced`, `..__pp_grad_not_accumulated`,
`..__pp_loss_not_scaled`. A mesh, FSDP, pipeline, context or
expert twin's refine.json also names the sequential node where refine must report the failure.

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

from refine.exporters.zoo.configs import check_plan, validate, zoo_config
from refine.exporters.errors import ExportError

MODELS = ("llama", "gpt2", "qwen2")
TPS = (2, 4, 8)
PLANS = ("tp", "sp")
MESH_PLANS = ("dp", "dpsp")  # TP (TP+SP) within each row of a DP x TP mesh: exporters/strategies/mesh.py
FSDP_PLANS = ("fsdp",)  # the FSDP / ZeRO-3 training step over DP ranks: exporters/strategies/data_parallel.py
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
             "global_head_count", "wrong_group", "avg_allreduce")  # exporters/zoo/bugs.py, without torch
TRAIN_BUG_NAMES = ("missing_grad_allreduce", "grad_avg_allreduce", "sp_norm_grad_unreduced")  # backward bugs
GPT2_ONLY = {"bias_before_allreduce", "global_head_count"}
SP_ONLY = {"sp_norm_grad_unreduced", "sp_norm_grad_reduced"}
# the injection machinery with the bug taken out: must verify (selectable, not in the default zoo)
CONTROL_NAMES = ("faulty_rowwise_none", "kv_own_offset", "faulty_colwise_sum", "sp_norm_grad_reduced")
TRAIN_ONLY = {*TRAIN_BUG_NAMES, "faulty_colwise_sum", "sp_norm_grad_reduced"}  # no effect on a forward export
MESH_BUG_NAMES = ("mesh_wrong_group",)  # exporters/strategies/mesh.py MESH_BUGS of the forward, without torch
MESH_TRAIN_BUG_NAMES = ("mesh_grad_over_tp",)  # ... and of the training step
FSDP_BUG_NAMES = ("fsdp_grad_not_reduced", "fsdp_grad_avg")  # exporters/strategies/data_parallel.py, `fsdp=True`
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

PP, MICRO_BATCHES, PPTP_TP, CP, EP = 2, 2, 2, 2, 2  # the degrees of the pipeline, context and expert plans


@dataclass(frozen=True)
class ParallelPlan:
    """A plan of another parallelism than TP alone (pipeline, context, expert), at the zoo's fixed
    degrees: forward entries `{model}_{suffix}` of `models`, and its twins `bugs` (the exporter's
    catalogue, without torch), each refuted at `nodes[bug][model]`."""

    name: str
    models: tuple[str, ...]
    suffix: str  # the entry name after the model: its degrees
    bugs: tuple[str, ...]
    nodes: dict[str, dict[str, str]]
    tp: int = 1  # the TP degree inside it (pptp, eptp), 1: none
    train: bool = False  # its entries are training steps (pptrain), not forwards

    def validate(self, model: str, config: str) -> None:
        """An ExportError if this plan does not split `model` (pure Python: before torch)."""
        cfg = zoo_config(model, config)
        if self.name in ("pp", "pptp", "pptrain"):
            if model not in self.models:
                raise ExportError(f"pipeline parallelism exports {', '.join(self.models)} only, not {model}")
            if self.tp > 1:
                validate(model, config, self.tp, False)
            if PP > cfg.layers:
                raise ExportError(f"PP {PP} is more stages than {model} config {config!r} has layers ({cfg.layers})")
            if cfg.batch % MICRO_BATCHES:
                raise ExportError(f"{MICRO_BATCHES} micro-batches do not divide the batch {cfg.batch} "
                                  f"of config {config!r}")
        elif self.name in ("cp", "ring", "zigzag"):
            check_plan("context parallelism", self.models, model, CP, "CP", cfg.seq_len, "sequence length", config)
            if self.name == "zigzag" and cfg.seq_len % (2 * CP):
                raise ExportError(f"zig-zag CP {CP} cuts the sequence into {2 * CP} chunks: {2 * CP} does not divide "
                                  f"the sequence length {cfg.seq_len} of config {config!r}")
        else:
            check_plan("expert parallelism", self.models, model, EP, "EP", cfg.batch, "batch", config)
            if self.tp > 1:
                for what, size in {"attention heads": cfg.heads, "key/value heads": cfg.kv_heads}.items():
                    if size % self.tp:
                        raise ExportError(f"{model} config {config!r}: {what} {size} not divisible by TP {self.tp}")
            if EXPERTS % EP:
                raise ExportError(f"EP {EP} does not divide the {EXPERTS} experts of {model}")

    def export(self, model: str, config: str, seed: int, bug: str | None, out: Path) -> None:
        """Export `model` under this plan (with `bug` injected) to the model directory `out` (torch)."""
        if self.name == "pp":
            from refine.exporters.strategies.pipeline import export_pipeline

            export_pipeline(model, config, PP, MICRO_BATCHES, out, seed, bug=bug)
        elif self.name == "pptp":
            from refine.exporters.strategies.pipeline_mesh import export_pipeline_mesh

            export_pipeline_mesh(model, config, PP, self.tp, MICRO_BATCHES, out, seed, bug=bug)
        elif self.name == "pptrain":
            from refine.exporters.strategies.pipeline_train import export_pipeline_train

            export_pipeline_train(model, config, PP, MICRO_BATCHES, out, seed, bug=bug)
        elif self.name in ("cp", "ring", "zigzag"):
            from refine.exporters.strategies.context_export import export_context_parallel

            export_context_parallel(model, config, CP, out, seed, bug=bug, ring=self.name == "ring",
                                    zigzag=self.name == "zigzag")
        elif self.name == "eptp":
            from refine.exporters.strategies.expert_mesh import export_expert_mesh

            export_expert_mesh(model, config, EP, self.tp, out, seed, bug=bug)
        else:
            from refine.exporters.strategies.expert import export_expert_parallel

            export_expert_parallel(model, config, EP, out, seed, bug=bug)

    def record(self) -> dict[str, object]:
        """The keys of the exporter's zoo record (export.json) that set this plan."""
        return {"pp": {"pp": PP, "micro_batches": MICRO_BATCHES},
                "pptp": {"mesh": {"pp": PP, "tp": self.tp}, "micro_batches": MICRO_BATCHES},
                "pptrain": {"pp": PP, "micro_batches": MICRO_BATCHES},
                "eptp": {"ep": EP, "mesh": {"ep": EP, "tp": self.tp}},
                "cp": {"cp": CP, "ring": None}, "ring": {"cp": CP, "ring": True},
                "zigzag": {"cp": CP, "zigzag": True},
                "ep": {"ep": EP}}[self.name]


PP_MODELS = MODELS  # exporters/strategies/pipeline.py PP_MODELS
EP_MODEL = "mixtral"  # exporters/strategies/expert.py EP_MODELS, the zoo's only MoE model
EXPERTS = 4  # exporters/zoo/moe.py EXPERTS (EP must divide them)
PIPELINE_BUG_NAMES = ("pp_micro_batch_order", "pp_layer_twice")  # exporters/strategies/pipeline.py PIPELINE_BUGS
PIPELINE_TP_BUG_NAMES = ("pp_wrong_tp_peer",)  # ... of a PP x TP mesh only
CONTEXT_BUG_NAMES = ("cp_positions_not_offset", "cp_mask_not_offset")  # exporters/strategies/context.py CONTEXT_BUGS
RING_BUG_NAMES = ("ring_mask_not_offset", "ring_no_rescale", "ring_block_twice")  # ... RING_BUGS
ZIGZAG_BUG_NAMES = ("zigzag_mask_not_offset", "zigzag_positions_not_offset", "zigzag_chunk_order")  # ... ZIGZAG_BUGS
EXPERT_BUG_NAMES = ("ep_global_expert_ids", "ep_combine_wrong_indices")  # exporters/strategies/expert.py, stock weighting
EXPERT_TP_BUG_NAMES = (*EXPERT_BUG_NAMES, "ep_mesh_wrong_group")  # exporters/strategies/expert_mesh.py EXPERT_MESH_BUGS
PIPELINE_TRAIN_BUG_NAMES = ("pp_tied_grad_not_reduced", "pp_grad_not_accumulated", "pp_loss_not_scaled")  # ... train=True
# where `refine verify` names each twin's first failure (found by exporting and verifying each once):
# micro-batches swapped, at the head's reshape of the logits; a layer run twice (or, under TP, its
# input sent to the wrong TP peer), at the next layer's first norm
_LOGITS = {m: "lm_head/Reshape_2" for m in PP_MODELS}
_NEXT_NORM = {m: "h.1.ln_1/LayerNormalization" if m == "gpt2" else "model.layers.1.input_layernorm/Mul_2"
              for m in PP_MODELS}
PIPELINE_BUG_NODES = {"pp_micro_batch_order": _LOGITS, "pp_layer_twice": _NEXT_NORM}
PIPELINE_TP_BUG_NODES = {**PIPELINE_BUG_NODES,
                         "pp_wrong_tp_peer": {**_NEXT_NORM, "llama": "model.layers.1.input_layernorm/Pow",
                                              "qwen2": "model.layers.1.input_layernorm/Pow"}}
CONTEXT_BUG_NODES = {"cp_positions_not_offset": {"gpt2": "wpe/Gather"},
                     "cp_mask_not_offset": {"gpt2": "h.0/attn/Where"}}
RING_BUG_NODES = {bug: {"gpt2": "h.0/attn/MatMul"} for bug in RING_BUG_NAMES}  # where the merged output stops relating
ZIGZAG_BUG_NODES = {"zigzag_mask_not_offset": {"gpt2": "h.0.attn/Where"},
                    "zigzag_positions_not_offset": {"gpt2": "wpe/Gather"},
                    "zigzag_chunk_order": {"gpt2": "h.0.attn/Transpose_4"}}  # (the gathered keys)
EXPERT_BUG_NODES = {"ep_global_expert_ids": {EP_MODEL: "model.layers.0/mlp/Transpose"},
                    "ep_combine_wrong_indices": {EP_MODEL: "model.layers.0/mlp/ReduceSum_2"}}
EXPERT_TP_BUG_NODES = {**EXPERT_BUG_NODES, "ep_mesh_wrong_group": {EP_MODEL: "model.layers.0/mlp/MatMul"}}
# the tied embedding's two parts never summed, at its gradient's sum; the last micro-batch's gradients
# only (micro-batch 0's backward is then dead code), at the first norm; the loss M times too large, at
# its division
PIPELINE_TRAIN_BUG_NODES = {"pp_tied_grad_not_reduced": {"gpt2": "wte (backward)/Add"},
                            "pp_grad_not_accumulated": {"gpt2": "h.0.ln_1/LayerNormalization"},
                            "pp_loss_not_scaled": {"gpt2": "Div"}}
PARALLEL_PLANS = {p.name: p for p in (
    ParallelPlan("pp", PP_MODELS, f"pp{PP}", PIPELINE_BUG_NAMES, PIPELINE_BUG_NODES),
    ParallelPlan("pptp", PP_MODELS, f"pp{PP}_tp{PPTP_TP}", (*PIPELINE_BUG_NAMES, *PIPELINE_TP_BUG_NAMES),
                 PIPELINE_TP_BUG_NODES, tp=PPTP_TP),
    ParallelPlan("cp", ("gpt2",), f"cp{CP}", CONTEXT_BUG_NAMES, CONTEXT_BUG_NODES),
    ParallelPlan("ring", ("gpt2",), f"cp{CP}_ring", RING_BUG_NAMES, RING_BUG_NODES),
    ParallelPlan("zigzag", ("gpt2",), f"cp{CP}_zigzag", ZIGZAG_BUG_NAMES, ZIGZAG_BUG_NODES),
    ParallelPlan("ep", (EP_MODEL,), f"ep{EP}", EXPERT_BUG_NAMES, EXPERT_BUG_NODES),
    ParallelPlan("eptp", (EP_MODEL,), f"ep{EP}_tp{PPTP_TP}", EXPERT_TP_BUG_NAMES, EXPERT_TP_BUG_NODES, tp=PPTP_TP),
    ParallelPlan("pptrain", ("gpt2",), f"pp{PP}_train", PIPELINE_TRAIN_BUG_NAMES, PIPELINE_TRAIN_BUG_NODES, train=True),
)}
ALL_MODELS = (*MODELS, EP_MODEL)
ALL_PLANS = (*PLANS, *DP_PLANS, *PARALLEL_PLANS)
# bugs of one family of plans only (the TP plans' twins are exporters/zoo/bugs.py's)
_PLAN_ONLY_BUG_NAMES = {*_DP_BUG_NAMES, *(bug for plan in PARALLEL_PLANS.values() for bug in plan.bugs)}
UNSUPPORTED |= {(name, "train"): (f"{name}'s entries are training steps already: pass --steps infer" if plan.train
                                 else f"{name} exports the forward only: its training step is not in the zoo; "
                                      "pass --steps infer") for name, plan in PARALLEL_PLANS.items()}


@dataclass(frozen=True)
class ZooEntry:
    """One zoo entry: a zoo model, its TP degree (1 under FSDP, PARALLEL_PLANS': theirs) and plan
    (and DP degree, on a mesh or under FSDP), and the bug injected (None: correct)."""

    model: str
    tp: int
    plan: Literal["tp", "sp", "dp", "dpsp", "fsdp", "pp", "pptp", "pptrain", "cp", "ring", "zigzag", "ep", "eptp"]
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
    def parallel(self) -> ParallelPlan | None:
        """The pipeline, context or expert plan (PARALLEL_PLANS); None for a TP, mesh or FSDP plan."""
        return PARALLEL_PLANS.get(self.plan)

    @property
    def dp_degree(self) -> int | None:
        """The DP degree of a mesh or FSDP plan; None for a TP plan."""
        return (self.dp or DEFAULT_DP) if self.plan in DP_PLANS else None

    @property
    def name(self) -> str:
        train = "_train" if self.step == "train" else ""
        if self.parallel:
            base = f"{self.model}_{self.parallel.suffix}"
        elif self.fsdp:
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
        """The sequential node the failure must name, where the zoo knows it (mesh, FSDP, pipeline,
        context and expert twins)."""
        nodes = self.parallel.nodes if self.parallel else {**MESH_BUG_NODES, **FSDP_BUG_NODES}
        return nodes.get(self.bug or "", {}).get(self.model)

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
        if self.parallel:
            return self.parallel.validate(self.model, self.config)
        cfg = zoo_config(self.model, self.config) if self.fsdp else validate(self.model, self.config, self.tp, self.sp)
        if self.dp_degree:
            check_plan("data parallelism", MODELS, self.model, self.dp_degree, "DP", cfg.batch, "batch", self.config)

    def default_bugs(self) -> tuple[str, ...]:
        """The twins of this plan and step when no bug is chosen."""
        if self.parallel:
            return self.parallel.bugs
        if self.fsdp:
            return FSDP_BUG_NAMES
        if self.dp_degree:
            return MESH_TRAIN_BUG_NAMES if self.step == "train" else MESH_BUG_NAMES
        return TRAIN_BUG_NAMES if self.step == "train" else BUG_NAMES

    def applies(self, bug: str) -> bool:
        """Whether `bug` (or `none`) has an entry of this model, plan and step."""
        if self.parallel:
            return bug == CORRECT or bug in self.parallel.bugs
        if self.dp_degree:  # under SP the wrong group's reduce-scatter keeps its output's shape only if D == T
            return bug == CORRECT or (bug in self.default_bugs()
                                      and (bug not in MESH_BUG_NAMES or not self.sp or self.dp_degree == self.tp))
        return not ((bug in GPT2_ONLY and self.model != "gpt2") or (bug in SP_ONLY and self.plan != "sp")
                    or (bug in TRAIN_ONLY and self.step != "train") or bug in _PLAN_ONLY_BUG_NAMES)

    def manifest(self) -> dict[str, object]:
        """The `zoo` record of export.json: how to rebuild this entry."""
        if self.parallel:  # (the record of its exporter: exporters/pipeline*.py, context.py, expert.py)
            return {"model": self.model, "config": self.config, **self.parallel.record(), "seed": self.seed,
                    "bug": self.bug, "train": self.parallel.train}
        if self.fsdp:  # (exporters/strategies/data_parallel.py's record)
            return {"model": self.model, "config": self.config, "dp": self.dp_degree, "seed": self.seed,
                    "bug": self.bug, "train": True, "fsdp": True}
        if self.dp_degree:  # (exporters/strategies/mesh.py's record)
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
    return (_split(plans, ALL_PLANS, "plan", default=PLANS),
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
    chosen = _split(plans, ALL_PLANS, "plan", default=MESH_PLANS[:1])
    if set(chosen) - set(MESH_PLANS):
        raise ExportError(f"--mesh is for the mesh plans ({', '.join(MESH_PLANS)}): drop --mesh or the other plans")
    dp, tp = parse_mesh(mesh)
    return ",".join(chosen), str(dp), str(tp)


def select(models: str | Iterable[str] | None = None, tps: str | int | Iterable[str | int] | None = None,
           plans: str | Iterable[str] | None = None, bugs: str | Iterable[str] | None = None,
           config: str = "tiny", seed: int = 0, steps: str | Iterable[str] | None = None,
           dps: str | int | Iterable[str | int] | None = None) -> list[ZooEntry]:
    """The entries of a slice of the zoo, in a stable order. `bugs` names bugs of
    exporters/zoo/bugs.py, exporters/strategies/mesh.py, exporters/strategies/data_parallel.py (FSDP), exporters/strategies/pipeline.py,
    context.py and expert.py, and `none` (the correct export); a bug that does not apply to a model
    (GPT-2 only), a plan (SP only; mesh bugs: mesh plans only; FSDP bugs: fsdp only; pipeline,
    context and expert bugs: their PARALLEL_PLANS only) or a step (backward bugs: training steps
    only) is left out there. `plans` defaults to the TP plans; the mesh and FSDP plans take the DP
    degrees `dps` (default DEFAULT_DP), and fsdp no TP degree (its entries come after a model's
    others); the PARALLEL_PLANS take neither (their degrees are fixed; they come last) and export
    their own models only (`models` defaults to every model: mixtral has the ep plan only, and a
    chosen model that no chosen plan exports is an ExportError).
    `steps` (default: infer) picks forward exports, training steps or both; by default each entry
    gets its plan's and step's twins (`ZooEntry.default_bugs`). A plan and step pair in
    UNSUPPORTED is left out (`left_out` says why). An empty slice is an ExportError."""
    chosen_models = _split(models, ALL_MODELS, "model")
    chosen_tps = _degrees(tps, TPS, "TP degree")
    chosen_plans, chosen_steps = _plans_and_steps(plans, steps)
    chosen_dps = _degrees(dps, DPS, "DP degree", default=(DEFAULT_DP,))
    if dps is not None and not set(chosen_plans) & set(DP_PLANS):
        raise ExportError(f"a DP degree is for the mesh plans ({', '.join(MESH_PLANS)}) and {', '.join(FSDP_PLANS)}, "
                          "and none is chosen")
    if tps is not None and set(chosen_plans) <= {*FSDP_PLANS, *PARALLEL_PLANS}:
        raise ExportError("a TP degree is for the TP and mesh plans: " + "; ".join(
            f"{plan} has none " + ("(DP only)" if plan in FSDP_PLANS else f"(fixed degrees: {PARALLEL_PLANS[plan].suffix})")
            for plan in chosen_plans))
    for model in chosen_models if models is not None else ():
        if not any(model in _plan_models(plan) for plan in chosen_plans):
            raise ExportError(f"no chosen plan exports {model} ({_exported_by(model)})")
    known = dict.fromkeys((CORRECT, *BUG_NAMES, *TRAIN_BUG_NAMES, *CONTROL_NAMES, *MESH_BUG_NAMES,
                           *MESH_TRAIN_BUG_NAMES, *FSDP_BUG_NAMES, *_PLAN_ONLY_BUG_NAMES))
    chosen_bugs = _split(bugs, known, "bug") if bugs is not None else None
    pairs = [(tp, plan) for tp in chosen_tps for plan in chosen_plans if plan not in (*FSDP_PLANS, *PARALLEL_PLANS)]
    pairs += [(1, plan) for plan in chosen_plans if plan in FSDP_PLANS]  # (one world: DP ranks only)
    pairs += [(PARALLEL_PLANS[plan].tp, plan) for plan in chosen_plans if plan in PARALLEL_PLANS]
    entries = []
    for step in chosen_steps:
        for model in chosen_models:
            for tp, plan in pairs:
                if (plan, step) in UNSUPPORTED or model not in _plan_models(plan):
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


def _plan_models(plan: str) -> tuple[str, ...]:
    """The models a plan exports."""
    return PARALLEL_PLANS[plan].models if plan in PARALLEL_PLANS else MODELS


def _exported_by(model: str) -> str:
    """Which plans export `model`, in words."""
    plans = [plan for plan in ALL_PLANS if model in _plan_models(plan)]
    return f"{model} is in the {', '.join(plans)} plan{'s' if len(plans) > 1 else ''}"


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
    import refine.exporters
    from refine.exporters.zoo import bugs

    entry.validate()
    target = out / entry.name
    if target.exists() and not (target / "refine.json").is_file():
        raise ExportError(f"{target}: exists and is not a model directory; not replacing it")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=out))
    try:
        work = scratch / entry.name
        own = getattr(entry, "export_to", None)  # a framework's entry (exporters/frameworks/transformers_zoo.py)
        if own is not None:
            own(work)
        elif entry.parallel:
            entry.parallel.export(entry.model, entry.config, entry.seed, entry.bug, work)
        elif entry.fsdp:
            from refine.exporters.strategies.data_parallel import export_data_parallel

            export_data_parallel(entry.model, entry.config, entry.dp_degree or DEFAULT_DP, work, entry.seed,
                                 train=True, fsdp=True, bug=entry.bug)
        elif entry.dp_degree:
            from refine.exporters.strategies.mesh import export_mesh

            export_mesh(entry.model, entry.config, entry.tp, entry.dp_degree, work, entry.seed, sp=entry.sp,
                        bug=entry.bug, train=entry.step == "train")
        else:
            bug = (bugs.BUGS.get(entry.bug) or bugs.CONTROLS[entry.bug]) if entry.bug is not None else None
            refine.exporters.export_model(entry.model, entry.config, entry.tp, entry.sp, work, entry.seed, bug=bug,
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
