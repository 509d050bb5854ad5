"""`check`: the numeric proof that an export is right.

The torch sequential model and the exported programs run on the same random inputs, with the
torch model's own weights: the sequential ONNX program must compute what torch computes, and
the rank programs (run together by refine.diagnose.simulate, collectives executed) must reconstruct
it under the declared output layouts. The weights fed to rank r are the torch weights cut by
the layouts in refine.json (refine.config.shard_bounds), so a wrongly derived layout shows up
as a mismatch. Separately, the weights each rank file *stores* (what DTensor put on that rank)
must equal the declared layout applied to the sequential weights, exactly.

With a device mesh (refine.json `mesh`), a layout `over` a mesh dim splits its tensor along that
dim only: the rank whose coordinate there is k gets piece k, so every line of ranks along the dim
holds the same split. An output sharded over a mesh dim is rebuilt once per such line, and every
line must give the sequential output; the ranks that hold the same piece (one per line) must
moreover agree exactly, as replicas computed by one program do.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from pydantic import TypeAdapter

from refine.exporters.capture.export import MANIFEST_NAME
from refine.exporters.errors import ExportError
from refine.config import (
    SEQ_NAME,
    Layout,
    ModelConfig,
    PartialLayout,
    RepLayout,
    ShardLayout,
    load_config,
)
from refine.lowering.layers import inline_calls
from refine.lowering.row_copies import RankPrograms
from refine.precision import tolerance
from refine.diagnose.simulate import (
    SimulationError,
    cut_shards,
    cut_two_dim,
    declared_values,
    place_shards,
    rebuild_two_dim,
    run_programs,
)

_LAYOUT = TypeAdapter(Layout)


@dataclass
class CheckResult:
    """Pass/fail plus one line per comparison."""

    ok: bool = True
    lines: list[str] = field(default_factory=list)

    def add(self, ok: bool, line: str) -> None:
        self.ok &= ok
        self.lines.append(("ok    " if ok else "FAIL  ") + line)

    def render(self) -> str:
        return "\n".join([*self.lines, "check: " + ("PASSED" if self.ok else "FAILED")])


def distribute(layout: Layout, value: np.ndarray, world: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Rank k's tensor for the sequential `value` under `layout`."""
    if isinstance(layout, RepLayout):
        return [value.copy() for _ in range(world)]
    if isinstance(layout, ShardLayout):
        return cut_shards(layout, value, world)
    assert isinstance(layout, PartialLayout)
    if layout.op == "max":
        return [value if k == 0 else value - np.abs(rng.standard_normal(value.shape)).astype(value.dtype) for k in range(world)]
    parts = [rng.standard_normal(value.shape).astype(value.dtype) for _ in range(world - 1)]
    return [value - sum(parts, np.zeros_like(value)), *parts]


def distribute_in(config: ModelConfig, layout: Layout, value: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Every rank's tensor for `value` in `config`'s world: `distribute` over all ranks, or, for a
    layout `over` a mesh dim, over that dim's coordinates (the rank at coordinate k gets piece k,
    one split for every line of ranks along the dim)."""
    if getattr(layout, "over", None) is None:
        return distribute(layout, value, config.world_size, rng)
    assert isinstance(layout, (ShardLayout, PartialLayout))
    if isinstance(layout, ShardLayout) and layout.then is not None:
        return cut_two_dim(layout, value, config)
    splits = [config.split_of(layout, r) for r in range(config.world_size)]
    pieces = distribute(layout.model_copy(update={"over": None}), value, splits[0][1], rng)
    return [pieces[k] for k, _n in splits]


def mesh_lines(config: ModelConfig, layout: ShardLayout | PartialLayout, ranks: list[int]) -> list[list[int]]:
    """The lines of `ranks` that each hold the whole tensor under `layout`, each in piece order:
    without `over`, all of them (rank k holds piece k); `over` a mesh dim, one line per coordinate
    of the other dims, ordered by the coordinate on that dim."""
    if getattr(layout, "over", None) is None or config.mesh is None:
        return [list(ranks)]
    lines: dict[tuple[int, ...], list[int]] = {}
    for r in ranks:
        coords = config.mesh.coordinates(r)
        lines.setdefault(tuple(c for dim, c in coords.items() if dim != layout.over), []).append(r)
    return [sorted(line, key=lambda r: config.split_of(layout, r)[0]) for line in lines.values()]


def reconstruct(layout: Layout, parts: list[np.ndarray]) -> np.ndarray:
    """The sequential tensor the ranks' `parts` stand for under `layout`."""
    if isinstance(layout, RepLayout):
        raise ValueError("a replicated tensor is compared rank by rank")
    if isinstance(layout, ShardLayout):
        return place_shards(layout, parts)
    stack = np.stack([p.astype(np.float64) for p in parts])
    return (stack.sum(axis=0) if layout.op == "sum" else stack.max(axis=0)).astype(parts[0].dtype)


