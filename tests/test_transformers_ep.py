"""HF transformers' mixture-of-experts models under HF's own expert-parallel plan (issue 42):
`refine export --framework transformers --model-type T --tp N --ep N`.

HF's `AllReduceEP` (the `ep_implementation` HF picks at inference when the expert group is the
TP group): every rank routes the whole batch, runs the routes to its own experts (the stacked
expert weights `Shard(0)`), masks the others (local id `e`, weight 0) and all-reduces the partial
outputs; with HF's `batched_mm` experts each routed row gathers its expert's weights. Forward and
training step verify and match torch (rules/owned_rows.lp), Qwen2-MoE's shared expert too; the
twins of exporters/frameworks/transformers_bugs.py are refuted, and torch's own run disagrees.
With HF's default `grouped_mm` experts each side sorts the routes in its own order, the rank by
local id (rules/sorted_rows.lp): Mixtral's and gpt-oss's forward and training step (gpt-oss's
per-expert biases at the clamped sorted ids) verify too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import refine.exporters  # noqa: E402
from harness import SWEEP, assert_export_refused, assert_verified_and_matches_torch, exports_on_first_use, invoke  # noqa: E402
from refine.exporters.frameworks import transformers as hf  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

# name -> export_model_type arguments beyond (model type, tp 2, ep 2, batched_mm experts)
EXPORTS = {
    "mixtral": dict(model_type="mixtral"),
    "mixtral_train": dict(model_type="mixtral", train=True),
    "qwen3_moe": dict(model_type="qwen3_moe"),
    "qwen3_moe_train": dict(model_type="qwen3_moe", train=True),
    "ep_global_ids": dict(model_type="mixtral", bug="ep_global_ids"),
    "ep_output_mean": dict(model_type="mixtral", bug="ep_output_mean"),
    "ep_router_grad_unreduced": dict(model_type="mixtral", train=True, bug="ep_router_grad_unreduced"),
    "ep_input_grad_unreduced": dict(model_type="mixtral", train=True, bug="ep_input_grad_unreduced"),
    "qwen2_moe": dict(model_type="qwen2_moe"),  # a shared expert (replicated) added after the experts' all-reduce
    "ep_shared_before_reduce": dict(model_type="qwen2_moe", bug="ep_shared_before_reduce"),
    # HF's default experts (grouped_mm: the routes sorted by local id, rules/sorted_rows.lp)
    "mixtral_grouped_mm": dict(model_type="mixtral", experts="grouped_mm"),
    "mixtral_grouped_mm_train": dict(model_type="mixtral", experts="grouped_mm", train=True),
    "gpt_oss_grouped_mm": dict(model_type="gpt_oss", experts="grouped_mm"),  # per-expert biases at clamped ids
    # (its interleaved gate/up's gradient scattered back off the route axis, its biases' at the sorted ids)
    "gpt_oss_grouped_mm_train": dict(model_type="gpt_oss", experts="grouped_mm", train=True),
    "ep_global_ids_grouped_mm": dict(model_type="mixtral", bug="ep_global_ids", experts="grouped_mm"),
    # HF's AllToAllEP (routes exchanged by ragged all-to-alls, at static capacity: exporters/capture/ragged.py)
    "mixtral_all_to_all": dict(model_type="mixtral", ep_implementation="all_to_all"),
    # ... with HF's default experts: the receiver sorts its received rows again (rules/placed_rows.lp)
    "mixtral_all_to_all_grouped": dict(model_type="mixtral", ep_implementation="all_to_all", experts="grouped_mm"),
    "mixtral_all_to_all_grouped_train": dict(model_type="mixtral", ep_implementation="all_to_all", experts="grouped_mm",
                                             train=True),
    "ep_counts_unexchanged": dict(model_type="mixtral", ep_implementation="all_to_all", bug="ep_counts_unexchanged"),
    "ep_combine_forward_order": dict(model_type="mixtral", ep_implementation="all_to_all", bug="ep_combine_forward_order"),
    "mixtral_all_to_all_train": dict(model_type="mixtral", ep_implementation="all_to_all", train=True),
}
SWEEP_ONLY = ("qwen3_moe_train", "ep_input_grad_unreduced")


def _sweep(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.skipif(not SWEEP, reason="harness.SWEEP")) if n in SWEEP_ONLY else n
            for n in names]


@pytest.fixture(scope="module")
def ep_dir(tmp_path_factory):
    """name -> its export directory, exported on first use."""
    return exports_on_first_use(tmp_path_factory.mktemp("transformers_ep"),
                                lambda name, out: hf.export_model_type(out=out, tp=2, ep=2,
                                                                       **{"experts": "batched_mm", **EXPORTS[name]}))


@pytest.mark.parametrize("name", _sweep(["mixtral", "mixtral_train", "qwen3_moe", "qwen3_moe_train", "qwen2_moe",
                                          "mixtral_grouped_mm", "mixtral_grouped_mm_train", "gpt_oss_grouped_mm",
                                          "gpt_oss_grouped_mm_train", "mixtral_all_to_all", "mixtral_all_to_all_train",
                                          "mixtral_all_to_all_grouped"]))
def test_hf_expert_parallel_plans_verify_and_match_torch(ep_dir, name: str) -> None:
    assert_verified_and_matches_torch(ep_dir(name))


def test_the_experts_are_split_and_the_record_rebuilds_the_model(ep_dir) -> None:
    """Each rank holds its block of the stacked experts (HF's grouped_gemm: Shard(0)); the router
    is replicated; the manifest records the expert-parallel plan and the experts implementation
    (what `--check` rebuilds the model with)."""
    out = ep_dir("mixtral")
    inputs = json.loads((out / "refine.json").read_text())["inputs"]
    assert inputs["model.layers.0.mlp.experts.gate_up_proj"] == {"layout": "shard", "axis": 0}
    assert inputs["model.layers.0.mlp.experts.down_proj"] == {"layout": "shard", "axis": 0}
    assert inputs["model.layers.0.mlp.gate.weight"] == {"layout": "rep"}
    zoo = json.loads((out / "export.json").read_text())["zoo"]
    assert zoo["ep"] is True and zoo["experts"] == "batched_mm" and zoo["bug"] is None


@pytest.mark.parametrize("name,bug_class,node", [
    ("ep_global_ids", 12, "model.layers.0/mlp.experts/"),
    ("ep_output_mean", 14, "model.layers.0/"),
    ("ep_router_grad_unreduced", 1, "model.layers.1 (backward)/mlp"),
    ("ep_shared_before_reduce", 3, "model.layers.0/mlp/"),
    pytest.param("ep_input_grad_unreduced", 1, "model.layers.1 (backward)/",
                 marks=pytest.mark.skipif(not SWEEP, reason="harness.SWEEP")),
])
def test_expert_parallel_twins_are_refuted(ep_dir, name: str, bug_class: int, node: str) -> None:
    """Each twin of HF's AllReduceEP is refuted inside the experts' layer (the first failure in
    transformers' MoE code or the router's backward), what is wrong said with its bug class;
    torch's own run of the ranks disagrees too."""
    out = ep_dir(name)
    report = verify_dir(out)
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert f"[docs/bugs.md class {bug_class}]" in text, text
    assert report.failure is not None and report.failure.node.startswith(node), text
    if name == "ep_router_grad_unreduced":  # (the partial the missing all-reduce leaves: the router's input gradient)
        assert "is missing after `model.layers.1 (backward)/mlp.gate (backward)/" in text, text
    assert not refine.exporters.check(out).ok


def test_global_ids_sorted_by_grouped_mm_are_refuted(ep_dir) -> None:
    """The global-id twin under HF's default grouped_mm experts: the rank sorts and counts the
    global ids, so its groups (the counts' cumulative sum) are wrong; refuted inside the experts,
    at the counts, and torch's own run disagrees."""
    out = ep_dir("ep_global_ids_grouped_mm")
    report = verify_dir(out)
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert report.failure is not None and report.failure.node.startswith("model.layers.0/mlp.experts/"), text
    assert not refine.exporters.check(out).ok


@pytest.mark.parametrize("name", ["mixtral_all_to_all_grouped_train"])
def test_hf_all_to_all_dispatch_exports_at_static_capacity(ep_dir, name: str) -> None:
    """HF's AllToAllEP, its code unmodified: the split sizes stay count tensors of the programs,
    each ragged exchange a dist.AllToAllV (the backward's too, the counts swapped); the programs
    compute what torch computes (the padding rows of each receive buffer are never sent back).
    With HF's default experts (the receiver sorts its rows again) the training step VERIFIES
    (rules/placed_rows.lp: the backward through the receiver's second sort and the placed combine)."""
    import onnx

    out = ep_dir(name)
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()
    ops = [n.op_type for f in onnx.load(str(out / "rank0.onnx")).functions for n in f.node]
    assert ops.count("AllToAllV") >= (4 if "train" in name else 2), ops  # (dispatch and combine, and their backward)
    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)


