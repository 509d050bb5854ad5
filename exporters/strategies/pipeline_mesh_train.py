"""Pipeline x tensor parallelism training steps (`refine export --pp P --tp T --micro-batches M --train`).

The P*T ranks form the mesh `{"shape": [P, T], "dims": ["pp", "tp"]}` of exporters/strategies/pipeline_mesh.py:
global rank r = s*T + t is TP rank t of pipeline stage s. Each rank runs the pipeline training step
of exporters/strategies/pipeline_train.py (GPipe or 1F1B order, the backward per micro-batch, parameter
gradients accumulated over the micro-batches, the loss normalised by the whole batch's counted
tokens) on its stage's layers parallelized by the zoo's TP plan (exporters/zoo/plans.py, DTensor), so:

- the TP plan's forward and backward collectives run over the stage's own TP group {s*T .. s*T+T-1}
  (the backward as exporters/capture/train.py traces it: DTensor's redistributions, a replicated input's
  partial gradient all-reduced by `from_local`'s backward);
- activations go forward and their gradients back by Send/Recv between the same TP position of
  consecutive stages (rank s*T + t with (s+1)*T + t): the activations between blocks and their
  gradients are replicas within a TP group, so each TP rank hands on its own copy;
- the tied embedding (GPT-2's wte = lm_head, a replica under the TP plan): TP rank t of the first
  stage holds the gradient through the lookup, TP rank t of the last stage the gradient through the
  LM head; the two all-reduce it with sum over their embedding group {t, (P-1)*T + t} (Megatron's
  embedding group, one per TP position);
- every parameter's gradient is an output `grad.<fqn>` of the ranks that hold the parameter,
  declared with the parameter's layout over the mesh (a shard `"over": "tp"`, a replica); the loss
  is an output of the last stage's T ranks, a replica.

How it is captured: each rank is built and traced (exporters/capture/train.py's make_fx over eager autograd,
the stage's own `training_step`) in a fake process group of the whole P*T world, its TP plan on the
`tp` dim of a (pp, tp) DeviceMesh, so every collective names its global group as it is. Every layer
is inline (no layer functions yet). Each rank stores its own chunk of the weights, so each is
captured (no copies of TP rank 0 as the forward's --meta export makes).

With `dp` or `cp` (exporters/strategies/mesh4d.py), the mesh gains those dims: each rank takes its
batch rows and sequence slice, and the token count, the loss and every gradient are all-reduced
over its stage's data group (the ranks holding the same TP piece of the same stage).

Bug twins: the pipeline training bugs of exporters/strategies/pipeline.py (PIPELINE_BUGS with `train`),
injected into every stage as in exporters/strategies/pipeline_train.py; and the mesh's own
(mesh4d.MESH_BUGS: with a data group, gradients averaged after the global normalisation, a local
token count; inside a stage, K/V gathered over the dp line, RoPE positions not offset, a TP
all-reduce left out).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import torch
from torch import nn

from refine.exporters.zoo.configs import ZooConfig
from refine.exporters.strategies.data_parallel import IGNORE_INDEX, example_labels
from refine.exporters.errors import ExportError
from refine.exporters.capture.layouts import REP, LayoutJson, Piece
from refine.exporters.strategies.pipeline import GPT2Stage, LlamaStage, PipelineBug, Stage, stage_layers
from refine.exporters.strategies.mesh4d import (ContextLlamaStage, MeshPeers, MeshShape, mesh_bug, new_groups,
                                                rank_inputs, sequential_model, validate_mesh_shape)
from refine.exporters.strategies.pipeline_mesh import StageWeights, validate_pipeline_mesh
from refine.exporters.capture.pipeline_step import step_class
from refine.exporters.strategies.pipeline_train import SCHEDULES, tied_parameters
from refine.version import framework_versions

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

LABELS = "labels"


def validate_pipeline_mesh_train(model: str, config: str, pp: int, tp: int, micro_batches: int, *,
                                 layers: int | None = None, meta: bool = False, bug: str | None = None,
                                 batch: int | None = None, order: str = "gpipe", dp: int = 1,
                                 cp: int = 1) -> ZooConfig:
    """The config if a PP x TP (x DP x CP) training step of it can be exported; an ExportError
    naming the first clash otherwise (before anything is captured)."""
    if order not in SCHEDULES:
        raise ExportError(f"unknown pipeline schedule {order!r}: one of {', '.join(SCHEDULES)}")
    mesh = MeshShape(pp=pp, tp=tp, dp=dp, cp=cp)
    if bug is not None:
        mesh_bug(bug, micro_batches, mesh)
        if bug == "pp_1f1b_send_first" and order != "1f1b":
            raise ExportError("pipeline bug 'pp_1f1b_send_first' is a 1F1B bug: pass --schedule 1f1b")
        if bug == "pp_tied_grad_not_reduced" and model != "gpt2":  # (else nothing to inject: the twin would be the stock step)
            raise ExportError(f"pipeline bug 'pp_tied_grad_not_reduced' needs a tied embedding (gpt2): {model}'s LM "
                              "head is a weight of its own")
    cfg = validate_pipeline_mesh(model, config, pp, tp, micro_batches, layers=layers, meta=meta, batch=batch)
    validate_mesh_shape(model, cfg.seq_len, cfg.batch, mesh, micro_batches)
    return cfg


def stage_train_tp_module(model: str, config: str, seed: int, rank: int, *, mesh: MeshShape, micro_batches: int,
                          layers: int | None = None, meta: bool = False, bug: PipelineBug | None = None,
                          order: str = "gpipe") -> nn.Module:
    """Global rank `rank`'s training step (module doc; exporters/strategies/mesh4d.py on a mesh
    with dp or cp): its stage's blocks of the zoo model built from `seed`, in a (fake) process
    group of the whole mesh, parallelized by the zoo's TP plan on the `tp` dim of the DeviceMesh,
    cut to the stage."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from refine.exporters.zoo import plans, models as zoo

    where = mesh.coordinates(rank)
    stage, tp_rank, stages = where["pp"], where["tp"], mesh.pp
    # only this rank's TP line as a DeviceMesh (the whole mesh's would make a group for every line of
    # every dim, in each rank's capture: about 11,500 at 16,384 ranks)
    tp_mesh = DeviceMesh("cpu", torch.tensor(mesh.line(rank, "tp")), mesh_dim_names=("tp",))
    over_dp = bug is not None and bug.name == "mesh_cp_gather_over_dp"  # BUG: K/V gathered over the dp line
    cp_group = new_groups(mesh, rank, "dp" if over_dp else "cp") if mesh.cp > 1 else None
    data_group = new_groups(mesh, rank, "dp", "cp") if mesh.dp * mesh.cp > 1 else None
    full = zoo.build(model, config, seed, layers=layers, meta=meta)
    tied = tied_parameters(full)
    prefix = plans.layer_stack(model)
    blocks = set(Stage.blocks_of(stage, stages, len(full.get_submodule(prefix)), bug))
    plan = {key: style for key, style in plans.make_plan(model, full, False).items()
            if not key.startswith(prefix + ".") or int(key[len(prefix) + 1:].split(".")[0]) in blocks}  # its blocks'
    if bug is not None and bug.name == "mesh_tp_reduce_missing" and stage == stages - 1:  # BUG: left partial
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor.parallel import RowwiseParallel

        plan[f"{prefix}.{min(blocks)}.self_attn.o_proj"] = RowwiseParallel(output_layouts=Partial())
    parallelize_module(full, tp_mesh, plan, src_data_rank=None)
    stage_class = _stage_class(GPT2Stage if model == "gpt2" else ContextLlamaStage if mesh.cp > 1 else LlamaStage)
    context = dict(cp=mesh.cp, cp_rank=where["cp"], cp_group=cp_group) if mesh.cp > 1 else {}
    module = stage_class(full, stage, stages, micro_batches, bug, mesh.tp, tp_rank, **context)
    module.mesh, module.global_rank = mesh, rank  # type: ignore[assignment]
    # the embedding group: the first and last stage's ranks at this (dp, cp, tp) position
    group = new_groups(mesh, rank, "pp", ends=True) if tied else None
    module.__class__ = step_class(stage_class)
    module.bug = bug  # type: ignore[assignment]
    module.schedule = order  # type: ignore[assignment]
    module.tied = tuple(fqn for fqn in dict(module.named_parameters()) if fqn in tied)  # type: ignore[assignment]
    module.embedding_group = group if module.tied else None  # type: ignore[assignment]
    module.data_group = data_group  # type: ignore[assignment]
    return module.eval()


