"""Lowering a model directory end to end: plain graphs to one fact set, or, for function-form
models (docs/layers.md), the main graphs with each layer call as one opaque node plus one fact
set per distinct layer *template* (the bodies called at one call site on the sequential side
and on every rank, hashed canonically with their input types). Also the facts directories
these are written to and read from (`refine lower`, `refine run --facts`). The memoized run
that reads templates and call sites is refine/run/memo.py."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from refine import dist
from refine.errors import InputError
from refine.lowering.facts import FactSet, read_facts_dir, write_facts_dir
from refine.lowering import layers
from refine.lowering import rows as rows_module
from refine.lowering.graphs import (
    add_groups,
    declared_relations,
    declared_values,
    lower_body_calls,
    lower_graphs,
    lower_models,
    op_name,
)
from refine.lowering.load import SEQ, LoadedModels, RowSymmetry, load_model_dir
from refine.lowering.shapes import (
    check_declared_types,
    infer_shapes,
    int_constants,
    take_declared_types,
    value_types,
)

TEMPLATES_DIR = "templates"


@dataclass
class Program:
    """What the lowering of a model directory gives: the main graphs' facts and, for
    function-form models, one fact set per distinct layer template."""

    main: FactSet
    templates: dict[str, FactSet] = field(default_factory=dict)
    rows: RowSymmetry | None = None  # lowered for row 0 only (refine/lowering/rows.py)

    def count(self) -> int:
        return self.main.count() + sum(t.count() for t in self.templates.values())



# --- lowering --------------------------------------------------------------------------------


class BodyInference:
    """Shape inference of graphs and layer-call bodies, once per distinct one *up to value names*.

    Each rank's layer functions are the same code traced again, so the pieces cut from them
    differ only in torch's value names (`val_7` on one rank, `val_9` on the next) and node
    metadata, and the ranks of one TP position in different DP rows run the same program with
    other collective groups (inference reads a group's size only); a training step also infers each piece twice (to type the call's outputs in the
    main graph, then to lower the template). A piece is keyed by its canonical form (values
    renamed by first appearance, node names and metadata dropped; everything inference reads
    kept: ops, attributes, initializers, input types, opsets, functions); the first piece of a
    form is inferred as it is (so errors name its own nodes) and its types are kept under
    canonical names, which serve every later piece of the same form. A piece with subgraphs
    (whose bodies may read outer names) is keyed by its exact bytes instead."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._types: dict[bytes, dict[str, onnx.TypeProto]] = {}  # canonical form -> canonical name -> type

    def __call__(self, piece: onnx.ModelProto, path: Path) -> onnx.ModelProto:
        key, canonical, positions = _canonical_form(piece)
        known = self._types.get(key)
        if known is None:
            inferred = infer_shapes(piece, path, self.world_size)
            self._types[key] = {canonical[name]: tp for name, tp in value_types(inferred.graph).items() if name in canonical}
            return inferred
        out = onnx.ModelProto.FromString(piece.SerializeToString())
        declared = take_declared_types(out.graph)
        types = {name: known[c] for name, c in canonical.items() if c in known}
        types.update(positions)  # (the chunk positions left out of the key: typed by their own attribute)
        given = {vi.name for vi in out.graph.input} | {i.name for i in out.graph.initializer}
        outputs = {vi.name for vi in out.graph.output}
        out.graph.value_info.extend(onnx.helper.make_value_info(name, tp) for name, tp in types.items()
                                    if name not in given and name not in outputs)
        for vi in out.graph.output:
            if vi.name in types:
                vi.type.CopyFrom(types[vi.name])
        check_declared_types(declared, value_types(out.graph), path)
        return out


