"""Training steps: one program that computes the loss and the gradient of every parameter.

torch.export cannot trace `torch.autograd.grad` (non-strict export lifts the engine's tensors
as fake constants), and its joint export (`aot_export_module(trace_joint=True)`) refuses tensor
subclasses, so it cannot see DTensor's backward. A training step is therefore traced one level
lower, by `make_fx` over eager autograd: the forward runs through the real module (DTensor,
parallel-style hooks, custom `autograd.Function`s and all), then `torch.autograd.grad` runs
the real backward, and every ATen op and collective that executes is recorded, in the
forward and in the backward alike. So the backward collectives in the program are the ones
the implementation runs: DTensor's redistributions in backward, a Megatron-style
`autograd.Function`'s all-reduce, none where the code has none.

Parameters enter as local tensors (a rank's own shard). A DTensor parameter is rebuilt from
its local tensor with `DTensor.from_local(..., placements)`, whose backward redistributes the
gradient to the parameter's placement before handing back the local gradient: what DTensor
does before an optimizer can use a gradient (a replicated parameter's partial gradient is
all-reduced there). A plain tensor parameter gets exactly the gradient its code computes.

The loss is token cross-entropy against `labels`, the mean over every token. The outputs are
`loss` and `grad.<parameter FQN>` per parameter, in `named_parameters` order.

A strategy changes the step through hooks on the module, read here and nowhere else (an
implementation detail of refine's exporters: a user's own module and loss go through
`refine.exporters.export_train`, exporters/strategies/own.py, which sets them): `computes_loss`
(forward(*inputs, labels=labels) returns the loss), `micro_batches` (M > 1: one backward per
micro-batch, forward also gets `all_labels`), `unshard_params(params)` (the parameters as the
forward uses them: FSDP's all-gather), `finalize_loss(loss)` and `finalize_grads(grads)` (the
loss reported and the gradients the optimizer gets: data parallelism's reductions),
`step_input_names()` / `step_output_names()` (the program's input and output names) and
`training_step(...)` (a step run entirely by the module: a pipeline stage).

Node metadata (what ties a failure to a module and a source line) is kept: forward nodes get
the module stack and the stack trace, as torch.export gives them; each backward node gets the
metadata of the forward op it differentiates (matched by autograd's sequence number), with a
last module-stack entry `BACKWARD` so the verifier can say "backward", and keeps its own
stack trace where that is user code (a custom `autograd.Function.backward`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from refine.exporters.capture import row_indexing
from refine.exporters.errors import ExportError
from refine.lowering.graphs import BACKWARD_SCOPE as BACKWARD
from refine.lowering.graphs import user_frames



class LocalKeeper(Protocol):
    """What a step's trace asks of a layer tracer (refine.exporters.capture.train_layers'): which
    parameters it hands to its layer calls as the local leaves."""

    def keep_local(self, params: Mapping[str, tuple[torch.Tensor, Any]]) -> set[str]: ...

LOSS = "loss"
GRAD_PREFIX = "grad."
LABELS = "labels"
IGNORE_INDEX = -100  # torch's cross-entropy default: a label that does not count


def grad_name(fqn: str) -> str:
    """The output holding the gradient of parameter `fqn`."""
    return f"{GRAD_PREFIX}{fqn}"


def output_names(module: nn.Module) -> list[str]:
    """`loss`, then one gradient per parameter (named_parameters order, tied ones once); a module
    with its own `step_output_names()` (a pipeline stage, exporters/strategies/pipeline_train.py) names them."""
    own = getattr(module, "step_output_names", None)
    if own is not None:
        return list(own())
    return [LOSS, *(grad_name(fqn) for fqn, _ in module.named_parameters())]


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss: cross-entropy of every token's logits against its label, mean over tokens."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def step_loss(module: nn.Module, call: Callable[..., Any], inputs: Sequence[torch.Tensor],
              labels: torch.Tensor) -> torch.Tensor:
    """The step's loss: the module's own (`computes_loss`: forward(*inputs, labels=labels)), else
    token cross-entropy of its logits. `call` runs the module's forward."""
    if getattr(module, "computes_loss", False):
        return call(*inputs, labels=labels)
    return token_cross_entropy(call(*inputs), labels)