@functools.cache
def _stage_class(stage_class: type) -> type:
    """`stage_class` sending to and receiving from its mesh position's peers (mesh4d.MeshPeers)."""
    return type(f"Mesh{stage_class.__name__}", (MeshPeers, stage_class), {})


def stage_pieces(module: nn.Module, tp_group: list[int], tp_rank: int) -> dict[str, Piece]:
    """FQN -> what TP rank `tp_rank` of the TP group `tp_group` (global ranks) holds of each
    parameter and buffer, in TP coordinates (a DTensor's piece on that group;
    refine.exporters.capture.layouts.rank_pieces reads a mesh of ranks 0..T-1 only)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from refine.exporters.capture.layouts import _piece

    out: dict[str, Piece] = {}
    for name, value in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        data = value.data if isinstance(value, nn.Parameter) else value
        if not isinstance(data, DTensor):
            out[name] = _piece(data, tp_rank, len(tp_group))
            continue
        mesh = data.device_mesh
        if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != tp_group or mesh.get_coordinate() != (tp_rank,):
            raise ExportError(f"{name}: a DTensor on mesh {mesh.mesh.tolist()}, not the TP group {tp_group} at "
                              f"position {tp_rank}")
        local_shape, offset = compute_local_shape_and_global_offset(data.shape, mesh, data.placements)
        (placement,) = data.placements
        common = dict(global_shape=tuple(data.shape), local_shape=tuple(int(d) for d in local_shape),
                      offset=tuple(int(o) for o in offset), placement=str(placement))
        if isinstance(placement, Replicate):
            out[name] = Piece("rep", **common)  # type: ignore[arg-type]
        elif isinstance(placement, Shard):
            out[name] = Piece("shard", axis=placement.dim % max(1, data.dim()), **common)  # type: ignore[arg-type]
        elif isinstance(placement, Partial):
            out[name] = Piece("partial", reduce_op=str(placement.reduce_op), **common)  # type: ignore[arg-type]
        else:
            raise ExportError(f"{name}: DTensor placement {placement} has no refine.json layout")
    return out


# --- capture: every rank, in forked workers --------------------------------------------------------

_JOB: dict[str, Any] = {}  # factory, mesh (set in the parent before forking)


def _capture(rank: int, args: tuple) -> tuple[onnx.ModelProto, dict[str, Piece], dict, float]:
    """Global rank `rank`'s training step, built and traced in a fake process group of the whole world."""
    from refine.exporters.capture import export as api
    from refine.exporters.capture.tracing import fake_process_group
    from refine.exporters.capture.collectives import translation_table

    start = time.perf_counter()
    steps: dict[str, Any] = {}
    mesh: MeshShape = _JOB["mesh"]
    with fake_process_group(rank, mesh.world):
        module = _JOB["factory"](rank)
        built = time.perf_counter() - start
        pieces = stage_pieces(module, mesh.line(rank, "tp"), mesh.coordinates(rank)["tp"])
        model = api._capture(module, args, [], translation_table(), _JOB["stack"], True, steps)
    steps["seconds"] = {"build": built, **steps["seconds"]}
    return model, pieces, steps, time.perf_counter() - start