def _canonical_form(piece: onnx.ModelProto) -> tuple[bytes, dict[str, str], dict[str, onnx.TypeProto]]:
    """(key, value name -> canonical name, the chunk positions' Constants left out of the key ->
    their type) of a piece: see BodyInference. A position Constant read by nothing but chunk
    positions is left out of the form altogether, so that where torch emits it (among the
    constants at the top, or right before its SequenceAt) does not change the key."""
    graph = piece.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return hashlib.sha256(piece.SerializeToString(deterministic=True)).digest(), {}, {}
    names: dict[str, str] = {"": ""}

    def canon(name: str) -> str:
        return names.setdefault(name, f"v{len(names)}")

    positions = _chunk_positions(graph)
    form = onnx.ModelProto()
    form.CopyFrom(piece)
    del form.metadata_props[:]
    g = form.graph
    g.name, g.doc_string = "", ""
    del g.value_info[:]  # (declared types: inference never adopts them)
    for vi in [*g.input, *g.output]:
        vi.name, vi.doc_string = canon(vi.name), ""
    for init in g.initializer:
        init.name = canon(init.name)
    dropped = {node.output[0]: _constant_type(node) for node in g.node
               if node.output and node.output[0] in positions.unread_otherwise}
    kept = [(index, node) for index, node in enumerate(g.node) if not (node.output and node.output[0] in dropped)]
    for index, node in kept:
        node.name, node.doc_string = "", ""
        del node.metadata_props[:]
        if index in positions.reads:
            node.input[1] = "chunk position " + positions.zeroed[node.input[1]].SerializeToString().hex()
        for attr in node.attribute:  # a collective's group: inference reads its size only
            if node.domain == dist.DIST_DOMAIN and attr.name == "group":
                attr.ints[:] = [0] * len(attr.ints)
        node.input[:] = [canon(x) for x in node.input]
        node.output[:] = [canon(x) for x in node.output]
    del g.node[:]
    g.node.extend(node for _, node in kept)
    for vi in g.output:  # outputs keep their (inferred) type out of the key
        vi.ClearField("type")
    key = hashlib.sha256(form.SerializeToString(deterministic=True)).digest()
    return key, {name: c for name, c in names.items() if name}, dropped


def _constant_type(node: onnx.NodeProto) -> onnx.TypeProto:
    """The type of a Constant's output, read off its attribute (a tensor, or an int or ints)."""
    attr = node.attribute[0]
    if attr.name == "value":
        return onnx.helper.make_tensor_type_proto(attr.t.data_type, list(attr.t.dims))
    return onnx.helper.make_tensor_type_proto(onnx.TensorProto.INT64, [] if attr.name == "value_int" else [len(attr.ints)])


@dataclass
class _ChunkPositions:
    """What `_chunk_positions` finds: the SequenceAt nodes (by index) whose position does not
    change their type, each position's Constant with its value zeroed (type kept), and the
    Constants read by nothing else (their value changes no type at all)."""

    reads: set[int] = field(default_factory=set)
    zeroed: dict[str, onnx.AttributeProto] = field(default_factory=dict)
    unread_otherwise: set[str] = field(default_factory=set)


def _chunk_positions(graph: onnx.GraphProto) -> _ChunkPositions:
    """Positions inference cannot see: `SequenceAt(SplitToSequence(x, sizes), k)` with `sizes`
    stated, at least two and all equal, `k` a stated integer in range, and `x` computed from a
    graph input (no folding reaches the chunk). Such a chunk has one type whichever `k` it is,
    so `k` is left out of a piece's key: a sequence-parallel layer takes chunk `rank` of its
    input, the only difference between the ranks' bodies of one layer. A Constant read by such
    positions only (or by nothing) keeps its type in the key, not its value."""
    consts = int_constants(graph)
    constant_nodes = {n.output[0]: n for n in graph.node
                      if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output and n.output[0] in consts}
    dynamic = {vi.name for vi in graph.input} - {i.name for i in graph.initializer}
    equal_splits: dict[str, int] = {}  # sequence -> number of chunks
    found = _ChunkPositions()
    other_reads: set[str] = set()
    for index, node in enumerate(graph.node):
        if any(x in dynamic for x in node.input):
            dynamic.update(node.output)
        standard = node.domain in ("", "ai.onnx")
        sizes = consts.get(node.input[1]) if standard and node.op_type == "SplitToSequence" and len(node.input) > 1 else None
        if sizes and len(sizes) > 1 and len(set(sizes)) == 1 and node.input[0] in dynamic:
            equal_splits[node.output[0]] = len(sizes)
        position = node.input[1] if standard and node.op_type == "SequenceAt" and len(node.input) == 2 else None
        k = consts.get(position) if position in constant_nodes else None
        if k is not None and len(k) == 1 and node.input[0] in equal_splits \
                and -equal_splits[node.input[0]] <= k[0] < equal_splits[node.input[0]]:
            found.reads.add(index)
            other_reads.add(node.input[0])
        else:
            other_reads.update(node.input)
    other_reads.update(vi.name for vi in graph.output)
    for name, node in constant_nodes.items():
        if len(consts[name]) != 1:
            continue
        attr = onnx.AttributeProto()
        attr.CopyFrom(node.attribute[0])
        if attr.name == "value":
            attr.t.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(attr.t))))
        elif attr.name == "value_int":
            attr.i = 0
        else:
            attr.ints[:] = [0]
        found.zeroed[name] = attr
        if name not in other_reads:
            found.unread_otherwise.add(name)
    return found


