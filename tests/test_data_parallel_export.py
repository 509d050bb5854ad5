"""Data-parallel export of zoo models (`refine export --dp N [--train] [--micro-batches M]`,
exporters/strategies/data_parallel.py: gradient accumulation too) and its bug twins, through the CLI in-process.

Each export is made once per session (tiny config, batch 2: DP 2; GPT-2 unless named; the bug
twins with one layer) and shared by the tests. The default run refutes one twin per path (DP's
local token count, accumulation's, FSDP's averaged reduce-scatter); the sweep (REFINE_TEST_SWEEP=1,
benchmarks/sweep.py) every twin (SWEEP_ONLY) and Llama's DP step.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

import onnx  # noqa: E402

from harness import SWEEP, assert_export_refused, exports_on_first_use, invoke  # noqa: E402

from refine.exporters.strategies import data_parallel  # noqa: E402
from refine.config import load_config  # noqa: E402

EXPORTS: dict[str, tuple[str, ...]] = {
    "train": ("--dp", "2", "--train"),
    "llama_train": ("--model", "llama", "--dp", "2", "--train", "--layers", "1"),
    "forward": ("--dp", "2"),
    "accumulate": ("--dp", "2", "--micro-batches", "2", "--batch", "4", "--train", "--layers", "1"),
    "fsdp": ("--dp", "2", "--train", "--fsdp", "--layers", "1"),
    **{bug.name: ("--dp", "2", "--train", "--layers", "1", "--bug", bug.name)
       + (("--micro-batches", "2", "--batch", "4") if bug.min_micro_batches > 1 else ())
       + (("--fsdp",) if bug.fsdp else ())
       for bug in data_parallel.DATA_PARALLEL_BUGS.values()},
}


@pytest.fixture(scope="session")
def dp_dir(tmp_path_factory):
    """name -> its export directory (refine export --config tiny ...), made on first use."""
    def export(name: str, out: Path) -> None:
        args = EXPORTS[name] if "--model" in EXPORTS[name] else ("--model", "gpt2", *EXPORTS[name])
        result = invoke("export", "--config", "tiny", *args, "--out", out)
        assert result.exit_code == 0, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("data_parallel"), export)


def source_line(text: str) -> int:
    """The line of exporters/strategies/data_parallel.py holding `text` (once; a trailing newline: at the end)."""
    lines = Path(inspect.getfile(data_parallel)).read_text().splitlines()
    hits = [i for i, line in enumerate(lines, start=1) if text in line + "\n"]
    assert len(hits) == 1, hits
    return hits[0]


# (Llama's DP step only in the sweep: tests/test_export_mesh.py verifies it, data_parallel.as_step over
# each mesh column, as the TP x DP training step)
@pytest.mark.parametrize("name", ["train", *(["llama_train"] if SWEEP else []), "accumulate"])
def test_data_parallel_training_step_verifies(dp_dir, name: str) -> None:
    """Loss normalised by the global token count, gradients all-reduced with sum: the loss and
    every gradient are replicas of the sequential step's on the whole batch (also with each
    rank accumulating two micro-batches' gradients: batch 4, two rows per rank)."""
    out = dp_dir(name)
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output and "loss = r0:loss (replicated on r0..r1)" in result.output, result.output
    grads = [o for o in load_config(out).outputs if o.startswith("grad.")]
    assert grads and all(load_config(out).outputs[g].layout == "rep" for g in grads)


def test_fsdp_step_verifies_with_every_gradient_sharded(dp_dir) -> None:
    """FSDP / ZeRO-3: each rank holds shard k of every parameter along axis 0 (declared so), all-gathers
    them for use, and ends with shard k of every gradient, reduce-scattered: the sequential step's."""
    out = dp_dir("fsdp")
    config = load_config(out)
    params = [name for name in config.inputs if name not in ("input_ids", "labels")]
    assert params and all(config.inputs[p].layout == "shard" and config.inputs[p].axis == 0 for p in params)
    grads = [o for o in config.outputs if o.startswith("grad.")]
    assert grads and all(config.outputs[g].layout == "shard" and config.outputs[g].axis == 0 for g in grads)
    rank0 = onnx.load(str(out / "rank0.onnx"))
    kinds = [n.op_type for n in rank0.graph.node]
    assert kinds.count("AllGather") >= len(params) and kinds.count("ReduceScatter") >= len(params), kinds
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output and "grad.wte.weight = concat(r0..r1:grad.wte.weight, axis=0)" in result.output


def test_data_parallel_forward_verifies(dp_dir) -> None:
    result = invoke("verify", dp_dir("forward"))
    assert result.exit_code == 0, result.output
    assert "logits = concat(r0..r1:logits, axis=0)" in result.output, result.output


