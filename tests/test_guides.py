"""Every command of every guide in docs/ (and exporters/README.md) runs as written: the ```sh
blocks, run in order from a scratch directory that sees the repository's examples/, each
`refine` command with the exit code its comment states (VERIFIED 0, REFUTED 1, UNPROVEN 3, else
`exit N`, else 0), and the verdict printed. Commands marked `(slow)` (whole zoos, 405B-sized
exports, and exports whose exporter paths a test file verifies by default: the frameworks' TP 2
exports, GPT-2's PP 2 and ring exports, docs/export.md's TP 8; docs/layers.md's --no-memo rerun,
which tests/test_lemmas_layers.py runs on a smaller stack) run under benchmarks/sweep.py only
(REFINE_TEST_SWEEP=1); `pip install` lines are the install, not run here.
docs/first-lemma.md's tutorial has its own test (tests/test_rulecheck.py, under the sweep)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness import SWEEP

REPO = Path(__file__).resolve().parent.parent
GUIDES = sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "first-lemma.md") + [REPO / "exporters" / "README.md"]
EXIT = {"VERIFIED": 0, "REFUTED": 1, "UNPROVEN": 3}


def commands(guide: Path) -> list[str]:
    """The command lines of the guide's ```sh blocks (comment-only lines left out)."""
    blocks = re.findall(r"```sh\n(.*?)```", guide.read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def expected_exit(comment: str) -> int:
    found = re.search(r"\b(VERIFIED|REFUTED|UNPROVEN)\b", comment)
    if found:
        return EXIT[found[1]]
    code = re.search(r"\bexit (\d)\b", comment)
    return int(code[1]) if code else 0


def test_every_guide_has_commands_and_no_guide_is_left_out() -> None:
    with_commands = [g.name for g in GUIDES if commands(g)]
    assert {"export.md", "parallelism.md", "training.md", "frameworks.md", "layers.md", "batch.md"} <= set(with_commands)


def _available(line: str) -> str | None:
    """Why the line cannot run here (an extra not installed), or None."""
    import importlib.util

    if "megatron-core" in line and importlib.util.find_spec("megatron") is None:
        return "the megatron extra"
    if "--framework torchtitan" in line and importlib.util.find_spec("torchtitan") is None:
        return "the torchtitan extra"
    if re.search(r"refine (export|zoo)\b", line) and importlib.util.find_spec("torch") is None:
        return "the torch extra"
    return None


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_guide_runs_as_written(guide: Path, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    ran = 0
    for line in commands(guide):
        command, _, comment = line.partition("#")
        words = shlex.split(command)
        if words[:2] == ["pip", "install"] or (not SWEEP and "(slow)" in comment):
            continue
        missing = _available(line)
        if missing:
            pytest.skip(f"{line.strip()}: needs {missing}")
        if words[0] == "python":
            subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, check=True, capture_output=True)
            continue
        assert words[0] == "refine", f"{guide.name}: not a refine, python or pip command: {line}"
        done = subprocess.run([sys.executable, "-m", "refine.cli", *words[1:]], cwd=tmp_path, capture_output=True,
                              text=True)
        want = expected_exit(comment)
        assert done.returncode == want, f"{guide.name}: {line}\nexit {done.returncode}, expected {want}\n{done.stdout}\n{done.stderr}"
        verdict = re.search(r"\b(VERIFIED|REFUTED|UNPROVEN)\b", comment)
        if verdict:
            assert f": {verdict[1]} (" in done.stdout, f"{guide.name}: {line}\n{done.stdout}"
        ran += 1
    assert ran or not SWEEP


def test_the_readme_fits_on_a_screen_and_links_every_guide() -> None:
    """At most 200 lines: what refine does, the two fresh-machine commands, the commands, and a
    link to each guide (each guide holds the details)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for guide in GUIDES:
        assert str(guide.relative_to(REPO)) in text, guide
    assert "pip install -e . && refine verify examples/mlp_tp2" in text
    assert "pip install -e '.[test,torch,megatron,ray,torchtitan]' && python -m pytest -q -n 2 --dist loadfile" in text
