"""TP x DP exports of zoo models on a 2-D device mesh (`refine export --tp T --dp D [--sp] [--train]`).

The D*T ranks form the mesh `{"shape": [D, T], "dims": ["dp", "tp"]}`, row-major: global rank
r = d*T + t sits at (dp=d, tp=t). Rank (d, t) runs the zoo TP (or TP+SP) program of TP rank t on
batch rows [d*B/D, (d+1)*B/D), its collectives over its mesh row {d*T .. d*T+T-1}. Mesh rows differ
only in those groups, so the TP plan is captured once, at the local batch B/D (T programs, by
`refine.exporters.export`), and each mesh row gets copies of them with every group mapped t -> d*T + t:
the cost of an export grows with D only by the files written. The sequential program is the zoo
model on the whole batch B, captured on its own.

refine.json: the token ids shard the batch over `dp`; every weight keeps its TP layout, split over
`tp` only (a shard or partial gets `"over": "tp"`, a replica stays one); the logits, a replica
within each TP group, are the batch rows of the rank's mesh row: shard along axis 0 over `dp`
(declared in refine.json and export.json alike, so that refine verifies exactly that layout).
`refine.exporters.check` reads the mesh from refine.json (exporters/capture/numeric.py cuts along mesh dims).

The training step (`train`): rank (d, t) runs TP rank t's training step (the zoo TP or TP+SP export's) on
its batch rows, as the data-parallel step of exporters/strategies/data_parallel.py over its DP group (its mesh
column): its summed token cross-entropy over the WHOLE batch's counted tokens (its count all-reduced
over the column), the reported loss and every gradient (after the TP step's own reductions)
all-reduced with sum over the column. Those collectives need the real 2-D world: row 0's T ranks
are captured in a fake process group of D*T ranks, on a DeviceMesh (dp, tp) (the TP plan on
mesh["tp"], the DP collectives on mesh["dp"]'s group); the other rows are copies in which every
group inside row 0 moves to row d and every group spanning the rows (a column) stays. refine.json:
the token ids and the labels (which may take the ignore index) shard the batch over `dp`, the loss
is a replica, each gradient has its parameter's layout.

The bug twins (`MESH_BUGS`, BUGS.md class 11, collective over the wrong process group):
`mesh_wrong_group` (forward): the first block's MLP down projection reduces over the rank's DP
group (its mesh column {t, T+t, ...}) instead of its TP group: the all-reduce of the TP plan, the
reduce-scatter of the TP+SP plan. `mesh_grad_over_tp` (training step): the gradients'
data-parallel all-reduce runs over the rank's TP group (its mesh row) instead of its DP group.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import torch
from onnx import helper

from refine.exporters.zoo.configs import ZooConfig, validate
from refine.exporters.strategies.data_parallel import BATCH_AXIS, IGNORE_INDEX, as_step, example_labels, validate_data_parallel
from refine.exporters.errors import ExportError, named_bug
from refine.exporters.capture.layouts import REP, LayoutJson
from refine.config import SEQ_NAME, ModelConfig, rank_file_name
from refine.dist import DIST_DOMAIN
from refine.lowering.graphs import module_scope

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

DIMS = ("dp", "tp")
LOGITS, LABELS = "logits", "labels"


@dataclass(frozen=True)
class MeshBug:
    """One injected mesh mistake."""

    name: str
    bug_class: int
    title: str
    train: bool = False  # a bug of the training step (else of the forward)


MESH_BUGS: dict[str, MeshBug] = {
    b.name: b for b in (
        MeshBug("mesh_wrong_group", 11, "the first block's MLP down projection reduces over the rank's data-parallel "
                "group (its mesh column) instead of its tensor-parallel group (its mesh row)"),
        MeshBug("mesh_grad_over_tp", 11, "the gradients' data-parallel all-reduce runs over the rank's tensor-parallel "
                "group (its mesh row) instead of its data-parallel group (its mesh column): a reduction over the TP "
                "group instead of the DP group", train=True),
    )
}


def mesh_bug(name: str | None) -> MeshBug | None:
    """The bug named `name` (None for none); an ExportError for an unknown name."""
    return None if name is None else named_bug(MESH_BUGS, name, "TP x DP mesh")


def validate_mesh(model: str, config: str, tp: int, dp: int, *, sp: bool = False, layers: int | None = None,
                  meta: bool = False, batch: int | None = None, bug: str | None = None,
                  train: bool = False) -> ZooConfig:
    """The config (with `batch` rows if given) if `tp` splits the model and `dp` its batch; an
    ExportError naming the clash otherwise (before anything is captured)."""
    if tp < 2:
        raise ExportError(f"a TP x DP mesh needs --tp 2 or more, got {tp} (--dp alone is data parallelism)")
    validate(model, config, tp, sp, layers=layers, meta=meta)
    cfg = validate_data_parallel(model, config, dp, layers=layers, train=False, batch=batch)
    injected = mesh_bug(bug)
    if injected is not None and injected.train != train:
        raise ExportError(f"bug {bug!r} is in the " + ("training step: pass --train" if injected.train
                                                         else "forward: drop --train"))
    if injected is not None and not injected.train and sp and dp != tp:
        raise ExportError(f"bug {bug!r} with --sp needs --dp equal to --tp: its reduce-scatter over the DP group of "
                          f"{dp} instead of the TP group of {tp} would change its output's shape")
    return cfg


def mesh_json(tp: int, dp: int) -> dict[str, Any]:
    """refine.json's `mesh`: D rows (dp) of T ranks (tp)."""
    return {"shape": [dp, tp], "dims": list(DIMS)}


