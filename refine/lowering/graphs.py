"""Lowering of shape-inferred graphs to facts (refine/lowering/facts.py), and of refine.json's declared
relations between their inputs (loading is in load.py, shapes in shapes.py).

Linear in graph size: one pass over nodes per graph. Weight bytes
are never read: declared inputs and large initializers stay opaque. Static tensors (small
undeclared initializers, Constant outputs, and what is computed from them and from static
shapes: masks, position ids, reshape targets; see refine/lowering/fold.py) are evaluated and hashed,
so equal values on both sides can be recognised; integer ones with at most SMALL_INTS
elements are spelled out (reshape shapes, slice bounds, axes).

Some per-node facts are normalized here rather than in the rules because they need ONNX
knowledge the rules should not repeat: negative axes, Slice/Split bounds, Reduce axes.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Callable, Iterable
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from refine import dist
from refine.config import (
    ModelConfig,
    PartialLayout,
    RepLayout,
    ShardLayout,
    shard_bounds,
    shard_indices,
)
from refine.errors import InputError
from refine.lowering.facts import FactSet
from refine.lowering import canonical, cse, fold, normal_forms
from refine.lowering.fold import SMALL_CONST
from refine.lowering.rows import NotSymmetric
from refine.lowering.load import (
    SEQ,
    LoadedModels,
    load_model_dir,
    rank_graph_id,
    topological_order,
)
from refine.lowering.shapes import chunk_bounds, infer_shapes, static_shape, value_types

SMALL_INTS = 64

# Attributes whose values legitimately differ between the sequential and a rank program
# (they restate shapes): they are left out of the pairing signature and read by lemmas.
# A convolution's `group` too: with replicated operands (or a batch slice) the shapes fix it
# (C / W.shape[1]), and rules/samples.lp's grouped_channels reads it where ranks hold some groups.
SHAPE_ATTRS = {"Split": {"split"}, "Conv": {"group"}}
AXIS_ATTRS = {"axis", "axes", "split_axis", "concat_axis"}  # normalized to >= 0
REDUCE_OPS = {
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
}



_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_frames(stack_trace: str) -> list[tuple[str, str]]:
    """(file, line) of the frames of a torch stack trace that are not torch's own code."""
    return [f for f in _FRAME.findall(stack_trace) if "/torch/" not in f[0].replace("\\", "/")]


_PACKAGE = Path(__file__).resolve().parents[1]  # refine/ (the exporters: its exporters/, or the checkout's)
_MODEL_CODE = ("zoo", "strategies", "frameworks")  # exporters' folders that play the user's model code


def _library_frame(file: str) -> bool:
    """A frame of a library that makes calls on the user's behalf: transformers, or refine's own
    machinery (refine/ and the exporters' capture; the zoo's models and strategies are the
    model code of the zoo's exports)."""
    if "/transformers/" in file.replace("\\", "/"):
        return True
    path = Path(file)
    for exporters in (_PACKAGE / "exporters", _PACKAGE.parent / "exporters"):
        if path.is_relative_to(exporters):
            return not any(path.is_relative_to(exporters / folder) for folder in _MODEL_CODE)
    return path.is_relative_to(_PACKAGE)


def call_site_frames(stack_trace: str) -> list[tuple[str, str]]:
    """(file, line) of the frames where the user's code makes a call: outside torch, transformers
    and refine (a collective is the user's where their code asks for it, not where a library
    issues it); the frames outside torch if there is none such. A front end of refine's that
    wraps a library's model (exporters/frameworks/: HF's model under its own plan) is no caller:
    where its forward is the only such frame, outermost, the call is the library's, at the
    library's innermost line (HF's modeling code), not at the wrapper's."""
    frames = user_frames(stack_trace)
    own = [f for f in frames if not _library_frame(f[0])]
    if own == frames[:1] and len(frames) > 1 and _front_end_frame(own[0][0]):
        own = []
    return own or frames


def _front_end_frame(file: str) -> bool:
    """A frame of refine's framework front ends (exporters/frameworks/), in a checkout or installed."""
    path = Path(file)
    return any(path.is_relative_to(exporters / "frameworks") for exporters in (_PACKAGE / "exporters", _PACKAGE.parent / "exporters"))


BACKWARD_SCOPE = "refine.backward"  # class-hierarchy entry of a training step's backward nodes (exporters/capture/train.py)


def module_scope(node: onnx.NodeProto) -> tuple[str, bool]:
    """(module path, is a training step's backward node) from the torch exporter's metadata:
    `pkg.torch.onnx.name_scopes` lists module paths, outermost first, the op last; a backward
    node has BACKWARD_SCOPE in its class hierarchy. ('', False) without metadata."""
    meta = {p.key: p.value for p in node.metadata_props}
    try:
        parts = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
    except (ValueError, SyntaxError):
        parts = []
    module = parts[-2] if isinstance(parts, list) and len(parts) >= 2 and isinstance(parts[-2], str) else ""
    return module, BACKWARD_SCOPE in meta.get("pkg.torch.onnx.class_hierarchy", "")


