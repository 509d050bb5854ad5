"""Layer memoization (docs/layers.md, refine/run/memo.py): the `layer_summary` lemma's witness, and
memoized runs against plain (inlined) ones on correct and buggy stacks of layer functions."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import EXAMPLES_DIR
from harness import invoke
from refine.run import memo
from refine.run.engine import Probe
from refine.lowering.facts import FactSet
from refine.lowering.graphs import _constant_chunks, _digest
from refine.lowering.program import lower_program
from refine.run.memo import run_program
from refine.pipeline import verify_dir
from refine.diagnose.diagnosis import build_report
from refine.diagnose.simulate import simulate_dir
from refine.diagnose.witness import check


def _layered():
    spec = importlib.util.spec_from_file_location("examples_layered", EXAMPLES_DIR / "layered.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules.setdefault("examples_layered", module)
    spec.loader.exec_module(module)
    return module


layered = _layered()


@pytest.mark.parametrize("elide", [True, False])
@pytest.mark.parametrize("tp,layers", [(2, 5), (4, 3), (8, 2)])
def test_layer_summary_witness(tmp_path, tp, layers, elide):
    """Relations carried through layer calls by their template's summary hold on the numbers
    (the simulator runs the inlined programs), and every call used one template solve. Not
    eliding puts every call's outputs in the fixpoint, so every summary is checked."""
    d = layered.write(tmp_path / "m", layers, tp)
    program = lower_program(d)
    run = run_program(program, elide=elide)
    assert len(program.templates) == 1 and run.template_solves == 1
    assert run.elided == (layers - 1 if elide else 0)
    report = build_report("m", program.main, run.derived)
    assert report.verdict == "verified"
    for seed in (0, 1):
        checked = check(run.derived, simulate_dir(d, seed), seed)
        assert checked.ok, checked.violations
        assert "layer_summary" in checked.lemmas_checked
    assert run.derived.get("sanity") == []


def test_layer_summary_only_where_the_key_holds(tmp_path):
    """A summary proved for replicated inputs does not reach a call whose input is not
    replicated: the stack's input declared as a partial sum (same shapes, so the same
    template, another key) leaves every call unproven."""
    d = layered.write(tmp_path / "m", 3, 2)
    config = json.loads((d / "refine.json").read_text())
    config["inputs"]["x"] = {"layout": "partial", "op": "sum"}
    (d / "refine.json").write_text(json.dumps(config))
    run = run_program(lower_program(d))
    assert not [r for r in run.derived.get("rel_by") if r[3] == "layer_summary"]


@pytest.mark.parametrize("broken", [None, "first rank's layout", "last rank's second entry"])
def test_a_key_holds_at_a_site_only_when_every_rank_entry_does(broken):
    """The key check (memo.summary_rule's facts, rules/layers.lp's chain over one step per rank
    graph and the entries of each step): memo(C, k) at a site whose every rank input relates as
    the key says; one entry related otherwise on the first rank, or missing on the last, and the
    site gets no summary (no step of the chain may be skipped)."""
    ranks = ["r0", "r1", "r2"]
    key = frozenset((i, g, i, "rep" if i == 0 else f"sl(1,{2 * r},{2 * r + 2})")
                    for r, g in enumerate(ranks) for i in (0, 1))
    facts = FactSet()
    facts.add("callsite", "c", "T1")
    for g in ["seq", *ranks]:
        facts.add("call_node", "c", g, f"{g}/call")
        for i in (0, 1):
            facts.add("node_in", g, f"{g}/call", i, f"{g}/in{i}")
    for i, g, j, lay in key:
        if broken == "first rank's layout" and (g, i) == ("r0", 1):
            lay = "sl(1,2,4)"
        if broken == "last rank's second entry" and (g, i) == ("r2", 1):
            continue
        facts.add("param_rel", f"seq/in{i}", f"{g}/in{j}", lay)
    probe = Probe(facts, program=memo.summary_rule("k1", "T1", key, []))
    held = {(c.value, k.value) for c, k in probe.ask("", "memo", 2)}
    assert held == ({("c", "k1")} if broken is None else set())


