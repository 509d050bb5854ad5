"""Renaming tensors inside an ONNX model.

refine.json relates a sequential tensor to the *same-named* tensor on every rank, but torch
names a DTensor parameter after its unwrapping parametrization
(`q_proj.parametrizations.weight.original0`), so rank initializers are renamed back to the
sequential FQN after export.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import onnx

from exporters.errors import ExportError


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
