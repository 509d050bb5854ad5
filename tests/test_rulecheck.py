"""Lemmas checked on numbers (refine/kit/rulecheck.py): `refine rules check DIR` rejects an unsound
user lemma and accepts its sound twin; `refine verify --rules` takes "verified" away from a proof
that rests on a user lemma's relation that does not hold (and, with --no-rule-check, the same
unsound lemma turns a bug into "verified": the check matters); the tutorial (docs/first-lemma.md)
runs as written (under harness.SWEEP: REFINE_TEST_SWEEP=1, benchmarks/sweep.py; its `rules check` and
`verify --rules` runs are the calls the tests above make by default)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import SWEEP, invoke
from refine.pipeline import verify_dir
from refine.kit.rulecheck import check_rules, user_lemmas

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "examples" / "rules"
SOUND, UNSOUND = RULES / "cumsum", RULES / "cumsum_unsound"


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tutorial's two models (examples/rules/build.py)."""
    out = tmp_path_factory.mktemp("tutorial")
    subprocess.run([sys.executable, str(RULES / "build.py"), "--out", str(out)], check=True, capture_output=True)
    return out


def test_the_lemmas_and_ops_of_a_rule_directory() -> None:
    assert user_lemmas([SOUND]) == ({"cumsum_other_axis", "cumsum_linear"}, ["CumSum"])


@pytest.fixture(scope="module")
def unsound_checked(tmp_path_factory: pytest.TempPathFactory, tutorial: Path):
    """check_rules of the unsound lemma with the tutorial's buggy model directory next to it,
    instances saved: one run (about 15 s) that both tests below read."""
    root = tmp_path_factory.mktemp("unsound")
    rules = root / "rules"
    shutil.copytree(UNSOUND, rules)
    shutil.copytree(tutorial / "cumsum_on_shard", rules / "cumsum_on_shard")
    return check_rules(rules, save_dir=root / "saved")


def test_an_unsound_lemma_is_rejected_with_the_instance_saved(unsound_checked) -> None:
    result = unsound_checked
    assert result.status == "violated", result.summary
    assert "cumsum_keeps_slices" in result.summary
    culprit = [v for v in result.violations if "cumsum_keeps_slices" in v.lemmas and not v.instance.startswith("example ")]
    assert culprit and all("shard axis 1" in v.instance or "shard axis" in v.instance for v in culprit)
    saved = Path(culprit[0].saved)
    assert (saved / "refine.json").is_file() and (saved / "seq.onnx").is_file()
    # the saved instance reproduces it: verify with the lemma names it
    report = verify_dir(saved, [UNSOUND])
    assert report.rule_check is not None and report.rule_check.status == "violated"


@pytest.fixture(scope="module")
def sound_checked():
    """check_rules of the sound cumsum lemmas: one run (about 15 s) that the tests below read."""
    return check_rules(SOUND)


def test_its_sound_twin_holds_and_both_lemmas_fire(sound_checked) -> None:
    result = sound_checked
    assert result.status == "held", result.summary
    fired = {t.lemma: t.fired for t in result.lemmas}
    assert fired["cumsum_other_axis"] > 0 and fired["cumsum_linear"] > 0, fired
    assert result.not_exercised == []


def test_model_directories_next_to_the_rules_are_checked(unsound_checked) -> None:
    result = unsound_checked
    assert any(v.instance.startswith("example cumsum_on_shard") for v in result.violations), \
        [v.instance for v in result.violations]


def test_an_op_the_generator_cannot_make_is_named(tmp_path: Path) -> None:
    (tmp_path / "reshape.lp").write_text(
        '% a lemma about Reshape, whose shape input the generator cannot make up\n'
        'rel_by(So, To, rep, my_reshape) :- pair(N, M, _), op(N, "Reshape"), inrel(N, M, 0, rep), pout(N, M, 0, So, To).\n')
    result = check_rules(tmp_path)
    assert any(u.startswith("Reshape:") for u in result.unsupported_ops), result.unsupported_ops
    assert result.not_exercised == ["my_reshape"]


def test_a_user_lemma_that_breaks_stratification_is_named(tmp_path: Path, sound_checked) -> None:
    """A negation over `pair` inside the lemmas' recursion (slow to ground: docs/facts.md), and
    the sound cumsum lemmas beside it, which stay stratified."""
    (tmp_path / "reshape.lp").write_text(
        '% Reshape pairs whose shape inputs differ nowhere (a negation over pair/3: not stratified)\n'
        'differs(N, M) :- pair(N, M, G), op(N, "Reshape"), sin(N, 1, A), node_in(G, M, 1, B), not pair_slot(N, M, 1, A, B).\n'
        'rel_by(So, To, rep, my_reshape) :- pair(N, M, _), op(N, "Reshape"), inrel(N, M, 0, rep), not differs(N, M),\n'
        '    pout(N, M, 0, So, To).\n')
    result = check_rules(tmp_path)
    assert any("reshape.lp:3" in r and "reads differs/2" in r for r in result.unstratified), result.unstratified
    assert all("reshape.lp" in r for r in result.unstratified)  # (never the bundled library's rules)
    assert sound_checked.unstratified == []


def test_verify_takes_verified_away_from_an_unsound_user_lemma(tutorial: Path) -> None:
    buggy = tutorial / "cumsum_on_shard"
    checked = verify_dir(buggy, [UNSOUND])
    assert checked.verdict != "verified"
    assert checked.rule_check is not None and checked.rule_check.status == "violated"
    unchecked = verify_dir(buggy, [UNSOUND], rule_check=False)
    assert unchecked.verdict == "verified"  # what the check prevents
    assert verify_dir(buggy, [SOUND]).verdict == "refuted"
    correct = verify_dir(tutorial / "cumsum_tp2", [SOUND])
    assert correct.verdict == "verified" and correct.rule_check is not None and correct.rule_check.status == "held"


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the tutorial's rules checks and "
                                        "verifies run by default in the tests above")
def test_the_tutorial_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command of docs/first-lemma.md, from a directory that sees the repository's
    examples/, with the exit code its comment states."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    text = (REPO / "docs" / "first-lemma.md").read_text()
    commands = [line for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S) for line in block.splitlines()
                if line.strip()]
    assert len(commands) >= 8
    for line in commands:
        command, _, comment = line.partition("#")
        words = shlex.split(command)
        if words[0] == "python":
            subprocess.run([sys.executable, *words[1:]], check=True, capture_output=True)
            continue
        assert words[0] == "refine", line
        expected = re.match(r"\s*exit (\d)", comment)
        assert expected, f"no `# exit N` on: {line}"
        result = invoke(*words[1:])
        assert result.exit_code == int(expected[1]), f"{line}\n{result.output}"