@pytest.mark.parametrize("name", ["ep_counts_unexchanged", "ep_combine_forward_order"])
def test_all_to_all_twins_are_refuted(ep_dir, name: str) -> None:
    """AllToAllEP without its count exchange (each rank takes the counts it sends for those it
    receives: its split sizes and local expert ids are wrong; the simulator's count check, or the
    experts' wrong rows), and its combine gathering the rows brought back at the sort's order
    where it scatters them by it: refuted inside layer 0's experts, and torch's own run disagrees."""
    out = ep_dir(name)
    report = verify_dir(out)
    text = render_text(report)
    assert report.verdict == "refuted", text
    if name == "ep_combine_forward_order":  # (its counts are right: the failure is where the routes meet their weights)
        assert report.failure is not None and report.failure.node.startswith("model.layers.0/mlp.experts/"), text
    assert not refine.exporters.check(out).ok


@pytest.mark.parametrize("args,words", [
    (["--model-type", "mixtral", "--tp", "2", "--ep", "4"], "pass --ep 2"),
    (["--model-type", "mixtral", "--ep-implementation", "all_to_all"], "pass --ep N"),
    (["--model-type", "mixtral", "--ep", "2", "--ep-implementation", "ragged"], "one of all_reduce, all_to_all"),
    (["--model-type", "mixtral", "--ep", "2", "--bug", "ep_counts_unexchanged"], "pass --ep-implementation all_to_all"),
    (["--model-type", "mixtral", "--ep", "2", "--ep-implementation", "all_to_all", "--bug", "ep_global_ids"],
     "pass --ep-implementation all_reduce"),
    (["--model", "mixtral", "--ep-implementation", "all_to_all"], "--ep-implementation is HF's"),
    (["--model-type", "llama", "--ep", "2"], "ships no expert-parallel plan"),
    (["--model-type", "mixtral", "--experts", "eager"], "a loop torch.export cannot capture"),
    (["--model-type", "mixtral", "--ep", "2", "--bug", "not_a_bug"], "unknown transformers bug 'not_a_bug'"),
    (["--model-type", "mixtral", "--bug", "ep_global_ids"], "pass --ep N"),
    (["--model-type", "mixtral", "--ep", "2", "--bug", "ep_router_grad_unreduced"], "pass --train"),
    (["--model-type", "mixtral", "--ep", "2", "--bug", "ep_shared_before_reduce"], "pass --model-type qwen2_moe"),
    (["--model", "mixtral", "--experts", "batched_mm"], "--experts is HF's experts implementation"),
])
def test_bad_expert_parallel_requests_are_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, *([] if "--model" in args else ["--framework", "transformers"]),
                          *args)


