"""`refine batch`: every entry under a root verified in worker processes, cached, reported.

Entries are copies of bundled examples plus hand-made broken ones. Time and memory limits are
exercised with a test-only lemma file that is expensive only for an entry holding a Softsign
(a grounding that loops, in constant memory) or a Softplus (a grounding that keeps allocating),
so the other entries of the same batch show that the batch goes on.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from harness import invoke
from refine.batch import entries as batch_entries, local, verify_entry
from refine.errors import InputError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

SLOW_RULES = """% test only: expensive for entries holding a Softsign (time) or a Softplus (memory)
refine_test_p(1..3000) :- node(_, _, "Softsign").
refine_test_never :- refine_test_p(X), refine_test_p(Y), refine_test_p(Z), X + Y + Z < 0.
refine_test_big(X) :- node(_, _, "Softplus"), X = 1..200000000.
"""


def _unary_entry(root: Path, op: str) -> Path:
    """A world-size-2 entry whose seq and ranks are one replicated `op` (verifies, cheaply)."""
    d = root / f"act_{op.lower()}"
    d.mkdir(parents=True)
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="act")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    for name in ("seq.onnx", "rank0.onnx", "rank1.onnx"):
        onnx.save(model, str(d / name))
    (d / "refine.json").write_text(json.dumps({"world_size": 2, "inputs": {"x": {"layout": "rep"}}}))
    return d


@pytest.fixture
def zoo(tmp_path) -> Path:
    """A small root: a correct and a buggy example (nested one level), a corrupt entry, a hidden one."""
    root = tmp_path / "zoo"
    shutil.copytree(EXAMPLES / "mlp_tp2", root / "mlp_tp2")
    shutil.copytree(EXAMPLES / "mlp_missing_allreduce", root / "bugs" / "mlp_missing_allreduce")
    corrupt = shutil.copytree(EXAMPLES / "mlp_tp2", root / "corrupt")
    (corrupt / "rank1.onnx").write_bytes(b"\x08\x07this is not a protobuf")
    shutil.copytree(EXAMPLES / "mlp_tp2", root / ".hidden" / "skipped")
    return root


def _options(**kw) -> batch_entries.BatchOptions:
    return batch_entries.BatchOptions(**{"jobs": 2, "timeout": 120, **kw})


def _by_entry(report: batch_entries.BatchReport) -> dict[str, batch_entries.EntryResult]:
    return {e.entry: e for e in report.entries}


# --- discovery ---------------------------------------------------------------------------------


def test_find_entries_recurses_and_skips_hidden(zoo):
    names = [e.name for e in batch_entries.find_entries(zoo)]
    assert names == ["bugs/mlp_missing_allreduce", "corrupt", "mlp_tp2"]
    # the root itself can be an entry
    assert [e.name for e in batch_entries.find_entries(zoo / "mlp_tp2")] == ["mlp_tp2"]


def test_a_plain_model_inside_a_model_directory_belongs_to_that_entry(zoo):
    """With --plan, an .onnx file in a subdirectory of a model directory is one of that
    entry's files (its cache key hashes it), not a plain model of its own."""
    extra = zoo / "mlp_tp2" / "extras"
    extra.mkdir()
    shutil.copy(zoo / "mlp_tp2" / "seq.onnx", extra / "copy.onnx")
    shutil.copy(zoo / "mlp_tp2" / "seq.onnx", zoo / "plain.onnx")
    entries = {e.name: e for e in batch_entries.find_entries(zoo, plan_tp=2)}
    assert "mlp_tp2/extras/copy.onnx" not in entries and "plain.onnx" in entries
    assert "extras/copy.onnx" in {name for name, _ in verify_entry._entry_files(entries["mlp_tp2"])}


def test_find_entries_bad_roots(tmp_path):
    with pytest.raises(InputError, match="holds no entry"):
        batch_entries.find_entries(tmp_path)
    with pytest.raises(InputError, match="not a directory"):
        batch_entries.find_entries(tmp_path / "missing")


# --- one batch, every outcome --------------------------------------------------------------------


