"""Words for every class of docs/bugs.md, and never a class whose pattern is absent: every bundled
example, and (under SWEEP: about 60 exports) every zoo twin of GPT-2 and Mixtral at degree 2 over
every plan, the data-parallel twins and the correct exports, verified; each report names the
injected bug's class in its plain words (refine/diagnose/plain.py) or, for the few twins listed in
NO_WORDS, no class at all; a correct export names none. Own-code twins: tests/test_own_bugs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import SWEEP, example_report, invoke
from refine.pipeline import verify_dir
from refine.report.render import render_text

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(d.name for d in (REPO / "examples").iterdir() if (d / "refine.json").is_file())
EXAMPLE_CLASSES = {  # the buggy examples' classes (docs/bugs.md's catalogue); the others are correct
    "attn_reshape_moves_shard": 8, "mlp_bias_before_allreduce": 3, "mlp_dp2_tp2_grads_over_tp": 11,
    "mlp_dp2_tp2_wrong_group": 11, "mlp_extra_scale": 14, "mlp_missing_allreduce": 1, "mlp_pp_send_partial": 13,
    "mlp_wrong_collective": 2,
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_names_its_class_or_none(name):
    report = example_report(name)
    want = EXAMPLE_CLASSES.get(name)
    got = report.diagnosis.bug_class if report.diagnosis is not None else None
    assert got == want, render_text(report)
    if want is None:
        assert report.verdict == "verified" and "what is wrong" not in render_text(report)


# --- the zoo's twins (SWEEP) ------------------------------------------------------------------------------

ZOO = ["--models", "gpt2,mixtral", "--tp", "2", "--plans", "tp,sp,pp,pptp,cp,ring,zigzag,ep,eptp,pptrain,fsdp,dp",
       "--steps", "infer,train"]
DATA_PARALLEL = {  # `refine export --dp` twins (not in `refine zoo`): name -> arguments
    **{f"gpt2_dp2_train__{b}": ["--dp", "2", "--train", "--layers", "1", "--bug", b]
       for b in ("dp_local_token_count", "dp_grad_avg", "dp_grad_not_reduced")},
    **{f"gpt2_dp2_ga2_train__{b}": ["--dp", "2", "--train", "--micro-batches", "2", "--batch", "4", "--layers", "1",
                                    "--bug", b] for b in ("ga_local_token_count", "ga_sum_of_means")},
}
# twins whose report names no class: the failure lands where no pattern of plain.py recognises the bug
NO_WORDS: set[str] = set()


def bug_classes() -> dict[str, int | None]:
    """Every injected bug of the exporters, by name: its docs/bugs.md class (None: a control)."""
    from refine.exporters.strategies import context, data_parallel, expert, expert_mesh, mesh, pipeline
    from refine.exporters.zoo import bugs

    catalogues = [bugs.BUGS, bugs.CONTROLS, context.CONTEXT_BUGS, context.RING_BUGS, context.LOSS_BUGS,
                  context.ZIGZAG_BUGS, data_parallel.DATA_PARALLEL_BUGS, expert.EXPERT_BUGS,
                  expert_mesh.EXPERT_MESH_BUGS, mesh.MESH_BUGS, pipeline.PIPELINE_BUGS]
    return {name: bug.bug_class for catalogue in catalogues for name, bug in catalogue.items()}


@pytest.mark.skipif(not SWEEP, reason="about 60 exports: benchmarks/sweep.py runs it")
def test_every_zoo_twin_names_its_class_or_none(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("zoo") / "zoo"
    done = invoke("zoo", "--out", out, *ZOO)
    assert done.exit_code == 0, done.output
    for name, args in DATA_PARALLEL.items():
        done = invoke("export", "--model", "gpt2", *args, "--out", out / name)
        assert done.exit_code == 0, done.output
    classes = bug_classes()
    wrong, silent = [], []
    for entry in sorted(d for d in out.iterdir() if (d / "refine.json").is_file()):
        bug = json.loads((entry / "export.json").read_text())["zoo"].get("bug")
        report = verify_dir(entry)
        got = report.diagnosis.bug_class if report.diagnosis is not None else None
        want = classes.get(bug) if bug else None
        if got is None and want is not None and entry.name not in NO_WORDS:
            silent.append(entry.name)
        elif got is not None and got != want:
            wrong.append((entry.name, want, got, report.diagnosis.summary if report.diagnosis else ""))
    assert not wrong, wrong
    assert not silent, silent
