"""Each distinct layer exported once, as an ONNX model-local function (docs/layers.md).

Capturing 126 identical decoder layers costs 126 times one; this module makes a capture cost
one per *distinct* layer. While a program is captured, every layer of the stack (a ModuleList
such as `model.layers`) is intercepted at its call, before its own hooks (so a parallel plan's
hooks on the layer belong to the layer):

- its *key* is a digest of the layer's module signature (class, submodules, non-tensor
  attributes except `layer_idx`, hooks and what their closures hold, parameter and buffer
  shapes, dtypes and DTensor placements) and of the call (argument structure, non-tensor
  arguments, each tensor argument's shape, dtype, stride and placement, which arguments alias);
- the first call with a new key, the *representative*, runs for real, its tensor arguments
  and its result passed through identity ops (`refine_export::mark`) that delimit its body;
- a later call with a seen key runs nothing: one opaque `refine_export::stub` op on its
  tensor arguments stands for it, with the representative's result type (and placement).

The captured graph therefore holds the outer code exactly as torch ran it for the whole model
(what feeds every layer, where every result goes), each distinct body once, and a stub per
other layer. `outline` cuts each marked body out into a FunctionProto (inputs: the layer's
tensor arguments, then its parameters; constants stay inside) and replaces bodies and stubs
alike by calls named by module path, `model.layers.K(args..., model.layers.K.<param>...)`.

Soundness rests on the key: a stub stands for its representative's body, so two layers may
share a key only if they compute the same function of their arguments and parameters. The
signature describes everything reachable from the layer that can steer its forward
structurally (functions by their code, defaults and closures; objects by their attributes) and
falls back to object identity where it cannot, which can only split a group, never merge two.
What it does not see: a forward that reads state outside the layer by `layer_idx` (the zoo's
layers read none), and attributes a framework declares inert for one export (`inert_attributes`:
exporters/frameworks/megatron.py leaves out Megatron's `layer_number` after checking that no option it
exports with reads it in forward). `refine export --check` compares the function-form programs with torch.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import os
import re
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
import torch.utils._pytree as pytree
from onnx import helper, numpy_helper
from onnx.defs import OpSchema

from refine.exporters.errors import ExportError, LayerFormError
from refine.exporters.capture.layouts import module_fqn

LAYER_DOMAIN = "refine.layer"
LAYER_VERSION = 1
_MARK_DOMAIN = "refine.export"  # transient: never in a written file
_HOOK_ATTRS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")
_IGNORED_ATTRS = frozenset({
    "_parameters", "_buffers", "_modules", "_compiled_call_impl", "layer_idx", *_HOOK_ATTRS,
    # hooks that do not run in forward
    "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_is_full_backward_hook",
})
_MAX_DEPTH = 24


# --- the signature: what decides what a layer computes -------------------------------------------


_INERT: dict[type, frozenset[str]] = {}  # class -> attributes its forward does not read (this export)


@contextlib.contextmanager
def inert_attributes(table: Mapping[type, frozenset[str]]) -> Iterator[None]:
    """Leave `table`'s attributes (per class, subclasses included) out of layer signatures
    while the block runs: for a framework's per-layer counter that its forward reads only under
    options the caller has checked are off (forked rank workers inherit the table)."""
    saved = dict(_INERT)
    _INERT.update(table)
    try:
        yield
    finally:
        _INERT.clear()
        _INERT.update(saved)


def _inert_for(cls: type) -> frozenset[str]:
    return frozenset().union(*(names for owner, names in _INERT.items() if issubclass(cls, owner)))


class _Describer:
    """Canonical, hashable descriptions of objects reachable from one layer.

    Modules inside the layer are named by their path relative to it (so equal layers describe
    alike); anything not understood is described by identity (so it can only split groups).
    Descriptions are memoized by id for one pass over a model that does not change meanwhile:
    those naming a layer's modules only while that layer is described."""

    def __init__(self) -> None:
        self._memo: dict[int, Any] = {}  # this layer's
        self._shared: dict[int, Any] = {}  # naming no module of a layer: valid for every layer
        self._stack: list[int] = []  # ids of the objects being described, outermost first
        self._cycles = 0  # back references emitted so far
        self._selfrefs = 0  # modules of the layer named so far
        self._inside: dict[int, str] = {}
        self._keep: list[Any] = []  # ids stay unique while memoized objects are alive

    def layer(self, layer: torch.nn.Module) -> str:
        # a description naming modules of this layer by relative path is not reused for another
        self._memo = {}
        self._inside = {id(m): path for path, m in layer.named_modules(remove_duplicate=False)}
        parts: list[Any] = []
        for path, sub in layer.named_modules(remove_duplicate=False):
            inert = _inert_for(type(sub))
            attrs = {k: v for k, v in vars(sub).items() if k not in _IGNORED_ATTRS and k not in inert}
            parts.append(("module", path, _type_name(type(sub)), self.of(attrs, 0), self._hooks(sub)))
            for kind, table in (("param", sub._parameters), ("buffer", sub._buffers)):
                for name, value in table.items():
                    parts.append((kind, path, name, _tensor_meta(value) if value is not None else None))
        tensors = [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]
        first: dict[int, str] = {}
        parts.append(("aliases", tuple(first.setdefault(id(t), n) for n, t in tensors)))
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def _hooks(self, module: torch.nn.Module) -> Any:
        """Forward hooks in the order they run, with their flags; not their handle ids, which
        are global counters and differ between otherwise equal layers."""
        pre = [(self.of(h, 0), k in module._forward_pre_hooks_with_kwargs) for k, h in module._forward_pre_hooks.items()]
        post = [(self.of(h, 0), k in module._forward_hooks_with_kwargs, k in module._forward_hooks_always_called)
                for k, h in module._forward_hooks.items()]
        return ("hooks", tuple(pre), tuple(post))

    def of(self, obj: Any, depth: int) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return (type(obj).__name__, repr(obj))
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            return ("torch", repr(obj))
        if isinstance(obj, torch.nn.Module) and id(obj) in self._inside:
            self._selfrefs += 1
            return ("self", self._inside[id(obj)])
        if isinstance(obj, torch.Tensor):
            return ("tensor", id(obj)) if isinstance(obj, torch.nn.Parameter) else ("tensor", _tensor_meta(obj), _data(obj))
        key = id(obj)
        if key in self._shared:
            return self._shared[key]
        if key in self._memo:
            return self._memo[key]
        if key in self._stack:  # a back reference: how many levels up it points
            self._cycles += 1
            return ("cycle", len(self._stack) - self._stack.index(key))
        if depth > _MAX_DEPTH:
            return ("deep", key)
        self._stack.append(key)
        cycles, selfrefs = self._cycles, self._selfrefs
        try:
            out = self._compound(obj, depth + 1)
        finally:
            self._stack.pop()
        if self._cycles == cycles:  # a description with back references depends on where it was reached
            (self._shared if self._selfrefs == selfrefs else self._memo)[key] = out
            self._keep.append(obj)
        return out

    def _compound(self, obj: Any, depth: int) -> Any:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.placement_types import Placement

        if isinstance(obj, (tuple, list)):
            return (type(obj).__name__, tuple(self.of(v, depth) for v in obj))
        if isinstance(obj, (set, frozenset)):
            return (type(obj).__name__, tuple(sorted(repr(self.of(v, depth)) for v in obj)))
        if isinstance(obj, dict):
            items = sorted((repr(self.of(k, depth)), self.of(v, depth)) for k, v in obj.items())
            return (_type_name(type(obj)), tuple(items))
        if isinstance(obj, Placement):
            return ("placement", repr(obj))
        if isinstance(obj, DeviceMesh):
            return ("mesh", id(obj))  # one mesh object per rank capture: identity is exact
        if isinstance(obj, functools.partial):
            return ("partial", self.of(obj.func, depth), self.of(obj.args, depth), self.of(obj.keywords, depth))
        if isinstance(obj, types.MethodType):
            return ("method", self.of(obj.__func__, depth), self.of(obj.__self__, depth))
        if isinstance(obj, types.FunctionType):
            cells = tuple(self.of(c.cell_contents, depth) if _filled(c) else ("empty",) for c in obj.__closure__ or ())
            return ("function", obj.__module__, obj.__qualname__, _code(obj.__code__),
                    self.of(obj.__defaults__, depth), self.of(obj.__kwdefaults__, depth), cells)
        if isinstance(obj, type):
            return ("type", _type_name(obj))
        if isinstance(obj, types.ModuleType):
            return ("pymodule", obj.__name__)
        if isinstance(obj, types.BuiltinFunctionType):  # bound to a module, or to an object (by identity)
            owner = obj.__self__
            bound = None if owner is None or isinstance(owner, types.ModuleType) else id(owner)
            return ("builtin", getattr(obj, "__module__", None), obj.__qualname__, bound)
        if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            slots = {s: getattr(obj, s) for s in _slots(type(obj)) if hasattr(obj, s)}
            return ("object", _type_name(type(obj)), self.of(vars(obj), depth), self.of(slots, depth))
        if _slots(type(obj)):
            return ("object", _type_name(type(obj)), self.of({s: getattr(obj, s, None) for s in _slots(type(obj))}, depth))
        return ("identity", _type_name(type(obj)), id(obj))


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _slots(cls: type) -> list[str]:
    return [s for c in cls.__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")]


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _code(code: types.CodeType) -> Any:
    consts = tuple(_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return (code.co_code.hex(), consts, code.co_names, code.co_varnames, code.co_freevars)


def _tensor_meta(t: torch.Tensor, local: torch.Tensor | None = None) -> tuple:
    """Shape, dtype, stride, device (and placement, mesh and local layout of a DTensor, read off
    its spec and `local`, its local tensor if known: reading `_local_tensor` while capturing
    records a node)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        spec = t._spec
        local = t._local_tensor if local is None else local
        meta = spec.tensor_meta
        return (tuple(meta.shape), str(meta.dtype), tuple(meta.stride), spec.mesh.device_type, bool(t.requires_grad),
                "dtensor", id(spec.mesh), tuple(repr(p) for p in spec.placements),
                tuple(local.shape), tuple(local.stride()))
    return (tuple(t.shape), str(t.dtype), tuple(t.stride()), t.device.type, bool(t.requires_grad))


def _data(t: torch.Tensor) -> Any:
    """A plain tensor attribute's contents (a constant the forward may bake in), by value if small."""
    if t.device.type == "meta" or t.numel() > 1 << 16 or type(t) is not torch.Tensor:
        return ("identity", id(t))
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def layer_signatures(stack: torch.nn.ModuleList) -> list[str]:
    """One digest per layer; equal digests: same code, structure, attributes, hooks, parameter types."""
    describer = _Describer()
    return [describer.layer(layer) for layer in stack]


# --- markers and stubs: the transient ops that delimit bodies ------------------------------------

_STUB_OUT: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # site -> the local result type


@torch.library.custom_op("refine_export::mark", mutates_args=())
def _mark(x: torch.Tensor, site: int, pos: int) -> torch.Tensor:
    """Identity; pos >= 0 marks the site's pos-th tensor argument, -1 its result."""
    return x.clone()


@_mark.register_fake
def _(x: torch.Tensor, site: int, pos: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("refine_export::stub", mutates_args=())
def _stub(xs: list[torch.Tensor], site: int) -> torch.Tensor:
    """A layer call whose body is its representative's; never executed, only traced."""
    raise ExportError("a layer stub was executed (it only exists while capturing)")


@_stub.register_fake
def _(xs: list[torch.Tensor], site: int) -> torch.Tensor:
    shape, dtype = _STUB_OUT[site]
    return xs[0].new_empty(shape, dtype=dtype) if xs else torch.empty(shape, dtype=dtype)


def as_real(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view (a last axis of 2: real, imaginary), as torch.onnx
    represents complex values; any other tensor as it is. The markers and stubs are custom ops,
    which torch.onnx translates on real tensors only (DeepSeek-V2's and Llama 4's complex RoPE
    frequencies are a layer argument)."""
    return torch.view_as_real(x) if x.is_complex() else x


def marked(mark: Callable[[torch.Tensor, int, int], torch.Tensor], x: torch.Tensor, site: int, pos: int) -> torch.Tensor:
    """`mark(x, site, pos)`, a complex x marked as its real view and viewed complex again
    (torch.onnx writes both views as the identity)."""
    return torch.view_as_complex(mark(as_real(x), site, pos)) if x.is_complex() else mark(x, site, pos)


def _register_marker_schemas() -> None:
    types_ = [f"tensor({t})" for t in ("float", "double", "float16", "bfloat16", "int64", "int32", "int16",
                                         "int8", "uint8", "bool")]
    if not onnx.defs.has("Mark", _MARK_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "Mark", _MARK_DOMAIN, 1, "identity delimiting a layer body (refine.exporters.capture.layers)",
            inputs=[OpSchema.FormalParameter("X", "T", "")], outputs=[OpSchema.FormalParameter("Y", "T", "")],
            type_constraints=[("T", types_, "")],
            attributes=[OpSchema.Attribute("site", OpSchema.AttrType.INT, "", required=True),
                        OpSchema.Attribute("pos", OpSchema.AttrType.INT, "", required=True)]))
    if not onnx.defs.has("Stub", _MARK_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "Stub", _MARK_DOMAIN, 1, "a layer call standing for its representative (refine.exporters.capture.layers)",
            inputs=[OpSchema.FormalParameter("X", "T", "", param_option=OpSchema.FormalParameterOption.Variadic,
                                             is_homogeneous=False)],
            outputs=[OpSchema.FormalParameter("Y", "U", "")],
            type_constraints=[("T", types_, ""), ("U", types_, "")],
            attributes=[OpSchema.Attribute("site", OpSchema.AttrType.INT, "", required=True)]))


@functools.cache
def translation_table() -> dict[Callable[..., Any], Callable[..., Any]]:
    """custom_translation_table entries for the markers (onnxscript needs their schemas); the
    same functions every time, so that a translation registry built with them can be reused."""
    import onnxscript

    _register_marker_schemas()
    ops = onnxscript.values.Opset(_MARK_DOMAIN, 1)

    def mark(x: Any, site: int, pos: int) -> Any:
        return ops.Mark(x, site=site, pos=pos)

    def stub(xs: Any, site: int) -> Any:
        return ops.Stub(*xs, site=site)

    return {torch.ops.refine_export.mark.default: mark, torch.ops.refine_export.stub.default: stub}


# --- interception while capturing ----------------------------------------------------------------


@dataclass
class Site:
    """One layer call seen while capturing."""

    site: int  # unique in the process (the markers' `site` attribute)
    layer: int  # index in the stack
    path: str  # module path, `model.layers.3`
    key: str
    rep: int  # site of its representative (itself if it is one)
    arg_names: list[str]  # one per tensor argument


class Retrace(Exception):
    """A hidden layer needs tracing after all (its call differs from every representative's)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"layer {index} needs its own trace")
        self.index = index


class _Hidden(torch.nn.Module):
    """Stands in the stack for a layer expected to become a stub, so that the capture does not
    lift its parameters (a placeholder per parameter per layer is most of a deep model's
    capture cost). Attribute reads the outer code makes fall through to the real layer."""

    def __init__(self, tracer: Tracer, index: int) -> None:
        super().__init__()
        self._refine_tracer = tracer
        self._refine_index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._refine_tracer.call(self._refine_index, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            index = self.__dict__["_refine_index"]
            value = getattr(self.__dict__["_refine_tracer"].layers[index], name)
            if isinstance(value, (torch.Tensor, torch.nn.Module)):
                raise Retrace(index) from None  # the outer code reads into the layer: capture it for real
            return value


def in_form(value: torch.Tensor, form: tuple[int, int] | None) -> Any:
    """A layer's result tensor in the form its layer returns it (see Tracer._result)."""
    if form is None:
        return value
    length, slot = form
    return tuple(value if i == slot else None for i in range(length))


@dataclass
class Tracer:
    """Intercepts the calls of one stack's layers while a program is captured.

    Only the first layer of each module-signature group stays in the module while capturing
    (`visible`); the others are hidden behind `_Hidden`. A hidden layer whose call matches no
    representative raises Retrace; the capture is then repeated with that layer visible."""

    root: torch.nn.Module
    prefix: str
    layers: list[torch.nn.Module] = field(default_factory=list)
    signatures: list[str] = field(default_factory=list)
    visible: set[int] = field(default_factory=set)
    sites: list[Site] = field(default_factory=list)
    _reps: dict[str, Site] = field(default_factory=dict)
    _out: dict[int, Any] = field(default_factory=dict)  # rep site -> (local meta, DTensor spec)
    _made: dict[int, tuple] = field(default_factory=dict)  # id -> (DTensor made here, its parts, versions)

    def __post_init__(self) -> None:
        try:
            stack = self.root.get_submodule(self.prefix)
        except AttributeError:
            raise ExportError(f"the module has no submodule {self.prefix!r} holding its layers") from None
        if not isinstance(stack, torch.nn.ModuleList) or not len(stack):
            raise ExportError(f"{self.prefix!r} is not a non-empty ModuleList of layers")
        self.layers = list(stack)
        self.signatures = layer_signatures(stack)
        first: dict[str, int] = {}
        self.visible = {first.setdefault(sig, i) for i, sig in enumerate(self.signatures)}

    @property
    def stack(self) -> torch.nn.ModuleList:
        return self.root.get_submodule(self.prefix)  # type: ignore[return-value]

    def reset(self, *_: Any) -> None:
        """A new forward: representatives are chosen afresh (hook on the root module)."""
        self.sites.clear()
        self._reps.clear()
        self._made.clear()

    def call(self, index: int, args: tuple, kwargs: dict) -> Any:
        layer = self.layers[index]
        flat, spec = pytree.tree_flatten_with_path((args, kwargs))
        leaves = [leaf for _, leaf in flat]
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        parts = {i: self._parts(leaves[i]) for i in tensors}  # (local, DTensor spec, meta)
        first: dict[int, int] = {}
        call_sig = (
            str(spec),
            tuple(parts[i][2] if i in parts else _leaf(leaf) for i, leaf in enumerate(leaves)),
            tuple(first.setdefault(id(leaves[i]), i) for i in tensors),
        )
        key = hashlib.sha256(repr((self.signatures[index], call_sig)).encode()).hexdigest()[:16]
        rep = self._reps.get(key)
        if rep is None and index not in self.visible:
            raise Retrace(index)
        site = _next_site()
        names = _arg_names(layer, [flat[i][0] for i in tensors]) if rep is None else []
        here = Site(site, index, f"{self.prefix}.{index}", key, rep.site if rep else site, names)
        self.sites.append(here)
        if rep is None:
            self._reps[key] = here
            return self.representative(here, leaves, spec, tensors, parts)
        return self.stub(here, rep, leaves, tensors, parts)

    def representative(self, here: Site, leaves: list[Any], spec: Any, tensors: list[int],
                       parts: dict[int, tuple]) -> Any:
        """Run the layer for real, its tensor arguments and its result passed through markers."""
        for pos, i in enumerate(tensors):
            local, dspec, _ = parts[i]
            leaves[i] = self._wrap(marked(_mark, local, here.site, pos), dspec)
        a, kw = pytree.tree_unflatten(leaves, spec)
        out = self._result(here, torch.nn.Module._call_impl(self.layers[here.layer], *a, **kw))
        local, dspec, _ = self._parts(out)
        return in_form(self._wrap(marked(_mark, local, here.site, -1), dspec), self._out[here.site][2])

    def _result(self, here: Site, out: Any) -> torch.Tensor:
        """A representative's result tensor; its type and form remembered for the stubs. The form
        is None for one tensor, (length, slot) for a tuple of one tensor and Nones (Megatron's
        TransformerLayer returns (hidden_states, context=None))."""
        form: tuple[int, int] | None = None
        if isinstance(out, tuple) and all(o is None or isinstance(o, torch.Tensor) for o in out) \
                and sum(isinstance(o, torch.Tensor) for o in out) == 1:
            form = (len(out), next(i for i, o in enumerate(out) if isinstance(o, torch.Tensor)))
            out = out[form[1]]
        if not isinstance(out, torch.Tensor):
            raise LayerFormError(f"{here.path} returns {type(out).__name__}, not one tensor: layers as functions need "
                              "one tensor result, or a tuple of one tensor and Nones (export with --flat)")
        local, dspec, _ = self._parts(out)
        self._out[here.site] = ((tuple(local.shape), local.dtype), dspec, form)
        return out

    def stub(self, here: Site, rep: Site, leaves: list[Any], tensors: list[int], parts: dict[int, tuple]) -> Any:
        """Run nothing: one opaque op with the representative's result type stands for the call."""
        meta, dspec, form = self._out[rep.site]
        _STUB_OUT[here.site] = meta
        return in_form(self._wrap(_stub([as_real(parts[i][0]) for i in tensors], here.site), dspec), form)

    def _parts(self, t: torch.Tensor) -> tuple[torch.Tensor, Any, tuple]:
        """(local tensor, DTensor spec or None, meta) of a tensor argument; remembered for the
        DTensors this tracer made, so that a chain of stubs records no unwrapping nodes."""
        made = self._made.get(id(t))
        if made is not None and made[0] is t and made[2] == (t._version, made[1][0]._version):
            return made[1]  # not modified in place since it was made
        local, dspec = _unwrap(t)
        return local, dspec, _tensor_meta(t, local)

    def _wrap(self, local: torch.Tensor, dspec: Any) -> torch.Tensor:
        out = _rewrap(local, dspec)
        if dspec is not None:
            self._made[id(out)] = (out, (local, dspec, _tensor_meta(out, local)), (out._version, local._version))
        return out

    @contextlib.contextmanager
    def active(self) -> Iterator[Tracer]:
        """Intercept while inside (visible layers at their call, hidden ones swapped out); the
        module is left as it was."""
        hook = self.root.register_forward_pre_hook(self.reset)
        stack = self.stack
        try:
            for index, layer in enumerate(self.layers):
                if index in self.visible:
                    # nn.Module.__call__ runs `_compiled_call_impl` instead of `_call_impl` (hooks
                    # and forward) when set: the interceptor sees the call as the outer code made it
                    layer._compiled_call_impl = functools.partial(self._intercept, index)
                else:
                    stack[index] = _Hidden(self, index)
            yield self
        finally:
            hook.remove()
            for index, layer in enumerate(self.layers):
                layer.__dict__.pop("_compiled_call_impl", None)
                stack[index] = layer

    def close(self) -> None:
        """Forget the stubs' result types (needed until the ONNX conversion is done)."""
        for s in self.sites:
            _STUB_OUT.pop(s.site, None)
        self._made.clear()

    def _intercept(self, index: int, *args: Any, **kwargs: Any) -> Any:
        return self.call(index, args, kwargs)

    def parameters(self, index: int) -> list[tuple[str, torch.Tensor]]:
        """(name relative to the layer, tensor) of layer `index`'s parameters and buffers."""
        layer = self.layers[index]
        return [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]


def retrace_of(exc: BaseException) -> Retrace | None:
    """The Retrace behind an exception torch may have wrapped, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Retrace):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


_SITES = iter(range(1 << 62))


def _next_site() -> int:
    return next(_SITES)


def _leaf(value: Any) -> Any:
    return _Describer().of(value, 0)


def _unwrap(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A DTensor's local tensor and spec, read directly: to_local() would add a view to the graph."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t._local_tensor, t._spec
    return t, None


def _rewrap(t: torch.Tensor, spec: Any) -> torch.Tensor:
    """The DTensor `spec` describes around the local `t` (no view, unlike from_local())."""
    if spec is None:
        return t
    from torch.distributed.tensor import DTensor

    return DTensor(t, spec, requires_grad=False)


def _arg_names(layer: torch.nn.Module, paths: list[tuple]) -> list[str]:
    """Readable names of the tensor arguments: `hidden_states`, `position_embeddings.0`."""
    try:
        params = [p for p in inspect.signature(layer.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = []
    for path in paths:
        parts: list[str] = []
        for i, entry in enumerate(path):
            key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))
            if i == 0:
                continue  # (args, kwargs)
            if i == 1 and path[0].idx == 0:  # type: ignore[union-attr]
                parts.append(params[key].name if isinstance(key, int) and key < len(params) else f"arg{key}")
            else:
                parts.append(str(key))
        names.append(".".join(parts) or "arg")
    seen: dict[str, int] = defaultdict(int)
    unique = []
    for n in names:
        seen[n] += 1
        unique.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return unique


# --- outlining: marked bodies -> functions, stubs -> calls ----------------------------------------


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


@dataclass
class _Body:
    site: Site
    nodes: list[int]  # indices into graph.node, in order
    arg_values: dict[int, str]  # pos -> the Mark output inside the body
    arg_actuals: dict[int, str]  # pos -> the value the outer code passed
    result: str  # value the body computes (Mark -1's input)
    params: list[str]  # the layer's parameters it reads, relative names
    outer: list[str]  # weights of modules outside the layer it reads: the same for every call
    constants: list[str]  # initializers it reads that are no weight (constants torch lifted)
    constant_nodes: list[int]  # Constant nodes it reads (the ONNX builder shares them across the graph): copied


@dataclass
class _Function:
    proto: onnx.FunctionProto
    arg_positions: list[int]  # the tensor arguments it takes (unused ones dropped)
    params: list[str]  # parameter names relative to the layer, in input order
    outer: list[str]  # then weights outside the layer, by main-graph name


class _Outliner:
    """One program's rewrite (see `outline`)."""

    def __init__(self, model: onnx.ModelProto, tracer: Tracer) -> None:
        self.model, self.graph, self.tracer = model, model.graph, tracer
        self._types: dict[str, onnx.TypeProto] | None = None
        self.sites = {s.site: s for s in tracer.sites}
        self.params_of = {
            index: {rel: f"{tracer.prefix}.{index}.{rel}" for rel, _ in tracer.parameters(index)}
            for index in range(len(tracer.layers))
        }
        # the representatives' own parameters by FQN (a DTensor's is named after its parametrization)
        from refine.exporters.capture.rename import rename_values

        prefix = f"{tracer.prefix}."
        names = [i.name for i in self.graph.initializer] + [i.name for i in self.graph.input]
        rename_values(model, {n: module_fqn(n) for n in names if module_fqn(n) != n and module_fqn(n).startswith(prefix)})
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, node in enumerate(self.graph.node):
            for out in node.output:
                self.producer[out] = i
            for inp in node.input:
                self.consumers[inp].append(i)
        self.inits = {init.name: init for init in self.graph.initializer}
        self.inputs = {vi.name for vi in self.graph.input}
        self.weights = {n for n, _ in tracer.root.named_parameters(remove_duplicate=False)}
        self.weights |= {n for n, _ in tracer.root.named_buffers(remove_duplicate=False)}
        self.marks_in: dict[int, dict[int, int]] = defaultdict(dict)
        self.mark_out: dict[int, int] = {}
        self.stubs: dict[int, int] = {}
        self.backward_marks: list[int] = []  # GradMark and StubGrad nodes (refine.exporters.capture.train_layers)
        for i, node in enumerate(self.graph.node):
            if node.domain != _MARK_DOMAIN:
                continue
            site = _attr(node, "site")
            if site not in self.sites:
                raise ExportError(f"the captured graph holds a layer marker of an unknown call (site {site})")
            if node.op_type == "Stub":
                self.stubs[site] = i
            elif node.op_type != "Mark":
                self.backward_marks.append(i)
            elif _attr(node, "pos") < 0:
                self.mark_out[site] = i
            else:
                self.marks_in[site][_attr(node, "pos")] = i
        reps = {s.site for s in tracer.sites if s.rep == s.site}
        if set(self.mark_out) != reps or set(self.stubs) != set(self.sites) - reps:
            raise ExportError("the captured graph's layer markers do not match the layer calls torch made")

    def body(self, rep: Site, readers: frozenset[int] = frozenset()) -> _Body:
        """The nodes between the representative's argument marks and its result mark; their
        values may be read outside it only by `readers` (its backward, which recomputes them)."""
        graph = self.graph
        out_node = graph.node[self.mark_out[rep.site]]
        arg_values = {pos: graph.node[i].output[0] for pos, i in self.marks_in[rep.site].items()}
        boundary = set(arg_values.values())
        own = {name: rel for rel, name in self.params_of[rep.layer].items()}
        nodes: set[int] = set()
        constant_nodes: set[int] = set()
        params: list[str] = []
        outer: list[str] = []
        constants: list[str] = []
        todo = [out_node.input[0]]
        while todo:
            value = todo.pop()
            if not value or value in boundary:
                continue
            if value in own and (value in self.inits or value in self.inputs):
                if own[value] not in params:
                    params.append(own[value])
                continue
            if module_fqn(value) in self.weights and (value in self.inits or value in self.inputs):
                if value not in outer:  # a weight, never baked into the body as a constant
                    outer.append(value)
                continue
            if value in self.inits:
                if value not in constants:
                    constants.append(value)
                continue
            if value not in self.producer:
                where = "a graph input" if value in self.inputs else "undefined"
                raise ExportError(f"{rep.path}: its body reads {value!r} ({where}), which the layer was not given")
            i = self.producer[value]
            if i in nodes or i in constant_nodes:
                continue
            node = graph.node[i]
            if node.op_type == "Constant" and not node.domain and not node.input:
                constant_nodes.add(i)
                continue
            if node.domain == _MARK_DOMAIN:
                raise ExportError(f"{rep.path}: its body reads {value!r}, computed outside the layer and not passed to it")
            nodes.add(i)
            todo.extend(node.input)
        outputs = {o.name for o in graph.output}
        for i in nodes:
            for out in graph.node[i].output:
                leaks = [c for c in self.consumers.get(out, [])
                         if c not in nodes and c not in readers and c != self.mark_out[rep.site]]
                if leaks or out in outputs:
                    raise ExportError(f"{rep.path}: {out!r}, computed inside the layer, is used outside it "
                                      "without being its result (export with --flat)")
        return _Body(rep, sorted(nodes), arg_values,
                     {pos: graph.node[i].input[0] for pos, i in self.marks_in[rep.site].items()},
                     out_node.input[0], sorted(params), sorted(outer), constants, sorted(constant_nodes))

    def function(self, b: _Body, name: str) -> _Function:
        """The body as a FunctionProto: tensor arguments, the layer's parameters, outer weights;
        constants inside."""
        graph, rep = self.graph, b.site
        opsets = {o.domain: o.version for o in self.model.opset_import}
        rename = {self.params_of[rep.layer][rel]: rel for rel in b.params}
        used = {v for i in b.nodes for v in graph.node[i].input} | {b.result}
        arg_positions = sorted(pos for pos, v in b.arg_values.items() if v in used)
        rename.update({b.arg_values[pos]: rep.arg_names[pos] for pos in arg_positions})
        body = [helper.make_node("Constant", [], [c], name=f"{c}/Constant", value=self.inits[c]) for c in b.constants]
        body += [_renamed(graph.node[i], rename) for i in sorted([*b.constant_nodes, *b.nodes])]
        clash = set(rename.values()) & {o for n in body for o in n.output}
        if clash:
            raise ExportError(f"{rep.path}: a body value is named like an argument or parameter ({min(clash)!r})")
        layer = self.tracer.layers[rep.layer]
        proto = helper.make_function(
            LAYER_DOMAIN, name,
            inputs=[rep.arg_names[pos] for pos in arg_positions] + b.params + b.outer,
            outputs=[rename.get(b.result, b.result)],
            nodes=body,
            opset_imports=[helper.make_opsetid(d, opsets[d]) for d in sorted({n.domain for n in body}) if d in opsets],
            doc_string=f"{rep.path} ({type(layer).__qualname__}) and every layer called like it (key {rep.key})",
        )
        # types of every value the body names, formal inputs and output included: the types
        # at the representative's call, which every call of the function shares (the key)
        types = self.types()
        actual = {rep.arg_names[pos]: b.arg_actuals[pos] for pos in arg_positions}
        actual.update({rel: self.params_of[rep.layer][rel] for rel in b.params})
        actual.update({w: w for w in b.outer})
        named = [*actual, *(v for i in [*b.constant_nodes, *b.nodes] for v in graph.node[i].output)]
        for v in named:
            tp = types.get(actual.get(v, v))
            if tp is not None:
                proto.value_info.append(helper.make_value_info(rename.get(v, v), tp))
        return _Function(proto, arg_positions, b.params, b.outer)

    def types(self) -> dict[str, onnx.TypeProto]:
        """Every typed value of the main graph: inputs, initializers, intermediate values, outputs."""
        if self._types is None:
            g = self.graph
            self._types = {vi.name: vi.type for vi in (*g.input, *g.value_info, *g.output)}
            for init in g.initializer:
                self._types.setdefault(init.name, helper.make_tensor_type_proto(init.data_type, list(init.dims)))
        return self._types

    def call(self, fn: _Function, site: Site, args: list[str], output: str, like: onnx.NodeProto) -> onnx.NodeProto:
        """A call of `fn` named by module path, with the marker's name scopes and stack trace."""
        params = self.params_of[site.layer]
        node = helper.make_node(fn.proto.name, [*args, *(params[p] for p in fn.params), *fn.outer], [output],
                                name=site.path, domain=LAYER_DOMAIN)
        copy_call_metadata(node, like, site.path)
        return node

    def rewrite(self) -> dict[str, Any]:
        graph, tracer = self.graph, self.tracer
        reps = [s for s in tracer.sites if s.rep == s.site]
        readers = self.body_readers(reps)
        bodies = [self.body(s, readers.get(s.site, frozenset())) for s in reps]
        functions: dict[int, _Function] = {}
        for b in bodies:
            functions[b.site.site] = self.function(b, self.function_name(b.site))
        drop: set[int] = set()
        calls: dict[int, onnx.NodeProto] = {}
        for b in bodies:
            fn, at = functions[b.site.site], self.mark_out[b.site.site]
            drop.update(b.nodes)
            drop.update(self.marks_in[b.site.site].values())
            calls[at] = self.call(fn, b.site, [b.arg_actuals[p] for p in fn.arg_positions], graph.node[at].output[0],
                                  graph.node[at])
        for site_id, i in self.stubs.items():
            site, node = self.sites[site_id], graph.node[i]
            fn = functions[site.rep]
            calls[i] = self.call(fn, site, [node.input[p] for p in fn.arg_positions], node.output[0], node)
        protos = {fn.proto.name: (fn.proto, [s.path for s in tracer.sites if s.rep == rep])
                  for rep, fn in functions.items()}
        protos.update(self.more_calls(functions, drop, calls))
        dropped = {out for i in drop for out in graph.node[i].output} - {v for c in calls.values() for v in c.output}
        nodes = [calls.get(i, node) for i, node in enumerate(graph.node) if i not in drop]
        read = {v for n in nodes for v in n.input} | {o.name for o in graph.output}
        nodes = [n for n in nodes if not (n.op_type == "Constant" and not n.domain and not set(n.output) & read)]
        value_info = [vi for vi in graph.value_info if vi.name not in dropped]
        del graph.node[:], graph.value_info[:]
        graph.node.extend(nodes)
        graph.value_info.extend(value_info)
        self.declare_parameters(functions)
        _shortcut_views(graph, self.types())
        used = {v for n in graph.node for v in n.input}
        initializers = [i for i in graph.initializer if i.name in used]  # lifted constants moved into bodies
        del graph.initializer[:]
        graph.initializer.extend(initializers)
        _check_defined(graph)
        opsets = [o for o in self.model.opset_import if o.domain != _MARK_DOMAIN]
        del self.model.opset_import[:]
        self.model.opset_import.extend([*opsets, helper.make_opsetid(LAYER_DOMAIN, LAYER_VERSION)])
        self.model.functions.extend(proto for proto, _ in protos.values())
        return {"calls": sum(len(paths) for _, paths in protos.values()),
                "functions": {name: paths for name, (_, paths) in protos.items()}}

    def function_name(self, rep: Site, suffix: str = "") -> str:
        """The layer's class name (`LlamaDecoderLayer`), numbered for a second distinct layer of
        the same class (`LlamaDecoderLayer_1`), plus `suffix`."""
        stem = type(self.tracer.layers[rep.layer]).__name__
        reps = [s for s in self.tracer.sites if s.rep == s.site and type(self.tracer.layers[s.layer]).__name__ == stem]
        k = next(k for k, s in enumerate(reps) if s.site == rep.site)
        return f"{stem}{f'_{k}' if k else ''}{suffix}"

    def body_readers(self, reps: list[Site]) -> dict[int, frozenset[int]]:
        """Per representative, the nodes outside its body that may read its values (none here)."""
        return {}

    def more_calls(self, functions: Mapping[int, _Function], drop: set[int],
                   calls: dict[int, onnx.NodeProto]) -> dict[str, tuple[onnx.FunctionProto, list[str]]]:
        """Further functions and calls (a training step's backward: refine.exporters.capture.train_layers),
        recorded in `drop` and `calls`; name -> (function, module paths of its calls)."""
        return {}

    def declare_parameters(self, functions: Mapping[int, _Function]) -> None:
        """Every parameter a call passes becomes a main-graph initializer (or, without data, a
        typed graph input) named by its FQN, read from the layer module itself."""
        graph = self.graph
        have = {i.name for i in graph.initializer} | {i.name for i in graph.input}
        for site in self.tracer.sites:
            tensors = dict(self.tracer.parameters(site.layer))
            for rel in functions[site.rep].params:
                name = self.params_of[site.layer][rel]
                if name in have:
                    continue
                have.add(name)
                local = _local(tensors[rel])
                if local.device.type == "meta":
                    graph.input.append(helper.make_tensor_value_info(name, _onnx_dtype(local.dtype), list(local.shape)))
                else:
                    graph.initializer.append(numpy_helper.from_array(local.detach().contiguous().numpy(), name))


_EXPORTER_DIR = os.path.dirname(os.path.abspath(__file__))
# the frames of the layer interception itself, cut off a call's stack trace (model code, such
# as the zoo's own GPT-2 in exporters/zoo/models.py, stays)
_MARKER_FILES = frozenset(os.path.join(_EXPORTER_DIR, f) for f in ("layers.py", "train_layers.py"))
_FRAME_START = re.compile(r'^\s*File "([^"]+)", line \d+', re.MULTILINE)


def copy_call_metadata(node: onnx.NodeProto, like: onnx.NodeProto, path: str) -> None:
    """Give a layer call the metadata of the marker it replaces (`like`), pointed at the layer:
    its module path as the innermost name scope, and the stack trace up to the line that calls
    the layer (the marker's own frames, in this package, cut off)."""
    meta = {p.key: p.value for p in like.metadata_props}
    if "pkg.torch.onnx.class_hierarchy" in meta:
        node.metadata_props.add(key="pkg.torch.onnx.class_hierarchy", value=meta["pkg.torch.onnx.class_hierarchy"])
    try:
        scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
    except (ValueError, SyntaxError):
        scopes = []
    outer = list(scopes[:-1]) if isinstance(scopes, list) else []
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=repr([*outer, path, "call"]))
    trace = meta.get("pkg.torch.onnx.stack_trace", "")
    starts = list(_FRAME_START.finditer(trace))
    while starts and os.path.abspath(starts[-1].group(1)) in _MARKER_FILES:
        trace = trace[: starts.pop().start()].rstrip("\n ")
    if trace:
        node.metadata_props.add(key="pkg.torch.onnx.stack_trace", value=trace)


_VIEWS = frozenset({"Identity", "Reshape"})  # (a Reshape only where its result is shaped as its input)


def _shortcut_views(graph: onnx.GraphProto, types: Mapping[str, onnx.TypeProto]) -> None:
    """Pass weights and activations straight to the layer calls, and layer-call results straight
    out as graph outputs, past the same-shaped views (Identity, a Reshape to the same static
    shape) that DTensor's to_local/from_local leave around them in a training step; then drop the nodes
    nothing reads any more (standard ops only; collectives stay). Why: a weight read by calls
    only is set aside by the verifier (refine/run/memo.py) and a gradient computed by a call is
    checked in its summary, so a deep model's main graph keeps a few values per layer instead
    of a view chain per weight. Only exact identities are skipped, so the values are the same."""
    def same_view(node: onnx.NodeProto) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type not in _VIEWS or not node.input:
            return False
        a, b = types.get(node.input[0]), types.get(node.output[0])
        if a is None or b is None or not a.HasField("tensor_type") or not b.HasField("tensor_type"):
            return False
        ta, tb = a.tensor_type, b.tensor_type
        dims = [[d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] for t in (ta, tb)]
        static = ta.HasField("shape") and tb.HasField("shape") and None not in dims[0]
        return ta.elem_type == tb.elem_type and static and dims[0] == dims[1]

    producer = {out: node for node in graph.node for out in node.output}
    before = set(producer)
    outputs = {o.name for o in graph.output}
    for call in (n for n in graph.node if n.domain == LAYER_DOMAIN):
        for k, value in enumerate(call.input):
            while value in producer and same_view(producer[value]):
                value = producer[value].input[0]
            call.input[k] = value
    readers = Counter(v for node in graph.node for v in node.input)
    for out in outputs:
        value, chain = out, []
        while value in producer and same_view(producer[value]):
            chain.append(producer[value])
            value = chain[-1].input[0]
            if readers[value] != 1 or value in outputs:
                break
        node = producer.get(value)
        if chain and node is not None and node.domain == LAYER_DOMAIN and readers[value] == 1 and value not in outputs:
            node.output[list(node.output).index(value)] = out  # the chain's nodes are now unread
            for step in chain:
                del step.output[:]
    read = Counter(v for node in graph.node for v in node.input) + Counter(outputs)
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        pure = node.domain in ("", "ai.onnx")
        if pure and not any(read[o] for o in node.output if o):
            read.subtract(v for v in node.input)
            continue
        kept.append(node)
    kept.reverse()
    gone = before - {v for node in kept for v in node.output}
    value_info = [vi for vi in graph.value_info if vi.name not in gone and vi.name not in outputs]
    del graph.node[:], graph.value_info[:]
    graph.node.extend(kept)
    graph.value_info.extend(value_info)


def _check_defined(graph: onnx.GraphProto) -> None:
    """Every value a node of the rewritten graph reads is still computed, or an input."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in graph.node:
        missing = [v for v in node.input if v not in defined]
        if missing:
            raise ExportError(f"outlining the layers left {node.name or node.op_type!r} reading {missing[0]!r}, "
                              "which no node computes any more (export with --flat)")
        defined.update(node.output)


def outline(model: onnx.ModelProto, tracer: Tracer) -> dict[str, Any]:
    """Rewrite a program captured under `tracer` in place: each representative's marked body
    becomes a local function, every layer call (representative or stub) a call of it.

    Returns {calls, functions: name -> module paths} for the manifest. Raises ExportError if a
    body reads a value the layer was not given, or leaks one it did not return."""
    return _Outliner(model, tracer).rewrite()


def _renamed(node: onnx.NodeProto, rename: Mapping[str, str]) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    for i, v in enumerate(copy.input):
        copy.input[i] = rename.get(v, v)
    return copy


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


_ONNX_DTYPES = {
    torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float64: onnx.TensorProto.DOUBLE,
    torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32, torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8, torch.bool: onnx.TensorProto.BOOL,
}


def _onnx_dtype(dtype: torch.dtype) -> int:
    if dtype not in _ONNX_DTYPES:
        raise ExportError(f"a layer parameter has dtype {dtype}, which the exporter cannot declare")
    return _ONNX_DTYPES[dtype]
