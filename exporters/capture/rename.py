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
from collections.abc import Callable, Iterable, Iterator, Mapping

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
    names (the layer's module path, by which refine labels the call and its body's nodes).

    The tensors torch named after its trace (`view_33`, `add_2`) are then named in the user's
    words too (`readable_value_names`), so that no report has to speak torch's language."""
    for model in models:
        functions = {(f.domain, f.name) for f in model.functions}
        calls = [n.name for g in _graphs(model.graph) for n in g.node if (n.domain, n.op_type) in functions]
        layer = _layer_prefix(calls)
        for g in _graphs(model.graph):
            _name_nodes(g.node, functions, None)
        for fn in model.functions:
            _name_nodes(fn.node, functions, layer)
        readable_value_names(model)


_LAYER_DOMAIN = "refine.layer"  # (capture/layers.py's LAYER_DOMAIN; this module imports no torch)

# ops whose output is their first input's values, moved: its tensor is named after that input
_VIEWS = {"Reshape": "view", "Flatten": "view", "Squeeze": "view", "Unsqueeze": "view", "Identity": "view",
          "Expand": "view", "Transpose": "transposed", "Cast": "cast"}


def readable_value_names(model: onnx.ModelProto) -> None:
    """Name the tensors made inside the programs in the user's words, unique within their graph
    (or layer body), from the readable node names (`readable_node_names` runs first):

    - a view of a tensor (Reshape, Transpose, Identity, Cast, ...) is that tensor's name and
      what was done: `down.bias (view)`, `up.weight (transposed)`, `down/MatMul (view 2)`; the
      name of a parameter, buffer or input survives every view of it;
    - any other tensor is named after the node that made it, its module path and op
      (`layers.0.mlp.down/MatMul`; a second output `.../Split:1`); a layer call's output after
      the layer (`model.layers.3 (output)`).

    Graph inputs, outputs and initializers keep their names (refine.json declares them), and
    so do a layer function's formal inputs and outputs. Edges go by tensor names: every use is
    renamed with its definition (subgraphs included)."""
    bodies: dict[tuple[str, str], set[str]] = {}  # function -> its body's tensors, renamed
    for fn in model.functions:
        inner = _value_names(fn.node, {*fn.input, *fn.output})
        for node in fn.node:
            node.input[:] = [inner.get(t, t) for t in node.input]
            node.output[:] = [inner.get(t, t) for t in node.output]
        for vi in fn.value_info:
            vi.name = inner.get(vi.name, vi.name)
        bodies[(fn.domain, fn.name)] = {t for n in fn.node for t in n.output if t} - set(fn.output)
    # a layer call's body is inlined (refine/lowering/layers.py) as `CALL/NAME`: no main-graph name may be one
    inlined = {f"{n.name}/{t}" for n in model.graph.node for t in bodies.get((n.domain, n.op_type), ())}
    protected = {v.name for v in (*model.graph.input, *model.graph.output)} | {i.name for i in model.graph.initializer}
    rename_values(model, _value_names(model.graph.node, protected, inlined))


def _value_names(nodes: Iterable[onnx.NodeProto], protected: set[str], reserved: set[str] = frozenset()
                 ) -> dict[str, str]:
    """old -> new name of every tensor the nodes make (but `protected` ones), in node order; no new
    name is one of `reserved`."""
    nodes = list(nodes)
    taken = set(protected) | {t for n in nodes for t in (*n.input, *n.output) if t} | set(reserved)
    mapping: dict[str, str] = {}  # (no new name may shadow an old one)
    root: dict[str, tuple[str, str]] = {}  # new name of a view -> (the name it views, what was done)
    for node in nodes:
        for i, out in enumerate(node.output):
            if not out or out in protected:
                continue
            if out not in reserved:
                taken.discard(out)  # (it may keep its own name)
            source = mapping.get(node.input[0], node.input[0]) if node.input else ""
            word = _VIEWS.get(node.op_type) if node.domain in ("", "ai.onnx") and source else None
            if word is not None:
                base, done = root.get(source, (source, word))
                done = word if word != "view" else done  # (a transposed view stays transposed)
                name = _unique(f"{base} ({done})", taken, lambda k, b=base, d=done: f"{b} ({d} {k})")
                root[name] = (base, done)
            else:
                stem = node.name or node.op_type
                # (a layer call's output: not the call's own name, which names its body's nodes)
                stem = f"{stem} (output)" if node.domain == _LAYER_DOMAIN and node.name else stem
                stem = stem if i == 0 else f"{stem}:{i}"
                name = _unique(stem, taken, lambda k, s=stem: f"{s}#{k}")
            taken.add(name)
            mapping[out] = name
    return {old: new for old, new in mapping.items() if old != new}


def _unique(name: str, taken: set[str], numbered: Callable[[int], str]) -> str:
    """`name`, or `numbered(k)` for the first k >= 2 that no tensor has."""
    k = 2
    while name in taken:
        name, k = numbered(k), k + 1
    return name


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