@contextlib.contextmanager
def _runner(factory: Callable[[int], nn.Module], mesh: MeshShape, workers: int, stack: str | None) -> Iterator[Any]:
    """submit(rank, args) -> a handle; get(handle) -> (model, pieces, steps, seconds)
    (api.capture_pool, the job set for the workers to inherit; `stack`: the ModuleList whose
    distinct layers become functions, or None)."""
    from refine.exporters.capture import export as api

    _JOB.update(factory=factory, mesh=mesh, stack=stack)
    try:
        with api.capture_pool(_capture, workers) as runner:
            yield runner
    finally:
        _JOB.clear()


def batch_layout(mesh: MeshShape) -> LayoutJson:
    """The layout of the [batch, sequence] inputs on the mesh: batch rows over dp, then the
    sequence over cp (a replica where neither is split)."""
    cuts = [(axis, dim) for axis, dim in ((0, "dp"), (1, "cp")) if mesh.size(dim) > 1]
    if not cuts:
        return dict(REP)
    (axis, over), *then = cuts
    return {"layout": "shard", "axis": axis, "over": over,
            **({"then": {"axis": then[0][0], "over": then[0][1]}} if then else {})}


def _param(grad: str) -> str:
    from refine.exporters.capture.train import GRAD_PREFIX

    return grad.removeprefix(GRAD_PREFIX)


# --- the export ------------------------------------------------------------------------------------


