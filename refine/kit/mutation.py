"""Mutation testing of refine itself: one small change to a model directory, judged twice.

Why: refine is only useful if `verified` can be trusted, and the places where it could be
wrong (a lemma that fires too eagerly, a shape annotation taken on trust, a reconstruction
that ignores a rank) are hard to imagine one by one. So we make random one-change mutants of
correct model directories (a Reshape target permuted, operands swapped, a collective's
reduce_op changed, ...) and ask two independent questions of each:

- the **judge** (the oracle): run the programs (refine.diagnose.simulate) on two seeds and compare the
  ranks' outputs with the sequential ones by the output rule of docs/model-dir.md, written
  here again on purpose, small and strict, without refine's own counterexample code:
  `equivalent`, `differs` or `cannot_run`;
- the **verdict**: `refine.pipeline.verify_dir` says `verified`, `refuted` or `unproven`, or
  raises (`bad_input` for an InputError, `crash` for anything else).

A **hole** is `verified` on a mutant that differs or cannot run, or any crash. `unproven`
on an equivalent mutant is a missing lemma (a secondary metric); `refuted` on an equivalent
one is a false alarm.

Operators are plain functions over a `ModelEdit` (one ONNX file, copied) or a `ConfigEdit`
(refine.json) listed in OPERATORS; to add one, write the function and add a row. A model
operator may land on seq.onnx, on one rank file, or on every rank file alike (the SPMD
change: the same node, the same change, on each rank).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import itertools
import json
import random
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from math import prod
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import onnx
from onnx import helper, numpy_helper
from pydantic import BaseModel, computed_field

from refine import dist
from refine.lowering import layers
from refine.config import (
    CONFIG_NAME,
    SEQ_NAME,
    Layout,
    ModelConfig,
    PartialLayout,
    RepLayout,
    ShardLayout,
    load_config,
    rank_file_name,
    shard_indices,
)
from refine.errors import InputError
from refine.lowering.load import load_model_file
from refine.lowering.row_copies import RankPrograms, write_copies_out
from refine.pipeline import verify_dir
from refine.precision import FLOAT32_TOLERANCE, tolerance
from refine.diagnose.simulate import SimResult, cut_two_dim, simulate_dir

Judgement = Literal["equivalent", "differs", "cannot_run"]
Verdict = Literal["verified", "refuted", "unproven", "bad_input", "crash", "timeout"]
JUDGEMENTS: tuple[str, ...] = get_args(Judgement)
VERDICTS: tuple[str, ...] = get_args(Verdict)

JUDGE_SEEDS = (0, 1)
RELATIVE_TOLERANCE = FLOAT32_TOLERANCE  # max|a-b| <= 1e-4 * max(1, max|expected|) (16-bit floats: refine/precision.py)
EVERY_RANK = "rank*.onnx"  # target: the same change on every rank file
MAIN = ""  # scope name of the main graph (a function's scope is its name)
ONNX_DOMAINS = ("", "ai.onnx")
SMALL_CONSTANT = 64  # elements: larger initializers are weights, not constants to mutate
TINY_FLOAT = 1e-3  # scaling an epsilon this small changes the numbers by less than the judge sees

ValueType = tuple[tuple[int, ...], str]  # (shape, numpy dtype name), from a run of the subject
ScopeTypes = dict[str, dict[str, ValueType]]  # scope -> value name -> type
ScopeInts = dict[str, dict[str, tuple[int, ...]]]  # scope -> value name -> a short 1-d integer value
SHORT_INTS = 8  # elements: integer vectors this short are remembered from the run (shapes, bounds)


# ---------------------------------------------------------------------------------------------
# Subjects


@dataclass
class Subject:
    """A correct model directory to mutate, loaded once per process, with the type of every
    value (main graph and function bodies) as one run of it shows them: operators need shapes
    to stay well-typed, and a run is ground truth where annotations may be stale."""

    path: Path
    config: dict[str, Any]  # refine.json as written
    models: dict[str, onnx.ModelProto]  # file name -> model (functions kept)
    types: dict[str, ScopeTypes]  # file name -> scope -> value -> type
    ints: dict[str, ScopeInts]  # file name -> scope -> value -> its value, for short integer vectors

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def world_size(self) -> int:
        return int(self.config["world_size"])

    @property
    def rank_files(self) -> list[str]:
        return [rank_file_name(r) for r in range(self.world_size)]

    @property
    def declared(self) -> frozenset[str]:
        """Initializers refine.json declares are inputs: their stored values are never read."""
        return frozenset(self.config.get("inputs", {}))


def load_subject(path: Path) -> Subject:
    """Read a model directory and learn its value types by running it once (seed 0). A directory
    whose refine.json declares row copies is mutated as its copy with every rank's file written
    (a change to one rank's file must not reach the ranks that copy it)."""
    if load_config(path).row_copies is not None:  # (validated like refine does: bad subjects fail here)
        path = _copies_written_out(path)
    config = json.loads((path / CONFIG_NAME).read_text())
    files = [SEQ_NAME] + [rank_file_name(r) for r in range(int(config["world_size"]))]
    models = {f: load_model_file(path / f) for f in files}
    run = simulate_dir(path, 0)
    seen = {f: _scope_values(models[f], path / f, v) for f, v in zip(files, [run.seq, *run.ranks])}
    types = {f: {scope: {n: k[0] for n, k in known.items()} for scope, known in scopes.items()}
             for f, scopes in seen.items()}
    ints = {f: {scope: {n: k[1] for n, k in known.items() if k[1] is not None} for scope, known in scopes.items()}
            for f, scopes in seen.items()}
    return Subject(path, config, models, types, ints)


Known = tuple[ValueType, tuple[int, ...] | None]  # a value's type, and the value if a short integer vector


def _known(value: np.ndarray) -> Known:
    value = np.asarray(value)
    short = value.ndim == 1 and value.size <= SHORT_INTS and value.dtype.kind in "iu"
    return (tuple(int(d) for d in value.shape), str(value.dtype)), tuple(int(v) for v in value) if short else None


def _scope_values(model: onnx.ModelProto, path: Path, values: dict[str, np.ndarray]) -> dict[str, dict[str, Known]]:
    """What a run shows of the main graph's values, and of each function's values where every
    call agrees (the simulator names a call's body values `CALL/NAME`, refine.lowering.layers' renaming)."""
    graph = model.graph
    main_names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    main_names |= {v for n in graph.node for v in [*n.input, *n.output] if v}
    scopes: dict[str, dict[str, Known]] = {MAIN: {n: _known(values[n]) for n in main_names
                                                  if n in values and not isinstance(values[n], list)}}
    seen: dict[str, dict[str, Known | None]] = defaultdict(dict)
    for call in layers.layer_calls(model, path):
        fn = call.function
        actual = dict(zip(fn.input, call.node.input)) | dict(zip(fn.output, call.node.output))
        for name in {v for n in fn.node for v in [*n.input, *n.output] if v}:
            value = values.get(actual.get(name, f"{call.label}/{name}"))
            found = _known(value) if value is not None and not isinstance(value, list) else None  # (a list: a sequence)
            known = seen[fn.name]
            known[name] = found if known.get(name, found) == found else None
    for fn_name, known in seen.items():
        scopes[fn_name] = {n: k for n, k in known.items() if k is not None}
    return scopes


# ---------------------------------------------------------------------------------------------
# Editing one ONNX file


Scope = onnx.GraphProto | onnx.FunctionProto


@dataclass
class Site:
    """One node of the main graph or of a function body (a change there affects every call)."""

    scope: Scope
    scope_name: str
    index: int

    @property
    def node(self) -> onnx.NodeProto:
        return self.scope.node[self.index]

    def __str__(self) -> str:
        node = self.node
        where = f"function {self.scope_name}: " if self.scope_name else ""
        return f"{where}node {node.name or node.output[0]!r} ({node.op_type})"


@dataclass
class ModelEdit:
    """A copy of one model being mutated, and what operators need to keep it well-typed.

    Structural edits (`insert`, `add_constant`) rebuild a node list, so operators make them
    last, after every in-place change of the chosen node."""

    model: onnx.ModelProto
    types: ScopeTypes
    ints: ScopeInts
    declared: frozenset[str]
    rng: random.Random
    _names: set[str] | None = None
    _constants: dict[str, dict[str, onnx.TensorProto | onnx.NodeProto]] = field(default_factory=dict)

    def scopes(self) -> list[tuple[str, Scope]]:
        return [(MAIN, self.model.graph)] + [(fn.name, fn) for fn in self.model.functions]

    def sites(self) -> Iterator[Site]:
        for name, scope in self.scopes():
            for i in range(len(scope.node)):
                yield Site(scope, name, i)

    def pick(self, accept: Callable[[Site], bool]) -> Site | None:
        """A random site among those `accept`ed, or None."""
        found = [s for s in self.sites() if accept(s)]
        return self.rng.choice(found) if found else None

    def type_of(self, site: Site, value: str) -> ValueType | None:
        return self.types.get(site.scope_name, {}).get(value)

    def constant(self, site: Site, value: str) -> np.ndarray | None:
        """The value of a small constant visible at the site: an undeclared initializer (main
        graph) or a Constant node's output in the same scope."""
        if site.scope_name not in self._constants:  # indexed once: edits come after all look-ups
            found: dict[str, onnx.TensorProto | onnx.NodeProto] = {
                n.output[0]: n for n in site.scope.node if _is_onnx(n, "Constant") and n.output}
            if site.scope_name == MAIN:
                found |= {i.name: i for i in self.model.graph.initializer if i.name not in self.declared}
            self._constants[site.scope_name] = found
        source = self._constants[site.scope_name].get(value)
        if isinstance(source, onnx.TensorProto):
            return numpy_helper.to_array(source) if prod(source.dims) <= SMALL_CONSTANT else None
        return _constant_node_value(source) if source is not None else None

    def rewrite_constant(self, site: Site, value: str, new: np.ndarray) -> bool:
        """Give the constant `value` (every reader of it) a new value, in place; False if it is
        no constant (a computed value)."""
        self.constant(site, value)  # indexes the scope's constants
        source = self._constants[site.scope_name].get(value)
        if isinstance(source, onnx.TensorProto):
            source.CopyFrom(numpy_helper.from_array(new.astype(numpy_helper.to_array(source).dtype), value))
        elif source is not None:
            del source.attribute[:]
            source.attribute.append(helper.make_attribute("value", numpy_helper.from_array(new, value)))
        return source is not None

    def readers(self, site: Site, value: str) -> int:
        return sum(value in n.input for n in site.scope.node)

    def static_ints(self, site: Site, value: str) -> np.ndarray | None:
        """A short integer vector's value: a constant's, or else the (input-independent) one a
        run computed, as for a Reshape target built from Shape and Concat nodes."""
        found = self.constant(site, value)
        if found is None and value in self.ints.get(site.scope_name, {}):
            found = np.asarray(self.ints[site.scope_name][value], dtype=np.int64)
        return found if found is not None and found.dtype.kind in "iu" else None

    def defined_before(self, site: Site) -> list[str]:
        """Values a node at the site may read without making a cycle."""
        scope = site.scope
        if site.scope_name == MAIN:
            names = [i.name for i in scope.input] + [i.name for i in scope.initializer]
        else:
            names = list(scope.input)
        for node in scope.node[: site.index]:
            names.extend(v for v in node.output if v)
        return list(dict.fromkeys(names))

    def fresh(self, hint: str) -> str:
        """A value name used nowhere in the model."""
        if self._names is None:
            self._names = {v for _, s in self.scopes() for n in s.node for v in [*n.input, *n.output, n.name]}
            self._names |= {i.name for i in self.model.graph.input} | {i.name for i in self.model.graph.initializer}
        for k in itertools.count():
            name = f"{hint}__mut{k}"
            if name not in self._names:
                self._names.add(name)
                return name
        raise AssertionError("unreachable")

    def insert(self, site: Site, nodes: list[onnx.NodeProto], constants: dict[str, np.ndarray] | None = None,
               after: bool = True) -> None:
        """Insert nodes next to the site, with the constants they read (initializers in the
        main graph, Constant nodes in a function body, which cannot see initializers)."""
        constants = constants or {}
        if site.scope_name == MAIN:
            self.model.graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in constants.items())
        else:
            nodes = [helper.make_node("Constant", [], [n], name=n, value=numpy_helper.from_array(v, n))
                     for n, v in constants.items()] + nodes
        position = site.index + 1 if after else site.index
        old = list(site.scope.node)
        rebuilt = [_copy_node(n) for n in old[:position]] + nodes + [_copy_node(n) for n in old[position:]]
        del site.scope.node[:]
        site.scope.node.extend(rebuilt)

    def add_constant(self, site: Site, name: str, value: np.ndarray) -> None:
        self.insert(site, [], {name: value}, after=False)

    def annotate_main_values(self) -> None:
        """Declare the (unmutated) type of every main-graph value that has none, as an exporter
        would: after a mutation, these annotations are stale."""
        graph = self.model.graph
        have = {v.name for v in [*graph.value_info, *graph.input, *graph.output]} | {i.name for i in graph.initializer}
        for name, (shape, dtype) in sorted(self.types.get(MAIN, {}).items()):
            if name not in have:
                graph.value_info.append(helper.make_tensor_value_info(
                    name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape)))

    def strip_annotations(self) -> None:
        """Remove every declared shape: value_info (graph and functions) and output sizes."""
        del self.model.graph.value_info[:]
        for fn in self.model.functions:
            del fn.value_info[:]
        for out in self.model.graph.output:  # the checker wants a shape: its rank stays, sizes go
            for dim in out.type.tensor_type.shape.dim:
                dim.ClearField("dim_value")
                dim.ClearField("dim_param")


