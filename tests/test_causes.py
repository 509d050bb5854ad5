"""Why, not only where: for each bug class in BUGS.md that refine catches, the report names the
failing node AND its cause -- the closest lemma (refine/diagnose/closest.py: the rule whose body held
furthest with the node bound to the failing one), the premise of it that did not hold, and that
premise in words with what holds instead -- and the bug's correct twin verifies.

The bundled examples (examples/build.py) and the layered ones (examples/layered.py, through
layer memoization and without it) take seconds; the Megatron blocks (examples/megatron.py,
real PyTorch exported with `refine.exporters.export`) need the torch extra.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO
from harness import Case, Graph, example_report, rep, shard
from refine import dist
from refine.run.engine import solve
from refine.lowering.facts import FactSet
from refine.lowering.graphs import lower_models
from refine.pipeline import run_facts, verify_dir
from refine.report.render import render_text
from refine.diagnose.diagnosis import build_report
from refine.report.schema import ClosestLemma, Report

EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))
import layered  # noqa: E402  (examples/layered.py)


@dataclass(frozen=True)
class Cause:
    """A buggy model, where it must fail and why: the closest lemma, the predicate of its missing
    premise, fragments its words must contain, and fragments some near lemma's words must contain
    (`near`: lemma -> fragments), with the twins that must verify."""

    name: str
    node: str
    lemma: str
    missing: str  # how the missing premise starts: `inrel(`, `shape_ok(`, `0 < 0`
    words: tuple[str, ...]
    near: dict[str, tuple[str, ...]] = field(default_factory=dict)
    twins: tuple[str, ...] = ()


def closest_of(report: Report, node: str) -> ClosestLemma:
    assert report.verdict != "verified"
    assert report.failure is not None and report.failure.node == node, (report.failure, render_text(report))
    closest = report.failure.closest
    assert closest is not None, render_text(report)
    return closest


def deepest_words(near) -> str:
    """A near lemma's words and those of the helper rules below it."""
    return " / ".join([near.words, *(b.words for b in near.because)])


def assert_cause(report: Report, cause: Cause) -> None:
    closest = closest_of(report, cause.node)
    assert closest.rule == cause.lemma, render_text(report)
    assert closest.missing is not None and closest.missing.startswith(cause.missing), closest.missing
    assert closest.matched < closest.premises or closest.missing.startswith("shape_ok(")
    for fragment in cause.words:
        assert fragment in closest.words, (fragment, closest.words)
    others = {o.rule: deepest_words(o) for o in closest.others}
    for lemma, fragments in cause.near.items():
        assert lemma in others, (lemma, sorted(others))
        for fragment in fragments:
            assert fragment in others[lemma], (lemma, fragment, others[lemma])
    text = render_text(report)
    assert f"closest lemma: {cause.lemma} (rules/" in text and closest.words in text


# --- bundled examples: BUGS.md classes 1, 2, 3, 8, 14 ------------------------------------------

