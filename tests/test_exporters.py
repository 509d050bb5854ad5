"""Exporters: torch models + parallel plans -> model directories, proven right numerically.

Each zoo model x plan is exported once per session (tiny configs, about 4 s per rank), with
each distinct decoder layer as one ONNX local function unless the case says `flat`;
`refine.exporters.check` then runs torch and the exported programs on the same random inputs.

The default run exports every zoo model at TP 2, and Llama and GPT-2 with TP+SP at TP 2; the rest
of the model x plan x TP matrix (every model at TP 8, GPT-2's SP 8 with one head and one token per
rank, Qwen2's SP 2, Llama's SP 2 at batch 1: the same exporter code, about 3 min) runs under
`python benchmarks/sweep.py`.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from harness import SWEEP, exports_on_first_use  # noqa: E402

import refine.exporters  # noqa: E402
from refine.exporters.capture.export import op_counts  # noqa: E402
from refine.exporters.errors import ExportError  # noqa: E402
from refine.exporters.capture.layers import LAYER_DOMAIN, layer_signatures  # noqa: E402
from refine.exporters.capture.layouts import REP, Piece, derive_layout, match_name, module_fqn  # noqa: E402
from refine.exporters.capture.rename import rename_values  # noqa: E402
from refine.cli.main import app  # noqa: E402
from refine.config import load_config  # noqa: E402
from refine.dist import register_schemas  # noqa: E402
from refine.run.engine import solve  # noqa: E402
from refine.lowering.graphs import lower_dir  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.diagnose.diagnosis import build_report  # noqa: E402
from refine.report.render import render_text  # noqa: E402
from refine.diagnose.simulate import simulate_dir  # noqa: E402
from refine.diagnose.witness import check as witness_check  # noqa: E402

runner = CliRunner()

# case -> (model, config, tp, sp); every case exports layers as functions
CASES = {  # every zoo model x {TP, TP+SP} x TP {2, 8} (Qwen2 at TP 2 with grouped-query attention)
    "llama_tp2": ("llama", "tiny", 2, False),
    "llama_tp8": ("llama", "tiny", 8, False),
    "qwen2_gqa_tp2": ("qwen2", "tiny-gqa", 2, False),
    "qwen2_tp8": ("qwen2", "tiny", 8, False),
    "gpt2_tp2": ("gpt2", "tiny", 2, False),
    "gpt2_tp8": ("gpt2", "tiny", 8, False),
    "llama_sp2": ("llama", "tiny", 2, True),
    "llama_sp8": ("llama", "tiny", 8, True),
    "qwen2_gqa_sp2": ("qwen2", "tiny-gqa", 2, True),
    "qwen2_sp8": ("qwen2", "tiny", 8, True),
    "gpt2_sp2": ("gpt2", "tiny", 2, True),
    "gpt2_sp8": ("gpt2", "tiny", 8, True),
    "llama_b1_sp2": ("llama", "tiny-b1", 2, True),  # batch 1: the SP gather is a stack read back by a view
}
# the cases the default run takes: all but these TP 8 ones, Qwen2's SP and Llama's SP at batch 1
# (benchmarks/sweep.py runs every case): the same exporter code as the TP 2 and SP 2 cases it keeps
SWEEP_ONLY = {"llama_tp8", "qwen2_tp8", "qwen2_sp8", "llama_sp8", "gpt2_tp8", "gpt2_sp8", "qwen2_gqa_sp2", "llama_b1_sp2"}
RUN = [case for case in CASES if SWEEP or case not in SWEEP_ONLY]
# further exports some tests need: case -> export_model keyword arguments
EXTRA = {
    "llama_tp2_flat": dict(model="llama", config="tiny", tp=2, sp=False, flat=True),
    # Llama 3 8B sizes (vocab 128256 x hidden 4096: 2 GB per embedding if written), 2 layers
    "llama8b_meta": dict(model="llama", config="llama3-8b", tp=2, sp=False, layers=2, meta=True),
}


@pytest.fixture(scope="session")
def exported(tmp_path_factory, zoo_export):
    """case -> its model directory, exported on first use (llama_tp2 through the CLI, with --check;
    the other CASES by conftest.zoo_export, shared with the test files reading the same export)."""
    def export(case: str, out: Path) -> None:
        if case == "llama_tp2":
            model, config, tp, _ = CASES[case]
            result = runner.invoke(app, ["export", "--model", model, "--config", config, "--tp", str(tp),
                                         "--out", str(out), "--check"])
            assert result.exit_code == 0, result.output
            assert "check: PASSED" in result.stdout and "AllReduce x4" in result.stdout
        else:
            refine.exporters.export_model(out=out, **EXTRA[case])

    made = exports_on_first_use(tmp_path_factory.mktemp("exports"), export)
    return lambda case: zoo_export(*CASES[case]) if case in CASES and case != "llama_tp2" else made(case)


def rank_models(out: Path) -> list[onnx.ModelProto]:
    return [onnx.load(str(out / f"rank{r}.onnx")) for r in range(load_config(out).world_size)]


def op_types(model: onnx.ModelProto) -> Counter:
    """What the program runs: a layer call counts its body's ops."""
    return op_counts(model)


