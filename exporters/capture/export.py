"""`export` (any sequential module + a per-rank factory) and `export_model` (the zoo).

A model directory is written all or nothing: into a temporary directory next to `out_dir`,
renamed into place at the end. Besides the files refine reads (seq.onnx, rank{K}.onnx,
refine.json) it holds `export.json`, the exporter's manifest: how to rebuild the torch model
(zoo entries), the inputs' shapes and value ranges, the outputs' layouts, which rank
initializer was mapped to which sequential FQN, and timings. `refine.exporters.check` reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from math import prod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import torch
from pydantic import TypeAdapter

from refine.exporters.capture.tracing import fake_process_group, prepare_tracing, set_metadata, to_onnx, torchlib_base
from refine.exporters.capture.collectives import translation_table
from refine.exporters.errors import ExportError
from refine.exporters.capture.layouts import (
    REP,
    LayoutJson,
    Piece,
    held_layout,
    match_name,
    mesh_line,
    module_fqn,
    rank_pieces,
)
from refine.exporters.capture.rename import readable_node_names, rename_values
from refine.config import (
    CONFIG_NAME,
    SEQ_NAME,
    Layout,
    Mesh,
    ModelConfig,
    PartialLayout,
    ShardLayout,
    rank_file_name,
    shard_indices,
)
from refine.dist import DIST_DOMAIN, register_schemas
from refine.lowering.layers import local_functions
from refine.version import framework_versions

if TYPE_CHECKING:
    from refine.exporters.errors import NamedBug

MANIFEST_NAME = "export.json"
_MODEL_DIR_FILES = (SEQ_NAME, CONFIG_NAME, MANIFEST_NAME)


@dataclass
class ExportResult:
    """What `export` wrote and how long it took."""

    out_dir: Path
    config: dict[str, Any]
    manifest: dict[str, Any]
    seconds: dict[str, Any] = field(default_factory=dict)
    rank_op_types: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)  # how the export departed from what was asked (summary)

    def warnings(self) -> list[str]:
        """What looks wrong about the export whatever refine will say: rank 0's program makes no
        collective although refine.json splits inputs between the ranks (its pieces are never
        combined: the code that issues the plan's collectives did not run while exporting)."""
        split = sorted(n for n, lay in self.config["inputs"].items() if lay.get("layout") in ("shard", "partial"))
        if not split or self.config["world_size"] < 2 or any(k.startswith(f"{DIST_DOMAIN}.") for k in self.rank_op_types):
            return []
        return [f"refine.json splits {len(split)} inputs between the ranks (e.g. {split[0]}), but rank 0's program "
                "makes no collective: the pieces are never combined. If the plan should communicate, the code that "
                "issues its collectives did not run while exporting (e.g. torchtitan's spmd_types backend outside its "
                "trainer's SPMD mesh region, set_current_spmd_mesh)"]

    def summary(self) -> str:
        s = self.seconds
        dist_ops = {k: v for k, v in sorted(self.rank_op_types.items()) if k.startswith(f"{DIST_DOMAIN}.")}
        return (
            f"wrote {self.out_dir} (world size {self.config['world_size']}, {len(self.config['inputs'])} declared inputs; "
            f"captured in {s['captured']:.1f}s: seq {s['seq']:.1f}s, ranks {sum(s['ranks']):.1f}s summed; collectives per rank 0: "
            f"{', '.join(f'{k[len(DIST_DOMAIN) + 1:]} x{v}' for k, v in dist_ops.items()) or 'none'})"
            + "".join(f"; {note}" for note in self.notes)
        )


def _input_spec(t: torch.Tensor, high: int | None, also: list[int] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if not t.is_floating_point():
        if high is None and t.device.type == "meta":
            raise ExportError("an integer input on the meta device needs its value range (input_ranges)")
        spec["high"] = int(high) if high is not None else max(2, int(t.max()) + 1)
        if also:
            spec["also"] = list(also)
    return spec


def _user_inputs(model: onnx.ModelProto, fqns: set[str]) -> list[str]:
    """Graph inputs that are no parameter or buffer (a meta export's weights are graph inputs too)."""
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits and module_fqn(i.name) not in fqns]


def _weights(model: onnx.ModelProto, fqns: set[str]) -> dict[str, tuple[int, ...]]:
    """ONNX name -> shape of every parameter or buffer: initializers, and typed inputs without data."""
    out = {i.name: tuple(i.dims) for i in model.graph.initializer if module_fqn(i.name) in fqns}
    for vi in model.graph.input:
        if vi.name not in out and module_fqn(vi.name) in fqns:
            out[vi.name] = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
    return out


def _module_fqns(module: torch.nn.Module) -> set[str]:
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return names | {n for n, _ in module.named_buffers(remove_duplicate=False)}


def _shape(vi: onnx.ValueInfoProto) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]


