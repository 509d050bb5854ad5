"""Real PyTorch code, real bugs: hand-written Megatron layers (examples/megatron.py) exported
with `refine.exporters.export` at TP=2 and verified with refine.

The correct blocks must verify and pass `refine.exporters.check`; each bug, injected at the PyTorch
level, must be shown real (the ranks' output differs from the sequential one numerically)
and must be refuted at the right sequential node, with a source location in
examples/megatron.py that points at the right line.
"""

from __future__ import annotations

import inspect
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import refine.exporters  # noqa: E402
from conftest import load_megatron_examples  # noqa: E402
from refine.run.engine import solve  # noqa: E402
from refine.lowering.graphs import lower_dir  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.diagnose.simulate import simulate_dir  # noqa: E402
from refine.diagnose.witness import check as witness_check  # noqa: E402

TP = 2
mt = load_megatron_examples()  # examples/megatron.py, the module conftest.megatron_export builds from


class _Exported:
    """One case exported once per session (conftest.megatron_export, at TP 2: shared with
    tests/test_causes.py): its directory, sequential module and refine report."""

    def __init__(self, name: str, megatron_export):
        self.dir, self.seq = megatron_export(name)
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
            self._check = refine.exporters.check(self.dir, self.seq)
        return self._check


@pytest.fixture(scope="session")
def exported(megatron_export):
    assert TP == 2  # the TP of conftest.megatron_export
    cache: dict[str, _Exported] = {}

    def get(name: str) -> _Exported:
        if name not in cache:
            cache[name] = _Exported(name, megatron_export)
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

@pytest.mark.parametrize("name", ["mlp_nobias", "attn_nobias", "mlp", "attn"])
def test_correct_block_matches_numerically(exported, name):
    check = exported(name).check
    assert check.ok, check.render()


@pytest.mark.parametrize("name", ["mlp_nobias", "attn_nobias", "mlp", "attn"])
def test_correct_block_verifies(exported, name):
    """With biases too: the sequential nn.Linear is a Gemm (aten.addmm) between two views, the
    row-parallel rank computes MatMul -> view -> all-reduce -> Add(bias); lowering rewrites the
    Gemm (refine/lowering/canonical.py) into MatMul -> view -> Add, which pairs with the rank's ops."""
    report = exported(name).report
    assert report.verdict == "verified", (report.failure.node, report.failure.reason) if report.failure else report


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
    """Class 3: every rank adds the full bias to its partial sum. The failure is the sequential
    bias add of down_proj (its Gemm's Add after the rewrite): rank 0's sum carries the bias once,
    rank 1's a second time, so the all-reduce of the ranks' terms rebuilds nothing."""
    failure = assert_refuted(exported("mlp_bias_before_allreduce"))
    assert failure.op == "Add" and failure.location.module == "down_proj", failure
    assert failure.node == "down_proj/Gemm", failure.node
    assert failure.location.line == line_of(mt.SeqMLP.forward, "self.down_proj(")
    assert "the ranks' outputs do not rebuild it" in failure.reason, failure.reason
    # the bias went into rank 0's piece once (and, by the bug, into rank 1's piece again)
    assert {(i.rank, i.layout.startswith("partial sum")) for i in failure.inputs} == {(0, True), (1, True)}


@pytest.mark.parametrize("name", ["attn_missing_allreduce", "attn_missing_allreduce_bias"])
def test_missing_allreduce_before_the_residual(exported, name):
    """Class 1: o_proj's partial sums (plus, on every rank, its bias) are added to the replicated
    residual."""
    failure = assert_refuted(exported(name))
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


def test_missing_allreduce_at_the_output_with_bias(exported):
    """The same with a bias: every rank adds it to its partial sum and returns that. Rank 0's
    output is a true piece (bias once), rank 1's carries the bias again: refuted at down_proj's
    bias add."""
    failure = assert_refuted(exported("mlp_missing_allreduce_bias"))
    assert failure.op == "Add" and failure.location.module == "down_proj" and failure.node == "down_proj/Gemm", failure
    assert failure.location.line == line_of(mt.SeqMLP.forward, "self.down_proj(")
    assert "r1:output is unrelated to it" in failure.reason, failure.reason


def test_reshape_splits_the_shard_on_the_inner_factor(exported):
    """Class 8: local q [b, s, h/tp] viewed as [b, s, nh, hd/tp] instead of [b, s, nh/tp, hd]."""
    failure = assert_refuted(exported("attn_inner_split"))
    assert failure.op == "Reshape" and failure.node == "Reshape", failure
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


# --- vocab-parallel embedding -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["embed", "embed_where"])
def test_vocab_parallel_embedding_verifies(exported, name):
    """Megatron's VocabParallelEmbedding written with masked_fill (or torch.where): the ranks'
    masked lookups sum to the sequential lookup, for token ids declared in [0, vocab); every
    relation derived on the way holds on the simulator's numbers."""
    case = exported(name)
    assert case.check.ok, case.check.render()
    config = json.loads((case.dir / "refine.json").read_text())
    assert config["inputs"]["ids"] == {"layout": "rep", "range": [0, mt.VOCAB]}
    report = case.report
    assert report.verdict == "verified", (report.failure.node, report.failure.reason) if report.failure else report
    derived = solve(lower_dir(case.dir))
    numbers = witness_check(derived, simulate_dir(case.dir, seed=0))
    assert numbers.ok, numbers.violations[:3]
    assert {"vocab_parallel_gather", "value_window", "value_bool", "value_compare"} <= numbers.lemmas_checked


@pytest.mark.parametrize("name, layer", [("embed_off_by_one", mt.VocabParallelEmbeddingOffByOne),
                                         ("embed_unmasked", mt.VocabParallelEmbeddingUnmasked)])
def test_vocab_parallel_embedding_bugs(exported, name, layer):
    """An owned range off by one, or the foreign rows never zeroed: refuted at the sequential
    lookup (the embedding's Gather), which no rank's masked lookup rebuilds."""
    failure = assert_refuted(exported(name))
    assert failure.op == "Gather" and failure.location.module == "embed", failure
    assert failure.location.line == line_of(mt.SeqEmbedding.forward, "return self.embed(ids)")
    assert rank_lines(failure) <= set(lines_of(mt.VocabParallelEmbedding.forward)) | set(lines_of(layer))