def test_batch_reports_each_entry_and_goes_on(zoo, tmp_path):
    out_json, out_xml = tmp_path / "r.json", tmp_path / "r.xml"
    result = invoke("batch", zoo, "--jobs", 2, "--json", out_json, "--junit", out_xml, "--cache-dir", tmp_path / "c")
    assert result.exit_code == 1, result.output  # the corrupt entry
    report = batch_entries.BatchReport.model_validate_json(out_json.read_text())
    got = _by_entry(report)
    assert set(got) == {"bugs/mlp_missing_allreduce", "corrupt", "mlp_tp2"}
    assert got["mlp_tp2"].status == "verified" and got["mlp_tp2"].ok and got["mlp_tp2"].report is not None
    bug = got["bugs/mlp_missing_allreduce"]
    # refine.json declares the bug: refuted at the named node is the expected outcome
    assert (bug.status, bug.expected, bug.failing_node, bug.ok) == ("refuted", "refuted", "mlp.down_proj/Add", True)
    assert bug.report.verdict == "refuted" and bug.report.failure.node == "mlp.down_proj/Add"
    bad = got["corrupt"]
    assert bad.status == "error" and not bad.ok and bad.report is None
    assert bad.error.startswith(str(zoo / "corrupt" / "rank1.onnx") + ":") and "\n" not in bad.error
    # the summary table names every entry, the verdict and the failing node / error
    assert "mlp.down_proj/Add" in result.stdout and "corrupt/rank1.onnx" in result.stdout
    assert "3 entries" in result.stdout and "1 not as expected" in result.stdout
    # JUnit: one testcase per entry; the corrupt one is an error carrying the one-line message
    suites = ET.parse(out_xml).getroot()
    cases = {c.get("name"): c for c in suites.iter("testcase")}
    assert set(cases) == set(got)
    assert suites.get("tests") == "3" and suites.get("errors") == "1" and suites.get("failures") == "0"
    assert cases["corrupt"].find("error").get("message").startswith("error: ")
    assert cases["mlp_tp2"].find("failure") is None and cases["mlp_tp2"].find("error") is None


def test_exit_code_zero_only_if_everything_matches_its_expectation(zoo, tmp_path):
    shutil.rmtree(zoo / "corrupt")
    cache = tmp_path / "c"
    assert invoke("batch", zoo, "--cache-dir", cache).exit_code == 0
    # a wrong expectation (a bug declared at another node) makes the batch fail
    config = zoo / "bugs" / "mlp_missing_allreduce" / "refine.json"
    data = json.loads(config.read_text())
    data["expect"]["node"] = "mlp.up_proj/MatMul"
    config.write_text(json.dumps(data))
    result = invoke("batch", zoo, "--cache-dir", cache)
    assert result.exit_code == 1
    # and a correct model declared buggy fails too
    data["expect"] = {"verdict": "refuted"}
    (zoo / "mlp_tp2" / "refine.json").write_text(json.dumps({**json.loads((zoo / "mlp_tp2" / "refine.json").read_text()), "expect": data["expect"]}))
    config.write_text(json.dumps({k: v for k, v in data.items() if k != "expect"} | {"expect": {"verdict": "refuted"}}))
    report = local.run_batch(zoo, _options(cache_dir=cache))
    assert [(e.entry, e.ok) for e in report.entries] == [("bugs/mlp_missing_allreduce", True), ("mlp_tp2", False)]


# --- the cache -------------------------------------------------------------------------------------


def test_cache_skips_unchanged_entries_and_rules_invalidate_all(zoo, tmp_path):
    shutil.rmtree(zoo / "corrupt")
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "extra.lp").write_text("% a user lemma file\nrefine_test_unused :- node(_, _, \"NoSuchOp\").\n")
    opts = _options(rules=(rules,))
    first = local.run_batch(zoo, opts)
    assert not any(e.cached for e in first.entries)
    assert (zoo / verify_entry.CACHE_DIR_NAME).is_dir()  # the default location
    again = local.run_batch(zoo, opts)
    assert all(e.cached for e in again.entries)
    assert [e.model_dump(exclude={"cached"}) for e in again.entries] == [e.model_dump(exclude={"cached"}) for e in first.entries]
    # a changed file re-verifies that entry only
    config = zoo / "mlp_tp2" / "refine.json"
    config.write_text(config.read_text() + "\n")
    cached = {e.entry: e.cached for e in local.run_batch(zoo, opts).entries}
    assert cached == {"bugs/mlp_missing_allreduce": True, "mlp_tp2": False}
    # a change to any rule file invalidates every verdict
    (rules / "extra.lp").write_text((rules / "extra.lp").read_text() + "% edited\n")
    assert not any(e.cached for e in local.run_batch(zoo, opts).entries)
    # --no-cache forces
    assert not any(e.cached for e in local.run_batch(zoo, _options(rules=(rules,), use_cache=False)).entries)
    # a corrupt cache file is a miss, not a failure
    for f in (zoo / verify_entry.CACHE_DIR_NAME).glob("*.json"):
        f.write_text("{not json")
    assert [e.status for e in local.run_batch(zoo, opts).entries] == ["refuted", "verified"]


def test_timeouts_and_crashes_are_not_cached(tmp_path):
    key = "k"
    cache = verify_entry.Cache(tmp_path)
    cache.put(key, batch_entries.EntryResult(entry="e", status="verified", ok=True))
    assert cache.get(key).status == "verified"
    assert set(verify_entry.CACHEABLE) == {"verified", "refuted", "unproven", "nothing_sharded", "error"}


# --- limits and dying workers ------------------------------------------------------------------------


@pytest.fixture
def slow_rules(tmp_path) -> Path:
    d = tmp_path / "slow_rules"
    d.mkdir()
    (d / "slow.lp").write_text(SLOW_RULES)
    return d


