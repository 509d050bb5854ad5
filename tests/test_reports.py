"""Failure reports a person can act on: three honest verdicts (refuted only with a numeric
witness), where and why, --explain, and the output formats (text, JSON + schema, JUnit, HTML)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest

from conftest import REPO
from harness import Case, Graph, rep
from refine.diagnose import counterexample
from refine import dist
from refine.config import load_config
from refine.run.engine import solve
from refine.pipeline import FACTS_ONLY, verify_dir
from refine.report.render import render_html, render_junit, render_text
from refine.diagnose.diagnosis import build_report
from refine.report.schema import Report
from harness import SWEEP, example_report, invoke  # noqa: E402

EXAMPLES = REPO / "examples"
ALL = sorted(p.name for p in EXAMPLES.iterdir() if (p / "refine.json").is_file())
BUGGY = [n for n in ALL if load_config(EXAMPLES / n).expect.node is not None]
CORRECT = [n for n in ALL if n not in BUGGY]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def write_case(case: Case, root: Path) -> Path:
    """A harness case as a model directory (seq.onnx, rank*.onnx, refine.json)."""
    d = root / case.name
    d.mkdir()
    loaded = case.loaded()
    onnx.save(loaded.seq, str(d / "seq.onnx"))
    for r, model in enumerate(loaded.ranks):
        onnx.save(model, str(d / f"rank{r}.onnx"))
    (d / "refine.json").write_text(json.dumps({"world_size": len(case.ranks), "inputs": case.inputs}))
    return d


def atan_case() -> Case:
    """y = Atan(x) on both sides, x replicated: correct, but no lemma handles Atan."""
    seq = Graph()
    seq.output(seq.op("Atan", seq.input("x", [2, 4])))
    ranks = []
    for _ in range(2):
        g = Graph()
        g.output(g.op("Atan", g.input("x", [2, 4])))
        ranks.append(g)
    return Case("atan_both_sides", seq, ranks, {"x": rep()})


def mismatched_collective_case() -> Case:
    """Rank 0 all-reduces with max, rank 1 with min: the call is mismatched (a real job fails)."""
    seq = Graph()
    seq.output(seq.op("Relu", seq.input("x", [2, 4])))
    ranks = []
    for r, op in enumerate(["max", "min"]):
        g = Graph()
        g.output(g.coll("AllReduce", g.op("Relu", g.input("x", [2, 4])), [0, 1], reduce_op=op))
        ranks.append(g)
    return Case("mismatched_allreduce", seq, ranks, {"x": rep()})


# --- verdicts --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUGGY)
def test_buggy_example_is_refuted_with_numbers(name):
    expect = load_config(EXAMPLES / name).expect
    report = example_report(name)
    assert report.verdict == "refuted", render_text(report)
    assert report.exit_code == 1
    num = report.numeric
    assert num is not None and num.status == "counterexample", num
    assert num.output is not None and not num.output.matches
    # a declared output layout is the one candidate tried (refine/diagnose/counterexample.py)
    assert num.output.candidates_tried >= 1
    if num.output.best is None:  # the ranks' outputs do not even have the declared shape
        assert "no candidate" in num.output.note
    else:
        assert num.output.best.max_abs_error > num.tolerance and num.output.coordinates
    assert report.failure is not None and report.failure.node == expect.node
    assert num.at_node is not None and num.at_node.seq_node == expect.node
    assert num.at_node.best is not None and not num.at_node.matches
    assert num.at_node.best.max_abs_error > num.tolerance
    text = render_text(report)
    assert "REFUTED" in text and expect.node in text and "max abs error" in text


@pytest.mark.parametrize("name", CORRECT)
def test_correct_example_stays_verified(name):
    report = example_report(name)
    assert report.verdict == "verified"
    assert report.failure is None and report.numeric is None


def test_numbers_agree_means_unproven_not_refuted(tmp_path):
    d = write_case(atan_case(), tmp_path)
    report = verify_dir(d)
    assert report.verdict == "unproven", render_text(report)
    assert report.numeric is not None and report.numeric.status == "agrees"
    assert "no lemma applies" in report.numeric.summary and "not a known bug" in report.numeric.summary
    assert report.failure is not None and report.failure.op == "Atan"
    assert "REFUTED" not in render_text(report) and "counterexample" not in render_text(report)


def test_mismatched_collective_is_refuted(tmp_path):
    d = write_case(mismatched_collective_case(), tmp_path)
    report = verify_dir(d)
    assert report.verdict == "refuted", render_text(report)
    assert report.numeric is not None and report.numeric.status == "program_error"
    assert report.numeric.simulation_error.startswith("mismatched collective")
    assert report.collective_mismatches
    calls = report.failure.collectives
    assert calls and not calls[0].matched and calls[0].group == [0, 1]
    assert [m.rank for m in calls[0].members] == [0, 1] and all(m.node for m in calls[0].members)


def test_mismatch_with_undeclared_input_is_not_a_counterexample(tmp_path):
    """A rank input with no declared relation gets made-up values: a mismatch proves nothing."""
    seq = Graph()
    seq.output(seq.op("Relu", seq.input("x", [2, 4])))
    ranks = []
    for _ in range(2):
        g = Graph()
        g.output(g.op("Add", g.op("Relu", g.input("x", [2, 4])), g.input("noise", [2, 4])))
        ranks.append(g)
    report = verify_dir(write_case(Case("free_input", seq, ranks, {"x": rep()}), tmp_path))
    assert report.verdict == "unproven"
    assert report.numeric.status == "inconclusive" and "noise" in report.numeric.summary


def test_simulation_limits_are_not_counterexamples():
    assert counterexample._is_program_error("mismatched collective: call #0 on group [0, 1]: ...")
    assert counterexample._is_program_error("deadlock: rank 0 waits in AllReduce call #0 on group [0, 1] for rank 1 (finished)")
    assert not counterexample._is_program_error("deadlock: timed out after 20 s: rank 0 waits ...")
    assert not counterexample._is_program_error("rank 1 failed: RuntimeError: no kernel for op Foo")
    assert not counterexample._is_program_error("sequential model failed: ValueError: ...")


def test_no_simulate_and_run_facts_stay_unproven(tmp_path):
    name = "mlp_bias_before_allreduce"
    out = tmp_path / "v.json"
    result = invoke("verify", EXAMPLES / name, "--no-simulate", "--json", out)
    assert result.exit_code == 3 and "UNPROVEN" in result.stdout
    report = json.loads(out.read_text())
    assert report["verdict"] == "unproven" and report["numeric"]["status"] == "not_run"
    facts = tmp_path / "facts"
    assert invoke("lower", EXAMPLES / name, "--out", facts).exit_code == 0
    ran = invoke("run", "--facts", facts, "--json", tmp_path / "r.json")
    assert ran.exit_code == 3 and "UNPROVEN" in ran.stdout and "no ONNX" in ran.stdout
    assert json.loads((tmp_path / "r.json").read_text())["numeric"]["summary"] == FACTS_ONLY


# --- where and why ---------------------------------------------------------------------------


def test_collective_failure_names_group_and_calls():
    report = example_report("mlp_wrong_collective")
    calls = report.failure.collectives
    assert len(calls) == 1 and calls[0].kind == "AllGather" and calls[0].group == [0, 1] and calls[0].matched
    assert [(m.rank, m.node) for m in calls[0].members] == [(0, "mlp.down_proj/AllGather"), (1, "mlp.down_proj/AllGather")]
    assert all(m.location.file == "examples/build.py" and m.input_relation.startswith("partial sum") for m in calls[0].members)
    assert "collective: AllGather call #0 on group [0, 1]" in render_text(report)


def test_other_failures_are_counted_by_op_and_cause():
    """A big model's report shows the first failure in full and counts the rest."""
    seq, ranks = Graph(), [Graph(), Graph()]
    for g in [seq, *ranks]:
        x = g.input("x", [2, 4])
        for _ in range(30):
            g.output(g.op("Atan", x))
    case = Case("many_atan", seq, ranks, {"x": rep()})
    dist.register_schemas()
    from refine.lowering.graphs import lower_models

    facts = lower_models(case.loaded())
    report = build_report("many_atan", facts, solve(facts))
    assert report.other_failures == 29
    assert [(g.op, g.count) for g in report.other_failure_groups] == [("Atan", 29)]
    assert len(report.other_failure_groups[0].nodes) == 5
    text = render_text(report)
    assert "29 x Atan: no lemma handles op Atan" in text
    assert text.count("first failure") == 1 and text.count("why:") == 1
    assert "... 22 more outputs: 0 rebuilt, 22 NOT rebuilt" in text
    assert len(text.splitlines()) <= 20, text