def lower_program(model_dir: Path, memo: bool = True, rows: bool = False) -> Program:
    """Lower a model directory; with `memo`, layer calls become templates + call sites. With
    `rows`, a mesh whose rows run the same programs is lowered for row 0 only (rows.py; the
    Program says so in `rows`)."""
    models = rows_module.load_rows(model_dir, inline=not memo) if rows else None
    if models is not None:
        try:
            return _lower_models(models)
        except rows_module.NotSymmetric:
            pass
    return _lower_models(load_model_dir(model_dir, inline=not memo))


def _lower_models(models: LoadedModels) -> Program:
    graphs = [(SEQ, models.seq), *models.rank_graphs()]
    if not any(m.functions for _, m in graphs):
        infer = BodyInference(models.config.world_size)
        program = Program(lower_models(models, infer=lambda model, path, _n: infer(model, path)))
    else:
        program = _lower_with_calls(models, graphs)
    program.rows = models.rows
    if models.rows is not None:  # (a template's rules must know it too: windows.lp, rows_reduced)
        for facts in program.templates.values():
            facts.add("row_symmetry", models.rows.dim, models.rows.rows)
        for facts in (program.main, *program.templates.values()):
            rows_module.add_mirror_facts(facts, models.config, models.rows)
    return program


def _lower_with_calls(models: LoadedModels, graphs: list[tuple[str, onnx.ModelProto]]) -> Program:
    n = models.config.world_size
    calls = {g: layers.layer_calls(m, models.paths[g]) for g, m in graphs}
    infer_body = BodyInference(n)
    inferred: dict[str, onnx.ModelProto] = {}
    types: dict[str, dict[str, onnx.TypeProto]] = {}
    for g, model in graphs:
        inferred[g], types[g] = _infer_main(model, models.paths[g], n, calls[g], infer_body)
    main = FactSet()
    lowered = lower_graphs([(g, inferred[g], models.paths[g]) for g, _ in graphs], n, set(models.config.inputs), main,
                           declared_values(models.config))
    declared_relations(models.config, lowered, models, main)
    _set_aside_layer_params(main, graphs, calls, lowered)
    _lower_layer_bodies_calls(main, graphs, calls, models, n)
    program = Program(main)
    by_digest: dict[tuple[str, ...], str] = {}
    digests: dict[tuple, str] = {}  # one hash per function and input types

    def digest_of(g: str, model: onnx.ModelProto, call: layers.LayerCall, in_types: list[onnx.TypeProto | None]) -> str:
        key = (g, call.function.domain, call.function.name,
               tuple(t.SerializeToString() if t else bytes([bool(x)]) for t, x in zip(in_types, call.node.input)),
               tuple(bool(x) for x in call.node.output))
        if key not in digests:
            digests[key] = layers.body_digest(call, layers.local_functions(model), in_types, _opsets(model), models.paths[g])
        return digests[key]

    model_of = dict(graphs)
    for occurrence, site_calls in _call_sites(graphs, calls):
        in_types = {g: [types[g].get(x) if x else None for x in c.node.input] for g, c in site_calls.items()}
        digest = tuple((g, digest_of(g, model_of[g], call, in_types[g])) for g, call in site_calls.items())
        if digest not in by_digest:
            name = f"T{len(by_digest) + 1}"
            by_digest[digest] = name
            site_graphs = [(g, model_of[g]) for g in site_calls]
            program.templates[name] = _lower_template(name, site_graphs, site_calls, in_types, models, n, infer_body)
        cid = lowered[SEQ].node_ids[site_calls[SEQ].position]
        cid = cid if occurrence == 0 else f"{cid}@{occurrence}"  # (a stage's call of micro-batch k > 0)
        main.add("callsite", cid, by_digest[digest])
        for g, call in site_calls.items():
            main.add("call_node", cid, g, lowered[g].node_ids[call.position])  # its edges: node_in/node_out
    return program