def test_timeout_is_reported_and_the_batch_goes_on(tmp_path, slow_rules):
    root = tmp_path / "root"
    shutil.copytree(EXAMPLES / "mlp_tp2", root / "mlp_tp2")
    _unary_entry(root, "Softsign")
    # (20 s: the normal entry's worker starts, imports and verifies in it on a machine busy with
    # other processes (8 s was too little with CI's two workers and more sharing two cores))
    report = local.run_batch(root, _options(timeout=20, rules=(slow_rules,), memory_mb=2000))
    got = _by_entry(report)
    assert got["mlp_tp2"].status == "verified"
    slow = got["act_softsign"]
    assert slow.status == "timeout" and not slow.ok and "20 s time limit" in slow.error
    assert slow.seconds < 45  # killed, not waited for


def test_memory_cap_is_reported_and_the_batch_goes_on(tmp_path, slow_rules):
    root = tmp_path / "root"
    shutil.copytree(EXAMPLES / "mlp_tp2", root / "mlp_tp2")
    _unary_entry(root, "Softplus")
    result = invoke("batch", root, "--rules", slow_rules, "--memory", 450, "--timeout", 60, "--jobs", 1,
                    "--json", tmp_path / "r.json")
    assert result.exit_code == 1
    got = _by_entry(batch_entries.BatchReport.model_validate_json((tmp_path / "r.json").read_text()))
    assert got["mlp_tp2"].status == "verified"  # the same cap is plenty for a normal entry
    hog = got["act_softplus"]
    assert hog.status == "out_of_memory" and "450 MiB" in hog.error, hog


def test_a_killed_worker_does_not_hang_the_batch(zoo):
    shutil.rmtree(zoo / "corrupt")

    def kill(entry: batch_entries.Entry) -> None:
        if entry.name == "mlp_tp2":
            (worker,) = [p for p in multiprocessing.active_children() if p.name == f"refine-batch {entry.name}"]
            os.kill(worker.pid, signal.SIGKILL)

    report = local.run_batch(zoo, _options(use_cache=False), local.Callbacks(on_start=kill))
    got = _by_entry(report)
    assert got["mlp_tp2"].status == "crashed" and "SIGKILL" in got["mlp_tp2"].error
    assert got["bugs/mlp_missing_allreduce"].status == "refuted"
    assert report.exit_code == 1


def test_a_bug_in_the_core_is_a_crash_of_that_entry_only():
    """Anything but InputError raised while verifying is reported as crashed (one line)."""
    entry = batch_entries.Entry(name="x", path=Path("/nonexistent/x"), kind="dir")
    result = verify_entry.run_entry(entry, _options())
    assert result.status == "error" and "refine.json" in result.error  # missing dir: bad input
    died = verify_entry.worker_died(entry, -signal.SIGSEGV, _options(memory_mb=100), 1.0)
    assert died.status == "crashed" and "SIGSEGV" in died.error and "100 MiB" in died.error


# --- the command line -------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--plan", "pp:2"], "--plan 'pp:2': expected tp:N"),
    (["--rules", "/nonexistent/rules"], "/nonexistent/rules: not a directory of .lp rule files"),
    (["--json", "/nonexistent/dir/r.json"], "no directory /nonexistent/dir"),
])
def test_bad_arguments_are_one_line(zoo, args, message):
    result = invoke("batch", zoo, *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refine: error: ") and message in lines[0], result.stderr
    assert not (zoo / verify_entry.CACHE_DIR_NAME).exists()  # nothing done


def test_an_unreadable_rule_file_is_one_line(zoo, tmp_path):
    rules = tmp_path / "rules"
    (rules / "odd.lp").mkdir(parents=True)  # a directory where a rule file should be
    result = invoke("batch", zoo, "--rules", rules)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"refine: error: {rules / 'odd.lp'}: cannot read the rule file"), result.stderr


def test_no_cache_neither_reads_nor_writes_it(zoo):
    report = local.run_batch(zoo, _options(use_cache=False))
    assert report.entries and not any(e.cached for e in report.entries)
    assert not (zoo / verify_entry.CACHE_DIR_NAME).exists()


def test_bad_roots_and_cache_dirs(tmp_path, zoo):
    empty = tmp_path / "empty"
    empty.mkdir()
    for root, message in ((tmp_path / "missing", "not a directory"), (empty, "holds no entry")):
        result = invoke("batch", root)
        assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = invoke("batch", zoo, "--cache-dir", blocker / "cache")
    assert result.exit_code == 2 and "cannot create the cache directory" in result.stderr


def test_progress_bar_lines(zoo, capsys):
    shutil.rmtree(zoo / "corrupt")
    with local.progress_bar(quiet=False, force=True) as callbacks:
        local.run_batch(zoo, _options(use_cache=False), callbacks)
    err = capsys.readouterr().err
    assert "ok mlp_tp2: verified" in err and "ok bugs/mlp_missing_allreduce: refuted" in err
    with local.progress_bar(quiet=True, force=True) as callbacks:
        local.run_batch(zoo, _options(use_cache=False), callbacks)
    assert capsys.readouterr().err == ""
