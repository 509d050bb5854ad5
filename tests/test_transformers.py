"""HF transformers models under HF's own tensor-parallel plans (issue 40): `refine export
--framework transformers` and `export_hf_model`.

Each export is made once per module (tiny configs: 2 layers, 8 heads, 4 key/value heads, vocab
128); the tests read them. The correct ones must verify and match torch; the two user overrides
that HF accepts but that compute something else (a plain colwise split of a fused gate/up
weight; qwen3's per-head norms without their gradient all-reduce) must be refuted, and torch's
own run of the TP model must disagree too. Mixture-of-experts types under HF's `moe_tp_experts`
(each expert split over TP, HF's own experts code: the sort by expert, the grouped GEMM, the
inverse permutation) verify too, with HF's default experts implementation (`grouped_mm`, on a
float32 CPU model HF's own fallback op) and with `batched_mm`. Every model type of the issue at
TP 2 and 4, forward and training step, runs under harness.SWEEP, with Llama's training step,
gemma2, the MoE training step and `batched_mm` (SWEEP_ONLY)
(benchmarks/transformers_plans.py covers every type).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import onnx  # noqa: E402
import torch  # noqa: E402

import refine.exporters  # noqa: E402
from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402
from refine.exporters.errors import ExportError  # noqa: E402
from refine.exporters.frameworks import transformers as hf  # noqa: E402
from refine.exporters.frameworks.transformers_configs import tiny_config  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402

HF_SITE = "/site-packages/transformers/"

# name -> export_model_type arguments (HF's plan as shipped)
TYPES = {
    "llama": dict(model_type="llama", tp=2),
    "llama_train": dict(model_type="llama", tp=2, train=True),
    "gemma2": dict(model_type="gemma2", tp=2),  # tied LM head, soft-capping, sliding windows
    "qwen3_train": dict(model_type="qwen3", tp=2, train=True),  # q/k norms: replicated_with_grad_allreduce
    "qwen3_moe": dict(model_type="qwen3_moe", tp=2),  # moe_tp_experts, HF's grouped_mm experts
    "qwen3_moe_train": dict(model_type="qwen3_moe", tp=2, train=True),
    # MLA: kv_a_proj_with_mqa's mla_kv_a_proj style all-reduces the rope part's gradient only (a replica next to
    # a partial in the backward)
    "glm4_moe_lite_train": dict(model_type="glm4_moe_lite", tp=2, train=True),
    # complex rotary frequencies (torch.polar) handed to every layer: exporters/capture/complex_ops.py
    "deepseek_v2_train": dict(model_type="deepseek_v2", tp=2, train=True),
}
# name -> export_model_type arguments: one of HF's styles with one line changed (exporters/frameworks/transformers_bugs.py)
TWINS = {"mla_rope_grad_unreduced": dict(model_type="glm4_moe_lite", tp=2, train=True, bug="mla_rope_grad_unreduced")}
# name -> (model type, HF's experts implementation a user picks: from_config(experts_implementation=...))
IMPLEMENTATIONS = {"qwen3_moe_batched_mm": ("qwen3_moe", "batched_mm")}
# name -> (model type, train, the tp_plan overrides a user passes as DistributedConfig(tp_plan=...))
OVERRIDES = {
    # fused [gate; up] as HF's packed style shards it: each rank [gate_r; up_r] (a _StridedShard)
    "phi3_packed": ("phi3", False, {"model.layers.*.mlp.gate_up_proj": "packed_colwise",
                                    "model.layers.*.mlp.down_proj": "rowwise"}),
    # ... and as a plain column split: rank 0 all of gate, rank 1 all of up (BUGS.md class 6)
    "phi3_colwise": ("phi3", False, {"model.layers.*.mlp.gate_up_proj": "colwise",
                                     "model.layers.*.mlp.down_proj": "rowwise"}),
    # qwen3's per-head q/k norms kept replicated without the gradient all-reduce (BUGS.md class 4)
    "qwen3_norm_replicate": ("qwen3", True, {"model.layers.*.self_attn.q_norm": "replicate",
                                             "model.layers.*.self_attn.k_norm": "replicate"}),
    # the experts' weights split by the plan, but their module kept local (no moe_tp_experts: no all-reduce
    # of each rank's partial rows, BUGS.md class 1)
    "qwen3_moe_experts_local": ("qwen3_moe", False, {"model.layers.*.mlp.experts": "local_params"}),
}


def user_model(model_type: str, **options: str) -> torch.nn.Module:
    """An HF causal LM as a user builds it (from a config, eager attention, `options` such as
    experts_implementation), seeded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, 2).config, attn_implementation="eager", **options)