def _error(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max |got - want|, max |want|); an infinite error if the shapes differ."""
    if got.shape != want.shape:
        return float("inf"), 0.0
    if not want.size:
        return 0.0, 0.0
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float(np.max(diff)), float(np.max(np.abs(want)))


def _within(err: float, scale: float, rel_tol: float) -> bool:
    return err <= rel_tol * max(1.0, scale)


def _random_inputs(specs: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Integer inputs (token ids) uniform in [0, high) (and, declared `also`, some of those values:
    labels' ignore index), float inputs standard normal."""
    out = {}
    for name, spec in specs.items():
        dtype = torch.empty((), dtype=getattr(torch, spec["dtype"])).numpy().dtype
        if "high" in spec:
            out[name] = declared_values((0, spec["high"]), spec.get("also"), spec["shape"], rng).astype(dtype)
        else:
            out[name] = rng.standard_normal(spec["shape"]).astype(dtype)
    return out


def _torch_outputs(module: torch.nn.Module, inputs: list[torch.Tensor], names: list[str], train: bool) -> dict[str, np.ndarray]:
    """What torch computes: the forward's outputs, or a training step's loss and gradients."""
    if train:
        from refine.exporters.capture.train import reference

        return {n: t.numpy() for n, t in reference(module, inputs).items()}
    with torch.no_grad():
        ref = module(*inputs)
    return {n: t.detach().numpy() for n, t in zip(names, ref if isinstance(ref, (tuple, list)) else [ref])}


_STORED_HINT = (" (each rank must hold its chunk of the sequential module's weights: build the rank modules "
                "with the same seed and parallelize with `parallelize_module(..., src_data_rank=None)`, which "
                "keeps each rank's own chunk instead of broadcasting rank 0's; or pass compare_stored=False if "
                "your ranks are seeded otherwise)")


