"""The `dist` ONNX domain: collectives written as ordinary ONNX nodes.

Rank programs are plain ONNX models in which communication is a node of domain `dist`, so
that they can be checked, stored and executed with ONNX tooling. This module is the single
place that knows the ops, their attributes and their shape rule; the lowering (refine/lowering/)
and the reference executor (refine/diagnose/simulate.py) both read collectives through it.
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
COLLECTIVE_OPS = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll", "AllToAllV", "Broadcast")
POINT_TO_POINT_OPS = ("Send", "Recv")
# Calls that are correct only if values agree across members (AllToAllV's counts), which no
# lemma checks yet (docs/moe.md stage 3): only the simulator does, so a program making one is
# never verified (refine/diagnose/diagnosis.py), even where no output reads its result.
VALUE_CHECKED_OPS = ("AllToAllV",)
KNOWN_OPS = COLLECTIVE_OPS + POINT_TO_POINT_OPS
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
    "AllToAllV": (("out_rows", OpSchema.AttrType.INT, None), ("group", OpSchema.AttrType.INTS, None)),
    "Broadcast": (("root", OpSchema.AttrType.INT, None), ("group", OpSchema.AttrType.INTS, None)),
    "Send": (("peer", OpSchema.AttrType.INT, None), ("tag", OpSchema.AttrType.INT, 0)),
    "Recv": (("peer", OpSchema.AttrType.INT, None), ("tag", OpSchema.AttrType.INT, 0)),
}

_DOCS = {
    "AllReduce": "Every member gets the elementwise reduction (reduce_op) of all members' X.",
    "AllGather": "Every member gets all members' X concatenated along axis, in group order.",
    "ReduceScatter": "Reduce all members' X, then member j gets chunk j of n equal chunks along axis.",
    "AllToAll": "Member i sends chunk j (of n along split_axis) to member j, which concatenates "
    "what it receives along concat_axis in group order.",
    "AllToAllV": "Ragged all-to-all (torch's all_to_all_single with split sizes): member r sends its "
    "rows [off_r(j), off_r(j) + send_counts[j]) (off_r = exclusive cumsum of its send_counts) to member j, "
    "where they land at row sum_{i<r} recv_counts_j[i] of j's output of out_rows rows; the other rows are "
    "zero. send_counts_r[j] must equal recv_counts_j[r] (the simulator checks it).",
    "Broadcast": "Every member gets the X of member `root` (a global rank of the group); the other "
    "members' X only gives the shape and element type.",
    "Send": "Hand X to rank `peer`, whose matching Recv (same sender, receiver and tag, the k-th "
    "Send meets the k-th Recv) gets it; the call completes when that Recv is posted (a rendezvous, "
    "as NCCL's send). Y = X, so that later work can be ordered after the send.",
    "Recv": "Y = the X of the matching Send of rank `peer` (same sender, receiver and tag, in call "
    "order); this rank's X is the receive buffer: only its shape and element type count.",
}

# op -> its inputs (name, type, description), where they are not the one X of type T.
COUNT_INPUTS = ("send_counts", "recv_counts")  # AllToAllV's 1-D int64 counts, one per group member
_INPUTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "AllToAllV": (
        ("data", "T", "this rank's rows to send, grouped by destination member in group order (rows: axis 0)"),
        ("send_counts", "tensor(int64)", "1-D, one count per member: how many rows go to member j"),
        ("recv_counts", "tensor(int64)", "1-D, one count per member: how many rows come from member i"),
    ),
}

_register_lock = threading.Lock()


def _schema(op: str) -> OpSchema:
    attributes = []
    for name, kind, default in _ATTRS[op]:
        if default is None:
            attributes.append(OpSchema.Attribute(name, kind, f"{name} (required)", required=True))
        else:
            attributes.append(OpSchema.Attribute(name, helper.make_attribute(name, default), f"{name}"))
    where = " group: global ranks of the members, in group order." if op in COLLECTIVE_OPS else " peer: a global rank."
    return OpSchema(
        op,
        DIST_DOMAIN,
        DIST_VERSION,
        _DOCS[op] + where,
        inputs=[OpSchema.FormalParameter(name, kind, doc) for name, kind, doc in
                _INPUTS.get(op, (("X", "T", "this rank's contribution"),))],
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


def _node(op: str, x: str | Sequence[str], y: str, name: str | None, **attrs: Any) -> onnx.NodeProto:
    if "reduce_op" in attrs and attrs["reduce_op"] not in REDUCE_OPS:
        raise ValueError(f"reduce_op {attrs['reduce_op']!r} is not one of {REDUCE_OPS}")
    if "group" in attrs:
        attrs["group"] = [int(r) for r in attrs["group"]]
    inputs = [x] if isinstance(x, str) else list(x)
    return helper.make_node(op, inputs, [y], name=name, domain=DIST_DOMAIN, **attrs)


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


def all_to_all_v(
    data: str, send_counts: str, recv_counts: str, y: str, group: Sequence[int], out_rows: int,
    name: str | None = None,
) -> onnx.NodeProto:
    """Ragged all-to-all: this member's rows [off(j), off(j) + send_counts[j]) (off = exclusive
    cumsum of send_counts) go to member j, landing at row sum_{i<r} recv_counts_j[i] of j's y
    (out_rows rows; the rest zero). Every send_counts_r[j] must equal recv_counts_j[r]."""
    return _node("AllToAllV", [data, send_counts, recv_counts], y, name, out_rows=int(out_rows), group=group)


def broadcast(x: str, y: str, group: Sequence[int], root: int, name: str | None = None) -> onnx.NodeProto:
    """y = the x of member `root` (a global rank in `group`) on every member."""
    return _node("Broadcast", x, y, name, root=int(root), group=group)


def send(x: str, y: str, peer: int, tag: int = 0, name: str | None = None) -> onnx.NodeProto:
    """Send x to rank `peer` (y = x)."""
    return _node("Send", x, y, name, peer=int(peer), tag=int(tag))


def recv(buffer: str, y: str, peer: int, tag: int = 0, name: str | None = None) -> onnx.NodeProto:
    """y = what rank `peer` sends with the matching tag; `buffer` gives the shape and type."""
    return _node("Recv", buffer, y, name, peer=int(peer), tag=int(tag))


def members(op_type: str, attrs: dict[str, Any], rank: int) -> tuple[int, ...]:
    """The ranks taking part in one call, in the order the call's facts number them: a
    collective's group, or (sender, receiver) of a point-to-point call made on `rank`."""
    if op_type == "Send":
        return (rank, int(attrs["peer"]))
    if op_type == "Recv":
        return (int(attrs["peer"]), rank)
    return tuple(map(int, attrs.get("group", ())))


