"""The `dist` ONNX domain: collectives written as ordinary ONNX nodes.

Rank programs are plain ONNX models in which communication is a node of domain `dist`, so
that they can be checked, stored and executed with ONNX tooling. This module is the single
place that knows the ops, their attributes and their shape rule; the lowering (refine/lowering/)
and the reference executor (refine/simulate.py) both read collectives through it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import onnx
from onnx import helper
from onnx.defs import OpSchema

DIST_DOMAIN = "dist"
DIST_VERSION = 1
KNOWN_OPS = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")
REDUCE_OPS = ("sum", "max", "min", "avg")

_TENSOR_TYPES = tuple(
    f"tensor({t})"
    for t in (
        "float", "double", "float16", "bfloat16",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    )
)

# op -> its attributes in a fixed order: (name, AttrType, default or None if required).
_ATTRS: dict[str, tuple[tuple[str, Any, Any], ...]] = {
    "AllReduce": (("reduce_op", OpSchema.AttrType.STRING, "sum"), ("group", OpSchema.AttrType.INTS, None)),
    "AllGather": (("axis", OpSchema.AttrType.INT, None), ("group", OpSchema.AttrType.INTS, None)),
    "ReduceScatter": (
        ("axis", OpSchema.AttrType.INT, None),
        ("reduce_op", OpSchema.AttrType.STRING, "sum"),
        ("group", OpSchema.AttrType.INTS, None),
    ),
    "AllToAll": (
        ("split_axis", OpSchema.AttrType.INT, None),
        ("concat_axis", OpSchema.AttrType.INT, None),
        ("group", OpSchema.AttrType.INTS, None),
    ),
}

_DOCS = {
    "AllReduce": "Every member gets the elementwise reduction (reduce_op) of all members' X.",
    "AllGather": "Every member gets all members' X concatenated along axis, in group order.",
    "ReduceScatter": "Reduce all members' X, then member j gets chunk j of n equal chunks along axis.",
    "AllToAll": "Member i sends chunk j (of n along split_axis) to member j, which concatenates "
    "what it receives along concat_axis in group order.",
}

_register_lock = threading.Lock()


def _schema(op: str) -> OpSchema:
    attributes = []
    for name, kind, default in _ATTRS[op]:
        if default is None:
            attributes.append(OpSchema.Attribute(name, kind, f"{name} (required)", required=True))
        else:
            attributes.append(OpSchema.Attribute(name, helper.make_attribute(name, default), f"{name}"))
    return OpSchema(
        op,
        DIST_DOMAIN,
        DIST_VERSION,
        _DOCS[op] + " group: global ranks of the members, in group order.",
        inputs=[OpSchema.FormalParameter("X", "T", "this rank's contribution")],
        outputs=[OpSchema.FormalParameter("Y", "T", "this rank's result")],
        type_constraints=[("T", _TENSOR_TYPES, "numeric tensors")],
        attributes=attributes,
    )


def register_schemas() -> None:
    """Make the `dist` ops known to onnx (checker, schema lookups); safe to call repeatedly.

    No shape-inference function is attached: refine/lowering/ fills collective output shapes
    itself with `output_shape`, so ONNX inference leaves them unknown.
    """
    with _register_lock:
        for op in KNOWN_OPS:
            if not onnx.defs.has(op, DIST_DOMAIN):
                onnx.defs.register_schema(_schema(op))


def dist_opset() -> onnx.OperatorSetIdProto:
    """The opset import a model using `dist` ops must carry."""
    return helper.make_opsetid(DIST_DOMAIN, DIST_VERSION)


def _node(op: str, x: str, y: str, name: str | None, **attrs: Any) -> onnx.NodeProto:
    if "reduce_op" in attrs and attrs["reduce_op"] not in REDUCE_OPS:
        raise ValueError(f"reduce_op {attrs['reduce_op']!r} is not one of {REDUCE_OPS}")
    attrs["group"] = [int(r) for r in attrs["group"]]
    return helper.make_node(op, [x], [y], name=name, domain=DIST_DOMAIN, **attrs)


def all_reduce(x: str, y: str, group: Sequence[int], reduce_op: str = "sum", name: str | None = None) -> onnx.NodeProto:
    """y = reduce_op over the members' x (every member gets the same value)."""
    return _node("AllReduce", x, y, name, reduce_op=reduce_op, group=group)


def all_gather(x: str, y: str, group: Sequence[int], axis: int, name: str | None = None) -> onnx.NodeProto:
    """y = concat of the members' x along `axis`, in group order."""
    return _node("AllGather", x, y, name, axis=axis, group=group)


def reduce_scatter(
    x: str, y: str, group: Sequence[int], axis: int, reduce_op: str = "sum", name: str | None = None
) -> onnx.NodeProto:
    """y = chunk (this member's group index) along `axis` of the reduction of the members' x."""
    return _node("ReduceScatter", x, y, name, axis=axis, reduce_op=reduce_op, group=group)


def all_to_all(
    x: str, y: str, group: Sequence[int], split_axis: int, concat_axis: int, name: str | None = None
) -> onnx.NodeProto:
    """Member i's chunk j along `split_axis` goes to member j, concatenated along `concat_axis`."""
    return _node("AllToAll", x, y, name, split_axis=split_axis, concat_axis=concat_axis, group=group)


def node_attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes as python values, with schema defaults filled in for known ops."""
    out: dict[str, Any] = {}
    for att in node.attribute:
        value = helper.get_attribute_value(att)
        if isinstance(value, bytes):
            value = value.decode()
        elif att.type == onnx.AttributeProto.INTS:
            value = [int(v) for v in value]
        out[att.name] = value
    for name, _, default in _ATTRS.get(node.op_type, ()):
        if default is not None:
            out.setdefault(name, default)
    return out


def normalize_axis(axis: int, rank: int) -> int:
    """`axis` in [0, rank); negative axes count from the end, as everywhere in ONNX."""
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis % rank


def _attr(attrs: dict[str, Any], op_type: str, name: str) -> int:
    if name not in attrs:
        raise ValueError(f"{op_type} needs attribute {name!r}")
    return int(attrs[name])


def output_shape(op_type: str, attrs: dict[str, Any], input_shape: list[int], group_size: int) -> list[int]:
    """Output shape of one collective on an input of `input_shape` in a group of `group_size`."""
    if group_size < 1:
        raise ValueError(f"{op_type} needs a non-empty group")
    shape = list(input_shape)
    if op_type == "AllReduce":
        return shape
    if op_type == "AllGather":
        axis = normalize_axis(_attr(attrs, op_type, "axis"), len(shape))
        shape[axis] *= group_size
        return shape
    if op_type == "ReduceScatter":
        axis = normalize_axis(_attr(attrs, op_type, "axis"), len(shape))
        shape[axis] = _divide(shape[axis], group_size, op_type, "axis")
        return shape
    if op_type == "AllToAll":
        split = normalize_axis(_attr(attrs, op_type, "split_axis"), len(shape))
        concat = normalize_axis(_attr(attrs, op_type, "concat_axis"), len(shape))
        shape[split] = _divide(shape[split], group_size, op_type, "split_axis")
        shape[concat] *= group_size
        return shape
    raise ValueError(f"unknown collective {op_type!r} (known: {', '.join(KNOWN_OPS)})")


def _divide(size: int, n: int, op_type: str, what: str) -> int:
    if size % n:
        raise ValueError(f"{op_type}: {what} dimension {size} is not divisible by group size {n}")
    return size // n