def check(
    out_dir: Path | str,
    seq_module: torch.nn.Module | None = None,
    *,
    seed: int = 0,
    rel_tol: float | None = None,
    compare_stored: bool = True,
) -> CheckResult:
    """Run torch and the exported programs on the same random inputs and compare (see module doc).

    `seq_module` defaults to the zoo model the manifest names. `compare_stored=False` skips the
    stored-weights comparison (for rank factories not seeded like the sequential module).
    Tolerance: max|diff| <= rel_tol * max(1, max|expected|); by default that of the float formats
    the programs round to (refine/precision.py: 1e-4 for float32 programs).
    """
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ExportError(f"{manifest_path}: missing (not a directory written by refine export)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("meta"):
        raise ExportError(f"{out_dir}: exported with --meta, it has no weights to check")
    with contextlib.ExitStack() as scope:
        if seq_module is None:
            seq_module = scope.enter_context(_reference_module(out_dir, manifest))
        seq_module.eval()
        return _compare(out_dir, manifest, seq_module, seed, rel_tol, compare_stored)


@contextlib.contextmanager
def _reference_module(out_dir: Path, manifest: dict[str, Any]) -> Iterator[torch.nn.Module]:
    """The torch model a zoo export names, usable inside the block (Megatron-Core's needs its
    one-rank process group and CPU shims while it runs)."""
    zoo_entry = manifest.get("zoo")
    if not zoo_entry:
        raise ExportError(f"{out_dir}: not a zoo export; pass the sequential torch module")
    if zoo_entry.get("framework") == "megatron-core":
        from refine.exporters.frameworks import megatron

        with megatron.reference_model(zoo_entry) as module:
            yield module
        return
    if zoo_entry.get("framework") == "torchtitan":  # torchtitan's Llama 3 at one rank (exporters/frameworks/torchtitan.py)
        from refine.exporters.frameworks import torchtitan

        with torchtitan.reference_model(zoo_entry) as module:
            yield module
        return
    if zoo_entry.get("framework") == "transformers":  # an HF model type (exporters/frameworks/transformers.py)
        from refine.exporters.frameworks import transformers

        with transformers.reference_model(zoo_entry) as module:
            yield module
        return
    if zoo_entry.get("ep"):  # the zoo model with its MoE experts grouped (exporters/strategies/expert.py)
        from refine.exporters.strategies import expert

        yield expert.build(zoo_entry["model"], zoo_entry["config"], zoo_entry["seed"], layers=zoo_entry.get("layers"))
        return
    if zoo_entry.get("loss"):  # the zoo model returning its training loss (exporters/strategies/context_export.py, --cp --loss)
        from refine.exporters.strategies import context_export as context

        yield context.loss_model(zoo_entry["model"], zoo_entry["config"], zoo_entry["seed"],
                                 layers=zoo_entry.get("layers"))
        return
    from refine.exporters.zoo import models as zoo

    yield zoo.build(zoo_entry["model"], zoo_entry["config"], zoo_entry["seed"], layers=zoo_entry.get("layers"))


def _compare(out_dir: Path, manifest: dict[str, Any], seq_module: torch.nn.Module, seed: int, rel_tol: float | None,
             compare_stored: bool) -> CheckResult:
    """`check` once the torch module is at hand."""
    config = load_config(out_dir)
    world = config.world_size
    # layer calls inlined (values `CALL/NAME`), the way refine's simulator runs them
    seq = inline_calls(onnx.load(str(out_dir / SEQ_NAME)), out_dir / SEQ_NAME)
    ranks = RankPrograms(out_dir, config, load=lambda path: inline_calls(onnx.load(str(path)), path)).all()
    if rel_tol is None:
        rel_tol = tolerance([seq, *ranks])
    rng = np.random.default_rng(seed)
    result = CheckResult()

    inputs = _random_inputs(manifest["inputs"], rng)
    out_names = list(manifest["outputs"])
    torch_out = _torch_outputs(seq_module, [torch.from_numpy(v) for v in inputs.values()], out_names,
                               bool(manifest.get("train")))

    state = {n: t.detach() for n, t in seq_module.named_parameters(remove_duplicate=False)}
    state.update({n: t.detach() for n, t in seq_module.named_buffers(remove_duplicate=False)})
    state = {n: torch.view_as_real(t) if t.is_complex() else t for n, t in state.items()}  # (as ONNX holds it: real pairs)
    seq_inits = {i.name: numpy_helper.to_array(i) for i in seq.graph.initializer}
    rank_inits = [{i.name: i for i in m.graph.initializer} for m in ranks]
    rank_inputs = [{i.name for i in m.graph.input} for m in ranks]
    seq_feeds: dict[str, np.ndarray] = dict(inputs)
    rank_feeds: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    differ: list[str] = []
    for name, layout in config.inputs.items():
        if name in inputs:
            value = inputs[name]
        elif name in state:
            value = state[name].numpy().copy()
            if compare_stored and not np.array_equal(seq_inits.get(name), value):
                differ.append(f"seq:{name}")
        else:
            raise ExportError(f"refine.json declares {name!r}: not an input, parameter or buffer of the torch model")
        seq_feeds[name] = value
        try:
            parts = distribute_in(config, layout, value, rng)
        except ValueError as exc:
            result.add(False, f"{name}: its layout {layout.model_dump(exclude_none=True)} cannot cut {list(value.shape)}: {exc}")
            return result
        for r in range(world):
            if name in rank_inits[r] or name in rank_inputs[r]:
                rank_feeds[r][name] = parts[r]
            stored = rank_inits[r].get(name)
            if compare_stored and stored is not None and not isinstance(layout, PartialLayout):
                if not np.array_equal(numpy_helper.to_array(stored), parts[r]):
                    differ.append(f"rank{r}:{name}")
    if compare_stored:
        n_weights = len(set(config.inputs) - set(inputs))
        result.add(
            not differ,
            f"stored weights: the {n_weights} declared initializers of seq and every rank are the torch weights "
            "cut by their layouts" + (f"; not so for {len(differ)}: {', '.join(differ[:6])}" + _STORED_HINT
                                      if differ else ""),
        )

    try:
        sim = run_programs(seq, ranks, seq_feeds, rank_feeds)
    except SimulationError as exc:
        result.add(False, f"the programs cannot run on these feeds: {' '.join(str(exc).split())[:400]}")
        return result
    for name in out_names:
        layout = _LAYOUT.validate_python(manifest["outputs"][name])
        seq_value = sim.seq[name]
        err, scale = _error(seq_value, torch_out[name])
        result.add(_within(err, scale, rel_tol), f"{name}: seq.onnx vs torch: max|diff| {err:.2e} (max|value| {scale:.3g})")
        holders = [r for r in range(world) if name in sim.ranks[r]]  # (a pipeline's last stage only)
        if isinstance(layout, RepLayout):
            errors = [_error(sim.ranks[r][name], seq_value)[0] for r in holders]
            err, worst = max(errors), holders[int(np.argmax(errors))]
            who = "every rank's" if len(holders) == world else f"every rank's of {len(holders)} holding it"
            result.add(_within(err, scale, rel_tol), f"{name}: {who} (rep) vs seq.onnx: worst rank {worst} max|diff| {err:.2e}")
        else:
            _compare_pieces(result, name, layout, config, {r: sim.ranks[r][name] for r in holders}, seq_value,
                            scale, rel_tol)
    return result


def _compare_pieces(result: CheckResult, name: str, layout: ShardLayout | PartialLayout, config: ModelConfig,
                    held: dict[int, np.ndarray], seq_value: np.ndarray, scale: float, rel_tol: float) -> None:
    """The lines of `result` for an output split between ranks (`held`: rank -> its piece): every
    line of ranks that holds the whole output (all of them, or each line along a mesh dim) rebuilds
    seq.onnx's value; along a mesh dim, the lines hold exactly the same pieces too (a two-dim
    shard: every plane of ranks along its two dims rebuilds it)."""
    if layout.then is not None:
        rebuilt = rebuild_two_dim(layout, held, config)
        errors = [_error(value, seq_value)[0] for _ranks, value in rebuilt] or [float("inf")]
        worst = ", ".join(map(str, rebuilt[int(np.argmax(errors))][0])) if rebuilt else "none whole"
        result.add(_within(max(errors), scale, rel_tol),
                   f"{name}: each of the {len(rebuilt)} planes of ranks along {layout.over} x {layout.then.over} "
                   f"({layout.layout}) reconstructed vs seq.onnx: worst plane ranks {worst} max|diff| {max(errors):.2e}")
        return
    lines = mesh_lines(config, layout, list(held))
    errors = [_error(reconstruct(layout, [held[r] for r in line]), seq_value)[0] for line in lines]
    err = max(errors)
    if len(lines) == 1:
        what = f"the {config.world_size} ranks' ({layout.layout}) reconstructed vs seq.onnx:"
    else:
        worst = ", ".join(map(str, lines[int(np.argmax(errors))]))
        what = (f"each of the {len(lines)} lines of ranks along {layout.over} ({layout.layout}) reconstructed vs "
                f"seq.onnx: worst line ranks {worst}")
    result.add(_within(err, scale, rel_tol), f"{name}: {what} max|diff| {err:.2e}")
    if len(lines) > 1:
        result.add(*_pieces_agree(name, layout, [[held[r] for r in line] for line in lines]))


def _pieces_agree(name: str, layout: ShardLayout | PartialLayout, lines: list[list[np.ndarray]]) -> tuple[bool, str]:
    """Whether the lines of ranks (each in piece order) hold exactly the same pieces, as the copies
    of one split over a mesh dim are (one program on the same inputs); a line saying which differ."""
    differ = []
    for k, copies in enumerate(zip(*lines)):
        spread = max(_error(c, copies[0])[0] for c in copies)
        if spread:
            differ.append(f"{layout.over}={k}: max|diff| {spread:.2e} between its {len(copies)} ranks")
    return not differ, (f"{name}: the {len(lines)} copies of each piece over {layout.over} agree exactly"
                        + (f"; not so for {'; '.join(differ)}" if differ else ""))