def export_pipeline_mesh_train(
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
    batch: int | None = None,
    bug: str | None = None,
    workers: int | None = None,
    order: str = "gpipe",
    dp: int = 1,
    cp: int = 1,
    functions: bool = False,
) -> ExportResult:
    """Export one training step of a zoo model (gpt2, llama, qwen2) as `pp` pipeline stages of `tp`
    tensor-parallel ranks each, `micro_batches` micro-batches in `order` (gpipe or 1f1b), to the
    model directory `out` (module doc); with `dp` or `cp`, on a PP x DP x CP x TP mesh
    (exporters/strategies/mesh4d.py: the batch rows over dp, the sequence over cp, the loss and
    gradients reduced over the data group). `bug` (a training bug of
    refine.exporters.strategies.pipeline.PIPELINE_BUGS) is injected into the stages. `layers`
    overrides the config's depth, `batch` its batch rows, `meta` exports without weight data
    (parameters typed graph inputs: shapes only, for big configs; every rank of DP row 0 is still captured),
    `workers` as in `refine.exporters.export`. `functions`: each distinct layer one forward and one
    backward ONNX local function per program (exporters/capture/train_layers.py), so that lowering
    and the solver work per distinct layer (docs/layers.md); else every layer inline."""
    from refine.exporters.capture import export as api
    from refine.exporters.zoo import models as zoo, plans
    from refine.exporters.capture import train as training
    from refine.exporters.capture.tracing import prepare_tracing, set_metadata
    from refine.config import Mesh

    cfg = validate_pipeline_mesh_train(model, config, pp, tp, micro_batches, layers=layers, meta=meta, bug=bug,
                                       batch=batch, order=order, dp=dp, cp=cp)
    mesh = MeshShape(pp=pp, tp=tp, dp=dp, cp=cp)
    injected = mesh_bug(bug, micro_batches, mesh) if bug is not None else None
    out = Path(out)
    api._check_out_dir(out)  # before the slow part
    prepare_tracing()
    start = time.perf_counter()
    input_ids, labels = zoo.example_inputs(model, config, seed, meta=meta, labels=True, batch=cfg.batch)
    # some tokens ignored, unevenly between the DP rows' micro-batches
    args = (input_ids, example_labels(labels, dp * micro_batches))
    world = mesh.world
    factory = functools.partial(stage_train_tp_module, model, config, seed, mesh=mesh,
                                micro_batches=micro_batches, layers=layers, meta=meta, bug=injected, order=order)
    # built before the workers fork (building traces nothing), so that they inherit the model code imported
    seq_module = sequential_model(model, zoo.build(model, config, seed, layers=layers, meta=meta), mesh).eval()
    # the DP rows run the same programs on their own batch rows: without a bug (which may single
    # out a row), row dp=0 is captured and the other rows are its copies (docs/rows.md)
    copied = mesh.dp > 1 and injected is None
    counterpart = [mesh.rank({**mesh.coordinates(r), "dp": 0}) if copied else r for r in range(world)]
    stack = plans.layer_stack(model) if functions else None
    with _runner(factory, mesh, api._worker_count(workers, world), stack) as (submit, get):
        handles = {r: submit(r, rank_inputs(mesh, r, *args)) for r in sorted(set(counterpart))}
        seq_steps: dict[str, Any] = {}
        seq = api._capture(seq_module, args, [], None, stack, True, seq_steps)
        seq_seconds = time.perf_counter() - start
        own = {r: get(h) for r, h in handles.items()}
    # (a copy is never materialised: its counterpart's program, pieces and steps stand for it until
    # the files are written, each copy then made from the final row-0 program and written at once)
    captured = [own[r] if r == counterpart[r] else (None, *own[counterpart[r]][1:3], 0.0) for r in range(world)]
    names = training.output_names(seq_module)  # loss, grad.<fqn> per parameter
    seq_fqns = api._module_fqns(seq_module)
    seq_shapes = api._weights(seq, seq_fqns)
    user_inputs = api._user_inputs(seq, seq_fqns)

    ranks: list[onnx.ModelProto | None] = []
    weights = StageWeights(seq_shapes, Mesh.model_validate(mesh.json()))
    held = weights.held
    for rank, (program, pieces, _steps, _seconds) in enumerate(captured):
        if program is None:  # (a copy holds what its row-0 counterpart, taken before it, holds)
            weights.take_copy(rank, counterpart[rank])
            ranks.append(None)
            continue
        weights.take(rank, program, pieces, also=lambda fqn, seq_name: {training.grad_name(fqn): training.grad_name(seq_name)})
        taken = api._user_inputs(program, set(seq_shapes) | set(pieces))
        if taken != user_inputs:
            raise ExportError(f"rank {rank} takes inputs {taken}, the sequential model {user_inputs}")
        set_metadata(program, world_size=world, rank=rank)
        ranks.append(program)

    inputs: dict[str, LayoutJson] = {name: dict(REP) for name in user_inputs}
    inputs["input_ids"] = {**batch_layout(mesh), "range": [0, cfg.vocab]}
    # labels may take the ignore index, so that counterexamples meet micro-batches that count differently
    inputs[LABELS] = {**batch_layout(mesh), "range": [0, cfg.vocab], "also": [IGNORE_INDEX]}
    inputs.update(weights.layouts())
    layouts = training.output_layouts(names, inputs)  # each gradient laid out as its parameter
    # refine.json declares a split output only where every rank holds a piece (docs/model-dir.md): the
    # gradient of a parameter split over tp on some stages is left undeclared there (refine then takes
    # any reconstruction in which every rank holding it takes part); export.json keeps its layout,
    # which refine.exporters.check compares along each TP group holding it
    outputs = {name: lay for name, lay in layouts.items() if lay["layout"] == "rep" or len(held[_param(name)]) == pp}
    for name in names:
        holders = [r for r in range(world) if any(o.name == name for o in ranks[counterpart[r]].graph.output)]  # type: ignore[union-attr]
        if not holders:
            raise ExportError(f"output {name!r} is an output of no rank")
        last = mesh.line(world - 1, "dp", "cp", "tp")
        if name == training.LOSS and holders != last:
            raise ExportError(f"the loss is an output of ranks {holders}, not of the last stage's {last}")

    depth = (f", {cfg.layers} layers" if layers is not None else "") + (f", batch {cfg.batch}" if batch else "")
    split = ", ".join(f"{r.start}..{r.stop - 1}" for r in stage_layers(cfg.layers, pp))
    refine_json: dict[str, Any] = {
        "world_size": world, "mesh": mesh.json(), "inputs": inputs, "outputs": outputs,
        "description": f"{model} config {config!r}{depth}, {mesh.words()} on a "
        f"{' x '.join(map(str, mesh.json()['shape']))} mesh (stages: layers {split}; the TP plan and its backward "
        "within each stage, activations and their gradients passed between the same mesh position"
        + ("; the batch rows over dp, the sequence over cp (keys and values all-gathered), the loss's token count, "
           "the loss and the gradients all-reduced over each stage's dp x cp ranks" if dp * cp > 1 else "")
        + f"), {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} in "
        f"{'GPipe' if order == 'gpipe' else '1F1B'} order, one training step (loss normalised by the batch's token "
        "count, gradients accumulated over the micro-batches"
        + (", the tied embedding's all-reduced over the first and last stage's ranks at each TP position"
           if model == "gpt2" else "")
        + "), exported by exporters/strategies/pipeline_mesh_train.py" + (" (meta: no weight data)" if meta else "")
        + (api.bug_words(injected) if injected is not None else ""),
    }
    if copied:  # (the other rows' files are not written: refine.json declares them row 0's copies)
        refine_json["row_copies"] = {"dim": "dp"}
    seconds, rank_steps = api.finish_programs(seq, ranks, captured, seq_seconds, seq_steps, start)
    manifest = {
        "exporter": "refine exporters",
        **framework_versions("torch", "transformers", "megatron-core", "onnx", "onnxscript"),
        "zoo": {"model": model, "config": config, "mesh": {d: mesh.size(d) for d in mesh.dims},
                "micro_batches": micro_batches,
                "batch": cfg.batch, "seed": seed, "layers": layers, "meta": meta, "flat": not functions, "bug": bug,
                "train": True, **({"schedule": order} if order != "gpipe" else {})},
        "world_size": world,
        "mesh": mesh.json(),
        "inputs": {n: api._input_spec(a, cfg.vocab if n in ("input_ids", LABELS) else None, inputs[n].get("also"))
                   for n, a in zip(user_inputs, args)},
        "outputs": layouts,
        "rank_names": {k: weights.name_map[k] for k in sorted(weights.name_map) if weights.name_map[k] != k},
        "unmatched_rank_tensors": sorted(weights.unmatched),
        "undeclared_seq_initializers": sorted(set(seq_shapes) - held.keys()),
        "meta": meta,
        "train": True,
        "layers": api._layers_manifest(stack, seq_steps, rank_steps),
        "seconds": seconds,
    }
    api._write(out, seq, ranks, refine_json, manifest)
    return api.ExportResult(out, refine_json, manifest, seconds, api.op_counts(ranks[0]))  # type: ignore[arg-type]
