"""Loading a model directory (seq.onnx, rank*.onnx, refine.json): every file read, checked and
cross-checked here, so that each problem is one InputError naming its file. The graph ids of the
facts (`seq`, `r<k>`) are given here. Layer functions are inlined unless the memoized lowering
keeps the calls (refine/lowering/program.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from refine import dist
from refine.config import (
    SEQ_NAME,
    ModelConfig,
    load_config,
    rank_file_name,
)
from refine.errors import InputError
from refine.lowering import layers, row_copies

SEQ = "seq"


def rank_graph_id(rank: int) -> str:
    return f"r{rank}"


@dataclass
class LoadedModels:
    """The parsed model directory: every rank's program, or (`rank_ids`) those of the ranks that
    stand for the others (the first row of a mesh whose rows run the same program,
    refine/lowering/rows.py: `rows` says which)."""

    config: ModelConfig
    seq: onnx.ModelProto
    ranks: list[onnx.ModelProto]
    paths: dict[str, Path]  # graph id -> file
    rank_ids: list[int] | None = None  # the rank of each entry of `ranks` (None: 0, 1, ...)
    rows: RowSymmetry | None = None

    def rank_graphs(self) -> list[tuple[str, onnx.ModelProto]]:
        """(graph id, program) of every rank loaded, in rank order."""
        ids = self.rank_ids if self.rank_ids is not None else range(len(self.ranks))
        return [(rank_graph_id(r), m) for r, m in zip(ids, self.ranks)]


@dataclass(frozen=True)
class RowSymmetry:
    """A mesh whose rows along `dim` run the same programs on their own chunk of the batch:
    only row 0's ranks are lowered, and the relations proved for row 0 hold for every row
    (docs/rows.md; the check is refine/lowering/rows.py)."""

    dim: str  # the mesh dim the batch is split over (dp)
    rows: int  # its size: the number of rows, and of batch chunks
    declared: bool = False  # the other rows have no files: refine.json declares them row 0's copies


# --- loading and validation ----------------------------------------------------------------


def load_model_file(path: Path) -> onnx.ModelProto:
    """Load one ONNX file (no external weight data), checked; problems are InputErrors."""
    if not path.exists():
        raise InputError(path, "missing")
    if not path.is_file():
        raise InputError(path, "not a file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise InputError(path, f"not a readable ONNX model ({type(exc).__name__})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise InputError(path, "not a readable ONNX model (no graph)")
    for node in _all_nodes(model):
        if node.domain == dist.DIST_DOMAIN and node.op_type not in dist.KNOWN_OPS:
            raise InputError(
                path, f"unknown collective dist.{node.op_type} in node {node.name!r} "
                f"(known: {', '.join(dist.KNOWN_OPS)})"
            )
    topological_order(model.graph, path)  # a cycle gets its own message, before the checker's
    dist.register_schemas()
    try:
        onnx.checker.check_model(model, full_check=False)
    except (onnx.checker.ValidationError, ValueError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else "invalid"
        if "topologically sorted" in text:
            first = "nodes are not in topological order"
        raise InputError(path, f"invalid ONNX model: {first}") from None
    return model


def _all_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The main graph's nodes and those of every local function."""
    return list(model.graph.node) + [n for fn in model.functions for n in fn.node]


def load_model_dir(model_dir: Path, inline: bool = True) -> LoadedModels:
    """Load and cross-check a model directory: config, sequential model, every rank.

    Layers stored as local functions (docs/layers.md) are inlined unless `inline` is False
    (the memoized lowering, refine/lowering/program.py, keeps the calls).

    Whatever can be checked per file is checked here, so that the error names that file:
    the file set against refine.json's world_size (`model_dir_files`), and what each file
    says of itself (`check_own_claims`).
    """
    config, paths = model_dir_files(model_dir)
    models = {g: load_graph(g, path, config.world_size, inline) for g, path in paths.items() if _stored(config, g)}
    if config.row_copies is not None:  # (declared copies: made from their counterparts' programs just loaded)
        programs = row_copies.RankPrograms(model_dir, config, load=lambda path: models[_graph_of(path)])
        for r in range(config.world_size):
            if not config.stored(r):
                models[rank_graph_id(r)] = copy = programs.program(r)
                check_own_claims(copy, rank_graph_id(r), programs.path(r), config.world_size)
    return LoadedModels(config, models[SEQ], [models[rank_graph_id(r)] for r in range(config.world_size)], paths)


def _stored(config: ModelConfig, g: str) -> bool:
    return g == SEQ or config.stored(int(g[1:]))


def _graph_of(path: Path) -> str:
    """The graph id of a rank file (`rank5.onnx`: r5)."""
    return rank_graph_id(int(path.stem.removeprefix("rank")))