def test_calls_given_each_others_weights_get_no_summary(tmp_path):
    """The weight part of a key is checked in Python (memo.params_ok), not by the summary rule:
    rank 1 passing layer 3's bias to layer 2's call and layer 2's to layer 3's (every weight is
    still read by calls only, so all of them stay out of the main solve) must leave layer 2
    without the summary the other calls share, memoized or not, and the numbers show the bug."""
    d = layered.write(tmp_path / "m", 6, 2)
    m = onnx.load(d / "rank1.onnx")
    calls = {n.name: n for n in m.graph.node}
    for mine, other in (("layers.2", "layers.3"), ("layers.3", "layers.2")):
        call = calls[mine]
        call.input[list(call.input).index(f"{mine}.b1")] = f"{other}.b1"
    onnx.save(m, d / "rank1.onnx")
    memo = verify_dir(d)
    plain = verify_dir(d, memo=False)
    assert memo.verdict == plain.verdict == "refuted"
    assert memo.failure is not None and memo.failure.node.startswith("layers.2"), memo.failure
    run = run_program(lower_program(d), elide=False)  # every call's outputs in the fixpoint
    summarized = {r[0] for r in run.derived.get("rel_by") if r[3] == "layer_summary"}
    assert "seq:layers.1.out" in summarized and "seq:layers.2.out" not in summarized


def _rel_atoms(run) -> set[tuple[str, str, str]]:
    return {(str(s), str(t), text) for (s, t, _), (_s, _t, text) in zip(run.derived.get("rel"), run.derived.raw["rel"])}


def test_chained_calls_left_out_of_the_main_solve_give_the_same_fixpoint(tmp_path):
    """In a chain of 12 layers every call but the last (whose output the head reads) is
    instantiated along the chain and left out of the whole main solve: the fixpoint then lacks
    the relations of the 10 activations only left-out calls read (the 11th, which the last call
    reads, is given to the solve) and nothing else, and has no others."""
    d = layered.write(tmp_path / "m", 12, 2)
    program = lower_program(d)
    cut, whole = run_program(program), run_program(program, elide=False)
    assert cut.elided == 11 and whole.elided == 0 and cut.main_solves == whole.main_solves == 2
    between = {t for site in cut.sites[:-2] for t in site.outputs["seq"].values()}
    assert len(between) == 10
    assert _rel_atoms(cut) == {a for a in _rel_atoms(whole) if a[0] not in between}
    assert build_report("m", program.main, cut.derived).verdict == "verified"


def test_a_left_out_call_whose_key_the_solve_does_not_confirm_is_solved_whole(tmp_path, monkeypatch):
    """The chain is instantiated with the keys the first (partial) solve foresaw; if the whole
    solve relates a left-out call's inputs otherwise, the graphs are solved again, whole."""
    real_walk = memo._learn_along_chains
    walks = []

    def foresee_one_relation_more(sites, rels, consts, summaries, learn, foresee=None, relay=None):
        walk = real_walk(sites, rels, consts, summaries, learn, foresee, relay)
        first = sites[0].cid
        if not walks and first in walk.keys:  # the first walk that foresees the chain
            walk.keys[first] = walk.keys[first] | {(0, "r0", 0, "sl(0,0,1)")}
            walks.append(walk)
        return walk

    monkeypatch.setattr(memo, "_learn_along_chains", foresee_one_relation_more)
    d = layered.write(tmp_path / "m", 4, 2)
    run = run_program(lower_program(d))
    assert run.elided == 0 and run.main_solves == 3
    assert build_report("m", lower_program(d).main, run.derived).verdict == "verified"


@pytest.mark.parametrize("bug", layered.BUGS)
def test_a_failing_run_solved_whole_again_reuses_its_summaries(tmp_path, bug):
    """What pipeline.py does when a run with calls left out does not verify: solve the whole
    graphs again with the summaries already learned (no template solve, no first partial
    solve), which must give the very fixpoint a fresh run without leaving calls out gives."""
    d = layered.write(tmp_path / "m", 8, 2, bug, 5)
    program = lower_program(d)
    first = run_program(program)
    again, fresh = run_program(program, elide=False, learned=first), run_program(program, elide=False)
    assert first.elided > 0 and again.elided == fresh.elided == 0
    assert again.template_solves == 0 and again.main_solves < fresh.main_solves
    assert _rel_atoms(again) == _rel_atoms(fresh)
    assert sorted(again.derived.get("frontier")) == sorted(fresh.derived.get("frontier"))


def test_a_call_whose_outputs_are_not_shaped_as_its_template_results_stays_in_the_solve(tmp_path):
    """Left-out calls skip the shape guard; so a call whose output shape differs from its
    template's result (a shape-inference hole, faked here in the facts) is not left out: the
    guard rejects its summary there, and says so."""
    d = layered.write(tmp_path / "m", 6, 2)
    program = lower_program(d)
    program.main.rows["dim"] = [(g, t, a, n + 1 if t == "r0:layers.3.out" and a == 0 else n)
                                for g, t, a, n in program.main.rows["dim"]]
    run = run_program(program)
    assert ("shape_mismatch", "seq:layers.3.out", "r0:layers.3.out") in run.derived.get("sanity")
    assert build_report("m", program.main, run.derived).verdict == "unproven"


