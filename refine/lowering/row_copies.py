"""Row copies: a rank of another DP row as its row-0 counterpart's program with its calls moved.

An exporter that captures one row of a mesh writes the other rows' programs as copies of it
(each group member, peer and root moved to the copy's row; a column group, which holds every
row, kept). It may write them as files, which `refine verify` recognises byte for byte
(refine/lowering/rows.py), or not write them at all and declare them in refine.json
(`row_copies`, refine/config.py RowCopies): 16,384 files of a 405B layout are 35 GB of the same
bytes. This module is the one place that turns row 0's program into a copy, and (`RankPrograms`)
the one place that reads every rank's program of a directory, from its file or as a copy, for the
whole-directory readers (the whole lowering, the simulator, `--check`, the mutation harness).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from math import prod
from pathlib import Path

import onnx

from refine import dist
from refine.config import CONFIG_NAME, ModelConfig, load_config, rank_file_name


class RowMesh:
    """Rank arithmetic for one row dim: the row of a rank and its row-0 counterpart."""

    def __init__(self, config: ModelConfig, dim: str) -> None:
        assert config.mesh is not None
        self.config = config
        axis = config.mesh.dims.index(dim)
        self.rows = config.mesh.shape[axis]
        self.stride = prod(config.mesh.shape[axis + 1:])  # (row-major: ranks one row apart)

    def row(self, rank: int) -> int:
        return (rank // self.stride) % self.rows

    def counterpart(self, rank: int) -> int:
        return rank - self.row(rank) * self.stride

    def in_row(self, members: list[int], row: int) -> bool:
        return all(self.row(m) == row for m in members)

    def is_column(self, members: list[int]) -> bool:
        """A group that holds, with each member, its counterpart in every row (each once): a call
        across the rows that every row makes alike, the DP column's all-reduce of gradients or
        of the token count (docs/rows.md, column calls)."""
        # (a member is its counterpart plus its row times the stride, so distinct members are
        # distinct (counterpart, row) pairs: they are every pair iff there are rows x counterparts of them)
        distinct = set(members)
        return len(distinct) == len(members) == len({self.counterpart(m) for m in distinct}) * self.rows

    def mirrors(self, members: list[int]) -> list[tuple[int, int, int]]:
        """(J, J0, K) for each member J of a column group outside row 0: it is row K's counterpart
        of member J0, a row-0 rank."""
        position = {m: j for j, m in enumerate(members)}
        return [(j, position[self.counterpart(m)], self.row(m)) for j, m in enumerate(members) if self.row(m) != 0]


class RowCopies:
    """A row-0 program as the file of its counterpart in another row would hold it, were that
    file a copy: the same bytes but for the `rank` metadata and every group member, peer and
    root moved to that row. (Only its few dist nodes change from row to row.)"""

    def __init__(self, model: onnx.ModelProto, mesh: RowMesh) -> None:
        self.model, self.mesh = copy_model(model), mesh
        self.calls = [(attr, list(attr.ints) if attr.name == "group" else attr.i)
                      for node in dist_nodes(self.model) for attr in node.attribute
                      if attr.name in ("group", "peer", "root")
                      and not (attr.name == "group" and mesh.is_column(list(attr.ints)))]  # (a column stays)
        self.rank_meta = next((p for p in self.model.metadata_props if p.key == "rank"), None)

    def as_rank(self, rank: int) -> bytes:
        shift = self.mesh.row(rank) * self.mesh.stride
        for attr, value in self.calls:
            if isinstance(value, list):
                attr.ints[:] = [m + shift for m in value]
            else:
                attr.i = value + shift
        if self.rank_meta is not None:
            self.rank_meta.value = str(rank)
        return self.model.SerializeToString()


def row_copier(model: onnx.ModelProto, config: ModelConfig, dim: str) -> Callable[[int], bytes]:
    """Row 0's program `model` as each of its counterparts in the other rows along mesh dim `dim`
    runs it (groups inside the row, peers and roots moved to that row; column groups kept), as a
    function of the counterpart's rank giving its file's bytes: what an exporter that captures one
    row writes for the others (one at a time: 16,384 programs need not be held at once), and
    `load_rows` recognises unparsed."""
    return RowCopies(model, RowMesh(config, dim)).as_rank


def row_copy(model: onnx.ModelProto, config: ModelConfig, dim: str, rank: int) -> onnx.ModelProto:
    """`row_copier`'s program for one counterpart `rank`, parsed."""
    return onnx.ModelProto.FromString(row_copier(model, config, dim)(rank))


class RankPrograms:
    """Every rank's program of a model directory: read from its file by `load`, or, for a rank that
    refine.json declares a row copy (`row_copies`), made from its row-0 counterpart's program as
    loaded. `path(rank)` is the file that holds a rank's program (for a copy, its counterpart's):
    what an error about that program names."""

    def __init__(self, model_dir: Path, config: ModelConfig,
                 load: Callable[[Path], onnx.ModelProto] = lambda path: onnx.load(str(path))) -> None:
        self.model_dir, self.config, self.load = model_dir, config, load
        declared = config.row_copies
        self.mesh = RowMesh(config, declared.dim) if declared is not None else None
        self._copiers: dict[int, Callable[[int], bytes]] = {}

    def counterpart(self, rank: int) -> int:
        """The rank whose file holds `rank`'s program (itself, or its row-0 counterpart)."""
        return rank if self.mesh is None else self.mesh.counterpart(rank)

    def path(self, rank: int) -> Path:
        return self.model_dir / rank_file_name(self.counterpart(rank))

    def program(self, rank: int) -> onnx.ModelProto:
        """Rank `rank`'s program: a fresh one on every call."""
        source = self.counterpart(rank)
        if source == rank:
            return self.load(self.path(rank))
        if source not in self._copiers:
            assert self.mesh is not None
            self._copiers[source] = RowCopies(self.load(self.path(source)), self.mesh).as_rank
        return onnx.ModelProto.FromString(self._copiers[source](rank))

    def all(self) -> list[onnx.ModelProto]:
        return [self.program(r) for r in range(self.config.world_size)]


def write_copies_out(model_dir: Path, dest: Path) -> None:
    """A copy of model directory `model_dir` at `dest` (which must not exist) with every declared row
    copy written as a file and refine.json's `row_copies` dropped: for tools that change one rank's
    file (the mutation harness), where a copy must no longer follow its counterpart."""
    config = load_config(model_dir)
    dest.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.is_file() and item.name != CONFIG_NAME:
            shutil.copyfile(item, dest / item.name)
    programs = RankPrograms(model_dir, config)
    for r in range(config.world_size):
        if not config.stored(r):
            onnx.save(programs.program(r), str(dest / rank_file_name(r)))
    raw = json.loads((model_dir / CONFIG_NAME).read_text())
    raw.pop("row_copies", None)
    (dest / CONFIG_NAME).write_text(json.dumps(raw, indent=1) + "\n")


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def dist_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    return (node for node in all_nodes(model) if node.domain == dist.DIST_DOMAIN)


def all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of the main graph, of local functions, and of their subgraphs."""

    def walk(nodes: list[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
        for node in nodes:
            yield node
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from walk(list(attr.g.node))
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        yield from walk(list(g.node))

    yield from walk(list(model.graph.node))
    for fn in model.functions:
        yield from walk(list(fn.node))
