"""`refine zoo`: models x TP x plans and their buggy twins, each with its expected verdict.

The whole zoo is 120 entries (about 20 s of export each today), so the suite checks the
catalogue in pure Python and exports one small slice: Llama at TP 2, the correct export, one
bug, and the bug machinery with the bug taken out (which must verify, so that the twin differs
from it by the bug alone). `refine batch` then has to give every entry its expected verdict.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytest

from refine.exporters.zoo import entries as zoo_gen
from harness import SWEEP, invoke


def test_the_full_zoo_has_five_bug_classes_per_model_and_plan():
    entries = zoo_gen.select()
    names = [e.name for e in entries]
    assert len(names) == len(set(names))
    groups: dict[tuple, list] = defaultdict(list)
    for e in entries:
        groups[(e.model, e.tp, e.plan)].append(e)
    assert set(groups) == {(m, tp, p) for m in ("llama", "gpt2", "qwen2") for tp in (2, 4, 8) for p in ("tp", "sp")}
    for key, group in groups.items():
        assert [e.expect for e in group if e.bug is None] == ["verified"], key
        buggy = [e for e in group if e.bug is not None]
        assert all(e.expect == "refuted" for e in buggy)
        assert len(buggy) >= 5, key
    assert len(entries) == 18 * 6 + 6 * 2  # gpt2 has two more bugs
    assert not any(e.bug in zoo_gen.CONTROL_NAMES for e in entries)  # controls only on request


def test_training_steps_get_the_backward_bugs():
    entries = zoo_gen.select(models="llama", tps="2", steps="infer,train")
    train = [e for e in entries if e.step == "train"]
    assert [e.name for e in train] == [
        "llama_tp2_train", "llama_tp2_train__missing_grad_allreduce", "llama_tp2_train__grad_avg_allreduce",
        "llama_tp2_sp_train", "llama_tp2_sp_train__missing_grad_allreduce", "llama_tp2_sp_train__grad_avg_allreduce",
        "llama_tp2_sp_train__sp_norm_grad_unreduced"]
    assert all(e.bug not in zoo_gen.TRAIN_ONLY for e in entries if e.step == "infer")
    assert [e.manifest()["train"] for e in train] == [True] * len(train)
    # a backward bug asked for explicitly is left out of forward entries and of plans it cannot be in
    picked = zoo_gen.select(models="gpt2", tps="2", bugs="sp_norm_grad_unreduced", steps="infer,train")
    assert [e.name for e in picked] == ["gpt2_tp2_sp_train__sp_norm_grad_unreduced"]
    assert zoo_gen.select()[0].step == "infer" and len(zoo_gen.select()) == 120


def test_slices():
    sliced = zoo_gen.select(models="gpt2,llama", tps="2", plans="sp", bugs="none,bias_before_allreduce")
    assert [e.name for e in sliced] == ["gpt2_tp2_sp", "gpt2_tp2_sp__bias_before_allreduce", "llama_tp2_sp"]
    assert [e.expect for e in zoo_gen.select(models="llama", tps=[2], plans="tp", bugs="kv_own_offset")] == ["verified"]


@pytest.mark.parametrize("args, message", [
    (["--models", "mistral"], "unknown model 'mistral'"),
    (["--tp", "3"], "unknown TP degree '3'"),
    (["--plans", "zz"], "unknown plan 'zz'"),
    (["--bugs", "nope"], "unknown bug 'nope'"),
    (["--steps", "backward"], "unknown step 'backward'"),
    (["--models", "llama", "--bugs", "bias_before_allreduce"], "holds no zoo entry"),
    (["--plans", "dp", "--dp", "4"], "DP 4 does not divide the batch 2"),
    (["--dp", "2"], "a DP degree is for the mesh plans"),
    (["--plans", "dpsp", "--steps", "train"], "refine cannot prove it yet (UNPROVEN)"),
    (["--plans", "fsdp"], "fsdp is a training-step plan"),
    (["--plans", "fsdp", "--steps", "train", "--tp", "2"], "a TP degree is for the TP and mesh plans"),
    (["--mesh", "dp=2,pp=2"], "the dimensions must be exactly dp and tp, got dp, pp"),
    (["--mesh", "dp=0,tp=2"], "the size of dp must be a whole number >= 1, got '0'"),
    (["--mesh", "dp=2,tp=2", "--tp", "2"], "gives the DP and TP degrees: drop --dp and --tp"),
    (["--mesh", "dp=2,tp=2", "--plans", "tp"], "--mesh is for the mesh plans"),
    (["--mesh", "dp=2,tp=2", "--plans", "pptp"], "--mesh is for the mesh plans"),
    (["--plans", "pp,cp", "--tp", "2"], "a TP degree is for the TP and mesh plans: pp has none (fixed degrees: pp2)"),
    (["--plans", "pptp", "--tp", "4"], "pptp has none (fixed degrees: pp2_tp2)"),
    (["--plans", "ep", "--dp", "2"], "a DP degree is for the mesh plans"),
    (["--plans", "pp,ring", "--steps", "train"], "pp exports the forward only: its training step is not in the zoo"),
    (["--models", "mixtral"], "no chosen plan exports mixtral (mixtral is in the ep, eptp plans)"),
    (["--models", "llama", "--plans", "cp,ring,ep"], "no chosen plan exports llama"),
    (["--plans", "ep", "--bugs", "pp_layer_twice"], "holds no zoo entry"),
    (["--plans", "ep", "--config", "tiny-b1"], "EP 2 does not divide the batch 1 of config 'tiny-b1'"),
    (["--plans", "pptp", "--config", "tiny-b1"], "2 micro-batches do not divide the batch 1 of config 'tiny-b1'"),
    (["--plans", "pptp", "--models", "gpt2", "--config", "tiny-gqa"], "gpt2 has no grouped-query attention"),
])
def test_bad_selection_is_one_line_before_any_export(tmp_path, args, message):
    result = invoke("zoo", "--out", tmp_path / "z", *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refine: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "z").exists()


def test_export_without_the_torch_extra_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "refine.exporters.capture.export", None)  # as if torch were not installed
    result = invoke("export", "--model", "llama", "--train", "--out", tmp_path / "x")
    assert result.exit_code == 2 and "export needs the torch extra" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_list_and_missing_torch_extra(tmp_path, monkeypatch):
    listed = invoke("zoo", "--out", tmp_path / "z", "--models", "llama", "--tp", "2", "--list")
    assert listed.exit_code == 0
    assert "llama_tp2\tverified" in listed.stdout and "llama_tp2_sp__missing_allreduce\trefuted" in listed.stdout
    monkeypatch.setitem(sys.modules, "refine.exporters.zoo.bugs", None)  # as if torch were not installed
    result = invoke("zoo", "--out", tmp_path / "z", "--models", "llama", "--tp", "2")
    assert result.exit_code == 2 and "zoo needs the torch extra" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "z").exists()


def test_mesh_plans_list_their_twins_with_the_failing_node(tmp_path):
    """dp and dpsp (TP, TP+SP within each row of a DP 2 x TP mesh) only on request, each with its
    wrong-group twin, expected refuted at a named node."""
    listed = invoke("zoo", "--out", tmp_path / "z", "--models", "llama", "--tp", "2", "--plans", "dp,dpsp", "--list")
    assert listed.exit_code == 0
    assert listed.stdout.splitlines() == [
        "llama_tp2_dp2\tverified", "llama_tp2_dp2__mesh_wrong_group\trefuted at model.layers.0/Add_2",
        "llama_tp2_dp2_sp\tverified", "llama_tp2_dp2_sp__mesh_wrong_group\trefuted at model.layers.0/Add_2"]
    assert [e.plan for e in zoo_gen.select()] == [e.plan for e in zoo_gen.select(plans="tp,sp")]


def test_mesh_and_fsdp_training_steps_list_their_twins_with_the_failing_node(tmp_path):
    """--steps train: the TP x DP step (dp plan) with its mesh_grad_over_tp twin, the FSDP step
    (fsdp plan, no TP degree) with its two twins, each twin refuted at a named node; dpsp has no
    training step (refine cannot prove it yet): a note on stderr, not an entry."""
    listed = invoke("zoo", "--models", "llama", "--tp", "2", "--plans", "dp,dpsp,fsdp", "--steps", "train", "--list")
    assert listed.exit_code == 0, listed.output
    grad = "refuted at model.embed_tokens (backward)/Transpose_3"
    assert listed.stdout.splitlines() == [
        "llama_tp2_dp2_train\tverified", f"llama_tp2_dp2_train__mesh_grad_over_tp\t{grad}",
        "llama_dp2_fsdp_train\tverified", f"llama_dp2_fsdp_train__fsdp_grad_not_reduced\t{grad}",
        f"llama_dp2_fsdp_train__fsdp_grad_avg\t{grad}"]
    assert listed.stderr.strip().splitlines() == [
        "refine: note: the TP+SP x DP training step is not in the zoo: refine cannot prove it yet (UNPROVEN); "
        "the TP x DP step is --plans dp --steps train"]
    fsdp = zoo_gen.select(models="gpt2", plans="fsdp", steps="infer,train")  # every TP degree: one FSDP entry
    assert [(e.name, e.tp, e.manifest()["fsdp"]) for e in fsdp] == [
        ("gpt2_dp2_fsdp_train", 1, True), ("gpt2_dp2_fsdp_train__fsdp_grad_not_reduced", 1, True),
        ("gpt2_dp2_fsdp_train__fsdp_grad_avg", 1, True)]
    assert zoo_gen.left_out("fsdp", "infer,train") == [zoo_gen.UNSUPPORTED[("fsdp", "infer")]]
    # a twin of another plan or step is left out (the forward mesh twin of a training step)
    assert [e.name for e in zoo_gen.select(models="gpt2", tps="2", plans="dp", steps="infer,train",
                                           bugs="mesh_wrong_group,mesh_grad_over_tp")] == [
        "gpt2_tp2_dp2__mesh_wrong_group", "gpt2_tp2_dp2_train__mesh_grad_over_tp"]


def test_mesh_option_is_the_dp_plan_on_that_mesh(tmp_path):
    """--mesh dp=D,tp=T (either order) lists what --plans dp --dp D --tp T does; with --plans, the
    chosen mesh plans on that mesh."""
    def lines(*args: str) -> list[str]:
        result = invoke("zoo", "--models", "gpt2", "--list", *args)
        assert result.exit_code == 0, result.output
        return result.stdout.splitlines()

    assert lines("--mesh", "dp=2,tp=2", "--steps", "infer,train") == \
        lines("--plans", "dp", "--dp", "2", "--tp", "2", "--steps", "infer,train") == [
        "gpt2_tp2_dp2\tverified", "gpt2_tp2_dp2__mesh_wrong_group\trefuted at h.0/Add_2",
        "gpt2_tp2_dp2_train\tverified", "gpt2_tp2_dp2_train__mesh_grad_over_tp\trefuted at wte (backward)/Add"]
    assert lines("--mesh", "tp=4, dp=2", "--plans", "dp,dpsp") == lines("--plans", "dp,dpsp", "--dp", "2", "--tp", "4")
    assert zoo_gen.parse_mesh("tp=8,dp=2") == (2, 8)


def test_mesh_and_fsdp_catalogues_match_the_selection():
    pytest.importorskip("torch")
    from refine.exporters.strategies import data_parallel, mesh

    assert tuple(n for n, b in mesh.MESH_BUGS.items() if b.train) == zoo_gen.MESH_TRAIN_BUG_NAMES
    assert tuple(n for n, b in data_parallel.DATA_PARALLEL_BUGS.items() if b.fsdp) == zoo_gen.FSDP_BUG_NAMES
    assert set(zoo_gen.MESH_BUG_NODES) | set(zoo_gen.FSDP_BUG_NODES) == {
        *zoo_gen.MESH_BUG_NAMES, *zoo_gen.MESH_TRAIN_BUG_NAMES, *zoo_gen.FSDP_BUG_NAMES}


def test_pipeline_context_and_expert_plans_only_on_request(tmp_path):
    """pp, pptp, cp, ring, zigzag, ep, eptp: forward entries at fixed degrees (PP 2 with 2 micro-batches,
    PP 2 x TP 2, CP 2 all-gather, ring and zig-zag, EP 2, EP 2 x TP 2), and pptrain's training steps (PP 2,
    2 micro-batches), of the models their exporters take, each twin refuted at a named node; none in the
    default zoo; a chosen twin is left out of the other plans."""
    listed = invoke("zoo", "--plans", "pp,pptp,pptrain,cp,ring,zigzag,ep,eptp", "--list")
    assert listed.exit_code == 0, listed.output
    rows = dict(line.split("\t") for line in listed.stdout.splitlines())
    plans = {p.name: p for p in zoo_gen.PARALLEL_PLANS.values()}
    want = {f"{m}_{p.suffix}" + (f"__{b}" if b else "")
            for p in plans.values() for m in p.models for b in (None, *p.bugs)}
    assert set(rows) == want and len(rows) == 3 * 3 + 3 * 4 + 4 + 3 + 4 + 4 + 3 + 4
    assert {n for n, v in rows.items() if v == "verified"} == {
        "llama_pp2", "gpt2_pp2", "qwen2_pp2", "llama_pp2_tp2", "gpt2_pp2_tp2", "qwen2_pp2_tp2", "gpt2_cp2",
        "gpt2_cp2_ring", "gpt2_cp2_zigzag", "mixtral_ep2", "mixtral_ep2_tp2", "gpt2_pp2_train"}
    assert all(v.startswith("refuted at ") for n, v in rows.items() if "__" in n)  # every twin names its node
    assert rows["gpt2_cp2__cp_positions_not_offset"] == "refuted at wpe/Gather"
    assert {e.plan for e in zoo_gen.select(models="gpt2,llama,qwen2")} == {"tp", "sp"}  # not in the default zoo
    entries = zoo_gen.select(models="gpt2", plans="pp,pptp", bugs="none,pp_wrong_tp_peer")
    assert [(e.name, e.tp) for e in entries] == [
        ("gpt2_pp2", 1), ("gpt2_pp2_tp2", 2), ("gpt2_pp2_tp2__pp_wrong_tp_peer", 2)]
    assert entries[1].manifest() == {"model": "gpt2", "config": "tiny", "mesh": {"pp": 2, "tp": 2}, "micro_batches": 2,
                                     "seed": 0, "bug": None, "train": False}
    assert [e.name for e in zoo_gen.select(plans="tp,ep", tps="2", bugs="none", models="llama,mixtral")] == [
        "llama_tp2", "mixtral_ep2"]
    assert zoo_gen.left_out("pp,cp", "infer,train") == [zoo_gen.UNSUPPORTED[("pp", "train")],
                                                        zoo_gen.UNSUPPORTED[("cp", "train")]]
    assert entries[0].manifest()["train"] is False
    assert zoo_gen.select(models="gpt2", plans="pptrain", bugs="none")[0].manifest()["train"] is True


def test_parallel_catalogues_match_the_selection():
    pytest.importorskip("torch")
    from refine.exporters.strategies import context, expert, expert_mesh, pipeline

    from refine.exporters.zoo import moe
    plans = zoo_gen.PARALLEL_PLANS
    assert set(pipeline.PP_MODELS) == set(plans["pp"].models) == set(plans["pptp"].models)
    forward = {n: b for n, b in pipeline.PIPELINE_BUGS.items() if not b.train}  # (the zoo's plans are forward)
    assert plans["pp"].bugs == tuple(n for n, b in forward.items() if b.min_tp == 1)
    assert plans["pptp"].bugs == tuple(forward)
    trained = {n: b for n, b in pipeline.PIPELINE_BUGS.items() if b.train and b.min_tp == 1}  # (GPipe's: not 1F1B's)
    assert set(plans["pptrain"].bugs) == set(trained) - {"pp_1f1b_send_first"}
    assert context.CP_MODELS == plans["cp"].models == plans["ring"].models == plans["zigzag"].models
    assert (plans["cp"].bugs, plans["ring"].bugs) == (tuple(context.CONTEXT_BUGS), tuple(context.RING_BUGS))
    assert plans["zigzag"].bugs == tuple(context.ZIGZAG_BUGS)
    assert expert.EP_MODELS == plans["ep"].models and moe.EXPERTS == zoo_gen.EXPERTS
    assert plans["ep"].bugs == tuple(n for n, b in expert.EXPERT_BUGS.items() if b.weigh == "experts")
    assert plans["eptp"].models == plans["ep"].models and set(plans["eptp"].bugs) == set(expert_mesh.EXPERT_MESH_BUGS)
    for plan in plans.values():  # every twin of every model has its node
        assert {(b, m) for b, nodes in plan.nodes.items() for m in nodes} == {
            (b, m) for b in plan.bugs for m in plan.models}


# --- a slice exported through PyTorch -------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_slice(zoo_slice):
    """Llama TP 2, plain TP plan: none, missing_allreduce, faulty_rowwise_none (conftest.zoo_slice,
    shared with tests/test_names.py)."""
    return zoo_slice


def test_bugs_catalogue_matches_the_selection():
    pytest.importorskip("torch")
    from refine.exporters.zoo import bugs

    assert tuple(bugs.BUGS) == zoo_gen.BUG_NAMES + zoo_gen.TRAIN_BUG_NAMES
    assert tuple(bugs.CONTROLS) == zoo_gen.CONTROL_NAMES
    assert {n for n, b in bugs.BUGS.items() if b.models == ("gpt2",)} == zoo_gen.GPT2_ONLY
    # what the torch-free selection knows of each bug's plans and steps is what the catalogue says
    everything = {**bugs.BUGS, **bugs.CONTROLS}
    assert {n for n, b in everything.items() if b.plans == ("sp",)} == zoo_gen.SP_ONLY
    assert {n for n, b in everything.items() if b.train_only} == zoo_gen.TRAIN_ONLY
    assert len({b.bug_class for b in bugs.BUGS.values() if b.applies("llama")}) >= 5


def test_slice_entries_carry_their_expectation(exported_slice):
    for name, verdict in (("llama_tp2", "verified"), ("llama_tp2__missing_allreduce", "refuted"),
                          ("llama_tp2__faulty_rowwise_none", "verified")):
        config = json.loads((exported_slice / name / "refine.json").read_text())
        assert config["expect"] == {"verdict": verdict}, name
        manifest = json.loads((exported_slice / name / "export.json").read_text())["zoo"]
        assert manifest["bug"] == (None if name == "llama_tp2" else name.split("__")[1])
    assert not [p for p in exported_slice.iterdir() if p.name.startswith(".")]  # no scratch left behind


def test_the_injected_bug_is_real(exported_slice):
    import refine.exporters

    assert refine.exporters.check(exported_slice / "llama_tp2__faulty_rowwise_none").ok
    assert not refine.exporters.check(exported_slice / "llama_tp2__missing_allreduce").ok


def test_batch_gives_every_entry_its_expected_verdict(exported_slice, tmp_path):
    result = invoke("batch", exported_slice, "--jobs", 2, "--json", tmp_path / "r.json", "--cache-dir", tmp_path / "c")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    got = {e["entry"]: e["status"] for e in report["entries"]}
    assert got == {"llama_tp2": "verified", "llama_tp2__missing_allreduce": "refuted",
                   "llama_tp2__faulty_rowwise_none": "verified"}


def test_zoo_rerun_keeps_current_entries(exported_slice):
    result = invoke("zoo", "--out", exported_slice, "--models", "llama", "--tp", "2", "--plans", "tp",
                    "--bugs", "none,missing_allreduce,faulty_rowwise_none")
    assert result.exit_code == 0 and "3 already current" in result.stdout, result.output


def test_training_step_twins_get_their_verdict_at_their_node(tmp_path):
    """GPT-2 (the smallest) on a 2 x 2 mesh and under FSDP over 2 ranks: each twin is refuted at the
    node its refine.json names, and under SWEEP each correct step verifies (the default run verifies
    the correct TP x DP step in tests/test_export_mesh.py and the FSDP one in
    tests/test_data_parallel_export.py); a rerun keeps every entry. The default run takes the mesh
    twin alone (the FSDP twin fsdp_grad_avg, refuted by default in tests/test_data_parallel_export.py,
    is the sweep's here)."""
    pytest.importorskip("torch")
    chosen = "none,mesh_grad_over_tp,fsdp_grad_avg" if SWEEP else "mesh_grad_over_tp"
    plans = "dp,fsdp" if SWEEP else "dp"
    args = ("zoo", "--out", tmp_path / "zoo", "--models", "gpt2", "--tp", "2", "--plans", plans, "--steps", "train",
            "--bugs", chosen)
    n = 4 if SWEEP else 1
    result = invoke(*args)
    assert result.exit_code == 0 and f"{n} entries: {n} written" in result.stdout, result.output
    if SWEEP:
        raw = json.loads((tmp_path / "zoo" / "gpt2_dp2_fsdp_train__fsdp_grad_avg" / "refine.json").read_text())
        assert raw["expect"] == {"verdict": "refuted", "node": "wte (backward)/Add"}
    manifest = json.loads((tmp_path / "zoo" / "gpt2_tp2_dp2_train__mesh_grad_over_tp" / "export.json").read_text())["zoo"]
    assert manifest["train"] is True and manifest["mesh"] == {"dp": 2, "tp": 2}
    batch = invoke("batch", tmp_path / "zoo", "--jobs", 2, "--json", tmp_path / "r.json", "--cache-dir", tmp_path / "c")
    assert batch.exit_code == 0 and "all as expected" in batch.output, batch.output
    got = {e["entry"]: e["status"] for e in json.loads((tmp_path / "r.json").read_text())["entries"]}
    want = {"gpt2_tp2_dp2_train__mesh_grad_over_tp": "refuted"}
    if SWEEP:
        want |= {"gpt2_dp2_fsdp_train__fsdp_grad_avg": "refuted", "gpt2_tp2_dp2_train": "verified",
                 "gpt2_dp2_fsdp_train": "verified"}
    assert got == want
    assert f"{n} already current" in invoke(*args).stdout


def test_a_context_parallel_slice_gets_its_verdicts_at_its_nodes(tmp_path):
    """GPT-2 under CP 2 (all-gather), correct and its positions twin: `refine batch` gives each its
    verdict, the twin at the node its refine.json names (the other plans' twins: by hand, docs)."""
    pytest.importorskip("torch")
    args = ("zoo", "--out", tmp_path / "zoo", "--plans", "cp", "--bugs", "none,cp_positions_not_offset")
    result = invoke(*args)
    assert result.exit_code == 0 and "2 entries: 2 written" in result.stdout, result.output
    twin = "gpt2_cp2__cp_positions_not_offset"
    assert json.loads((tmp_path / "zoo" / twin / "refine.json").read_text())["expect"] == {
        "verdict": "refuted", "node": "wpe/Gather"}
    assert json.loads((tmp_path / "zoo" / twin / "export.json").read_text())["zoo"]["cp"] == 2
    batch = invoke("batch", tmp_path / "zoo", "--jobs", 2, "--json", tmp_path / "r.json", "--cache-dir", tmp_path / "c")
    assert batch.exit_code == 0 and "all as expected" in batch.output, batch.output
    got = {e["entry"]: e["status"] for e in json.loads((tmp_path / "r.json").read_text())["entries"]}
    assert got == {"gpt2_cp2": "verified", twin: "refuted"}
    assert "2 already current" in invoke(*args).stdout


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1, benchmarks/sweep.py): 8 exports")
def test_pipeline_training_and_expert_mesh_plans_get_their_verdicts(tmp_path):
    """pptrain (GPT-2's pipeline training step) and eptp (Mixtral on EP 2 x TP 2), correct and every
    twin: `refine batch` gives each its verdict, each twin at the node its refine.json names."""
    pytest.importorskip("torch")
    args = ("zoo", "--out", tmp_path / "zoo", "--plans", "pptrain,eptp")
    result = invoke(*args)
    assert result.exit_code == 0 and "8 entries: 8 written" in result.stdout, result.output
    assert json.loads((tmp_path / "zoo" / "gpt2_pp2_train" / "export.json").read_text())["zoo"]["train"] is True
    batch = invoke("batch", tmp_path / "zoo", "--jobs", 2, "--json", tmp_path / "r.json", "--cache-dir", tmp_path / "c")
    assert batch.exit_code == 0 and "all as expected" in batch.output, batch.output
    got = {e["entry"]: e["status"] for e in json.loads((tmp_path / "r.json").read_text())["entries"]}
    assert sorted(n for n, s in got.items() if s == "verified") == ["gpt2_pp2_train", "mixtral_ep2_tp2"]
    assert "8 already current" in invoke(*args).stdout