def _call_sites(graphs: list[tuple[str, onnx.ModelProto]],
                calls: dict[str, list[layers.LayerCall]]) -> list[tuple[int, dict[str, layers.LayerCall]]]:
    """The layer call sites, each the sequential call and the rank calls that run it (graph ->
    call), with its occurrence: the how-manieth rank call of that sequential call it is.
    Programs whose k-th calls run the same layer (tensor, data, context parallelism; or as many
    calls each, named apart, as a Megatron rank's are): the k-th call of every program
    (occurrence 0). Otherwise (a pipeline: each stage runs only its layers, once per
    micro-batch) the sequential call and, on each rank, the calls of the same name (its module
    path): the k-th of them on every rank that has k + 1 is occurrence k, one site each (a stage
    running a layer on micro-batch k relates to the k-th batch chunk of the sequential call's
    input, which its key states). A sequential call no rank runs is no site (an opaque node, as a
    call past the shortest program's count was). Which calls a site joins decides only what is
    solved together: a call's outputs relate only through a summary whose key its inputs satisfy."""
    def path(call: layers.LayerCall) -> str:  # (a label made unique: `h.0#3`; the node name is the module path)
        return call.node.name or call.label

    seq_calls = calls[SEQ]
    seq_paths = {path(c) for c in seq_calls}
    by_name = all(path(c) in seq_paths for g, _ in graphs for c in calls[g])
    in_step = all(path(c) == path(s) for g, _ in graphs for c, s in zip(calls[g], seq_calls))
    if len({len(calls[g]) for g, _ in graphs}) == 1 and (in_step or not by_name):
        return [(0, {g: calls[g][k] for g, _ in graphs}) for k in range(len(seq_calls))]
    by_path: dict[str, dict[str, list[layers.LayerCall]]] = {}
    for g, _ in graphs:
        if g != SEQ:
            by_path[g] = defaultdict(list)
            for c in calls[g]:
                by_path[g][path(c)].append(c)
    sites = []
    for call in seq_calls:
        runs = max((len(named.get(path(call), [])) for named in by_path.values()), default=0)
        for k in range(runs):
            ranks = {g: named[path(call)][k] for g, named in by_path.items() if len(named.get(path(call), [])) > k}
            sites.append((k, {SEQ: call, **ranks}))
    return sites


def _lower_layer_bodies_calls(main: FactSet, graphs: list[tuple[str, onnx.ModelProto]],
                              calls: dict[str, list[layers.LayerCall]], models: LoadedModels, n: int) -> None:
    """The calls each rank's layer functions make (body_coll facts, once per rank and distinct
    function, whether a call site joins its calls or not), so that the call schedule is checked
    over everything a rank runs, in order (refine/diagnose/schedule.py)."""
    groups: dict[str, tuple[int, ...]] = {}
    for g, model in graphs:
        if g == SEQ:
            continue
        functions = layers.local_functions(model)
        done: set[layers.FunctionKey] = set()
        for call in calls[g]:
            fn = call.function
            if (fn.domain, fn.name) in done:
                continue
            done.add((fn.domain, fn.name))
            body = layers.body_nodes(fn, functions, list(fn.input), list(fn.output), "", models.paths[g])
            lower_body_calls(g, op_name(fn.domain, fn.name), body, models.paths[g], n, main, groups)
    add_groups(main, groups)


