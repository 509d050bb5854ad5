"""Canonical forms: ops that the two sides may spell differently, rewritten before lowering
into the ops the lemmas know, so that no lemma has to match two spellings.

Gemm.  Y = alpha * op(A) op(B) + beta * C  (op = transpose when transA/transB).  PyTorch
exports nn.Linear with a bias as Gemm (aten.addmm), while a hand-written row-parallel layer
computes MatMul, all-reduces, then adds the bias: no lemma can pair one Gemm with three ops
on the other side, but once every Gemm is Transpose / MatMul / Mul / Add the MatMul and Add
lemmas (rules/matmul.lp, rules/elementwise.lp) do.

The bias after the view.  torch's linear on an [..., in] input is view -> addmm -> view: the
bias is added before the view back, while the rank adds it after the view and the all-reduce.
When a Gemm's only reader is a Reshape that keeps its last axis, and C broadcasts along that
axis only (a [N] or [1, N] bias, or a single value), the Add moves after the Reshape:
    reshape(P + c) = reshape(P) + c        (the flat position mod N is the column, kept).

Invariants (numeric witnesses and counterexamples read values by tensor name):
- every tensor of the input graph keeps its name and its value, except the output of a Gemm
  whose bias moved after the view (no tensor equals it any more: it is gone); new tensors get
  fresh names derived from the Gemm's output (`addmm/product`, ...);
- the node that adds the bias (or otherwise ends the Gemm) takes the Gemm's name, and every
  new node carries the Gemm's metadata, so reports name the user's node and source line;
- each original node has one representative in the result; the other new nodes are marked
  (`inserted`), so that a caller indexing nodes by their original position can skip them.
A Gemm that cannot be rewritten exactly (a pre-opset-7 `broadcast` attribute, an integer
Gemm scaled by alpha/beta, unknown types) stays a Gemm: no lemma handles it, which is sound.

Runs on shape-inferred models (refine.lowering.shapes.infer_shapes): the new tensors get value_info
computed from the known types, so lowering sees their shapes without a second inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INSERTED_KEY = "refine.canonical"  # node metadata marking a node that has no original position
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
GEMM_ATTRS = {"alpha", "beta", "transA", "transB"}

Types = dict[str, onnx.TypeProto]


def inserted(node: onnx.NodeProto) -> bool:
    """Whether `node` was added by canonicalization (it stands for no node of the input graph)."""
    return any(p.key == INSERTED_KEY for p in node.metadata_props)


def canonicalize(model: onnx.ModelProto, types: Types) -> onnx.ModelProto:
    """`model` with every rewritable Gemm of its main graph expanded (a copy; `model` itself
    when there is nothing to rewrite). `types` are the graph's value types after inference."""
    graph = model.graph
    if not any(_is_gemm(n) for n in graph.node):
        return model
    rewriter = _Rewriter(graph, types)
    nodes = rewriter.run()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.value_info.extend(rewriter.value_info)
    return out


def _is_gemm(node: onnx.NodeProto) -> bool:
    return node.op_type == "Gemm" and node.domain in ("", "ai.onnx")


def static_shape(tp: onnx.TypeProto | None) -> list[int] | None:
    """The static dims of a tensor type, or None where any is unknown."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims = tp.tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


@dataclass
class _Gemm:
    """One Gemm's parts, read off its node and the inferred types."""

    node: onnx.NodeProto
    a: str
    b: str
    c: str  # "" when absent
    alpha: float
    beta: float
    trans_a: int
    trans_b: int
    elem: int  # element type of Y
    shape: list[int]  # [M, N]


