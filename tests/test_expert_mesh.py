"""Expert parallelism x tensor parallelism on a 2-D mesh (exporters/strategies/expert_mesh.py).

The zoo Mixtral (grouped experts, exporters/strategies/expert.py's sequential model) at EP 2 x TP 2: attention
tensor parallel within each mesh row, the experts sharded over each mesh column (the EP group),
tokens dispatched and combined by all-to-all over the column, the batch split between the rows.
The export matches torch and verifies; its twins are refuted at layer 0's MoE block with a line of
exporters/strategies/expert.py: `ep_global_expert_ids` (BUGS.md class 12, inside the mesh) and
`ep_mesh_wrong_group` (class 11: the MoE's collectives over the TP group, the report naming it in
mesh coordinates); under the sweep also `ep_combine_wrong_indices` (class 12).

Each export is made once per session (1 layer, through refine.exporters.strategies.expert_mesh: the CLI is wired
elsewhere) and shared by the tests reading it; bigger meshes only under benchmarks/sweep.py
(REFINE_TEST_SWEEP=1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import SWEEP, exports_on_first_use, invoke

EXPERT_PY = str(Path(__file__).resolve().parent.parent / "exporters" / "strategies" / "expert.py")
EXPORTS = {"ep2_tp2": None, "global_ids": "ep_global_expert_ids", "wrong_group": "ep_mesh_wrong_group",
           "combine": "ep_combine_wrong_indices"}
SWEEP_ONLY = pytest.mark.skipif(not SWEEP, reason="bigger EP x TP meshes run under benchmarks/sweep.py")


@pytest.fixture(scope="session")
def mesh_dir(tmp_path_factory):
    """name -> the Mixtral tiny (1 layer) EP 2 x TP 2 export of that name (EXPORTS: its bug, if
    any), made on first use."""
    pytest.importorskip("torch")
    from refine.exporters.strategies.expert_mesh import export_expert_mesh

    def export(name: str, out: Path) -> None:
        export_expert_mesh("mixtral", "tiny", 2, 2, out, layers=1, bug=EXPORTS[name])

    return exports_on_first_use(tmp_path_factory.mktemp("expert_mesh"), export)


def test_refine_json_declares_the_mesh_and_collectives_run_on_their_groups(mesh_dir) -> None:
    """The 2 x 2 mesh (ep, tp); token ids and logits split by batch rows over ep; the stacked
    expert weights sharded along the experts over ep; attention's projections over tp; the rest
    replicated. Each rank: one all-reduce on its mesh row (attention's o projection), two
    all-to-alls and one all-gather on its mesh column (the MoE block)."""
    import onnx

    from refine.exporters.strategies.mesh import _dist_nodes

    out = mesh_dir("ep2_tp2")
    config = json.loads((out / "refine.json").read_text())
    assert config["world_size"] == 4 and config["mesh"] == {"shape": [2, 2], "dims": ["ep", "tp"]}
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 0, "over": "ep", "range": [0, 128]}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 0, "over": "ep"}}
    p = "model.layers.0"
    for w in ("w1", "w2", "w3"):
        assert config["inputs"][f"{p}.mlp.{w}"] == {"layout": "shard", "axis": 0, "over": "ep"}
    for w in ("q_proj", "k_proj", "v_proj"):
        assert config["inputs"][f"{p}.self_attn.{w}.weight"] == {"layout": "shard", "axis": 0, "over": "tp"}
    assert config["inputs"][f"{p}.self_attn.o_proj.weight"] == {"layout": "shard", "axis": 1, "over": "tp"}
    split = {k for k, v in config["inputs"].items() if v["layout"] != "rep"}
    assert len(split) == 8 and config["inputs"][f"{p}.mlp.gate.weight"] == {"layout": "rep"}
    for r in range(4):
        e, t = divmod(r, 2)
        calls = [(n.op_type, next(list(a.ints) for a in n.attribute if a.name == "group"))
                 for n in _dist_nodes(onnx.load(str(out / f"rank{r}.onnx")))]
        row, column = [2 * e, 2 * e + 1], [t, 2 + t]
        assert calls == [("AllReduce", row), ("AllToAll", column), ("AllGather", column), ("AllToAll", column)]


def test_expert_mesh_matches_torch(mesh_dir) -> None:
    """The ranks' logits, each mesh row's batch rows on every rank of the row, are torch's."""
    import refine.exporters

    checked = refine.exporters.check(mesh_dir("ep2_tp2"))
    assert checked.ok, checked.render()


def test_expert_mesh_verifies(mesh_dir) -> None:
    result = invoke("verify", mesh_dir("ep2_tp2"))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    assert "logits = concat(r0:logits, r2:logits, axis=0)" in result.output


@pytest.mark.parametrize("name,node,line,words", [
    pytest.param("global_ids", "mlp/Transpose", "y = y * weights.t().unsqueeze(-1)", "mine = every[:, first:first + c]",
                 marks=SWEEP_ONLY),  # (class 12 without the mesh: tests/test_expert.py)
    ("wrong_group", "mlp/MatMul", "y = self.experts(xe, self.w1, self.w3, self.w2)", "the tp group of ep=0"),
    pytest.param("combine", "mlp/ReduceSum_2", "return y.sum(dim=0).view(b, s, h)", "back = combine(", marks=SWEEP_ONLY),
])
def test_expert_mesh_bug_twin_refuted(mesh_dir, tmp_path: Path, name: str, node: str, line: str, words: str) -> None:
    """Refuted (exit 1) by a counterexample at layer 0's MoE block: the routing columns' transpose
    (the ranks took their local experts' columns), the experts' first matmul (the tokens came
    from the rank's own mesh row: the all-to-all, named in mesh coordinates, ran over the TP
    group) or (sweep) the sum over the experts (the combine gave the ranks other rows' tokens), at
    the sequential line computing it, its rank nodes at lines of exporters/strategies/expert.py."""
    report = tmp_path / "report.json"
    result = invoke("verify", mesh_dir(name), "--json", report)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output.splitlines()[0] and "counterexample" in result.output
    failure = json.loads(report.read_text())["failure"]
    assert failure["node"] == f"model.layers.0/{node}", failure["node"]
    assert failure["location"]["file"] == EXPERT_PY
    source = Path(EXPERT_PY).read_text().splitlines()
    assert source[failure["location"]["line"] - 1].strip().startswith(line)
    sites = {(n["location"]["file"], n["location"]["line"]) for n in failure["rank_nodes"]}
    assert sites and all(file == EXPERT_PY for file, _ in sites), sites
    if name == "wrong_group":
        assert words in result.output
    else:
        assert any(words in source[ln - 1] for _, ln in sites), sorted(sites)


@pytest.mark.parametrize("args,kwargs,words", [
    (("llama", "tiny", 2, 2), {}, "mixtral only"),
    (("mixtral", "tiny", 2, 1), {}, "needs --tp 2 or more"),
    (("mixtral", "tiny", 1, 2), {}, "at least 2 ranks"),
    (("mixtral", "tiny", 3, 2), {}, "does not divide"),
    (("mixtral", "tiny", 2, 3), {}, "not divisible by --tp 3"),
    (("mixtral", "tiny", 2, 2), {"bug": "nope"}, "unknown EP x TP mesh bug 'nope'"),
    (("mixtral", "tiny", 2, 4), {"bug": "ep_mesh_wrong_group"}, "needs --ep equal to --tp"),
    (("mixtral", "llama3-8b", 2, 2), {}, "export it with --meta"),
])
def test_bad_expert_mesh_options_raise_before_capturing(tmp_path: Path, args: tuple, kwargs: dict, words: str) -> None:
    pytest.importorskip("torch")
    from refine.exporters.errors import ExportError
    from refine.exporters.strategies.expert_mesh import export_expert_mesh

    out = tmp_path / "out"
    with pytest.raises(ExportError, match=None) as caught:
        export_expert_mesh(*args, out, layers=1, **kwargs)
    assert words in str(caught.value), str(caught.value)
    assert not out.exists()


@SWEEP_ONLY
@pytest.mark.parametrize("ep,tp,batch,flat", [(2, 4, None, False), (4, 2, 4, True)])
def test_bigger_expert_meshes_match_torch_and_verify(tmp_path: Path, ep: int, tp: int, batch: int | None,
                                                      flat: bool) -> None:
    """EP 2 x TP 4 (layer functions) and EP 4 x TP 2 on 4 batch rows (one expert per column member,
    every layer inline)."""
    import refine.exporters
    from refine.exporters.strategies.expert_mesh import export_expert_mesh

    out = tmp_path / f"ep{ep}_tp{tp}"
    export_expert_mesh("mixtral", "tiny", ep, tp, out, layers=1, batch=batch, flat=flat)
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output
    rows = ", ".join(f"r{e * tp}:logits" for e in range(ep))
    assert f"logits = concat({rows}, axis=0)" in result.output


@SWEEP_ONLY
def test_expert_mesh_at_llama3_8b_sizes_on_the_meta_device(tmp_path: Path) -> None:
    """EP 2 x TP 2 at Llama-3-8B sizes (4 experts of 14336), 2 layers, no weight data: verifies."""
    from refine.exporters.strategies.expert_mesh import export_expert_mesh

    out = tmp_path / "meta"
    export_expert_mesh("mixtral", "llama3-8b", 2, 2, out, layers=2, meta=True)
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output