def _copy_node(node: onnx.NodeProto) -> onnx.NodeProto:
    fresh = onnx.NodeProto()
    fresh.CopyFrom(node)
    return fresh


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for att in node.attribute:
        value = helper.get_attribute_value(att)
        if att.name == "value":
            return numpy_helper.to_array(value) if prod(value.dims) <= SMALL_CONSTANT else None
        if att.name in ("value_float", "value_floats"):
            return np.asarray(value, dtype=np.float32)
        if att.name in ("value_int", "value_ints"):
            return np.asarray(value, dtype=np.int64)
    return None


def _is_onnx(node: onnx.NodeProto, *ops: str) -> bool:
    return node.domain in ONNX_DOMAINS and node.op_type in ops


def _is_collective(node: onnx.NodeProto, *ops: str) -> bool:
    return node.domain == dist.DIST_DOMAIN and node.op_type in (ops or dist.KNOWN_OPS)


def _set_attr(node: onnx.NodeProto, name: str, value: Any) -> None:
    keep = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(keep + [helper.make_attribute(name, value)])


def _int_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return int(dist.node_attrs(node).get(name, default))


def _replace_by_identity(node: onnx.NodeProto, source: str) -> None:
    node.op_type, node.domain = "Identity", ""
    del node.input[:], node.attribute[:]
    node.input.append(source)


def _rank_of(edit: ModelEdit, site: Site, value: str) -> int | None:
    found = edit.type_of(site, value)
    return len(found[0]) if found else None


def _other(rng: random.Random, options: list[Any], current: Any) -> Any | None:
    """A random option other than `current`, or None."""
    rest = [o for o in options if o != current]
    return rng.choice(rest) if rest else None


# ---------------------------------------------------------------------------------------------
# Model operators: each changes one site of `edit.model` and says what it did, or returns None


def _reshape_resolved(target: list[int], shape: tuple[int, ...], allowzero: int) -> tuple[int, ...] | None:
    """The output shape of Reshape(data of `shape`, target), or None if the target is invalid."""
    if not allowzero and any(v == 0 and i >= len(shape) for i, v in enumerate(target)):
        return None
    dims = [shape[i] if v == 0 and not allowzero else v for i, v in enumerate(target)]
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        return None
    numel = prod(shape)
    if -1 in dims:
        known = prod(d for d in dims if d != -1)
        if known == 0 or numel % known:
            return None
        dims[dims.index(-1)] = numel // known
    return tuple(dims) if prod(dims) == numel else None


def _reshape_targets(edit: ModelEdit, site: Site) -> tuple[list[int], list[list[int]]] | None:
    """The Reshape's literal target, and the targets that give a different valid shape:
    permutations of the literal and of the resolved shape, and merges of adjacent dims."""
    node = site.node
    if not _is_onnx(node, "Reshape") or len(node.input) < 2:
        return None
    target, data = edit.static_ints(site, node.input[1]), edit.type_of(site, node.input[0])
    if target is None or data is None or target.ndim != 1 or not 2 <= target.size <= 6:
        return None
    allowzero = _int_attr(node, "allowzero", 0)
    literal = [int(v) for v in target]
    current = _reshape_resolved(literal, data[0], allowzero)
    if current is None:
        return None
    candidates = set(itertools.permutations(literal)) | set(itertools.permutations(current))
    candidates |= {current[:i] + (current[i] * current[i + 1],) + current[i + 2:] for i in range(len(current) - 1)}
    options = sorted(list(c) for c in candidates
                     if list(c) != literal and _reshape_resolved(list(c), data[0], allowzero) not in (None, current))
    return (literal, options) if options else None


def change_reshape_target(edit: ModelEdit, annotations: Literal["stale", "none"]) -> str | None:
    """a. A Reshape to another shape of the same size. A constant target is rewritten in place,
    so every Reshape reading it changes alike (q, k and v to another head split); a computed
    one is replaced by a constant for this Reshape. `stale`: every value keeps (or gets) the
    shape annotation of the unmutated model; `none`: no shape annotation is left."""
    site = edit.pick(lambda s: _reshape_targets(edit, s) is not None)
    if site is None:
        return None
    found = _reshape_targets(edit, site)
    assert found is not None
    literal, options = found
    new = edit.rng.choice(options)
    if annotations == "stale":
        edit.annotate_main_values()
    else:
        edit.strip_annotations()
    target = site.node.input[1]
    what = f"{site}: target {literal} -> {new}"
    if edit.rewrite_constant(site, target, np.asarray(new, dtype=np.int64)):
        readers = edit.readers(site, target)
        what += f" (constant {target!r}" + (f", read by {readers} nodes)" if readers > 1 else ")")
    else:  # a computed target: this Reshape reads a new constant instead
        name = edit.fresh("shape")
        site.node.input[1] = name
        edit.add_constant(site, name, np.asarray(new, dtype=np.int64))
    return what + ("; stale shape annotations kept" if annotations == "stale" else "; shape annotations removed")


def _swap_first_operands(edit: ModelEdit, ops: tuple[str, ...]) -> str | None:
    site = edit.pick(lambda s: _is_onnx(s.node, *ops) and len(s.node.input) >= 2 and s.node.input[0] != s.node.input[1])
    if site is None:
        return None
    node = site.node
    a, b = node.input[0], node.input[1]
    node.input[0], node.input[1] = b, a
    return f"{site}: operands swapped ({a!r}, {b!r})"


NON_COMMUTATIVE = ("Sub", "Div", "MatMul", "Pow")
COMMUTATIVE = ("Add", "Mul", "Max", "Min")


def swap_operands(edit: ModelEdit) -> str | None:
    """b. x - y -> y - x (and Div, MatMul, Pow): usually a different value."""
    return _swap_first_operands(edit, NON_COMMUTATIVE)


def commute_operands(edit: ModelEdit) -> str | None:
    """i. x + y -> y + x (and Mul, Max, Min): the same value, a lemma must see it."""
    return _swap_first_operands(edit, COMMUTATIVE)


def _bypass_sources(edit: ModelEdit, site: Site) -> list[str]:
    node = site.node
    if len(node.output) != 1 or not node.output[0] or _is_onnx(node, "Identity", "Constant"):
        return []
    out = edit.type_of(site, node.output[0])
    return sorted({v for v in node.input if v and out is not None and edit.type_of(site, v) == out})


def bypass_node(edit: ModelEdit) -> str | None:
    """c. A node's output replaced by one of its inputs of the same shape and dtype."""
    site = edit.pick(lambda s: bool(_bypass_sources(edit, s)))
    if site is None:
        return None
    source = edit.rng.choice(_bypass_sources(edit, site))
    what = f"{site}: bypassed (output := input {source!r})"
    _replace_by_identity(site.node, source)
    return what