def _user_model_of(name: str) -> torch.nn.Module:
    if name in IMPLEMENTATIONS:
        model_type, experts = IMPLEMENTATIONS[name]
        return user_model(model_type, experts_implementation=experts)
    return user_model(OVERRIDES[name][0])


def _export(name: str, out: Path) -> None:
    if name in TYPES or name in TWINS:
        hf.export_model_type(out=out, **{**TYPES, **TWINS}[name])
        return
    if name in IMPLEMENTATIONS:
        hf.export_hf_model(_user_model_of(name), 2, out)
        return
    _, train, plan = OVERRIDES[name]
    hf.export_hf_model(_user_model_of(name), 2, out, tp_plan=plan, train=train)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """name -> its export directory, exported on first use."""
    return exports_on_first_use(tmp_path_factory.mktemp("transformers"), _export)


def _check(name: str, out: Path) -> refine.exporters.CheckResult:
    """torch (the sequential model, and the TP programs' rebuild) against the exported programs."""
    if name in TYPES or name in TWINS:
        return refine.exporters.check(out)
    return refine.exporters.check(out, hf.as_logits_model(_user_model_of(name)))


# harness.SWEEP only: Llama's training step (the HF training path runs by default on qwen3's step, with
# its norm hooks), gemma2 (another model type through the same front end), the MoE training step (its
# forward, grouped_mm dispatch and all, runs by default, with its twin) and batched_mm
SWEEP_ONLY = ("llama_train", "gemma2", "qwen3_moe_train", "qwen3_moe_batched_mm")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.skipif(not SWEEP, reason="harness.SWEEP"))
                                  if name in SWEEP_ONLY else name for name in [*TYPES, "phi3_packed", *IMPLEMENTATIONS]])
def test_hf_plans_verify_and_match_torch(hf_dir, name: str) -> None:
    """HF's plan as shipped (embedding_rowwise included; gemma2's tied head; qwen3's norm
    gradients all-reduced by HF's own hooks), and a packed_colwise override, verify, and the
    programs compute what torch computes."""
    out = hf_dir(name)
    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)
    checked = _check(name, out)
    assert checked.ok, checked.render()


@pytest.mark.parametrize("name,node,bug_class,source", [
    ("phi3_colwise", "model.layers.0/mlp", 6, "phi3/modeling_phi3.py:"),
    ("qwen3_norm_replicate", "model.layers.0 (backward)/self_attn.q_norm (backward)", 4, "qwen3/modeling_qwen3.py:"),
    ("qwen3_moe_experts_local", "model.layers.0/", 1, "integrations/moe.py:"),
])
def test_wrong_overrides_are_refuted_at_hf_lines(hf_dir, name: str, node: str, bug_class: int, source: str) -> None:
    """A plan HF applies without complaint but that computes something else is refuted in
    layer 0, in transformers' code, and what is wrong is said in words at a line of the model's
    own source, with the bug class; torch's own run of the TP programs disagrees as well."""
    out = hf_dir(name)
    report = verify_dir(out)
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert f"[docs/bugs.md class {bug_class}]" in text and source in text, text
    assert report.failure is not None and report.failure.node.startswith(node), text
    assert report.failure.location is not None and HF_SITE in report.failure.location.file, text
    assert not _check(name, out).ok