def row_group(d: int, tp: int) -> list[int]:
    """The TP group of mesh row d: global ranks d*T .. d*T+T-1."""
    return [d * tp + t for t in range(tp)]


def column_group(t: int, tp: int, dp: int) -> list[int]:
    """The DP group of mesh column t: global ranks t, T+t, 2T+t, ..."""
    return [d * tp + t for d in range(dp)]


def mesh_layout(layout: LayoutJson, dim: str) -> LayoutJson:
    """A TP export's layout on the mesh: a split between the ranks becomes a split along `dim`
    (and a copy along the other dims); a replica stays a replica."""
    return dict(layout) if layout["layout"] == "rep" else {**layout, "over": dim}


def batch_layout(layout: LayoutJson) -> LayoutJson:
    """A tensor replicated within the TP group (the token ids with their value range, the logits)
    on the mesh: each mesh row holds its batch slice."""
    if layout["layout"] != "rep":
        raise ExportError(f"the TP export's input layout {layout} is not a replica: cannot slice its batch over dp")
    return {**layout, "layout": "shard", "axis": BATCH_AXIS, "over": "dp"}


# --- rank programs -------------------------------------------------------------------------------


def _dist_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every `dist` node of a program: its graph's (subgraphs too) and its functions'."""
    def walk(nodes: Any) -> Iterator[onnx.NodeProto]:
        for node in nodes:
            if node.domain == DIST_DOMAIN:
                yield node
            for att in node.attribute:
                for g in ([att.g] if att.type == onnx.AttributeProto.GRAPH else list(att.graphs)):
                    yield from walk(g.node)

    yield from walk(model.graph.node)
    for fn in model.functions:
        yield from walk(fn.node)


def _set_ints(node: onnx.NodeProto, name: str, values: list[int]) -> None:
    for att in node.attribute:
        if att.name == name:
            att.CopyFrom(helper.make_attribute(name, values))


def remap_ranks(model: onnx.ModelProto, tp: int, row: int, *, peers: bool = True) -> None:
    """Map a row-0 program's global ranks 0..T-1 (groups, roots, peers) to mesh row `row`'s; a group
    spanning the rows (a DP column of a training step) is the same for every row and stays. With
    `peers=False` the point-to-point peers are left as they are (already global ranks: a pipeline
    stage's, exporters/strategies/pipeline_mesh.py)."""
    moved = ("root", "peer") if peers else ("root",)
    for node in _dist_nodes(model):
        for att in node.attribute:
            ranks = list(att.ints) if att.name == "group" else [att.i] if att.name in moved else None
            if ranks is None:
                continue
            if att.name == "group" and len({r // tp for r in ranks}) > 1:
                continue
            if any(not 0 <= r < tp for r in ranks):
                raise ExportError(f"{node.name}: {att.name} {ranks} names ranks outside mesh row 0 (0..{tp - 1}) "
                                  "without spanning the rows")
            if att.name == "group":
                _set_ints(node, "group", [row * tp + r for r in ranks])
            else:
                att.i = row * tp + att.i


@dataclass(frozen=True)
class _Site:
    """Where a bug edits a program: a node of the graph (function None) or of a function."""

    function: tuple[str, str] | None
    index: int

    def node(self, model: onnx.ModelProto) -> onnx.NodeProto:
        if self.function is None:
            return model.graph.node[self.index]
        fn = next(f for f in model.functions if (f.domain, f.name) == self.function)
        return fn.node[self.index]


def _down_projection_site(model: onnx.ModelProto, zoo_model: str) -> _Site:
    """The first collective of the first block's MLP down projection; when that block is a call of
    a layer function other blocks call too, block 0 gets a copy of the function of its own (so the
    bug stays in one block). An ExportError if the program has no such collective."""
    from refine.exporters.zoo.plans import first_block_sites, layer_stack

    down = first_block_sites(zoo_model)["down"]
    stack = layer_stack(zoo_model)
    in_layer = re.compile(rf"^{re.escape(stack)}\.\d+\.{re.escape(down.removeprefix(f'{stack}.0.'))}$")
    for i, node in enumerate(model.graph.node):
        if node.domain == DIST_DOMAIN and module_scope(node)[0] == down:
            return _Site(None, i)
        if node.name != f"{stack}.0":
            continue
        key = (node.domain, node.op_type)
        fn = next((f for f in model.functions if (f.domain, f.name) == key), None)
        if fn is None:
            continue
        index = next((j for j, n in enumerate(fn.node) if n.domain == DIST_DOMAIN and in_layer.match(module_scope(n)[0])),
                     None)
        if index is None:
            break
        if sum((n.domain, n.op_type) == key for n in model.graph.node) > 1:
            own = onnx.FunctionProto()
            own.CopyFrom(fn)
            own.name = f"{fn.name}_block0"
            model.functions.append(own)
            node.op_type = own.name
            key = (own.domain, own.name)
        return _Site(key, index)
    raise ExportError(f"no collective of {down} in the TP program: the mesh bug has nothing to move")


def row_copies(tp_ranks: list[onnx.ModelProto], dp: int) -> list[onnx.ModelProto]:
    """The D*T mesh programs from mesh row 0's T: rank d*T + t is row 0's program t with every group
    inside row 0 moved to row d (a group spanning the rows, a DP column, stays)."""
    from refine.exporters.capture.tracing import set_metadata

    tp = len(tp_ranks)
    out = []
    for d in range(dp):
        for t, program in enumerate(tp_ranks):
            model = onnx.ModelProto()
            model.CopyFrom(program)
            remap_ranks(model, tp, d)
            set_metadata(model, world_size=dp * tp, rank=d * tp + t)
            out.append(model)
    return out


def rank_programs(tp_ranks: list[onnx.ModelProto], dp: int, zoo_model: str, bug: MeshBug | None) -> list[onnx.ModelProto]:
    """The D*T mesh programs: rank d*T + t is TP program t over mesh row d's group (with `bug`, its
    first block's down projection over its mesh column instead)."""
    tp = len(tp_ranks)
    moved = bug is not None and bug.name == "mesh_wrong_group"  # (others are injected while capturing)
    sites = [_down_projection_site(m, zoo_model) for m in tp_ranks] if moved else []  # (before copying: a site
    out = row_copies(tp_ranks, dp)                                                      # may add a function)
    for t, site in enumerate(sites):
        for d in range(dp):
            _set_ints(site.node(out[d * tp + t]), "group", column_group(t, tp, dp))
    return out


# --- the export ----------------------------------------------------------------------------------


def train_rank_factory(model: str, config: str, tp: int, dp: int, sp: bool, seed: int, *, layers: int | None = None,
                       meta: bool = False, bug: MeshBug | None = None) -> Callable[[int], torch.nn.Module]:
    """rank -> the zoo TP (TP+SP with `sp`) training step of mesh rank `rank` (built in a fake
    process group of D*T ranks): the plan on the `tp` dim of a (dp, tp) DeviceMesh, the data-parallel step
    (exporters/strategies/data_parallel.py) over its `dp` dim's group (with `bug`, the gradients over the
    `tp` dim's group instead)."""
    from torch.distributed.device_mesh import init_device_mesh

    from refine.exporters.zoo import tensor_parallel

    def factory(rank: int) -> torch.nn.Module:
        grid = init_device_mesh("cpu", (dp, tp), mesh_dim_names=DIMS)
        module = tensor_parallel.zoo_rank_factory(model, config, tp, sp, seed, layers=layers, meta=meta,
                                      mesh=lambda: grid["tp"])(rank)
        column, row = grid["dp"].get_group(), grid["tp"].get_group()
        return as_step(module, group=column, grad_group=row if bug is not None and bug.name == "mesh_grad_over_tp"
                       else None)

    return factory


def _examples(model: str, config: str, seed: int, cfg: ZooConfig, dp: int, *, meta: bool, train: bool,
              ) -> tuple[torch.Tensor, ...]:
    """The whole batch's example inputs: token ids, and with `train` labels ignoring a different
    number of tokens in each DP row (data_parallel.example_labels)."""
    from refine.exporters.zoo import models as zoo

    inputs = zoo.example_inputs(model, config, seed, meta=meta, labels=train, batch=cfg.batch)
    return (inputs[0], example_labels(inputs[1], dp)) if train and not meta else inputs


def export_mesh(
    model: str,
    config: str,
    tp: int,
    dp: int,
    out: Path | str,
    seed: int = 0,
    *,
    sp: bool = False,
    batch: int | None = None,
    bug: str | None = None,
    meta: bool = False,
    layers: int | None = None,
    flat: bool = False,
    workers: int | None = None,
    train: bool = False,
) -> ExportResult:
    """Export a zoo model on a `dp` x `tp` mesh (module doc) to the model directory `out`: the
    forward, TP (or TP+SP with `sp`) within each mesh row, the batch (`batch` rows instead of the
    config's if given) split between the rows, or with `train` one TP x DP training step; `bug`
    (MESH_BUGS) injected into every rank. Other options as in `refine.exporters.export_model`."""
    from refine.exporters.capture import export as api
    from refine.exporters.zoo import plans, tensor_parallel, models as zoo
    from refine.exporters.capture import train_program
    from refine.exporters.capture.tracing import to_onnx
    from refine.exporters.capture.rename import readable_node_names
    from refine.dist import register_schemas

    cfg = validate_mesh(model, config, tp, dp, sp=sp, layers=layers, meta=meta, batch=batch, bug=bug, train=train)
    injected = mesh_bug(bug)
    out = Path(out)
    api._check_out_dir(out)  # before the slow part
    stack = None if flat else plans.layer_stack(model)
    start = time.perf_counter()
    examples = _examples(model, config, seed, cfg, dp, meta=meta, train=train)
    local = tuple(t[: cfg.batch // dp] for t in examples)  # mesh row 0's batch rows
    if train:  # row 0 of the D*T world: its DP collectives reach the other rows (module doc)
        factory = train_rank_factory(model, config, tp, dp, sp, seed, layers=layers, meta=meta, bug=injected)
        step: dict[str, Any] = {"train": True, "process_group_size": dp * tp}
    else:
        factory = tensor_parallel.zoo_rank_factory(model, config, tp, sp, seed, layers=layers, meta=meta)
        step = {"output_names": [LOGITS]}
    ranges = {"input_ids": cfg.vocab, **({LABELS: cfg.vocab} if train else {})}
    with tempfile.TemporaryDirectory(prefix="refine-mesh-") as tmp:
        tp_result = api.export(zoo.build(model, config, seed, layers=layers, meta=meta), factory, local, tp,
                               Path(tmp) / "tp", input_ranges=ranges, layers=stack, workers=workers, **step)
        tp_ranks = [onnx.load(str(tp_result.out_dir / rank_file_name(t))) for t in range(tp)]
    tp_outputs = tp_result.config["outputs"]
    if not train and tp_outputs[LOGITS] != REP:
        raise ExportError(f"the {tp}-rank TP export's logits are {tp_outputs[LOGITS]}, not a replica within the TP "
                          "group: their layout on the mesh (that split within each batch slice) cannot be declared")
    seq_start = time.perf_counter()
    seq_info: dict[str, Any] = {}
    seq_module = zoo.build(model, config, seed, layers=layers, meta=meta).eval()
    seq = (train_program.to_onnx(seq_module, examples, layers=stack, info=seq_info) if train
           else to_onnx(seq_module, examples, [LOGITS], layers=stack, info=seq_info))
    seq_seconds = time.perf_counter() - seq_start
    readable_node_names(seq)
    register_schemas()
    api._check_onnx(seq, SEQ_NAME)
    ranks = rank_programs(tp_ranks, dp, model, injected)

    batched = {"input_ids", LABELS}
    inputs = {name: _with_ignored(name, batch_layout(layout)) if name in batched else mesh_layout(layout, "tp")
              for name, layout in tp_result.config["inputs"].items()}
    outputs = ({name: mesh_layout(layout, "tp") for name, layout in tp_outputs.items()} if train
               else {LOGITS: batch_layout(tp_outputs[LOGITS])})
    depth = f", {cfg.layers} layers" if layers is not None else ""
    what = ("one training step (TP's within each row, loss normalised by the global token count, loss and gradients "
            "all-reduced with sum over each DP column)" if train else "forward")
    refine_json: dict[str, Any] = {
        "world_size": dp * tp, "mesh": mesh_json(tp, dp), "inputs": inputs, "outputs": outputs,
        "description": f"{model} config {config!r}{depth}, batch {cfg.batch}, TP {tp} x DP {dp} on a {dp} x {tp} mesh "
        f"({'TP+SP' if sp else 'TP'} within each mesh row, the batch split between the rows), {what}, exported by "
        "exporters/strategies/mesh.py" + (" (meta: no weight data)" if meta else "")
        + (api.bug_words(injected) if injected is not None else ""),  # type: ignore[arg-type]
    }
    zoo_recipe = {"model": model, "config": config, "mesh": {"dp": dp, "tp": tp}, "sp": sp, "batch": cfg.batch,
                  "seed": seed, "layers": layers, "meta": meta, "flat": flat, "bug": bug, "train": train}
    # (no top-level "tp" in export.json: refine/diagnose/reduced.py would re-export this recipe as a TP-only one)
    return write_rows(out, seq, seq_info, seq_seconds, tp_result, ranks, refine_json, start,
                      whole_batch=cfg.batch, extra={"zoo": zoo_recipe},
                      input_spec=_with_ignored)


def write_rows(out: Path, seq: onnx.ModelProto, seq_info: dict[str, Any], seq_seconds: float, row: ExportResult,
               ranks: list[onnx.ModelProto], refine_json: dict[str, Any], start: float, *, whole_batch: int,
               extra: dict[str, Any], input_spec: Callable[[str, dict[str, Any]], dict[str, Any]] = lambda _n, s: s,
               ) -> ExportResult:
    """Write a DP x TP mesh export whose row 0 was captured (`row`: its T ranks at the row's batch)
    and whose `ranks` are row 0's programs and their copies: refine.json as given, export.json row
    0's with the mesh's world, the batch inputs' whole shapes (`whole_batch` rows; `input_spec`
    adjusts a spec) and `extra` entries."""
    from refine.exporters.capture import export as api

    ModelConfig.model_validate(refine_json)
    world = refine_json["world_size"]
    tp = world // refine_json["mesh"]["shape"][0]
    batched = {name for name, lay in refine_json["inputs"].items() if lay.get("over") == "dp"}
    captured = row.seconds["ranks"]
    seconds = {"seq": seq_seconds, "ranks": [captured[r] if r < tp else 0.0 for r in range(world)],
               "captured": time.perf_counter() - start,
               "steps": {"seq": seq_info.get("seconds", {}),
                         "ranks": [row.seconds["steps"]["ranks"][r % tp] for r in range(world)]}}
    layer_map = row.manifest["layers"]
    manifest = {
        **row.manifest,
        **extra,
        "world_size": world,
        "mesh": refine_json["mesh"],
        "inputs": {name: input_spec(name, {**spec, "shape": [whole_batch, *spec["shape"][1:]]} if name in batched
                                    else spec)
                   for name, spec in row.manifest["inputs"].items()},
        "outputs": refine_json["outputs"],
        "layers": None if layer_map is None else {**layer_map, "seq": seq_info.get("layers"),
                                                  "ranks": [layer_map["ranks"][r % tp] for r in range(world)]},
        "seconds": seconds,
    }
    api._write(out, seq, ranks, refine_json, manifest)
    return api.ExportResult(out, refine_json, manifest, seconds, api.op_counts(ranks[0]))


def _with_ignored(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The labels' layout or input spec taking the ignore index too (as the DP export declares them)."""
    return {**spec, "also": [IGNORE_INDEX]} if name == LABELS else spec