# --- --explain ---------------------------------------------------------------------------------


def test_explain_names_lemmas_back_to_inputs():
    result = invoke("verify", EXAMPLES / "mlp_tp2", "--explain", "y")
    assert result.exit_code == 0
    text = result.stdout[result.stdout.index("explain y"):]
    for lemma in ("allreduce_sum", "matmul_row_parallel", "matmul_column_parallel", "elementwise", "declared"):
        assert f"by {lemma}" in text, text
    steps = text.splitlines()[1:]
    assert steps[0].strip().startswith("y ~ r0:y as replica by elementwise")
    assert "mlp.down_proj/AllReduce" in text and "examples/build.py:" in text
    # the chain ends at declared graph inputs
    assert {"x", "mlp.up_proj.weight", "mlp.down_proj.weight"} <= {
        line.split()[0] for line in steps if "declared in refine.json" in line}


def test_explain_in_run_and_json(tmp_path):
    facts = tmp_path / "facts"
    assert invoke("lower", EXAMPLES / "mlp_tp2", "--out", facts).exit_code == 0
    ran = invoke("run", "--facts", facts, "--explain", "y", "--json", tmp_path / "r.json")
    assert ran.exit_code == 0 and "by allreduce_sum" in ran.stdout
    ex = json.loads((tmp_path / "r.json").read_text())["explanation"]
    assert ex["output"] == "y" and ex["rebuilt"] and ex["steps"][0]["depth"] == 0
    assert {"allreduce_sum", "matmul_row_parallel"} <= {lm for s in ex["steps"] for lm in s["lemmas"]}


