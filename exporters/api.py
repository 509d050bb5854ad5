"""`export` (any sequential module + a per-rank factory) and `export_model` (the zoo).

A model directory is written all or nothing: into a temporary directory next to `out_dir`,
renamed into place at the end. Besides the files refine reads (seq.onnx, rank{K}.onnx,
refine.json) it holds `export.json`, the exporter's manifest: how to rebuild the torch model
(zoo entries), the inputs' shapes and value ranges, the outputs' layouts, which rank
initializer was mapped to which sequential FQN, and timings. `exporters.check` reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch
from pydantic import TypeAdapter

from exporters.capture import fake_process_group, prepare_tracing, set_metadata, to_onnx
from exporters.collectives import translation_table
from exporters.configs import validate
from exporters.errors import ExportError
from exporters.layouts import REP, LayoutJson, Piece, derive_layout, match_name, module_fqn, rank_pieces
from exporters.rename import rename_values
from refine.config import (
    CONFIG_NAME,
    SEQ_NAME,
    Layout,
    ModelConfig,
    PartialLayout,
    ShardLayout,
    rank_file_name,
    shard_bounds,
)
from refine.dist import DIST_DOMAIN, register_schemas

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

    def summary(self) -> str:
        s = self.seconds
        dist_ops = {k: v for k, v in sorted(self.rank_op_types.items()) if k.startswith(f"{DIST_DOMAIN}.")}
        return (
            f"wrote {self.out_dir} (world size {self.config['world_size']}, {len(self.config['inputs'])} declared inputs; "
            f"seq {s['seq']:.1f}s, ranks {sum(s['ranks']):.1f}s; collectives per rank 0: "
            f"{', '.join(f'{k[len(DIST_DOMAIN) + 1:]} x{v}' for k, v in dist_ops.items()) or 'none'})"
        )


def _input_spec(t: torch.Tensor, high: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if not t.is_floating_point():
        spec["high"] = int(high) if high is not None else max(2, int(t.max()) + 1)
    return spec


def _graph_inputs(model: onnx.ModelProto) -> list[str]:
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _shape(vi: onnx.ValueInfoProto) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]


def _infer_output_layout(name: str, seq_shape: list[int | None], rank_shapes: list[list[int | None]]) -> LayoutJson:
    """rep if every rank's output has the sequential shape, shard if one axis is split evenly."""
    world = len(rank_shapes)
    if all(s == seq_shape for s in rank_shapes):
        return dict(REP)
    if all(s == rank_shapes[0] for s in rank_shapes) and len(seq_shape) == len(rank_shapes[0]):
        diff = [i for i, (a, b) in enumerate(zip(seq_shape, rank_shapes[0])) if a != b]
        if len(diff) == 1 and seq_shape[diff[0]] is not None and rank_shapes[0][diff[0]] == seq_shape[diff[0]] // world:
            return {"layout": "shard", "axis": diff[0]}
    raise ExportError(f"output {name!r}: cannot infer how rank shapes {rank_shapes} make {seq_shape}; pass output_layouts")


def _layout(name: str, layout: Mapping[str, Any]) -> LayoutJson:
    """A declared input layout: rep, or an (even or sized) shard; the rank's example is cut from it."""
    parsed = TypeAdapter(Layout).validate_python(dict(layout))
    if isinstance(parsed, PartialLayout):
        raise ExportError(f"input {name!r}: a partial input layout has no single example to export ranks with")
    return parsed.model_dump(exclude_none=True)


