"""What is wrong, in plain words (refine/diagnose/plain.py), on zoo bugs injected in PyTorch.

The partial sums of the attention output projection reduced with max (class 2) or avg (class
14: an extra 1/TP), and k/v replicated with every rank slicing the first heads instead of its
own (class 7), have to be named on the report's second line with the rank-side node and its
source line; their correct twins verify and say nothing of the kind. GPT-2 tiny at TP 2 (the
smallest zoo model), each case exported once per session (about 10 s each).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

from refine.exporters.zoo import models as zoo  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.report.render import render_text  # noqa: E402


@pytest.fixture(scope="session")
def zoo_gpt2(zoo_export):
    """bug (or control, or `none`) -> the GPT-2 tiny TP 2 export with it injected (conftest.zoo_export:
    `none` is tests/test_exporters.py's gpt2_tp2)."""
    return lambda name: zoo_export("gpt2", "tiny", 2, False, None if name == "none" else name)


def attention_line(text: str) -> int:
    """The line of zoo.GPT2Attention.forward that holds `text` (where the rank-side node comes from)."""
    lines, start = inspect.getsourcelines(zoo.GPT2Attention.forward)
    return next(start + i for i, line in enumerate(lines) if text in line)


# bug -> (pattern, docs/bugs.md class, the rank-side node's module, the source text of its line,
# words the second line must hold; {node} is the rank-side node)
WHAT = {
    "wrong_reduce_op": ("wrong_collective", 2, "h.0.attn.c_proj", "self.c_proj(",
                        ["the partial sums of `", "are combined with max by the all-reduce `{node}` (",
                         "; they must be summed"]),
    "avg_allreduce": ("wrong_collective", 14, "h.0.attn.c_proj", "self.c_proj(",
                      ["an extra factor 1/2: the all-reduce `{node}` (", "averages over ranks 0, 1 where it must sum",
                       "reduce them with avg"]),
    "kv_wrong_offset": ("wrong_offset", 7, "h.0.attn.k_proj", "p(x).view(",
                        ["every rank takes the same slice of `", "instead of its own: the Slice `{node}` (",
                         "takes [0:32) of axis 2 on ranks 0, 1", "; rank 1 needs [32:64)",
                         "together the ranks hold only [0:32) of the 64"]),
}


@pytest.mark.parametrize("bug", sorted(WHAT))
def test_a_zoo_bug_says_what_is_wrong_on_the_second_line(zoo_gpt2, bug):
    pattern, bug_class, module, source, words = WHAT[bug]
    report = verify_dir(zoo_gpt2(bug))
    assert report.verdict == "refuted", render_text(report)
    found = report.diagnosis
    assert found is not None and (found.pattern, found.bug_class) == (pattern, bug_class), found
    assert found.rank_node and found.location is not None and found.location.module == module, found
    line = attention_line(source)
    assert (Path(found.location.file).name, found.location.line) == ("models.py", line), found.location
    second = render_text(report).splitlines()[1]
    assert second.startswith("  what is wrong: ") and second.endswith(f"[docs/bugs.md class {bug_class}]"), second
    for w in [*words, f"exporters/zoo/models.py:{line}"]:
        assert w.format(node=found.rank_node) in second, (w, second)


@pytest.mark.parametrize("twin", ["none", "kv_own_offset"])
def test_the_correct_twins_have_no_diagnosis(zoo_gpt2, twin):
    """The same code with the right reduction (the plain export) or each rank's own heads."""
    report = verify_dir(zoo_gpt2(twin))
    assert report.verdict == "verified" and report.diagnosis is None
    assert "what is wrong" not in render_text(report)