def test_explain_unknown_output_is_a_usage_error():
    result = invoke("verify", EXAMPLES / "mlp_tp2", "--explain", "nope")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"refine: error: {EXAMPLES / 'mlp_tp2'}: --explain: the sequential model has no output 'nope' (outputs: y)"]


# --- formats -----------------------------------------------------------------------------------


def test_text_is_plain_without_a_tty():
    result = invoke("verify", EXAMPLES / "mlp_bias_before_allreduce")
    assert "\x1b[" not in result.stdout
    assert result.stdout.splitlines()[0].startswith("mlp_bias_before_allreduce: REFUTED")


def test_json_schema_is_published():
    published = json.loads((REPO / "docs" / "report.schema.json").read_text())
    assert published == Report.model_json_schema(), "regenerate docs/report.schema.json from Report.model_json_schema()"


def test_json_report_round_trips(tmp_path):
    out = tmp_path / "r.json"
    assert invoke("verify", EXAMPLES / "mlp_extra_scale", "--json", out).exit_code == 1
    data = json.loads(out.read_text())
    report = Report.model_validate(data)
    assert report.verdict == "refuted" and report.numeric.status == "counterexample"
    assert data["numeric"]["at_node"]["seq_node"] == "mlp.down_proj/Add"


def test_junit(tmp_path):
    bad, good = tmp_path / "bad.xml", tmp_path / "good.xml"
    assert invoke("verify", EXAMPLES / "mlp_bias_before_allreduce", "--junit", bad).exit_code == 1
    assert invoke("verify", EXAMPLES / "mlp_tp2", "--junit", good).exit_code == 0
    suite = ET.parse(bad).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == "1" and suite.get("failures") == "1"
    (case,) = suite.findall("testcase")
    assert case.get("name") == "y"
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "refuted"
    assert "no reconstruction of output y" in failure.get("message")
    assert "mlp.down_proj/Add" in failure.text
    suite = ET.parse(good).getroot()
    assert suite.get("failures") == "0" and [c.get("name") for c in suite.findall("testcase")] == ["y"]
    assert suite.find("testcase/failure") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.xml", "good.xml"]  # no .tmp left


def test_junit_collective_only_failure(tmp_path):
    d = write_case(mismatched_collective_case(), tmp_path)
    suite = ET.fromstring(render_junit(verify_dir(d)))
    assert int(suite.get("failures")) >= 1
    messages = [f.get("message") for f in suite.iter("failure")]
    assert any("mismatched collective" in m or "cannot run together" in m for m in messages), messages