def _location(node: onnx.NodeProto) -> tuple[str, str, int] | None:
    """(module path, file, line) from the exporter's node metadata, if any.

    The torch exporter writes `pkg.torch.onnx.name_scopes` (module paths, outermost first, the
    op last) and a stack trace; the line worth showing is the innermost frame outside torch
    itself (the model's code, e.g. transformers' modeling file, or the user's own), never a
    frame inside torch; a collective's is the frame where the user's code calls for it (outside
    torch, transformers and refine, `call_site_frames`). A node of a
    training step's backward (BACKWARD_SCOPE in its class hierarchy) names its forward
    module as `path (backward)`, with the forward op's line where torch gives no other.
    """
    meta = {p.key: p.value for p in node.metadata_props}
    module = meta.get("namespace", "")
    if "pkg.torch.onnx.name_scopes" in meta:
        module, backward = module_scope(node)
        if backward:
            module = f"{module or 'the loss'} (backward)"
    trace = meta.get("pkg.torch.onnx.stack_trace", "")
    # never a line inside torch; a collective (and its backward) at the user's call site
    frames = call_site_frames(trace) if node.domain == dist.DIST_DOMAIN else user_frames(trace)
    file, line = (frames or [("", "0")])[-1]
    if not module and not file:
        return None
    return module, file, int(line)


def op_name(domain: str, op_type: str) -> str:
    """A node's op as the `node` facts name it: domain-qualified outside the ONNX domain
    (`dist.AllReduce`, a layer call's `refine.layer.Block`)."""
    return op_type if domain in ("", "ai.onnx") else f"{domain}.{op_type}"


def _numel(dims: object) -> int:
    return int(np.prod(list(dims), dtype=np.int64))  # type: ignore[call-overload]


def _exact_fraction(x: float | int, dtype: np.dtype) -> Fraction | None:
    """The simple rational a scalar constant stands for (0.125 -> 1/8, 1/3 in float32 -> 1/3)."""
    if isinstance(x, (int, np.integer)):
        return Fraction(int(x))
    if not np.isfinite(x):
        return None
    frac = Fraction(float(x)).limit_denominator(1 << 20)
    return frac if np.asarray(float(frac), dtype=dtype) == np.asarray(x, dtype=dtype) else None