def all_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [*model.graph.node, *(n for f in model.functions for n in f.node)]


def calls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == LAYER_DOMAIN]


# --- every case ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [*RUN, "llama_tp2_flat"])
def test_files_and_onnx_checker(exported, case):
    out = exported(case)
    world = load_config(out).world_size
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["seq.onnx", "refine.json", "export.json", *(f"rank{r}.onnx" for r in range(world))]
    )
    register_schemas()
    seq = onnx.load(str(out / "seq.onnx"))
    onnx.checker.check_model(seq)
    for r, model in enumerate(rank_models(out)):
        onnx.checker.check_model(model)
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["world_size"] == str(world) and meta["rank"] == str(r)
        # weights stay initializers, named by the sequential FQN
        assert not any("parametrizations" in i.name for i in model.graph.initializer)
    # node metadata survives, inside layer bodies too: module path and source line
    metas = [{p.key for p in n.metadata_props} for n in all_nodes(seq)]
    assert all({"pkg.torch.onnx.name_scopes", "pkg.torch.onnx.stack_trace"} <= m for m in metas if m)
    assert sum(1 for m in metas if m) > 0.9 * len(metas)


@pytest.mark.parametrize("case", [*RUN, "llama_tp2_flat"])
def test_numeric_check_passes(exported, case):
    result = refine.exporters.check(exported(case))
    assert result.ok, result.render()
    assert len(result.lines) == 3  # stored weights, seq vs torch, ranks vs seq


@pytest.mark.parametrize("case", [*RUN, "llama_tp2_flat"])
def test_refine_verifies_the_export(exported, case):
    """What the exporters emit, the lemma library proves: every model x plan verifies (calls
    inlined, and memoized per layer template), and every relation derived on the way holds on
    the simulator's numbers."""
    out = exported(case)
    facts = lower_dir(out)
    derived = solve(facts)
    report = build_report(case, facts, derived)
    assert report.verdict == "verified", render_text(report)
    assert not report.sanity_violations
    numbers = witness_check(derived, simulate_dir(out, seed=0))
    assert numbers.ok, numbers.violations[:3]
    memoized = verify_dir(out, simulate=False)
    assert memoized.verdict == "verified", render_text(memoized)


@pytest.mark.parametrize("case", RUN)
def test_every_weight_declared(exported, case):
    out = exported(case)
    config = load_config(out)
    manifest = json.loads((out / "export.json").read_text())
    seq = onnx.load(str(out / "seq.onnx"))
    assert set(config.inputs) == {i.name for i in seq.graph.initializer} | {"input_ids"}
    assert manifest["unmatched_rank_tensors"] == [] and manifest["undeclared_seq_initializers"] == []
    assert config.inputs["input_ids"].layout == "rep"


# --- layers as functions --------------------------------------------------------------------------


@pytest.mark.parametrize("case", RUN)
def test_one_call_per_layer(exported, case):
    """docs/layers.md: every layer is a call named by its module path, passing its own weights
    by their per-layer names; the calls line up across programs; a body has no weights."""
    out = exported(case)
    blocks = "h" if CASES[case][0] == "gpt2" else "model.layers"
    programs = [onnx.load(str(out / "seq.onnx")), *rank_models(out)]
    for model in programs:
        assert [c.name for c in calls(model)] == [f"{blocks}.{i}" for i in range(2)]
        assert LAYER_DOMAIN in {o.domain for o in model.opset_import}
        made = {t for n in model.graph.node for t in n.output}  # (a layer's output is named after the layer)
        for i, call in enumerate(calls(model)):
            weights = [v for v in call.input if v.startswith(f"{blocks}.") and v not in made]
            assert weights and all(v.startswith(f"{blocks}.{i}.") for v in weights)
        for fn in model.functions:
            assert not any(n.op_type == "Constant" and "weight" in n.output[0] for n in fn.node)
    manifest = json.loads((out / "export.json").read_text())["layers"]
    assert manifest["stack"] == blocks and manifest["seq"]["calls"] == 2