def test_a_style_twin_is_refuted_where_the_gradient_stays_partial(hf_dir) -> None:
    """HF's mla_kv_a_proj style without its all-reduce of the rope part's gradient (its twin:
    glm4_moe_lite_train, HF's style as shipped, verifies above): a missing all-reduce in the
    attention's backward, said in words at a line of the model's source; torch's own run of the
    TP programs disagrees."""
    out = hf_dir("mla_rope_grad_unreduced")
    report = verify_dir(out)
    text = render_text(report)
    assert report.verdict == "refuted", text
    assert "an all-reduce (sum) is missing" in text and "[docs/bugs.md class 1]" in text, text
    assert "glm4_moe_lite/modeling_glm4_moe_lite.py:" in text, text
    assert report.failure is not None and report.failure.node.startswith("model.layers.1 (backward)/self_attn"), text
    assert not _check("mla_rope_grad_unreduced", out).ok


def test_refine_json_is_read_off_dtensor(hf_dir) -> None:
    """Token ids in [0, vocab); the vocab-parallel embedding and the LM head row-sharded, the
    projections by HF's colwise/rowwise, norms replicated; the fused gate/up of packed_colwise a
    strided shard (refine.json's stride 2: each rank [gate_r; up_r])."""
    inputs = json.loads((hf_dir("llama") / "refine.json").read_text())["inputs"]
    assert inputs["input_ids"] == {"layout": "rep", "range": [0, 128]}
    assert inputs["model.embed_tokens.weight"] == {"layout": "shard", "axis": 0}
    assert inputs["lm_head.weight"] == {"layout": "shard", "axis": 0}
    assert inputs["model.layers.0.self_attn.k_proj.weight"] == {"layout": "shard", "axis": 0}
    assert inputs["model.layers.0.self_attn.o_proj.weight"] == {"layout": "shard", "axis": 1}
    assert inputs["model.layers.0.input_layernorm.weight"] == {"layout": "rep"}
    packed = json.loads((hf_dir("phi3_packed") / "refine.json").read_text())["inputs"]
    assert packed["model.layers.0.mlp.gate_up_proj.weight"] == {"layout": "shard", "axis": 0, "stride": 2}


def test_the_vocab_parallel_lookup_is_masked_in_one_place(hf_dir) -> None:
    """embedding_rowwise on each rank: the ids it does not own masked (Where), the lookup, the
    foreign rows zeroed, one all-reduce; no data-dependent scatter (NonZero/ScatterND)."""
    model = onnx.load(str(hf_dir("llama") / "rank1.onnx"))
    embedding = [n for n in model.graph.node if n.name.startswith("model.embed_tokens/")]
    ops = [n.op_type for n in embedding]
    assert ops.count("Where") == 2 and "Gather" in ops and "AllReduce" in ops, ops
    assert not {"NonZero", "ScatterND"} & {n.op_type for n in model.graph.node}


def test_layers_are_memoized_and_the_versions_recorded(hf_dir) -> None:
    """The decoder layers of the forward share one function per program; the manifest names the
    transformers installed and how to rebuild the model."""
    from importlib import metadata

    manifest = json.loads((hf_dir("llama") / "export.json").read_text())
    assert manifest["layers"]["stack"] == "model.layers"
    for program in (manifest["layers"]["seq"], *manifest["layers"]["ranks"]):
        assert list(program["functions"].values()) == [["model.layers.0", "model.layers.1"]]
    assert manifest["transformers"] == metadata.version("transformers")
    assert manifest["zoo"]["framework"] == "transformers" and manifest["zoo"]["model"] == "llama"


def test_hooked_training_steps_are_flat_and_their_hooks_run(hf_dir) -> None:
    """qwen3's step is exported flat (HF registers its norm gradient hooks in each layer's
    forward, which a stub layer would skip), and each rank's program all-reduces the q/k norm
    gradients: HF's post-accumulate hooks, run on the gradients (capture/train.py `accumulated`)."""
    out = hf_dir("qwen3_train")
    assert json.loads((out / "export.json").read_text())["layers"] is None
    model = onnx.load(str(out / "rank0.onnx"))
    reduced = {name for n in model.graph.node if n.op_type == "AllReduce" for name in n.output}
    q_norm = next(o for o in model.graph.output if o.name == "grad.model.layers.0.self_attn.q_norm.weight")
    producers = {o: n for n in model.graph.node for o in n.output}
    node, seen = producers[q_norm.name], 0
    while node.op_type != "AllReduce" and node.input and node.input[0] in producers and seen < 8:
        node, seen = producers[node.input[0]], seen + 1
    assert node.op_type == "AllReduce" and node.output[0] in reduced


