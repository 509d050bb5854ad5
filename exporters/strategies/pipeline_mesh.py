"""Pipeline x tensor parallelism on a 2-D mesh (`export_pipeline_mesh`: `--pp P --tp T`), forward.

The P*T ranks form the mesh `{"shape": [P, T], "dims": ["pp", "tp"]}`, row-major: global rank
r = s*T + t is TP rank t of pipeline stage s (mesh.py's convention, with stages as its rows). Each
stage is the stage of exporters/strategies/pipeline.py (its blocks, embedding or head, the micro-batches in
GPipe order) with its blocks parallelized by the zoo's TP plan (exporters/zoo/plans.py, DTensor, as
the TP export does: `pipeline.stage_tp_module`). So:

- TP collectives run over the stage's own TP group, global ranks {s*T .. s*T+T-1};
- stage boundaries are Send/Recv between the same TP position of consecutive stages: rank s*T + t
  sends micro-batch k's activations to (s+1)*T + t, which receives them from s*T + t (the
  activations between blocks are replicated within a TP group, so each TP rank hands on its own
  copy);
- parameters live on the stages that use them, under their sequential names, with their TP
  layout declared over the `tp` mesh dim (a shard or partial gets `"over": "tp"`, a replica stays
  one); ranks that lack a parameter are skipped (docs/model-dir.md);
- the logits, a replica, are an output of the last stage's T ranks only.

How it is captured: stage s's TP rank 0 is built and captured as rank 0 of a fake process group of
T ranks (its collectives over 0..T-1, its sends and receives already naming global peers), by
refine.exporters.capture.export's rank capture (`_capture_rank`, in forked workers while this process captures the
sequential model); the stage's other TP ranks are copies of it sending to and receiving from their
own TP position (`tp_copy`; `capture_every_rank` captures each instead, and the tests check that
both give the same files). Each program's groups are then moved to stage s's TP group by
mesh.remap_ranks (peers left as they are), exactly as mesh.py moves a TP program to its mesh row. Every layer is inline by
default, as in exporters/strategies/pipeline.py; with `functions` each distinct layer is one ONNX local function
per program (exporters/capture/layers.py), so that a capture costs one layer per distinct layer, not one per
layer of the stage (see export_pipeline_mesh for what refine makes of those). Layouts are read off
what DTensor placed on each stage's T ranks (refine.exporters.capture.layouts.held_layout) and must agree between
the stages that hold a parameter (GPT-2's tied embedding, a replica on the first and the last stage).

What refine proves of it today: with one micro-batch, the flat export VERIFIES. With M > 1, each
stage computes on a batch slice of the sequential activations while its weights are TP shards, a
composite (a slice of a shard) that refine states only through batch windows (rules/windows.lp),
which lowering seeds from inputs sharded over a mesh dim, not from a program's own micro-batch
slices: such exports are UNPROVEN at the first column-parallel MatMul until lowering seeds a window
for them (`window_seed(seq:input_ids, 0, M)`, with which they verify).

Bug twins: the pipeline bugs of exporters/strategies/pipeline.py (PIPELINE_BUGS, BUGS.md class 13), injected
into the stages as there; `pp_wrong_tp_peer` (PP x TP only) makes each TP rank of stage 0 send to the
next TP position of stage 1, which still receives from its own: sends nobody receives, refuted as
calls that cannot run together (the report names the unmatched Send); its first failing sequential
node is the next stage's first layer norm, whose input no received tensor relates to.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from math import prod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from refine.exporters.zoo.configs import ZooConfig, validate
from refine.exporters.errors import ExportError
from refine.config import Mesh
from refine.exporters.capture.layouts import REP, LayoutJson, Piece, held_layout, match_name, module_fqn
from refine.exporters.strategies.pipeline import PipelineBug, pipeline_bug, stage_layers, stage_outputs, stage_tp_module, validate_pipeline
from refine.version import framework_versions

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult, _RankJob

DIMS = ("pp", "tp")
LOGITS = "logits"


def validate_pipeline_mesh(model: str, config: str, pp: int, tp: int, micro_batches: int, *, layers: int | None = None,
                           meta: bool = False, bug: str | None = None, batch: int | None = None) -> ZooConfig:
    """The config (with `batch` rows if given), if `tp` splits the model (its TP plan) and `pp`
    stages and `micro_batches` split its layers and batch (and `bug` applies); an ExportError
    naming the clash otherwise."""
    if tp < 2:
        raise ExportError(f"a PP x TP mesh needs --tp 2 or more, got {tp} (--pp alone is pipeline parallelism)")
    validate(model, config, tp, False, layers=layers, meta=meta)
    return validate_pipeline(model, config, pp, micro_batches, layers=layers, meta=meta, bug=bug, batch=batch, tp=tp)


def mesh_json(pp: int, tp: int) -> dict[str, Any]:
    """refine.json's `mesh`: P stages (pp) of T ranks (tp)."""
    return {"shape": [pp, tp], "dims": list(DIMS)}