def test_distinct_layers_are_distinct_functions(exported):
    """TP: one function for both layers. SP: the plan reshards the first layer's input
    (replicated -> sequence shards) in a hook on that layer, so on every rank layer 0 is a
    function of its own, while the sequential program still has one."""
    def functions(case):
        out = exported(case)
        return [len(m.functions) for m in [onnx.load(str(out / "seq.onnx")), *rank_models(out)]]

    assert functions("llama_tp2") == [1, 1, 1]
    assert functions("llama_sp2") == [1, 2, 2]
    ranks = json.loads((exported("llama_sp2") / "export.json").read_text())["layers"]["ranks"]
    assert ranks[0]["functions"] == {"LlamaDecoderLayer": ["model.layers.0"], "LlamaDecoderLayer_1": ["model.layers.1"]}


def test_flat_export_has_no_functions(exported):
    out = exported("llama_tp2_flat")
    for model in [onnx.load(str(out / "seq.onnx")), *rank_models(out)]:
        assert not model.functions and not calls(model)
    assert json.loads((out / "export.json").read_text())["layers"] is None


def test_meta_export_declares_weights_without_data(exported):
    """--meta on Llama 3 8B sizes: the weights are typed graph inputs with no data (the files
    stay small), refine.json declares every one, and the plan still verifies."""
    out = exported("llama8b_meta")
    assert all(p.stat().st_size < 4_000_000 for p in out.glob("*.onnx"))
    config = load_config(out)
    for name in ("seq.onnx", "rank0.onnx", "rank1.onnx"):
        model = onnx.load(str(out / name))
        assert not model.graph.initializer or all(i.name not in config.inputs for i in model.graph.initializer)
        weights = {i.name for i in model.graph.input} - {"input_ids"}
        assert weights == set(config.inputs) - {"input_ids"}
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(str(out / "rank1.onnx")).graph.input}
    assert dims["model.embed_tokens.weight"] == [128256, 4096]
    assert dims["model.layers.1.mlp.down_proj.weight"] == [4096, 14336 // 2]
    assert config.inputs["model.layers.1.mlp.down_proj.weight"].layout == "shard"
    assert json.loads((out / "export.json").read_text())["meta"] is True
    with pytest.raises(ExportError, match="no weights to check"):
        refine.exporters.check(out)
    assert verify_dir(out, simulate=False).verdict == "verified"


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.proj(x))


class Stack(torch.nn.Module):
    """Three equal blocks; the outer code calls the last on a longer input, so its call (not
    its module) differs: it must be captured as a layer of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = torch.nn.Parameter(torch.randn(4))
        self.blocks = torch.nn.ModuleList(Block(4) for _ in range(3))

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](x * self.scale))  # both inputs require grad: alike
        return self.blocks[2](torch.cat([x, x], dim=0))


def test_a_call_unlike_its_group_is_captured_on_its_own(tmp_path):
    seq = Stack()
    result = refine.exporters.export(seq, lambda r: Stack(), (torch.randn(2, 4),), 2, tmp_path / "s", layers="blocks")
    seq_functions = result.manifest["layers"]["seq"]["functions"]
    assert seq_functions == {"Block": ["blocks.0", "blocks.1"], "Block_1": ["blocks.2"]}
    check = refine.exporters.check(tmp_path / "s", seq)
    assert check.ok, check.render()


def test_layer_signatures():
    """Equal layers share a signature whatever their layer_idx; any other attribute, a hook or
    a weight's shape sets one apart."""
    blocks = torch.nn.ModuleList(Block(4) for _ in range(5))
    for i, b in enumerate(blocks):
        b.layer_idx = i
    blocks[2].scale = 2.0
    blocks[3].proj.register_forward_hook(lambda m, i, o: o * 2)
    blocks[4].proj = torch.nn.Linear(4, 4, bias=False)
    sigs = layer_signatures(blocks)
    assert sigs[0] == sigs[1] and len(set(sigs)) == 4