def drop_collective(edit: ModelEdit) -> str | None:
    """d. A collective replaced by Identity (a missing all-reduce, all-gather, ...)."""
    site = edit.pick(lambda s: _is_collective(s.node) and bool(s.node.input))
    if site is None:
        return None
    what = f"{site}: dropped (Identity)"
    _replace_by_identity(site.node, site.node.input[0])
    return what


def collective_reduce_op(edit: ModelEdit) -> str | None:
    """d. An all-reduce or reduce-scatter with another reduce_op (sum -> avg, max, ...)."""
    site = edit.pick(lambda s: _is_collective(s.node, "AllReduce", "ReduceScatter"))
    if site is None:
        return None
    current = dist.node_attrs(site.node)["reduce_op"]
    new = _other(edit.rng, ["sum", "avg", "max", "min"], current)
    _set_attr(site.node, "reduce_op", new)
    return f"{site}: reduce_op {current} -> {new}"


def _collective_kinds(edit: ModelEdit, site: Site) -> list[tuple[str, onnx.NodeProto]]:
    """Other collectives the site could be, where the input's shape allows them."""
    node = site.node
    if not _is_collective(node, "AllReduce", "AllGather", "ReduceScatter") or not node.input:
        return []
    found = edit.type_of(site, node.input[0])
    if found is None:
        return []
    shape, attrs = found[0], dist.node_attrs(node)
    group, reduce_op = attrs["group"], attrs.get("reduce_op", "sum")
    x, y, name = node.input[0], node.output[0], node.name
    options = []
    if node.op_type != "AllReduce":
        options.append(("AllReduce", dist.all_reduce(x, y, group, reduce_op, name)))
    for axis in range(len(shape)):
        if node.op_type != "AllGather":
            options.append((f"AllGather(axis={axis})", dist.all_gather(x, y, group, axis, name)))
        if node.op_type != "ReduceScatter" and shape[axis] % len(group) == 0:
            options.append((f"ReduceScatter(axis={axis})", dist.reduce_scatter(x, y, group, axis, reduce_op, name)))
    return options


def collective_kind(edit: ModelEdit) -> str | None:
    """d. AllReduce <-> AllGather / ReduceScatter, where the shapes allow."""
    site = edit.pick(lambda s: bool(_collective_kinds(edit, s)))
    if site is None:
        return None
    label, new = edit.rng.choice(_collective_kinds(edit, site))
    what = f"{site}: now {label}"
    site.node.CopyFrom(new)
    return what


def _collective_axes(edit: ModelEdit, site: Site) -> list[tuple[str, int]]:
    """(attribute, new value) pairs for an AllGather / ReduceScatter / AllToAll axis."""
    node = site.node
    if not _is_collective(node, "AllGather", "ReduceScatter", "AllToAll") or not node.input:
        return []
    found = edit.type_of(site, node.input[0])
    if found is None:
        return []
    shape, attrs = found[0], dist.node_attrs(node)
    n = len(attrs["group"])
    names = ("split_axis", "concat_axis") if node.op_type == "AllToAll" else ("axis",)
    options = []
    for name in names:
        current = dist.normalize_axis(int(attrs[name]), len(shape)) if -len(shape) <= int(attrs[name]) < len(shape) else None
        for axis in range(len(shape)):
            divisible = shape[axis] % n == 0 or node.op_type == "AllGather" or name == "concat_axis"
            if axis != current and divisible:
                options.append((name, axis))
    return options


def collective_axis(edit: ModelEdit) -> str | None:
    """d. A collective gathering, scattering or splitting along another axis."""
    site = edit.pick(lambda s: bool(_collective_axes(edit, s)))
    if site is None:
        return None
    name, axis = edit.rng.choice(_collective_axes(edit, site))
    current = dist.node_attrs(site.node)[name]
    _set_attr(site.node, name, axis)
    return f"{site}: {name} {current} -> {axis}"


def collective_group(edit: ModelEdit) -> str | None:
    """d. The same members in another order (which member's chunk comes first)."""
    site = edit.pick(lambda s: _is_collective(s.node) and len(dist.node_attrs(s.node).get("group", [])) >= 2)
    if site is None:
        return None
    group = dist.node_attrs(site.node)["group"]
    orders = [list(p) for p in itertools.islice(itertools.permutations(group), 24)] + [group[::-1]]
    new = _other(edit.rng, orders, group)
    _set_attr(site.node, "group", new)
    return f"{site}: group {group} -> {new}"


def _other_groups(edit: ModelEdit, site: Site) -> list[list[int]]:
    """Groups of as many ranks that other calls of the model (any scope) use, other than the
    site's own members: the process group of another mesh dimension (BUGS.md class 11)."""
    node = site.node
    if not _is_collective(node) or "group" not in dist.node_attrs(node):
        return []
    group = list(dist.node_attrs(node)["group"])
    found = {tuple(dist.node_attrs(s.node)["group"]) for s in edit.sites()
             if _is_collective(s.node) and "group" in dist.node_attrs(s.node)}
    return [list(g) for g in sorted(found) if len(g) == len(group) and set(g) != set(group)]


def collective_other_group(edit: ModelEdit) -> str | None:
    """d. A collective over another group of as many ranks that the program also uses (the TP
    group where the DP or CP group belongs)."""
    site = edit.pick(lambda s: bool(_other_groups(edit, s)))
    if site is None:
        return None
    group = dist.node_attrs(site.node)["group"]
    new = edit.rng.choice(_other_groups(edit, site))
    _set_attr(site.node, "group", new)
    return f"{site}: group {group} -> {new}"


def _calls_to_cross(site: Site) -> list[int]:
    """Indices of the other calls of the site's scope that the site's call could be moved past,
    in its scope's order, without reading a value before it is made or making one after it is read."""
    nodes, i = site.scope.node, site.index
    if not _is_collective(nodes[i]):
        return []
    made_at = {out: k for k, n in enumerate(nodes) for out in n.output if out}
    earliest = max((made_at[x] for x in nodes[i].input if x in made_at), default=-1) + 1
    outputs = {o for o in nodes[i].output if o}
    latest = min((k for k, n in enumerate(nodes) if k != i and outputs & set(n.input)), default=len(nodes)) - 1
    return [k for k, n in enumerate(nodes) if k != i and earliest <= k <= latest and _is_collective(n)]


def reorder_call(edit: ModelEdit) -> str | None:
    """d. A collective or point-to-point call moved past another call of its graph or layer
    function (a receive after a send, two groups taken in another order): on one rank, calls
    that wait for each other; on every rank, other values exchanged."""
    site = edit.pick(lambda s: bool(_calls_to_cross(s)))
    if site is None:
        return None
    k = edit.rng.choice(_calls_to_cross(site))
    other = site.scope.node[k]
    what = f"{site}: moved {'before' if k < site.index else 'after'} {other.name or other.op_type!r}"
    nodes = [_copy_node(n) for n in site.scope.node]
    nodes.insert(k, nodes.pop(site.index))  # (before call k if it came earlier; after it, k having moved up one, if later)
    del site.scope.node[:]
    site.scope.node.extend(nodes)
    return what


def _swappable_sends(edit: ModelEdit, site: Site) -> list[Site]:
    """Later Sends of the site's scope that send a value of the same type, which the site's
    Send may send instead (both values exist before the site: no cycle)."""
    node = site.node
    if not _is_collective(node, "Send") or not node.input:
        return []
    before = set(edit.defined_before(site))
    kind = edit.type_of(site, node.input[0])
    return [s for s in edit.sites() if s.scope is site.scope and s.index > site.index and _is_collective(s.node, "Send")
            and s.node.input and s.node.input[0] in before and s.node.input[0] != node.input[0]
            and kind is not None and edit.type_of(s, s.node.input[0]) == kind]


def point_to_point(edit: ModelEdit) -> str | None:
    """d. A Send or Recv on another tag or with another peer (one this program talks to), or two
    Sends that swap what they send (a stage sending the wrong micro-batch)."""
    site = edit.pick(lambda s: _is_collective(s.node, "Send", "Recv"))
    if site is None:
        return None
    node, attrs = site.node, dist.node_attrs(site.node)
    peers = sorted({int(dist.node_attrs(s.node)["peer"]) for s in edit.sites() if _is_collective(s.node, "Send", "Recv")}
                   - {int(attrs["peer"])})
    sends = _swappable_sends(edit, site)
    change = edit.rng.choice(["tag"] + ["peer"] * bool(peers) + ["swap"] * bool(sends))
    if change == "swap":
        other = edit.rng.choice(sends)
        node.input[0], other.node.input[0] = other.node.input[0], node.input[0]
        return f"{site}: sends {node.input[0]!r}, and {other} sends {other.node.input[0]!r} (swapped)"
    new = int(attrs[change]) + 1 if change == "tag" else edit.rng.choice(peers)
    _set_attr(node, change, new)
    return f"{site}: {change} {attrs[change]} -> {new}"


# e. axis-like attributes, one small function per op: the changes that keep the node valid


AxisChange = tuple[str, Callable[[ModelEdit, Site], None]]  # (what, apply)


def _axis_attr_changes(edit: ModelEdit, site: Site, name: str, rank: int | None,
                       valid: Callable[[int], bool] = lambda _: True) -> list[AxisChange]:
    if rank is None or rank < 2:
        return []
    node = site.node
    current = dist.normalize_axis(_int_attr(node, name, -1 if node.op_type == "Softmax" else 0), rank)

    def setter(axis: int) -> Callable[[ModelEdit, Site], None]:
        return lambda _e, s: _set_attr(s.node, name, axis)

    return [(f"{name} {current} -> {axis}", setter(axis)) for axis in range(rank) if axis != current and valid(axis)]


def _concat_axes(edit: ModelEdit, site: Site) -> list[AxisChange]:
    shapes = [edit.type_of(site, v) for v in site.node.input]
    if not shapes or any(s is None for s in shapes):
        return []
    dims = [s[0] for s in shapes if s is not None]

    def valid(axis: int) -> bool:
        return all(len(d) == len(dims[0]) and all(a == b for i, (a, b) in enumerate(zip(d, dims[0])) if i != axis)
                   for d in dims)

    return _axis_attr_changes(edit, site, "axis", len(dims[0]), valid)


