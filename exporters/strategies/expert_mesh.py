"""Expert parallelism x tensor parallelism on a 2-D mesh (`export_expert_mesh`: EP E x TP T), forward,
for the zoo Mixtral with grouped experts (exporters/strategies/expert.py's sequential model).

The E*T ranks form the mesh `{"shape": [E, T], "dims": ["ep", "tp"]}`, row-major: global rank
r = e*T + t sits at (ep=e, tp=t) (exporters/strategies/mesh.py's convention, EP rows of TP groups). The layout
is Megatron's for attention (tensor parallel within a TP group, the batch split between the TP
groups, data parallel) with the MoE experts sharded over an EP group that runs across the TP groups
(DeepSpeed-MoE's and Megatron's "expert tensor parallel size 1": the experts are not split within
a TP group):

- rank (e, t) takes the batch rows [e*B/E, (e+1)*B/E) (`input_ids` shard axis 0 over `ep`);
- attention is the zoo's TP plan (exporters/zoo/moe.py: q/k/v column-, o row-parallel, one all-reduce)
  on its TP group {e*T .. e*T+T-1} (mesh row e), so after attention every rank of the row holds
  the row's hidden states;
- each MoE block is exporters/strategies/expert.py's ExpertParallelMoE over the rank's EP group {t, T+t, ...}
  (mesh column t): it holds the experts [e*E'/E, (e+1)*E'/E) (E' experts: the stacked weights'
  chunk e along axis 0, declared `shard` axis 0 over `ep`), dispatches its row's tokens by
  all-to-all to the column's members, runs its experts, weighs their outputs with the routing
  columns of their global expert ids (the routing matrices all-gathered over the column) and
  combines them back by all-to-all. Every TP rank of a row runs the same MoE block on the same
  tokens, so its output is the row's MoE output on every rank of the row (a replica within the TP
  group: DeepSpeed-MoE before it learnt to drop the duplicate tokens), and the residual stream
  stays replicated within the row;
- the embedding, norms, router and head are replicated; the logits are each row's batch rows:
  `shard` axis 0 over `ep` (a replica within the row).

Every rank is captured on its own, in a fake process group of E*T ranks on a DeviceMesh (ep, tp)
(the attention plan on mesh["tp"], the MoE's collectives on mesh["ep"]'s group): the rows differ in
their expert chunk and in the routing columns they take, so they are not copies of each other.
refine.json declares each DTensor parameter's layout over the mesh dim of its DeviceMesh (read off
what DTensor placed, as refine.exporters.capture.layouts does on a 1-D mesh, and checked to be the same in every
line of that dim). The EP all-to-alls cross the rows, so refine verifies the whole plan (no row
symmetry: docs/rows.md).

Bug twins (`EXPERT_MESH_BUGS`): exporters/strategies/expert.py's `ep_global_expert_ids` (BUGS.md class 12,
each rank weighs its local expert i with routing column i, right on EP rank 0 only) and
`ep_combine_wrong_indices` (class 12, the combine's buffer not regrouped by destination), injected
into the mesh's MoE blocks; `ep_mesh_wrong_group` (class 11): every MoE block is handed the rank's TP
group instead of its EP group (its all-to-alls and routing all-gather run within the mesh row,
whose members hold the same tokens and the same experts; needs E = T, else the shapes differ).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import torch

from refine.exporters.zoo.configs import ZooConfig
from refine.exporters.errors import ExportError, PlanBug, named_bug
from refine.exporters.capture.layouts import REP, LayoutJson, Piece, derive_layout, match_name, module_fqn
from refine.version import framework_versions

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

DIMS = ("ep", "tp")
LOGITS = "logits"
BATCH_AXIS = 0


@dataclass(frozen=True)
class _Bug(PlanBug):
    """One injected EP x TP mistake, with its BUGS.md class."""

    bug_class: int  # type: ignore[misc]


EXPERT_MESH_BUGS: dict[str, _Bug] = {
    b.name: b for b in (
        _Bug("ep_global_expert_ids", "each rank weights its local expert i with routing column i (the local id) "
             "instead of the global id e*E/N + i", 12),
        _Bug("ep_combine_wrong_indices", "the combine sends the experts' outputs without regrouping them by "
             "destination rank: each rank sums rows of other rows' tokens as its own", 12),
        _Bug("ep_mesh_wrong_group", "every MoE block dispatches, gathers the routing weights and combines over the "
             "rank's tensor-parallel group (its mesh row) instead of its expert-parallel group (its mesh column)", 11),
    )
}


def expert_mesh_bug(name: str | None) -> _Bug | None:
    """The bug named `name` (None for none); an ExportError for an unknown name."""
    return None if name is None else named_bug(EXPERT_MESH_BUGS, name, "EP x TP mesh")


def validate_expert_mesh(model: str, config: str, ep: int, tp: int, *, layers: int | None = None,
                         batch: int | None = None, meta: bool = False, bug: str | None = None) -> ZooConfig:
    """The config (with `batch` rows if given), if `tp` splits its attention (the zoo TP plan), `ep`
    its experts and its batch, and `bug` applies; an ExportError naming the clash otherwise."""
    from refine.exporters.strategies.expert import validate_expert

    if tp < 2:
        raise ExportError(f"an EP x TP mesh needs --tp 2 or more, got {tp} (--ep alone is expert parallelism)")
    cfg = validate_expert(model, config, ep, layers=layers, batch=batch, meta=meta)
    for what, size in {"attention heads": cfg.heads, "key/value heads": cfg.kv_heads}.items():  # (experts: not split)
        if size % tp:
            raise ExportError(f"{model} config {config!r}: {what} {size} not divisible by --tp {tp}")
    if bug == "ep_mesh_wrong_group" and ep != tp:
        raise ExportError(f"bug {bug!r} needs --ep equal to --tp: its all-to-alls over the TP group of {tp} instead "
                          f"of the EP group of {ep} would change the shapes")
    expert_mesh_bug(bug)
    return cfg


def mesh_json(ep: int, tp: int) -> dict[str, Any]:
    """refine.json's `mesh`: E rows (ep) of T ranks (tp)."""
    return {"shape": [ep, tp], "dims": list(DIMS)}