def op_counts(model: onnx.ModelProto) -> Counter[str]:
    """`domain.op` -> how many times the program runs it: a layer call counts its body's ops."""
    functions = local_functions(model)
    memo: dict[tuple[str, str], Counter[str]] = {}

    def count(nodes: Sequence[onnx.NodeProto], depth: int = 0) -> Counter[str]:
        out: Counter[str] = Counter()
        for n in nodes:
            key = (n.domain, n.op_type)
            if key in functions and depth < 32:
                if key not in memo:
                    memo[key] = count(functions[key].node, depth + 1)
                out.update(memo[key])
            else:
                out[f"{n.domain}.{n.op_type}" if n.domain else n.op_type] += 1
        return out

    return count(model.graph.node)


def _infer_output_layout(name: str, seq_shape: list[int | None], rank_shapes: dict[int, list[int | None]],
                         world_size: int, mesh: Mesh | None = None) -> LayoutJson:
    """rep if every holder's output (rank -> its shape) has the sequential shape; shard if one axis
    is split evenly between all ranks, or, on a `mesh`, along the one mesh dim whose lines make
    up the holders and whose size is the split (a pipeline's last stage of TP ranks)."""
    shapes = list(rank_shapes.values())
    if all(s == seq_shape for s in shapes):
        return dict(REP)
    if all(s == shapes[0] for s in shapes) and len(seq_shape) == len(shapes[0]):
        diff = [i for i, (a, b) in enumerate(zip(seq_shape, shapes[0])) if a != b]
        whole, part = (seq_shape[diff[0]], shapes[0][diff[0]]) if len(diff) == 1 else (None, None)
        if whole is not None and part and whole % part == 0:
            if whole // part == len(shapes) and (mesh is None or len(shapes) == world_size):
                return {"layout": "shard", "axis": diff[0]}
            dims = [dim for dim, n in zip(mesh.dims, mesh.shape) if n == whole // part
                    and all(set(mesh_line(mesh, r, dim)) <= rank_shapes.keys() for r in rank_shapes)] if mesh else []
            if len(dims) == 1:
                return {"layout": "shard", "axis": diff[0], "over": dims[0]}
    raise ExportError(f"output {name!r}: cannot infer how rank shapes {shapes} make {seq_shape}; pass output_layouts")


def _open_gradient(by_rank: dict[int, Piece], world_size: int, mesh: Mesh | None) -> LayoutJson | None:
    """The layout of a gradient the parameter's own annotation leaves partial (spmd_types' R: a
    summand per rank along the R dim, left to the data-parallel wrapper), for export.json's check;
    refine.json leaves it open. A replica's: partial (over that dim); a shard's (a TP shard under
    CP): partial over the R dim, then cut as the parameter is. None: the gradient is whole."""
    pieces = list(by_rank.values())
    if not all(p.grad == "partial" for p in pieces) or (len(by_rank) < world_size and mesh is None):
        return None
    kinds = {(p.kind, p.over, p.grad_over, p.axis) for p in pieces}
    if len(kinds) != 1:
        return None
    ((kind, over, grad_over, axis),) = kinds
    if kind == "shard":
        if grad_over is None or over is None or len(by_rank) < world_size:
            return None
        return {"layout": "partial", "op": "sum", "over": grad_over, "then": {"axis": axis, "over": over}}
    return {"layout": "partial", "op": "sum", **({"over": over} if over else {})}