BUNDLED = [
    # class 1: the row-parallel partial sums are used as if complete (bias added on every rank)
    Cause("mlp_missing_allreduce", "mlp.down_proj/Add", "partial_add_partial", "inrel(",
          ("input 1 of r1's mlp.down_proj/Add", "mlp.down_proj.bias", "a partial sum", "but it is a replica"),
          {"partial_add_once": ("input 0 (mlp.down_proj/MatMul_output_0) is partial sum, piece [32:64) of 64",)},
          twins=("mlp_tp2",)),
    # class 2: an all-gather where the all-reduce belongs: what reaches the Add relates to nothing
    Cause("mlp_wrong_collective", "mlp.down_proj/Add", "partial_add_partial", "inrel(",
          ("input 0 of r0's mlp.down_proj/Add", "mlp.down_proj/AllGather_output_0",
           "relates to no layout of mlp.down_proj/MatMul_output_0", "mlp.down_proj/AllGather (examples/build.py:187)",
           "dist.AllGather"),
          twins=("mlp_tp2",)),
    # class 3: every rank adds the full bias to its partial; the fixes are the near lemmas
    Cause("mlp_bias_before_allreduce", "mlp.down_proj/Add", "partial_add_partial", "inrel(",
          ("input 1 of r1's mlp.down_proj/Add (examples/build.py:192)", "mlp.down_proj.bias", "but it is a replica"),
          {"partial_add_share": ("scaled(P,Q,rep)", "but it is a replica"),  # bias / TP on every rank
           "partial_add_once": ("psum(0,B,D,St)", "piece [32:64) of 64")},  # bias on piece 0 only
          twins=("mlp_bias_rank0", "mlp_bias_div_tp")),
    # class 8: the reshape lemma fires, and the shape guard refuses: the rank split heads' dims
    # (the Reshapes pair since the library is stratified again: an unstratified negation left the
    # closest-lemma probe without the pair, and it named value_view's missing pair instead)
    Cause("attn_reshape_moves_shard", "self_attn/Reshape_q", "reshape", "shape_ok(",
          ("to have the shape that slice axis 2 [0:4) of self_attn/Reshape_q_output_0 implies",
           "[2, 6, 8, 2]", "[2, 6, 8, 4]"),
          {"value_view": ("flat_layout(",)},
          twins=("attn_tp2",)),
    # class 14: an extra 1/2 on the activation: the MatMul carries it (rules/scales.lp), the all-reduce
    # holds half the sequential sum on each rank, and each rank adds the whole bias to its half
    Cause("mlp_extra_scale", "mlp.down_proj/Add", "partial_add_partial", "inrel(",
          ("input 0 of r0's mlp.down_proj/Add", "mlp.down_proj/AllReduce_output_0", "but it is 1/2 x replica"),
          {"partial_add_share": ("1/2 x replica",)},
          twins=("mlp_tp2",)),
]


@pytest.mark.parametrize("cause", BUNDLED, ids=lambda c: c.name)
def test_bundled_bug_names_node_and_cause(cause):
    report = example_report(cause.name)
    assert report.verdict == "refuted"
    assert_cause(report, cause)


@pytest.mark.parametrize("twin", sorted({t for c in BUNDLED for t in c.twins}))
def test_bundled_twin_verifies(twin):
    report = example_report(twin)
    assert report.verdict == "verified" and report.failure is None


# --- layered models: the failure inside a memoized layer is explained from the layer's facts ----

LAYERED = [
    # b2 added before the all-reduce on every rank: the all-reduced sum relates to nothing
    Cause("bias_every_rank", "layers.2/residual", "partial_add_partial", "inrel(",
          ("input 0 of r0's layers.2/residual", "layers.1.out", "but it is a replica"),
          {"partial_add_once": ("input 1 (layers.2/summed) relates to no layout of layers.2/down_b",
                                "layers.2/allreduce, dist.AllReduce")}),
    # the partial sum scaled by 1/TP before the all-reduce: the sum is half of it, plus b2
    Cause("extra_scale", "layers.2/residual", "partial_add_partial", "inrel(",
          ("input 0 of r1's layers.2/residual", "layers.1.out", "but it is a replica"),
          {"partial_add_once": ("input 1 (layers.2/down_b) relates to no layout of layers.2/down_b",)}),
]


@pytest.fixture(scope="module")
def layered_dir(tmp_path_factory) -> Callable[[str | None], Path]:
    out = tmp_path_factory.mktemp("layered")

    def make(bug: str | None) -> Path:
        d = out / (bug or "correct")
        return d if d.is_dir() else layered.write(d, 4, 2, bug, 2)

    return make


# what the plain words must say of each layered bug, with and without memoization: the pattern,
# the class and the rank-side node (the first failing node itself may lie a layer further on:
# the ranks' sum can still rebuild a layer's output as the pieces of another decomposition, and
# memoization sees one layer at a time)
LAYERED_WORDS = {
    "bias_every_rank": ("replica_before_allreduce", 3, "layers.2/down_bias"),
    "extra_scale": ("extra_factor", 14, "layers.2/scale"),
}


