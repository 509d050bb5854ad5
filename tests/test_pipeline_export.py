"""Pipeline-parallel export of zoo models (`refine export --pp N --micro-batches M`,
exporters/strategies/pipeline.py) and its bug twins, through the CLI in-process.

Each export is made once per session (tiny: 2 layers, batch 2; GPT-2 unless named) and shared
by the tests. The default run verifies PP 2 (1 and 2 micro-batches) and PP 2 x TP 2 (one micro-batch,
and 2 with layer functions, with its micro-batch order twin) and refutes the layer-twice and
wrong-peer twins; the sweep (REFINE_TEST_SWEEP=1, benchmarks/sweep.py) adds 3 stages, Llama, PP 2 x
TP 2's inline micro-batches and the same twins at another place (SWEEP_ONLY).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

import onnx  # noqa: E402

from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402

from refine.exporters.strategies import pipeline  # noqa: E402
from refine.config import load_config  # noqa: E402

EXPORTS: dict[str, tuple[str, ...]] = {
    "pp2_m1": ("--pp", "2"),
    "llama_pp2_m1": ("--model", "llama", "--pp", "2"),
    "pp2_m2": ("--pp", "2", "--micro-batches", "2"),
    "pp3_m2": ("--pp", "3", "--micro-batches", "2", "--layers", "3"),
    "pp_micro_batch_order": ("--pp", "2", "--micro-batches", "2", "--bug", "pp_micro_batch_order"),
    "pp_layer_twice": ("--pp", "2", "--bug", "pp_layer_twice"),
}


@pytest.fixture(scope="session")
def pp_dir(tmp_path_factory):
    """name -> its export directory (refine export --model gpt2 --config tiny ...), made on first use."""
    def export(name: str, out: Path) -> None:
        args = EXPORTS[name] if "--model" in EXPORTS[name] else ("--model", "gpt2", *EXPORTS[name])
        result = invoke("export", "--config", "tiny", *args, "--out", out)
        assert result.exit_code == 0, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("pipeline"), export)


def source_line(text: str) -> int:
    """The line of exporters/strategies/pipeline.py holding `text` (once)."""
    lines = Path(inspect.getfile(pipeline)).read_text().splitlines()
    hits = [i for i, line in enumerate(lines, start=1) if text in line]
    assert len(hits) == 1, hits
    return hits[0]


def sweep_only(*values, why: str):
    """A parameter set that runs under harness.SWEEP only (REFINE_TEST_SWEEP=1, benchmarks/sweep.py)."""
    return pytest.param(*values, marks=pytest.mark.skipif(not SWEEP, reason=f"sweep only (REFINE_TEST_SWEEP=1): {why}"))


@pytest.mark.parametrize("name", ["pp2_m1", "pp2_m2", sweep_only("pp3_m2", why="a third stage, the same exporter code"),
                                  sweep_only("llama_pp2_m1", why="another model through the same exporter")])
def test_pipeline_export_verifies(pp_dir, name: str) -> None:
    """Every stage's blocks, the sends and receives between them and the last stage's logits
    (the micro-batches concatenated in order) rebuild the sequential model's logits (GPT-2; HF
    Llama with one micro-batch: with more, the micro-batch's causal mask awaits a lemma)."""
    result = invoke("verify", pp_dir(name))
    assert result.exit_code == 0, result.output
    world = load_config(pp_dir(name)).world_size
    assert "VERIFIED" in result.output and f"logits = r{world - 1}:logits" in result.output, result.output


def test_stages_hold_their_layers_and_only_the_last_has_logits(pp_dir) -> None:
    """Stage s sends M micro-batches to s+1 (tag 0) and receives M from s-1; parameters keep
    their sequential names and live on the stages that use them (the tied embedding on the first
    and the last); only the last stage outputs logits, declared a replica."""
    out = pp_dir("pp3_m2")
    config = load_config(out)
    assert config.outputs["logits"].layout == "rep"
    ranks = [onnx.load(str(out / f"rank{r}.onnx")) for r in range(3)]
    for r, m in enumerate(ranks):
        dist = [(n.op_type, {a.name: a.i for a in n.attribute}) for n in m.graph.node if n.domain == "dist"]
        sends = [attrs for op, attrs in dist if op == "Send"]
        recvs = [attrs for op, attrs in dist if op == "Recv"]
        assert sends == ([] if r == 2 else [{"peer": r + 1, "tag": 0}] * 2), dist
        assert recvs == ([] if r == 0 else [{"peer": r - 1, "tag": 0}] * 2), dist
        assert [i.name for i in m.graph.input if i.name == "input_ids"] == ["input_ids"]
        assert [o.name for o in m.graph.output] == (["logits"] if r == 2 else ["sent.0", "sent.1"])
        inits = {i.name for i in m.graph.initializer}
        assert ("lm_head.weight" in inits) == (r in (0, 2)) and ("wpe.weight" in inits) == (r == 0)
        assert {n.split(".")[1] for n in inits if n.startswith("h.")} == {str(r)}