@pytest.mark.parametrize("bug", [None, *layered.BUGS])
def test_memoized_and_plain_runs_agree(tmp_path, bug):
    """Same verdict and reconstructions with and without memoization; a bug in layer 13 of 16
    is reported inside layer 13 by the memoized run, with a numeric counterexample. (16 layers:
    the plain run's cost grows with depth; the chain and the deep bug are there at 16 as at 40.)"""
    d = layered.write(tmp_path / "m", 16, 2, bug, 13)
    memo = verify_dir(d)
    plain = verify_dir(d, memo=False)
    assert memo.verdict == plain.verdict == ("verified" if bug is None else "refuted")
    assert [(o.name, o.ok, o.reconstruction) for o in memo.outputs] == [(o.name, o.ok, o.reconstruction) for o in plain.outputs]
    assert memo.memo is not None and memo.memo["layer_calls"] == 16
    assert memo.memo["templates"] == (1 if bug is None else 2)
    if bug is not None:
        assert memo.failure is not None and memo.failure.node.startswith("layers.13/"), memo.failure
        assert plain.failure is not None and plain.failure.node.split("/")[0] in ("layers.13", "layers.14")
        assert memo.numeric is not None and memo.numeric.status == "counterexample"
        assert memo.numeric.at_node is not None  # the values at the node inside the layer


def _rename_variant(model: onnx.ModelProto, layer: int, mutate=None) -> onnx.ModelProto:
    """Give layer `layer` its own copy of the block function (optionally changed)."""
    fn = onnx.FunctionProto()
    fn.CopyFrom(model.functions[0])
    fn.name = "MLPBlockCopy"
    if mutate is not None:
        mutate(fn)
    model.functions.append(fn)
    node = next(n for n in model.graph.node if n.name == f"layers.{layer}")
    node.op_type = fn.name
    return model


def _leaky(fn: onnx.FunctionProto) -> None:
    relu = next(n for n in fn.node if n.op_type == "Relu")
    relu.op_type = "LeakyRelu"
    relu.attribute.append(helper.make_attribute("alpha", 0.0))  # the same values, another op


@pytest.mark.parametrize("where,mutate,templates", [
    ("all", None, 1),        # a renamed copy of the same body is the same template
    ("r1", None, 1),
    ("r1", _leaky, 2),       # one rank differs in one node: a different template
    ("seq", _leaky, 2),
])
def test_templates_are_identified_by_content(tmp_path, where, mutate, templates):
    d = layered.write(tmp_path / "m", 4, 2)
    for name in ["seq", "rank0", "rank1"]:
        if where == "all" or where == name.replace("rank", "r"):
            onnx.save(_rename_variant(onnx.load(d / f"{name}.onnx"), 2, mutate), d / f"{name}.onnx")
    program = lower_program(d)
    assert len(program.templates) == templates


def test_attribute_change_is_a_new_template(tmp_path):
    """Same ops, one attribute different on one rank (the all-reduce's group order)."""
    d = layered.write(tmp_path / "m", 3, 2)

    def regroup(fn: onnx.FunctionProto) -> None:
        ar = next(n for n in fn.node if n.op_type == "AllReduce")
        for a in ar.attribute:
            if a.name == "group":
                del a.ints[:]
                a.ints.extend([1, 0])

    for r in range(2):
        onnx.save(_rename_variant(onnx.load(d / f"rank{r}.onnx"), 1, regroup), d / f"rank{r}.onnx")
    assert len(lower_program(d).templates) == 2


def test_lower_and_run_on_layer_functions(tmp_path):
    """`refine lower` writes the templates next to the main facts; `refine run` reads them."""
    d = layered.write(tmp_path / "m", 6, 2)
    facts = tmp_path / "facts"
    result = invoke("lower", str(d), "--out", str(facts))
    assert result.exit_code == 0, result.output
    assert (facts / "templates" / "T1" / "node.facts").is_file()
    result = invoke("run", "--facts", str(facts))
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    result = invoke("lower", str(d), "--out", str(facts), "--no-memo")
    assert result.exit_code == 0 and not (facts / "templates").exists()
    result = invoke("run", "--facts", str(facts))
    assert result.exit_code == 0, result.output


