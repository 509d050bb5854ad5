"""The command line on good input: verdicts and exit codes, lower + run = verify, --json, --rules."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from harness import invoke  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE_DIRS = sorted(p.name for p in EXAMPLES.iterdir() if (p / "refine.json").is_file())


def _verdict_part(report: dict) -> dict:
    """What must agree between two runs on the same facts (not the name or the timings)."""
    return {k: report[k] for k in ("verdict", "world_size", "outputs", "failure", "other_failures",
                                   "unrelated_inputs", "collective_mismatches", "sanity_violations", "relations")}


def test_verify_good_example():
    result = invoke("verify", EXAMPLES / "mlp_tp2")
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.stdout
    assert result.stderr == ""


def test_verify_buggy_example():
    result = invoke("verify", EXAMPLES / "mlp_bias_before_allreduce")
    assert result.exit_code == 1, result.output
    assert "VERIFIED" not in result.stdout
    assert "mlp.down_proj/Add" in result.stdout
    assert result.stderr == ""


@pytest.mark.parametrize("name", EXAMPLE_DIRS)
def test_examples_give_expected_verdict(name, tmp_path):
    expect = json.loads((EXAMPLES / name / "refine.json").read_text())["expect"]
    out = tmp_path / "report.json"
    result = invoke("verify", EXAMPLES / name, "--json", out)
    assert result.exit_code == (0 if expect["verdict"] == "verified" else 1), result.output
    report = json.loads(out.read_text())
    assert report["verdict"] == expect["verdict"]
    if expect.get("node"):
        assert report["failure"]["node"] == expect["node"]


@pytest.mark.parametrize("name", ["mlp_tp2", "mlp_bias_before_allreduce", "attn_tp2", "attn_reshape_moves_shard"])
def test_lower_then_run_matches_verify(name, tmp_path):
    facts = tmp_path / "facts"
    lowered = invoke("lower", EXAMPLES / name, "--out", facts)
    assert lowered.exit_code == 0, lowered.output
    assert facts.is_dir() and any(facts.glob("*.facts"))
    assert [p.name for p in tmp_path.iterdir()] == ["facts"]  # no temp dir left behind

    ran = invoke("run", "--facts", facts, "--json", tmp_path / "run.json")
    # run has no ONNX to simulate: compare it with verify's static part (--no-simulate)
    verified = invoke("verify", EXAMPLES / name, "--no-simulate", "--json", tmp_path / "verify.json")
    assert ran.exit_code == verified.exit_code
    first = lambda r: r.stdout.splitlines()[0].split(" (")[0].split(": ", 1)[1]  # noqa: E731
    assert first(ran) == first(verified)  # "VERIFIED" / "UNPROVEN"
    run_report = json.loads((tmp_path / "run.json").read_text())
    verify_report = json.loads((tmp_path / "verify.json").read_text())
    assert _verdict_part(run_report) == _verdict_part(verify_report)


def test_lower_replaces_previous_facts_dir(tmp_path):
    facts = tmp_path / "facts"
    assert invoke("lower", EXAMPLES / "mlp_tp8", "--out", facts).exit_code == 0
    assert invoke("lower", EXAMPLES / "mlp_tp2", "--out", facts).exit_code == 0
    assert (facts / "world_size.facts").read_text() == "2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["facts"]


def test_json_report(tmp_path):
    out = tmp_path / "report.json"
    result = invoke("verify", EXAMPLES / "mlp_bias_before_allreduce", "--json", out)
    assert result.exit_code == 1
    report = json.loads(out.read_text())
    assert {"verdict", "outputs", "failure"} <= report.keys()
    assert report["verdict"] == "refuted"
    assert report["outputs"] and report["outputs"][0]["name"] == "y" and report["outputs"][0]["ok"] is False
    assert report["failure"]["node"] == "mlp.down_proj/Add"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no .tmp left

    ok = tmp_path / "ok.json"
    assert invoke("verify", EXAMPLES / "mlp_tp2", "--json", ok).exit_code == 0
    report = json.loads(ok.read_text())
    assert report["verdict"] == "verified" and report["failure"] is None
    assert all(o["ok"] for o in report["outputs"])


# --- user lemma files (--rules) ------------------------------------------------------------


def _atan_model_dir(root: Path) -> Path:
    """y = Atan(x) on both sides, x replicated: correct, but no built-in lemma knows Atan."""
    d = root / "atan"
    d.mkdir()
    for name in ["seq", "rank0", "rank1"]:
        graph = helper.make_graph(
            [helper.make_node("Atan", ["x"], ["y"], name="atan")], name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        onnx.checker.check_model(model)
        onnx.save(model, str(d / f"{name}.onnx"))
    (d / "refine.json").write_text(json.dumps({"world_size": 2, "inputs": {"x": {"layout": "rep"}}}))
    return d


def test_user_rules_are_loaded(tmp_path):
    model = _atan_model_dir(tmp_path)
    without = invoke("verify", model, "--json", tmp_path / "without.json")
    assert without.exit_code == 3, without.output  # unproven
    assert "no lemma handles op Atan" in json.loads((tmp_path / "without.json").read_text())["failure"]["reason"]

    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "mine.lp").write_text('% Atan is elementwise: the built-in elementwise lemmas apply.\nelementwise("Atan").\n')
    with_rules = invoke("verify", model, "--rules", rules)
    assert with_rules.exit_code == 0, with_rules.output
    assert "VERIFIED" in with_rules.stdout

    facts = tmp_path / "facts"
    assert invoke("lower", model, "--out", facts).exit_code == 0
    assert invoke("run", "--facts", facts).exit_code == 3
    ran = invoke("run", "--facts", facts, "--rules", rules)
    assert ran.exit_code == 0 and "VERIFIED" in ran.stdout


def test_user_rules_harmless_fact(tmp_path):
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "mine.lp").write_text('handles("MyOp", "mine.lp").\nmine_seen(N) :- node(seq, N, "MatMul").\n')
    out = tmp_path / "r.json"
    result = invoke("verify", EXAMPLES / "mlp_tp2", "--rules", rules, "--json", out)
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.stdout
    assert json.loads(out.read_text())["verdict"] == "verified"


def test_user_rules_cannot_fake_unhandled_op_as_verified(tmp_path):
    """Declaring that a file handles an op only changes the report's pointer, not the verdict."""
    model = _atan_model_dir(tmp_path)
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "mine.lp").write_text('handles("Atan", "mine.lp").\n')
    out = tmp_path / "r.json"
    result = invoke("verify", model, "--rules", rules, "--json", out)
    assert result.exit_code == 3  # unproven
    assert json.loads(out.read_text())["failure"]["rules_file"] == "mine.lp"