BUG_SITES = {
    # the micro-batches arrive swapped: each is right, the last stage's concatenation is not
    "pp_micro_batch_order": ("lm_head/Reshape", "torch.cat(logits, dim=0)"),
    # stage 1 runs h.0 again on what it receives: h.1's input is wrong on stage 1
    "pp_layer_twice": ("h.1.ln_1/LayerNormalization", "x = recv(buffer, self.peer(self.stage - 1))"),
}


# (the micro-batch order twin in the sweep: the default run refutes it on the PP 2 x TP 2 mesh,
# test_pp_tp_layer_functions_with_micro_batches)
@pytest.mark.parametrize("bug", [sweep_only(bug, why="refuted by default on the PP x TP mesh")
                                 if bug == "pp_micro_batch_order" else bug for bug in BUG_SITES])
def test_pipeline_bug_twins_are_refuted(pp_dir, tmp_path, bug: str) -> None:
    """Each twin is REFUTED (exit 1) by a counterexample; the first failure is the sequential node
    where the relation breaks, and the report shows the stage code at fault in exporters/strategies/pipeline.py."""
    node, code = BUG_SITES[bug]
    report_path = tmp_path / "report.json"
    result = invoke("verify", pp_dir(bug), "--json", report_path)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output and f"first failure: node {node}" in result.output, result.output
    report = json.loads(report_path.read_text())
    where = f"exporters/strategies/pipeline.py:{source_line(code)}"
    rank_sites = [n["location"] for g in report["failure"]["neighbourhood"] if g["rank"] >= 0 for n in g["nodes"]]
    assert any(site and site.endswith(where) for site in rank_sites), (where, rank_sites)


@pytest.mark.parametrize("args,words", [
    (("--pp", "1"), "--pp must be at least 2"),
    (("--pp", "3"), "more stages than gpt2 config 'tiny' has layers (2)"),
    (("--pp", "2", "--micro-batches", "3"), "--micro-batches 3 does not divide the batch 2"),
    (("--pp", "2", "--tp", "2", "--sp"), "no --sp yet"),
    (("--micro-batches", "2"), "--micro-batches is for a pipeline or data-parallel export"),
    (("--pp", "2", "--bug", "pp_micro_batch_order"), "needs --micro-batches 2 or more"),
    (("--pp", "2", "--bug", "nope"), "unknown pipeline bug 'nope'"),
    (("--pp", "2", "--sp"), "not with --pp"),
])
def test_bad_pipeline_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "gpt2", "--config", "tiny", *args)


def test_check_passes_for_a_pipeline_export(pp_dir) -> None:
    """torch and the exported stages compute the same logits (refine.exporters.check)."""
    import refine.exporters

    checked = refine.exporters.check(pp_dir("pp2_m2"))
    assert checked.ok, checked.render()


# --- pipeline x tensor parallelism on a pp x tp mesh (exporters/strategies/pipeline_mesh.py) ----------------

PP, TP = 2, 2
MESH_EXPORTS: dict[str, dict] = {
    "gpt2": {"model": "gpt2"},
    "gpt2_layer_twice": {"model": "gpt2", "bug": "pp_layer_twice"},
    "gpt2_wrong_tp_peer": {"model": "gpt2", "bug": "pp_wrong_tp_peer", "meta": True},  # (TP rank 0 copied)
    # two micro-batches: each stage computes on a batch chunk of TP shards (windows seeded by the
    # ranks' own cut of input_ids, refine/lowering/graphs.py _sliced_replica_windows)
    "gpt2_m2": {"model": "gpt2", "micro_batches": 2},
    # each distinct layer one ONNX function: a stage's calls pair with the sequential calls of the
    # same module path (refine/lowering/program.py _call_sites), on the ranks that run them
    "gpt2_functions": {"model": "gpt2", "functions": True},
    "gpt2_functions_twice": {"model": "gpt2", "functions": True, "bug": "pp_layer_twice"},
    # with micro-batches a stage calls each of its layers once per micro-batch: one site each
    "gpt2_functions_m2": {"model": "gpt2", "functions": True, "micro_batches": 2},
    "gpt2_functions_m2_order": {"model": "gpt2", "functions": True, "micro_batches": 2, "bug": "pp_micro_batch_order"},
    "gpt2_m2_order": {"model": "gpt2", "micro_batches": 2, "bug": "pp_micro_batch_order"},
}


