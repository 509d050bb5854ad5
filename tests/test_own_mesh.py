"""Your own training step on a DP x TP mesh (refine.exporters.export_train with parallelize,
data_parallel="ddp" and dp; exporters/strategies/own_mesh.py): the user's DTensor plan within each
mesh row, DDP over each column, as torch runs them. The correct step passes the numeric check and
VERIFIES on DP row 0 alone (the other row by symmetry, docs/rows.md); a summed loss under DDP's avg
(class 14) and a mean over each rank's own count of valid labels (class 10) are REFUTED at the
user's loss line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import torch.nn.functional as F  # noqa: E402

import own_models as om  # noqa: E402
from harness import SWEEP, exports_on_first_use, invoke  # noqa: E402

import refine.exporters  # noqa: E402
from refine.exporters.errors import ExportError  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402

IGNORE = -100


def mean_ce(out, batch):
    return F.cross_entropy(out, batch["labels"])  # (the local mean: class 10 where ranks ignore unevenly)


def summed_ce(out, batch):
    return F.cross_entropy(out, batch["labels"], reduction="sum")  # BUG(sum_under_avg)


def _batch(ignored: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=generator)
    labels = torch.randint(0, 16, (8,), generator=generator)
    if ignored:
        labels[:3] = IGNORE  # (row 0 of the mesh ignores 3 of its 4 labels, row 1 none)
    return {"x": x, "labels": labels}


class Stack(torch.nn.Module):
    """Two MLP blocks in a ModuleList (`layers="blocks"`: one layer function, called twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([om.MLP(), om.MLP()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def stack_plan(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for block in model.blocks:
        om.tp_plan(block, mesh)
    return model


STEPS = {
    "correct": (mean_ce, {}, False),
    "micro": (mean_ce, {"micro_batches": 2}, False),
    "layers": (mean_ce, {"layers": "blocks"}, False),
    "sum_under_avg": (summed_ce, {}, False),
    "local_count": (mean_ce, {}, True),
}


def _export(name: str, out: Path) -> None:
    loss, options, ignored = STEPS[name]
    torch.manual_seed(0)
    ranges = {"labels": (16, [IGNORE])} if ignored else {"labels": 16}
    model, plan = (Stack(), stack_plan) if "layers" in options else (om.MLP(residual=False), om.tp_plan)
    refine.exporters.export_train(model, loss, _batch(ignored), 4, out, parallelize=plan, data_parallel="ddp", dp=2,
                                  ranges=ranges, check=name in ("correct", "micro", "layers"), **options)


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    return exports_on_first_use(tmp_path_factory.mktemp("own_mesh"), _export)


@pytest.mark.parametrize("name", ["correct", *(["micro", "layers"] if SWEEP else [])])
def test_tp_plan_with_ddp_verifies_on_one_row(step_dir, name: str) -> None:
    """The plan on each row's TP mesh, DDP's avg over each column: torch agrees (the export's check),
    refine.json names the mesh, the batch is split over dp and the weights over tp, and the step is
    VERIFIED on row 0 alone (also with micro-batches, and with layers as functions)."""
    out = step_dir(name)
    config = json.loads((out / "refine.json").read_text())
    assert config["mesh"] == {"shape": [2, 2], "dims": ["dp", "tp"]}
    assert config["inputs"]["x"] == {"layout": "shard", "axis": 0, "over": "dp"}
    weight = "blocks.0.up.weight" if name == "layers" else "up.weight"
    assert config["inputs"][weight] == {"layout": "shard", "axis": 0, "over": "tp"}
    report = verify_dir(out)
    assert report.verdict == "verified", report.failure
    assert report.rows is not None and "dp=0" in report.rows


@pytest.mark.parametrize("name,bug_class", [("sum_under_avg", 14), ("local_count", 10)])
def test_loss_bugs_under_ddp_on_the_mesh_are_refuted_at_the_loss(step_dir, name: str, bug_class: int) -> None:
    """A summed loss averaged over the column (half the whole batch's sum), and each rank's mean
    over its own count of valid labels: REFUTED, in the user's words, at this file's loss line."""
    report = verify_dir(step_dir(name))
    assert report.verdict == "refuted", report.verdict
    diagnosis = report.diagnosis
    assert diagnosis is not None and diagnosis.bug_class == bug_class, diagnosis
    assert "test_own_mesh.py" in diagnosis.summary, diagnosis.summary


@pytest.mark.parametrize("options,words", [
    ({"data_parallel": "ddp"}, "pass data_parallel='ddp' and dp=D"),
    ({"data_parallel": "fsdp", "dp": 2}, "FSDP with a TP plan is not built yet"),
    ({"data_parallel": "ddp", "dp": 3}, "does not divide world_size 4"),
    ({"dp": 2}, "takes both parallelize"),
])
def test_bad_mesh_options_are_one_export_error(tmp_path, options: dict, words: str) -> None:
    plan = om.tp_plan if options.get("data_parallel") else None
    with pytest.raises(ExportError, match=words.replace("(", r"\(").replace(")", r"\)")):
        refine.exporters.export_train(om.MLP(residual=False), mean_ce, _batch(), 4, tmp_path / "out", parallelize=plan,
                                      **options)
    assert not (tmp_path / "out").exists()


def test_module_of_ones_own_on_the_mesh_from_the_command_line(tmp_path) -> None:
    """`refine export --module examples/own_training.py:example --tp 2 --dp 2 --train --check`
    (exporters/README.md): the factory's plan and loss on a 2 x 2 mesh, torch agrees, VERIFIED on
    one row; --tp with --dp without --train is one line of bad input."""
    example = f"{Path(__file__).resolve().parent.parent / 'examples' / 'own_training.py'}:example"
    out = tmp_path / "own_mesh"
    exported = invoke("export", "--module", example, "--tp", "2", "--dp", "2", "--train", "--check", "--out", out)
    assert exported.exit_code == 0 and "check: PASSED" in exported.output, exported.output
    verified = invoke("verify", out)
    assert verified.exit_code == 0 and "VERIFIED" in verified.output and "by symmetry" in verified.output, \
        verified.output
    refused = invoke("export", "--module", example, "--tp", "2", "--dp", "2", "--out", tmp_path / "forward")
    assert refused.exit_code == 2 and "pass --train" in refused.output, refused.output