def _cut(value: torch.Tensor, layout: LayoutJson | None, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s example input under `layout` (the whole example when replicated)."""
    if layout is None or layout["layout"] == "rep":
        return value
    shard = ShardLayout.model_validate(layout)
    axis = shard.axis % value.dim()
    lo, hi = shard_bounds(shard, value.shape[axis], world_size)[rank]
    return value.narrow(axis, lo, hi - lo).contiguous()


def _check_onnx(model: onnx.ModelProto, what: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{what}: the exported model fails onnx.checker: {str(exc).splitlines()[0]}") from None


def export(
    seq_module: torch.nn.Module,
    rank_module_factory: Callable[[int], torch.nn.Module],
    example_inputs: Sequence[torch.Tensor],
    world_size: int,
    out_dir: Path | str,
    *,
    output_names: Sequence[str] | None = None,
    output_layouts: Mapping[str, LayoutJson] | None = None,
    input_layouts: Mapping[str, LayoutJson] | None = None,
    input_ranges: Mapping[str, int] | None = None,
    description: str | None = None,
    zoo: Mapping[str, Any] | None = None,
) -> ExportResult:
    """Export `seq_module` and its `world_size` ranks to the model directory `out_dir`.

    `rank_module_factory(rank)` is called while a fake process group (this process = `rank`)
    is initialized; it builds and parallelizes the rank's module (DTensor plans on a 1-D
    mesh over all ranks). Parameters and buffers stay initializers, named by their sequential
    FQN on every side, and refine.json declares each one's layout as DTensor placed it.
    Graph inputs are replicated unless `input_layouts` shards them (each rank is then exported
    with its chunk of the example); output layouts are inferred from shapes unless given. Integer inputs take values in [0, input_ranges[name])
    in `check` (default: max of the example + 1).
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)  # before the slow part
    if world_size < 1:
        raise ExportError(f"world size must be at least 1, got {world_size}")
    args = tuple(example_inputs)
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise ExportError("example_inputs must be a sequence of tensors")
    prepare_tracing()
    start = time.perf_counter()
    seq_module.eval()
    with torch.no_grad():
        outs = seq_module(*args)
    n_out = len(outs) if isinstance(outs, (tuple, list)) else 1
    default_names = ["output"] if n_out == 1 else [f"output_{i}" for i in range(n_out)]
    names = list(output_names) if output_names else default_names
    seq = to_onnx(seq_module, args, names)
    seq_seconds = time.perf_counter() - start
    seq_fqns = {n for n, _ in seq_module.named_parameters(remove_duplicate=False)}
    seq_fqns |= {n for n, _ in seq_module.named_buffers(remove_duplicate=False)}
    seq_inits = {i.name for i in seq.graph.initializer} & seq_fqns  # parameters and buffers, by FQN
    user_inputs = _graph_inputs(seq)

    ranks: list[onnx.ModelProto] = []
    held: dict[str, dict[int, Piece]] = {}
    name_map: dict[str, str] = {}
    unmatched: set[str] = set()
    rank_seconds: list[float] = []
    declared_inputs = {name: _layout(name, value) for name, value in (input_layouts or {}).items()}
    if set(declared_inputs) - set(user_inputs):
        raise ExportError(f"input_layouts names {sorted(set(declared_inputs) - set(user_inputs))}, not inputs {user_inputs}")
    seq_shapes = {i.name: tuple(i.dims) for i in seq.graph.initializer}
    for rank in range(world_size):
        t = time.perf_counter()
        rank_args = tuple(_cut(a, declared_inputs.get(n), rank, world_size) for n, a in zip(user_inputs, args))
        with fake_process_group(rank, world_size):
            module = rank_module_factory(rank)
            module.eval()
            pieces = rank_pieces(module, rank, world_size)
            model = to_onnx(module, rank_args, names, translation_table())
        renames = {}
        for init in model.graph.initializer:
            fqn = module_fqn(init.name)
            if fqn not in pieces:
                continue  # a constant torch lifted, not a parameter or buffer
            seq_name = match_name(fqn, seq_inits)
            if seq_name is None:
                unmatched.add(fqn)
                continue
            if pieces[fqn].global_shape != seq_shapes[seq_name]:
                raise ExportError(
                    f"rank {rank}'s {fqn} stands for a tensor of shape {list(pieces[fqn].global_shape)}, the sequential "
                    f"{seq_name} has shape {list(seq_shapes[seq_name])} (a rank-local slice must be a DTensor)"
                )
            renames[init.name] = seq_name
            name_map[seq_name] = init.name
            held.setdefault(seq_name, {})[rank] = pieces[fqn]
        rename_values(model, renames)
        if _graph_inputs(model) != user_inputs:
            raise ExportError(f"rank {rank} takes inputs {_graph_inputs(model)}, the sequential model {user_inputs}")
        set_metadata(model, world_size=world_size, rank=rank)
        ranks.append(model)
        rank_seconds.append(time.perf_counter() - t)

    inputs: dict[str, LayoutJson] = {name: declared_inputs.get(name, dict(REP)) for name in user_inputs}
    for seq_name in sorted(held):
        by_rank = held[seq_name]
        if len(by_rank) == world_size:
            inputs[seq_name] = derive_layout(seq_name, [by_rank[r] for r in range(world_size)])
        elif all(p.kind in ("plain", "rep") for p in by_rank.values()):
            inputs[seq_name] = dict(REP)  # refine skips the ranks that lack it
        else:
            raise ExportError(f"{seq_name}: sharded on ranks {sorted(by_rank)} and absent on the others")

    outputs = {}
    seq_out = {o.name: _shape(o) for o in seq.graph.output}
    for name in names:
        given = (output_layouts or {}).get(name)
        rank_shapes = [_shape(next(o for o in m.graph.output if o.name == name)) for m in ranks]
        outputs[name] = dict(given) if given else _infer_output_layout(name, seq_out[name], rank_shapes)

    config = {"world_size": world_size, "inputs": inputs, "outputs": outputs}
    if description:
        config["description"] = description
    ModelConfig.model_validate(config)  # what refine will read must be valid
    register_schemas()
    _check_onnx(seq, "seq.onnx")
    for r, m in enumerate(ranks):
        _check_onnx(m, rank_file_name(r))
    op_types = Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in ranks[0].graph.node)
    seconds = {"seq": seq_seconds, "ranks": rank_seconds}
    manifest = {
        "exporter": "refine exporters",
        "torch": torch.__version__,
        "zoo": dict(zoo) if zoo else None,
        "world_size": world_size,
        "inputs": {n: _input_spec(a, (input_ranges or {}).get(n)) for n, a in zip(user_inputs, args)},
        "outputs": outputs,
        "rank_names": {k: name_map[k] for k in sorted(name_map) if name_map[k] != k},
        "unmatched_rank_tensors": sorted(unmatched),
        "undeclared_seq_initializers": sorted(seq_inits - held.keys()),
        "seconds": seconds,
    }
    _write(out_dir, seq, ranks, config, manifest)
    return ExportResult(out_dir, config, manifest, seconds, op_types)


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