def test_several_rules_dirs(tmp_path):
    model = _atan_model_dir(tmp_path)
    for sub, text in [("a", 'elementwise("Atan").\n'), ("b", 'handles("MyOp", "b.lp").\n')]:
        (tmp_path / sub).mkdir()
        (tmp_path / sub / f"{sub}.lp").write_text(text)
    result = invoke("verify", model, "--rules", tmp_path / "a", "--rules", tmp_path / "b")
    assert result.exit_code == 0, result.output


# --- help ----------------------------------------------------------------------------------


def test_help_lists_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("lower", "run", "verify"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["lower", "run", "verify"])
def test_command_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Usage" in result.stdout


def test_version_help_and_exit_codes_speak_to_users():
    """`--version`; `--help` says what refine does and what each exit code means (no
    developer notes); the exit code tells refuted (1) from unproven (3)."""
    import refine

    version = invoke("--version")
    assert version.exit_code == 0 and version.stdout.strip() == f"refine {refine.__version__}"
    text = invoke("--help").stdout
    assert "Thin" not in text and "3 unproven" in text and "1 refuted" in text
    assert "mixtral" in invoke("export", "--help").stdout
    assert invoke("verify", EXAMPLES / "mlp_bias_before_allreduce").exit_code == 1
    assert invoke("verify", EXAMPLES / "mlp_bias_before_allreduce", "--no-simulate").exit_code == 3


def test_zoo_list_needs_no_out_dir_and_export_does():
    listed = invoke("zoo", "--list", "--models", "llama", "--tp", "2", "--plans", "tp")
    assert listed.exit_code == 0 and "llama_tp2\tverified" in listed.stdout, listed.output
    missing = invoke("zoo", "--models", "llama")
    assert missing.exit_code == 2 and "--out" in missing.stderr


@pytest.mark.parametrize("args,words", [
    (["--framework", "nope"], "unknown framework 'nope'"),
    (["--framework", "megatron-core", "--model", "llama"], "drop --model"),
    (["--framework", "megatron-core", "--config", "tiny-llama", "--tp", "3"], "query groups 2 neither a multiple nor a divisor of --tp 3"),
    (["--framework", "megatron-core", "--config", "nope"], "unknown megatron-core config 'nope'"),
    ([], "Missing option '--model'"),
    (["--model", "llama", "--bug", "missing_allreduce"], "refine zoo --bugs"),
    (["--framework", "megatron-core", "--bug", "nope"], "unknown megatron-core bug 'nope'"),
    (["--framework", "megatron-core", "--bug", "glu_stride_1"], "needs a llama-style config"),
    (["--framework", "megatron-core", "--sp", "--bug", "sp_norm_grad_unreduced"], "(--sp --train)"),
])
def test_export_framework_arguments_are_checked_before_any_import(tmp_path, args, words):
    """Bad --framework arguments: one line, exit 2, nothing written (no torch or Megatron needed)."""
    result = invoke("export", *args, "--out", tmp_path / "d")
    assert result.exit_code == 2 and words in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_plain_progress_prints_one_line_per_step_on_stderr():
    """--progress plain, for logs: a line per step (lowering, solving) on stderr, the report
    alone on stdout; --quiet prints none."""
    plain = invoke("verify", EXAMPLES / "mlp_tp2", "--progress", "plain")
    steps = [line for line in plain.stderr.splitlines() if line.startswith("refine: [")]
    assert plain.exit_code == 0 and any("lowering" in line for line in steps) and any("solving" in line for line in steps)
    assert "refine: [" not in plain.stdout
    assert "refine: [" not in invoke("verify", EXAMPLES / "mlp_tp2", "--progress", "plain", "--quiet").stderr


def test_python_api_verify_returns_the_report(tmp_path):
    """`refine.verify(path)`: the report --json writes; bad input raises InputError."""
    import refine
    from refine.errors import InputError

    assert refine.verify(EXAMPLES / "mlp_tp2").verdict == "verified"
    assert refine.verify(str(EXAMPLES / "mlp_bias_before_allreduce"), simulate=False).verdict == "unproven"
    with pytest.raises(InputError, match="missing"):
        refine.verify(tmp_path / "missing")