# --- layouts and collectives per plan -----------------------------------------------------------


def layouts(out: Path) -> dict[str, tuple]:
    return {k: (v.layout, getattr(v, "axis", None)) for k, v in load_config(out).inputs.items()}


def test_llama_tp_layouts(exported):
    got = layouts(exported("llama_tp8" if "llama_tp8" in RUN else "llama_tp2"))
    for i in range(2):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert got[p + name + ".weight"] == ("shard", 0)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert got[p + name + ".weight"] == ("shard", 1)
        assert got[p + "input_layernorm.weight"] == ("rep", None)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.rotary_emb.inv_freq"):
        assert got[name] == ("rep", None)


def test_qwen2_biases_follow_their_weights(exported):
    got = layouts(exported("qwen2_gqa_tp2"))
    assert got["model.layers.0.self_attn.k_proj.bias"] == ("shard", 0)
    assert got["model.layers.0.self_attn.k_proj.weight"] == ("shard", 0)
    # GQA: 2 KV heads of 8 dims, one per rank
    k = next(i for i in rank_models(exported("qwen2_gqa_tp2"))[1].graph.initializer
             if i.name == "model.layers.0.self_attn.k_proj.weight")
    assert list(k.dims) == [8, 64]


def test_gpt2_layouts_and_tied_head(exported):
    got = layouts(exported("gpt2_tp2"))
    assert got["h.0.attn.q_proj.bias"] == ("shard", 0)
    assert got["h.0.mlp.c_proj.weight"] == ("shard", 1)
    assert got["h.0.mlp.c_proj.bias"] == ("rep", None)  # row-parallel bias: whole on every rank
    assert ("rep", None) in {got.get("wte.weight"), got.get("lm_head.weight")}  # tied: one tensor


def test_sp_shards_norm_input_and_head(exported):
    got = layouts(exported("llama_sp2"))
    assert got["model.layers.0.input_layernorm.weight"] == ("rep", None)
    assert got["lm_head.weight"] == ("shard", 0)


COLLECTIVES = [
    ("llama_tp2", {"dist.AllReduce": 4}),   # o_proj and down_proj of 2 layers
    ("llama_tp8", {"dist.AllReduce": 4}),
    ("gpt2_tp2", {"dist.AllReduce": 4}),
    ("gpt2_tp8", {"dist.AllReduce": 4}),
    # SP: per layer 2 all-gathers (attention, mlp inputs) and 2 reduce-scatters; the head gathers
    # the sequence and (column-parallel) the vocabulary
    ("llama_sp2", {"dist.AllGather": 6, "dist.ReduceScatter": 4}),
    ("llama_sp8", {"dist.AllGather": 6, "dist.ReduceScatter": 4}),
    ("gpt2_sp2", {"dist.AllGather": 5, "dist.ReduceScatter": 4}),
    ("gpt2_sp8", {"dist.AllGather": 5, "dist.ReduceScatter": 4}),
]


@pytest.mark.parametrize("case, expected", [(case, expected) for case, expected in COLLECTIVES if case in RUN])
def test_collectives(exported, case, expected):
    world = CASES[case][2]
    for model in rank_models(exported(case)):
        ops = op_types(model)
        assert {k: v for k, v in ops.items() if k.startswith("dist.")} == expected
        for node in all_nodes(model):
            if node.domain == "dist":
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                assert list(attrs["group"]) == list(range(world))
                assert attrs.get("axis", 0) == 0  # torch gathers/scatters along dim 0


# --- the check catches wrong exports ------------------------------------------------------------


def test_check_catches_a_wrong_name_mapping(exported, tmp_path):
    """Two same-shaped rank weights swapped (a mapping bug) fail both halves of the check."""
    out = tmp_path / "swapped"
    shutil.copytree(exported("llama_tp2"), out)
    rank1 = onnx.load(str(out / "rank1.onnx"))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    rename_values(rank1, {q: k, k: q})
    onnx.save(rank1, str(out / "rank1.onnx"))
    result = refine.exporters.check(out)
    assert not result.ok
    assert sum(line.startswith("FAIL") for line in result.lines) == 2, result.render()
    assert f"rank1:{q}" in result.render()


