"""Real PyTorch code, real bugs: hand-written Megatron layers (examples/megatron.py) exported
with `exporters.export` at TP=2 and verified with refine.

The correct blocks must verify and pass `exporters.check`; each bug, injected at the PyTorch
level, must be shown real (the ranks' output differs from the sequential one numerically)
and must be refuted at the right sequential node, with a source location in
examples/megatron.py that points at the right line.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import exporters  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MEGATRON_PY = REPO / "examples" / "megatron.py"
TP = 2


def _load_megatron():
    spec = importlib.util.spec_from_file_location("examples_megatron", MEGATRON_PY)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules.setdefault("examples_megatron", module)
    spec.loader.exec_module(module)
    return module


mt = _load_megatron()


class _Exported:
    """One case exported once per session: its directory, sequential module and refine report."""

    def __init__(self, name: str, out: Path):
        self.seq, factory, inputs = mt.build(name)
        self.dir = out / name
        exporters.export(self.seq, factory, inputs, TP, self.dir)
        self._report = None
        self._check = None

    @property
    def report(self):
        if self._report is None:
            self._report = verify_dir(self.dir)
        return self._report

    @property
    def check(self):
        if self._check is None:
            self._check = exporters.check(self.dir, self.seq)
        return self._check


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    cache: dict[str, _Exported] = {}

    def get(name: str) -> _Exported:
        if name not in cache:
            cache[name] = _Exported(name, out)
        return cache[name]

    return get


def line_of(func, text: str) -> int:
    """The file line number of the first line of `func`'s source that contains `text`."""
    lines, start = inspect.getsourcelines(func)
    hits = [start + i for i, line in enumerate(lines) if text in line]
    assert hits, f"{text!r} not in {func.__qualname__}"
    return hits[0]


def lines_of(func) -> range:
    lines, start = inspect.getsourcelines(func)
    return range(start, start + len(lines))


# --- correct blocks --------------------------------------------------------------------------

BIAS_AFTER_ALLREDUCE_LEMMA = (
    "missing lemma: the sequential nn.Linear with a bias lowers to Gemm(A, B^T, C) (aten.addmm), while "
    "Megatron's RowParallelLinear computes MatMul (no C) -> dist.AllReduce -> Reshape -> Add(replicated bias); "
    "rules/matmul.lp only pairs a seq Gemm with a rank Gemm, so refine stops at `down_proj`/`o_proj` Gemm "
    "('the ranks feed these inputs to Add, MatMul, Reshape, not to Gemm') though the export is numerically right"
)

CORRECT = [
    "mlp_nobias",
    "attn_nobias",
    pytest.param("mlp", marks=pytest.mark.xfail(strict=True, reason=BIAS_AFTER_ALLREDUCE_LEMMA)),
    pytest.param("attn", marks=pytest.mark.xfail(strict=True, reason=BIAS_AFTER_ALLREDUCE_LEMMA)),
]


@pytest.mark.parametrize("name", ["mlp_nobias", "attn_nobias", "mlp", "attn"])
def test_correct_block_matches_numerically(exported, name):
    check = exported(name).check
    assert check.ok, check.render()


@pytest.mark.parametrize("name", CORRECT)
def test_correct_block_verifies(exported, name):
    report = exported(name).report
    assert report.verdict == "verified", (report.failure.node, report.failure.reason) if report.failure else report


def test_biased_blocks_stop_at_the_row_parallel_gemm(exported):
    """Pins down what the xfail above is waiting for: unproven (not refuted) at the Gemm."""
    for name, module, forward in (("mlp", "down_proj", mt.SeqMLP.forward), ("attn", "o_proj", mt.SeqAttention.forward)):
        report = exported(name).report
        assert report.verdict == "unproven", name
        assert report.failure.op == "Gemm" and report.failure.location.module == module, name
        assert report.failure.location.line in lines_of(forward), name


# --- bugs -------------------------------------------------------------------------------------