def step_gradients(module: nn.Module, call: Callable[..., Any], inputs: Sequence[torch.Tensor], labels: torch.Tensor,
                   leaves: Sequence[torch.Tensor], traced: bool = False) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The step's loss and the gradients of `leaves`. A module with `micro_batches` M > 1
    accumulates: the batch is cut into M micro-batches along dim 0, each one's loss is
    differentiated on its own (its module's forward also gets the whole batch's labels as
    `all_labels`, to count tokens), and losses and gradients are summed, as a training loop
    calling backward M times before the optimizer step does. `traced`: record the module stack
    and mark each backward's nodes (make_fx in trace_step)."""
    m = int(getattr(module, "micro_batches", 1))
    parts = list(zip(*(t.chunk(m, 0) for t in (*inputs, labels)))) if m > 1 else [(*inputs, labels)]
    total_loss: torch.Tensor | None = None
    total: list[torch.Tensor | None] = [None] * len(leaves)
    for *micro_inputs, micro_labels in parts:
        with _module_stack(module) if traced else contextlib.nullcontext():
            if m > 1:
                loss = call(*micro_inputs, labels=micro_labels, all_labels=labels)
            else:
                loss = step_loss(module, call, micro_inputs, micro_labels)
        handles = _mark_backward([loss.grad_fn]) if traced else []
        try:
            grads = _gradients(loss, leaves)
        finally:
            for h in handles:
                h.remove()
        total_loss = loss if total_loss is None else total_loss + loss
        total = accumulated(leaves, total, grads)
    assert total_loss is not None
    return total_loss, total