def test_the_zoo_lists_types_and_keeps_current_entries(hf_dir, tmp_path: Path) -> None:
    """`refine zoo --framework transformers --list`: an entry per chosen type that exports, a note
    with the reason for one that does not; an entry already written with the same recipe is kept."""
    from refine.exporters.frameworks.transformers_zoo import TransformersEntry
    from refine.exporters.zoo.entries import is_current

    result = invoke("zoo", "--framework", "transformers", "--model-types", "llama,gemma4_vision", "--list")
    assert result.exit_code == 0, result.output
    assert "hf_llama_tp2\tverified" in result.output
    assert "hf_gemma4_vision_tp2 left out" in result.output and "has no token vocabulary" in result.output
    shutil.copytree(hf_dir("llama"), tmp_path / "hf_llama_tp2")
    config = tmp_path / "hf_llama_tp2" / "refine.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "expect": {"verdict": "verified"}}))
    assert is_current(TransformersEntry("llama", 2), tmp_path)
    assert not is_current(TransformersEntry("llama", 2, "train"), tmp_path)


@pytest.mark.parametrize("args,words", [
    (["--model-type", "not_a_type"], "unknown model type 'not_a_type'"),
    (["--model-type", "bert"], "ships no tensor-parallel plan"),
    (["--model-type", "llama", "--tp", "3"], "8 attention heads do not divide by --tp 3"),
    (["--model-type", "llama", "--sp"], "ships no sequence-parallel plan"),
    (["--model-type", "llama", "--tp", "1"], "--tp must be at least 2"),
    (["--model-type", "gemma4_vision"], "has no token vocabulary"),  # a vision encoder: no token ids to feed
    # per-layer key/value heads (a heterogeneous config): its full-attention layers' single head
    (["--model-type", "embedding_gemma2_text"], "1 key/value heads do not divide by --tp 2"),
    (["--model", "llama"], "drop --model"),
])
def test_bad_requests_are_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--framework", "transformers", *args)


def test_bad_config_files_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "qwen2.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 128}))
    assert_export_refused(tmp_path / "out", "not --model-type 'llama'", "--framework", "transformers",
                          "--model-type", "llama", "--config", tmp_path / "qwen2.json")
    (tmp_path / "bad.json").write_text("{")
    assert_export_refused(tmp_path / "out", "not a readable config.json", "--framework", "transformers",
                          "--config", tmp_path / "bad.json")
    assert_export_refused(tmp_path / "out", "--model-type is for --framework transformers", "--model", "llama",
                          "--model-type", "llama")


def test_a_config_file_names_its_model_type(tmp_path: Path) -> None:
    """`--config FILE.json` (a config.json as HF writes it) gives the model type and sizes it holds."""
    from refine.exporters.frameworks.transformers_configs import validate

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("qwen2", 4).config.to_dict()))
    hf_config = validate(None, str(path), 4)
    assert hf_config.model_type == "qwen2" and hf_config.source == str(path) and hf_config.config.num_key_value_heads == 4


def test_a_capture_failure_in_an_hf_style_names_the_style_and_its_rules() -> None:
    """A failure whose line is in one of HF's parallel styles says which style, and the plan's rules
    that use it."""
    import inspect

    from transformers.distributed import tensor_parallel

    file = inspect.getsourcefile(tensor_parallel.RowwiseParallel)
    line = inspect.getsourcelines(tensor_parallel.RowwiseParallel)[1] + 3
    plan = {"model.layers.0.mlp.down_proj": "rowwise", "model.layers.0.mlp.up_proj": "colwise"}
    words = hf._style_at(f"M (torch.export) cannot be captured: RuntimeError: x (at {file}:{line})", plan)
    assert words.startswith("; in HF's parallel style RowwiseParallel (") and "model.layers.0.mlp.down_proj" in words
    assert "up_proj" not in words
    assert hf._style_at("M cannot be captured: RuntimeError: x (at /elsewhere/model.py:3)", plan) == ""