@pytest.fixture(scope="module")
def mesh_dir(tmp_path_factory):
    """name -> its PP 2 x TP 2 export (tiny, 2 layers, one micro-batch), made on first use."""
    from refine.exporters.strategies.pipeline_mesh import export_pipeline_mesh

    def export(name: str, out: Path) -> None:
        spec = MESH_EXPORTS[name]
        export_pipeline_mesh(spec["model"], "tiny", PP, TP, spec.get("micro_batches", 1), out, bug=spec.get("bug"),
                             meta=spec.get("meta", False), functions=spec.get("functions", False))

    return exports_on_first_use(tmp_path_factory.mktemp("pipeline_mesh"), export)


def test_pp_tp_export_verifies_and_matches_torch(mesh_dir) -> None:
    """Each stage's blocks under the TP plan, the sends and receives between the same TP position
    of the two stages, and the last stage's logits rebuild the sequential logits: VERIFIED, and
    torch and the exported programs agree numerically (refine.exporters.check, what --check runs)."""
    import refine.exporters

    out = mesh_dir("gpt2")
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    assert "logits = r2:logits (replicated on r2..r3)" in result.output, result.output
    checked = refine.exporters.check(out)
    assert checked.ok, checked.render()


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): two micro-batches under TP verify and "
                                        "their order twin is refuted by default with layer functions "
                                        "(test_pp_tp_layer_functions_with_micro_batches)")
def test_pp_tp_micro_batches_verify_and_their_order_twin_is_refuted(mesh_dir, tmp_path) -> None:
    """Two micro-batches per stage under TP: VERIFIED and torch agrees; stage 0 sending micro-batch
    1 first is REFUTED where the last stage concatenates the logits (each micro-batch is right)."""
    import refine.exporters

    out = mesh_dir("gpt2_m2")
    result = invoke("verify", out)
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    assert refine.exporters.check(out).ok
    result = invoke("verify", mesh_dir("gpt2_m2_order"), "--json", tmp_path / "r.json")
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "first failure: node lm_head/Reshape" in result.output, result.output


@pytest.mark.skipif(not SWEEP, reason="sweep only: one micro-batch of test_pp_tp_layer_functions_with_micro_batches, "
                                        "pp_layer_twice inline in test_pp_tp_layer_twice_is_refuted_at_its_node")
def test_pp_tp_layer_functions_are_memoized_per_stage(mesh_dir) -> None:
    """With layer functions, each layer is solved once as a template of the sequential call and
    the calls of the same module path on its stage's ranks: VERIFIED with every layer summarized
    (no call left opaque); a layer run on two stages is REFUTED."""
    import json as _json

    out = mesh_dir("gpt2_functions")
    result = invoke("verify", out, "--json", out.parent / "functions.json")
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    memo = _json.loads((out.parent / "functions.json").read_text())["memo"]
    assert memo and memo["template_solves"] >= 2, memo  # one per stage (its ranks differ)
    result = invoke("verify", mesh_dir("gpt2_functions_twice"))
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output


def test_pp_tp_layer_functions_with_micro_batches(mesh_dir, tmp_path) -> None:
    """Two micro-batches with layer functions: a stage calls each of its layers twice, and each
    call pairs with the sequential call of its module path as its own site (occurrence k, its
    input batch chunk k of the sequential call's input, which its key states): VERIFIED with one
    template per stage, each solved once for every micro-batch (refine/run/memo.py ChunkClass); the
    micro-batches sent out of order are REFUTED at the logits' concatenation."""
    import json as _json

    out = mesh_dir("gpt2_functions_m2")
    result = invoke("verify", out, "--json", tmp_path / "m2.json")
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    memo = _json.loads((tmp_path / "m2.json").read_text())["memo"]
    assert memo["templates"] == 2 and memo["template_solves"] == 2, memo
    # (stage 0's summaries reach stage 1's calls through the Send/Recv in the walk: one partial
    # solve to find the first keys, one whole solve)
    assert memo["main_solves"] == 2, memo
    result = invoke("verify", mesh_dir("gpt2_functions_m2_order"))
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert "first failure: node lm_head/Reshape" in result.output, result.output