def channel_id(op_type: str, attrs: dict[str, Any], rank: int) -> str:
    """The id of the group a call is counted on: a collective's members (`group_id`), or
    `p2p:SENDER>RECEIVER#TAG` for a point-to-point call (the k-th Send meets the k-th Recv)."""
    if op_type in POINT_TO_POINT_OPS:
        sender, receiver = members(op_type, attrs, rank)
        return f"p2p:{sender}>{receiver}#{int(attrs['tag'])}"
    return group_id(members(op_type, attrs, rank))


def group_id(group: Sequence[int]) -> str:
    """A collective's members as a short id, the same length at any world size where it can be:
    `0..511` (consecutive), `3..507/8` (every 8th: a mesh column), else `0,2,3`. (Every fact and
    signature of every rank's call repeats it: the list written out made a 512-rank layer's facts
    grow with the square of the world size.)"""
    if len(group) >= 3:
        step = group[1] - group[0]
        if step > 0 and list(group) == list(range(group[0], group[-1] + 1, step)):  # (whole lists: C speed)
            return f"{group[0]}..{group[-1]}" + (f"/{step}" if step > 1 else "")
    return ",".join(map(str, group))


def group_of_id(gid: str) -> list[int]:
    """The members a collective's `group_id` names."""
    if ".." not in gid:
        return [int(r) for r in gid.split(",")]
    first, _, rest = gid.partition("..")
    last, _, step = rest.partition("/")
    return list(range(int(first), int(last) + 1, int(step or 1)))