def test_check_catches_a_wrong_layout(exported, tmp_path):
    out = tmp_path / "relaid"
    shutil.copytree(exported("llama_tp2"), out)
    config = json.loads((out / "refine.json").read_text())
    config["inputs"]["model.layers.1.mlp.down_proj.weight"] = {"layout": "shard", "axis": 0}
    (out / "refine.json").write_text(json.dumps(config))
    result = refine.exporters.check(out)
    assert not result.ok
    assert "rank0:model.layers.1.mlp.down_proj.weight" in result.render()


# --- the generic API with explicit collectives --------------------------------------------------


class SeqMatmul(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x):
        return (x @ self.w)[[0, 2, 1, 3]]


class RankMatmul(torch.nn.Module):
    """x @ w with w's rows sharded, then every collective the translation table knows."""

    def __init__(self, w, rank, world):
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        self.w = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)], src_data_rank=None))
        rows = w.shape[0] // world
        self.lo, self.hi, self.world = rank * rows, (rank + 1) * rows, world

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        part = x[:, self.lo:self.hi] @ self.w.to_local()               # partial sum of x @ w
        rows = fc.reduce_scatter_tensor(part, "sum", 0, dist.group.WORLD)  # rows 2r, 2r+1
        swapped = fc.all_to_all_single(rows, None, None, dist.group.WORLD)  # rows r, 2+r
        gathered = fc.all_gather_tensor(swapped, 0, dist.group.WORLD)  # rows 0, 2, 1, 3
        out = gathered / self.world
        dist.all_reduce(out)  # legacy in-place call
        return out