def assert_refuted(case: _Exported):
    """The bug is real (numerically) and refine refutes it; returns the failure."""
    check = case.check
    assert not check.ok, "the buggy export matches the sequential model numerically"
    assert any(line.startswith("FAIL") and "every rank" in line for line in check.lines), check.render()
    report = case.report
    assert report.verdict == "refuted", (report.verdict, report.failure)
    failure = report.failure
    assert failure is not None and failure.location is not None
    assert failure.location.file.endswith("examples/megatron.py"), failure.location
    return failure


def rank_lines(failure) -> set[int]:
    assert failure.rank_nodes, "no rank counterpart named"
    assert all(n.location.file.endswith("examples/megatron.py") for n in failure.rank_nodes)
    return {n.location.line for n in failure.rank_nodes}


def test_bias_added_before_the_allreduce(exported):
    """Class 3: every rank adds the full bias to its partial sum."""
    failure = assert_refuted(exported("mlp_bias_before_allreduce"))
    assert failure.op == "Gemm" and failure.location.module == "down_proj", failure
    assert "addmm" in failure.node
    assert failure.location.line == line_of(mt.SeqMLP.forward, "self.down_proj(")
    assert "rules/matmul.lp" in failure.reason
    # the ranks' Gemm is the buggy statement itself
    bug = line_of(mt.RowParallelLinearBiasBeforeAllReduce.forward, "# BUG")
    assert rank_lines(failure) == {bug}


def test_missing_allreduce_before_the_residual(exported):
    """Class 1: o_proj's partial sums are added to the replicated residual."""
    failure = assert_refuted(exported("attn_missing_allreduce"))
    assert failure.op == "Add", failure
    assert failure.location.line == line_of(mt.SeqAttention.forward, "return x + self.o_proj(o)")
    # rank 0's residual sum counts as a partial sum (x added once), rank 1's adds x a second time
    assert "the ranks' outputs do not rebuild it" in failure.reason and "partial sum" in failure.reason, failure.reason
    # an output-level failure: the report names no rank counterpart node here
    assert not failure.rank_nodes or rank_lines(failure) <= set(lines_of(mt.TPAttention.forward))


def test_missing_allreduce_at_the_output(exported):
    """Class 1 at the very end of the model: the ranks return partial sums as the output. (A sum
    would rebuild it; the exporter declares the output replicated in refine.json, so it fails.)"""
    case = exported("mlp_missing_allreduce")
    assert not case.check.ok
    assert case.report.verdict != "verified"


def test_reshape_splits_the_shard_on_the_inner_factor(exported):
    """Class 8: local q [b, s, h/tp] viewed as [b, s, nh, hd/tp] instead of [b, s, nh/tp, hd]."""
    failure = assert_refuted(exported("attn_inner_split"))
    assert failure.op == "Reshape" and "view" in failure.node, failure
    # the sequential q's split into heads (its view, called from forward for q)
    assert failure.location.line == line_of(mt.SeqAttention.forward, "q = self._split_heads(")
    assert "rules/shape.lp" in failure.reason
    # torch's stack traces keep nn.Module.forward frames only, so the ranks' Reshape is placed at
    # forward's call of the (buggy) _split_heads, not at the `# BUG` line inside it
    assert rank_lines(failure) == {line_of(mt.TPAttention.forward, "self._split_heads(t)")}


def test_fused_qkv_sharded_as_a_plain_column_shard(exported):
    """Class 6: rank 0 holds q and half of k, rank 1 the other half of k and v."""
    case = exported("attn_fused_qkv")
    assert case.check.ok is False
    failure = assert_refuted(case)
    # the first sequential node whose rank counterpart is gone: k's transpose in q @ k^T
    assert failure.op == "Transpose", failure
    assert failure.location.line == line_of(mt.SeqAttentionFusedQKV.forward, "_attend(q, k, v")
    assert rank_lines(failure) <= {line_of(mt.TPAttention.forward, "_attend(q, k, v")}