def _gather_axes(edit: ModelEdit, site: Site) -> list[AxisChange]:
    data = edit.type_of(site, site.node.input[0])
    indices = edit.constant(site, site.node.input[1]) if len(site.node.input) > 1 else None
    if data is None:
        return []
    top = int(np.max(np.abs(indices))) if indices is not None and indices.size else 0
    return _axis_attr_changes(edit, site, "axis", len(data[0]), lambda a: data[0][a] > top)


def _split_axes(edit: ModelEdit, site: Site) -> list[AxisChange]:
    data = edit.type_of(site, site.node.input[0])
    if data is None:
        return []
    sizes = [edit.type_of(site, v) for v in site.node.output]
    current = dist.normalize_axis(_int_attr(site.node, "axis", 0), len(data[0])) if data[0] else 0
    parts = [s[0][current] for s in sizes if s is not None]
    return _axis_attr_changes(edit, site, "axis", len(data[0]), lambda a: len(parts) == len(sizes) and sum(parts) == data[0][a])


def _transpose_perms(edit: ModelEdit, site: Site) -> list[AxisChange]:
    rank = _rank_of(edit, site, site.node.input[0])
    if rank is None or not 2 <= rank <= 5:
        return []
    current = dist.node_attrs(site.node).get("perm", list(range(rank))[::-1])

    def setter(perm: list[int]) -> Callable[[ModelEdit, Site], None]:
        return lambda _e, s: _set_attr(s.node, "perm", perm)

    return [(f"perm {current} -> {list(p)}", setter(list(p))) for p in itertools.permutations(range(rank))
            if list(p) != list(current)]


def _reduce_axes(edit: ModelEdit, site: Site) -> list[AxisChange]:
    node = site.node
    rank = _rank_of(edit, site, node.input[0])
    if rank is None or rank < 2:
        return []
    from_input = len(node.input) > 1 and node.input[1]
    if from_input:
        found = edit.static_ints(site, node.input[1])
        if found is None:
            return []
        current = sorted(int(a) % rank for a in found.reshape(-1))
    else:
        current = sorted(int(a) % rank for a in dist.node_attrs(node).get("axes", range(rank)))
    options = [list(c) for k in range(1, rank + 1) for c in itertools.combinations(range(rank), k) if list(c) != current]

    def setter(axes: list[int]) -> Callable[[ModelEdit, Site], None]:
        def apply(e: ModelEdit, s: Site) -> None:
            if from_input:
                name = e.fresh("axes")
                s.node.input[1] = name
                e.add_constant(s, name, np.asarray(axes, dtype=np.int64))
            else:
                _set_attr(s.node, "axes", axes)
        return apply

    return [(f"axes {current} -> {axes}", setter(axes)) for axes in options]


REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare")
AXIS_CHANGES: dict[str, Callable[[ModelEdit, Site], list[AxisChange]]] = {
    "Concat": _concat_axes,
    "Softmax": lambda e, s: _axis_attr_changes(e, s, "axis", _rank_of(e, s, s.node.input[0])),
    "LogSoftmax": lambda e, s: _axis_attr_changes(e, s, "axis", _rank_of(e, s, s.node.input[0])),
    "Transpose": _transpose_perms,
    "Gather": _gather_axes,
    "Split": _split_axes,
    **{op: _reduce_axes for op in REDUCE_OPS},
}


def _axis_changes(edit: ModelEdit, site: Site) -> list[AxisChange]:
    node = site.node
    change = AXIS_CHANGES.get(node.op_type) if node.domain in ONNX_DOMAINS and node.input else None
    return change(edit, site) if change else []


def change_axis(edit: ModelEdit) -> str | None:
    """e. An axis-like attribute (Concat/Softmax/Gather/Split axis, Transpose perm, Reduce axes)."""
    site = edit.pick(lambda s: bool(_axis_changes(edit, s)))
    if site is None:
        return None
    what, apply = edit.rng.choice(_axis_changes(edit, site))
    description = f"{site}: {what}"
    apply(edit, site)
    return description


def _scalable_inputs(edit: ModelEdit, site: Site) -> list[tuple[int, np.ndarray]]:
    """Inputs of the site that are small scalar-like constants worth scaling."""
    found = []
    for i, v in enumerate(site.node.input):
        value = edit.constant(site, v)
        if value is not None and value.size == 1 and _worth_scaling(value.reshape(-1)[0]):
            found.append((i, value))
    return found


def _worth_scaling(item: np.generic) -> bool:
    if np.issubdtype(item.dtype, np.floating):
        return abs(float(item)) >= TINY_FLOAT
    return np.issubdtype(item.dtype, np.integer) and 0 <= int(item) <= 4096


def scale_constant(edit: ModelEdit) -> str | None:
    """f. A scalar constant x2 or x0.5 (floats), x2 or +1 (non-negative integers: -1 is a
    marker, in Reshape targets and Slice ends), for one reader."""
    site = edit.pick(lambda s: not _is_onnx(s.node, "Constant") and bool(_scalable_inputs(edit, s)))
    if site is None:
        return None
    index, value = edit.rng.choice(_scalable_inputs(edit, site))
    old = _number(value)
    if np.issubdtype(value.dtype, np.floating):
        factor = edit.rng.choice([2.0, 0.5])
        new_value, what = (value * factor).astype(value.dtype), f"x{factor:g}"
    else:
        zero = not value.reshape(-1)[0]
        new_value, what = ((value + 1) if zero else (value * 2)).astype(value.dtype), "+1" if zero else "x2"
    name = edit.fresh("const")
    description = f"{site}: input {index} constant {old} {what} -> {_number(new_value)}"
    site.node.input[index] = name
    edit.add_constant(site, name, new_value)
    return description


def _number(value: np.ndarray) -> str:
    item = value.reshape(-1)[0].item()
    return f"{item:.6g}" if isinstance(item, float) else str(item)


def _rewirings(edit: ModelEdit, site: Site) -> list[tuple[int, str]]:
    node = site.node
    if _is_onnx(node, "Constant") or not node.input:
        return []
    available = edit.defined_before(site)
    options = []
    for i, v in enumerate(node.input):
        want = edit.type_of(site, v) if v else None
        if want is not None:
            options += [(i, other) for other in available if other != v and edit.type_of(site, other) == want]
    return options


def rewire_input(edit: ModelEdit) -> str | None:
    """g. One input of a node read from another tensor of the same shape and dtype."""
    site = edit.pick(lambda s: bool(_rewirings(edit, s)))
    if site is None:
        return None
    index, other = edit.rng.choice(_rewirings(edit, site))
    description = f"{site}: input {index} {site.node.input[index]!r} -> {other!r}"
    site.node.input[index] = other
    return description


OP_FAMILY_SWAPS = {"Add": "Sub", "Sub": "Add", "Mul": "Div", "Div": "Mul", "Relu": "Sigmoid", "Sigmoid": "Relu",
                   "ReduceSum": "ReduceMean", "ReduceMean": "ReduceSum", "Max": "Min", "Min": "Max"}


def swap_op_family(edit: ModelEdit) -> str | None:
    """h. An op replaced by its sibling (Add<->Sub, Mul<->Div, Relu<->Sigmoid, ...)."""
    site = edit.pick(lambda s: _is_onnx(s.node, *OP_FAMILY_SWAPS))
    if site is None:
        return None
    old = site.node.op_type
    description = f"{site}: op {old} -> {OP_FAMILY_SWAPS[old]}"
    site.node.op_type = OP_FAMILY_SWAPS[old]
    return description


def _single_typed_output(edit: ModelEdit, site: Site) -> ValueType | None:
    node = site.node
    if len(node.output) != 1 or not node.output[0]:
        return None
    return edit.type_of(site, node.output[0])


def _detour(edit: ModelEdit, site: Site, make: Callable[[str, str], tuple[list[onnx.NodeProto], dict[str, np.ndarray]]],
            what: str) -> str:
    """Let the site's node write a fresh value, and `make` the nodes from it back to the old name."""
    out = site.node.output[0]
    fresh = edit.fresh(out.rsplit("/", 1)[-1] or "value")
    site.node.output[0] = fresh
    nodes, constants = make(fresh, out)
    description = f"{site}: output {out!r} passed through {what}"
    edit.insert(site, nodes, constants)
    return description


def insert_identity(edit: ModelEdit) -> str | None:
    """i. An Identity after a node: the same value."""
    site = edit.pick(lambda s: _single_typed_output(edit, s) is not None and not _is_onnx(s.node, "Constant"))
    if site is None:
        return None
    name = edit.fresh("identity")
    return _detour(edit, site, lambda src, dst: ([helper.make_node("Identity", [src], [dst], name=name)], {}), "an Identity")


