"""Own-code bug twins: plain modules written for the test (tests/own_models.py, not the zoo),
exported as a user would (refine.exporters.export_forward / export_train, a pipeline through
refine.exporters.export), each with one mistake people make. For every report: REFUTED, the
bug class of docs/bugs.md named in plain words, the user's tensor named, and the user's line of
the mistake (the `# BUG(name)` line of tests/own_models.py) as the diagnosis's location; no
location anywhere in the report is a file inside torch. The correct twins verify and name no
class. Each case is exported once per session (a few seconds each). The default run takes a twin
of every class (SWEEP_ONLY: the training-step twins of forward twins it keeps, the same class at
another place), the sweep (REFINE_TEST_SWEEP=1, benchmarks/sweep.py) every twin.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import own_models as om  # noqa: E402
from harness import SWEEP  # noqa: E402

import refine.exporters  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

SOURCE = Path(inspect.getsourcefile(om) or "")


def bug_line(marker: str) -> int:
    """The line of tests/own_models.py marked `# BUG(marker)`."""
    hits = [i for i, line in enumerate(SOURCE.read_text().splitlines(), 1) if f"# BUG({marker})" in line]
    assert len(hits) == 1, marker
    return hits[0]


@dataclass(frozen=True)
class Twin:
    """One export: its module, plan and batch (built fresh, seeded), and what its report must say
    (class None: a correct twin)."""

    build: Callable[[], dict[str, Any]]
    bug_class: int | None = None
    tensor: str = ""  # words the diagnosis must hold: the user's tensor, `in backticks`
    marker: str = ""  # the `# BUG(...)` line the diagnosis must point at
    options: dict[str, Any] = field(default_factory=dict)


def mlp_x():
    torch.manual_seed(1)
    return (torch.randn(4, 16),)


def mlp_batch():
    torch.manual_seed(1)
    return {"x": torch.randn(4, 16), "target": torch.randn(4, 16)}


def seq_batch():
    torch.manual_seed(2)
    return {"x": torch.randn(4, 2, 16), "target": torch.randn(4, 2, 16)}


def attn_x():
    torch.manual_seed(3)
    return (torch.randn(2, 4, 16),)


def attn_batch():
    torch.manual_seed(3)
    return {"x": torch.randn(2, 4, 16), "target": torch.randn(2, 4, 16)}


def cls_batch(ignore: bool = False):
    torch.manual_seed(4)
    labels = torch.randint(0, 4, (8,))
    if ignore:  # ignored labels, unevenly between the ranks and micro-batches
        labels[0] = labels[1] = labels[5] = -100
    return {"x": torch.randn(8, 16), "labels": labels}


def fwd(model, plan, x, world=2):
    return lambda: dict(kind="forward", model=model(), parallelize=plan, batch=x(), world=world)


def step(model, plan, batch, loss=om.mse, world=2, **extra):
    return lambda: dict(kind="train", model=model(), parallelize=plan, batch=batch(), world=world, loss_fn=loss, **extra)


def dp(how, loss, ignore=False, **extra):
    ranges = {"labels": (4, [-100])} if ignore else {"labels": 4}
    return lambda: dict(kind="train", model=om.Classifier(), batch=cls_batch(ignore), world=2, loss_fn=loss,
                        data_parallel=how, ranges=ranges, **extra)


def pipeline(bug):
    return lambda: dict(kind="pipeline", model=om.TwoLayers(), bug=bug, batch=mlp_x(), world=2)


TWINS: dict[str, Twin] = {
    # class 1: partial sums used as if whole (forward, and an input gradient in backward)
    "row_missing_allreduce": Twin(fwd(om.MLP, om.row_plan("missing_allreduce"), mlp_x), 1, "`down/MatMul`", "missing_allreduce"),
    "row_missing_allreduce_train": Twin(step(om.MLP, om.row_plan("missing_allreduce"), mlp_batch), 1, "`down/MatMul`", "missing_allreduce"),
    "copy_no_allreduce_train": Twin(step(om.PreMLP, om.megatron_plan("copy_no_allreduce"), mlp_batch), 1, "`mlp.up (backward)/MatMul`", "copy_no_allreduce"),
    # class 2: the wrong collective or reduction
    "row_all_gather": Twin(fwd(om.MLP, om.row_plan("all_gather"), mlp_x), 2, "`down/MatMul`", "all_gather"),
    "row_all_gather_train": Twin(step(om.MLP, om.row_plan("all_gather"), mlp_batch), 2, "`down/MatMul`", "all_gather"),
    "row_max": Twin(fwd(om.MLP, om.row_plan("max"), mlp_x), 2, "`down/MatMul`", "reduce_op"),
    "row_max_train": Twin(step(om.MLP, om.row_plan("max"), mlp_batch), 2, "`down/MatMul`", "reduce_op"),
    # class 3: a replica added to partial sums before the all-reduce
    "row_bias_first": Twin(fwd(om.MLP, om.row_plan("bias_first"), mlp_x), 3, "`down.bias`", "bias_first"),
    "row_bias_first_train": Twin(step(om.MLP, om.row_plan("bias_first"), mlp_batch), 3, "`down.bias`", "bias_first"),
    # class 4: a replicated parameter's gradient left partial
    "sp_norm_grad_unreduced": Twin(step(om.NormMLP, om.sp_plan("unreduced"), seq_batch), 4, "`norm.weight`", "sp_norm"),
    # class 6: a fused projection cut from a plain shard
    "fused_qkv": Twin(fwd(lambda: om.Attention(fused=True), om.attn_plan(None, fused=True), attn_x), 6, "`qkv/MatMul`", "fused_qkv"),
    "fused_qkv_train": Twin(step(lambda: om.Attention(fused=True), om.attn_plan(None, fused=True), attn_batch), 6, "`qkv/MatMul`", "fused_qkv"),
    # class 7: replicated KV heads, every rank taking the first
    "kv_first": Twin(fwd(lambda: om.Attention(kv_heads=2), om.attn_plan("kv_first", shard_kv=False), attn_x), 7, "`k/MatMul`", "kv_first"),
    "kv_first_train": Twin(step(lambda: om.Attention(kv_heads=2), om.attn_plan("kv_first", shard_kv=False), attn_batch), 7, "`k/MatMul`", "kv_first"),
    # class 8: a reshape by the global head count moves the sharded axis
    "global_heads": Twin(fwd(om.Attention, om.attn_plan("global_heads"), attn_x), 8, "`q/MatMul`", "global_heads"),
    "global_heads_train": Twin(step(om.Attention, om.attn_plan("global_heads"), attn_batch), 8, "`q/MatMul`", "global_heads"),
    # class 9: positions not offset by the rank's place in the sequence
    "cp_positions_not_offset": Twin(fwd(om.PosModel, om.cp_plan("not_offset"), lambda: (torch.randn(2, 8, 16),)), 9, "`pos/Gather`", "cp_positions"),
    # class 10: loss normalised by a rank's (or a micro-batch's) own count
    "ddp_local_count": Twin(dp("ddp", om.token_ce, ignore=True), 10, "`labels`", "local_count"),
    "fsdp_local_count": Twin(dp("fsdp", om.token_ce, ignore=True), 10, "`labels`", "local_count"),
    "ddp_accumulate_local_count": Twin(dp("ddp", om.token_ce, ignore=True, micro_batches=2), 10, "`labels`", "local_count"),
    "accumulate_local_count": Twin(lambda: {**dp(None, om.token_ce, ignore=True)(), "world": 1, "micro_batches": 2}, 10, "`labels`", "local_count"),
    # class 11: a reduction over the wrong group
    "wrong_group": Twin(fwd(om.MLP, om.row_plan("wrong_group"), mlp_x, world=4), 11, "`down/MatMul`", "wrong_group"),
    # class 12: routing columns of the first rank's experts
    "ep_local_ids": Twin(fwd(om.MoE, om.ep_plan("local_ids"), lambda: (torch.randn(6, 16),)), 12, "`router/MatMul`", "ep_ids"),
    # class 13: a layer run on two pipeline stages
    "pp_layer_twice": Twin(pipeline("layer_twice"), 13, "`first`", "layer_twice"),
    # class 14: an extra factor
    "row_avg": Twin(fwd(om.MLP, om.row_plan("avg"), mlp_x), 14, "`down/MatMul`", "reduce_op"),
    "row_avg_train": Twin(step(om.MLP, om.row_plan("avg"), mlp_batch), 14, "`down/MatMul`", "reduce_op"),
    "row_half": Twin(fwd(om.MLP, om.row_plan("half"), mlp_x), 14, "`down/MatMul`", "half"),
    "row_half_train": Twin(step(om.MLP, om.row_plan("half"), mlp_batch), 14, "`down", "half"),
    "row_autograd_allreduce_train": Twin(step(om.MLP, om.row_plan("autograd_allreduce"), mlp_batch), 14, "`down (backward)/AllReduce`", "autograd_allreduce"),
    "local_scale": Twin(fwd(om.Attention, om.attn_plan("local_scale"), attn_x), 14, "`q/MatMul`", "local_scale"),
    "ddp_sum_loss": Twin(dp("ddp", om.summed_ce), 14, "`loss/ReduceSum`", "sum_loss"),
    "fsdp_sum_loss": Twin(dp("fsdp", om.summed_ce), 14, "`loss/ReduceSum`", "sum_loss"),
}

# The twins the default run leaves to the sweep (REFINE_TEST_SWEEP=1, benchmarks/sweep.py): the
# training-step twins whose forward twin runs by default (the same mistake in the same module; the
# backward export path runs by default with the twins of classes 1, 3, 4, 10, 14), and the same class
# at another place (class 2's max; class 14's other factors and the summed losses; class 10's DDP
# accumulation). The default run keeps a twin of every class, forward and training step, DDP, FSDP
# and accumulation.
SWEEP_ONLY = {"row_missing_allreduce_train", "row_all_gather_train", "row_max", "row_max_train", "row_bias_first",
              "fused_qkv_train", "kv_first_train", "global_heads_train", "row_avg_train", "row_half",
              "row_half_train", "local_scale", "ddp_sum_loss", "fsdp_sum_loss", "ddp_accumulate_local_count"}

CORRECT: dict[str, Twin] = {
    "row_train": Twin(step(om.MLP, om.row_plan(None), mlp_batch)),
    "megatron_train": Twin(step(om.PreMLP, om.megatron_plan(None), mlp_batch)),
    "sp_norm_grad_reduced": Twin(step(om.NormMLP, om.sp_plan("reduced"), seq_batch)),
    "attention": Twin(fwd(om.Attention, om.attn_plan(None), attn_x)),
    "kv_own": Twin(fwd(lambda: om.Attention(kv_heads=2), om.attn_plan("kv_own", shard_kv=False), attn_x)),
    "cp_positions_offset": Twin(fwd(om.PosModel, om.cp_plan("offset"), lambda: (torch.randn(2, 8, 16),))),
    "pp": Twin(pipeline(None)),
}


def export_twin(twin: Twin, out: Path) -> Path:
    """Export one case as a user would: the public API of refine.exporters."""
    torch.manual_seed(0)
    spec = twin.build()
    if spec["kind"] == "forward":
        refine.exporters.export_forward(spec["model"], spec["batch"], spec["world"], out, parallelize=spec["parallelize"])
    elif spec["kind"] == "train":
        refine.exporters.export_train(spec["model"], spec["loss_fn"], spec["batch"], spec["world"], out,
                                      parallelize=spec.get("parallelize"), data_parallel=spec.get("data_parallel"),
                                      micro_batches=spec.get("micro_batches", 1), ranges=spec.get("ranges"))
    else:  # a pipeline: each stage its own module, the last returning the output
        model, bug = spec["model"], spec["bug"]
        refine.exporters.export(copy.deepcopy(model), lambda r: om.Stage(copy.deepcopy(model), r, bug), spec["batch"],
                                spec["world"], out, output_names=["output"],
                                rank_output_names=lambda r: ["sent"] if r == 0 else ["output"])
    return out


@pytest.fixture(scope="session")
def reported(tmp_path_factory):
    """name -> (report, its JSON) of the twin or correct case `name`, exported and verified once."""
    root = tmp_path_factory.mktemp("own_bugs")
    done: dict[str, Any] = {}

    def get(name: str):
        if name not in done:
            report = verify_dir(export_twin({**TWINS, **CORRECT}[name], root / name))
            done[name] = (report, report.model_dump_json())
        return done[name]

    return get


def torch_files(report_json: str) -> list[str]:
    """Every source file a report names that lies inside torch."""
    return sorted({f for f in re.findall(r'"file":\s*"([^"]*)"', report_json) if "/torch/" in f.replace("\\", "/")})


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.skipif(
    not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the same class runs by default (SWEEP_ONLY)"))
    if name in SWEEP_ONLY else name for name in sorted(TWINS)])
def test_a_twin_names_its_class_its_tensor_and_its_line(reported, name):
    twin = TWINS[name]
    report, as_json = reported(name)
    assert report.verdict == "refuted", render_text(report)
    found = report.diagnosis
    assert found is not None, render_text(report)
    assert found.bug_class == twin.bug_class, found
    assert twin.tensor in found.summary, (twin.tensor, found.summary)
    assert found.location is not None and Path(found.location.file) == SOURCE, found.location
    assert found.location.line == bug_line(twin.marker), (found.location, twin.marker)
    second = render_text(report).splitlines()[1]
    assert second.startswith("  what is wrong: ") and f"own_models.py:{bug_line(twin.marker)}" in second, second
    assert not torch_files(as_json), torch_files(as_json)


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_correct_twin_verifies_and_names_no_class(reported, name):
    report, as_json = reported(name)
    assert report.verdict == "verified", render_text(report)
    assert report.diagnosis is None and "what is wrong" not in render_text(report)
    assert not torch_files(as_json)


def test_there_are_thirty_twins_over_every_class_but_the_vocabulary_loss():
    """At least 30 own-code twins; every class of docs/bugs.md but 5 (a vocab-parallel loss of
    one's own is issue 38's: its correct twin is not proven yet) has one, in the default run too."""
    assert len(TWINS) >= 30
    assert {t.bug_class for t in TWINS.values()} == set(range(1, 15)) - {5}
    assert SWEEP_ONLY < set(TWINS)
    assert {t.bug_class for n, t in TWINS.items() if n not in SWEEP_ONLY} == set(range(1, 15)) - {5}


TRACE_NAME = re.compile(r"(view|add|mul|mm|addmm|permute|getitem|wait_tensor|all_reduce|all_gather_into_tensor|sub|div|"
                        r"t|expand|clone|unsqueeze|squeeze|transpose|sum|neg|relu|softmax|cat|slice|select|bmm|"
                        r"convert_element_type|val)(_\d+)?")


def tensor_names(report_json: str) -> list[str]:
    """Every tensor a report names: the relations' and collectives' tensors, the names in
    backticks in its words."""
    data = json.loads(report_json)
    names: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for key, value in x.items():
                if key in ("input", "rank_tensor", "output", "tensor", "seq_tensor") and isinstance(value, str):
                    names.append(value)
                elif key == "summary" and isinstance(value, str):
                    names.extend(re.findall(r"`([^`]+)`", value))
                else:
                    walk(value)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(data)
    return names


@pytest.mark.parametrize("name", ["row_bias_first_train", "ddp_local_count", "sp_norm_grad_unreduced", "fused_qkv"])
def test_no_tensor_is_named_by_a_trace_name(reported, name):
    """Reports speak the user's words: no torch trace name (`view_33`, `add_2`) for any tensor
    of a twin's report (JSON: relations, collectives, words)."""
    names = tensor_names(reported(name)[1])
    assert names and not [n for n in names if TRACE_NAME.fullmatch(n)], names
