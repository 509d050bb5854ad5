"""Training steps with layer functions: each distinct layer's forward and backward captured once
(docs/layers.md, "Training steps").

The forward export's interception (refine.exporters.capture.layers) carries over to a training step traced by
`make_fx` over eager autograd (refine.exporters.capture.train), with three changes:

- Every value crossing a layer's boundary is a local tensor passed through a differentiable
  marker (`_Marked`): its tensor arguments and, since a training step differentiates them, its
  parameters and buffers too (argument positions after the tensor arguments). The backward of
  a marker records a `refine_export::grad_mark` of the gradient crossing back: at the result, the
  gradient that enters the layer's backward (pos -1); at an argument or parameter, the gradient
  leaving it (its pos). DTensor arguments are unwrapped with `to_local` and rewrapped with
  `from_local` around the markers; parameters reach the layer call as the step's local leaves
  (`TrainTracer.keep_local`) and are wrapped behind the markers. So what crosses is exactly a
  local tensor and its gradient, and whatever DTensor does to convert a gradient to the
  argument's or parameter's placement is inside the marked backward.
- A later call with a representative's key runs `_StubLayer`: one opaque `stub` op in the
  forward, and in its backward one `stub_grads` op giving every gradient (of the arguments that
  need one and of every parameter), each typed as the local tensor it is the gradient of (one
  `StubGrad` node per gradient in the ONNX program).
- Outlining (`outline`) makes two functions per distinct layer: the forward, as before, and
  the backward, whose inputs are the gradient entering the layer and the forward's arguments
  and parameters, and whose outputs are the gradients leaving it. The backward *recomputes* the
  forward values it reads (activation recomputation), so its call needs nothing from inside
  the forward call: the calls of a program stay a chain the verifier memoizes (refine/run/memo.py).

Soundness rests on the same key as for the forward (a stub stands for its representative's
body), plus: a stub's gradients are the ones its representative gives (checked when the
program is outlined), and every value read by a backward body is a marked input, a constant,
or computed inside the layer (else the export fails, as a leak does in the forward).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import onnx
import torch
import torch.utils._pytree as pytree
from onnx import helper

from refine.exporters.capture import layers
from refine.exporters.errors import ExportError
from refine.exporters.capture.layers import _MARK_DOMAIN, LAYER_DOMAIN, Site, _attr, _Function, _mark, _Outliner, _renamed, _stub
from refine.exporters.capture.train import as_dtensor

ENTRY = -1  # grad_mark pos of the gradient entering a layer's backward (the result's)
BACKWARD_SUFFIX = " (backward)"  # a backward call's name: `model.layers.3 (backward)`


# --- the transient ops of the backward -----------------------------------------------------------


@torch.library.custom_op("refine_export::grad_mark", mutates_args=())
def _grad_mark(x: torch.Tensor, site: int, pos: int) -> torch.Tensor:
    """Identity on a gradient crossing a layer's boundary (pos: ENTRY, or the input it leaves)."""
    return x.clone()