def _round_trip_shape(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Another shape of the same size to reshape through."""
    if len(shape) >= 2:
        return (prod(shape),)
    if len(shape) == 1 and shape[0] >= 2:
        return (shape[0], 1)
    return None


def reshape_round_trip(edit: ModelEdit) -> str | None:
    """i. Reshape to another shape of the same size and back: the same value."""
    site = edit.pick(lambda s: (t := _single_typed_output(edit, s)) is not None and _round_trip_shape(t[0]) is not None
                     and not _is_onnx(s.node, "Constant"))
    if site is None:
        return None
    shape = _single_typed_output(edit, site)[0]  # type: ignore[index]
    via = _round_trip_shape(shape)
    assert via is not None
    there, back, mid = edit.fresh("round_trip_shape"), edit.fresh("round_trip_back"), edit.fresh("round_trip")

    def make(src: str, dst: str) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
        nodes = [helper.make_node("Reshape", [src, there], [mid], name=mid),
                 helper.make_node("Reshape", [mid, back], [dst], name=f"{mid}_back")]
        return nodes, {there: np.asarray(via, dtype=np.int64), back: np.asarray(shape, dtype=np.int64)}

    return _detour(edit, site, make, f"Reshape to {list(via)} and back to {list(shape)}")


def _slice_changes(edit: ModelEdit, site: Site) -> list[tuple[int, int, int, int]]:
    """(input index 1 or 2, entry, old, new) for a Slice with constant bounds and unit steps."""
    node = site.node
    if not _is_onnx(node, "Slice") or len(node.input) < 3:
        return []
    data = edit.type_of(site, node.input[0])
    starts, ends = (edit.static_ints(site, v) for v in node.input[1:3])
    if data is None or starts is None or ends is None:
        return []
    rank = len(data[0])
    axes = edit.static_ints(site, node.input[3]) if len(node.input) > 3 and node.input[3] else np.arange(len(starts))
    steps = edit.static_ints(site, node.input[4]) if len(node.input) > 4 and node.input[4] else np.ones(len(starts))
    if axes is None or steps is None or np.any(steps != 1):
        return []
    options = []
    for k, axis in enumerate(axes.reshape(-1)):
        dim = data[0][int(axis) % rank]
        lo, hi = (max(0, min(dim, int(v) + dim if v < 0 else int(v))) for v in (starts[k], ends[k]))
        options += [(1, k, int(starts[k]), s) for s in range(hi) if s != lo]
        options += [(2, k, int(ends[k]), e) for e in range(lo + 1, dim + 1) if e != hi]
    return options


def change_slice_bounds(edit: ModelEdit) -> str | None:
    """j. One Slice start or end moved (the slice stays non-empty)."""
    site = edit.pick(lambda s: bool(_slice_changes(edit, s)))
    if site is None:
        return None
    index, entry, old, new = edit.rng.choice(_slice_changes(edit, site))
    bounds = edit.static_ints(site, site.node.input[index])
    assert bounds is not None
    bounds = bounds.copy()
    bounds.reshape(-1)[entry] = new
    name = edit.fresh("starts" if index == 1 else "ends")
    description = f"{site}: {'start' if index == 1 else 'end'} {entry}: {old} -> {new}"
    site.node.input[index] = name
    edit.add_constant(site, name, bounds)
    return description


def _other_chunks(edit: ModelEdit, site: Site) -> list[int]:
    """The other positions a `SequenceAt(SplitToSequence(x, sizes), k)` with stated sizes and
    `k` could take whose chunk has the same size as chunk `k` (the mutant stays well-typed)."""
    node = site.node
    if not _is_onnx(node, "SequenceAt") or len(node.input) != 2:
        return []
    split = next((n for n in site.scope.node if _is_onnx(n, "SplitToSequence") and n.output[0] == node.input[0]), None)
    if split is None or len(split.input) < 2 or not split.input[1]:
        return []
    sizes, k = edit.static_ints(site, split.input[1]), edit.static_ints(site, node.input[1])
    if sizes is None or k is None or sizes.size < 2 or k.size != 1 or not -sizes.size <= int(k.reshape(-1)[0]) < sizes.size:
        return []
    sizes, current = sizes.reshape(-1), int(k.reshape(-1)[0]) % sizes.size
    return [j for j in range(sizes.size) if j != current and sizes[j] == sizes[current]]


def change_chunk_position(edit: ModelEdit) -> str | None:
    """j. A rank takes another chunk of a split sequence (a sequence-parallel layer's own chunk,
    `SequenceAt(SplitToSequence(x), rank)`, read at another rank's position)."""
    site = edit.pick(lambda s: bool(_other_chunks(edit, s)))
    if site is None:
        return None
    new = edit.rng.choice(_other_chunks(edit, site))
    old = edit.static_ints(site, site.node.input[1])
    assert old is not None
    name = edit.fresh("position")
    description = f"{site}: chunk {int(old.reshape(-1)[0])} -> {new}"
    site.node.input[1] = name
    edit.add_constant(site, name, np.asarray(new, dtype=old.dtype).reshape(old.shape))
    return description


# ---------------------------------------------------------------------------------------------
# refine.json operators


@dataclass
class ConfigEdit:
    """A copy of refine.json being mutated, with the sequential inputs' and outputs' types."""

    config: dict[str, Any]
    seq_types: dict[str, ValueType]
    seq_outputs: list[str]
    world_size: int
    rng: random.Random


VALUE_KEYS = ("range", "also")  # what an input's values can be: kept when its layout changes


def _layout_text(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "undeclared"
    extra = {k: v for k, v in layout.items() if k not in ("layout", *VALUE_KEYS)}
    return layout["layout"] + (f"({', '.join(f'{k}={v}' for k, v in extra.items())})" if extra else "")


def _layout_options(shape: tuple[int, ...], dtype: str, world: int) -> list[dict[str, Any]]:
    """Every layout a tensor of this type could be declared with (even shards only)."""
    options: list[dict[str, Any]] = [{"layout": "rep"}]
    options += [{"layout": "shard", "axis": a} for a in range(len(shape)) if shape[a] % world == 0]
    if np.issubdtype(np.dtype(dtype), np.floating):
        options += [{"layout": "partial", "op": "sum"}, {"layout": "partial", "op": "max"}]
    return options


def _same_layout(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    strip = (lambda d: None if d is None else {k: v for k, v in d.items() if k not in VALUE_KEYS})
    return strip(a) == strip(b)


def change_input_layout(edit: ConfigEdit) -> str | None:
    """k. A declared input relation changed (shard axis, rep <-> shard, partial)."""
    inputs = edit.config.get("inputs", {})
    names = sorted(n for n in inputs if n in edit.seq_types)
    if not names:
        return None
    name = edit.rng.choice(names)
    shape, dtype = edit.seq_types[name]
    old = inputs[name]
    options = [o for o in _layout_options(shape, dtype, edit.world_size) if not _same_layout(o, old)]
    if not options:
        return None
    new = edit.rng.choice(options)
    new.update({k: old[k] for k in VALUE_KEYS if k in old})
    inputs[name] = new
    return f"input {name!r}: {_layout_text(old)} -> {_layout_text(new)}"


def change_output_layout(edit: ConfigEdit) -> str | None:
    """k. A declared output relation changed or dropped, or an undeclared one declared."""
    names = [n for n in edit.seq_outputs if n in edit.seq_types]
    if not names:
        return None
    name = edit.rng.choice(names)
    outputs = edit.config.setdefault("outputs", {})
    old = outputs.get(name)
    options: list[dict[str, Any] | None] = [None, *_layout_options(*edit.seq_types[name], edit.world_size)]
    choices = [o for o in options if not _same_layout(o, old)]
    if not choices:
        return None
    new = edit.rng.choice(choices)
    if new is None:
        outputs.pop(name)
    else:
        outputs[name] = new
    return f"output {name!r}: {_layout_text(old)} -> {_layout_text(new)}"


# ---------------------------------------------------------------------------------------------
# l. Index and count computations (issue 42): the values that say which row goes where

# ops that compute indices, masks or counts from integer values (expert ids, ranks, offsets)
INDEX_OPS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Mod", "Div", "Where", "Clip",
                       "Add", "Sub", "Mul", "Max", "Min"})
# ops that read rows or write them at an index tensor (input 1)
INDEXED_OPS = frozenset({"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND"})


def _integer_scalars(edit: ModelEdit, site: Site) -> list[tuple[int, np.ndarray]]:
    """Integer scalar constant inputs of an index-computing node."""
    if site.node.domain not in ("", "ai.onnx") or site.node.op_type not in INDEX_OPS:
        return []
    found = []
    for i, v in enumerate(site.node.input):
        value = edit.constant(site, v)
        if value is not None and value.size == 1 and np.issubdtype(value.dtype, np.integer):
            found.append((i, value))
    return found


def shift_index_constant(edit: ModelEdit) -> str | None:
    """l. An integer constant of an index computation (a rank compared with, a block size, a
    clamp bound, a fill id, an offset) one more or one less, for one reader: the off-by-one."""
    site = edit.pick(lambda s: bool(_integer_scalars(edit, s)))
    if site is None:
        return None
    index, value = edit.rng.choice(_integer_scalars(edit, site))
    step = int(edit.rng.choice([1, -1]))
    new_value = (value + step).astype(value.dtype)
    name = edit.fresh("const")
    description = f"{site}: input {index} constant {_number(value)} {step:+d} -> {_number(new_value)}"
    site.node.input[index] = name
    edit.add_constant(site, name, new_value)
    return description


def _reversible_index(edit: ModelEdit, site: Site) -> bool:
    node = site.node
    if node.domain not in ("", "ai.onnx") or node.op_type not in INDEXED_OPS or len(node.input) < 2:
        return False
    typed = edit.type_of(site, node.input[1])
    return typed is not None and len(typed[0]) >= 1 and isinstance(typed[0][0], int) and typed[0][0] >= 2


def reverse_index(edit: ModelEdit) -> str | None:
    """l. The index tensor of a gather or scatter read in reverse along its first axis: each
    row picked or written at another row's index (a permutation applied where its inverse, or
    none, belongs)."""
    site = edit.pick(lambda s: _reversible_index(edit, s))
    if site is None:
        return None
    old = site.node.input[1]
    where = str(site)  # before the insert moves the site
    out, starts, ends, axes, steps = (edit.fresh(h) for h in ("reversed_index", "starts", "ends", "axes", "steps"))
    node = helper.make_node("Slice", [old, starts, ends, axes, steps], [out], name=out)
    constants = {starts: np.asarray([-1], np.int64), ends: np.asarray([np.iinfo(np.int64).min], np.int64),
                 axes: np.asarray([0], np.int64), steps: np.asarray([-1], np.int64)}
    site.node.input[1] = out
    edit.insert(site, [node], constants, after=False)
    return f"{where}: index {old!r} read in reverse along axis 0"


# The split sizes of a ragged exchange: dist.AllToAllV's send_counts and recv_counts (how many
# rows go to, and come from, each member), and the integer counts an AllToAll exchanges before
# it (each member's counts per expert): a change there reaches both ends, so the members still
# agree on the counts and only the rows go astray.
COUNT_POSITIONS = tuple(range(1, 1 + len(dist.COUNT_INPUTS)))


@dataclass(frozen=True)
class CountOperand:
    """One count input of a call: its position, the axis along the group's members, its shape
    and dtype, and how many entries each member has along that axis."""

    position: int
    axis: int
    shape: tuple[int, ...]
    dtype: str
    members: int

    @property
    def chunk(self) -> int:
        return self.shape[self.axis] // self.members


def _count_operands(edit: ModelEdit, site: Site) -> list[CountOperand]:
    node = site.node
    if not _is_collective(node, "AllToAllV", "AllToAll"):
        return []
    attrs = dist.node_attrs(node)
    members = len(attrs["group"])
    if node.op_type == "AllToAllV":
        positions, axis = COUNT_POSITIONS, 0
    else:
        positions, axis = (0,), int(attrs["split_axis"])
    found = []
    for position in positions:
        typed = edit.type_of(site, node.input[position]) if position < len(node.input) else None
        if typed is None or members < 2 or not np.issubdtype(np.dtype(typed[1]), np.integer):
            continue
        shape = typed[0]
        if all(isinstance(d, int) for d in shape) and len(shape) > axis and shape[axis] % members == 0:
            found.append(CountOperand(position, axis, tuple(shape), typed[1], members))
    return found


def swap_split_counts(edit: ModelEdit) -> str | None:
    """l. A ragged exchange's send and receive counts passed the other way round (the combine's
    counts not swapped back, or the dispatch's swapped)."""
    site = edit.pick(lambda s: _is_collective(s.node, "AllToAllV") and len(s.node.input) > max(COUNT_POSITIONS))
    if site is None:
        return None
    send, recv = (site.node.input[i] for i in COUNT_POSITIONS)
    site.node.input[COUNT_POSITIONS[0]], site.node.input[COUNT_POSITIONS[1]] = recv, send
    return f"{site}: send counts {send!r} and receive counts {recv!r} swapped"


def _count_detour(edit: ModelEdit, make: Callable[[CountOperand], tuple[str, np.ndarray, dict[str, Any], str]]
                  ) -> str | None:
    """Route one count operand of a call through `op(counts, constant, **attrs)` as `make` builds
    it, for this call alone or (at random) for every reader in its scope. Says what changed."""
    site = edit.pick(lambda s: bool(_count_operands(edit, s)))
    if site is None:
        return None
    operand = edit.rng.choice(_count_operands(edit, site))
    old = site.node.input[operand.position]
    op_type, value, attrs, what = make(operand)
    every_reader = edit.readers(site, old) > 1 and edit.rng.random() < 0.5
    where = f"{site}: input {operand.position} {old!r}" + (" (at every reader)" if every_reader else "")
    out, constant = edit.fresh("counts"), edit.fresh("counts_operand")
    first = site
    if every_reader:
        first = next(s for s in edit.sites() if s.scope_name == site.scope_name and old in s.node.input)
        for node in site.scope.node:
            node.input[:] = [out if v == old else v for v in node.input]
    else:
        site.node.input[operand.position] = out
    edit.insert(first, [helper.make_node(op_type, [old, constant], [out], name=out, **attrs)], {constant: value},
                after=False)
    return f"{where}: {what}"


def move_split_count(edit: ModelEdit) -> str | None:
    """l. One row of the split sizes moved from one member to another: the total still fits the
    buffers, two blocks one row longer and shorter (an offset off by one)."""

    def make(operand: CountOperand) -> tuple[str, np.ndarray, dict[str, Any], str]:
        more, fewer = edit.rng.sample(range(operand.members), 2)
        delta = np.zeros(operand.shape, operand.dtype)
        for member, step in ((more, 1), (fewer, -1)):  # the member's first entry (its first expert's count)
            delta[tuple(member * operand.chunk if a == operand.axis else 0 for a in range(len(operand.shape)))] = step
        return "Add", delta, {}, f"one row moved from member {fewer} to member {more}"

    return _count_detour(edit, make)


def reverse_split_counts(edit: ModelEdit) -> str | None:
    """l. The split sizes read in reverse member order (each member's counts taken as another's)."""

    def make(operand: CountOperand) -> tuple[str, np.ndarray, dict[str, Any], str]:
        order = np.arange(operand.shape[operand.axis]).reshape(operand.members, operand.chunk)[::-1].reshape(-1)
        return "Gather", order.astype(np.int64), {"axis": operand.axis}, "read in reverse member order"

    return _count_detour(edit, make)


# ---------------------------------------------------------------------------------------------
# The operator table


@dataclass(frozen=True)
class Operator:
    """One kind of mutation. `family` is its letter in issue 11's list (k: refine.json)."""

    name: str
    family: str
    change: Callable[[Any], str | None]  # ModelEdit (kind "model") or ConfigEdit (kind "config")
    kind: Literal["model", "config"] = "model"
    ranks_only: bool = False  # the sequential model has nothing it applies to


OPERATORS: tuple[Operator, ...] = (
    Operator("reshape_target_stale", "a", partial(change_reshape_target, annotations="stale")),
    Operator("reshape_target_unannotated", "a", partial(change_reshape_target, annotations="none")),
    Operator("swap_operands", "b", swap_operands),
    Operator("bypass_node", "c", bypass_node),
    Operator("drop_collective", "d", drop_collective, ranks_only=True),
    Operator("collective_reduce_op", "d", collective_reduce_op, ranks_only=True),
    Operator("collective_kind", "d", collective_kind, ranks_only=True),
    Operator("collective_axis", "d", collective_axis, ranks_only=True),
    Operator("collective_group", "d", collective_group, ranks_only=True),
    Operator("collective_other_group", "d", collective_other_group, ranks_only=True),
    Operator("reorder_call", "d", reorder_call, ranks_only=True),
    Operator("point_to_point", "d", point_to_point, ranks_only=True),
    Operator("change_axis", "e", change_axis),
    Operator("scale_constant", "f", scale_constant),
    Operator("rewire_input", "g", rewire_input),
    Operator("swap_op_family", "h", swap_op_family),
    Operator("commute_operands", "i", commute_operands),
    Operator("reshape_round_trip", "i", reshape_round_trip),
    Operator("insert_identity", "i", insert_identity),
    Operator("change_slice_bounds", "j", change_slice_bounds),
    Operator("change_chunk_position", "j", change_chunk_position),
    Operator("shift_index_constant", "l", shift_index_constant),
    Operator("reverse_index", "l", reverse_index),
    Operator("swap_split_counts", "l", swap_split_counts, ranks_only=True),
    Operator("move_split_count", "l", move_split_count, ranks_only=True),
    Operator("reverse_split_counts", "l", reverse_split_counts, ranks_only=True),
    Operator("change_input_layout", "k", change_input_layout, kind="config"),
    Operator("change_output_layout", "k", change_output_layout, kind="config"),
)
OPERATORS_BY_NAME = {op.name: op for op in OPERATORS}


def apply_operator(op: Operator, model: onnx.ModelProto, types: ScopeTypes, ints: ScopeInts,
                   declared: frozenset[str], rng: random.Random) -> tuple[onnx.ModelProto, str] | None:
    """The mutated copy of `model` and what changed, or None when the operator does not apply
    (or would leave the model as it was: a mutant always differs from its subject)."""
    mutated = onnx.ModelProto()
    mutated.CopyFrom(model)
    description = op.change(ModelEdit(mutated, types, ints, declared, rng))
    if description is None or _bytes(mutated) == _bytes(model):
        return None
    return mutated, description


def apply_config_operator(op: Operator, subject: Subject, rng: random.Random) -> tuple[dict[str, Any], str] | None:
    """The mutated refine.json and what changed, or None."""
    config = copy.deepcopy(subject.config)
    seq_outputs = [o.name for o in subject.models[SEQ_NAME].graph.output]
    description = op.change(ConfigEdit(config, subject.types[SEQ_NAME][MAIN], seq_outputs, subject.world_size, rng))
    if description is None or config == subject.config:
        return None
    return config, description


def _bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


# ---------------------------------------------------------------------------------------------
# Mutants


@dataclass
class Mutant:
    """One change to a subject: the files it replaces (new contents) and what changed."""

    index: int
    subject: Subject
    operator: Operator
    files: dict[str, bytes]
    description: str

    def write(self, root: Path) -> Path:
        """A copy of the subject under `root` with this mutant's files replaced."""
        out = root / self.subject.name
        out.mkdir(parents=True)
        for name in [SEQ_NAME, CONFIG_NAME, *self.subject.rank_files]:
            if name in self.files:
                (out / name).write_bytes(self.files[name])
            else:
                shutil.copyfile(self.subject.path / name, out / name)
        return out


def mutate(subject: Subject, op: Operator, target: str, rng: random.Random) -> tuple[dict[str, bytes], str] | None:
    """Apply `op` to one file of the subject (or to every rank file alike): new file contents
    and a one-line description, or None."""
    if op.kind == "config":
        found = apply_config_operator(op, subject, rng)
        if found is None:
            return None
        config, description = found
        return {CONFIG_NAME: json.dumps(config, indent=1).encode()}, f"{CONFIG_NAME}: {description}"
    files = subject.rank_files if target == EVERY_RANK else [target]
    state = rng.getstate()
    changed, descriptions = {}, set()
    for name in files:
        rng.setstate(state)  # every rank makes the same choices, so the same change lands on each
        found = apply_operator(op, subject.models[name], subject.types[name], subject.ints[name], subject.declared, rng)
        if found is None:
            return None
        changed[name] = _bytes(found[0])
        descriptions.add(found[1])
    if len(descriptions) != 1:  # the ranks differ where the change lands: not one SPMD change
        return None
    return changed, f"{target}: {descriptions.pop()}"


TARGET_KINDS = ("seq", "one", "every")  # where a model operator may land: seq.onnx, one rank file, every rank file


def _targets(subject: Subject, op: Operator, rng: random.Random, kinds: tuple[str, ...] = TARGET_KINDS) -> list[str]:
    """Files to try, in random order, of the target `kinds`: the sequential model, one rank,
    every rank (a row-symmetric subject keeps its rows alike only under seq and every-rank
    changes, which test its one-row proof; a one-rank change makes it verified whole)."""
    if op.kind == "config":
        return [CONFIG_NAME]
    targets = [rng.choice(subject.rank_files)] if "one" in kinds else []
    targets += [EVERY_RANK] if subject.world_size > 1 and "every" in kinds else []
    targets += [] if op.ranks_only or "seq" not in kinds else [SEQ_NAME]
    rng.shuffle(targets)
    return targets


def make_mutant(subjects: list[Subject], index: int, seed: int, operators: tuple[Operator, ...] = OPERATORS,
                attempts: int = 64, targets: tuple[str, ...] = TARGET_KINDS) -> Mutant | None:
    """Mutant number `index` of a campaign (deterministic in seed and index): a random
    operator, on the first of the subjects (in random order) it applies to. Operators are
    drawn first so that each gets its share, also those only a few subjects offer a site to."""
    rng = random.Random(f"{seed}:{index}")
    for _ in range(attempts):
        op = rng.choice(operators)
        for subject in rng.sample(subjects, len(subjects)):
            for target in _targets(subject, op, rng, targets):
                found = mutate(subject, op, target, rng)
                if found is not None:
                    return Mutant(index, subject, op, *found)
    return None


# ---------------------------------------------------------------------------------------------
# The judge: run the programs, rebuild every sequential output from the ranks' outputs


@dataclass
class Judged:
    judgement: Judgement
    detail: str = ""


def close(actual: np.ndarray, expected: np.ndarray, tol: float = RELATIVE_TOLERANCE) -> bool:
    """Same shape, the same non-finite values, and max|a-b| <= tol * max(1, max|expected|)
    (`tol`: the programs' float formats' tolerance, refine/precision.py; 1e-4 for float32)."""
    if actual.shape != expected.shape:
        return False
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(e)
    if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(a[~finite], e[~finite], equal_nan=True):
        return False
    if not finite.any():
        return True
    scale = max(1.0, float(np.max(np.abs(e[finite]))))
    return float(np.max(np.abs(a[finite] - e[finite]))) <= tol * scale


def _reduced(parts: list[np.ndarray], op: str) -> np.ndarray | None:
    if len({p.shape for p in parts}) != 1:
        return None
    stack = np.stack([np.asarray(p, dtype=np.float64) for p in parts])
    return stack.sum(axis=0) if op == "sum" else stack.max(axis=0)


def _declared_problem(y: np.ndarray, parts: dict[int, np.ndarray], layout: Layout, config: ModelConfig,
                      tol: float = RELATIVE_TOLERANCE) -> str | None:
    """None if the ranks' outputs relate to y as the declared layout says (a shard `over` a mesh
    dim: each rank holds the chunk of its coordinate there)."""
    if not parts:
        return "no rank has this output"
    if isinstance(layout, RepLayout):
        bad = [r for r, p in parts.items() if not close(p, y, tol)]
        return f"declared rep, but rank(s) {bad} differ" if bad else None
    if isinstance(layout, ShardLayout) and layout.then is not None:  # a two-dim shard: each rank its block
        try:
            blocks = cut_two_dim(layout, y, config)
        except ValueError as exc:
            return f"declared two-dim shard: {exc}"
        bad = [r for r in range(config.world_size) if r not in parts or not close(parts[r], blocks[r], tol)]
        return f"declared two-dim shard, but rank(s) {bad} do not hold their block" if bad else None
    if isinstance(layout, ShardLayout):
        if y.ndim == 0 or not -y.ndim <= layout.axis < y.ndim:
            return f"declared shard along axis {layout.axis} of a {y.ndim}-d output"
        axis = layout.axis % y.ndim
        parts_of = config.split_of(layout, 0)[1]
        try:
            indices = shard_indices(layout.model_copy(update={"over": None}), y.shape[axis], parts_of)
        except ValueError as exc:
            return f"declared shard: {exc}"
        chunk = {r: config.split_of(layout, r)[0] for r in range(config.world_size)}
        bad = [r for r in range(config.world_size)
               if r not in parts or not close(parts[r], np.take(y, indices[chunk[r]], axis=axis), tol)]
        return f"declared shard(axis={axis}), but rank(s) {bad} do not hold their chunk" if bad else None
    assert isinstance(layout, PartialLayout)
    total = _reduced(list(parts.values()), layout.op)
    ok = total is not None and close(total, y, tol)
    return None if ok else f"declared partial {layout.op}, but the {layout.op} of the ranks' outputs differs"


def _windows(y: np.ndarray, part: np.ndarray, axis: int, tol: float) -> list[int]:
    """Starts s such that part equals y[s : s + len] along axis."""
    if part.ndim != y.ndim or any(a != b for i, (a, b) in enumerate(zip(part.shape, y.shape)) if i != axis):
        return []
    size = part.shape[axis]
    if size == 0 or size > y.shape[axis]:
        return []
    return [s for s in range(y.shape[axis] - size + 1) if close(part, np.take(y, np.arange(s, s + size), axis=axis), tol)]


def _concatenated(y: np.ndarray, parts: list[np.ndarray], tol: float, limit: int = 4096) -> bool:
    """Each part is some contiguous window of y along one axis, and the windows cover it."""
    for axis in range(y.ndim):
        starts = [_windows(y, p, axis, tol) for p in parts]
        if not all(starts):
            continue
        for choice in itertools.islice(itertools.product(*starts), limit):
            covered = np.zeros(y.shape[axis], dtype=bool)
            for s, p in zip(choice, parts):
                covered[s: s + p.shape[axis]] = True
            if covered.all():
                return True
    return False


def _interleaved(y: np.ndarray, parts: list[np.ndarray], tol: float) -> bool:
    """The parts cut into B equal blocks along one axis; y is block 0 of every rank (in rank
    order), then block 1 of every rank, ... (B >= 2; B = 1 is a plain concatenation)."""
    if len({p.shape for p in parts}) != 1 or parts[0].ndim != y.ndim:
        return False
    shape = parts[0].shape
    for axis in range(y.ndim):
        size = shape[axis]
        if size * len(parts) != y.shape[axis] or any(a != b for i, (a, b) in enumerate(zip(shape, y.shape)) if i != axis):
            continue
        for blocks in range(2, size + 1):
            if size % blocks:
                continue
            step = size // blocks
            rebuilt = np.concatenate([np.take(p, np.arange(b * step, (b + 1) * step), axis=axis)
                                      for b in range(blocks) for p in parts], axis=axis)
            if close(rebuilt, y, tol):
                return True
    return False


def _equal_groups(items: list[int], size: int) -> Iterator[list[list[int]]]:
    """Every partition of `items` into groups of `size` (the first item's group first)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [i for i in rest if i not in others]
        for groups in _equal_groups(remaining, size):
            yield [[first, *others], *groups]


def _concatenated_sums(y: np.ndarray, parts: list[np.ndarray], tol: float, limit: int = 4096) -> bool:
    """The parts fall into equal groups whose sums are windows covering an axis of y (a shard
    of a gradient left partial over another mesh dim: the concatenation of sums)."""
    n = len(parts)
    for size in range(2, n):
        if n % size:
            continue
        for groups in itertools.islice(_equal_groups(list(range(n)), size), limit):
            sums = [_reduced([parts[i] for i in group], "sum") for group in groups]
            if all(t is not None for t in sums) and _concatenated(y, sums, tol):  # type: ignore[arg-type]
                return True
    return False


def _undeclared_problem(y: np.ndarray, parts: dict[int, np.ndarray], tol: float = RELATIVE_TOLERANCE) -> str | None:
    """None if every rank having the output takes part in one reconstruction of y: a replica,
    a concatenation of windows covering an axis, a sum, a max, an interleaving, or a
    concatenation of sums of equal groups of ranks."""
    if not parts:
        return "no rank has this output"
    values = list(parts.values())
    if all(close(p, y, tol) for p in values) or _concatenated(y, values, tol) or _interleaved(y, values, tol):
        return None
    for op in ("sum", "max"):
        total = _reduced(values, op)
        if total is not None and close(total, y, tol):
            return None
    if _concatenated_sums(y, values, tol):
        return None
    return (f"no replica, concatenation, sum, max, interleaving or concatenation of sums of rank(s) {sorted(parts)} "
            "rebuilds it")


def output_problems(run: SimResult, config: ModelConfig, seq_outputs: list[str],
                    rank_outputs: list[list[str]], tol: float = RELATIVE_TOLERANCE) -> list[str]:
    """For one run: every sequential output the ranks' outputs do not rebuild, and why."""
    problems = []
    for y in seq_outputs:
        parts = {r: run.ranks[r][y] for r, names in enumerate(rank_outputs) if y in names}
        layout = config.outputs.get(y)
        why = (_declared_problem(run.seq[y], parts, layout, config, tol) if layout is not None
               else _undeclared_problem(run.seq[y], parts, tol))
        if why:
            problems.append(f"{y}: {why}")
    return problems


def _programs(model_dir: Path, config: ModelConfig) -> list[onnx.ModelProto]:
    """The directory's programs, without their weights' data (names, types, nodes)."""
    def bare(path: Path) -> onnx.ModelProto:
        return onnx.load(str(path), load_external_data=False)

    return [bare(model_dir / SEQ_NAME), *RankPrograms(model_dir, config, load=bare).all()]


def judge(model_dir: Path, seeds: tuple[int, ...] = JUDGE_SEEDS) -> Judged:
    """Run the directory's programs on each seed: `equivalent` if every sequential output is
    rebuilt from the ranks' outputs on every seed, `differs` if not, `cannot_run` if loading
    or running fails."""
    try:
        config = load_config(model_dir)
        seq, *ranks = _programs(model_dir, config)
        seq_outputs = [o.name for o in seq.graph.output]
        rank_outputs = [[o.name for o in rank.graph.output] for rank in ranks]
        tol = tolerance([seq, *ranks])
        runs = [simulate_dir(model_dir, seed) for seed in seeds]
        problems = [f"seed {seed}: {p}" for seed, run in zip(seeds, runs)
                    for p in output_problems(run, config, seq_outputs, rank_outputs, tol)]
    except Exception as exc:  # noqa: BLE001 - anything that stops the run means "cannot run"
        return Judged("cannot_run", _one_line(exc))
    return Judged("differs", "; ".join(problems)) if problems else Judged("equivalent")


# ---------------------------------------------------------------------------------------------
# The verdict


def verdict_of(model_dir: Path, verify_jobs: int = 1) -> tuple[Verdict, str]:
    """refine's verdict on the directory (simulation on; `verify_jobs`: verify's --jobs), and a
    short detail."""
    try:
        report = verify_dir(model_dir, jobs=verify_jobs)
    except InputError as exc:
        return "bad_input", exc.one_line(model_dir)
    except Exception as exc:  # noqa: BLE001 - a crash is a finding, recorded with where it happened
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
        return "crash", _one_line(exc) + where
    detail = f"{report.failure.node}: {report.failure.reason}" if report.failure else ""
    return report.verdict, " ".join(detail.split())[:300]


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Timeout(BaseException):
    """A mutant ran past its time limit (a BaseException, so that no `except Exception` on the
    way, refine's or the judge's, takes it for a failure of the mutant)."""


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise _Timeout in the main thread after `seconds` (no limit elsewhere)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: object) -> None:
        raise _Timeout(f"over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------
# Campaigns


class MutantRow(BaseModel):
    """One mutant: what changed, what the judge and refine said."""

    index: int
    subject: str
    operator: str
    family: str
    description: str
    judgement: Judgement
    judge_detail: str = ""
    verdict: Verdict
    verdict_detail: str = ""
    seconds: float = 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hole(self) -> bool:
        """refine says verified where the numbers differ or the programs cannot run, or crashes."""
        return self.verdict == "crash" or (self.verdict == "verified" and self.judgement != "equivalent")

    def line(self) -> str:
        return f"#{self.index} {self.subject}: {self.description}"


class SubjectRow(BaseModel):
    """An unmutated subject: both must hold (equivalent, and verified) for its mutants to mean much."""

    subject: str
    judgement: Judgement
    verdict: Verdict
    detail: str = ""


class Campaign(BaseModel):
    """The rows of a campaign and the tables read from them."""

    seed: int
    count: int
    subjects: list[SubjectRow]
    rows: list[MutantRow]
    seconds: float = 0.0

    def confusion(self) -> dict[str, dict[str, int]]:
        """verdict -> judgement -> number of mutants."""
        table = {v: {j: 0 for j in JUDGEMENTS} for v in VERDICTS}
        for row in self.rows:
            table[row.verdict][row.judgement] += 1
        return table

    def holes(self) -> list[MutantRow]:
        return [r for r in self.rows if r.hole]

    def false_alarms(self) -> list[MutantRow]:
        """refuted although the numbers agree: the counterexample search is wrong."""
        return [r for r in self.rows if r.verdict == "refuted" and r.judgement == "equivalent"]

    def unproven_equivalent(self) -> dict[str, int]:
        """operator -> equivalent mutants left unproven (missing lemmas)."""
        return dict(sorted(Counter(r.operator for r in self.rows
                                   if r.verdict == "unproven" and r.judgement == "equivalent").items()))

    def by_operator(self) -> dict[str, Counter[str]]:
        table: dict[str, Counter[str]] = defaultdict(Counter)
        for row in self.rows:
            table[row.operator][row.judgement] += 1
        return dict(sorted(table.items()))

    def operator_markdown(self) -> str:
        """Per operator: how many mutants, what the judge said, and what refine said."""
        lines = ["| operator | family | mutants | " + " | ".join(JUDGEMENTS) + " | " + " | ".join(VERDICTS) + " |",
                 "|---|---|---|" + "---|" * (len(JUDGEMENTS) + len(VERDICTS))]
        for op, judged in self.by_operator().items():
            rows = [r for r in self.rows if r.operator == op]
            said = Counter(r.verdict for r in rows)
            lines.append(f"| {op} | {rows[0].family} | {len(rows)} | " + " | ".join(str(judged[j]) for j in JUDGEMENTS)
                         + " | " + " | ".join(str(said[v]) for v in VERDICTS) + " |")
        return "\n".join(lines)

    def markdown(self) -> str:
        """The confusion table, the holes, false alarms and missing lemmas, as markdown."""
        lines = ["| verdict \\ judge | " + " | ".join(JUDGEMENTS) + " | total |",
                 "|---|" + "---|" * (len(JUDGEMENTS) + 1)]
        for verdict, row in self.confusion().items():
            if any(row.values()) or verdict in ("verified", "refuted", "unproven", "bad_input", "crash"):
                lines.append(f"| {verdict} | " + " | ".join(str(row[j]) for j in JUDGEMENTS) + f" | {sum(row.values())} |")
        holes = self.holes()
        lines += ["", f"Holes ({len(holes)}: verified while differs / cannot_run, or crash):"]
        lines += [f"- {r.verdict} on {r.judgement}: {r.line()}" + (f" ({r.verdict_detail})" if r.verdict == "crash" else "")
                  for r in holes] or ["- none"]
        alarms = self.false_alarms()
        if alarms:
            lines += ["", f"False alarms ({len(alarms)}: refuted while equivalent):"]
            lines += [f"- {r.line()}" for r in alarms]
        missing = self.unproven_equivalent()
        lines += ["", "Unproven on equivalent mutants, by operator (missing lemmas): "
                  + (", ".join(f"{op} {n}" for op, n in missing.items()) or "none")]
        bad = [s for s in self.subjects if s.judgement != "equivalent" or s.verdict != "verified"]
        if bad:
            lines += ["", "Subjects that are not themselves correct and verified: "
                      + ", ".join(f"{s.subject} ({s.judgement}, {s.verdict})" for s in bad)]
        return "\n".join(lines)


def _copies_written_out(path: Path) -> Path:
    """`path` with its declared row copies written as files, in a directory of this process's that
    is removed when it exits (named like the subject, which names its mutants)."""
    scratch = Path(tempfile.mkdtemp(prefix="refine-subject-"))
    atexit.register(shutil.rmtree, scratch, True)
    write_copies_out(path, scratch / path.name)
    return scratch / path.name


_SUBJECTS: dict[Path, Subject] = {}  # per process: subjects are loaded (and run) once


def _subject(path: Path) -> Subject:
    path = path.resolve()
    if path not in _SUBJECTS:
        _SUBJECTS[path] = load_subject(path)
    return _SUBJECTS[path]


def judge_and_verify(model_dir: Path, timeout: float | None, verify_jobs: int = 1) -> tuple[Judged, Verdict, str]:
    """Both questions about one directory, within one time limit."""
    judged = Judged("cannot_run", f"the judge ran past the time limit ({timeout} s)")
    try:
        with _time_limit(timeout):
            judged = judge(model_dir)
            verdict, detail = verdict_of(model_dir, verify_jobs)
    except _Timeout as exc:
        return judged, "timeout", str(exc)
    return judged, verdict, detail


def run_mutant(subject_paths: tuple[Path, ...], index: int, seed: int, timeout: float | None = 300.0,
               verify_jobs: int = 1, operators: tuple[str, ...] | None = None,
               targets: tuple[str, ...] = TARGET_KINDS) -> MutantRow | None:
    """Make mutant `index` (of the named `operators`, else of any; landing on the `targets`
    kinds of file), write it to a scratch directory, judge it and verify it."""
    start = time.perf_counter()
    chosen = tuple(OPERATORS_BY_NAME[name] for name in operators) if operators else OPERATORS
    mutant = make_mutant([_subject(p) for p in subject_paths], index, seed, chosen, targets=targets)
    if mutant is None:
        return None
    with tempfile.TemporaryDirectory(prefix="refine-mutant-") as tmp:
        model_dir = mutant.write(Path(tmp))
        judged, verdict, detail = judge_and_verify(model_dir, timeout, verify_jobs)
    return MutantRow(index=index, subject=mutant.subject.name, operator=mutant.operator.name,
                     family=mutant.operator.family, description=mutant.description, judgement=judged.judgement,
                     judge_detail=judged.detail, verdict=verdict, verdict_detail=detail,
                     seconds=round(time.perf_counter() - start, 3))


def run_subject(path: Path, timeout: float | None = 300.0, verify_jobs: int = 1) -> SubjectRow:
    """The unmutated subject, judged and verified like a mutant."""
    judged, verdict, detail = judge_and_verify(path, timeout, verify_jobs)
    return SubjectRow(subject=path.name, judgement=judged.judgement, verdict=verdict, detail=detail or judged.detail)


def run_campaign(subject_dirs: list[Path], count: int, seed: int = 0, jobs: int = 1, timeout: float | None = 300.0,
                 done: Callable[[MutantRow], None] | None = None, verify_jobs: int = 1,
                 operators: tuple[str, ...] | None = None, targets: tuple[str, ...] = TARGET_KINDS) -> Campaign:
    """`count` mutants (numbered 0..count-1) of the subjects, in `jobs` worker processes, each
    verified with `refine verify --jobs verify_jobs`; `operators` names the operators to draw
    from (all by default), `targets` the kinds of file model operators land on (TARGET_KINDS).

    Each mutant is independent and deterministic in (seed, index), so a hole can be made
    again alone: `make_mutant([load_subject(d) for d in dirs], index, seed)`."""
    start = time.perf_counter()
    paths = tuple(Path(d).resolve() for d in subject_dirs)
    rows: list[MutantRow] = []
    with _pool(jobs) as submit:
        subjects = [submit(run_subject, p, timeout, verify_jobs) for p in paths]
        for future in [submit(run_mutant, paths, i, seed, timeout, verify_jobs, operators, targets)
                       for i in range(count)]:
            row = future()
            if row is not None:
                rows.append(row)
                if done:
                    done(row)
        subject_rows = [f() for f in subjects]
    return Campaign(seed=seed, count=count, subjects=subject_rows, rows=sorted(rows, key=lambda r: r.index),
                    seconds=round(time.perf_counter() - start, 1))


@contextlib.contextmanager
def _pool(jobs: int) -> Iterator[Callable[..., Callable[[], Any]]]:
    """submit(fn, *args) -> a function returning the result: in-process for one job, else in
    forkserver workers (clean processes: no thread of this one is inherited)."""
    if jobs <= 1:
        yield lambda fn, *args: partial(fn, *args)
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("forkserver")) as pool:
        yield lambda fn, *args: pool.submit(fn, *args).result