def channel_of(gid: str) -> tuple[int, int, int] | None:
    """(sender, receiver, tag) of a point-to-point group id made by `channel_id`; None for a
    collective's group id."""
    if not gid.startswith("p2p:"):
        return None
    ranks, tag = gid[4:].split("#", 1)
    sender, receiver = ranks.split(">", 1)
    return int(sender), int(receiver), int(tag)


def call_problem(op_type: str, attrs: dict[str, Any], rank: int, world_size: int) -> str | None:
    """What makes a call malformed whatever the other ranks do, or None."""
    if attrs.get("reduce_op", "sum") not in REDUCE_OPS:
        return f"unknown reduce_op {attrs['reduce_op']!r} (known: {', '.join(REDUCE_OPS)})"
    if op_type in POINT_TO_POINT_OPS:
        if "peer" not in attrs:
            return "has no peer"
        peer, tag = int(attrs["peer"]), int(attrs["tag"])
        if not 0 <= peer < world_size:
            return f"peer {peer} is outside 0..{world_size - 1} (world_size {world_size})"
        if peer == rank:
            return f"rank {rank} names itself as its peer"
        if tag < 0:
            return f"tag {tag} is negative"
        return None
    group = attrs.get("group")
    if not isinstance(group, list) or not group:
        return "has no group"
    if len(set(group)) != len(group):
        return f"group {group} names a rank twice"
    if min(group) < 0 or max(group) >= world_size:
        outside = next(m for m in group if not 0 <= m < world_size)
        return f"group {group} names rank {outside}, outside 0..{world_size - 1} (world_size {world_size})"
    if rank not in group:
        return f"rank {rank} calls it but is not in its group {group}"
    if op_type == "Broadcast" and attrs.get("root") not in group:
        return f"root {attrs.get('root')} is not in its group {group}"
    if op_type == "AllToAllV":
        if "out_rows" not in attrs:
            return "has no out_rows"
        if not isinstance(attrs["out_rows"], int) or attrs["out_rows"] < 0:
            return f"out_rows {attrs['out_rows']!r} is not a non-negative integer"
    return None


def operand_problem(op_type: str, attrs: dict[str, Any], shapes: Sequence[Sequence[int] | None],
                    dtypes: Sequence[str | None]) -> str | None:
    """What is wrong with a call's operands beyond its first (AllToAllV's counts: 1-D int64 of
    one count per group member), given their static shapes and numpy dtype names (None:
    unknown), or None. The number of inputs is the ONNX checker's (the schema)."""
    if op_type != "AllToAllV":
        return None
    n = len(attrs.get("group", ()))
    for name, shape, dtype in zip(COUNT_INPUTS, shapes[1:], dtypes[1:]):
        if dtype is not None and dtype != "int64":
            return f"{name} has element type {dtype}, not int64"
        if shape is not None and list(shape) != [n]:
            return f"{name} has shape {list(shape)}, not [{n}] (one count per member of its group {list(attrs.get('group', ()))})"
    return None


def node_attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes as python values, with schema defaults filled in for known ops."""
    out: dict[str, Any] = {}
    for att in node.attribute:
        value = helper.get_attribute_value(att)
        if isinstance(value, bytes):
            value = value.decode()
        elif att.type == onnx.AttributeProto.INTS:
            value = list(map(int, value))
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
    shape = list(input_shape)
    if op_type in POINT_TO_POINT_OPS:  # Send passes X on; Recv's X is its buffer
        return shape
    if group_size < 1:
        raise ValueError(f"{op_type} needs a non-empty group")
    if op_type in ("AllReduce", "Broadcast"):
        return shape
    if op_type == "AllToAllV":  # out_rows rows (a capacity), the other axes kept
        if not shape:
            raise ValueError(f"{op_type} needs data of at least one axis (rows: axis 0), not a scalar")
        rows = _attr(attrs, op_type, "out_rows")
        if rows < 0:
            raise ValueError(f"{op_type}: out_rows {rows} is negative")
        return [rows, *shape[1:]]
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