def test_a_model_you_built_under_the_expert_parallel_plan(tmp_path: Path) -> None:
    """`export_hf_model(model, N, out, ep=True)`: a model the user built (batched_mm experts) under
    HF's TP and expert-parallel plans verifies and matches torch."""
    import torch
    from transformers import AutoModelForCausalLM

    from refine.exporters.frameworks.transformers_configs import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("olmoe", 2).config, attn_implementation="eager",
                                             experts_implementation="batched_mm")
    out = hf.export_hf_model(model, 2, tmp_path / "olmoe", ep=True).out_dir
    assert_verified_and_matches_torch(out, hf.as_logits_model(model))


def test_the_zoo_holds_both_experts_implementations_under_ep() -> None:
    """`refine zoo --framework transformers --ep --experts batched_mm,grouped_mm`: an entry per
    implementation (HF's default `grouped_mm` named `_ep_grouped`), each expected to verify; `--experts`
    without `--ep`, or an implementation refine does not export under EP, is one line, exit 2."""
    result = invoke("zoo", "--framework", "transformers", "--ep", "--experts", "batched_mm,grouped_mm",
                    "--model-types", "mixtral", "--steps", "infer,train", "--list")
    assert result.exit_code == 0, result.output
    assert [line.split("\t")[0] for line in result.output.splitlines() if line.startswith("hf_")] == [
        "hf_mixtral_tp2_ep", "hf_mixtral_tp2_ep_grouped", "hf_mixtral_tp2_ep_train", "hf_mixtral_tp2_ep_grouped_train"]
    for args, words in ((["--experts", "grouped_mm"], "add --ep"), (["--ep", "--experts", "eager"], "unknown experts")):
        refused = invoke("zoo", "--framework", "transformers", "--model-types", "mixtral", *args, "--list")
        assert refused.exit_code == 2 and words in refused.output, refused.output


