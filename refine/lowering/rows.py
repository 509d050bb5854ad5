"""Row symmetry: a DP x TP mesh whose rows run the same programs is verified on one row.

A plan that splits the batch over one mesh dim (dp) and runs the same TP program in every row
has D rows whose rank programs differ only in the ranks their collectives name. Lowering and
solving every row costs D times one row, although the rows prove the same thing about
different chunks of the batch. This module decides, before anything is lowered, whether a
model directory has that symmetry; if so only row 0's ranks are loaded in full and lowered, and
the lowering states its declared batch chunks and outputs as chunk 0's (refine/lowering/graphs.py:
input_chunk_rel, output_chunk_rel, row_symmetry). docs/rows.md gives the soundness argument;
in short, the symmetry is claimed only when

- refine.json splits inputs over exactly one mesh dim R (the batch: shard over R, even
  chunks), every other input is a replica or split over other dims only (so a rank and its
  row-0 counterpart are given the same tensors, except for their own batch chunk), and every
  output is sharded over R (each row holds its own chunk of it);
- every rank's program equals its row-0 counterpart's byte for byte once each group member
  and peer is replaced by its own row-0 counterpart, and every collective and point-to-point
  call stays inside the caller's row (no reduction over the batch: a DP all-reduce of
  gradients breaks the symmetry, and such a plan is verified whole);

and the rules (rules/windows.lp, `rows_reduced`) then let row 0's ranks meet the batch only
through chunk 0 of the virtual per-chunk program, never through a real sequential tensor that
depends on the batch, so that every relation proved for chunk 0 holds of chunk K word for word.

A file that breaks the symmetry is not an error: the directory is then lowered whole (the
caller, refine/lowering/program.py). A file that is bad input is one, as in a whole load.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx

from refine.config import ModelConfig, PartialLayout, RepLayout, ShardLayout
from refine.lowering import layers
from refine.lowering.facts import FactSet
from refine.lowering.row_copies import RowCopies, RowMesh, all_nodes, copy_model, dist_nodes
from refine.lowering.load import (
    SEQ,
    LoadedModels,
    RowSymmetry,
    check_own_claims,
    load_graph,
    load_model_file,
    model_dir_files,
    rank_graph_id,
)


class NotSymmetric(Exception):
    """Raised by the lowering of a reduced directory when a check that needs shapes fails (a
    batch that does not split evenly, an undeclared output): lower it whole instead."""


def row_dim(config: ModelConfig) -> RowSymmetry | None:
    """The likeliest mesh dim whose rows may be symmetric, from refine.json alone (see the module
    docstring), or None. Only one is tried: a plan whose batch rows differ is verified whole."""
    mesh = config.mesh
    if mesh is None or len(mesh.dims) < 2 or not config.outputs:
        return None
    split_in = {d for d in mesh.dims if any(_splits_batch(layout, d) for layout in config.inputs.values())}
    split_out = {getattr(layout, "over", None) for layout in config.outputs.values()} - {None}
    # the batch dim, likeliest first (a wrong guess costs a reduced solve that proves nothing):
    # the token ids' dim (declared with a value range), then a dim
    # named for data parallelism, then a dim the outputs are chunked over (the logits) or, with a
    # replicated output (a training step's loss, whole after the DP column's all-reduce), one
    # no output is split over
    whole_outputs = any(isinstance(lay, RepLayout) for lay in config.outputs.values())

    def likelihood(d: str) -> tuple[bool, bool, bool, str]:
        ids = any(_splits_batch(lay, d) and lay.value_bounds() is not None for lay in config.inputs.values())
        return (not ids, "dp" not in d, (d in split_out) == whole_outputs, d)

    for dim in sorted(split_in, key=likelihood):
        rows = mesh.shape[mesh.dims.index(dim)]
        if rows < 2 or not all(isinstance(layout, RepLayout) or _splits_batch(layout, dim)
                               or (layout.over not in (None, dim) and getattr(layout, "then", None) is None)
                               for layout in config.inputs.values()):
            continue  # (split over the whole world, over the rows otherwise than in even chunks, or over two dims)
        if all(_splits_batch(layout, dim) or _same_in_every_row(layout, dim) for layout in config.outputs.values()):
            return RowSymmetry(dim, rows)
    return None


def _same_in_every_row(layout: ShardLayout | PartialLayout | RepLayout, dim: str) -> bool:
    """An output every row holds alike (a training step's loss and gradients, whole after the DP
    column's all-reduce): a replica, or a shard over another dim."""
    return isinstance(layout, RepLayout) or (isinstance(layout, ShardLayout) and layout.over not in (None, dim)
                                             and layout.then is None)


def _splits_batch(layout: ShardLayout | PartialLayout | RepLayout, dim: str) -> bool:
    """Even chunks over the rows, each row's chunk whole or cut again over another dim (a
    two-dim shard: the row's batch rows, their sequence over cp, a window of the row's chunk)."""
    return (isinstance(layout, ShardLayout) and layout.over == dim and (layout.stride or 1) == 1
            and (layout.sizes is None or len(set(layout.sizes)) == 1)
            and (layout.then is None or layout.then.over != dim))


def load_rows(model_dir: Path, inline: bool = True) -> LoadedModels | None:
    """The model directory with only row 0's programs loaded, if its rows are symmetric (module
    docstring), else None. The other rows' files are compared with their counterparts: first
    byte for byte with the counterpart as that row's copy of it (`RowCopies`: what an exporter
    that copies rows writes), else parsed, checked as far as they speak of themselves (metadata,
    their calls' groups) and compared in canonical form (`_row_form`). Either way they are valid
    ONNX, being a program that was checked in full with other group members. Ranks that
    refine.json declares row copies (`row_copies`) have no file and need no comparison."""
    config, paths = model_dir_files(model_dir)
    symmetry = row_dim(config)
    if symmetry is None or (config.row_copies is not None and config.row_copies.dim != symmetry.dim):
        return None  # (copies declared along another dim: the whole load makes them)
    mesh = RowMesh(config, symmetry.dim)
    n = config.world_size
    seq = load_graph(SEQ, paths[SEQ], n, inline)
    first_row = [r for r in range(n) if mesh.row(r) == 0]
    programs: dict[int, onnx.ModelProto] = {}
    forms: dict[int, bytes] = {}
    copies: dict[int, RowCopies] = {}
    for r in first_row:
        path = paths[rank_graph_id(r)]
        model = load_graph(rank_graph_id(r), path, n, inline=False)
        copies[r] = RowCopies(model, mesh)
        form = _row_form(copy_model(model), mesh, r)
        if form is None:
            return None
        forms[r] = form
        programs[r] = layers.inline_calls(model, path) if inline else model
    for r in range(n):
        if mesh.row(r) == 0 or not config.stored(r):
            continue  # (row 0 itself; a declared copy, which is its counterpart's program by construction)
        path = paths[rank_graph_id(r)]
        data = path.read_bytes()
        if data == copies[mesh.counterpart(r)].as_rank(r):
            continue
        model = _parse(data, path)
        check_own_claims(model, rank_graph_id(r), path, n)
        if _row_form(model, mesh, r) != forms[mesh.counterpart(r)]:
            return None
    if config.row_copies is not None:
        symmetry = RowSymmetry(symmetry.dim, symmetry.rows, declared=True)
    return LoadedModels(config, seq, [programs[r] for r in first_row], paths, rank_ids=first_row, rows=symmetry)


def add_mirror_facts(facts: FactSet, config: ModelConfig, symmetry: RowSymmetry) -> None:
    """mirror_member(Group, J, J0, K) for each member J of a column group that is not lowered: row
    K's counterpart of member J0 (rules/rows.lp states its part of the call by symmetry)."""
    mesh = RowMesh(config, symmetry.dim)
    members: dict[str, list[tuple[int, int]]] = {}
    for gid, index, rank in facts.rows["group_member"]:
        members.setdefault(str(gid), []).append((int(index), int(rank)))
    for gid, indexed in members.items():
        ranks = [rank for _index, rank in sorted(indexed)]
        if not mesh.in_row(ranks, 0) and mesh.is_column(ranks):
            for j, j0, k in mesh.mirrors(ranks):
                facts.add("mirror_member", gid, j, j0, k)


def _parse(data: bytes, path: Path) -> onnx.ModelProto:
    """A file's bytes as a model; what does not parse, or is no model, is checked in full (and
    fails there with the same message as in a whole load)."""
    try:
        model = onnx.ModelProto.FromString(data)
    except Exception:  # noqa: BLE001 - load_model_file words every failure
        return load_model_file(path)
    if not model.HasField("graph"):
        return load_model_file(path)
    return model


def _row_form(model: onnx.ModelProto, mesh: RowMesh, rank: int) -> bytes | None:
    """The digest of a program with its rank-specific parts made row-0's (modifies `model`):
    its own metadata, node names and source lines dropped, its inner values named by first
    use (`_canonical_names`), every group member, peer and root replaced by its row-0
    counterpart, a column group (`RowMesh.is_column`) of an all-reduce kept as it is. None if any
    other call reaches outside the caller's row (a column's reduce-scatter, all-to-all or broadcast
    hands each member a value that depends on its place in the group, which row 0's proof does
    not rename)."""
    row = mesh.row(rank)
    _canonical_names(model, set(mesh.config.inputs))
    del model.metadata_props[:]
    model.graph.name, model.graph.doc_string = "", ""
    for node in all_nodes(model):  # (names and source lines: what reports print, never what runs)
        node.name, node.doc_string = "", ""
        del node.metadata_props[:]
    for node in dist_nodes(model):
        for attr in node.attribute:
            if attr.name == "group":
                if mesh.is_column(list(attr.ints)):
                    if node.op_type != "AllReduce":
                        return None  # (a member's output that depends on its place: a scatter's block, a root's value)
                    continue  # (the same group in every row, every member the same sum)
                if not mesh.in_row(list(attr.ints), row):
                    return None
                attr.ints[:] = [mesh.counterpart(m) for m in attr.ints]
            elif attr.name in ("peer", "root"):
                if mesh.row(attr.i) != row:
                    return None
                attr.i = mesh.counterpart(attr.i)
    return hashlib.sha256(model.SerializeToString(deterministic=True)).digest()


def _canonical_names(model: onnx.ModelProto, declared: set[str]) -> None:
    """Rename the main graph's inner values (not its inputs, outputs or declared tensors, which
    refine.json and the other ranks name) by first use, and order initializers and value_info by
    name: the same program traced twice names its values afresh (`val_7`, `val_9`). A graph
    with subgraphs (whose bodies may read outer names) keeps its names."""
    g = model.graph
    if any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for attr in n.attribute):
        return
    keep = declared | {vi.name for vi in g.input} | {vi.name for vi in g.output} | {""}
    names: dict[str, str] = {}

    def canon(name: str) -> str:
        return name if name in keep else names.setdefault(name, f"v{len(names)}")

    for node in g.node:
        node.input[:] = [canon(x) for x in node.input]
        node.output[:] = [canon(x) for x in node.output]
    for init in g.initializer:
        init.name = canon(init.name)
    for vi in g.value_info:
        vi.name = canon(vi.name)
    for field in (g.initializer, g.value_info):
        ordered = sorted(field, key=lambda item: item.name)
        copies = [type(item).FromString(item.SerializeToString()) for item in ordered]
        del field[:]
        field.extend(copies)