def _set_aside_layer_params(main: FactSet, graphs: list[tuple[str, onnx.ModelProto]],
                            calls: dict[str, list[layers.LayerCall]], lowered: dict) -> None:
    """Declared tensors that only layer calls read (a layer's weights: most of a big model's
    tensors) need no lemma in the main graphs, only their declared relation in the layer keys:
    their input_rel rows become param_rel rows, and their shapes are dropped, so the main solve
    costs little per layer. Only tensors declared on every rank are set aside: their declared
    layouts rebuild them, which is all the report needs to know of them."""
    only_calls: set[str] = set()
    for g, model in graphs:
        positions = {c.position for c in calls[g]}
        readers: dict[str, set[bool]] = defaultdict(set)
        for i, node in enumerate(model.graph.node):
            for x in node.input:
                readers[x].add(i in positions)
        outputs = {vi.name for vi in model.graph.output}
        only_calls |= {lowered[g].tid(x) for x, kinds in readers.items() if kinds == {True} and x not in outputs}
    ranks: dict[str, set[str]] = defaultdict(set)
    for s, t, _ in main.rows["input_rel"]:
        if s in only_calls and t in only_calls:
            ranks[str(s)].add(str(t).split(":", 1)[0])
    n = len(graphs) - 1  # declared on every rank, so the declared layouts rebuild it (report.lp)
    aside_seq = {s for s, gs in ranks.items() if len(gs) == n}
    keep = []
    for s, t, lay in main.rows["input_rel"]:
        (main.rows["param_rel"] if s in aside_seq and t in only_calls else keep).append((s, t, lay))
    main.rows["input_rel"] = keep
    aside = aside_seq | {t for _, t, _ in main.rows["param_rel"]}
    for name in ("dim", "ndim", "dtype"):
        main.rows[name] = [row for row in main.rows[name] if row[1] not in aside]


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def _lower_template(name: str, graphs: list[tuple[str, onnx.ModelProto]], site_calls: dict[str, layers.LayerCall],
                    in_types: dict[str, list[onnx.TypeProto | None]], models: LoadedModels, n: int,
                    infer_body: BodyInference) -> FactSet:
    """One template's bodies as graphs of their own, values named `T<k>/<formal name>`."""
    facts = FactSet()
    pieces = []
    formal_inputs: set[str] = set()
    for g, model in graphs:
        call = site_calls[g]
        fn = call.function
        actual_in = [f"{name}/{f}" if i < len(call.node.input) and call.node.input[i] else "" for i, f in enumerate(fn.input)]
        actual_out = [f"{name}/{f}" if i < len(call.node.output) and call.node.output[i] else "" for i, f in enumerate(fn.output)]
        piece = layers.call_model(model, call, in_types[g] + [None] * (len(fn.input) - len(in_types[g])),
                                  actual_in, actual_out, f"{name}/", models.paths[g])
        pieces.append((g, infer_body(piece, models.paths[g]), models.paths[g]))
        formal_inputs.update(x for x in actual_in if x)
        for i, x in enumerate(actual_in):
            if x:
                facts.add("param", g, i, f"{g}:{x}")
        for i, x in enumerate(actual_out):
            if x:
                facts.add("result", g, i, f"{g}:{x}")
    lower_graphs(pieces, n, formal_inputs, facts)
    return facts