def test_generic_export_with_every_collective(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(8, 6)
    seq = SeqMatmul(w)
    result = refine.exporters.export(seq, lambda r: RankMatmul(w, r, 2), (torch.randn(4, 8),), 2, tmp_path / "mm")
    assert result.config["inputs"] == {"x": {"layout": "rep"}, "w": {"layout": "shard", "axis": 0}}
    ops = op_types(onnx.load(str(tmp_path / "mm" / "rank1.onnx")))
    assert {k: v for k, v in ops.items() if k.startswith("dist.")} == {
        "dist.ReduceScatter": 1, "dist.AllToAll": 1, "dist.AllGather": 1, "dist.AllReduce": 1}
    check = refine.exporters.check(tmp_path / "mm", seq)
    assert check.ok, check.render()


class Double(torch.nn.Module):
    def forward(self, x):
        return 2 * x


class DoubleShard(torch.nn.Module):
    """Doubles its row shard of x, then gathers the rows."""

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        return fc.all_gather_tensor(2 * x, 0, dist.group.WORLD)


def test_generic_export_with_a_sharded_input(tmp_path):
    result = refine.exporters.export(Double(), lambda r: DoubleShard(), (torch.randn(4, 6),), 2, tmp_path / "d",
                              input_layouts={"x": {"layout": "shard", "axis": 0}})
    assert result.config["inputs"] == {"x": {"layout": "shard", "axis": 0}}
    rank0 = onnx.load(str(tmp_path / "d" / "rank0.onnx"))
    assert [d.dim_value for d in rank0.graph.input[0].type.tensor_type.shape.dim] == [2, 6]
    check = refine.exporters.check(tmp_path / "d", Double())
    assert check.ok, check.render()


class ZeroNegatives(torch.nn.Module):
    """`y[mask] = 0` on a clone (how Megatron masks the ids and rows a rank does not own)."""

    def forward(self, x):
        y = 3 * x
        y[y < 0] = 0.0
        return y


def test_boolean_mask_assignment_exports_as_where(tmp_path):
    """torch exports `y[mask] = v` as ScatterND at NonZero(mask), a data-dependent shape; the
    exporter's decomposition writes it as the Where it is, which refine verifies."""
    refine.exporters.export(ZeroNegatives(), lambda r: ZeroNegatives(), (torch.randn(3, 4),), 2, tmp_path / "d")
    ops = {n.op_type for n in onnx.load(str(tmp_path / "d" / "seq.onnx")).graph.node}
    assert "Where" in ops and not ops & {"ScatterND", "NonZero"}, ops
    check = refine.exporters.check(tmp_path / "d", ZeroNegatives())
    assert check.ok, check.render()
    assert verify_dir(tmp_path / "d").verdict == "verified"


class GatherLastDim(torch.nn.Module):
    """Gathers a tensor sharded on its last axis, in the three ways torch code spells it (torch
    gathers along dim 0 only): `all_gather_tensor(h, 2)`, a gather on 0 cut into blocks and
    concatenated on 2, and movedim to 0 and back around a gather on 0."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        h = 2 * x
        if self.spelling == "dim2":
            return fc.all_gather_tensor(h, 2, dist.group.WORLD)
        if self.spelling == "chunk":
            return torch.cat(fc.all_gather_tensor(h, 0, dist.group.WORLD).chunk(2, dim=0), dim=2)
        gathered = fc.all_gather_tensor(h.movedim(2, 0).contiguous(), 0, dist.group.WORLD)
        return gathered.movedim(0, 2)


@pytest.mark.parametrize("spelling", ["dim2", "chunk", "movedim"])
def test_gather_of_the_last_axis_verifies_however_it_is_spelled(tmp_path, spelling):
    out = tmp_path / spelling
    refine.exporters.export(Double(), lambda r: GatherLastDim(spelling), (torch.randn(2, 3, 8),), 2, out,
                     input_layouts={"x": {"layout": "shard", "axis": 2}}, output_layouts={"output": {"layout": "rep"}})
    assert refine.exporters.check(out, Double(), compare_stored=False).ok
    report = verify_dir(out)
    assert report.verdict == "verified", render_text(report)


def test_export_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not a model directory"):
        refine.exporters.export(SeqMatmul(torch.randn(8, 6)), lambda r: None, (torch.randn(4, 8),), 2, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# --- pieces that need no export -----------------------------------------------------------------


def test_gpt2_megatron_variant_matches_hf():
    from refine.exporters.zoo import models as zoo
    from refine.exporters.zoo.configs import CONFIGS

    cfg = CONFIGS["tiny"]
    hf = zoo.hf_gpt2(cfg, seed=0)
    ours = zoo.MegatronGPT2.from_hf(hf, cfg).eval()
    ids = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    with torch.no_grad():
        np.testing.assert_allclose(ours(ids).numpy(), hf(input_ids=ids).logits.numpy(), rtol=1e-5, atol=1e-5)


def piece(kind, local, offset, shape=(8, 4), axis=None):
    return Piece(kind, shape, local, offset, axis=axis, placement=kind)


def test_derive_layout():
    assert derive_layout("w", [piece("rep", (8, 4), (0, 0)), piece("plain", (8, 4), (0, 0))]) == {"layout": "rep"}
    even = [piece("shard", (4, 4), (0, 0), axis=0), piece("shard", (4, 4), (4, 0), axis=0)]
    assert derive_layout("w", even) == {"layout": "shard", "axis": 0}
    uneven = [piece("shard", (3, 4), (0, 0), (7, 4), 0), piece("shard", (3, 4), (3, 0), (7, 4), 0),
              piece("shard", (1, 4), (6, 0), (7, 4), 0)]
    assert derive_layout("w", uneven) == {"layout": "shard", "axis": 0, "sizes": [3, 3, 1]}
    with pytest.raises(ExportError, match="rank 0.s shard is not chunk 0"):
        derive_layout("w", [even[1], even[0]])
    with pytest.raises(ExportError, match="disagree"):
        derive_layout("w", [even[0], piece("rep", (8, 4), (0, 0))])


def test_held_layout_along_a_mesh_dim():
    """A (pp, tp) mesh of 2 x 2: a weight split over tp on the last stage's line only is a shard
    `over` tp; a line missing a piece, lines that disagree, and a run of ranks that is no mesh dim
    are refused."""
    from refine.config import Mesh
    from refine.exporters.capture.layouts import held_layout, mesh_dim, mesh_line

    mesh = Mesh(shape=[2, 2], dims=["pp", "tp"])
    assert mesh_line(mesh, 3, "tp") == [2, 3] and mesh_line(mesh, 3, "pp") == [1, 3]
    assert mesh_dim(2, 1, 4, mesh, "axis") == "tp" and mesh_dim(2, 2, 4, mesh, "axis") == "pp"
    assert mesh_dim(4, 1, 4, None, "axis") is None
    with pytest.raises(ExportError, match="runs over 2 of the 4 ranks, 1 apart: it is no dim of no mesh"):
        mesh_dim(2, 1, 4, None, "axis")
    with pytest.raises(ExportError, match="no dim of the mesh"):
        mesh_dim(2, 3, 4, mesh, "axis")

    def over_tp(k: int, axis: int = 0) -> Piece:
        local = (4, 4) if axis == 0 else (8, 2)
        return replace(piece("shard", local, tuple(k * local[a] if a == axis else 0 for a in range(2)), axis=axis),
                       over="tp")

    assert held_layout("w", {2: over_tp(0), 3: over_tp(1)}, 4, mesh) == {"layout": "shard", "axis": 0, "over": "tp"}
    both = {0: over_tp(0), 1: over_tp(1), 2: over_tp(0), 3: over_tp(1)}
    assert held_layout("w", both, 4, mesh) == {"layout": "shard", "axis": 0, "over": "tp"}
    with pytest.raises(ExportError, match=r"held by ranks \[2\] of the line \[2, 3\]"):
        held_layout("w", {2: over_tp(0)}, 4, mesh)
    with pytest.raises(ExportError, match="lay it out differently"):
        held_layout("w", {0: over_tp(0), 1: over_tp(1), 2: over_tp(0, 1), 3: over_tp(1, 1)}, 4, mesh)
    with pytest.raises(ExportError, match="sharded on ranks"):
        held_layout("w", {2: piece("shard", (4, 4), (0, 0), axis=0), 3: piece("shard", (4, 4), (4, 0), axis=0)}, 4)
    # a replica on some ranks: they must agree
    assert held_layout("b", {2: piece("plain", (8, 4), (0, 0)), 3: piece("plain", (8, 4), (0, 0))}, 4, mesh) == REP


def test_names():
    assert module_fqn("model.layers.0.q_proj.parametrizations.weight.original0") == "model.layers.0.q_proj.weight"
    assert module_fqn("parametrizations.w.original0") == "w"
    assert module_fqn("lm_head.weight") == "lm_head.weight"
    seq = {"model.layers.0.q.weight", "lm_head.weight"}
    assert match_name("model.layers.0.q.weight", seq) == "model.layers.0.q.weight"
    assert match_name("module.model.layers.0.q.weight", seq) == "model.layers.0.q.weight"  # rank-side wrapper
    assert match_name("layers.0.q.weight", seq) == "model.layers.0.q.weight"  # seq-side wrapper
    assert match_name("other.weight", seq) is None


@pytest.mark.parametrize("args, message", [
    (["--model", "bert"], "unknown model 'bert'"),
    (["--model", "llama", "--config", "huge"], "unknown config 'huge'"),
    (["--model", "llama", "--config", "tiny-gqa", "--tp", "8"], "key/value heads 2 not divisible by --tp 8"),
    (["--model", "llama", "--tp", "3"], "attention heads 8 not divisible by --tp 3"),
    (["--model", "gpt2", "--config", "tiny-gqa"], "gpt2 has no grouped-query attention"),
    (["--model", "llama", "--tp", "0"], "--tp must be at least 1"),
    (["--model", "llama", "--layers", "0"], "--layers must be at least 1"),
    (["--model", "llama", "--config", "llama3-8b", "--tp", "8"], "export it with --meta"),
    (["--model", "llama", "--config", "llama3-8b", "--meta", "--check"], "--check needs weights"),
    (["--model", "mixtral", "--sp"], "mixtral has a TP plan only"),
])
def test_cli_bad_arguments(tmp_path, args, message):
    result = runner.invoke(app, ["export", *args, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refine: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "x").exists()


def test_the_own_model_recipe_in_the_exporters_readme_runs_and_verifies(tmp_path, monkeypatch):
    """exporters/README.md "Exporting your own model": its code, run as written, exports a
    directory that `check` passes and refine verifies."""
    import re

    text = (Path(__file__).resolve().parent.parent / "exporters" / "README.md").read_text()
    section = text[text.index("## Exporting your own model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "recipe"}
    exec(compile(code, "exporters/README.md", "exec"), namespace)
    assert namespace["result"].ok, namespace["result"].render()
    assert verify_dir(tmp_path / "out" / "block").verdict == "verified"


def _segfault(*_args):  # (a capture that crashes its worker process, as a native fault would)
    import os
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_crashed_capture_worker_is_one_error_not_a_hang():
    """A worker process that dies (a segmentation fault in native code) fails the export with one
    ExportError naming the signal; multiprocessing's Pool would otherwise wait on its task forever."""
    from refine.exporters.capture.export import capture_pool
    from refine.exporters.errors import ExportError

    with capture_pool(_segfault, 1) as (submit, get):
        handle = submit(0)
        with pytest.raises(ExportError, match="killed by SIGSEGV"):
            get(handle)