@pytest.mark.parametrize("memo", [True, False], ids=["memo", "flat"])
@pytest.mark.parametrize("cause", LAYERED, ids=lambda c: c.name)
def test_layered_bug_names_node_and_cause(layered_dir, cause, memo):
    report = verify_dir(layered_dir(cause.name), memo=memo, simulate=False)
    pattern, bug_class, fragment = LAYERED_WORDS[cause.name]
    assert report.diagnosis is not None, render_text(report)
    assert (report.diagnosis.pattern, report.diagnosis.bug_class) == (pattern, bug_class), render_text(report)
    assert fragment in report.diagnosis.summary, report.diagnosis.summary
    assert report.failure is not None and report.failure.node.startswith(("layers.2/", "layers.3/")), render_text(report)
    if memo:  # (the layer's own facts explain it: the closest lemma at the node)
        assert_cause(report, cause)


def test_layered_twin_verifies(layered_dir):
    assert verify_dir(layered_dir(None), simulate=False).verdict == "verified"


# --- the closest lemma is an explanation, never a verdict ---------------------------------------


def atan_facts(x_layout: dict, local: int) -> FactSet:
    """y = Atan(x) on both sides, x [2, 4] held as `x_layout` ([2, local] on each rank)."""
    seq = Graph()
    seq.output(seq.op("Atan", seq.input("x", [2, 4])))
    ranks = []
    for _ in range(2):
        g = Graph()
        g.output(g.op("Atan", g.input("x", [2, local])))
        ranks.append(g)
    dist.register_schemas()
    return lower_models(Case("atan", seq, ranks, {"x": x_layout}).loaded())


@pytest.fixture
def atan_rules(tmp_path) -> Path:
    """A user's lemmas: one for Atan that wants x replicated, one about another op (Asin)."""
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "atan.lp").write_text(
        'handles("Atan", "atan.lp"). handles("Asin", "atan.lp").\n'
        'rel_by(So, To, rep, atan_rep) :- pair(N, M, _), op(N, "Atan"), inrel(N, M, 0, rep), pout(N, M, 0, So, To).\n'
        'rel_by(So, To, L, asin_any) :- op(N, "Asin"), pair(N, M, _), inrel(N, M, 0, L), pout(N, M, 0, So, To).\n')
    return rules


def test_closest_user_lemma_and_op_filter(atan_rules):
    facts = atan_facts(shard(1), 2)
    report = build_report("atan", facts, solve(facts, [atan_rules]), rule_dirs=[atan_rules])
    closest = report.failure.closest
    assert closest is not None and closest.rule == "atan_rep" and closest.file.endswith("atan.lp")
    assert closest.missing.startswith('inrel("') and closest.missing.endswith(",0,rep)")
    assert "input 0 of r0's" in closest.words and "but it is slice axis 1 [0:2)" in closest.words
    # a lemma about another op is never near, however much of its body would hold
    assert "asin_any" not in {o.rule for o in closest.others}


def test_closest_lemma_of_a_run_reads_the_users_rules(atan_rules):
    """`refine run/verify --rules DIR` solve with the user's lemmas, so the closest lemma is
    searched among them too (the pipeline hands its rule dirs to the report)."""
    report = run_facts(atan_facts(shard(1), 2), "atan", [atan_rules])
    assert report.failure is not None and report.failure.closest is not None
    assert report.failure.closest.rule == "atan_rep"


def test_closest_never_changes_the_report_otherwise(atan_rules):
    facts = atan_facts(shard(1), 2)
    derived = solve(facts, [atan_rules])
    with_closest = build_report("atan", facts, derived, rule_dirs=[atan_rules])
    without = build_report("atan", facts, derived, rule_dirs=[atan_rules], closest_lemma=False)
    assert with_closest.failure.closest is not None and without.failure.closest is None
    assert with_closest.model_dump(exclude={"failure": {"closest"}}) == without.model_dump(exclude={"failure": {"closest"}})


