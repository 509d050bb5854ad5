"""The Mixtral zoo model (exporters/zoo/moe.py): its dense-dispatch MoE block computes what HF's
sparse block computes; exported at TP 2 through the real PyTorch path it passes the numeric
check and verifies; the other correct router plan verifies too, and the two bugs (the router's
logits left partial, the MoE block's output never all-reduced) are refuted where they break. The
other router plan and the second twin run under harness.SWEEP (REFINE_TEST_SWEEP=1,
benchmarks/sweep.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

import refine.exporters  # noqa: E402
from refine.exporters.zoo import moe, models as zoo  # noqa: E402
from refine.exporters.zoo.configs import zoo_config  # noqa: E402
from harness import SWEEP, exports_on_first_use  # noqa: E402
from refine.run.engine import solve  # noqa: E402
from refine.lowering.graphs import lower_dir  # noqa: E402
from refine.pipeline import verify_dir  # noqa: E402
from refine.diagnose.simulate import simulate_dir  # noqa: E402
from refine.diagnose.witness import check as witness_check  # noqa: E402

TP = 2


def test_dense_moe_block_matches_hf_sparse_block():
    """Every expert on every token, weighted by a dense routing matrix that is zero off the top-k,
    is HF's MixtralSparseMoeBlock (which runs only the picked experts)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = zoo_config("mixtral", "tiny")
    torch.manual_seed(0)
    hf = MixtralSparseMoeBlock(zoo._hf_config("mixtral", cfg)).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = moe.DenseDispatchMoE.from_hf(hf)
    x = torch.randn(cfg.batch, cfg.seq_len, cfg.hidden)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """plan -> its model directory at TP 2: `tp` through the zoo (layers as functions, --check's
    path), the other plans flat with one layer (quicker, the same MoE block)."""
    def export(plan: str, out: Path) -> None:
        if plan == "tp":
            refine.exporters.export_model("mixtral", "tiny", TP, False, out)
        else:
            cfg = zoo_config("mixtral", "tiny", layers=1)
            refine.exporters.export(zoo.build("mixtral", "tiny", layers=1), lambda rank: _parallel(cfg, plan), (_ids(cfg),), TP, out,
                             output_names=["logits"], output_layouts={"logits": {"layout": "rep"}},
                             input_ranges={"input_ids": cfg.vocab})

    return exports_on_first_use(tmp_path_factory.mktemp("moe"), export)


def _parallel(cfg, plan: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    module = zoo.build("mixtral", "tiny", layers=cfg.layers)
    parallelize_module(module, init_device_mesh("cpu", (TP,)), moe.make_plan(module, variant=plan), src_data_rank=None)
    return module


def _ids(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=torch.Generator().manual_seed(0))


def _seq_module(plan: str) -> torch.nn.Module | None:
    return None if plan == "tp" else zoo.build("mixtral", "tiny", layers=1)


# (the other correct router plan in the sweep: REFINE_TEST_SWEEP=1, benchmarks/sweep.py)
@pytest.mark.parametrize("plan", ["tp", pytest.param("router_rowwise", marks=pytest.mark.skipif(
    not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the plain TP plan verifies through the same exporter"))])
def test_mixtral_tp2_verifies_and_matches(exported, plan):
    """The export computes what torch computes (--check), refine verifies it, and every relation
    derived on the way, the router's (TopK, ScatterElements) included, holds on the numbers."""
    out = exported(plan)
    check = refine.exporters.check(out, _seq_module(plan))
    assert check.ok, check.render()
    report = verify_dir(out)
    assert report.verdict == "verified", (report.failure.node, report.failure.reason) if report.failure else report
    derived = solve(lower_dir(out))
    numbers = witness_check(derived, simulate_dir(out, seed=0))
    assert numbers.ok, numbers.violations[:3]
    assert {"replica_op", "matmul_row_parallel", "partial_mul_rep", "partial_add_partial", "allreduce_sum"} \
        <= numbers.lemmas_checked


def _line(func, text: str) -> int:
    lines, start = inspect.getsourcelines(func)
    return next(start + i for i, line in enumerate(lines) if text in line)


def _refuted(exported, plan: str):
    """The plan's export: torch and the programs disagree, and refine refutes it; its failure."""
    out = exported(plan)
    assert not refine.exporters.check(out, _seq_module(plan)).ok
    report = verify_dir(out)
    assert report.verdict == "refuted"
    return report.failure


def test_router_on_partial_logits_is_refuted(exported):
    """The router cut along the hidden axis, its logits never all-reduced: every rank routes
    on its own partial sums. Refuted at the router's softmax (the first op a partial cannot
    pass), at its line in exporters/zoo/moe.py."""
    failure = _refuted(exported, "router_partial")
    assert failure.op == "Softmax" and failure.location.module == "model.layers.0.mlp", failure
    assert failure.location.file.endswith("exporters/zoo/moe.py")
    assert failure.location.line == _line(moe.DenseDispatchMoE.forward, "F.softmax(")
    assert any(i.layout.startswith("partial sum") for i in failure.inputs)


@pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the router twin is refuted by default; a "
                                        "missing all-reduce (class 1) in every exporter's default twins")
def test_missing_allreduce_after_the_experts_is_refused(exported):
    """The MoE block's routing-weighted sum of partials goes into the residual un-reduced: the
    residual is still a sum of the ranks' pieces, the final norm's square of it is not."""
    failure = _refuted(exported, "missing_allreduce")
    assert failure.op == "Pow" and failure.location.module == "model.norm", failure
    assert any(i.layout.startswith("partial sum") for i in failure.inputs)