@_grad_mark.register_fake
def _(x: torch.Tensor, site: int, pos: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("refine_export::stub_grads", mutates_args=())
def _stub_grads(xs: list[torch.Tensor], site: int, positions: list[int]) -> list[torch.Tensor]:
    """The gradients of a stub's inputs at `positions` (xs: the gradient entering, then the
    stub's inputs), one op for all of them; never executed, only traced."""
    raise ExportError("a layer stub was executed (it only exists while capturing)")


@_stub_grads.register_fake
def _(xs: list[torch.Tensor], site: int, positions: list[int]) -> list[torch.Tensor]:
    return [torch.empty_like(xs[1 + pos]) for pos in positions]


class _Marked(torch.autograd.Function):
    """The forward marker, differentiable: its backward marks the gradient crossing back."""

    @staticmethod
    def forward(x: torch.Tensor, site: int, pos: int) -> torch.Tensor:
        return _mark(x, site, pos)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.site, ctx.pos = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _grad_mark(grad, ctx.site, ctx.pos), None, None


class _StubLayer(torch.autograd.Function):
    """A layer call standing for its representative, in the forward and in the backward."""

    @staticmethod
    def forward(ctx: Any, site: int, *xs: torch.Tensor) -> torch.Tensor:
        ctx.site = site
        ctx.save_for_backward(*xs)
        return _stub(list(xs), site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        xs = ctx.saved_tensors
        positions = [pos for pos in range(len(xs)) if ctx.needs_input_grad[1 + pos]]
        grads: list[torch.Tensor | None] = [None] * len(xs)
        for pos, g in zip(positions, _stub_grads([grad, *xs], ctx.site, positions)):
            grads[pos] = g
        return (None, *grads)


def _to_local(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(local tensor, placement for `as_dtensor`: None for a plain tensor), differentiably
    (DTensor.to_local)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, None
    return t.to_local(), (t.device_mesh, t.placements, t.shape, t.stride())


def _register_backward_schemas() -> None:
    from onnx.defs import OpSchema

    types_ = [f"tensor({t})" for t in ("float", "double", "float16", "bfloat16", "int64", "int32", "bool")]
    attrs = [OpSchema.Attribute("site", OpSchema.AttrType.INT, "", required=True),
             OpSchema.Attribute("pos", OpSchema.AttrType.INT, "", required=True)]
    if not onnx.defs.has("GradMark", _MARK_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "GradMark", _MARK_DOMAIN, 1, "identity on a gradient crossing a layer boundary (refine.exporters.capture.train_layers)",
            inputs=[OpSchema.FormalParameter("X", "T", "")], outputs=[OpSchema.FormalParameter("Y", "T", "")],
            type_constraints=[("T", types_, "")], attributes=attrs))
    if not onnx.defs.has("StubGrad", _MARK_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "StubGrad", _MARK_DOMAIN, 1, "a gradient of a layer stub (refine.exporters.capture.train_layers)",
            inputs=[OpSchema.FormalParameter("X", "T", "", param_option=OpSchema.FormalParameterOption.Variadic,
                                             is_homogeneous=False)],
            outputs=[OpSchema.FormalParameter("Y", "U", "")],
            type_constraints=[("T", types_, ""), ("U", types_, "")], attributes=attrs))


@functools.cache
def translation_table() -> dict[Any, Any]:
    """The forward markers' translations plus the backward ones (the same functions every
    time, so that a translation registry built with them can be reused)."""
    import onnxscript

    table = dict(layers.translation_table())
    _register_backward_schemas()
    ops = onnxscript.values.Opset(_MARK_DOMAIN, 1)

    def grad_mark(x: Any, site: int, pos: int) -> Any:
        return ops.GradMark(x, site=site, pos=pos)

    def stub_grads(xs: Any, site: int, positions: list[int]) -> tuple[Any, ...]:
        return tuple(ops.StubGrad(*xs, site=site, pos=pos) for pos in positions)  # one node per gradient

    table[torch.ops.refine_export.grad_mark.default] = grad_mark
    table[torch.ops.refine_export.stub_grads.default] = stub_grads
    return table


# --- interception ------------------------------------------------------------------------------


class TrainTracer(layers.Tracer):
    """The layer interception of refine.exporters.capture.layers for a training step: every layer stays in the
    module (a training step reads every parameter), representatives run marked as described in
    the module docstring, other calls of a seen key run `_StubLayer`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.visible = set(range(len(self.layers)))
        self._kept: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (local leaf, its placement)

    def reset(self, *_: Any) -> None:
        """A new forward of the root within the same step (a micro-batch, a pipeline stage's next
        part): the calls so far stay, and representatives stay chosen, so that a later forward's
        layers are calls of the functions an earlier one outlined. (The forward tracer starts
        afresh because a Retrace repeats the whole capture; a training step hides no layer.)"""
        self._made.clear()

    def keep_local(self, params: Mapping[str, tuple[torch.Tensor, Any]]) -> set[str]:
        """Of `params` (FQN -> (local leaf, placement)), the FQNs of the layers' own: the step
        passes these to the layers as the local leaves. A representative wraps its own as the
        DTensors they are, behind its markers; a stub takes them as they are. So a stub costs
        no wrapping and unwrapping nodes (to_local/from_local and their backward views, per
        weight per layer), which were most of a deep step's capture."""
        self._kept = {id(leaf): (leaf, placement) for fqn, (leaf, placement) in params.items()
                      if fqn.startswith(f"{self.prefix}.")}
        return {fqn for fqn in params if fqn.startswith(f"{self.prefix}.")}

    def _local(self, value: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(local tensor, placement) of a layer parameter, a kept leaf as it is."""
        kept = self._kept.get(id(value))
        return kept if kept is not None and kept[0] is value else _to_local(value)

    def representative(self, here: Site, leaves: list[Any], spec: Any, tensors: list[int],
                       parts: dict[int, tuple]) -> Any:
        layer = self.layers[here.layer]
        for pos, i in enumerate(tensors):
            local, placement = _to_local(leaves[i])
            leaves[i] = as_dtensor(layers.marked(_Marked.apply, local, here.site, pos), placement)
        marked: dict[str, torch.Tensor] = {}
        for k, (rel, value) in enumerate(self.parameters(here.layer)):
            local, placement = self._local(value)
            marked[rel] = as_dtensor(layers.marked(_Marked.apply, local, here.site, len(tensors) + k), placement)
            here.arg_names.append(rel)
        a, kw = pytree.tree_unflatten(leaves, spec)
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(layer, marked):
            out = torch.nn.Module._call_impl(layer, *a, **kw)
        local, placement = _to_local(self._result(here, out))
        return layers.in_form(as_dtensor(layers.marked(_Marked.apply, local, here.site, -1), placement),
                              self._out[here.site][2])

    def stub(self, here: Site, rep: Site, leaves: list[Any], tensors: list[int], parts: dict[int, tuple]) -> Any:
        meta, dspec, form = self._out[rep.site]
        layers._STUB_OUT[here.site] = meta
        xs = [layers.as_real(_to_local(leaves[i])[0]) for i in tensors] + [self._local(v)[0] for _, v in self.parameters(here.layer)]
        placement = None if dspec is None else (dspec.mesh, dspec.placements, dspec.shape, dspec.stride)
        return layers.in_form(as_dtensor(_StubLayer.apply(here.site, *xs), placement), form)


# --- outlining: the backward of each representative -------------------------------------------------


class _TrainOutliner(_Outliner):
    """A training step's rewrite: the forward functions and calls as in refine.exporters.capture.layers, then
    one backward function per representative and a backward call per layer call."""

    def __init__(self, model: onnx.ModelProto, tracer: TrainTracer) -> None:
        super().__init__(model, tracer)
        self.entry: dict[int, int] = {}  # site -> its GradMark ENTRY node
        self.exits: dict[int, dict[int, int]] = defaultdict(dict)  # site -> pos -> GradMark node
        self.stub_grads: dict[int, dict[int, int]] = defaultdict(dict)  # site -> pos -> StubGrad node
        for i in self.backward_marks:
            node = self.graph.node[i]
            site, pos = _attr(node, "site"), _attr(node, "pos")
            if node.op_type == "StubGrad":
                self.stub_grads[site][pos] = i
            elif pos == ENTRY:
                self.entry[site] = i
            else:
                self.exits[site][pos] = i
        self._backward: dict[int, tuple[list[int], list[int], dict[int, str], list[str], list[int]]] = {}

    def backward_body(self, rep: Site) -> tuple[list[int], list[int], dict[int, str], list[str], list[int]]:
        """(nodes, constant nodes, formal input pos -> its marked value, constants, exit positions)
        of the representative's backward: everything its gradients leaving are computed from,
        back to the gradient entering, its marked inputs and constants."""
        if rep.site in self._backward:
            return self._backward[rep.site]
        graph = self.graph
        entry = graph.node[self.entry[rep.site]].output[0]
        marked = {graph.node[i].output[0]: pos for pos, i in self.marks_in[rep.site].items()}
        nodes: set[int] = set()
        constant_nodes: set[int] = set()
        constants: list[str] = []
        todo = [graph.node[i].input[0] for i in self.exits[rep.site].values()]
        while todo:
            value = todo.pop()
            if not value or value == entry or value in marked:
                continue
            if value in self.inits and module_fqn_weight(value, self.weights) is None:
                if value not in constants:
                    constants.append(value)
                continue
            if value not in self.producer:
                raise ExportError(f"{rep.path} (backward): reads {value!r}, which the layer was not given")
            i = self.producer[value]
            if i in nodes or i in constant_nodes:
                continue
            node = graph.node[i]
            if node.op_type == "Constant" and not node.domain and not node.input:
                constant_nodes.add(i)
                continue
            if node.domain == _MARK_DOMAIN:
                raise ExportError(f"{rep.path} (backward): reads {value!r}, computed outside the layer and not passed to it")
            nodes.add(i)
            todo.extend(node.input)
        read = {v for i in nodes for v in graph.node[i].input}
        read |= {graph.node[i].input[0] for i in self.exits[rep.site].values()}
        inputs = {pos: v for v, pos in marked.items() if v in read}
        self._backward[rep.site] = (sorted(nodes), sorted(constant_nodes), inputs, constants,
                                    sorted(self.exits[rep.site]))
        return self._backward[rep.site]

    def body_readers(self, reps: list[Site]) -> dict[int, frozenset[int]]:
        """A representative's backward reads its forward's values (recomputing them)."""
        return {rep.site: frozenset(self.backward_body(rep)[0]) for rep in reps if rep.site in self.entry}

    def more_calls(self, functions: Mapping[int, _Function], drop: set[int],
                   calls: dict[int, onnx.NodeProto]) -> dict[str, tuple[onnx.FunctionProto, list[str]]]:
        graph, tracer = self.graph, self.tracer
        out: dict[str, tuple[onnx.FunctionProto, list[str]]] = {}
        for rep in [s for s in tracer.sites if s.rep == s.site and s.site in self.entry]:
            nodes, constant_nodes, inputs, constants, exits = self.backward_body(rep)
            proto, in_positions = self.backward_function(rep, nodes, constant_nodes, inputs, constants, exits)
            paths = []
            for site in [s for s in tracer.sites if s.rep == rep.site]:
                if site.site == rep.site:
                    at, grad = self.entry[rep.site], graph.node[self.entry[rep.site]].input[0]
                    actual = [graph.node[self.marks_in[rep.site][p]].input[0] for p in in_positions]
                    results = [graph.node[self.exits[rep.site][p]].output[0] for p in exits]
                    drop.update(nodes)
                    drop.update(self.exits[rep.site].values())
                else:
                    grads = self.stub_grads.get(site.site, {})
                    if sorted(grads) != exits:
                        raise ExportError(f"{site.path}: its backward gives the gradients of inputs {sorted(grads)}, "
                                          f"its representative {rep.path}'s of {exits} (export with --flat)")
                    first = graph.node[grads[exits[0]]]
                    at, grad = min(grads.values()), first.input[0]
                    actual = [first.input[1 + p] for p in in_positions]
                    results = [graph.node[grads[p]].output[0] for p in exits]
                    drop.update(grads.values())
                drop.discard(at)
                calls[at] = self.backward_call(proto, site, [grad, *actual], results, graph.node[self.entry[rep.site]])
                paths.append(site.path)
            out[proto.name] = (proto, paths)
        stray = {s for s in self.stub_grads if self.sites[s].rep not in self.entry}
        if stray:
            raise ExportError(f"{self.sites[min(stray)].path}: its backward has no counterpart in its representative's")
        return out

    def backward_function(self, rep: Site, nodes: list[int], constant_nodes: list[int], inputs: dict[int, str],
                          constants: list[str], exits: list[int]) -> tuple[onnx.FunctionProto, list[int]]:
        """The backward body as a FunctionProto: (gradient entering, the marked inputs it reads)
        -> one gradient per exit position, each through an Identity named `grad.<input>`."""
        graph = self.graph
        in_positions = sorted(inputs)
        entry = graph.node[self.entry[rep.site]].output[0]
        rename = {entry: "grad"} | {inputs[p]: rep.arg_names[p] for p in in_positions}
        body = [helper.make_node("Constant", [], [c], name=f"{c}/Constant", value=self.inits[c]) for c in constants]
        body += [_renamed(graph.node[i], rename) for i in sorted([*constant_nodes, *nodes])]
        outputs = [f"grad.{rep.arg_names[p]}" for p in exits]
        for p, name in zip(exits, outputs):
            value = graph.node[self.exits[rep.site][p]].input[0]
            identity = helper.make_node("Identity", [rename.get(value, value)], [name], name=f"{name}/Identity")
            if value in self.producer:  # (a report names the node that computes the gradient)
                identity.metadata_props.extend(graph.node[self.producer[value]].metadata_props)
            body.append(identity)
        clash = (set(rename.values()) | set(outputs)) & {o for n in body[:-len(outputs)] for o in n.output}
        if clash:
            raise ExportError(f"{rep.path} (backward): a body value is named like an input or output ({min(clash)!r})")
        opsets = {o.domain: o.version for o in self.model.opset_import}
        proto = helper.make_function(
            LAYER_DOMAIN, self.function_name(rep, "_backward"),
            inputs=["grad", *(rep.arg_names[p] for p in in_positions)], outputs=outputs, nodes=body,
            opset_imports=[helper.make_opsetid(d, opsets[d]) for d in sorted({n.domain for n in body}) if d in opsets],
            doc_string=f"the backward of {rep.path} and of every layer called like it (key {rep.key})",
        )
        types = self.types()
        actual = {"grad": graph.node[self.entry[rep.site]].input[0]}
        actual |= {rep.arg_names[p]: graph.node[self.marks_in[rep.site][p]].input[0] for p in in_positions}
        actual |= {name: graph.node[self.exits[rep.site][p]].output[0] for p, name in zip(exits, outputs)}
        named = [*actual, *(v for i in [*constant_nodes, *nodes] for v in graph.node[i].output)]
        for v in named:
            tp = types.get(actual.get(v, v))
            if tp is not None:
                proto.value_info.append(helper.make_value_info(v, tp))
        return proto, in_positions

    def backward_call(self, proto: onnx.FunctionProto, site: Site, inputs: list[str], outputs: list[str],
                      like: onnx.NodeProto) -> onnx.NodeProto:
        """A backward call named `<module path> (backward)`, with the entering gradient's
        attribution (the layer's module stack, marked as backward)."""
        node = helper.make_node(proto.name, inputs, outputs, name=f"{site.path}{BACKWARD_SUFFIX}", domain=LAYER_DOMAIN)
        layers.copy_call_metadata(node, like, site.path)
        return node


def module_fqn_weight(value: str, weights: set[str]) -> str | None:
    """The FQN of the weight an initializer holds, if it holds one."""
    from refine.exporters.capture.layouts import module_fqn

    fqn = module_fqn(value)
    return fqn if fqn in weights else None


def outline(model: onnx.ModelProto, tracer: TrainTracer) -> dict[str, Any]:
    """Rewrite a training step captured under `tracer` in place: each representative's forward
    and backward become local functions, every layer call a forward call and a backward call.
    Returns {calls, functions: name -> module paths}, as refine.exporters.capture.layers.outline."""
    return _TrainOutliner(model, tracer).rewrite()