def _layout(name: str, layout: Mapping[str, Any]) -> LayoutJson:
    """A declared input layout: rep, or an (even or sized) shard; the rank's example is cut from it."""
    parsed = TypeAdapter(Layout).validate_python(dict(layout))
    if isinstance(parsed, PartialLayout):
        raise ExportError(f"input {name!r}: a partial input layout has no single example to export ranks with")
    return parsed.model_dump(exclude_none=True)


def _cut(value: torch.Tensor, layout: LayoutJson | None, rank: int, world_size: int,
         mesh: Mesh | None = None) -> torch.Tensor:
    """Rank `rank`'s example input under `layout` (the whole example when replicated; a shard
    `over` a mesh dim: the piece of the rank's coordinate there)."""
    if layout is None or layout["layout"] == "rep":
        return value
    shard = ShardLayout.model_validate(layout)
    axis = shard.axis % value.dim()
    if shard.over is not None:
        if mesh is None or shard.over not in mesh.dims:
            raise ExportError(f"an input layout over {shard.over!r} needs a mesh with that dim")
        rank, world_size = mesh.coordinates(rank)[shard.over], mesh.shape[mesh.dims.index(shard.over)]
    index = shard_indices(shard, value.shape[axis], world_size)[rank]
    return value.index_select(axis, torch.tensor(index, dtype=torch.long)).contiguous()


