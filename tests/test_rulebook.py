"""The rule authors' kit: `refine rules list`, `refine rules coverage`, `refine batch --coverage`
and the typo warning for user rule files (refine/kit/rulebook.py, refine/cli/rules.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from harness import invoke
from refine.kit import rulebook
from refine.run.engine import builtin_rules_dir, ground_rules

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

USER_RULE = """% Shrink is elementwise, so it keeps any layout:  shrink(S[sl on A]) = shrink(S)[sl on A]
rel_by(So, To, L, my_shrink) :-
    pair(N, M, _), op(N, "Shrink"), inrel(N, M, 0, L), pout(N, M, 0, So, To).
"""
TYPO_RULE = """% a lemma with a typo in its body
rel_by(So, To, rep, typo_lemma) :-
    pairr(N, M, G), op(N, "Shrink"), inrel(N, M, 0, rep), pout(N, M, 0, So, To).
"""


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _rules_dir(tmp_path: Path, text: str, name: str = "mine.lp") -> Path:
    d = tmp_path / "rules"
    d.mkdir(exist_ok=True)
    (d / name).write_text(text)
    return d


def _shrink_model(path: Path, in_function: bool = False) -> Path:
    """A tiny valid model with a Shrink (no rule file handles it), optionally inside a local function."""
    axis = helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("a", TensorProto.INT64, [], [0]))
    body = [axis, helper.make_node("Shrink", ["x"], ["c"], lambd=0.5), helper.make_node("Relu", ["c"], ["y"])]
    opsets = [helper.make_opsetid("", 18)]
    functions = []
    if in_function:
        functions = [helper.make_function("local", "Block", ["x"], ["y"], body, opsets)]
        body = [helper.make_node("Block", ["x"], ["y"], domain="local")]
        opsets.append(helper.make_opsetid("local", 1))
    graph = helper.make_graph(body, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    onnx.save(helper.make_model(graph, opset_imports=opsets, functions=functions), str(path))
    return path


# --- rules list ----------------------------------------------------------------------------------


def test_list_op_softmax_answers_where_the_softmax_lemma_is():
    result = invoke("rules", "list", "--op", "Softmax")
    assert result.exit_code == 0, result.output
    line = _line_of(builtin_rules_dir() / "reduce.lp", "rel_by(So, To, rep, softmax)")
    assert f"reduce.lp:{line}  softmax" in result.stdout
    assert "softmax(S[sl on A]) = softmax(S)[sl on A]" in result.stdout  # the identity, from its comment
    assert result.stderr == ""


def test_list_op_filters_and_json_is_the_model():
    everything = json.loads(invoke("rules", "list", "--json").stdout)
    only = json.loads(invoke("rules", "list", "--op", "matmul", "--json").stdout)
    assert 0 < len(only["lemmas"]) < len(everything["lemmas"])
    assert all("MatMul" in lemma["ops"] for lemma in only["lemmas"])
    assert {"matmul_rep", "matmul_column_parallel", "matmul_row_parallel"} <= {x["name"] for x in only["lemmas"]}
    assert "softmax" not in {x["name"] for x in only["lemmas"]}
    reduce_file = next(x for x in everything["lemmas"] if x["name"] == "reduce_sum_sharded")
    assert reduce_file["ops"] == ["ReduceSum"] and reduce_file["ops_from"] == "body"
    assert not any(x["user"] for x in everything["lemmas"])
    assert rulebook.Inventory.model_validate(everything).lemmas


def test_list_op_without_lemma_exits_1():
    result = invoke("rules", "list", "--op", "Shrink")
    assert result.exit_code == 1
    assert "no lemma for op Shrink" in result.stdout


def test_list_shows_the_users_rules(tmp_path):
    rules = _rules_dir(tmp_path, USER_RULE)
    result = invoke("rules", "list", "--op", "Shrink", "--rules", rules)
    assert result.exit_code == 0, result.output
    assert f"{rules / 'mine.lp'}:2  my_shrink  [Shrink]" in result.stdout
    assert "shrink(S[sl on A]) = shrink(S)[sl on A]" in result.stdout
    assert "(1 from --rules)" in result.stdout
    assert result.stderr == ""  # no typo: no warning
    data = json.loads(invoke("rules", "list", "--op", "Shrink", "--rules", rules, "--json").stdout)
    assert [(x["name"], x["user"], x["line"]) for x in data["lemmas"]] == [("my_shrink", True, 2)]


def test_list_bad_rules_is_one_line(tmp_path):
    rules = _rules_dir(tmp_path, "rel_by(X :- .\n", "broken.lp")
    result = invoke("rules", "list", "--rules", rules)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "broken.lp" in result.stderr


# --- coverage ------------------------------------------------------------------------------------


def test_coverage_of_a_bundled_example_is_complete():
    result = invoke("rules", "coverage", EXAMPLES / "mlp_tp2")
    assert result.exit_code == 0, result.output
    assert "every op is handled by some rule file" in result.stdout
    assert "handled: 4 of 4 op types" in result.stdout
    data = json.loads(invoke("rules", "coverage", EXAMPLES / "mlp_tp2", "--json").stdout)
    assert {c["op"] for c in data["handled"]} >= {"MatMul", "dist.AllReduce"} and data["unhandled"] == []


@pytest.mark.parametrize("in_function", [False, True], ids=["graph", "local_function"])
def test_coverage_lists_an_op_no_rule_handles(tmp_path, in_function):
    model = _shrink_model(tmp_path / "m.onnx", in_function)
    result = invoke("rules", "coverage", model)
    assert result.exit_code == 0, result.output
    assert "ops no rule file handles" in result.stdout
    assert "1  Shrink" in result.stdout
    assert "Block" not in result.stdout  # a call of a local function is not an op
    assert "handled: 2 of 3 op types (2 of 3 nodes)" in result.stdout  # Constant (lowering), Relu
    covered = invoke("rules", "coverage", model, "--rules", _rules_dir(tmp_path, USER_RULE))
    assert "every op is handled" in covered.stdout


def test_coverage_sorts_by_count(tmp_path):
    a, b = _shrink_model(tmp_path / "a.onnx"), _shrink_model(tmp_path / "b.onnx")
    cov = rulebook.coverage([a, b, EXAMPLES / "mlp_tp2"])
    assert [c.op for c in cov.unhandled] == ["Shrink"] and cov.unhandled[0].nodes == 2
    counts = [c.nodes for c in cov.handled]
    assert counts == sorted(counts, reverse=True)


def test_coverage_bad_input_is_one_line_exit_2(tmp_path):
    missing = invoke("rules", "coverage", tmp_path / "nope.onnx")
    assert missing.exit_code == 2 and missing.stderr == f"refine: error: {tmp_path / 'nope.onnx'}: missing\n"
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08garbage")
    bad = invoke("rules", "coverage", EXAMPLES / "mlp_tp2", corrupt)
    assert bad.exit_code == 2 and bad.stderr.startswith(f"refine: error: {corrupt}: not a readable ONNX model")
    assert bad.stderr.count("\n") == 1 and bad.stdout == ""
    no_dir = invoke("rules", "coverage", tmp_path / "nodir")
    assert no_dir.exit_code == 2 and "no such model directory" in no_dir.stderr


def test_batch_coverage_follows_the_table(tmp_path):
    root = tmp_path / "batch"
    shutil.copytree(EXAMPLES / "mlp_tp2", root / "mlp_tp2")
    result = invoke("batch", root, "--coverage", "--no-cache", "--jobs", "1", "--quiet")
    assert result.exit_code == 0, result.output
    table, _, coverage = result.stdout.partition("all as expected")
    assert "mlp_tp2" in table
    assert "every op is handled by some rule file" in coverage and "handled: 4 of 4 op types" in coverage


# --- the typo warning ----------------------------------------------------------------------------


def test_typo_in_a_user_rule_is_one_warning_naming_file_and_line(tmp_path):
    rules = _rules_dir(tmp_path, TYPO_RULE, "typo.lp")
    expected = f"refine: warning: {rules / 'typo.lp'}:3: pairr/3 is used in a rule body"
    listed = invoke("rules", "list", "--rules", rules)
    assert listed.exit_code == 0 and listed.stderr.startswith(expected) and listed.stderr.count("\n") == 1
    verified = invoke("verify", EXAMPLES / "mlp_tp2", "--rules", rules, "--quiet")
    assert verified.exit_code == 0, verified.output
    assert verified.stderr.count("pairr/3") == 1 and expected in verified.stderr


def test_bundled_rules_raise_no_undefined_atom():
    _ctl, undefined = ground_rules()
    assert undefined == []
    assert rulebook.typo_warnings(None) == []