def test_the_zoo_holds_all_to_all_entries(ep_dir, tmp_path) -> None:
    """`refine zoo --framework transformers --ep --ep-implementation all_reduce,all_to_all`: an entry
    per dispatch (AllToAllEP's named `_ep_a2a`) and experts implementation, forward and training
    step, each expected to verify; an AllToAllEP export of the same recipe is current."""
    from refine.exporters.frameworks.transformers_zoo import TransformersEntry
    from refine.exporters.zoo.entries import is_current

    result = invoke("zoo", "--framework", "transformers", "--ep", "--ep-implementation", "all_reduce,all_to_all",
                    "--experts", "batched_mm,grouped_mm", "--model-types", "mixtral", "--steps", "infer,train", "--list")
    assert result.exit_code == 0, result.output
    assert [line.split("\t")[0] for line in result.output.splitlines() if line.startswith("hf_")] == [
        "hf_mixtral_tp2_ep", "hf_mixtral_tp2_ep_a2a", "hf_mixtral_tp2_ep_grouped", "hf_mixtral_tp2_ep_a2a_grouped",
        "hf_mixtral_tp2_ep_train", "hf_mixtral_tp2_ep_a2a_train", "hf_mixtral_tp2_ep_grouped_train",
        "hf_mixtral_tp2_ep_a2a_grouped_train"], result.output
    assert "left out" not in result.output, result.output
    shutil.copytree(ep_dir("mixtral_all_to_all"), tmp_path / "hf_mixtral_tp2_ep_a2a")
    config = tmp_path / "hf_mixtral_tp2_ep_a2a" / "refine.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "expect": {"verdict": "verified"}}))
    assert is_current(TransformersEntry("mixtral", 2, ep=True, ep_implementation="all_to_all"), tmp_path)
    assert not is_current(TransformersEntry("mixtral", 2, ep=True), tmp_path / "hf_mixtral_tp2_ep_a2a")
    refused = invoke("zoo", "--framework", "transformers", "--model-types", "mixtral", "--ep-implementation",
                     "all_to_all", "--list")
    assert refused.exit_code == 2 and "add --ep" in refused.output, refused.output


def test_hf_collectives_are_located_at_hf_lines(ep_dir) -> None:
    """A collective HF's code issues (a TP style's all-reduce, AllToAllEP's exchanges) is located at
    HF's modeling line that reaches it, never at refine's wrapper of the model (its forward is the
    outermost frame of every node, refine/lowering/graphs.py call_site_frames)."""
    from refine.lowering.graphs import lower_dir

    facts = lower_dir(ep_dir("mixtral_all_to_all"))
    ops = {(g, n): op for g, n, op in facts.rows["node"]}
    files = {(ops[(g, n)], file) for g, n, _module, file, _line in facts.rows["loc"]
             if g == "r0" and ops.get((g, n), "").startswith("dist.")}
    assert {op for op, _ in files} >= {"dist.AllReduce", "dist.AllToAll", "dist.AllToAllV", "dist.AllGather"}, files
    assert all("/transformers/models/mixtral/" in file for _, file in files), files