def _write(out_dir: Path, seq: onnx.ModelProto, ranks: list[onnx.ModelProto], config: dict, manifest: dict) -> None:
    """Write the directory into a temporary sibling, then swap it into place."""
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


def zoo_rank_factory(model: str, config: str, tp: int, sp: bool, seed: int) -> Callable[[int], torch.nn.Module]:
    """rank -> the zoo model built from `seed` and parallelized by its plan on a 1-D mesh of `tp`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from exporters import plans, zoo

    def factory(rank: int) -> torch.nn.Module:
        mesh = init_device_mesh("cpu", (tp,))
        module = zoo.build(model, config, seed)
        # src_data_rank=None: every rank keeps its own chunk of the identically seeded weights
        parallelize_module(module, mesh, plans.make_plan(model, module, sp), src_data_rank=None)
        return module

    return factory


def export_model(
    model: str = "llama",
    config: str = "tiny",
    tp: int = 2,
    sp: bool = False,
    out: Path | str = Path("out"),
    seed: int = 0,
) -> ExportResult:
    """Export a zoo model under its TP (or TP+SP) plan to the model directory `out`."""
    from exporters import zoo

    cfg = validate(model, config, tp, sp)
    plan = "TP+SP" if sp else "TP"
    return export(
        zoo.build(model, config, seed),
        zoo_rank_factory(model, config, tp, sp, seed),
        zoo.example_inputs(model, config, seed),
        tp,
        out,
        output_names=["logits"],
        output_layouts={"logits": dict(REP)},
        input_ranges={"input_ids": cfg.vocab},
        description=f"{model} config {config!r}, {plan} over {tp} ranks, exported by `refine export`",
        zoo={"model": model, "config": config, "tp": tp, "sp": sp, "seed": seed},
    )