def test_pp_tp_mesh_groups_peers_and_layouts(mesh_dir) -> None:
    """refine.json: the pp x tp mesh, TP layouts over tp (replicas stay replicas), parameters on the
    stage that uses them; rank s*T + t: its collectives over its stage's TP group, its sends to
    (s+1)*T + t and its receives from (s-1)*T + t (the same TP position), logits on the last stage."""
    from refine.dist import node_attrs

    out = mesh_dir("gpt2")
    raw = json.loads((out / "refine.json").read_text())
    assert raw["world_size"] == PP * TP and raw["mesh"] == {"shape": [PP, TP], "dims": ["pp", "tp"]}
    assert raw["inputs"]["h.0.attn.q_proj.weight"] == {"layout": "shard", "axis": 0, "over": "tp"}
    assert raw["inputs"]["h.1.mlp.c_proj.weight"] == {"layout": "shard", "axis": 1, "over": "tp"}
    assert raw["inputs"]["lm_head.weight"] == {"layout": "rep"} and raw["outputs"] == {"logits": {"layout": "rep"}}
    load_config(out)
    for r in range(PP * TP):
        stage, t = divmod(r, TP)
        model = onnx.load(str(out / f"rank{r}.onnx"))
        calls = [(n.op_type, node_attrs(n)) for n in model.graph.node if n.domain == "dist"]
        assert {tuple(a["group"]) for op, a in calls if op == "AllReduce"} == {tuple(range(stage * TP, stage * TP + TP))}
        assert [a["peer"] for op, a in calls if op == "Send"] == ([TP + t] if stage == 0 else [])
        assert [a["peer"] for op, a in calls if op == "Recv"] == ([t] if stage == 1 else [])
        inits = {i.name for i in model.graph.initializer}
        assert {n.split(".")[1] for n in inits if n.startswith("h.")} == {str(stage)}
        assert [o.name for o in model.graph.output] == (["logits"] if stage == 1 else ["sent.0"])
        meta = {p.key: p.value for p in model.metadata_props}
        assert (meta["rank"], meta["world_size"]) == (str(r), str(PP * TP))


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the same twin is refuted by default "
                                        "without TP (test_pipeline_bug_twins_are_refuted[pp_layer_twice])")
def test_pp_tp_layer_twice_is_refuted_at_its_node(mesh_dir, tmp_path) -> None:
    """A layer run on both stages (class 13), injected in the mesh export: REFUTED by a
    counterexample, first failing at h.1's first norm, with the stage code at fault named."""
    node, code = BUG_SITES["pp_layer_twice"]
    report_path = tmp_path / "report.json"
    result = invoke("verify", mesh_dir("gpt2_layer_twice"), "--json", report_path)
    assert result.exit_code == 1 and "REFUTED" in result.output, result.output
    assert f"first failure: node {node}" in result.output, result.output
    report = json.loads(report_path.read_text())
    where = f"exporters/strategies/pipeline.py:{source_line(code)}"
    rank_sites = [n["location"] for g in report["failure"]["neighbourhood"] if g["rank"] >= 0 for n in g["nodes"]]
    assert any(site and site.endswith(where) for site in rank_sites), (where, rank_sites)


def test_pp_tp_wrong_tp_peer_is_refuted_as_unmatched_sends(mesh_dir) -> None:
    """Each TP rank of stage 0 sends to the next TP position of stage 1, which receives from its own
    (class 13 with the wrong peer, class 11's point-to-point kin): REFUTED, the programs cannot run
    together; the first failure is stage 1's first use of what it receives, and the report names
    the unmatched sends with the stage code's send line."""
    result = invoke("verify", mesh_dir("gpt2_wrong_tp_peer"))
    assert result.exit_code == 1 and "REFUTED" in result.output and "deadlock" in result.output, result.output
    assert "first failure: node h.1.ln_1/LayerNormalization" in result.output, result.output
    assert "call #0 on group [0, 3]: NOT matched: rank(s) 3 never make this call" in result.output, result.output
    where = f"r0: Send (dist.Send) {Path(inspect.getfile(pipeline))}:{source_line('sent.append(send(x')}"
    assert where in result.output, result.output


