"""Common subexpression elimination before lowering: a node that computes exactly what an
earlier node of the same graph computes (same op, domain and attributes, on the same inputs)
is merged into that earlier node.

Why: exporters repeat work on shared tensors once per layer (`cos.unsqueeze(1)` in every
attention layer, the same shape constants). Every copy on the sequential side relates to every
copy on a rank, so a flat L-layer graph would derive L x L relations for each such op. With the
copies merged there is one, and the work stays linear in depth.

Exactness: two deterministic nodes with the same op, attributes and input tensors give equal
outputs, so reading the first one's outputs instead of the copy's changes no value. Only ops of
the default ONNX domain qualify; never a collective (`dist`: matched by call order across
ranks), a layer call, a random op, or a node with a subgraph. A node writing a graph output
keeps it (an output's name is the output).

The merged node stays in the graph, marked (`merged`), with its outputs unread: lowering skips
it but keeps the graph's node positions, and the simulator, which runs the files, still
computes its values by name.
"""

from __future__ import annotations

import onnx

MERGED_KEY = "refine.cse"  # node metadata: the name of the node it was merged into
_DEFAULT_DOMAINS = ("", "ai.onnx")
_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                               "Multinomial", "Bernoulli", "Dropout"})
_SUBGRAPH_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def merged(node: onnx.NodeProto) -> bool:
    """Whether `node` was merged into an earlier node (lowering gives it no facts)."""
    return any(p.key == MERGED_KEY for p in node.metadata_props)


def merge_duplicates(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every later copy of a node merged into the first (a copy of the model;
    `model` itself when nothing repeats). Nodes must be in topological order (lowering checks)."""
    graph = model.graph
    outputs = {vi.name for vi in graph.output}
    first: dict[bytes, onnx.NodeProto] = {}
    rename: dict[str, str] = {}  # output of a merged copy -> the same output of the first node
    marks: dict[int, str] = {}  # position of a merged copy -> the first node's name
    for position, node in enumerate(graph.node):
        key = _key(node, rename, outputs)
        if key is None:
            continue
        kept = first.setdefault(key, node)
        if kept is not node:
            marks[position] = kept.name
            rename.update({mine: theirs for mine, theirs in zip(node.output, kept.output) if mine})
    if not marks:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for position, node in enumerate(out.graph.node):
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        if position in marks:
            node.metadata_props.add(key=MERGED_KEY, value=marks[position])
    return out


def _key(node: onnx.NodeProto, rename: dict[str, str], outputs: set[str]) -> bytes | None:
    """What identifies the node's computation (its op, attributes and inputs after merging), or
    None when it must not be merged."""
    if node.domain not in _DEFAULT_DOMAINS or node.op_type in _NONDETERMINISTIC or not node.output:
        return None
    if any(a.type in _SUBGRAPH_TYPES for a in node.attribute) or any(o in outputs for o in node.output):
        return None
    attrs = []
    for a in sorted(node.attribute, key=lambda a: a.name):
        attr = onnx.AttributeProto()
        attr.CopyFrom(a)
        if attr.HasField("t"):
            attr.t.ClearField("name")  # a Constant's value, not its name
        attr.ClearField("doc_string")
        attrs.append(attr.SerializeToString(deterministic=True))
    inputs = [rename.get(x, x) for x in node.input]
    slots = [bool(o) for o in node.output]
    return repr((node.op_type, node.overload, inputs, slots, attrs)).encode()  # bytes repr: unambiguous
