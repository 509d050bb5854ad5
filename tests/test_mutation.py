"""Mutation testing (refine/kit/mutation.py): a fixed, seeded sample of mutants of small models
must show no hole (refine `verified` while the numbers differ or the programs cannot run, or a
crash); and the harness itself must be right: the judge on known-correct and known-buggy
models and on every reconstruction rule, and every operator applying somewhere, producing a
model onnx.checker accepts and that differs from its subject."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import EXAMPLES_DIR
from harness import Case, Graph, mesh_maxes_case, rep, shard

from refine import dist
from refine.config import CONFIG_NAME, SEQ_NAME, ModelConfig
from refine.kit.mutation import (
    EVERY_RANK,
    OPERATORS,
    Operator,
    apply_operator,
    judge,
    load_subject,
    make_mutant,
    mutate,
    output_problems,
    run_campaign,
)
from refine.diagnose.simulate import SimResult

sys.path.insert(0, str(EXAMPLES_DIR))
import layered  # examples/layered.py, importable once EXAMPLES_DIR is on the path

SAMPLE_SEED = 11
SAMPLE_COUNT = 32


@pytest.fixture(scope="session")
def layered_dir(tmp_path_factory) -> Path:
    """Two MLP blocks as calls of one layer function: mutations inside a function body."""
    return layered.write(tmp_path_factory.mktemp("mutation") / "layered", 2, 2)


def _sp_program(rows: int, world: int | None) -> Graph:
    g = Graph()
    x, w = g.input("x", [rows, 8]), g.input("w", [8, 8])
    a, b = g.op_n("Split", g.op("MatMul", x, w), g.ints([4, 4]), outputs=2, axis=1)
    cut = g.op("Slice", g.op("Concat", b, a, axis=1), g.ints([0]), g.ints([6]), g.ints([1]))
    y = g.op("Softmax", g.op("Gather", cut, g.ints([1, 0, 2]), axis=1), axis=1)
    g.output(g.coll("AllGather", y, list(range(world)), axis=0) if world else y)
    return g


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory) -> Path:
    """Rows sharded, then Split, Concat, Slice, Gather, Softmax and an all-gather: what the
    bundled examples lack (slice bounds, gather/split/concat axes, a collective's axis)."""
    case = Case("sp", _sp_program(4, None), [_sp_program(2, 2), _sp_program(2, 2)], {"x": shard(0), "w": rep()})
    return _save_case(case, tmp_path_factory.mktemp("mutation") / "sp")


def _save_case(case: Case, out: Path) -> Path:
    loaded = case.loaded()
    out.mkdir()
    onnx.save(loaded.seq, out / SEQ_NAME)
    for r, model in enumerate(loaded.ranks):
        onnx.save(model, out / f"rank{r}.onnx")
    (out / CONFIG_NAME).write_text(json.dumps({"world_size": len(loaded.ranks), "inputs": case.inputs}))
    return out


def _pipeline_stage(stage: int | None) -> Graph:
    """y = x w0 w1 in two stages over two micro-batches (stage None: the sequential program)."""
    g = Graph()
    x, w0, w1 = g.input("x", [4, 6]), g.input("w0", [6, 6]), g.input("w1", [6, 5])
    if stage is None:
        g.output(g.op("MatMul", g.op("MatMul", x, w0), w1))
        return g
    halves = [g.op("Slice", x, g.ints([2 * k]), g.ints([2 * k + 2]), g.ints([0])) for k in (0, 1)]
    if stage == 0:
        for h in [g.op("MatMul", h, w0) for h in halves]:
            g.send(h, 1)
        return g
    g.output(g.op("Concat", *[g.op("MatMul", g.recv(h, 0), w1) for h in halves], axis=0))
    return g


@pytest.fixture(scope="session")
def pipeline_dir(tmp_path_factory) -> Path:
    """Two pipeline stages passing two micro-batches with Send/Recv (point-to-point mutations)."""
    case = Case("pp", _pipeline_stage(None), [_pipeline_stage(0), _pipeline_stage(1)],
                {"x": rep(), "w0": rep(), "w1": rep()})
    return _save_case(case, tmp_path_factory.mktemp("mutation") / "pp")


@pytest.fixture(scope="session")
def mesh_layers_dir(tmp_path_factory) -> Path:
    """A 2 x 2 mesh whose layer function all-reduces over the rank's tp group and its dp group:
    calls inside layer functions to move past each other or retarget to the other group."""
    return mesh_maxes_case("twin").save(tmp_path_factory.mktemp("mutation") / "mesh_layers", layer_calls=2)


def _chunk_program(rank: int | None) -> Graph:
    """Relu(x w), and on each rank its own chunk of the rows as sequence parallelism takes it:
    SequenceAt(SplitToSequence(y, [2, 2]), rank) (chunk-position mutations)."""
    g = Graph()
    x, w = g.input("x", [4, 6]), g.input("w", [6, 5])
    y = g.op("Relu", g.op("MatMul", x, w))
    if rank is None:
        g.output(y)
        return g
    g.output(g.op("SequenceAt", g.op("SplitToSequence", y, g.ints([2, 2]), axis=0), g.const(rank, np.int64)))
    return g


@pytest.fixture(scope="session")
def chunk_dir(tmp_path_factory) -> Path:
    """Each rank keeps its own chunk of a split sequence (a sequence-parallel layer's form)."""
    case = Case("chunks", _chunk_program(None), [_chunk_program(0), _chunk_program(1)], {"x": rep(), "w": rep()})
    return _save_case(case, tmp_path_factory.mktemp("mutation") / "chunks")


@pytest.fixture(scope="session")
def experts_dir(tmp_path_factory) -> Path:
    """HF's AllReduceEP with batched_mm experts over 2 ranks (tests/test_lemmas_owned_rows.py): the
    expert ids' block, local ids, clamp and sentinel, the gathers at them (index and count mutations)."""
    from test_lemmas_owned_rows import moe_case

    case, _, _ = moe_case("mutation_experts", 2, 0)
    return _save_case(case, tmp_path_factory.mktemp("mutation") / "experts")


@pytest.fixture(scope="session")
def exchange_dir(tmp_path_factory) -> Path:
    """HF's AllToAllEP over 2 ranks (tests/test_lemmas_exchanged_rows.py): the sort, the counts'
    exchange and the ragged exchanges there and back (split-count mutations)."""
    from test_lemmas_exchanged_rows import exchange_case

    case, _, _ = exchange_case("mutation_exchange", 2, 0)
    return _save_case(case, tmp_path_factory.mktemp("mutation") / "exchange")


@pytest.fixture(scope="session")
def subject_dirs(layered_dir, sp_dir, pipeline_dir, mesh_layers_dir, chunk_dir, experts_dir, exchange_dir) -> list[Path]:
    return [EXAMPLES_DIR / "mlp_tp2", EXAMPLES_DIR / "attn_tp2", layered_dir, sp_dir, pipeline_dir, mesh_layers_dir,
            chunk_dir, experts_dir, exchange_dir]


# --- the fixed sample ------------------------------------------------------------------------


def test_sample_has_no_holes(subject_dirs):
    campaign = run_campaign(subject_dirs, SAMPLE_COUNT, SAMPLE_SEED, jobs=2)  # (both cores: forkserver workers)
    assert len(campaign.rows) == SAMPLE_COUNT
    assert all(s.judgement == "equivalent" and s.verdict == "verified" for s in campaign.subjects), campaign.subjects
    assert len({r.operator for r in campaign.rows}) >= 8, "the sample should exercise many operators"
    assert not campaign.holes(), campaign.markdown()


def test_mutants_are_deterministic(subject_dirs):
    subjects = [load_subject(d) for d in subject_dirs]
    first, again = (make_mutant(subjects, 3, SAMPLE_SEED) for _ in range(2))
    assert first is not None and again is not None
    assert (first.description, first.files) == (again.description, again.files)


# --- the judge -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp_tp2", "attn_tp8", "mlp_bias_rank0", "mlp_dp2_tp2"])
def test_judge_correct_examples_equivalent(name):
    assert judge(EXAMPLES_DIR / name).judgement == "equivalent"


@pytest.mark.parametrize("name", ["mlp_bias_before_allreduce", "mlp_missing_allreduce", "attn_reshape_moves_shard",
                                  "mlp_dp2_tp2_wrong_group"])
def test_judge_buggy_examples_differ(name):
    judged = judge(EXAMPLES_DIR / name)
    assert judged.judgement == "differs", judged


def test_judge_cannot_run(tmp_path):
    (tmp_path / CONFIG_NAME).write_text('{"world_size": 2}')
    assert judge(tmp_path).judgement == "cannot_run"


_RNG = np.random.default_rng(0)
_Y = _RNG.standard_normal((4, 6)).astype(np.float32)


def _problems(rank_values: list[np.ndarray | None], outputs: dict | None = None, y: np.ndarray = _Y) -> list[str]:
    """The judge's output rule on one output `y` and the given rank outputs (None: no such output)."""
    config = ModelConfig.model_validate({"world_size": len(rank_values), "outputs": outputs or {}})
    run = SimResult({"y": y}, [{"y": v} if v is not None else {} for v in rank_values])
    return output_problems(run, config, ["y"], [["y"] if v is not None else [] for v in rank_values])


def test_judge_undeclared_reconstructions():
    a, b = _Y[:2], _Y[2:]
    assert not _problems([_Y, _Y])  # replicas
    assert not _problems([a, b])  # a concatenation along axis 0
    assert not _problems([b, a])  # windows in any order
    assert not _problems([a, a, b, b])  # replicated shards: every rank takes part
    assert not _problems([_Y[:, :4], _Y[:, 2:]])  # overlapping windows that cover the axis
    assert not _problems([_Y - 1, np.ones_like(_Y)])  # a sum
    assert not _problems([_Y - 1, _Y])  # a max
    assert not _problems([_Y[:, [0, 2, 4]], _Y[:, [1, 3, 5]]])  # an interleaving: block b of every rank, in rank order
    assert not _problems([_Y, None])  # a rank without the output takes no part
    # a shard of a sum left partial over another mesh dim: concat over the columns of sums over pairs
    assert not _problems([a - 1, b + 2, np.ones_like(a), -2 * np.ones_like(b)])


def test_judge_undeclared_failures():
    a, b = _Y[:2], _Y[2:]
    assert _problems([a, a])  # the windows do not cover the axis
    assert _problems([_Y[:, [1, 3, 5]], _Y[:, [0, 2, 4]]])  # interleaved, but not in rank order
    assert _problems([a, b, a + 1])  # every rank with the output must take part
    assert _problems([_Y, 2 * _Y])  # a replica and a wrong one: sums to 3y
    assert _problems([_Y * (1 + 1e-3), _Y])  # beyond the tolerance
    assert _problems([None, None])  # no rank has it
    assert _problems([a - 1, b + 2, np.ones_like(a), -np.ones_like(b)])  # one pair does not sum to its window
    assert not _problems([_Y * (1 + 1e-6), _Y])  # within it


def test_judge_declared_layouts():
    a, b = _Y[:2], _Y[2:]
    assert not _problems([_Y, _Y], {"y": rep()})
    assert _problems([a, b], {"y": rep()})  # a concatenation is not the declared replica
    assert not _problems([a, b], {"y": shard(0)})
    assert _problems([b, a], {"y": shard(0)})  # rank k holds chunk k
    assert not _problems([_Y[:1], _Y[1:]], {"y": shard(0, [1, 3])})
    assert not _problems([_Y - 1, np.ones_like(_Y)], {"y": {"layout": "partial", "op": "sum"}})
    assert _problems([_Y, _Y], {"y": {"layout": "partial", "op": "sum"}})
    assert not _problems([_Y, _Y - 1], {"y": {"layout": "partial", "op": "max"}})
    assert _problems([_Y, _Y - 1], {"y": {"layout": "partial", "op": "sum"}})


# --- the operators ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def subjects(subject_dirs):
    return [load_subject(d) for d in subject_dirs]


@pytest.mark.parametrize("op", OPERATORS, ids=lambda op: op.name)
def test_operator_applies_and_changes_a_checked_model(op, subjects):
    dist.register_schemas()
    applied = []
    for subject in subjects:
        for seed in range(6):
            rng = random.Random(seed)
            targets = [CONFIG_NAME] if op.kind == "config" else ["rank1.onnx", EVERY_RANK, SEQ_NAME]
            for target in targets:
                found = mutate(subject, op, target, rng)
                if found is None:
                    continue
                files, description = found
                applied.append(description)
                for name, content in files.items():
                    if name.endswith(".onnx"):
                        assert content != subject.models[name].SerializeToString(deterministic=True), description
                        onnx.checker.check_model(onnx.load_from_string(content))
                    else:
                        assert json.loads(content) != subject.config, description
    assert applied, f"{op.name} applies to none of {[s.name for s in subjects]}"


def test_operator_that_changes_nothing_makes_no_mutant(subjects):
    subject = subjects[0]
    idle = Operator("idle", "-", lambda edit: "changed nothing")
    annotate = Operator("annotate", "-", lambda edit: (edit.strip_annotations(), "annotations only")[1])
    model = subject.models[SEQ_NAME]
    before = model.SerializeToString()
    rng = random.Random(0)
    assert apply_operator(idle, model, subject.types[SEQ_NAME], subject.ints[SEQ_NAME], subject.declared, rng) is None
    found = apply_operator(annotate, model, subject.types[SEQ_NAME], subject.ints[SEQ_NAME], subject.declared, rng)
    assert found is not None and found[0] is not model  # a real change, on a copy
    assert model.SerializeToString() == before