@pytest.mark.parametrize("args,words", [
    (("gpt2", "tiny", 2, 1, 1), "needs --tp 2 or more"),
    (("gpt2", "tiny", 2, 3, 1), "attention heads 8 not divisible by --tp 3"),
    (("gpt2", "tiny", 3, 2, 1), "more stages than gpt2 config 'tiny' has layers (2)"),
    (("gpt2", "tiny", 2, 2, 3), "--micro-batches 3 does not divide the batch 2"),
    (("mixtral", "tiny", 2, 2, 1), "--pp exports gpt2, llama, qwen2 only"),
])
def test_bad_pp_tp_options_are_one_line_errors(tmp_path, args: tuple, words: str) -> None:
    from refine.exporters.errors import ExportError
    from refine.exporters.strategies.pipeline_mesh import validate_pipeline_mesh

    with pytest.raises(ExportError) as caught:
        validate_pipeline_mesh(*args)
    assert words in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_tp_copies_are_the_captured_programs(mesh_dir) -> None:
    """A meta export captures each stage's TP rank 0 and copies it to the stage's other TP ranks
    (pipeline_mesh.tp_copy: peers moved to their TP position): on the export that captured every
    rank, the copy of rank s*T is rank s*T + t's program, node for node, weights of the same names
    and shapes (only their values, each rank's own chunk, differ)."""
    from refine.exporters.strategies.pipeline_mesh import tp_copy

    out = mesh_dir("gpt2")
    for stage in range(PP):
        first = onnx.load(str(out / f"rank{stage * TP}.onnx"))
        for t in range(1, TP):
            copy, _, _, _ = tp_copy(first, {}, {}, 0.0, t, TP)
            other = onnx.load(str(out / f"rank{stage * TP + t}.onnx"))
            assert [n.SerializeToString() for n in copy.graph.node] == [n.SerializeToString() for n in other.graph.node]
            assert [(i.name, list(i.dims)) for i in copy.graph.initializer] == \
                [(i.name, list(i.dims)) for i in other.graph.initializer]


def test_one_template_solve_for_every_micro_batch_holds_on_the_numbers(mesh_dir) -> None:
    """The layer summaries of micro-batch 1's calls come from the template solved once for every
    batch chunk (its chunk a constant, read as 1): unelided, every relation at every call's
    outputs, chunk 1's included, holds in the simulator on two seeds."""
    from refine.lowering.program import lower_program
    from refine.run.memo import run_program
    from refine.diagnose.simulate import simulate_dir
    from refine.diagnose.witness import check

    out = mesh_dir("gpt2_functions_m2")
    run = run_program(lower_program(out), elide=False)
    assert run.template_solves == 2
    chunk1 = [r for r in run.derived.get("rel_by") if r[3] == "layer_summary" and isinstance(r[0], tuple) and r[0][3] == 1]
    assert chunk1, "no summary relation of micro-batch 1"
    for seed in (0, 1):
        checked = check(run.derived, simulate_dir(out, seed), seed)
        assert checked.ok, checked.violations
        assert "layer_summary" in checked.lemmas_checked


def test_chunk_class_of_a_key() -> None:
    """memo.ChunkClass: a key of batch chunk k for every chunk, and back."""
    from refine.layouts import EVERY_CHUNK
    from refine.run.memo import ChunkClass

    key = frozenset({
        (0, "r0", 0, "chunk(0,1,2,rep)"), (0, "r1", 0, "chunk(0,1,2,rep)"),  # the batch: chunk 1 of 2
        (0, "r0", 0, "sl(0,4,8)"), (0, "r1", 0, "sl(0,4,8)"),  # ... its slice: chunk 1's own, left out
        (1, "r0", 1, "sl(1,0,32)"), (1, "r1", 1, "sl(1,32,64)"),  # a TP shard of a weight: kept
        (1, "r0", 1, "chunk(1,0,2,rep)"), (1, "r1", 1, "chunk(1,1,2,rep)"),  # ... as chunks too: left out
    })
    cls = ChunkClass.of(key)
    assert cls is not None and cls.k == 1
    assert cls.base == {(0, "r0", 0, f"chunk(0,{EVERY_CHUNK},2,rep)"), (0, "r1", 0, f"chunk(0,{EVERY_CHUNK},2,rep)"),
                        (1, "r0", 1, "sl(1,0,32)"), (1, "r1", 1, "sl(1,32,64)")}
    summary = [(0, "r0", 0, f"chunk(0,{EVERY_CHUNK},2,rep)"), (0, "r1", 0, f"chunk(0,{EVERY_CHUNK},2,sl(2,0,4))")]
    assert cls.renamed(summary, {0: {0: 8, 1: 3, 2: 8}}) == [
        (0, "r0", 0, "chunk(0,1,2,rep)"), (0, "r0", 0, "sl(0,4,8)"), (0, "r1", 0, "chunk(0,1,2,sl(2,0,4))")]
    # two batch inputs of different chunks, or a rank input of the batch input without its chunk: no class
    assert ChunkClass.of(key | {(2, "r0", 2, "chunk(0,0,2,rep)"), (2, "r1", 2, "chunk(0,0,2,rep)")}) is None
    assert ChunkClass.of(frozenset({(0, "r0", 0, "chunk(0,1,2,rep)"), (0, "r1", 0, "sl(0,4,8)")})) is None