class _Rewriter:
    """Rewrites one graph's Gemms; `value_info` collects the types of the new tensors."""

    def __init__(self, graph: onnx.GraphProto, types: Types) -> None:
        self.graph, self.types = graph, types
        self.value_info: list[onnx.ValueInfoProto] = []
        self.names = {vi.name for vi in list(graph.input) + list(graph.output) + list(graph.value_info)}
        self.names |= {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}
        # a value read inside a subgraph has readers this pass does not see: keep every Gemm output
        self.outputs = {vi.name for vi in graph.output}
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
            self.outputs |= {n.output[0] for n in graph.node if _is_gemm(n) and n.output}
        self.readers: dict[str, list[int]] = {}
        for i, node in enumerate(graph.node):
            for x in set(node.input):
                self.readers.setdefault(x, []).append(i)

    def run(self) -> list[onnx.NodeProto]:
        after: dict[int, tuple[_Gemm, str, str]] = {}  # Reshape position -> (Gemm, product, bias term)
        nodes: list[onnx.NodeProto] = []
        for i, node in enumerate(self.graph.node):
            if i in after:
                nodes.extend(self._bias_after_view(node, *after[i]))
                continue
            gemm = self._parse(node) if _is_gemm(node) else None
            if gemm is None:
                nodes.append(node)
                continue
            view = self._view_reader(gemm)
            expanded, moved = self._expand(gemm, move_bias=view is not None)
            if view is not None and moved is not None:
                after[view] = (gemm, *moved)
            nodes.extend(expanded)
        return nodes

    # --- reading a Gemm -----------------------------------------------------------------------

    def _parse(self, node: onnx.NodeProto) -> _Gemm | None:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if set(attrs) - GEMM_ATTRS or len(node.input) < 2 or not node.output or not node.output[0]:
            return None
        out_type = self.types.get(node.output[0])
        shape = static_shape(out_type)
        if shape is None or len(shape) != 2:
            return None
        elem = out_type.tensor_type.elem_type  # type: ignore[union-attr]
        alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
        c = node.input[2] if len(node.input) > 2 else ""
        if (alpha != 1.0 or (c and beta != 1.0)) and elem not in FLOAT_TYPES:
            return None  # integer Gemm scaled by a float: its rounding is not ours to restate
        return _Gemm(node, node.input[0], node.input[1], c, alpha, beta,
                     int(attrs.get("transA", 0)), int(attrs.get("transB", 0)), elem, shape)

    def _view_reader(self, gemm: _Gemm) -> int | None:
        """Position of the Reshape the bias may move after (the Gemm's only reader, keeping the
        last axis, with C broadcasting along that axis only), or None."""
        y = gemm.node.output[0]
        readers = self.readers.get(y, [])
        if not gemm.c or y in self.outputs or len(readers) != 1:
            return None
        reader = self.graph.node[readers[0]]
        if reader.op_type != "Reshape" or reader.domain not in ("", "ai.onnx") or reader.input[0] != y:
            return None
        z, c = static_shape(self.types.get(reader.output[0])), static_shape(self.types.get(gemm.c))
        if z is None or c is None or len(c) > len(z) or len(z) == 0:
            return None
        if any(d != 1 for d in c[:-1]) or (c and c[-1] not in (1, gemm.shape[1])):
            return None
        if c and c[-1] != 1 and z[-1] != gemm.shape[1]:
            return None
        return readers[0]

    # --- writing ------------------------------------------------------------------------------

    def _expand(self, g: _Gemm, move_bias: bool) -> tuple[list[onnx.NodeProto], tuple[str, str] | None]:
        """The Gemm as [Transpose A] [Transpose B] MatMul [Mul alpha] [Mul beta] [Add C].

        With `move_bias` the Add is left out: returns the nodes and (product, bias term), for
        `_bias_after_view` to add the bias after the Reshape that reads the product."""
        y = g.node.output[0]
        out: list[onnx.NodeProto] = []
        a = self._transpose(g, g.a, "A", out) if g.trans_a else g.a
        b = self._transpose(g, g.b, "B", out) if g.trans_b else g.b
        bias = None
        if g.c:
            bias = g.c if g.beta == 1.0 else self._scale(
                g, g.c, "beta", self._fresh(f"{y}/beta", g.elem, static_shape(self.types.get(g.c))), "beta", out)
        ends = bias is None  # the (scaled) product is Y itself, and its last node is named as the Gemm
        last = (y, None) if ends else (self._fresh(f"{y}/product" if g.alpha == 1.0 else f"{y}/alpha", g.elem, g.shape),
                                       "MatMul" if g.alpha == 1.0 else "alpha")
        if g.alpha == 1.0:
            out.append(self._node(g, "MatMul", [a, b], *last))
        else:
            raw = self._fresh(f"{y}/product", g.elem, g.shape)
            out.append(self._node(g, "MatMul", [a, b], raw, "MatMul"))
            self._scale(g, raw, "alpha", *last, out)
        product = last[0]
        if bias is None:
            return self._mark(out), None
        if move_bias:
            return self._mark(out), (product, bias)
        out.append(self._node(g, "Add", [product, bias], y, None))
        return self._mark(out), None

    def _bias_after_view(self, reshape: onnx.NodeProto, gemm: _Gemm, product: str, bias: str) -> list[onnx.NodeProto]:
        """The Reshape of the bias-less product, then the Add of the bias (named after the Gemm)."""
        z = reshape.output[0]
        view = onnx.NodeProto()
        view.CopyFrom(reshape)
        view.input[0] = product
        view.output[0] = self._fresh(f"{gemm.node.output[0]}/view", gemm.elem, static_shape(self.types.get(z)))
        add = self._node(gemm, "Add", [view.output[0], bias], z, None)
        return [view] + self._mark([add], keep_last=False)

    def _scale(self, g: _Gemm, x: str, what: str, output: str, suffix: str | None,
               out: list[onnx.NodeProto]) -> str:
        """output = x * alpha (or beta): a Mul by a scalar Constant of Y's element type."""
        out.append(self._node(g, "Mul", [x, self._const(g, what, getattr(g, what), out)], output, suffix))
        return output

    def _transpose(self, g: _Gemm, x: str, which: str, out: list[onnx.NodeProto]) -> str:
        shape = static_shape(self.types.get(x))
        t = self._fresh(f"{g.node.output[0]}/{which}_T", g.elem, shape[::-1] if shape else None)
        out.append(self._node(g, "Transpose", [x], t, f"Transpose{which}", perm=[1, 0]))
        return t

    def _const(self, g: _Gemm, what: str, value: float, out: list[onnx.NodeProto]) -> str:
        dtype = helper.tensor_dtype_to_np_dtype(g.elem)
        name = self._fresh(f"{g.node.output[0]}/{what}_value", g.elem, [])
        out.append(self._node(g, "Constant", [], name, f"{what}_value",
                              value=numpy_helper.from_array(np.array(value, dtype=dtype))))
        return name

    def _node(self, g: _Gemm, op: str, inputs: list[str], output: str, suffix: str | None,
              **attrs: object) -> onnx.NodeProto:
        """A node with the Gemm's metadata; named `GEMM/suffix`, or the Gemm's name (suffix None)."""
        name = g.node.name if suffix is None or not g.node.name else f"{g.node.name}/{suffix}"
        node = helper.make_node(op, inputs, [output], name=name, **attrs)
        node.doc_string = g.node.doc_string
        node.metadata_props.extend(g.node.metadata_props)
        return node

    def _fresh(self, base: str, elem: int, shape: list[int] | None) -> str:
        """A value name not used in the graph, typed as given (untyped when the shape is unknown)."""
        name, k = base, 1
        while name in self.names:
            name, k = f"{base}#{k}", k + 1
        self.names.add(name)
        if shape is not None:
            self.value_info.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    @staticmethod
    def _mark(nodes: list[onnx.NodeProto], keep_last: bool = True) -> list[onnx.NodeProto]:
        """Mark every node as inserted, except the last when it stands for the original node."""
        for node in nodes[:-1] if keep_last else nodes:
            node.metadata_props.add(key=INSERTED_KEY, value="inserted")
        return nodes