def test_the_api_refuses_models_it_cannot_export(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="tp must be at least 2"):
        hf.export_hf_model(user_model("llama"), 1, tmp_path / "out")
    with pytest.raises(ExportError, match="no HF transformers model"):
        hf.export_hf_model(torch.nn.Linear(2, 2), 2, tmp_path / "out")


def test_strided_shards_are_read_off_dtensor() -> None:
    """A `_StridedShard(dim, split_factor)` parameter is refine.json's stride layout exactly when
    DTensor's own split gives each rank chunk r of every block (read off an index vector)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from refine.config import ShardLayout, shard_indices
    from refine.exporters.capture.layouts import derive_layout, rank_pieces
    from refine.exporters.capture.tracing import fake_process_group

    for world, split, size in ((2, 2, 16), (4, 2, 16), (2, 3, 12)):
        pieces = []
        for rank in range(world):
            with fake_process_group(rank, world):
                mesh = init_device_mesh("cpu", (world,))
                module = torch.nn.Linear(4, size)
                module.weight = torch.nn.Parameter(distribute_tensor(
                    torch.arange(size * 4.0).reshape(size, 4), mesh, [_StridedShard(0, split_factor=split)],
                    src_data_rank=None))
                held = module.weight.to_local()[:, 0].div(4).long().tolist()
                assert held == shard_indices(ShardLayout(layout="shard", axis=0, stride=split), size, world)[rank]
                pieces.append(rank_pieces(module, rank, world)["weight"])
        assert derive_layout("weight", pieces) == {"layout": "shard", "axis": 0, "stride": split}
    with fake_process_group(0, 4), pytest.raises(ExportError, match="no refine.json layout"):
        mesh = init_device_mesh("cpu", (4,))
        module = torch.nn.Linear(4, 12)  # 12 rows: 2 blocks of 6, not 4 equal chunks each
        module.weight = torch.nn.Parameter(distribute_tensor(module.weight.data, mesh, [_StridedShard(0, split_factor=2)],
                                                             src_data_rank=None))
        rank_pieces(module, 0, 4)


SWEEP_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")


@pytest.mark.skipif(not SWEEP, reason="every model type of issue 40 at TP 2 and 4: harness.SWEEP")
@pytest.mark.parametrize("model_type", SWEEP_TYPES)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_issue_types_verify_at_tp_2_and_4(tmp_path: Path, model_type: str, tp: int, train: bool) -> None:
    out = hf.export_model_type(model_type, tp, tmp_path / "out", train=train).out_dir
    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


def test_an_expert_parallel_plan_is_one_line(tmp_path: Path) -> None:
    """A TP plan that distributes the experts over the ranks (an expert-parallel style) without
    the expert-parallel plan (`ep`) is refused in one line naming --ep, before anything is captured
    (tests/test_transformers_ep.py: HF's expert-parallel plan)."""
    plan = {"model.layers.*.mlp.experts": "grouped_gemm"}
    with pytest.raises(ExportError, match="distributes its experts over the ranks.*--ep"):
        hf.export_hf_model(user_model("qwen3_moe"), 2, tmp_path / "out", tp_plan=plan)


def test_a_training_step_trace_takes_hfs_export_paths() -> None:
    """Inside hf_export_paths every loaded transformers module that asks is_torchdynamo_exporting()
    is told yes (the gated delta rule's forward substitution instead of solve_triangular), and is
    told the truth again after."""
    from transformers.masking_utils import is_torchdynamo_exporting as before
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    assert not qwen3_next.is_torchdynamo_exporting()
    with hf.hf_export_paths():
        assert qwen3_next.is_torchdynamo_exporting()
        import transformers.masking_utils as masking

        assert masking.is_torchdynamo_exporting()
    assert not qwen3_next.is_torchdynamo_exporting()
    import transformers.masking_utils as masking

    assert masking.is_torchdynamo_exporting is before