def test_html_is_self_contained(tmp_path):
    out = tmp_path / "r.html"
    assert invoke("verify", EXAMPLES / "mlp_bias_before_allreduce", "--html", out).exit_code == 1
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=|<link|@import|url\((?!#)""", page)
    assert 'class="node failing" data-node="mlp.down_proj/Add"' in page
    assert page.count('class="panel"') == 3  # seq + both ranks


def test_closest_lemma_in_every_format(tmp_path):
    """The closest lemma and its missing premise reach the text, JSON, JUnit and HTML reports."""
    paths = {fmt: tmp_path / f"r.{fmt}" for fmt in ("json", "xml", "html")}
    result = invoke("verify", EXAMPLES / "mlp_wrong_collective", "--json", paths["json"], "--junit", paths["xml"],
                    "--html", paths["html"], "--verbose")
    assert result.exit_code == 1
    assert "closest lemma" not in invoke("verify", EXAMPLES / "mlp_wrong_collective").stdout  # (internals: --verbose)
    closest = json.loads(paths["json"].read_text())["failure"]["closest"]
    assert closest["rule"] == "partial_add_partial" and closest["file"] == "rules/elementwise.lp"
    assert closest["missing"].startswith('inrel("mlp.down_proj/Add","r0:mlp.down_proj/Add",0,psum(')
    assert "mlp.down_proj/AllGather_output_0" in closest["words"] and closest["others"]
    head = f"closest lemma: partial_add_partial (rules/elementwise.lp:{closest['line']})"
    assert head in result.stdout and closest["words"] in result.stdout
    (message,) = [f.get("message") for f in ET.parse(paths["xml"]).getroot().iter("failure")]
    assert f"closest lemma partial_add_partial (rules/elementwise.lp:{closest['line']}) {closest['words']}" in message
    page = paths["html"].read_text()
    assert '<div class="closest" data-lemma="partial_add_partial">' in page
    assert html.escape(closest["missing"], quote=True) in page


def test_html_bad_path_fails_before_work(tmp_path):
    result = invoke("verify", EXAMPLES / "mlp_tp2", "--html", tmp_path / "no" / "r.html")
    assert result.exit_code == 2 and "--html" not in result.stdout
    assert result.stderr.startswith(f"refine: error: {tmp_path / 'no' / 'r.html'}: ")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_html_marks_failing_node_in_browser(tmp_path):
    page = tmp_path / "r.html"
    page.write_text(render_html(example_report("mlp_bias_before_allreduce")))
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body is not None, dom[:500]
    assert 'data-rendered="1"' in body.group(0)  # the page's script ran after layout
    assert 'data-failing-node="mlp.down_proj/Add"' in body.group(0)
    assert 'data-failing-stroke="rgb(211, 47, 47)"' in body.group(0)  # computed style: red
    assert 'class="node failing" data-node="mlp.down_proj/Add"' in dom


# --- what is wrong, in plain words (refine/diagnose/plain.py) ---------------------------------------------------

PLAIN_WORDS = {  # bundled buggy example -> (pattern, docs/bugs.md class, words the diagnosis must hold)
    "mlp_missing_allreduce": ("missing_allreduce", 1, ["an all-reduce (sum) is missing after `mlp.down_proj/MatMul`",
                                                       "examples/build.py:177", "partial sums"]),
    "mlp_bias_before_allreduce": ("replica_before_allreduce", 3, ["`mlp.down_proj.bias` is added on every rank before "
                                                                  "the all-reduce", "examples/build.py:192", "counts it 2 times"]),
    "mlp_wrong_collective": ("wrong_collective", 2, ["partial sums", "an all-gather (`mlp.down_proj/AllGather`",
                                                     "need an all-reduce (sum)"]),
    "mlp_extra_scale": ("extra_factor", 14, ["multiply `mlp.act_fn/Relu_output_0` by 1/2", "`mlp.act_fn/Mul`",
                                             "examples/build.py:176"]),
    "attn_reshape_moves_shard": ("reshape_moves_shard", 8, ["moves the sharded axis", "[2, 6, 8, 2]", "[2, 6, 8, 4]",
                                                            "dividing axis 2 instead (8 -> 4)"]),
}


@pytest.mark.parametrize("name", sorted(PLAIN_WORDS))
def test_a_buggy_example_says_what_is_wrong_in_its_first_three_lines(name):
    """The report names the bug pattern, the rank-side node and its line, in words, right
    under the verdict (text and HTML); the correct twins say nothing of the kind."""
    pattern, bug_class, words = PLAIN_WORDS[name]
    report = example_report(name)
    assert report.verdict == "refuted" and report.diagnosis is not None
    assert (report.diagnosis.pattern, report.diagnosis.bug_class) == (pattern, bug_class), report.diagnosis
    head = "\n".join(render_text(report).splitlines()[:3])
    for w in words:
        assert w in head, (w, head)
    page = render_html(report)
    assert "What is wrong:" in page and html.escape(words[0], quote=False) in page
    # the rank-side culprit is drawn as such in every rank's excerpt
    assert page.count(f'class="node culprit" data-node="{html.escape(report.diagnosis.rank_node)}"') == 2


@pytest.mark.parametrize("name", ["mlp_tp2", "mlp_bias_rank0", "mlp_bias_div_tp", "attn_tp2"])
def test_a_correct_twin_has_no_diagnosis(name):
    report = example_report(name)
    assert report.verdict == "verified" and report.diagnosis is None
    assert "what is wrong" not in render_text(report)


LAYERED_WORDS = {"bias_every_rank": ("replica_before_allreduce", "`layers.2.b2` is added on every rank"),
                 "missing_allreduce": ("missing_allreduce", "an all-reduce (sum) is missing after `layers.2/down_proj`"),
                 "extra_scale": ("extra_factor", "by 1/2 (`layers.2/scale`)")}


# (bias_every_rank and extra_scale under harness.SWEEP: REFINE_TEST_SWEEP=1, benchmarks/sweep.py;
# tests/test_causes.py diagnoses both in the same layered model, with and without memoization, by default)
@pytest.mark.parametrize("memo", [True, False])
@pytest.mark.parametrize("bug", [pytest.param(bug, marks=pytest.mark.skipif(
    not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): tests/test_causes.py diagnoses it by default"))
    if bug != "missing_allreduce" else bug for bug in sorted(LAYERED_WORDS)])
def test_a_bug_inside_a_layer_function_is_diagnosed_with_and_without_memoization(tmp_path, bug, memo):
    from test_lemmas_layers import layered

    d = layered.write(tmp_path / "m", 4, 2, bug, 2)
    report = verify_dir(d, memo=memo)
    pattern, words = LAYERED_WORDS[bug]
    assert report.diagnosis is not None and report.diagnosis.pattern == pattern, report.diagnosis
    assert words in report.diagnosis.summary


def test_html_edge_labels_are_whole_and_stay_in_their_column():
    """A long relation (and a long node name) is written out in full, wrapped at separators
    rather than cut off, with its whole text as a tooltip; the labels under a box stay in its
    column and above the next row."""
    from refine.report.schema import Failure, GraphEdge, GraphExcerpt, GraphNode

    layout = ("r0 psum[0:64)/128 of model.layers.0 (backward)/post_attention_layernorm (backward)/add_15, "
              "r1 psum[64:128)/128 of model.layers.0 (backward)/post_attention_layernorm (backward)/add_15, +6")
    name = "model.layers.0 (backward)/post_attention_layernorm (backward)/Add_2"
    excerpt = GraphExcerpt(graph="seq", rank=-1, nodes=[
        GraphNode(id="a", label=name, op="Add", role="failing"),
        GraphNode(id="b", label="model.layers.0/mlp.down_proj/MatMul", op="MatMul", role="context"),
        GraphNode(id="c", label="out", op="output", role="output")],
        edges=[GraphEdge(src="a", dst="c", tensor="model.layers.0 (backward)/add_15", layout=layout),
               GraphEdge(src="b", dst="c", tensor="model.layers.0/mm_6", layout="rep on r0..r1")])
    report = Report(model="m", verdict="refuted", world_size=2, relations=0, lower_seconds=0, run_seconds=0,
                    outputs=[], failure=Failure(node=name, op="Add", reason="r", neighbourhood=[excerpt]))
    svg = re.search(r"<svg.*?</svg>", render_html(report), re.S).group(0)
    assert "\u2026" not in svg  # nothing clipped
    labels = {html.unescape(t.group(2)): (float(t.group(1)), [html.unescape(x) for x in re.findall(r"<tspan[^>]*>([^<]*)</tspan>", t.group(0))])
              for t in re.finditer(r'<text class="elabel layout" x="[\d.]+" y="([\d.]+)">.*?<title>([^<]*)</title></text>', svg)}
    y, lines = labels[layout]  # the whole relation is the label's tooltip ...
    assert len(lines) > 1
    shown = ""
    for line in lines[:-1]:  # ... and its text, on lines broken at separators, never mid-token
        shown += line
        rest = layout[len(shown):]
        assert line[-1] in "/.," or rest.startswith(" "), (line, rest)
        shown += rest[: len(rest) - len(rest.lstrip(" "))]
    assert shown + lines[-1] == layout
    boxes = {html.unescape(m.group(1)): tuple(map(float, m.group(2, 3, 4, 5))) for m in re.finditer(
        r'data-node="([^"]*)".*?<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"/>', svg)}
    _, top, width, height = boxes[name]
    assert top + height < y and y + 11 * len(lines) < boxes["out"][1]  # under its box, above the next row
    assert max(len(line) for line in lines) * 5.4 <= width  # inside its column (9px text)
    node = re.search(rf'data-node="{re.escape(html.escape(name, quote=True))}".*?</g>', svg).group(0)
    assert "".join(re.findall(r"<tspan[^>]*>([^<]*)</tspan>", node)).replace(" ", "") == name.replace(" ", "")


def test_rank_tensor_lists_print_as_ranges() -> None:
    """Reports at scale: a run of consecutive ranks holding the same-named tensor is one range;
    a gap, another name, or a label of another form breaks it (issue 17)."""
    from refine.report.render import rank_tensors_text

    many = [f"r{r}:y" for r in range(512)]
    assert rank_tensors_text(many) == "r0..r511:y"
    assert rank_tensors_text(["r0:y", "r1:y", "r3:y", "r4:z", "r5:z", "x@2"]) == "r0..r1:y, r3:y, r4..r5:z, x@2"
    assert rank_tensors_text(["r2:y", "r1:y"]) == "r2:y, r1:y"  # out of order stays as it is


@pytest.mark.parametrize("layout,words", [
    (("psum", 0, 64, 128, ("blocks", 128)), "piece [0:64) of 128 (blocks(128))"),
    (("psum", 0, 3, 6, ("owner", "seq:labels")), "piece [0:3) of 6 (owner(seq:labels))"),
    (("psum", 0, 2, 4, ("once", "seq:Add_3", "pure")), "piece [0:2) of 4 (once@Add_3)"),
    (("bc", 2, 64), "64 of the equal indices of broadcast axis 2"),
    (("own", 0, 64, 128, "seq:labels"), "rows whose id (labels) is in [0:64), anything elsewhere"),
    (("msk", 64, 128, "seq:input_ids"), "rows whose id (input_ids) is in [64:128), 0 elsewhere"),
])
def test_every_layout_and_partial_style_reads_as_words(layout: object, words: str) -> None:
    """Styles may hold numbers and tensor names (a layout term as the engine returns it); a
    mutant once crashed the report on `blocks(128)`."""
    from refine.layouts import text

    assert words in text(layout)


def test_groups_print_short_at_any_world_size() -> None:
    """A 512-rank group is one range, a mesh column a strided one; anything else as it is."""
    from refine.report.render import group_text
    from refine.diagnose.schedule import describe_group

    assert group_text(list(range(512))) == "[0..511]"
    assert group_text(list(range(3, 512, 8))) == "[3..507 step 8]"
    assert group_text([1, 0]) == "[1, 0]"
    assert group_text([0, 2, 1, 3]) == "[0, 2, 1, 3]"
    # a long group as its runs (a DP row of a 4-D mesh: 16 ranks of each of 16 stages)
    row = [r for stage in range(16) for r in range(stage * 1024, stage * 1024 + 16)]
    assert group_text(row) == "[0..15, 1024..1039, 2048..2063, 12 more runs, 15360..15375; 256 ranks]"
    assert group_text([0, 1, 4, 5] * 1 + list(range(8, 24))) == "[0..1, 4..5, 8..23; 20 ranks]"
    assert describe_group(",".join(map(str, range(64)))) == "group [0..63]"
    assert describe_group("p2p:3>7#2") == "the sends from rank 3 to rank 7 (tag 2)"