def _gradients(loss: torch.Tensor, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """d loss / d leaf for the leaves that require a gradient, None for a frozen one (a parameter
    made with `requires_grad=False`, such as AFMoE's expert bias: training leaves it alone)."""
    trainable = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
    grads: list[torch.Tensor | None] = [None] * len(leaves)
    for i, g in zip(trainable, torch.autograd.grad(loss, [leaves[i] for i in trainable], allow_unused=True)):
        grads[i] = g
    return grads


def accumulated(leaves: Sequence[torch.Tensor], total: Sequence[torch.Tensor | None],
                grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradients accumulated over one more backward, as `loss.backward()` leaves them in
    `.grad`: each added to its leaf's running sum, then the leaf's post-accumulate-grad hooks run
    on it (in registration order, reading and writing `leaf.grad`), as autograd runs them after
    each accumulation. `torch.autograd.grad` accumulates nothing and runs no such hook, so a
    hook a parallel style puts on a parameter (HF's `replicated_with_grad_allreduce`: an
    all-reduce of the gradient of a replicated norm that sees this rank's heads only) would
    otherwise be left out of the step."""
    out: list[torch.Tensor | None] = []
    for leaf, t, g in zip(leaves, total, grads):
        acc = g if t is None else t if g is None else t + g
        hooks = list((getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values())
        if hooks and g is not None:
            leaf.grad = acc
            try:
                for hook in hooks:
                    hook(leaf)
                acc = leaf.grad
            finally:
                leaf.grad = None
        out.append(acc)
    return out


def traced_grad(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                grad_outputs: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor | None, ...]:
    """torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True) with the backward's
    nodes marked as step_gradients marks them when traced (each gets its forward op's module and
    source line, exporters/capture/train.py _attribute_backward): one backward segment of a step that runs
    its own (a pipeline stage)."""
    handles = _mark_backward([o.grad_fn for o in outputs])
    try:
        return torch.autograd.grad(list(outputs), list(inputs), grad_outputs=grad_outputs, allow_unused=True)
    finally:
        for h in handles:
            h.remove()


def module_stack(root: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The forward's module stack recorded while `root`'s modules run (as step_gradients records it)."""
    return _module_stack(root)


def finalized(module: nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients as the optimizer gets them: the module's `finalize_grads` applied, if any."""
    finalize = getattr(module, "finalize_grads", None)
    return finalize(grads) if finalize is not None else grads


def unsharded(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters as the forward uses them: the module's `unshard_params` applied, if any
    (FSDP / ZeRO-3: shards at rest, all-gathered for use; the all-gather's backward reduce-scatters
    the gradients onto the shards)."""
    unshard = getattr(module, "unshard_params", None)
    return unshard(params) if unshard is not None else params


def finalized_loss(module: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The loss the step reports: the module's `finalize_loss` applied, if any (a data-parallel
    replica reduces its share of the loss over its group; the gradients come from the unreduced one)."""
    finalize = getattr(module, "finalize_loss", None)
    return finalize(loss) if finalize is not None else loss


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.data if isinstance(t, nn.Parameter) else t
    return t.to_local() if isinstance(t, DTensor) else t


def _placement_of(t: torch.Tensor) -> tuple[Any, ...] | None:
    """(mesh, placements, shape, stride) of a DTensor parameter, None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    t = t.data if isinstance(t, nn.Parameter) else t
    return (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None


# --- metadata: module stack in the forward, forward op of each backward node ----------------------


@contextlib.contextmanager
def _module_stack(root: nn.Module) -> Iterator[None]:
    """Keep fx_traceback's current `nn_module_stack` equal to the modules being called (as
    torch.export records it: FQN and class per enclosing module, outermost first)."""
    names = {id(m): fqn for fqn, m in root.named_modules(remove_duplicate=False)}
    stack: list[dict[str, tuple[str, type]]] = []

    def enter(module: nn.Module, _args: Any) -> None:
        previous = fx_traceback.current_meta.get("nn_module_stack") or {}
        stack.append(previous)
        current = dict(previous)
        fqn = names.get(id(module))
        if fqn is not None:
            current[f"L__{fqn or 'self'}__{len(stack)}"] = (fqn, type(module))
        fx_traceback.current_meta["nn_module_stack"] = current

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        fx_traceback.current_meta["nn_module_stack"] = stack.pop() if stack else {}

    pre = nn.modules.module.register_module_forward_pre_hook(enter)
    post = nn.modules.module.register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def _mark_backward(roots: Sequence[Any]) -> list[Any]:
    """Hooks on every autograd node reachable from `roots`: while a node's backward runs, the
    ops it records carry its sequence number (the forward op's) and the backward mark."""
    handles: list[Any] = []
    seen: set[Any] = set()
    todo = [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(fn for fn, _ in node.next_functions if fn is not None)
        seq = node._sequence_nr()

        def pre(_grad_out: Any, seq: int = seq) -> None:
            fx_traceback.set_grad_fn_seq_nr(seq)
            fx_traceback._mark_autograd_backward()

        def post(_grad_in: Any, _grad_out: Any) -> None:
            fx_traceback.reset_grad_fn_seq_nr()
            fx_traceback._reset_autograd_backward()

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(post))
    return handles


BACKWARD_KEY = "refine_backward"  # the nn_module_stack key of the BACKWARD entry


def _own_frames(stack_trace: str) -> bool:
    """Does a backward node's own stack trace show user code (a custom Function's backward)?"""
    return any(not file.endswith(("exporters/capture/train.py", "autograd/__init__.py")) for file, _ in user_frames(stack_trace))


def _attribute_backward(gm: torch.fx.GraphModule) -> None:
    """Give each backward node the module stack (plus BACKWARD) and, unless its own stack
    trace is user code, the stack trace of the forward op with its sequence number.

    The engine's own additions (a tensor read twice gets the sum of two gradients) run in no
    backward function: each takes the attribution of its latest attributed operand, the
    contribution of the reader nearest the tensor in the forward (the backward runs the
    forward's readers in reverse)."""
    forward: dict[int, torch.fx.Node] = {}
    in_backward = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.meta.get("autograd_backward"):
            in_backward = True
        elif in_backward and not node.meta.get("nn_module_stack"):
            node.meta["autograd_backward"] = True  # an accumulation: attributed from its operands below
            node.meta["refine_accumulation"] = True  # (its seq_nr is the forward's last, not its own)
        elif "seq_nr" in node.meta:
            forward.setdefault(node.meta["seq_nr"], node)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.meta.get("autograd_backward"):
            continue
        if node.meta.get("refine_accumulation") or forward.get(node.meta.get("seq_nr")) is None:
            attributed = [a for a in node.all_input_nodes if BACKWARD_KEY in (a.meta.get("nn_module_stack") or {})]
            operand = max(attributed, key=position.__getitem__, default=None)
            if operand is not None:
                node.meta["nn_module_stack"] = dict(operand.meta["nn_module_stack"])
                node.meta["stack_trace"] = operand.meta.get("stack_trace", "")
                continue
        origin = forward.get(node.meta.get("seq_nr"))
        stack = dict(origin.meta.get("nn_module_stack") or {}) if origin is not None else {}
        path = next(reversed(stack.values()))[0] if stack else ""
        stack[BACKWARD_KEY] = (path, BACKWARD)
        node.meta["nn_module_stack"] = stack
        if origin is not None and not _own_frames(node.meta.get("stack_trace") or ""):
            node.meta["stack_trace"] = origin.meta.get("stack_trace", "")


# --- decompositions: core ATen, and slice_backward as a pad ------------------------------------------


def _slice_backward_as_pad(grad: torch.Tensor, input_sizes: Sequence[int], dim: int, start: int, end: int,
                           step: int) -> torch.Tensor:
    """slice_backward (the gradient of `x[..., start:end]`): zeros with `grad` at [start:end] on
    `dim`, written as a constant pad rather than core ATen's scatter into zeros, so the program
    keeps a Pad (whose relations follow the untouched axes) instead of an index scatter."""
    from torch._decomp import core_aten_decompositions

    dim = dim % len(input_sizes)
    if step != 1:
        return core_aten_decompositions()[torch.ops.aten.slice_backward.default](
            grad, input_sizes, dim, start, end, step)
    size = input_sizes[dim]
    start = min(max(start + size if start < 0 else start, 0), size)
    after = size - start - grad.shape[dim]
    pads = [0, 0] * (grad.dim() - 1 - dim) + [start, after]
    return torch.constant_pad_nd(grad, pads, 0.0)


@functools.cache
def _decompositions() -> dict[Any, Callable[..., Any]]:
    """Core ATen (what the forward export decomposes to), plus the decompositions torch.onnx
    would apply to the ops its translation lacks (aten.squeeze.dims), so the traced step goes
    straight to translation without another decomposition pass (a full retrace)."""
    from torch._decomp import core_aten_decompositions
    from torch.onnx._internal.exporter import _decomp

    from refine.exporters.capture.conv_backward import convolution_backward
    from refine.exporters.capture.tracing import own_decompositions, torchlib_registry

    table = dict(core_aten_decompositions())
    supported = set(_decomp.get_onnx_implemented_overloads(torchlib_registry(())))
    table.update(_decomp.create_onnx_friendly_decomposition_table(supported))
    for lift in (torch.ops.aten.lift.default, torch.ops.aten.lift_fresh.default):
        # make_fx lifts a constant (`x[mask] = 0`'s value) itself; decomposed, it would alias a real tensor
        table.pop(lift, None)
    table[torch.ops.aten.slice_backward.default] = _slice_backward_as_pad
    table[torch.ops.aten.convolution_backward.default] = convolution_backward
    table.update(own_decompositions())
    return table


# --- the step ------------------------------------------------------------------------------------------


def as_dtensor(local: torch.Tensor, placement: tuple[Any, ...] | None) -> torch.Tensor:
    """`local` as the DTensor `placement` (from `_placement_of`) describes, differentiably
    (DTensor.from_local: its backward converts the gradient to those placements); `local`
    itself for a plain parameter."""
    if placement is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = placement
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def trace_step(module: nn.Module, args: Sequence[torch.Tensor], tracer: LocalKeeper | None = None,
               ) -> tuple[torch.fx.GraphModule, list[str], list[str], list[torch.Tensor]]:
    """make_fx of one training step of `module` on `args` = (*model inputs, labels).

    Returns the graph (inputs: parameters' local tensors, buffers, then `args`; outputs: loss
    and one gradient per parameter), the parameter and buffer FQNs in input order, and their
    values (the local tensors the graph was traced with). With a layer `tracer`, the layers'
    parameters are handed to their calls as the local leaves (`TrainTracer.keep_local`)."""
    from torch.distributed.tensor import DTensor
    from torch.fx.experimental.proxy_tensor import make_fx

    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    placements = {fqn: _placement_of(p) for fqn, p in params.items()}
    n_params, n_buffers = len(params), len(buffers)
    flat = [_local(p).detach() for p in params.values()] + [_local(b) for b in buffers.values()] + list(args)

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # (the traced inputs are leaves already; a frozen parameter stays one without a gradient)
        leaves = [t.requires_grad_(p.requires_grad) for t, p in zip(flat[:n_params], params.values())]
        local = {fqn: (leaf, placements[fqn]) for fqn, leaf in zip(placements, leaves)}
        kept = tracer.keep_local(local) if tracer is not None else set()
        state = {fqn: leaf if fqn in kept else as_dtensor(leaf, spec)
                 for (fqn, spec), leaf in zip(placements.items(), leaves)}
        state = unsharded(module, state)
        # (a DTensor buffer, torchtitan's RoPE cache under full_dtensor, is rebuilt from its local tensor too)
        state.update((fqn, as_dtensor(b, _placement_of(buffers[fqn])))
                     for fqn, b in zip(buffers, flat[n_params : n_params + n_buffers]))
        *inputs, labels = flat[n_params + n_buffers :]
        own_step = getattr(module, "training_step", None)

        def call(*args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            out = torch.func.functional_call(module, state, tuple(args), kwargs)
            if isinstance(out, DTensor) and own_step is None:  # (a stage's own step sends local tensors itself)
                raise ExportError("a training step needs the model to return local logits, it returns a DTensor")
            return out

        if own_step is not None:  # a module that runs its own step (a pipeline stage: its sends, receives
            # and backward segments, exporters/strategies/pipeline_train.py) returns its outputs, `output_names` order
            return tuple(own_step(call, inputs, labels, dict(zip(placements, leaves))))
        loss, grads = step_gradients(module, call, inputs, labels, leaves, traced=True)
        full = {fqn: torch.zeros_like(leaf) if g is None else g for fqn, g, leaf in zip(placements, grads, leaves)}
        return (finalized_loss(module, loss), *finalized(module, full).values())

    from refine.exporters.capture.tracing import math_attention

    with fx_traceback.preserve_node_meta(), math_attention():
        # (_allow_non_fake_inputs: a module's plain tensor attribute, such as Megatron's RoPE
        # inv_freq, is read as a constant of the trace, lifted by _lift_constants)
        gm = make_fx(step, decomposition_table=_decompositions(), tracing_mode="fake",
                     record_stack_traces=True, _allow_non_fake_inputs=True)(*flat)
    _attribute_backward(gm)
    if _mutates(gm):  # in-place code (Megatron's cross-entropy): the traced step, functionalized
        gm = _functionalized(gm, flat)
    row_indexing.rewrite(gm)
    _drop_unused_absent_outputs(gm)
    return gm, list(params), list(buffers), flat[: n_params + n_buffers]


def _drop_unused_absent_outputs(gm: torch.fx.GraphModule) -> None:
    """Erase the unused `getitem`s of an output a multi-output op did not compute
    (convolution_backward's bias gradient when the convolution has no bias: None, so no `val`),
    which torch.export's verifier refuses."""
    import operator

    absent = [n for n in gm.graph.nodes
              if n.op == "call_function" and n.target is operator.getitem and not n.users and n.meta.get("val") is None]
    for node in absent:
        gm.graph.erase_node(node)
    if absent:
        gm.recompile()


def _functionalized(gm: torch.fx.GraphModule, flat: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """`gm` traced again through functionalization (in-place ops become functional ones), each new
    node keeping the metadata of the node it comes from (an Interpreter run, preserve_node_meta)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    for node in gm.graph.nodes:  # functionalization refuses prims' view ops: their ATen form, decomposed again below
        if node.target is torch.ops.prims.squeeze.default:
            node.target = torch.ops.aten.squeeze.dims
    gm.recompile()

    def run(*args: torch.Tensor) -> Any:
        return torch.fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta():
        return make_fx(torch.func.functionalize(run, remove="mutations"), decomposition_table=_decompositions(),
                       tracing_mode="fake", _allow_non_fake_inputs=True)(*flat)


def _mutates(gm: torch.fx.GraphModule) -> bool:
    """Whether the traced step runs an in-place op (an ExportedProgram must be functional)."""
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in gm.graph.nodes if n.op == "call_function")


def input_names(module: nn.Module, n_inputs: int) -> list[str]:
    """The names of the model's first `n_inputs` forward arguments, then `labels`; a module with
    its own `step_input_names()` (a user's batch, exporters/strategies/own.py) names them."""
    import inspect

    own = getattr(module, "step_input_names", None)
    if own is not None:
        return list(own())

    names = [p.name for p in inspect.signature(module.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:n_inputs]
    if len(names) < n_inputs or LABELS in names:
        names = [f"input_{i}" for i in range(n_inputs)]
    return [*names, LABELS]


def exported_program(gm: torch.fx.GraphModule, params: list[str], buffers: list[str],
                      values: Sequence[torch.Tensor], user_inputs: list[str]) -> torch.export.ExportedProgram:
    """The traced step as an ExportedProgram whose parameters and buffers are named by FQN,
    so the ONNX translation makes them initializers under those names, and whose user inputs
    are named `user_inputs`."""
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import (
        ExportGraphSignature,
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = params + buffers
    constants = _lift_constants(gm, placeholders[len(names) - 1] if names else None)
    inputs = []
    for i, ph in enumerate(placeholders):
        if i == len(names):  # (the lifted constants stand between the buffers and the user inputs)
            inputs.extend(InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), target=target)
                          for target, node in constants.items())
        if i < len(params):
            inputs.append(InputSpec(InputKind.PARAMETER, TensorArgument(ph.name), target=names[i]))
        elif i < len(names):
            inputs.append(InputSpec(InputKind.BUFFER, TensorArgument(ph.name), target=names[i], persistent=True))
        else:
            ph._rename(user_inputs[i - len(names)])
            inputs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(ph.name), target=None))
    (returned,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    outputs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(a.name), target=None) for a in returned]
    state = {name: (nn.Parameter(v, requires_grad=False) if i < len(params) else v)
             for i, (name, v) in enumerate(zip(names, values))}
    n_user = len(placeholders) - len(names)
    in_spec = pytree.tree_flatten(((None,) * n_user, {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(len(outputs))))[1]
    call = ModuleCallEntry("", ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec))
    return torch.export.ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=ExportGraphSignature(inputs, outputs), state_dict=state,
        range_constraints={}, module_call_graph=[call],
        constants={target: getattr(gm, target) for target in constants},
    )


def _lift_constants(gm: torch.fx.GraphModule, after: torch.fx.Node | None) -> dict[str, torch.fx.Node]:
    """Tensor constants the trace holds as attributes (`x[mask] = 0`'s value) as placeholders
    right after `after` (the last buffer), as an ExportedProgram lifts them; attribute -> node."""
    lifted: dict[str, torch.fx.Node] = {}
    anchor = after
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not isinstance(getattr(gm, node.target, None), torch.Tensor):
            continue
        if str(node.target) in lifted:  # read again (activation checkpointing recomputes the forward): one input
            node.replace_all_uses_with(lifted[str(node.target)])
            gm.graph.erase_node(node)
            continue
        if anchor is None:
            raise ExportError("a training step with tensor constants needs parameters")
        with gm.graph.inserting_after(anchor):
            placeholder = gm.graph.placeholder(f"c_{node.target}")
        placeholder.meta = dict(node.meta)
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        lifted[str(node.target)] = anchor = placeholder
    gm.recompile()
    return lifted


def output_layouts(names: Sequence[str], inputs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """refine.json layouts of a step's outputs: the loss is a replica, and each gradient is
    laid out as its parameter is (the same shard; a replica for a replicated parameter)."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if name == LOSS:
            out[name] = {"layout": "rep"}
            continue
        param = name.removeprefix(GRAD_PREFIX)
        if param not in inputs:
            raise ExportError(f"output {name!r}: parameter {param!r} is not declared in refine.json")
        out[name] = dict(inputs[param])
    return out


def reference(module: nn.Module, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What torch computes for one training step of `module` on (*model inputs, labels):
    the loss and every parameter's gradient, by eager autograd."""
    *model_inputs, labels = inputs
    params = dict(module.named_parameters())
    loss, grads = step_gradients(module, module, model_inputs, labels, list(params.values()))
    full = {fqn: torch.zeros_like(p) if g is None else g for (fqn, p), g in zip(params.items(), grads)}
    out = {LOSS: finalized_loss(module, loss).detach()}
    for fqn, g in finalized(module, full).items():
        out[grad_name(fqn)] = g.detach()
    return out