def attention_plan(module: torch.nn.Module) -> dict[str, Any]:
    """The zoo Mixtral TP plan's attention entries (exporters/zoo/moe.py make_plan): q/k/v column-,
    o row-parallel; the MoE blocks are left to expert parallelism."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(module.model.layers)):
        p = f"model.layers.{i}.self_attn"
        plan.update({f"{p}.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan[f"{p}.o_proj"] = RowwiseParallel()
    return plan


def rank_module(model: str, config: str, seed: int, rank: int, ep: int, tp: int, *, layers: int | None = None,
                bug: _Bug | None = None, meta: bool = False) -> torch.nn.Module:
    """Mesh rank `rank` (ep = rank // tp, tp = rank % tp) of the grouped zoo model built from `seed`
    (module doc), built in a fake process group of ep*tp ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from refine.exporters.strategies.expert import EXPERT_BUGS, ExpertParallelMoE, build

    grid = init_device_mesh("cpu", (ep, tp), mesh_dim_names=DIMS)
    e = rank // tp
    full = build(model, config, seed, layers=layers, meta=meta)
    # src_data_rank=None: every rank keeps its own chunk of the identically seeded weights
    parallelize_module(full, grid["tp"], attention_plan(full), src_data_rank=None)
    wrong = bug is not None and bug.name == "ep_mesh_wrong_group"
    group = grid["tp" if wrong else "ep"].get_group()
    injected = EXPERT_BUGS.get(bug.name) if bug is not None else None
    for layer in full.model.layers:
        layer.mlp = ExpertParallelMoE(layer.mlp, e, ep, grid["ep"], injected, group=group)
    return full.eval()


# --- what each rank holds, on a 2-D mesh ----------------------------------------------------------


def _pieces(module: torch.nn.Module) -> dict[str, tuple[str | None, Piece]]:
    """FQN -> (the mesh dim its DTensor is split over, None for a plain tensor; what this rank
    holds: a Piece in that dim's coordinates)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from refine.exporters.capture.layouts import _digest

    out: dict[str, tuple[str | None, Piece]] = {}
    for name, value in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        data = value.data if isinstance(value, torch.nn.Parameter) else value
        if not isinstance(data, DTensor):
            shape = tuple(data.shape)
            out[name] = (None, Piece("plain", shape, shape, (0,) * len(shape), placement="tensor", digest=_digest(data)))
            continue
        mesh = data.device_mesh
        if mesh.ndim != 1 or mesh.mesh_dim_names is None or mesh.mesh_dim_names[0] not in DIMS:
            raise ExportError(f"{name}: a DTensor on {mesh}, not on the ep or the tp dim of the mesh")
        local, offset = compute_local_shape_and_global_offset(data.shape, mesh, data.placements)
        common = dict(global_shape=tuple(data.shape), local_shape=tuple(int(d) for d in local),
                      offset=tuple(int(o) for o in offset), placement=str(data.placements[0]))
        placement = data.placements[0]
        if isinstance(placement, Replicate):
            piece = Piece("rep", **common)
        elif isinstance(placement, Shard):
            piece = Piece("shard", axis=placement.dim % max(1, data.dim()), **common)
        elif isinstance(placement, Partial):
            piece = Piece("partial", reduce_op=str(placement.reduce_op), **common)
        else:
            raise ExportError(f"{name}: DTensor placement {placement} has no refine.json layout")
        out[name] = (mesh.mesh_dim_names[0], piece)
    return out


def mesh_layout(name: str, held: dict[int, tuple[str | None, Piece]], ep: int, tp: int) -> LayoutJson:
    """The layout over the mesh of a parameter every rank holds (`held`: rank -> its dim and piece):
    a replica, or the layout of its pieces along its dim, the same in every line of that dim."""
    from refine.exporters.strategies.mesh import mesh_layout as over

    dims = {d for d, _ in held.values()}
    if sorted(held) != list(range(ep * tp)) or len(dims) != 1:
        raise ExportError(f"{name}: not held by every rank on one mesh dim ({sorted(held)}, dims {dims})")
    dim = dims.pop()
    if dim is None:
        return derive_layout(name, [held[r][1] for r in range(ep * tp)])
    lines = ([[e * tp + t for t in range(tp)] for e in range(ep)] if dim == "tp"
             else [[e * tp + t for e in range(ep)] for t in range(tp)])
    layouts = [derive_layout(name, [held[r][1] for r in line]) for line in lines]
    if any(lay != layouts[0] for lay in layouts):
        raise ExportError(f"{name}: the lines along {dim} lay it out differently: {layouts}")
    return over(layouts[0], dim)


# --- capture: every rank, in forked workers ----------------------------------------------------------

_JOB: dict[str, Any] = {}  # set in the parent before forking: factory, world, stack


def _capture(rank: int, args: tuple) -> tuple[onnx.ModelProto, dict[str, tuple[str | None, Piece]], dict, float]:
    from refine.exporters.capture.tracing import fake_process_group, to_onnx
    from refine.exporters.capture.collectives import translation_table

    start = time.perf_counter()
    steps: dict[str, Any] = {}
    with fake_process_group(rank, _JOB["world"]):
        module = _JOB["factory"](rank)
        pieces = _pieces(module)
        model = to_onnx(module, args, [LOGITS], translation_table(), layers=_JOB["stack"], info=steps)
    return model, pieces, steps, time.perf_counter() - start


def _capture_all(rank_args: list[tuple], workers: int) -> list[tuple[onnx.ModelProto, dict, dict, float]]:
    """Every rank's capture, in `workers` forked processes (0: here): api.capture_pool."""
    from refine.exporters.capture import export as api

    with api.capture_pool(_capture, workers) as (submit, get):
        handles = [submit(r, a) for r, a in enumerate(rank_args)]
        return [get(h) for h in handles]


# --- the export ------------------------------------------------------------------------------------


def export_expert_mesh(
    model: str,
    config: str,
    ep: int,
    tp: int,
    out: Path | str,
    seed: int = 0,
    *,
    bug: str | None = None,
    meta: bool = False,
    layers: int | None = None,
    batch: int | None = None,
    flat: bool = False,
    workers: int | None = None,
) -> ExportResult:
    """Export the zoo Mixtral (`model` "mixtral") on an `ep` x `tp` mesh (module doc) to the model
    directory `out`: attention tensor parallel within each mesh row, the experts sharded over each
    mesh column, the batch split between the rows; `bug` (EXPERT_MESH_BUGS) injected into every
    rank. `layers` overrides the config's depth, `batch` its batch rows (EP E needs E to divide
    them), `meta` exports without weight data, `flat` inlines every layer (default: each distinct
    layer one ONNX local function per program), `workers` as in `refine.exporters.export`. ExportError
    (before anything is captured) for a model other than mixtral, --ep < 2, --tp < 2, an EP that
    does not divide the experts or the batch, a TP that does not divide the heads, key/value heads
    or intermediate size, too many weights without `meta`, an unknown bug, or
    `ep_mesh_wrong_group` with ep != tp."""
    from refine.exporters.capture import export as api
    from refine.exporters.zoo import plans, models as zoo
    from refine.exporters.capture.tracing import prepare_tracing, set_metadata
    from refine.exporters.strategies.expert import build
    from refine.exporters.capture.rename import rename_values
    from refine.config import ModelConfig

    cfg = validate_expert_mesh(model, config, ep, tp, layers=layers, batch=batch, meta=meta, bug=bug)
    injected = expert_mesh_bug(bug)
    out = Path(out)
    api._check_out_dir(out)  # before the slow part
    prepare_tracing()
    stack = None if flat else plans.layer_stack(model)
    world = ep * tp
    start = time.perf_counter()
    args = tuple(zoo.example_inputs(model, config, seed, meta=meta, batch=cfg.batch))
    rows = cfg.batch // ep
    rank_args = [tuple(a[(r // tp) * rows:(r // tp + 1) * rows] for a in args) for r in range(world)]
    _JOB.update(factory=functools.partial(rank_module, model, config, seed, ep=ep, tp=tp, layers=layers, bug=injected,
                                          meta=meta), world=world, stack=stack)
    seq_module = build(model, config, seed, layers=layers, meta=meta).eval()  # (before forking: nothing traced)
    try:
        captured = _capture_all(rank_args, api._worker_count(workers, world))
    finally:
        _JOB.clear()
    seq_steps: dict[str, Any] = {}
    seq_start = time.perf_counter()
    seq = api._capture(seq_module, args, [LOGITS], None, stack, False, seq_steps)
    seq_seconds = time.perf_counter() - seq_start
    seq_fqns = api._module_fqns(seq_module)
    seq_shapes = api._weights(seq, seq_fqns)
    user_inputs = api._user_inputs(seq, seq_fqns)

    ranks: list[onnx.ModelProto] = []
    held: dict[str, dict[int, tuple[str | None, Piece]]] = {}
    name_map: dict[str, str] = {}
    unmatched: set[str] = set()
    for rank, (program, pieces, _steps, _seconds) in enumerate(captured):
        renames = {}
        for name in api._weights(program, set(pieces)):
            fqn = module_fqn(name)
            seq_name = match_name(fqn, seq_shapes)
            if seq_name is None:
                unmatched.add(fqn)
                continue
            if pieces[fqn][1].global_shape != seq_shapes[seq_name]:
                raise ExportError(f"rank {rank}'s {fqn} stands for a tensor of shape "
                                  f"{list(pieces[fqn][1].global_shape)}, the sequential {seq_name} has shape "
                                  f"{list(seq_shapes[seq_name])}")
            renames[name] = seq_name
            name_map[seq_name] = name
            held.setdefault(seq_name, {})[rank] = pieces[fqn]
        rename_values(program, renames)
        taken = api._user_inputs(program, set(seq_shapes) | set(pieces))
        if taken != user_inputs:
            raise ExportError(f"rank {rank} takes inputs {taken}, the sequential model {user_inputs}")
        set_metadata(program, world_size=world, rank=rank)
        ranks.append(program)

    batched = {"layout": "shard", "axis": BATCH_AXIS, "over": "ep"}
    inputs: dict[str, LayoutJson] = {name: {**batched, "range": [0, cfg.vocab]} if name == "input_ids" else dict(REP)
                                     for name in user_inputs}
    for seq_name in sorted(held):
        inputs[seq_name] = mesh_layout(seq_name, held[seq_name], ep, tp)
    outputs = {LOGITS: dict(batched)}
    depth = (f", {cfg.layers} layers" if layers is not None else "") + (f", batch {cfg.batch}" if batch else "")
    refine_json: dict[str, Any] = {
        "world_size": world, "mesh": mesh_json(ep, tp), "inputs": inputs, "outputs": outputs,
        "description": f"{model} config {config!r}{depth}, EP {ep} x TP {tp} on a {ep} x {tp} mesh (attention tensor "
        "parallel within each mesh row, the batch split between the rows; each MoE block's experts sharded over the "
        "rank's mesh column, its tokens dispatched and combined by all-to-all over that column, dense dispatch, "
        "routing weights applied on the experts' side), forward, exported by exporters/strategies/expert_mesh.py"
        + (" (meta: no weight data)" if meta else "") + (api.bug_words(injected) if injected is not None else ""),
    }
    ModelConfig.model_validate(refine_json)
    seconds, rank_steps = api.finish_programs(seq, ranks, captured, seq_seconds, seq_steps, start)
    manifest = {
        "exporter": "refine exporters",
        **framework_versions("torch", "transformers", "megatron-core", "onnx", "onnxscript"),
        # no top-level "tp": refine/diagnose/reduced.py would re-export this recipe as a TP-only one
        # "ep": refine.exporters.check builds the zoo model with grouped experts (exporters/strategies/expert.py)
        "zoo": {"model": model, "config": config, "ep": ep, "mesh": {"ep": ep, "tp": tp}, "batch": cfg.batch, "seed": seed,
                "layers": layers, "meta": meta, "flat": flat, "bug": bug, "train": False},
        "world_size": world,
        "mesh": mesh_json(ep, tp),
        "inputs": {n: api._input_spec(a, cfg.vocab if n == "input_ids" else None) for n, a in zip(user_inputs, args)},
        "outputs": outputs,
        "rank_names": {k: name_map[k] for k in sorted(name_map) if name_map[k] != k},
        "unmatched_rank_tensors": sorted(unmatched),
        "undeclared_seq_initializers": sorted(set(seq_shapes) - held.keys()),
        "meta": meta,
        "train": False,
        "layers": api._layers_manifest(stack, seq_steps, rank_steps),
        "seconds": seconds,
    }
    api._write(out, seq, ranks, refine_json, manifest)
    return api.ExportResult(out, refine_json, manifest, seconds, api.op_counts(ranks[0]))