def test_missing_template_is_bad_input(tmp_path):
    d = layered.write(tmp_path / "m", 2, 2)
    facts = tmp_path / "facts"
    assert invoke("lower", str(d), "--out", str(facts)).exit_code == 0
    (facts / "templates" / "T1" / "node.facts").unlink()
    result = invoke("run", "--facts", str(facts))
    assert result.exit_code == 2
    assert "node.facts" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_verify_no_memo_flag(tmp_path):
    d = layered.write(tmp_path / "m", 3, 2, "extra_scale", 1)
    for flag in ([], ["--no-memo"]):
        result = invoke("verify", str(d), "--quiet", *flag)
        assert result.exit_code == 1 and "layers.1/down_bias" in result.output, result.output


def _with_taps(d, declared: dict[int, dict]):
    """The stack with every layer's output also a graph output (`layers.K.out`), declared in
    refine.json as `declared` says (a replica unless named): like a training step's backward
    calls, whose weight gradients are graph outputs."""
    for path in sorted(d.glob("*.onnx")):
        model = onnx.load(str(path))
        calls = [n for n in model.graph.node if n.domain == "refine.layer"]
        model.graph.output.extend(helper.make_tensor_value_info(c.output[0], onnx.TensorProto.FLOAT, [2, 4, 8])
                                  for c in calls[:-1])
        onnx.save(model, str(path))
    config = json.loads((d / "refine.json").read_text())
    layers = sum(1 for k in config["inputs"] if k.endswith(".w1"))
    config["outputs"].update({f"layers.{k}.out": declared.get(k, {"layout": "rep"}) for k in range(layers - 1)})
    config.pop("expect", None)
    (d / "refine.json").write_text(json.dumps(config))
    return d


def test_graph_outputs_of_left_out_calls_are_checked_once_per_class(tmp_path):
    """Left-out calls whose outputs are also graph outputs: one output per class (template,
    key, position, declared layouts) is solved, the others get its atoms renamed; the result
    is the whole fixpoint's at every output, and the same report."""
    d = _with_taps(layered.write(tmp_path / "m", 6, 2), {})
    program = lower_program(d)
    cut, whole = run_program(program), run_program(program, elide=False)
    assert cut.elided == 5 and cut.copied == 3 and whole.copied == 0  # (layer 5 reads layer 4's: kept)
    outputs = {t for site in cut.sites for outs in site.outputs.values() for t in outs.values()}
    assert {a for a in _rel_atoms(cut) if a[0] in outputs} == {a for a in _rel_atoms(whole) if a[0] in outputs}
    assert sorted(cut.derived.get("output_ok")) == sorted(whole.derived.get("output_ok"))
    reports = [build_report("m", program.main, run.derived) for run in (cut, whole)]
    assert reports[0].outputs == reports[1].outputs and reports[0].verdict == reports[1].verdict == "verified"
    assert verify_dir(d).verdict == "verified"


@pytest.mark.parametrize("declared", [{"layout": "shard", "axis": 2}, {"layout": "partial"}])
def test_an_output_declared_otherwise_at_one_left_out_call_is_not_copied(tmp_path, declared):
    """The declared layout is part of an output's class: layer 3's output declared as a shard
    (or a partial sum) where every rank holds a replica is checked on its own, and fails."""
    d = _with_taps(layered.write(tmp_path / "m", 6, 2), {3: declared})
    run = run_program(lower_program(d))
    assert run.copied == 2
    report = verify_dir(d)
    assert report.verdict != "verified"
    assert {o.name for o in report.outputs if not o.ok} == {"layers.3.out"}


def test_a_layer_key_relates_constant_arguments_as_the_rules_do():
    """A call's constant argument enters its key with the layouts rules/core.lp's const_rel gives
    it: equal values a replica, a rank's equal chunk of the sequential constant that slice, and
    nothing for another chunk (the lowering's hashes: refine/lowering/graphs.py)."""
    table = np.arange(12, dtype=np.float32).reshape(6, 2) * 1.5 - 4.0
    main = FactSet()
    main.add("const", "seq", "S", _digest(table))
    for axis, lo, hi, h in _constant_chunks(table, 2):
        main.add("const_chunk", "seq", "S", axis, lo, hi, h)
    for t, value in (("whole", table), ("second", table[3:]), ("shifted", table[1:4])):
        main.add("const", "r1", t, _digest(value))
        for axis, size in enumerate(value.shape):
            main.add("dim", "r1", t, axis, size)
    consts = memo.Constants.of(main)
    assert consts.layouts("S", "whole") == {"rep"}
    assert consts.layouts("S", "second") == {"sl(0,3,6)"}
    assert consts.layouts("S", "shifted") == set()
