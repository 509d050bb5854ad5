"""Layers as ONNX model-local functions (docs/layers.md): find the calls, inline them, cut one
call out as a standalone graph, and hash a call's body canonically.

One renaming serves every use, so that names agree across the tool: the body of call `C`
becomes nodes and values named `C/NAME`; its formal inputs and outputs become the call's
actual tensors. The simulator and the plain (`--no-memo`) lowering inline whole models this
way; a failing layer is cut out this way for its report; a template's body is cut out with
formal names under the template's own prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

from refine.errors import InputError

FunctionKey = tuple[str, str]  # (domain, name)


@dataclass(frozen=True)
class LayerCall:
    """A main-graph node that calls a local function: the k-th such call in the graph."""

    index: int
    position: int  # the call node's index in graph.node
    label: str  # the call's name (its module path), unique in the graph: `model.layers.3`
    node: onnx.NodeProto
    function: onnx.FunctionProto


def local_functions(model: onnx.ModelProto) -> dict[FunctionKey, onnx.FunctionProto]:
    return {(f.domain, f.name): f for f in model.functions}


def layer_calls(model: onnx.ModelProto, path: Path) -> list[LayerCall]:
    """The main graph's calls of local functions, in the file's (topological) order."""
    functions = local_functions(model)
    calls: list[LayerCall] = []
    seen: set[str] = set()
    checked: set[FunctionKey] = set()  # each function once, however many calls it has
    for position, node in enumerate(model.graph.node):
        fn = functions.get((node.domain, node.op_type))
        if fn is None:
            continue
        if (fn.domain, fn.name) not in checked:
            _check_function(fn, path)
            checked.add((fn.domain, fn.name))
        label = node.name or f"{node.op_type}#{len(calls)}"
        if label in seen:
            label = f"{label}#{len(calls)}"
        seen.add(label)
        calls.append(LayerCall(len(calls), position, label, node, fn))
    return calls


def _check_function(fn: onnx.FunctionProto, path: Path) -> None:
    if fn.attribute or fn.attribute_proto:
        raise InputError(path, f"local function {fn.name!r} has attribute parameters, which refine does not support")
    for node in fn.node:
        if any(a.ref_attr_name or a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise InputError(path, f"local function {fn.name!r}: node {node.name or node.op_type!r} has a subgraph "
                             "or an attribute reference, which refine does not support inside a layer")


def body_nodes(fn: onnx.FunctionProto, functions: dict[FunctionKey, onnx.FunctionProto], actual_in: list[str],
               actual_out: list[str], prefix: str, path: Path, depth: int = 0,
               declared: list[onnx.ValueInfoProto] | None = None) -> Iterator[onnx.NodeProto]:
    """The nodes of `fn`'s body with formal inputs/outputs renamed to the actual ones and every
    other value and node name prefixed by `prefix`; nested calls are inlined recursively.

    With `declared`, the types the functions declare of their values (FunctionProto.value_info)
    are collected there under the same names, so that shape inference checks them
    (refine.lowering.shapes.infer_shapes) like any other declared type."""
    if depth > 32:
        raise InputError(path, f"local function {fn.name!r} calls itself (recursion)")
    _check_function(fn, path)
    rename = {"": ""}
    rename.update(zip(fn.input, actual_in))  # a missing trailing actual input stays absent
    for formal in fn.input[len(actual_in):]:
        rename[formal] = ""
    rename.update(zip(fn.output, actual_out))

    def name(value: str) -> str:
        return rename[value] if value in rename else prefix + value

    if declared is not None:
        declared.extend(helper.make_value_info(name(vi.name), vi.type) for vi in fn.value_info if name(vi.name))
    for i, node in enumerate(fn.node):
        inputs, outputs = [name(v) for v in node.input], [name(v) for v in node.output]
        inner = functions.get((node.domain, node.op_type))
        label = node.name or f"{node.op_type}_{i}"
        if inner is not None:
            yield from body_nodes(inner, functions, inputs, outputs, f"{prefix}{label}/", path, depth + 1, declared)
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + label
        del copy.input[:], copy.output[:]
        copy.input.extend(inputs)
        copy.output.extend(outputs)
        yield copy


def inline_calls(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """The model with every call replaced by its body (names `CALL/NAME`), functions dropped."""
    if not model.functions:
        return model
    functions = local_functions(model)
    calls = {c.position: c for c in layer_calls(model, path)}
    nodes: list[onnx.NodeProto] = []
    declared: list[onnx.ValueInfoProto] = []
    for position, node in enumerate(model.graph.node):
        call = calls.get(position)
        if call is None:
            nodes.append(node)
        else:
            nodes.extend(body_nodes(call.function, functions, list(node.input), list(node.output), f"{call.label}/",
                                    path, declared=declared))
    flat = onnx.ModelProto()
    flat.CopyFrom(model)
    del flat.graph.node[:], flat.functions[:]
    flat.graph.node.extend(nodes)
    flat.graph.value_info.extend(declared)
    used = {(n.domain or "") for n in nodes}
    _merge_opsets(flat, [f for f in model.functions], keep=used)
    return flat


def _merge_opsets(model: onnx.ModelProto, functions: list[onnx.FunctionProto], keep: set[str]) -> None:
    """Import, in `model`, every domain its nodes now use (functions import their own)."""
    have = {o.domain for o in model.opset_import}
    for fn in functions:
        for o in fn.opset_import:
            if o.domain not in have and o.domain in keep:
                model.opset_import.append(helper.make_opsetid(o.domain, o.version))
                have.add(o.domain)


def call_model(model: onnx.ModelProto, call: LayerCall, input_types: list[onnx.TypeProto | None],
               actual_in: list[str], actual_out: list[str], prefix: str, path: Path) -> onnx.ModelProto:
    """One call cut out as a standalone model: the body's nodes (renamed as in `body_nodes`),
    its inputs typed as at the call site, its outputs untyped (shape inference fills them)."""
    functions = local_functions(model)
    declared: list[onnx.ValueInfoProto] = []
    nodes = list(body_nodes(call.function, functions, actual_in, actual_out, prefix, path, declared=declared))
    inputs = []
    for name, tp in zip(actual_in, input_types):
        if not name:
            continue
        vi = onnx.ValueInfoProto(name=name)
        if tp is not None:
            vi.type.CopyFrom(tp)
        inputs.append(vi)
    outputs = [onnx.ValueInfoProto(name=name) for name in actual_out if name]
    graph = helper.make_graph(nodes, call.label, inputs, outputs, value_info=declared)
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    _merge_opsets(out, list(model.functions), keep={(n.domain or "") for n in nodes})
    return out


def body_digest(call: LayerCall, functions: dict[FunctionKey, onnx.FunctionProto],
                input_types: list[onnx.TypeProto | None], opsets: dict[str, int], path: Path) -> str:
    """A canonical hash of what the call computes: its body's ops, attributes, constants and
    wiring (values numbered by first appearance, names left out), the opsets it runs under
    and the types of its inputs. Equal digests mean the same computation on the same types."""
    formal_in = [f"in{i}" for i in range(len(call.node.input))]
    formal_out = [f"out{i}" for i in range(len(call.node.output))]
    numbering: dict[str, str] = {}
    h = hashlib.sha256()
    for i, tp in enumerate(input_types):
        h.update(f"in{i}:{tp.SerializeToString().hex() if tp is not None else '?'};".encode())
    h.update(f"opsets:{sorted(opsets.items())};outputs:{len(formal_out)};".encode())
    for node in body_nodes(call.function, functions, [a and f for a, f in zip(call.node.input, formal_in)],
                           formal_out, "v:", path):
        ins = [_canonical(v, numbering) for v in node.input]
        outs = [_canonical(v, numbering) for v in node.output]
        attrs = sorted((a.name, a.SerializeToString()) for a in node.attribute)
        h.update(f"{node.domain}|{node.op_type}|{ins}|{outs}|".encode())
        for key, blob in attrs:
            h.update(key.encode() + b"=" + blob + b";")
    return h.hexdigest()[:16]


def _canonical(value: str, numbering: dict[str, str]) -> str:
    if not value.startswith("v:"):
        return value  # a formal input/output, or absent
    if value not in numbering:
        numbering[value] = f"t{len(numbering)}"
    return numbering[value]