def test_the_harness_run_case_is_refine_cases_run_case_without_the_closest_lemma():
    """The witness tests' run_case (tests/harness.py) leaves out only the closest-lemma search:
    the same relations, the same numeric check and the same report otherwise as refine.kit.cases'
    (on a row-parallel MatMul whose partial sums reach a Relu without their all-reduce)."""
    import harness
    from refine.kit import cases

    seq = Graph()
    seq.output(seq.op("Relu", seq.op("MatMul", seq.input("x", [2, 4]), seq.input("w", [4, 3]))))
    ranks = []
    for _ in range(2):
        g = Graph()
        g.output(g.op("Relu", g.op("MatMul", g.input("x", [2, 2]), g.input("w", [2, 3]))))
        ranks.append(g)
    case = Case("row_parallel_unreduced", seq, ranks, {"x": shard(1), "w": shard(0)})
    ours, theirs = harness.run_case(case, 3), cases.run_case(case, 3)
    assert ours.report.verdict == theirs.report.verdict == "unproven"
    assert theirs.report.failure.closest is not None and ours.report.failure.closest is None
    clock = {"run_seconds": True, "lower_seconds": True}
    apart = {"failure": {"closest"}, **clock}
    assert ours.report.model_dump(exclude=apart) == theirs.report.model_dump(exclude=apart)
    assert sorted(map(str, ours.derived.get("rel"))) == sorted(map(str, theirs.derived.get("rel")))
    assert (ours.checked.ok, ours.checked.lemmas_checked) == (theirs.checked.ok, theirs.checked.lemmas_checked)
    again = harness.run_case(case, 3, closest_lemma=True).report
    assert again.model_dump(exclude=clock) == theirs.report.model_dump(exclude=clock)


def test_no_lemma_for_the_op_means_no_closest():
    facts = atan_facts(rep(), 4)
    report = build_report("atan", facts, solve(facts))
    assert report.failure.op == "Atan" and report.failure.closest is None
    assert "closest lemma" not in render_text(report)


# --- Megatron blocks exported from PyTorch: classes 1, 6 and the vocab-parallel embedding -------

MEGATRON = [
    # class 1 in a residual block: o_proj's partial sums added to the replicated residual
    Cause("attn_missing_allreduce", "Add", "partial_add_share", "inrel(",
          ("input 0 of r1's Add", "examples/megatron.py:", "but it is a replica"),
          {"partial_add_once": ("is partial sum, piece [8:16) of 16",)},
          twins=("attn_nobias",)),
    # class 6: [Q|K|V] cut as a plain column shard: no rank computes k's transpose any more
    Cause("attn_fused_qkv", "Transpose_4", "transpose", "pair(",
          ("a rank node computing Transpose", "no rank node does")),
    # the vocab-parallel embedding's owned range off by one, or the foreign ids never masked:
    # the rank's local ids are not the window of ids the lemma needs (they are ids masked to
    # the rows [1, 12): the off-by-one shows in the words)
    Cause("embed_off_by_one", "embed/Gather", "gather", "0 < 0", ("`A < Ga`", "here `0 < 0`"),
          {"vocab_parallel_gather": ("input 1 of r0's embed/Gather", "wnd(0,12,F)",
                                     "rows whose id (ids) is in [1:12), 0 elsewhere")},
          twins=("embed",)),
    # ... and with nothing zeroing the foreign rows, no row mask of the ids meets the rank's rows
    Cause("embed_unmasked", "embed/Gather", "gather", "0 < 0", ("`A < Ga`", "here `0 < 0`"),
          {"vocab_parallel_gather": ("`row_mask(G,Mb,Ids,X,Y,P)` of rules/embedding.lp:", 'row_mask(r0,Mb,"ids",0,12,P)')},
          twins=("embed",)),
]


@pytest.fixture(scope="module")
def megatron(megatron_export) -> Callable[[str], Path]:
    """name -> the examples/megatron.py block exported at TP 2 (conftest.megatron_export: shared
    with tests/test_real_bugs.py)."""
    return lambda name: megatron_export(name)[0]


@pytest.mark.parametrize("cause", MEGATRON, ids=lambda c: c.name)
def test_megatron_bug_names_node_and_cause(megatron, cause):
    assert_cause(verify_dir(megatron(cause.name), simulate=False), cause)


@pytest.mark.parametrize("twin", sorted({t for c in MEGATRON for t in c.twins}))
def test_megatron_twin_verifies(megatron, twin):
    assert verify_dir(megatron(twin), simulate=False).verdict == "verified"