def stage_group(stage: int, tp: int) -> list[int]:
    """Stage `stage`'s TP group: global ranks s*T .. s*T+T-1."""
    return [stage * tp + t for t in range(tp)]


# --- capture: every stage's T programs, in forked workers ----------------------------------------

_JOBS: list[_RankJob] = []  # one per stage (set in the parent before forking)


def _capture(stage: int, tp_rank: int, args: tuple) -> tuple[onnx.ModelProto, dict[str, Piece], dict, float]:
    from refine.exporters.capture import export as api

    return api._capture_rank(_JOBS[stage], tp_rank, args)


@contextlib.contextmanager
def _stage_runner(jobs: list[_RankJob], workers: int) -> Iterator[Any]:
    """submit(stage, t, args) -> a handle; get(handle) -> (model, pieces, steps, seconds)
    (api.capture_pool, the stages' jobs set for the workers to inherit)."""
    from refine.exporters.capture import export as api

    _JOBS[:] = jobs
    try:
        with api.capture_pool(_capture, workers) as runner:
            yield runner
    finally:
        _JOBS.clear()


# --- the other TP ranks of a stage: copies of its TP rank 0 --------------------------------------


def tp_copy(program: onnx.ModelProto, pieces: dict[str, Piece], steps: dict, seconds: float, tp_rank: int,
            tp: int) -> tuple[onnx.ModelProto, dict[str, Piece], dict, float]:
    """TP rank `tp_rank`'s capture made from TP rank 0's of the same stage, exported on the meta
    device (a copy holds no weight data, so no chunk of the wrong rank) (still in the T-rank
    coordinates of its capture: groups 0..T-1, global peers): the program with every Send/Recv peer
    moved on by `tp_rank` TP positions within its stage, and what the rank holds of each parameter (a shard: the
    chunk at its position). An ExportError where a piece is not an even chunk that a copy can move
    (capture every rank then)."""
    from refine.exporters.strategies.mesh import _dist_nodes

    model = onnx.ModelProto()
    model.CopyFrom(program)
    for node in _dist_nodes(model):
        for att in node.attribute:
            if att.name == "peer":  # TP position p of its stage -> p + tp_rank (mod T)
                peer = att.i // tp * tp + (att.i % tp + tp_rank) % tp
                for entry in node.metadata_props:  # the traced call, as torch would have written it
                    if entry.key == "pkg.torch.onnx.fx_node":
                        entry.value = re.sub(rf"(args = \(%[\w.]+, ){att.i}(, )", rf"\g<1>{peer}\g<2>", entry.value,
                                             count=1)
                att.i = peer
    return model, {name: _piece_at(name, piece, tp_rank, tp) for name, piece in pieces.items()}, steps, 0.0