def _infer_main(model: onnx.ModelProto, path: Path, n: int, calls: list[layers.LayerCall],
                infer_body: BodyInference) -> tuple[onnx.ModelProto, dict[str, onnx.TypeProto]]:
    """Shape inference of a main graph whose layer calls are opaque to ONNX: infer the graph
    without the calls (their typed outputs as graph inputs), type each call whose inputs are
    typed by inferring its body once per distinct (function, input types), and repeat until
    nothing new is typed (a chain of calls needs one pass). As in `infer_shapes`, the types the
    model declares are checked against the inferred ones and never adopted."""
    if not calls:
        inferred = infer_body(model, path)
        return inferred, value_types(inferred.graph)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    declared = take_declared_types(model.graph)
    positions = {c.position for c in calls}
    known: dict[str, onnx.TypeProto] = {}
    body_types: dict[tuple[str, str, tuple[bytes, ...]], list[onnx.TypeProto | None]] = {}
    types: dict[str, onnx.TypeProto] = {}
    base: onnx.ModelProto | None = None
    for _ in range(len(calls) + 1):
        base = _without_calls(model, positions, known)
        types = value_types(infer_body(base, path).graph)  # (DP copies of a TP program: inferred once)
        types.update(known)
        progressed = False
        for call in calls:
            if call.node.output and call.node.output[0] in known:
                continue
            if any(x and x not in types for x in call.node.input):
                continue
            in_types = [types[x] if x else None for x in call.node.input]
            key = (call.function.domain, call.function.name, tuple(t.SerializeToString() if t else b"" for t in in_types))
            if key not in body_types:
                body_types[key] = _call_output_types(model, call, in_types, path, infer_body)
            for x, tp in zip(call.node.output, body_types[key]):
                if x and tp is not None:
                    known[x] = tp
                    types[x] = tp
            progressed = True
        if not progressed:
            break
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.functions[:]
    del out.graph.value_info[:]
    outputs = {vi.name for vi in out.graph.output}
    inputs = {vi.name for vi in out.graph.input} | {i.name for i in out.graph.initializer}
    for name, tp in types.items():
        if name not in outputs and name not in inputs:
            out.graph.value_info.append(onnx.helper.make_value_info(name, tp))
    for vi in out.graph.output:
        if name_typed := types.get(vi.name):
            vi.type.CopyFrom(name_typed)
    check_declared_types(declared, types, path)
    return out, value_types(out.graph)


def _without_calls(model: onnx.ModelProto, positions: set[int], known: dict[str, onnx.TypeProto]) -> onnx.ModelProto:
    """The main graph minus its calls; the calls' outputs typed so far become graph inputs, and
    the nodes that read (through other nodes) a call output not typed yet wait for a later pass,
    so that the proxy is a well-formed graph for strict inference."""
    proxy = onnx.ModelProto()
    proxy.CopyFrom(model)
    del proxy.functions[:]
    produced = {vi.name for vi in model.graph.input} | {i.name for i in model.graph.initializer} | set(known) | {""}
    nodes = []
    for i, node in enumerate(model.graph.node):  # (topological order)
        if i not in positions and all(x in produced for x in node.input):
            nodes.append(node)
            produced.update(node.output)
    del proxy.graph.node[:]
    proxy.graph.node.extend(nodes)
    for name, tp in known.items():
        proxy.graph.input.append(onnx.helper.make_value_info(name, tp))
    kept = [vi for vi in model.graph.output if vi.name in produced]
    del proxy.graph.output[:]
    proxy.graph.output.extend(kept)
    return proxy


def _call_output_types(model: onnx.ModelProto, call: layers.LayerCall, in_types: list[onnx.TypeProto | None],
                       path: Path, infer_body: BodyInference) -> list[onnx.TypeProto | None]:
    fn = call.function
    actual_in = [f"in{i}" if i < len(call.node.input) and call.node.input[i] else "" for i in range(len(fn.input))]
    actual_out = [f"out{i}" for i in range(len(fn.output))]
    piece = layers.call_model(model, call, in_types + [None] * (len(fn.input) - len(in_types)), actual_in, actual_out,
                              "body/", path)
    body = value_types(infer_body(piece, path).graph)
    return [body.get(x) for x in actual_out]


# --- facts directories -------------------------------------------------------------------------


def write_program(program: Program, out_dir: Path) -> None:
    """Write a program all or nothing: main facts in `out_dir`, templates in `templates/T<k>/`."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".refine-facts-", dir=out_dir.parent))
    try:
        write_facts_dir(program.main, tmp)
        for name, facts in program.templates.items():
            (tmp / TEMPLATES_DIR / name).mkdir(parents=True)
            write_facts_dir(facts, tmp / TEMPLATES_DIR / name)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_program(facts_dir: Path) -> Program:
    """Read what `write_program` wrote; every template a call site names must be there."""
    program = Program(read_facts_dir(facts_dir))
    for (_, name) in program.main.rows["callsite"]:
        if name not in program.templates:
            tdir = facts_dir / TEMPLATES_DIR / str(name)
            if not tdir.is_dir():
                raise InputError(tdir, f"missing: call sites refer to template {name!r}")
            program.templates[str(name)] = read_facts_dir(tdir)
    return program