def test_ranks_hold_their_batch_rows_and_labels_may_be_ignored(dp_dir) -> None:
    """Each rank takes half the batch; labels are declared in [0, vocab) or the ignore index
    (the example ignores a different number of tokens per rank); every rank all-reduces the
    token count, the loss and each gradient over the whole group."""
    out = dp_dir("train")
    config = load_config(out)
    labels = config.inputs["labels"]
    assert labels.layout == "shard" and labels.axis == 0 and labels.also == [data_parallel.IGNORE_INDEX]
    seq = onnx.load(str(out / "seq.onnx"))
    batch = next(i for i in seq.graph.input if i.name == "input_ids").type.tensor_type.shape.dim[0].dim_value
    grads = sum(o.name.startswith("grad.") for o in seq.graph.output)
    for r in range(2):
        m = onnx.load(str(out / f"rank{r}.onnx"))
        ids = next(i for i in m.graph.input if i.name == "input_ids")
        assert ids.type.tensor_type.shape.dim[0].dim_value == batch // 2
        reduces = [n for n in m.graph.node if n.op_type == "AllReduce"]
        reduces += [n for f in m.functions for n in f.node if n.op_type == "AllReduce"]
        assert len(reduces) >= grads + 2, len(reduces)  # the count, the loss, every gradient


BUG_SITES = {
    # each rank divides by its own token count: the loss is a ratio of two partial sums
    "dp_local_token_count": ("Div", "return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)\n"),
    # gradients averaged although the loss is already divided by the global count (the report
    # names the all-reduce that averages; the gradient reductions carry their parameter's line)
    "dp_grad_avg": ("wte (backward)/Add", None),
    # no gradient all-reduce at all: each rank's gradient is its own batch's share
    "dp_grad_not_reduced": ("wte (backward)/Add", None),
    # accumulation: each micro-batch's mean over its own tokens, divided by M (or not at all)
    "ga_local_token_count": ("Div", "return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX) / "),
    "ga_sum_of_means": ("Div", None),
    # FSDP: the gather's backward keeps the rank's own slice, or reduce-scatters with avg
    "fsdp_grad_not_reduced": ("wte (backward)/Add", None),
    "fsdp_grad_avg": ("wte (backward)/Add", None),
}


# the default run: a twin of each path (DP, accumulation, FSDP); the sweep: every twin (the others: the same
# paths' gradient reductions and loss normalisation at another place)
SWEEP_ONLY = {"dp_grad_avg", "dp_grad_not_reduced", "ga_sum_of_means", "fsdp_grad_not_reduced"}


@pytest.mark.parametrize("bug", [b for b in BUG_SITES if SWEEP or b not in SWEEP_ONLY])
def test_data_parallel_bug_twins_are_refuted(dp_dir, tmp_path, bug: str) -> None:
    """Each twin is REFUTED (exit 1) by a counterexample at the sequential node where the relation
    breaks; where the bug is a line of the step, the report shows it."""
    node, code = BUG_SITES[bug]
    report_path = tmp_path / "report.json"
    result = invoke("verify", dp_dir(bug), "--json", report_path)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output and f"first failure: node {node} " in result.output, result.output
    if bug == "dp_grad_avg":
        assert "an extra factor 1/2: the all-reduce `wte (backward)/AllReduce`" in result.output, result.output
    if code is not None:
        report = json.loads(report_path.read_text())
        where = f"exporters/strategies/data_parallel.py:{source_line(code)}"
        sites = [n["location"] for g in report["failure"]["neighbourhood"] if g["rank"] >= 0 for n in g["nodes"]]
        sites += [c["location"] for c in report["failure"].get("collectives", []) for c in c.get("calls", [])]
        assert any(site and site.endswith(where) for site in sites), (where, sites)


@pytest.mark.parametrize("args,words", [
    (("--dp", "1"), "needs at least 2 ranks"),
    (("--dp", "3"), "DP 3 does not divide the batch 2"),
    (("--dp", "2", "--tp", "2", "--train", "--bug", "dp_grad_avg"), "unknown TP x DP mesh bug 'dp_grad_avg'"),
    (("--dp", "2", "--pp", "2"), "--pp and --dp together are not supported yet"),
    (("--dp", "2", "--bug", "dp_grad_avg"), "are in the training step: pass --train"),
    (("--dp", "2", "--train", "--bug", "nope"), "unknown data-parallel bug 'nope'"),
    (("--dp", "2", "--sp"), "not with --dp"),
    (("--dp", "2", "--micro-batches", "2"), "pass --train"),
    (("--dp", "2", "--micro-batches", "2", "--train"), "--micro-batches 2 does not divide a rank's 1 batch rows"),
    (("--dp", "2", "--train", "--bug", "ga_sum_of_means"), "needs --micro-batches 2 or more"),
    (("--batch", "4"), "--batch is for a data-parallel export"),
    (("--dp", "2", "--fsdp"), "--fsdp shards the parameters and reduce-scatters their gradients: pass --train"),
    (("--dp", "2", "--train", "--bug", "fsdp_grad_avg"), "is an FSDP step's: pass --fsdp"),
    (("--dp", "2", "--train", "--fsdp", "--bug", "dp_grad_avg"), "is a replicated step's: drop --fsdp"),
])
def test_bad_data_parallel_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "gpt2", "--config", "tiny", *args)


def test_check_passes_for_a_data_parallel_step(dp_dir) -> None:
    """torch and the exported programs compute the same loss and gradients, on labels that
    ignore tokens (refine.exporters.check draws the declared ignore index too)."""
    import refine.exporters

    checked = refine.exporters.check(dp_dir("train"))
    assert checked.ok, checked.render()