def _check_onnx(model: onnx.ModelProto, what: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{what}: the exported model fails onnx.checker: {str(exc).splitlines()[0]}") from None


def finish_programs(seq: onnx.ModelProto, ranks: Sequence[onnx.ModelProto | None], captured: Sequence[tuple], seq_seconds: float,
                    seq_steps: dict[str, Any], start: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """For an exporter that captured its ranks itself (the meshes): the programs' nodes named for
    the reports and checked by onnx.checker (an ExportError naming the file otherwise); the
    capture's seconds for export.json, and each rank's step record (captured: (program, pieces,
    steps, seconds) per rank)."""
    register_schemas()
    readable_node_names(seq, *(m for m in ranks if m is not None))
    _check_onnx(seq, SEQ_NAME)
    for r, m in enumerate(ranks):
        if m is not None:  # (None: a DP row's copy of a rank checked here, written later)
            _check_onnx(m, rank_file_name(r))
    rank_steps = [c[2] for c in captured]
    seconds = {"seq": seq_seconds, "ranks": [c[3] for c in captured], "captured": time.perf_counter() - start,
               "steps": {"seq": seq_steps.get("seconds", {}), "ranks": [s["seconds"] for s in rank_steps]}}
    return seconds, rank_steps


def export(
    seq_module: torch.nn.Module | Callable[[], torch.nn.Module],
    rank_module_factory: Callable[[int], torch.nn.Module],
    example_inputs: Sequence[torch.Tensor],
    world_size: int,
    out_dir: Path | str,
    *,
    output_names: Sequence[str] | None = None,
    output_layouts: Mapping[str, LayoutJson] | None = None,
    rank_output_names: Callable[[int], Sequence[str]] | None = None,
    input_layouts: Mapping[str, LayoutJson] | None = None,
    input_ranges: Mapping[str, int] | None = None,
    description: str | None = None,
    zoo: Mapping[str, Any] | None = None,
    layers: str | None = None,
    workers: int | None = None,
    train: bool = False,
    seq_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    same_program: bool = False,
    process_group_size: int | None = None,
    mesh: Mesh | None = None,
) -> ExportResult:
    """Export `seq_module` and its `world_size` ranks to the model directory `out_dir`.

    `rank_module_factory(rank)` is called while a fake process group (this process = `rank`)
    is initialized; it builds and parallelizes the rank's module (DTensor plans on a 1-D
    mesh over all ranks). Parameters and buffers stay initializers, named by their sequential
    FQN on every side, and refine.json declares each one's layout as DTensor placed it.
    Graph inputs are replicated unless `input_layouts` shards them (each rank is then exported
    with its chunk of the example); output layouts are inferred from shapes unless given. Integer inputs take values in [0, input_ranges[name])
    in `check` (default: max of the example + 1).

    `rank_output_names(rank)` names rank `rank`'s outputs when they are not the sequential ones
    (default: every rank returns every sequential output): a pipeline stage returns a sequential
    output only on the last stage, and other outputs of its own (its sends, so that they are
    kept). A sequential output then needs at least one rank holding it, and its layout is
    inferred from those ranks (refine accepts only a replica on some ranks: docs/model-dir.md).

    `layers` names the ModuleList (e.g. `model.layers`) whose layers become ONNX local
    functions, each distinct layer captured once per program (refine.exporters.capture.layers,
    docs/layers.md); None exports every layer inline. Modules on the meta device export
    without weights: their parameters become typed graph inputs with no data.

    Ranks are captured by `workers` forked processes (default: up to 2, one per core) while
    this process captures the sequential model; each rank is still captured on its own, under
    its own process group, exactly as in one process.

    `seq_context` (a framework that needs a process group even for one rank, as Megatron-Core
    does): entered around building and capturing the sequential module, which `seq_module` then
    builds (a function taking no argument); ranks are never captured inside it.

    `same_program`: the factory builds one module whatever the rank (data parallelism: every
    rank runs the same program on its own batch slice, collectives over the whole world), so rank
    0 is captured once and every rank's program is a copy of it (its metadata says its rank);
    the cost of an export stops growing with the world size.

    `process_group_size`: the ranks exported, 0..world_size-1, are the first of a fake process group
    of this many ranks (default: world_size), so that their code may also run collectives over
    groups reaching beyond them (a TP x DP mesh's first row, whose DP groups span the rows: its
    other rows are copies the caller derives from these programs, exporters/strategies/mesh.py). The export
    itself (refine.json, layouts, check) knows only the world_size ranks.

    `mesh`: the ranks as a device mesh (refine.json's `mesh`), for a framework whose parallel dims
    each split their tensors along one mesh dim (torchtitan's stages of TP ranks): a piece split
    along a mesh dim is laid out `over` it, an output held by some ranks only is declared where
    it is a replica and otherwise left open (export.json keeps its layout for check, which
    compares it along each line holding it).

    `train` exports one training step instead of the forward (exporters/capture/train.py): the last
    example input is `labels`, the outputs are `loss` and `grad.<FQN>` per parameter, and each
    gradient is declared with its parameter's layout (a replicated parameter's gradient must be
    a replica). With `layers`, each distinct layer's forward and backward become functions
    (refine.exporters.capture.train_layers).
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)  # before the slow part
    if world_size < 1:
        raise ExportError(f"world size must be at least 1, got {world_size}")
    args = tuple(example_inputs)
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise ExportError("example_inputs must be a sequence of tensors")
    prepare_tracing()
    if train:
        from refine.exporters.capture import train as training
    start = time.perf_counter()
    names = _output_names(seq_module, args, output_names, output_layouts, train)
    declared_inputs = {name: _layout(name, value) for name, value in (input_layouts or {}).items()}
    if rank_output_names is not None and train:
        raise ExportError("a training step's outputs are loss and grad.<parameter> on every rank: pass no rank_output_names")
    if process_group_size is not None and process_group_size < world_size:
        raise ExportError(f"process_group_size {process_group_size} is smaller than the world size {world_size}")
    if mesh is not None and prod(mesh.shape) != world_size:
        raise ExportError(f"mesh {mesh.shape} has {prod(mesh.shape)} ranks, the world size is {world_size}")
    job = _RankJob(rank_module_factory, world_size, names, layers, train, rank_output_names, same_program,
                   process_group_size or world_size, mesh)
    with _rank_runner(job, _worker_count(workers, world_size)) as run:
        if not declared_inputs:  # every rank takes the whole example: capture them while seq is
            run.submit({r: args for r in range(world_size)})
        seq_steps: dict[str, Any] = {}
        with seq_context() if seq_context is not None else contextlib.nullcontext():
            if not isinstance(seq_module, torch.nn.Module):
                seq_module = seq_module()
            seq_module.eval()
            if train:
                names = training.output_names(seq_module)
            seq = _capture(seq_module, args, names, None, layers, train, seq_steps)
        seq_seconds = time.perf_counter() - start
        seq_fqns = _module_fqns(seq_module)
        seq_shapes = _weights(seq, seq_fqns)  # parameters and buffers, by FQN
        seq_inits = set(seq_shapes)
        user_inputs = _user_inputs(seq, seq_fqns)
        if set(declared_inputs) - set(user_inputs):
            raise ExportError(f"input_layouts names {sorted(set(declared_inputs) - set(user_inputs))}, "
                              f"not inputs {user_inputs}")
        if declared_inputs:
            run.submit({r: tuple(_cut(a, declared_inputs.get(n), r, world_size, mesh) for n, a in zip(user_inputs, args))
                        for r in range(world_size)})
        captured = run.results()
    meta = any(p.device.type == "meta" for p in seq_module.parameters())

    ranks: list[onnx.ModelProto] = []
    held: dict[str, dict[int, Piece]] = {}
    name_map: dict[str, str] = {}
    unmatched: set[str] = set()
    rank_seconds: list[float] = []
    rank_steps: list[dict[str, Any]] = []
    for rank, (model, pieces, steps, seconds) in enumerate(captured):
        renames = {}
        for name in _weights(model, set(pieces)):
            fqn = module_fqn(name)
            seq_name = match_name(fqn, seq_inits)
            if seq_name is None:
                unmatched.add(fqn)
                continue
            if pieces[fqn].global_shape != seq_shapes[seq_name]:
                raise ExportError(
                    f"rank {rank}'s {fqn} stands for a tensor of shape {list(pieces[fqn].global_shape)}, the sequential "
                    f"{seq_name} has shape {list(seq_shapes[seq_name])} (a rank-local slice must be a DTensor or carry Megatron's partition attributes)"
                )
            renames[name] = seq_name
            if train:
                renames[training.grad_name(fqn)] = training.grad_name(seq_name)
            name_map[seq_name] = name
            held.setdefault(seq_name, {})[rank] = pieces[fqn]
        rename_values(model, renames)
        if _user_inputs(model, set(seq_inits) | set(pieces)) != user_inputs:
            raise ExportError(f"rank {rank} takes inputs {_user_inputs(model, set(seq_inits) | set(pieces))}, "
                              f"the sequential model {user_inputs}")
        set_metadata(model, world_size=world_size, rank=rank)
        ranks.append(model)
        rank_seconds.append(seconds)
        rank_steps.append(steps)

    inputs: dict[str, LayoutJson] = {name: declared_inputs.get(name, dict(REP)) for name in user_inputs}
    for name, high in (input_ranges or {}).items():  # token ids lie in [0, vocab): lemmas may rely on it
        if name in inputs:
            inputs[name] = {**inputs[name], "range": [0, int(high)]}
    for seq_name in sorted(held):
        inputs[seq_name] = held_layout(seq_name, held[seq_name], world_size, mesh)

    outputs = {}
    seq_out = {o.name: _shape(o) for o in seq.graph.output}
    undeclared: set[str] = set()  # outputs refine.json leaves open (export.json keeps their layout for check)
    if train:
        output_layouts = training.output_layouts(names, inputs)
        for seq_name, by_rank in held.items():  # a parameter whose own annotation leaves its gradient partial
            open_layout = _open_gradient(by_rank, world_size, mesh)
            if open_layout is not None:
                # (refine.json: any reconstruction every rank takes part in, a sum of pieces among them)
                output_layouts[training.grad_name(seq_name)] = open_layout
                undeclared.add(training.grad_name(seq_name))
    for name in names:
        given = (output_layouts or {}).get(name)
        rank_shapes = {r: _shape(o) for r, m in enumerate(ranks) for o in m.graph.output if o.name == name}
        if not rank_shapes:
            raise ExportError(f"output {name!r} is an output of no rank (rank_output_names)")
        outputs[name] = dict(given) if given else _infer_output_layout(name, seq_out[name], rank_shapes, world_size,
                                                                       mesh)
        if len(rank_shapes) < world_size and outputs[name].get("layout") != "rep" and mesh is not None:
            undeclared.add(name)  # (refine.json declares a split output only where every rank holds a piece)
        elif len(rank_shapes) < world_size and outputs[name].get("layout") != "rep":
            raise ExportError(f"output {name!r} is held by {len(rank_shapes)} of {world_size} ranks: only a replica "
                              f"may be missing on some ranks, not a {outputs[name]['layout']} layout")

    config = {"world_size": world_size, **({"mesh": mesh.model_dump()} if mesh is not None else {}), "inputs": inputs,
              "outputs": {k: v for k, v in outputs.items() if k not in undeclared}}
    if description:
        config["description"] = description
    ModelConfig.model_validate(config)  # what refine will read must be valid
    register_schemas()
    readable_node_names(seq, *ranks)  # every program is final here: name its nodes for the reports
    _check_onnx(seq, "seq.onnx")
    for r, m in enumerate(ranks):
        _check_onnx(m, rank_file_name(r))
    op_types = op_counts(ranks[0])
    # seq and each rank: wall seconds of its capture (ranks run side by side in the workers);
    # captured: until every program was captured; steps: where each program's time went
    seconds = {"seq": seq_seconds, "ranks": rank_seconds, "captured": time.perf_counter() - start,
               "steps": {"seq": seq_steps.get("seconds", {}), "ranks": [s["seconds"] for s in rank_steps]}}
    manifest = {
        "exporter": "refine exporters",
        **framework_versions("torch", "transformers", "megatron-core", "onnx", "onnxscript"),
        "zoo": dict(zoo) if zoo else None,
        "world_size": world_size,
        **({"mesh": mesh.model_dump()} if mesh is not None else {}),
        "inputs": {n: _input_spec(a, (input_ranges or {}).get(n), inputs[n].get("also")) for n, a in zip(user_inputs, args)},
        "outputs": outputs,
        "rank_names": {k: name_map[k] for k in sorted(name_map) if name_map[k] != k},
        "unmatched_rank_tensors": sorted(unmatched),
        "undeclared_seq_initializers": sorted(seq_inits - held.keys()),
        "meta": meta,
        "train": train,
        "layers": _layers_manifest(layers, seq_steps, rank_steps),
        "seconds": seconds,
    }
    _write(out_dir, seq, ranks, config, manifest)
    return ExportResult(out_dir, config, manifest, seconds, op_types)


def _output_names(seq_module: torch.nn.Module | Callable[[], torch.nn.Module], args: tuple,
                  output_names: Sequence[str] | None, output_layouts: Mapping[str, LayoutJson] | None,
                  train: bool) -> list[str]:
    """The forward's output names: as given, else `output`/`output_{i}` after one forward run.
    A training step's are named after its parameters once the module is built (here: none)."""
    if train:
        if output_names or output_layouts:
            raise ExportError("a training step's outputs are loss and grad.<parameter>: pass no output names or layouts")
        return []
    if output_names:
        return list(output_names)
    if not isinstance(seq_module, torch.nn.Module):
        raise ExportError("a sequential module built by a function needs output_names")
    seq_module.eval()
    with torch.no_grad():
        outs = seq_module(*args)
    n_out = len(outs) if isinstance(outs, (tuple, list)) else 1
    return ["output"] if n_out == 1 else [f"output_{i}" for i in range(n_out)]


def _capture(module: torch.nn.Module, args: tuple, names: list[str], table: dict | None, layers: str | None,
             train: bool, info: dict[str, Any]) -> onnx.ModelProto:
    """One program: the forward (refine.exporters.capture.tracing) or a training step (refine.exporters.capture.train_program, whose
    outputs are named after the module's own parameters: `names` is not read)."""
    if train:
        from refine.exporters.capture import train_program

        return train_program.to_onnx(module, args, table, layers=layers, info=info)
    return to_onnx(module, args, names, table, layers=layers, info=info)


@dataclass
class _RankJob:
    """What a rank capture needs (inherited by forked workers, never pickled)."""

    factory: Callable[[int], torch.nn.Module]
    world_size: int
    output_names: list[str]
    layers: str | None
    train: bool = False
    rank_output_names: Callable[[int], Sequence[str]] | None = None  # rank -> its outputs, if not output_names
    same_program: bool = False  # every rank's module is the same (export's `same_program`): capture rank 0 only
    process_group_size: int = 0  # ranks of the fake process group (export's `process_group_size`; 0: world_size)
    mesh: Mesh | None = None  # the ranks as a device mesh (export's `mesh`)

    def outputs_of(self, rank: int) -> list[str]:
        """The output names rank `rank`'s program is captured with."""
        return list(self.rank_output_names(rank)) if self.rank_output_names is not None else self.output_names


def _capture_rank(job: _RankJob, rank: int, args: tuple) -> tuple[onnx.ModelProto, dict[str, Piece], dict, float]:
    """Build rank `rank`'s module under its fake process group and capture it."""
    start = time.perf_counter()
    steps: dict[str, Any] = {}
    with fake_process_group(rank, job.process_group_size or job.world_size):
        module = job.factory(rank)
        module.eval()
        built = time.perf_counter() - start
        pieces = rank_pieces(module, rank, job.world_size, job.mesh)
        model = _capture(module, args, job.outputs_of(rank), translation_table(), job.layers, job.train, steps)
    steps["seconds"] = {"build": built, **steps["seconds"]}
    return model, pieces, steps, time.perf_counter() - start


_WORKER_JOB: _RankJob | None = None  # set in the parent before forking


def _worker_init() -> None:
    torch.set_num_threads(1)  # never enter the OpenMP pool the parent may have started


def by_value(args: tuple) -> bytes:
    """A task's arguments pickled by value. Handed to the pool as they are, torch tensors would
    cross as shared file descriptors that each worker fetches from this process's resource-sharer
    thread: a worker stopped mid-fetch (the pool terminated after another rank's error) makes that
    thread print a traceback under the export's one-line error."""
    return pickle.dumps(args)


def _worker_capture(rank: int, payload: bytes) -> tuple[bytes, dict[str, Piece], dict, float]:
    assert _WORKER_JOB is not None
    model, pieces, steps, seconds = _capture_rank(_WORKER_JOB, rank, pickle.loads(payload))
    return model.SerializeToString(), pieces, steps, seconds


def _worker_count(workers: int | None, world_size: int) -> int:
    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    return max(0, min(workers, world_size)) if world_size > 1 else 0


class _RankRunner:
    """Captures ranks in this process (no workers) or in a pool of forked ones."""

    def __init__(self, job: _RankJob, pool: Any) -> None:
        self.job, self.pool = job, pool
        self.pending: dict[int, Any] = {}

    def submit(self, rank_args: Mapping[int, tuple]) -> None:
        for rank, args in rank_args.items():
            if self.job.same_program and rank != 0:
                continue
            if self.pool is None:
                self.pending[rank] = args
            else:
                self.pending[rank] = self.pool.apply_async(_worker_capture, (rank, by_value(args)))

    def results(self) -> list[tuple[onnx.ModelProto, dict[str, Piece], dict, float]]:
        out = []
        for rank in range(self.job.world_size):
            if self.job.same_program and rank != 0:
                model, pieces, steps, _seconds = out[0]
                copy = onnx.ModelProto()
                copy.CopyFrom(model)
                out.append((copy, dict(pieces), steps, 0.0))
                continue
            if self.pool is None:
                out.append(_capture_rank(self.job, rank, self.pending[rank]))
            else:
                data, pieces, steps, seconds = awaited(self.pending[rank], self.pool, f"rank {rank}'s capture")
                out.append((onnx.ModelProto.FromString(data), pieces, steps, seconds))
        return out


def watched(pool: Any) -> set[Any]:
    """Every worker process `pool` has had: those it started with (recorded at its creation, before
    any could die: the Pool replaces a dead worker at once) and those it started since."""
    seen = pool.__dict__.setdefault("refine_workers", set())
    seen.update(pool._pool)  # (multiprocessing's Pool keeps its processes there)
    return seen


def awaited(handle: Any, pool: Any, what: str) -> Any:
    """A pool task's result, or an ExportError if a worker process died meanwhile (a crash in
    native code, a segmentation fault: multiprocessing's Pool replaces the worker and drops its
    task, so waiting on the task alone would wait forever)."""
    import multiprocessing
    import signal

    while True:
        try:
            return handle.get(timeout=1.0)
        except multiprocessing.TimeoutError:
            seen = watched(pool)
            dead = [p.exitcode for p in seen if p.exitcode not in (None, 0)]
            if dead:
                code = dead[0]
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                raise ExportError(f"{what} crashed: a capture worker process died ({how}); export with one process "
                                  "(workers=0) to see where") from None


@contextlib.contextmanager
def _rank_runner(job: _RankJob, workers: int) -> Iterator[_RankRunner]:
    """Fork the workers first, before this process starts tracing anything (torch.export
    patches global state while it traces; a fork must not inherit that)."""
    global _WORKER_JOB
    if workers < 1:
        yield _RankRunner(job, None)
        return
    import multiprocessing

    _WORKER_JOB = job
    torchlib_base()  # inherited by the workers: built once, not once per worker
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init)
    watched(pool)
    try:
        yield _RankRunner(job, pool)
    finally:
        pool.terminate()
        pool.join()
        _WORKER_JOB = None


Captured = tuple[onnx.ModelProto, dict[str, Any], dict[str, Any], float]  # (program, pieces, steps, seconds)


def _serialized(capture: Callable[..., Captured], payload: bytes) -> tuple[bytes, dict[str, Any], dict[str, Any], float]:
    """A worker's capture of its arguments (`by_value`), its program as bytes (a ModelProto
    crosses processes that way)."""
    model, pieces, steps, seconds = capture(*pickle.loads(payload))
    return model.SerializeToString(), pieces, steps, seconds


@contextlib.contextmanager
def capture_pool(capture: Callable[..., Captured], workers: int) -> Iterator[tuple[Callable[..., Any], Callable[[Any], Captured]]]:
    """For the exporters that capture their ranks themselves (the meshes): submit(*args) -> a
    handle, get(handle) -> capture(*args). With `workers`, in that many processes forked before
    this one traces anything (as `_rank_runner`'s); with none, here, at get. `capture` is a
    module-level function (workers find it by name)."""
    if workers < 1:
        yield (lambda *args: args), (lambda handle: capture(*handle))
        return
    import multiprocessing

    torchlib_base()  # inherited by the workers: built once, not once per worker
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init)
    watched(pool)

    def get(handle: Any) -> Captured:
        data, pieces, steps, seconds = awaited(handle, pool, "a rank's capture")
        return onnx.ModelProto.FromString(data), pieces, steps, seconds

    try:
        yield (lambda *args: pool.apply_async(_serialized, (capture, by_value(args)))), get
    finally:
        pool.terminate()
        pool.join()