def model_dir_files(model_dir: Path) -> tuple[ModelConfig, dict[str, Path]]:
    """refine.json, and the file of each graph id: the file set checked against its world_size. A
    rank that refine.json declares a row copy has no file; its id maps to its counterpart's file."""
    if not model_dir.exists():
        raise InputError(model_dir, "no such model directory")
    if not model_dir.is_dir():
        raise InputError(model_dir, "not a model directory (expected seq.onnx, rank*.onnx, refine.json)")
    config = load_config(model_dir)
    n = config.world_size
    seq_path = model_dir / SEQ_NAME
    if not seq_path.exists():
        raise InputError(seq_path, "missing (a model directory needs seq.onnx)")
    for r in range(n):  # stops at the first missing file, so a huge world_size fails fast
        path = model_dir / rank_file_name(r)
        if config.stored(r) and not path.exists():
            raise InputError(path, f"missing (refine.json says world_size {n}: rank0.onnx .. rank{n - 1}.onnx"
                             + (", those of the other rows along " + config.row_copies.dim + " declared copies"
                                if config.row_copies is not None else "") + ")")
        if not config.stored(r) and path.exists():
            assert config.row_copies is not None
            raise InputError(path, f"present, but refine.json declares rank {r} a copy of row "
                             f"{config.row_copies.dim}=0's program (row_copies): remove the file or the declaration")
    extra = model_dir / rank_file_name(n)
    if extra.exists():
        raise InputError(extra, f"present, but refine.json says world_size {n}")
    holder = row_copies.RankPrograms(model_dir, config)
    paths = {SEQ: seq_path}
    paths.update({rank_graph_id(r): holder.path(r) for r in range(n)})  # (a copy: the file of its counterpart)
    return config, paths


def load_graph(g: str, path: Path, world_size: int, inline: bool = True) -> onnx.ModelProto:
    """One file of a model directory, loaded and checked on its own (`load_model_file`, then
    `check_own_claims`), its layer functions inlined unless `inline` is False."""
    model = load_model_file(path)
    check_own_claims(model, g, path, world_size)
    return layers.inline_calls(model, path) if inline else model


def check_own_claims(model: onnx.ModelProto, g: str, path: Path, world_size: int) -> None:
    """What a file says of itself against its place: `world_size`/`rank` metadata, and every
    collective's attributes (a known reduce_op; a group of distinct ranks in 0..world_size-1 that
    contains the calling rank; no collectives in seq.onnx)."""
    n = world_size
    rank = None if g == SEQ else int(g[1:])
    meta = {p.key: p.value for p in model.metadata_props}
    if "world_size" in meta and meta["world_size"].strip() != str(n):
        raise InputError(path, f"metadata says world_size {meta['world_size']!r}, refine.json says {n}")
    if "rank" in meta and rank is not None and meta["rank"].strip() != str(rank):
        raise InputError(path, f"metadata says rank {meta['rank']!r}, file name says rank {rank}")
    for node in _all_nodes(model):
        if node.domain != dist.DIST_DOMAIN:
            continue
        kind = "point-to-point call" if node.op_type in dist.POINT_TO_POINT_OPS else "collective"
        what = f"{kind} {node.name or node.op_type!r}"
        if rank is None:
            raise InputError(path, f"{what}: the sequential model must not contain collectives")
        problem = dist.call_problem(node.op_type, dist.node_attrs(node), rank, n)
        if problem is not None:
            raise InputError(path, f"{what} {problem}" if problem.startswith("has ") else f"{what}: {problem}")



def topological_order(graph: onnx.GraphProto, path: Path) -> list[onnx.NodeProto]:
    """Nodes in a topological order (Kahn); a cycle, a tensor assigned twice, or one read that
    nothing defines, is bad input."""
    sources = {vi.name for vi in graph.input} | {init.name for init in graph.initializer}
    produced_by: dict[str, int] = {}
    for i, n in enumerate(graph.node):
        for out in n.output:
            if not out:
                continue
            if out in produced_by:
                first = graph.node[produced_by[out]]
                raise InputError(path, f"tensor {out!r} is the output of two nodes "
                                 f"({first.name or first.op_type!r} and {n.name or n.op_type!r})")
            if out in sources:
                raise InputError(path, f"tensor {out!r} is a graph input or initializer and "
                                 f"also the output of node {n.name or n.op_type!r}")
            produced_by[out] = i
    for n in graph.node:  # (before the checker, whose word for it is "not topologically sorted")
        undefined = next((t for t in n.input if t and t not in produced_by and t not in sources), None)
        if undefined is not None:
            raise InputError(path, f"node {n.name or n.op_type!r} reads {undefined!r}, which nothing defines "
                             "(no node's output, graph input or initializer has that name)")
    deps = [{produced_by[t] for t in n.input if t in produced_by} for n in graph.node]
    users: list[list[int]] = [[] for _ in graph.node]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    pending = [len(ds) for ds in deps]
    ready = [i for i, p in enumerate(pending) if p == 0]
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    if len(order) != len(graph.node):
        stuck = next(n for i, n in enumerate(graph.node) if pending[i] > 0)
        raise InputError(path, f"the graph has a cycle through node {stuck.name or stuck.op_type!r}")
    order.sort()  # keep the file's order where it is already topological (it must be, by ONNX)
    return [graph.node[i] for i in order]


# --- per-graph lowering --------------------------------------------------------------------

