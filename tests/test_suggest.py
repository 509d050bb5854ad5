"""`refine rules suggest` (refine/kit/suggest.py): on a corpus case whose lemma is left out of the
library, it proposes a lemma that `rules check` accepts (its witness model directory makes it fire)
and with which the case verifies; on the case's bug twin, whose numbers differ, it proposes nothing;
and `refine rules without` writes the library a rule author runs it against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refine.cli.main import app
from refine.kit import rulebook
from refine.kit.suggest import suggest
from refine.pipeline import verify_dir
from refine.run.engine import LIBRARY_ENV

pytest.importorskip("torch")
pytest.importorskip("onnxscript")
from spellings import corpus  # noqa: E402  (torch first)

CASE = "hf_label_smoothing_vs_vocab_parallel"  # label smoothing's sum of -log p: ReduceSum of a 1/K-scaled replica
# the lemma for that sum, and the scale copies' way back to the real tensors (which would carry the
# factor through the ReduceSum instead: rules/scales.lp)
LEFT_OUT = ("reduce_scaled", "scaled_linear")


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the correct case, its twin, the library without LEFT_OUT)."""
    root = tmp_path_factory.mktemp("suggest")
    spelling = next(s for s in corpus() if s.name == CASE)
    library = root / "library"
    assert sorted(rulebook.library_without(list(LEFT_OUT), library)) == sorted(LEFT_OUT)
    return spelling.export(root), spelling.export(root, buggy=True), library


def test_library_without_a_lemma_leaves_the_case_unproven(case, monkeypatch: pytest.MonkeyPatch) -> None:
    correct, _twin, library = case
    assert verify_dir(correct).verdict == "verified"
    monkeypatch.setenv(LIBRARY_ENV, str(library))
    assert verify_dir(correct).verdict == "unproven"
    assert not [lemma for lemma in rulebook.inventory().lemmas if lemma.name in LEFT_OUT]


def test_suggests_a_checked_lemma_with_which_the_case_verifies(case, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    correct, _twin, library = case
    monkeypatch.setenv(LIBRARY_ENV, str(library))
    out = tmp_path / "suggested"
    found = suggest(correct, out)
    assert found.status == "proposed", found.summary
    assert found.verdict_with_it == "verified"
    assert found.check is not None and found.check.status == "held"
    fired = {t.lemma: t.fired for t in found.check.lemmas}
    assert all(fired.get(Path(f).stem, 0) > 0 for f in found.lemma_files), fired  # exercised, not vacuous
    assert found.witness and all((Path(w) / "refine.json").is_file() for w in found.witness)
    assert "ReduceSum" in found.lemma and "% Suggested by" in found.lemma
    # adopting it is `verify --rules`, which checks what it derives on the model's own numbers
    adopted = verify_dir(correct, [out])
    assert adopted.verdict == "verified" and adopted.rule_check is not None and adopted.rule_check.status == "held"


def test_proposes_nothing_for_the_bug_twin(case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _correct, twin, library = case
    monkeypatch.setenv(LIBRARY_ENV, str(library))
    found = suggest(twin, tmp_path / "suggested")
    assert found.status == "nothing" and not found.lemma_files
    assert "refuted" in found.summary
    assert not (tmp_path / "suggested").exists() or not list((tmp_path / "suggested").glob("*.lp"))


def test_cli_suggest_and_without(case, tmp_path: Path) -> None:
    correct, _twin, _library = case
    runner = CliRunner()
    library = tmp_path / "lib"
    result = runner.invoke(app, ["rules", "without", *LEFT_OUT, "--out", str(library)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["rules", "without", "no_such_lemma", "--out", str(tmp_path / "lib2")])
    assert result.exit_code == 2 and "no lemma named no_such_lemma" in result.output  # (bad input)
    assert not (tmp_path / "lib2").exists() and "Traceback" not in result.output
    result = runner.invoke(app, ["rules", "suggest", str(correct), "--out", str(tmp_path / "s"), "--json"],
                           env={LIBRARY_ENV: str(library)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["status"] == "proposed"
    unproven = runner.invoke(app, ["verify", str(correct)], env={LIBRARY_ENV: str(library)})
    assert "refine rules suggest" in unproven.output
    verified = runner.invoke(app, ["rules", "suggest", str(correct), "--out", str(tmp_path / "s2")])
    assert verified.exit_code == 0 and "nothing to suggest" in verified.output
    missing = runner.invoke(app, ["rules", "suggest", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "Traceback" not in missing.output