def _layers_manifest(layers: str | None, seq_steps: dict[str, Any], rank_steps: list[dict[str, Any]]) -> Any:
    """Which layer calls share which function, per program (None for a flat export)."""
    if layers is None:
        return None
    return {"stack": layers, "seq": seq_steps.get("layers"), "ranks": [s.get("layers") for s in rank_steps]}


def _check_out_dir(out_dir: Path) -> None:
    """`out_dir` may be replaced only if it is absent or a model directory (never other files)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir}: exists and is not a directory")
    foreign = sorted(
        p.name
        for p in out_dir.iterdir()
        if p.name not in _MODEL_DIR_FILES and not (p.name.startswith("rank") and p.suffix == ".onnx")
    )
    if foreign:
        raise ExportError(f"{out_dir}: exists and is not a model directory (it holds {foreign[0]!r}); not replacing it")


def _write(out_dir: Path, seq: onnx.ModelProto, ranks: Sequence[onnx.ModelProto | None], config: dict,
           manifest: dict) -> None:
    """Write the directory into a temporary sibling, then swap it into place. A rank given as None
    has no file (a DP row's copy, which refine.json declares: `row_copies`)."""
    _check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    old = None
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the model directory's mode
        onnx.save(seq, str(tmp / SEQ_NAME))
        for r, m in enumerate(ranks):
            if m is not None:
                onnx.save(m, str(tmp / rank_file_name(r)))
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=1) + "\n")
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            out_dir.replace(old / "dir")
        tmp.replace(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old is not None:
            shutil.rmtree(old)


def bug_words(bug: NamedBug) -> str:
    """The description's words for an injected bug (its BUGS.md class and title)."""
    if bug.bug_class:
        return f", with a bug (BUGS.md class {bug.bug_class}): {bug.title}"
    return f", a correct variant of the bug machinery: {bug.title}"