def _piece_at(name: str, piece: Piece, tp_rank: int, tp: int) -> Piece:
    """What TP rank `tp_rank` holds where TP rank 0 holds `piece`."""
    if piece.kind in ("plain", "rep", "partial"):
        return piece
    axis = piece.axis
    if piece.kind != "shard" or axis is None or piece.stride != 1 or any(piece.offset) \
            or piece.local_shape[axis] * tp != piece.global_shape[axis]:
        raise ExportError(f"{name}: {piece.placement} is not an even chunk a copy of TP rank 0 can move; "
                          "capture every rank")
    offset = tuple(tp_rank * piece.local_shape[axis] if i == axis else 0 for i in range(len(piece.offset)))
    return replace(piece, offset=offset)


# --- the export ----------------------------------------------------------------------------------


@dataclass
class StageWeights:
    """The parameters of a pipeline mesh's rank programs (a mesh with a `pp` and a `tp` dim, and
    any others along which the stages' weights are replicas), renamed as the sequential ones they
    are pieces of (`take`), and who holds which piece."""

    seq_shapes: dict[str, tuple[int, ...]]  # sequential parameter -> its shape
    mesh: Mesh
    held: dict[str, dict[int, dict[int, Piece]]] = field(default_factory=dict)  # seq name -> stage -> rank -> piece
    name_map: dict[str, str] = field(default_factory=dict)  # seq name -> a rank's own name of it
    unmatched: set[str] = field(default_factory=set)  # rank parameters the sequential model has no match for

    def take(self, rank: int, program: onnx.ModelProto, pieces: dict[str, Piece],
             also: Callable[[str, str], dict[str, str]] | None = None) -> None:
        """Rename rank `rank`'s parameters in `program` as the sequential ones (and, with `also`,
        the values it names for each (rank fqn, sequential name): a training step's gradients); an
        ExportError where a piece stands for a tensor of another shape."""
        from refine.exporters.capture import export as api
        from refine.exporters.capture.rename import rename_values

        stage = self.mesh.coordinates(rank)["pp"]
        renames: dict[str, str] = {}
        for name in api._weights(program, set(pieces)):
            fqn = module_fqn(name)
            seq_name = match_name(fqn, self.seq_shapes)
            if seq_name is None:
                self.unmatched.add(fqn)
                continue
            if pieces[fqn].global_shape != self.seq_shapes[seq_name]:
                raise ExportError(f"rank {rank}'s {fqn} stands for a tensor of shape {list(pieces[fqn].global_shape)}, "
                                  f"the sequential {seq_name} has shape {list(self.seq_shapes[seq_name])}")
            renames[name] = seq_name
            renames.update(also(fqn, seq_name) if also is not None else {})
            self.name_map[seq_name] = name
            self.held.setdefault(seq_name, {}).setdefault(stage, {})[rank] = pieces[fqn]
        rename_values(program, renames)

    def take_copy(self, rank: int, of: int) -> None:
        """Rank `rank` holds what rank `of` holds (a DP row's copy of its row-0 counterpart, whose
        program is row 0's with its groups moved: `take` of it would record the same pieces)."""
        stage = self.mesh.coordinates(rank)["pp"]
        for by_stage in self.held.values():
            pieces = by_stage.get(stage, {})
            if of in pieces:
                pieces[rank] = pieces[of]

    def layouts(self) -> dict[str, LayoutJson]:
        """Each parameter's layout over the mesh, as capture derives any layout over a mesh dim
        (refine.exporters.capture.layouts.held_layout): a TP split `over` tp, on every line along
        tp holding it alike (an ExportError where a line lacks a TP rank's piece or lays it out
        otherwise)."""
        world = prod(self.mesh.shape)
        out: dict[str, LayoutJson] = {}
        for seq_name in sorted(self.held):
            by_rank = {r: replace(p, over="tp") if p.kind in ("shard", "partial") else p
                       for by_r in self.held[seq_name].values() for r, p in by_r.items()}
            out[seq_name] = held_layout(seq_name, by_rank, world, self.mesh)
        return out


