"""Renaming tensors and nodes inside an ONNX model.

refine.json relates a sequential tensor to the *same-named* tensor on every rank, but torch
names a DTensor parameter after its unwrapping parametrization
(`q_proj.parametrizations.weight.original0`), so rank initializers are renamed back to the
sequential FQN after export.

Torch names nodes after its own FX nodes (`node_add_2`, `node_MatMul_14`), which is what every
report would show; `readable_node_names` renames them after the module that ran them
(`model.layers.0.mlp.down_proj/MatMul`). Edges go by tensor names, so no edge changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import onnx

from refine.exporters.errors import ExportError
from refine.lowering.graphs import module_scope


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for att in node.attribute:
            if att.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(att.g)
            elif att.type == onnx.AttributeProto.GRAPHS:
                for sub in att.graphs:
                    yield from _graphs(sub)


def value_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor name defined or used anywhere in the model."""
    names: set[str] = set()
    for g in _graphs(model.graph):
        names.update(v.name for v in (*g.input, *g.output, *g.value_info))
        names.update(i.name for i in g.initializer)
        for node in g.node:
            names.update(n for n in (*node.input, *node.output) if n)
    return names


def rename_values(model: onnx.ModelProto, mapping: Mapping[str, str]) -> None:
    """Rename tensors in place (definitions and every use, subgraphs included)."""
    mapping = {old: new for old, new in mapping.items() if old != new}
    if not mapping:
        return
    existing = value_names(model)
    targets = list(mapping.values())
    clash = sorted({t for t in targets if t in existing and t not in mapping} | {t for t in targets if targets.count(t) > 1})
    if clash:
        raise ExportError(f"cannot rename tensors: {clash[0]!r} would name two different tensors")
    for g in _graphs(model.graph):
        for v in (*g.input, *g.output, *g.value_info):
            v.name = mapping.get(v.name, v.name)
        for init in g.initializer:
            init.name = mapping.get(init.name, init.name)
        for node in g.node:
            for i, name in enumerate(node.input):
                node.input[i] = mapping.get(name, name)
            for i, name in enumerate(node.output):
                node.output[i] = mapping.get(name, name)


_INDEXED = re.compile(r"^(.+)\.(\d+)$")  # `model.layers.3`: a layer of a ModuleList


def readable_node_names(*models: onnx.ModelProto) -> None:
    """Name every node after the module that ran it and its op, unique within its graph:
    `model.layers.0.mlp.down_proj/MatMul`, then `.../MatMul_2`; `Add` with no module path;
    `... (backward)` for a training step's backward. Reports name nodes by these names.

    Inside a layer function the path is relative to the layer (`self_attn.o_proj/MatMul`): one
    body serves every layer that calls it, and the call node says which layer. Calls keep their
    names (the layer's module path, by which refine labels the call and its body's nodes)."""
    for model in models:
        functions = {(f.domain, f.name) for f in model.functions}
        calls = [n.name for g in _graphs(model.graph) for n in g.node if (n.domain, n.op_type) in functions]
        layer = _layer_prefix(calls)
        for g in _graphs(model.graph):
            _name_nodes(g.node, functions, None)
        for fn in model.functions:
            _name_nodes(fn.node, functions, layer)


def _layer_prefix(calls: Iterable[str]) -> re.Pattern[str] | None:
    """What starts the module path of a node inside a layer, whichever layer of the stack
    (`model.layers.<K>.`): torch may number a shared body's scopes after any of its layers."""
    alternatives = set()
    for call in calls:
        path = call.split(" (", 1)[0]  # `model.layers.3 (backward)` calls the backward of model.layers.3
        indexed = _INDEXED.match(path)
        alternatives.add(rf"{re.escape(indexed[1])}\.\d+" if indexed else re.escape(path))
    return re.compile(rf"^(?:{'|'.join(sorted(alternatives))})(?:\.|$)") if alternatives else None


def _scope(node: onnx.NodeProto, layer: re.Pattern[str] | None) -> str:
    """The node's module path from torch's name scopes (relative to the layer when `layer` is
    given), marked `(backward)` for a training step's backward node; '' if it has none."""
    path, backward = module_scope(node)
    if layer is not None:
        path = layer.sub("", path, count=1)
    if backward:
        path = f"{path} (backward)" if path else "backward"
    return path


def _name_nodes(nodes: Iterable[onnx.NodeProto], functions: set[tuple[str, str]], layer: re.Pattern[str] | None) -> None:
    """Rename one graph's (or function body's) nodes, its calls left as they are."""
    nodes = list(nodes)
    is_call = [(n.domain, n.op_type) in functions for n in nodes]
    taken = {n.name for n, call in zip(nodes, is_call) if call}
    seen: dict[str, int] = {}  # name stem -> how many nodes took it
    for node, call in zip(nodes, is_call):
        if call:
            continue
        scope = _scope(node, layer)
        stem = f"{scope}/{node.op_type}" if scope else node.op_type
        k = seen.get(stem, 0)
        name = stem if k == 0 else f"{stem}_{k + 1}"
        while name in taken:
            k += 1
            name = f"{stem}_{k + 1}"
        seen[stem] = k + 1
        taken.add(name)
        node.name = name