class GraphLowering:
    """Lowers one graph (sequential or one rank) into facts."""

    def __init__(
        self, g: str, model: onnx.ModelProto, path: Path, declared: set[str], facts: FactSet,
        groups: dict[str, tuple[int, ...]], world_size: int, ranges: dict[str, fold.Values] | None = None,
    ) -> None:
        model = normal_forms.lowered_form(model, declared)  # one spelling: Gemm expanded, normal forms (refine/lowering/)
        types = value_types(model.graph)  # (a rewrite's new intermediates are typed in its value_info)
        model = cse.merge_duplicates(model)  # each repeated computation once (refine/lowering/cse.py); renames inputs only
        self.g, self.model, self.path, self.facts = g, model, path, facts
        self.groups = groups  # group id -> members, of the calls in any rank program (shared)
        self.world_size = world_size
        self.calls: dict[str, int] = {}  # group id -> calls on it so far in this graph
        self.opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
        self.versions: dict[tuple[str, str], int] = {}
        self.producers = {out: node for node in model.graph.node for out in node.output if out}
        self.chunks: dict[str, tuple[int, int, int]] = {}  # SequenceAt output -> (axis, start, end)
        self.graph = model.graph
        self.declared = declared
        self.ranges = ranges  # declared value ranges of integer inputs (refine.json "range", "also")
        self.types = types
        self.shapes: dict[str, list[int] | None] = {}
        self.ints: dict[str, list[int]] = {}
        self.node_ids: list[str] = []  # node id of graph.node[i] (file order is topological)

    def tid(self, name: str) -> str:
        return f"{self.g}:{name}"

    def shape(self, name: str) -> list[int] | None:
        if name not in self.shapes:
            tp = self.types.get(name)
            self.shapes[name] = static_shape(tp) if tp is not None else None
        return self.shapes[name]

    def _dtype_name(self, name: str) -> str | None:
        """The numpy name of a tensor's element type (int64, float32, ...), None if unknown."""
        tp = self.types.get(name)
        if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.elem_type:
            return None
        return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type)))

    def rank_of(self, name: str) -> int | None:
        tp = self.types.get(name)
        if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
            return None
        return len(tp.tensor_type.shape.dim)

    def lower(self) -> None:
        add, g = self.facts.add, self.g
        for t in self.types:
            self._tensor(t)
        for init in self.graph.initializer:
            if init.name in self.declared:
                add("graph_input", g, self.tid(init.name), init.name)
        statics = fold.static_values(self.graph, list(self.model.opset_import), self.shape, self.declared, SMALL_CONST,
                                     self.ranges)
        statics.update(fold.splat_values(self.graph, self.shape, statics))
        for name, value in statics.items():
            self._constant(name, value)
        for vi in self.graph.input:
            add("graph_input", g, self.tid(vi.name), vi.name)
        for vi in self.graph.output:
            add("graph_output", g, self.tid(vi.name), vi.name)
        names: dict[str, int] = {}
        for node in self.graph.node:
            names[node.name] = names.get(node.name, 0) + 1
        for index, node in enumerate(topological_order(self.graph, self.path)):
            label = node.name if node.name and names[node.name] == 1 else f"{node.name or node.op_type}#{index}"
            if not canonical.inserted(node):  # node_ids follow the input graph's positions
                self.node_ids.append(f"{g}:{label}")
            if not cse.merged(node):
                self._node(f"{g}:{label}", index, node)

    def _tensor(self, name: str) -> None:
        tp = self.types[name]
        if not tp.HasField("tensor_type"):
            return
        t = self.tid(name)
        elem = onnx.helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type) if tp.tensor_type.elem_type else None
        if elem is not None:
            self.facts.add("dtype", self.g, t, "float" if elem == np.float32 else str(elem))
        if tp.tensor_type.HasField("shape"):
            dims = tp.tensor_type.shape.dim
            self.facts.add("ndim", self.g, t, len(dims))
            for axis, d in enumerate(dims):
                if d.HasField("dim_value"):
                    self.facts.add("dim", self.g, t, axis, d.dim_value)

    def _constant(self, name: str, value: np.ndarray) -> None:
        t = self.tid(name)
        self.facts.add("const", self.g, t, _digest(value))
        for axis, digest in _constant_axes(value):
            self.facts.add("const_along", self.g, t, axis, digest)
        if self.g == "seq":
            for axis, lo, hi, digest in _constant_chunks(value, self.world_size):
                self.facts.add("const_chunk", self.g, t, axis, lo, hi, digest)
        if value.size and _uniform(value) and value.dtype.kind in "iufb" and value.flat[0] == 0:
            self.facts.add("fill_zero", self.g, t)
        if value.dtype.kind in "iu" and value.size <= SMALL_INTS:
            flat = [int(v) for v in value.reshape(-1)]
            self.ints[name] = flat
            for i, v in enumerate(flat):
                self.facts.add("const_int", self.g, t, i, v)
        if value.ndim == 1 and 1 < value.size <= SMALL_INTS and value.dtype.kind == "f" and _integer_edges(value):
            self.facts.add("int_edges", self.g, t, value.size)
        if value.size == 1 and value.dtype.kind in "iuf":
            frac = _exact_fraction(value.reshape(-1)[0].item(), value.dtype)
            if frac is not None:
                self.facts.add("const_num", self.g, t, frac.numerator, frac.denominator)
        elif value.size > 1 and value.dtype.kind in "iub" and _uniform(value):
            self.facts.add("fill_num", self.g, t, int(value.flat[0]))
        elif value.size > 1 and value.dtype.kind == "f" and _uniform(value) and float(value.flat[0]).is_integer():
            # (a float tensor of one integer value: the -1 a cross-entropy's backward scatters)
            self.facts.add("fill_num", self.g, t, int(value.flat[0]))

    def _node(self, n: str, index: int, node: onnx.NodeProto) -> None:
        add, g = self.facts.add, self.g
        chunk = self._sequence_chunk(node)
        if chunk is not None:  # SequenceAt(SplitToSequence(x), k): lowered as the Slice it is
            node = chunk
        op = op_name(node.domain, node.op_type)
        add("node", g, n, op)
        add("topo", g, n, index)
        add("arity", g, n, len(node.input))
        for i, t in enumerate(node.input):
            if t:
                add("node_in", g, n, i, self.tid(t))
        for i, t in enumerate(node.output):
            if t:
                add("node_out", g, n, i, self.tid(t))
        loc = _location(node)
        if loc:
            add("loc", g, n, *loc)
        sig = self._attributes(n, node, op)
        version = self._since_version(node)
        add("since", g, n, version)
        add("sig", g, n, f"{op}@{version}/{len(node.input)}/{len(node.output)}|{sig}")
        if chunk is not None:
            self.facts.add("slice_spec", g, n, 0, *self.chunks[node.output[0]])
        elif node.op_type == "Slice":
            self._slice(n, node)
        elif node.op_type == "Split":
            self._split(n, node)
        elif node.op_type in REDUCE_OPS:
            self._reduce(n, node)
        elif node.domain == dist.DIST_DOMAIN:
            self._collective(n, node)

    def _sequence_chunk(self, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """`SequenceAt(SplitToSequence(x, sizes, axis), k)` with constant sizes and k is
        x[start:end] along axis (how sequence-parallel code takes its chunk): return an
        equivalent Slice node (same name, metadata, output) and remember its bounds."""
        if node.op_type != "SequenceAt" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            return None
        split = self.producers.get(node.input[0])
        if split is None or split.op_type != "SplitToSequence" or len(split.input) < 2:
            return None
        shape, sizes, index = self.shape(split.input[0]), self._const_ints(split.input[1]), self._const_ints(node.input[1])
        if shape is None or sizes is None or index is None or len(index) != 1:
            return None
        axis = next((helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0) % len(shape)
        bounds = chunk_bounds(sizes, index[0], shape[axis])
        if bounds is None:
            return None
        self.chunks[node.output[0]] = (axis, *bounds)
        chunk = onnx.NodeProto()
        chunk.CopyFrom(node)
        chunk.op_type = "Slice"
        del chunk.input[:]
        chunk.input.append(split.input[0])
        return chunk

    def _since_version(self, node: onnx.NodeProto) -> int:
        """Which version of the op's semantics this node has (two nodes with the same op and
        since_version mean the same thing, whatever opset their models import)."""
        domain = "" if node.domain == "ai.onnx" else node.domain
        key = (node.op_type, domain)
        if key not in self.versions:
            opset = self.opsets.get(domain, 0)
            try:
                self.versions[key] = onnx.defs.get_schema(node.op_type, opset, domain).since_version
            except onnx.defs.SchemaError:
                self.versions[key] = 0
        return self.versions[key]

    def _attributes(self, n: str, node: onnx.NodeProto, op: str) -> str:
        """Emit attribute facts; return the canonical signature of the pairing attributes."""
        add, g = self.facts.add, self.g
        parts = []
        in_rank = self.rank_of(node.input[0]) if node.input and node.input[0] else None
        out_rank = self.rank_of(node.output[0]) if node.output else None
        for attr in sorted(node.attribute, key=lambda a: a.name):
            value = helper.get_attribute_value(attr)
            ref_rank = out_rank if node.op_type == "Unsqueeze" else in_rank
            if attr.name in AXIS_ATTRS and ref_rank is not None:
                value = [v % ref_rank if -ref_rank <= v < 0 else v for v in value] if isinstance(value, list) \
                    else (value % ref_rank if -ref_rank <= value < 0 else value)
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
                add("attr_str", g, n, attr.name, value)
            elif isinstance(value, bool) or isinstance(value, int):
                add("attr_int", g, n, attr.name, int(value))
            elif isinstance(value, float):
                add("attr_float", g, n, attr.name, repr(value))
            elif attr.type == onnx.AttributeProto.INTS:
                if not (node.domain == dist.DIST_DOMAIN and attr.name == "group"):
                    # (a collective's group is in coll/group_member facts, once per group: one row
                    # per member per node would be world-size squared)
                    for i, v in enumerate(value):
                        add("attr_ints", g, n, attr.name, i, v)
            elif isinstance(value, onnx.TensorProto):
                arr = numpy_helper.to_array(value) if _numel(value.dims) <= SMALL_CONST else None
                value = hashlib.sha1(arr.tobytes()).hexdigest()[:16] if arr is not None else f"<tensor:{n}>"
            elif isinstance(value, onnx.GraphProto) or (isinstance(value, list) and value and not isinstance(value[0], (int, float, bytes))):
                value = f"<graph:{n}>"  # subgraphs are not lowered: never pair such nodes
            if node.domain == dist.DIST_DOMAIN and attr.name == "group":
                value = dist.group_id(value)  # (short at any world size)
            if attr.name not in SHAPE_ATTRS.get(node.op_type, ()):
                parts.append(f"{attr.name}={value}")
        return ";".join(parts)

    def _const_ints(self, name: str) -> list[int] | None:
        return self.ints.get(name) if name else None

    def _slice(self, n: str, node: onnx.NodeProto) -> None:
        shape = self.shape(node.input[0])
        if len(node.input) < 3:  # Slice-1 (before opset 10): starts, ends and axes are attributes
            attrs = {a.name: list(helper.get_attribute_value(a)) for a in node.attribute}
            starts, ends, axes, steps = attrs.get("starts"), attrs.get("ends"), attrs.get("axes"), None
        else:
            starts, ends = self._const_ints(node.input[1]), self._const_ints(node.input[2])
            axes = self._const_ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            steps = self._const_ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if shape is None or starts is None or ends is None:
            return
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
        if (axes is None or steps is None) or not (len(starts) == len(ends) == len(axes) == len(steps)):
            return
        cut, stepped = [], []
        for start, end, axis, step in zip(starts, ends, axes, steps):
            axis = axis + len(shape) if axis < 0 else axis
            if step < 1 or not 0 <= axis < len(shape):
                return
            size = shape[axis]
            start = min(max(start + size if start < 0 else start, 0), size)
            end = min(max(end + size if end < 0 else end, 0), size)
            if step != 1:
                stepped.append((axis, start, max(end, start), step))
            elif (start, end) != (0, size):
                cut.append((axis, start, max(end, start)))
        if stepped:  # x[..., lo:hi:k] (k > 1) on one axis, nothing else cut: slice_step
            if len(stepped) == 1 and not cut:
                self.facts.add("slice_step", self.g, n, 0, *stepped[0])
        elif len(cut) == 1:
            self.facts.add("slice_spec", self.g, n, 0, *cut[0])
        elif not cut:
            self.facts.add("slice_spec", self.g, n, 0, 0, 0, shape[0] if shape else 0)

    def _split(self, n: str, node: onnx.NodeProto) -> None:
        shape = self.shape(node.input[0])
        if shape is None:
            return
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis = attrs.get("axis", 0)
        axis = axis + len(shape) if axis < 0 else axis
        size = shape[axis]
        sizes = self._const_ints(node.input[1]) if len(node.input) > 1 and node.input[1] else attrs.get("split")
        if sizes is None:
            parts = attrs.get("num_outputs", len(node.output))
            chunk = -(-size // parts)
            sizes = [min(chunk, max(size - i * chunk, 0)) for i in range(parts)]
        if len(sizes) != len(node.output) or sum(sizes) != size:
            return
        start = 0
        for i, s in enumerate(sizes):
            self.facts.add("slice_spec", self.g, n, i, axis, start, start + s)
            start += s

    def _reduce(self, n: str, node: onnx.NodeProto) -> None:
        rank = self.rank_of(node.input[0])
        if rank is None:
            return
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axes = attrs.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = self._const_ints(node.input[1])
            if axes is None:
                return  # axes computed at run time: no reduce facts, no lemma applies
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return
            axes = list(range(rank))
        for a in sorted({a % rank for a in axes}):
            self.facts.add("reduce_axis", self.g, n, a)
        self.facts.add("keepdims", self.g, n, int(attrs.get("keepdims", 1)))

    def _collective(self, n: str, node: onnx.NodeProto) -> None:
        """coll facts: the call's group (a collective's members, or a point-to-point channel
        sender>receiver#tag) and its call number there, counted in program order."""
        attrs = dist.node_attrs(node)
        meta_rank = int(self.g[1:])
        problem = dist.call_problem(node.op_type, attrs, meta_rank, self.world_size) or dist.operand_problem(
            node.op_type, attrs, [self.shape(x) for x in node.input], [self._dtype_name(x) for x in node.input])
        if problem is not None:
            raise InputError(self.path, f"{node.op_type} {node.name!r}: {problem}")
        gid = dist.channel_id(node.op_type, attrs, meta_rank)
        seq = self.calls.get(gid, 0)
        self.calls[gid] = seq + 1
        self.facts.add("coll", self.g, n, node.op_type, gid, seq)
        self.groups[gid] = dist.members(node.op_type, attrs, meta_rank)


def lower_body_calls(g: str, function: str, body: Iterable[onnx.NodeProto], path: Path, world_size: int,
                     facts: FactSet, groups: dict[str, tuple[int, ...]]) -> None:
    """body_coll facts: the collective and point-to-point calls a layer function's body makes
    when rank graph g calls it, in program order (nested calls inlined), with the group each is
    counted on and its source line. A memoized lowering keeps bodies out of the main graphs, so
    this is how refine/diagnose/schedule.py sees every call a rank makes, in the order it makes them."""
    rank = int(g[1:])
    index = 0
    for node in body:
        if node.domain != dist.DIST_DOMAIN:
            continue
        attrs = dist.node_attrs(node)
        problem = dist.call_problem(node.op_type, attrs, rank, world_size)
        if problem is not None:
            raise InputError(path, f"{node.op_type} {node.name!r} in layer function {function!r}: {problem}")
        gid = dist.channel_id(node.op_type, attrs, rank)
        groups[gid] = dist.members(node.op_type, attrs, rank)
        facts.add("body_coll", g, function, index, node.name, node.op_type, gid, *(_location(node) or ("", "", 0)))
        index += 1


def add_groups(facts: FactSet, groups: dict[str, tuple[int, ...]]) -> None:
    """group_size and group_member facts of the groups not stated yet."""
    known = {str(gid) for gid, _size in facts.rows["group_size"]}
    for gid, group in sorted(groups.items()):
        if gid in known:
            continue
        facts.add("group_size", gid, len(group))
        for index, rank in enumerate(group):
            facts.add("group_member", gid, index, rank)


def lower_models(models: LoadedModels,
                 infer: Callable[[onnx.ModelProto, Path, int], onnx.ModelProto] = infer_shapes) -> FactSet:
    """Lower a loaded model directory into one fact set (all graphs + declared relations);
    `infer` is the shape inference (refine/lowering/program.py's caches equal graphs)."""
    config, facts = models.config, FactSet()
    graphs = [(SEQ, models.seq), *models.rank_graphs()]
    inferred = [(g, infer(m, models.paths[g], config.world_size), models.paths[g]) for g, m in graphs]
    lowered = lower_graphs(inferred, config.world_size, set(config.inputs), facts, declared_values(config))
    declared_relations(config, lowered, models, facts)
    return facts


def declared_values(config: ModelConfig) -> dict[str, fold.Values]:
    """The values refine.json declares its integer inputs to take: [lo, hi) and `also`."""
    return {name: (layout.range[0], layout.range[1], frozenset(layout.also or ()))
            for name, layout in config.inputs.items() if getattr(layout, "range", None) is not None}


def lower_graphs(graphs: list[tuple[str, onnx.ModelProto, Path]], world_size: int, declared: set[str],
                 facts: FactSet, ranges: dict[str, fold.Values] | None = None) -> dict[str, GraphLowering]:
    """Lower shape-inferred graphs (the sequential one and one per rank) into `facts`, with
    the world size and the groups their collective and point-to-point calls use."""
    facts.add("world_size", world_size)
    groups: dict[str, tuple[int, ...]] = {}
    lowered: dict[str, GraphLowering] = {}
    for g, model, path in graphs:
        facts.add("graph", g, "seq" if g == SEQ else "rank", -1 if g == SEQ else int(g[1:]))
        low = GraphLowering(g, model, path, declared, facts, groups, world_size, ranges)
        low.lower()
        lowered[g] = low
    add_groups(facts, groups)
    return lowered


def declared_relations(config: ModelConfig, lowered: dict[str, GraphLowering], models: LoadedModels, facts: FactSet) -> None:
    """input_rel and output_rel facts from refine.json, checked against the shapes on both sides
    (and every sequential output must be an output of some rank program).

    Inputs: only graph inputs and initializers can be declared (a relation assumed of an
    intermediate tensor would be an unchecked claim about the computation); ranks lacking one
    are skipped. Outputs: a required layout must hold on every rank, so every rank has it."""
    inputs = {g: {vi.name for vi in low.graph.input} | {init.name for init in low.graph.initializer}
              for g, low in lowered.items()}
    outputs = {g: {vi.name for vi in low.graph.output} for g, low in lowered.items()}
    for vi in lowered[SEQ].graph.output:  # outputs correspond by name (docs/model-dir.md)
        if not any(vi.name in outputs[g] for g in lowered if g != SEQ):
            raise InputError(models.paths[SEQ], f"output {vi.name!r} is an output of no rank program "
                             "(a sequential output is rebuilt from the ranks' outputs of the same name)")
    if config.mesh is not None:  # (reports speak of groups in mesh coordinates)
        for index, (dim, size) in enumerate(zip(config.mesh.dims, config.mesh.shape)):
            facts.add("mesh_dim", dim, index, size)
    if models.rows is not None:  # row 0 stands for every row (refine/lowering/rows.py)
        # (an output refine.json leaves open is rebuilt from row 0's ranks: whole in every row, as
        # a training step's gradient after the column's all-reduce; a row's own chunk relates to
        # no real tensor there, so it is not rebuilt, and the plan is verified whole)
        facts.add("row_symmetry", models.rows.dim, models.rows.rows)
    for name, layout in config.inputs.items():
        _declare("input", name, layout, inputs, config, lowered, models, facts)
    for name, layout in config.outputs.items():
        _declare("output", name, layout, outputs, config, lowered, models, facts)
    if models.rows is None:
        _sliced_replica_windows(config, lowered, facts)


def _sliced_replica_windows(config: ModelConfig, lowered: dict[str, GraphLowering], facts: FactSet) -> None:
    """A rank that cuts a declared replica data input (not a weight) into even chunks along an axis (a pipeline
    stage's micro-batches: input_ids[k*B/M : (k+1)*B/M]) computes on windows of the sequential
    program (rules/windows.lp), as a rank of a batch split over a mesh dim does: each such cut
    seeds the windows of that input. So does a cut of a data input's even shard (a DP row's
    micro-batches: chunk k of M of the rank's B/D rows is chunk d*M + k of D*M of the batch).
    A seed only makes the chunks exist as virtual tensors; every relation of a chunk still comes
    from a lemma."""
    seq = lowered[SEQ]
    data = {vi.name for vi in seq.graph.input} - {init.name for init in seq.graph.initializer}  # (not weights)
    replicas = {lowered[g].tid(name): name for name, layout in config.inputs.items()
                if name in data and (isinstance(layout, RepLayout) or _plain_even_shard(layout))
                for g in lowered if g != SEQ}
    first_in = {(g, n): t for g, n, i, t in facts.rows["node_in"] if i == 0}
    seeded = {(str(s), int(a), int(k)) for s, a, k in facts.rows["window_seed"]}
    for g, n, _o, axis, lo, hi in facts.rows["slice_spec"]:
        name = replicas.get(first_in.get((g, n), ""))
        shape = seq.shape(name) if name is not None else None
        if name is None or shape is None or not 0 <= axis < len(shape):
            continue
        width, size = hi - lo, shape[axis]
        if 0 < width < size and size % width == 0 and lo % width == 0:
            seed = (seq.tid(name), axis, size // width)
            if seed not in seeded:
                seeded.add(seed)
                facts.add("window_seed", *seed)


def _plain_even_shard(layout: object) -> bool:
    """A shard in even contiguous chunks along one axis (no stride, sizes or second split)."""
    return (isinstance(layout, ShardLayout) and layout.then is None and (layout.stride or 1) == 1
            and (layout.sizes is None or len(set(layout.sizes)) == 1))


def _declare(kind: str, name: str, layout: ShardLayout | RepLayout | PartialLayout, sources: dict[str, set[str]],
             config: ModelConfig, lowered: dict[str, GraphLowering], models: LoadedModels, facts: FactSet) -> None:
    """One declared tensor: where it must exist, its per-rank layout term, and shape checks."""
    cfg_path = models.paths[SEQ].parent / "refine.json"
    seq = lowered[SEQ]
    loaded = [int(g[1:]) for g in lowered if g != SEQ]
    on_seq = name in sources[SEQ]
    ranks = [r for r in loaded if name in sources[rank_graph_id(r)]]
    where = "a graph input or initializer" if kind == "input" else "a graph output"
    if not on_seq and not ranks:
        if any(name in low.types for low in lowered.values()):
            raise InputError(cfg_path, f"{kind} {name!r} is an intermediate tensor, not {where}")
        raise InputError(cfg_path, f"{kind} {name!r} exists neither in seq.onnx nor in any rank program")
    if not on_seq:
        raise InputError(cfg_path, f"{kind} {name!r} exists in rank programs but not in seq.onnx")
    if not ranks:
        raise InputError(cfg_path, f"{kind} {name!r} exists in seq.onnx but in no rank program")
    if kind == "output" and len(ranks) != len(loaded) and not isinstance(layout, RepLayout):
        # (a replica may live on some ranks only, a pipeline's last stage; pieces must all be there)
        missing = next(r for r in loaded if r not in ranks)
        raise InputError(models.paths[rank_graph_id(missing)], f"has no output {name!r}, which refine.json requires "
                         f"(its {layout.layout} layout needs every rank's piece)")
    s_shape = seq.shape(name)
    if s_shape is None:
        raise InputError(models.paths[SEQ], f"{kind} {name!r} has no static shape")
    bounds_of_values = layout.value_bounds()
    if bounds_of_values is not None:
        _value_range(name, bounds_of_values, seq, cfg_path, facts)
    bounds = indices = None
    then: tuple[int, int] | None = None  # a two-dim shard's second split: (its axis, the first chunk's size there)
    parts = config.split_of(layout, 0)[1] if isinstance(layout, (ShardLayout, PartialLayout)) else config.world_size
    chunked = False  # a row-symmetric plan's batch: declared as chunk 0 (rows.py)
    if isinstance(layout, ShardLayout):
        axis = layout.axis + len(s_shape) if layout.axis < 0 else layout.axis
        if not 0 <= axis < len(s_shape):
            raise InputError(cfg_path, f"{kind} {name!r}: shard axis {layout.axis} out of range for shape {s_shape}")
        try:
            bounds = shard_bounds(layout, s_shape[axis], parts) if (layout.stride or 1) == 1 else None
            indices = shard_indices(layout, s_shape[axis], parts)
        except ValueError as exc:
            raise InputError(cfg_path, f"{kind} {name!r}: {exc}") from None
        windows = _windows_the_batch(layout, config, s_shape[axis], parts)
        chunked = models.rows is not None and layout.over == models.rows.dim
        if chunked and not windows:
            raise NotSymmetric(f"{kind} {name!r} does not split into {parts} even chunks")
        if layout.then is not None:
            then = _then_split(kind, name, layout, axis, parts, s_shape, windows, config.then_split_of(layout, 0)[1],
                               cfg_path)
        if windows and not chunked and (then is None or then[0] != axis) and (kind == "input" or then is not None):
            # (an input's chunks flow through the program; a two-dim output's chunks are what refine.json
            # requires relations of: rules/report.lp output_chunk_rel, so they must exist even where
            # nothing flows, a weight gradient's tp chunk)
            facts.add("window_seed", seq.tid(name), axis, parts)
    for r in ranks:
        g = rank_graph_id(r)
        r_shape = lowered[g].shape(name)
        expected = list(s_shape)
        k = config.split_of(layout, r)[0] if isinstance(layout, (ShardLayout, PartialLayout)) else r
        if isinstance(layout, (RepLayout, PartialLayout)):
            term = "rep" if isinstance(layout, RepLayout) else (
                f"psum({k},{k + 1},{parts},pure)" if layout.op == "sum" else f"pmax({k},{k + 1},{parts},pure)")
        elif bounds is None:  # strided: axis = `stride` blocks, rank r keeps chunk k of each
            assert indices is not None and isinstance(layout, ShardLayout) and layout.stride
            block, part = s_shape[axis] // layout.stride, len(indices[k]) // layout.stride
            expected[axis] = len(indices[k])
            term = f"blk({axis},{block},{k * part},{(k + 1) * part})"
        else:
            start, end = bounds[k]
            expected[axis] = end - start
            term = "rep" if (start, end) == (0, s_shape[axis]) else f"sl({axis},{start},{end})"
        if chunked:  # rank r holds its row's chunk whole: T = win(S, axis, k, parts)
            term = "rep"
        if then is not None:  # rank r holds chunk j of its chunk k: T = win(S, axis, k, parts)[chunk j on B]
            assert isinstance(layout, ShardLayout)
            then_axis, size = then
            j, m = config.then_split_of(layout, r)
            expected = list(s_shape)
            expected[axis] = s_shape[axis] // parts
            expected[then_axis] = size // m
            term = f"sl({then_axis},{j * size // m},{(j + 1) * size // m})"
            if then_axis == axis and not chunked:  # chunk j of chunk k along one axis: one plain slice of S
                start = k * size + j * size // m
                term = f"sl({axis},{start},{start + size // m})"
        one_slice = then is not None and then[0] == axis and not chunked
        if kind == "output":  # a rank output that cannot have this layout fails verification, not input
            if chunked or (then is not None and not one_slice):
                facts.add("output_chunk_rel", seq.tid(name), axis, k, parts, lowered[g].tid(name), term)
            else:
                facts.add("output_rel", seq.tid(name), lowered[g].tid(name), term)
            continue
        if r_shape is None:
            raise InputError(models.paths[g], f"{kind} {name!r} has no static shape, refine.json implies {expected}")
        s_elem, r_elem = seq.types[name].tensor_type.elem_type, lowered[g].types[name].tensor_type.elem_type
        if s_elem != r_elem:
            raise InputError(models.paths[g], f"{kind} {name!r} has element type "
                             f"{onnx.TensorProto.DataType.Name(r_elem)}, seq.onnx has {onnx.TensorProto.DataType.Name(s_elem)}")
        if r_shape != expected:
            raise InputError(models.paths[g], f"{kind} {name!r} has shape {r_shape}, refine.json implies {expected}")
        if chunked or (then is not None and not one_slice):
            facts.add("input_chunk_rel", seq.tid(name), axis, k, parts, lowered[g].tid(name), term)
        else:
            facts.add("input_rel", seq.tid(name), lowered[g].tid(name), term)


def _then_split(kind: str, name: str, layout: ShardLayout, axis: int, parts: int, s_shape: list[int], windows: bool,
                then_parts: int, cfg_path: Path) -> tuple[int, int]:
    """(axis, size there of the first chunk) of a two-dim shard's second split: the first split a
    window of the sequential program (rules/windows.lp: even chunks over a dim of a mesh of
    several), each window cut evenly again. An InputError naming the tensor where it cannot be."""
    assert layout.then is not None
    if not windows:
        raise InputError(cfg_path, f"{kind} {name!r}: a two-dim shard needs even chunks of axis {layout.axis} "
                         f"({s_shape[axis]}) over mesh dim {layout.over!r} of a mesh of several dims")
    then_axis = layout.then.axis + len(s_shape) if layout.then.axis < 0 else layout.then.axis
    if not 0 <= then_axis < len(s_shape):
        raise InputError(cfg_path, f"{kind} {name!r}: then axis {layout.then.axis} out of range for shape {s_shape}")
    size = s_shape[then_axis] // parts if then_axis == axis else s_shape[then_axis]
    if size % then_parts:
        raise InputError(cfg_path, f"{kind} {name!r}: the chunk's axis {then_axis} ({size}) does not split into "
                         f"{then_parts} even chunks over mesh dim {layout.then.over!r}")
    return then_axis, size


def _windows_the_batch(layout: ShardLayout, config: ModelConfig, size: int, parts: int) -> bool:
    """An input split in even chunks over one dim of a mesh of several dims (the batch of a
    DP x TP plan): each chunk is a window of the sequential program (rules/windows.lp) that the
    other dims' ranks refine together. Over the whole world, or a one-dim mesh, plain slices do."""
    return (layout.over is not None and config.mesh is not None and len(config.mesh.dims) > 1 and parts > 1
            and (layout.stride or 1) == 1 and size % parts == 0
            and (layout.sizes is None or len(set(layout.sizes)) == 1))


def _integer_edges(value: np.ndarray) -> bool:
    """Edge k lies in (k - 1, k] for every k: below it lie exactly the integers 0 .. k - 1 of
    the non-negative ones (torch's histc of integer ids over bins [0, B - 1], as torchlib writes
    its edges, the last nudged up)."""
    k = np.arange(value.size, dtype=np.float64)
    edges = value.astype(np.float64)
    return bool(np.all(edges > k - 1) and np.all(edges <= k))


def _uniform(value: np.ndarray) -> bool:
    """One value everywhere (a splat is, without being read element by element)."""
    return fold.is_splat(value) or bool((value == value.flat[0]).all())


def _digest(value: np.ndarray) -> str:
    """Equal static values, equal digests: element type, shape and elements (one element of a
    uniform tensor: a splat is hashed without materializing it)."""
    if value.size and _uniform(value):
        body = f"{value.dtype}|{value.shape}|splat|".encode() + np.asarray(value.flat[0], value.dtype).tobytes()
    else:
        body = f"{value.dtype}|{value.shape}|".encode() + np.ascontiguousarray(value).tobytes()
    return hashlib.sha1(body).hexdigest()[:16]


CHUNKED_CONSTANT = 1 << 16  # elements: a sequential constant larger than this gets no chunk hashes
MAX_CHUNKS = 64  # the most chunks an axis is cut into


def _constant_chunks(value: np.ndarray, world_size: int) -> list[tuple[int, int, int, str]]:
    """(axis, lo, hi, digest of value[.., lo:hi, ..]) for every cut of an axis into n equal chunks,
    n > 1 dividing the world size (at most MAX_CHUNKS): what a rank that keeps its own chunk of a
    per-head float constant holds (ALiBi slopes cut by rank). Not for a splat (every chunk alike:
    `_constant_axes` says more), a large constant, nor an integer one."""
    if value.size > CHUNKED_CONSTANT or value.size < 2 or value.dtype.kind != "f" or fold.is_splat(value):
        return []  # (integer constants are shapes, axes and indices: `const_int` reads them)
    out = []
    for axis, size in enumerate(value.shape):
        for n in range(2, min(world_size, size, MAX_CHUNKS) + 1):
            if size % n or world_size % n:  # (a group of the mesh cuts it: its size divides the world's)
                continue
            step = size // n
            for lo in range(0, size, step):
                chunk = value[(slice(None),) * axis + (slice(lo, lo + step),)]
                out.append((axis, lo, lo + step, _digest(chunk)))
    return out


def _constant_axes(value: np.ndarray) -> list[tuple[int, str]]:
    """(axis, digest of one slice) for every axis of size > 1 along which `value` is constant:
    all its slices along the axis are equal (a mask broadcast over the batch, zeros)."""
    out = []
    for axis, size in enumerate(value.shape):
        if size < 2:
            continue
        first = value[(slice(None),) * axis + (slice(0, 1),)]
        if fold.is_splat(value) or np.array_equal(value, np.broadcast_to(first, value.shape)):
            out.append((axis, _digest(first)))
    return out


def _value_range(name: str, bounds: tuple[int, int], seq: GraphLowering, cfg_path: Path, facts: FactSet) -> None:
    """value_range of a declared input: what its values can be (integer inputs only)."""
    elem = seq.types[name].tensor_type.elem_type
    if np.dtype(helper.tensor_dtype_to_np_dtype(elem)).kind not in "iu":
        raise InputError(cfg_path, f"input {name!r}: a value range is declared of integer inputs only, "
                         f"seq.onnx has {onnx.TensorProto.DataType.Name(elem)}")
    facts.add("value_range", seq.tid(name), *bounds)


def lower_dir(model_dir: Path) -> FactSet:
    """Load, check and lower a model directory."""
    return lower_models(load_model_dir(model_dir))