def export_pipeline_mesh(
    model: str,
    config: str,
    pp: int,
    tp: int,
    micro_batches: int,
    out: Path | str,
    seed: int = 0,
    *,
    layers: int | None = None,
    meta: bool = False,
    functions: bool = False,
    batch: int | None = None,
    bug: str | None = None,
    workers: int | None = None,
    capture_every_rank: bool | None = None,
) -> ExportResult:
    """Export a zoo model (gpt2, llama, qwen2) as `pp` pipeline stages of `tp` tensor-parallel ranks
    each, running `micro_batches` micro-batches in GPipe order (module doc), to the model directory
    `out`; `bug` (refine.exporters.strategies.pipeline.PIPELINE_BUGS) injected into the stages. `layers` overrides the
    config's depth, `batch` its batch rows, `meta` exports without weight data, `workers` as in
    `refine.exporters.export`.

    With `meta` (no weight data), each stage's TP rank 0 is captured and its other TP ranks are
    copies of it (`tp_copy`: the same program, sending to and receiving from their own TP position;
    DTensor's even TP shards make the T programs of a stage identical but for that);
    `capture_every_rank` (default: without `meta`, where each rank stores its own chunk of the
    weights) captures each of the P*T ranks instead (tests/test_pipeline_export.py checks that both
    give the same files).

    `functions`: each distinct layer one ONNX local function per program (exporters/capture/layers.py), so
    that the export's cost does not grow with depth; refine's memoization pairs layer calls by
    their position in every program (refine/lowering/program.py), which a pipeline's stages do not
    share, so such an export does not verify memoized yet (`refine verify --no-memo` inlines the
    calls). Default: every layer inline, as exporters/strategies/pipeline.py exports."""
    from refine.exporters.capture import export as api
    from refine.exporters.zoo import plans, models as zoo
    from refine.exporters.capture.tracing import prepare_tracing, set_metadata
    from refine.exporters.strategies.mesh import remap_ranks
    from refine.config import ModelConfig

    cfg = validate_pipeline_mesh(model, config, pp, tp, micro_batches, layers=layers, meta=meta, bug=bug, batch=batch)
    injected: PipelineBug | None = pipeline_bug(bug, micro_batches, tp) if bug is not None else None
    out = Path(out)
    api._check_out_dir(out)  # before the slow part
    prepare_tracing()
    stack = plans.layer_stack(model) if functions else None
    start = time.perf_counter()
    args = tuple(zoo.example_inputs(model, config, seed, meta=meta, batch=cfg.batch))
    jobs = [api._RankJob(functools.partial(stage_tp_module, model, config, seed, s, pp, micro_batches, tp,
                                           layers=layers, meta=meta, bug=injected),
                         tp, [LOGITS], stack, rank_output_names=functools.partial(
                             lambda stage, _t: stage_outputs(stage, pp, micro_batches), s))
            for s in range(pp)]
    if capture_every_rank is None:
        capture_every_rank = not meta
    elif not capture_every_rank and not meta:
        raise ExportError("copies of TP rank 0 hold its weights: with weight data, capture every rank")
    captures = range(tp) if capture_every_rank else range(1)  # TP positions captured per stage
    # built before the workers fork (building traces nothing), so that they inherit the model code
    # imported, not import it each
    seq_module = zoo.build(model, config, seed, layers=layers, meta=meta).eval()
    with _stage_runner(jobs, api._worker_count(workers, pp * len(captures))) as (submit, get):
        handles = [submit(s, t, args) for s in range(pp) for t in captures]
        seq_steps: dict[str, Any] = {}
        seq = api._capture(seq_module, args, [LOGITS], None, stack, False, seq_steps)
        seq_seconds = time.perf_counter() - start
        captured = [get(h) for h in handles]  # rank s*T + t, or with copies stage s's TP rank 0
    if not capture_every_rank:
        captured = [tp_copy(*captured[s], t, tp) if t else captured[s] for s in range(pp) for t in range(tp)]
    seq_fqns = api._module_fqns(seq_module)
    seq_shapes = api._weights(seq, seq_fqns)
    user_inputs = api._user_inputs(seq, seq_fqns)

    ranks: list[onnx.ModelProto] = []
    weights = StageWeights(seq_shapes, Mesh.model_validate(mesh_json(pp, tp)))
    for rank, (program, pieces, _steps, _seconds) in enumerate(captured):
        stage = rank // tp
        weights.take(rank, program, pieces)
        taken = api._user_inputs(program, set(seq_shapes) | set(pieces))
        if taken != user_inputs:
            raise ExportError(f"rank {rank} takes inputs {taken}, the sequential model {user_inputs}")
        remap_ranks(program, tp, stage, peers=False)  # TP rank t's groups 0..T-1 -> stage s's TP group
        set_metadata(program, world_size=pp * tp, rank=rank)
        ranks.append(program)

    inputs: dict[str, LayoutJson] = {name: {**REP, "range": [0, cfg.vocab]} if name == "input_ids" else dict(REP)
                                     for name in user_inputs}
    inputs.update(weights.layouts())
    holders = [r for r, m in enumerate(ranks) if any(o.name == LOGITS for o in m.graph.output)]
    if holders != stage_group(pp - 1, tp):
        raise ExportError(f"the logits are an output of ranks {holders}, not of the last stage's {stage_group(pp - 1, tp)}")
    outputs = {LOGITS: dict(REP)}  # a replica on the last stage's ranks

    depth = (f", {cfg.layers} layers" if layers is not None else "") + (f", batch {cfg.batch}" if batch else "")
    split = ", ".join(f"{r.start}..{r.stop - 1}" for r in stage_layers(cfg.layers, pp))
    refine_json: dict[str, Any] = {
        "world_size": pp * tp, "mesh": mesh_json(pp, tp), "inputs": inputs, "outputs": outputs,
        "description": f"{model} config {config!r}{depth}, PP {pp} x TP {tp} on a {pp} x {tp} mesh (stages: layers "
        f"{split}; the TP plan within each stage, stages passing activations between the same TP position), "
        f"{micro_batches} micro-batch{'es' if micro_batches > 1 else ''} in GPipe order, forward, exported by "
        "exporters/strategies/pipeline_mesh.py" + (" (meta: no weight data)" if meta else "")
        + (api.bug_words(injected) if injected is not None else ""),
    }
    ModelConfig.model_validate(refine_json)
    seconds, rank_steps = api.finish_programs(seq, ranks, captured, seq_seconds, seq_steps, start)
    manifest = {
        "exporter": "refine exporters",
        **framework_versions("torch", "transformers", "megatron-core", "onnx", "onnxscript"),
        "zoo": {"model": model, "config": config, "mesh": {"pp": pp, "tp": tp}, "micro_batches": micro_batches,
                "batch": cfg.batch, "seed": seed, "layers": layers, "meta": meta, "flat": not functions, "bug": bug, "train": False},
        "world_size": pp * tp,
        "mesh": mesh_json(pp, tp),
        "inputs": {n: api._input_spec(a, cfg.vocab if n == "input_ids" else None) for n, a in zip(user_inputs, args)},
        "outputs": outputs,
        "rank_names": {k: weights.name_map[k] for k in sorted(weights.name_map) if weights.name_map[k] != k},
        "unmatched_rank_tensors": sorted(weights.unmatched),
        "undeclared_seq_initializers": sorted(set(seq_shapes) - weights.held.keys()),
        "meta": meta,
        "train": False,
        "layers": api._layers_manifest(stack, seq_steps, rank_steps),
        "seconds": seconds,
    }
    api._write(out, seq, ranks, refine_json, manifest)
    return api.ExportResult(out, refine_json, manifest, seconds, api.op_counts(ranks[0]))
