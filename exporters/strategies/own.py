"""Your own module, exported as you run it: the forward, or one training step with your loss.

`export_train(model, loss_fn, batch, world_size, out, parallelize=..., data_parallel=...)` takes
the user's `nn.Module`, their loss `loss_fn(outputs, batch)` and an example batch, and writes a
model directory whose sequential program is one training step on the whole batch (the loss,
and the gradient of every parameter) and whose rank programs are that step as the ranks run
it, with torch's own semantics and nothing for the user to write:

- `parallelize(model, mesh)`: the user's own TP plan (DTensor `parallelize_module`, or modules
  of their own with `torch.distributed` collectives), applied to a copy of the model on each
  rank under a fake process group, `mesh` a 1-D DeviceMesh over the ranks. Every rank takes
  the whole batch.
- `parallelize` with `data_parallel="ddp"` and `dp=D`: a (dp, tp) mesh of D rows of
  world_size / D ranks, the plan on each row's 1-D TP mesh, DDP over each column
  (exporters/strategies/own_mesh.py; verified on one row, the others by symmetry).
- `data_parallel="ddp"`: as `DistributedDataParallel`: each rank a replica on its slice of the
  batch (every batch tensor cut along dim 0), its loss exactly as `loss_fn` computes it on that
  slice, its gradients all-reduced with avg. The loss the ranks report is their losses
  all-reduced with avg (as a training loop logs it).
- `data_parallel="fsdp"`: as FSDP2's `fully_shard`: every parameter sharded on dim 0, all-gathered
  for use, its gradient reduce-scattered with avg (the gather's backward); loss as with DDP.
- `micro_batches=M`: gradient accumulation as torch's recipe writes it: the rank's batch cut into
  M micro-batches along dim 0, each one's `loss_fn(...) / M` differentiated, the gradients
  summed before they are reduced.

So a loss that is a mean over the batch rows verifies under DDP, and one that is not (a sum, a
mean over a count only the rank sees) is refuted where it goes wrong: refine checks torch's
semantics against the sequential step, not a convention of its own.

The collectives this module issues on the user's behalf (DDP's and FSDP's) are stamped with
the user's call site (exporters/capture/call_site.py) and named after the parameter's module
(`down (backward)/AllReduce`), so that a report points at the user's line, never at this file.
The hooks exporters/capture/train.py reads (`computes_loss`, `micro_batches`, `finalize_loss`,
`finalize_grads`, `unshard_params`, `step_input_names`) are this module's implementation detail.

`export_forward(model, inputs, world_size, out, parallelize=..., data_parallel=...)` is the same
for the forward: the sequential model on the whole input, the ranks as `parallelize` or DDP
leaves them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from refine.exporters.capture.call_site import keep_frames_of, traced_at, user_call_site
from refine.exporters.capture.train import BACKWARD, BACKWARD_KEY, LABELS, token_cross_entropy
from refine.exporters.errors import ExportError

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

Batch = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
LossFn = Callable[[Any, Any], torch.Tensor]
Parallelize = Callable[[nn.Module, Any], "nn.Module | None"]
DataParallel = Literal["ddp", "fsdp"]
BATCH_AXIS = 0


class Options(BaseModel):
    """The scalar options of an export of the user's own module, checked at the API's boundary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: int = Field(ge=1)
    data_parallel: DataParallel | None = None
    micro_batches: int = Field(default=1, ge=1)
    dp: int | None = Field(default=None, ge=1)

    @property
    def data_ranks(self) -> int:
        """How many ways data parallelism cuts the batch: the mesh's DP size, else every rank."""
        return self.dp if self.dp is not None else self.world_size if self.data_parallel else 1


def _options(**values: Any) -> Options:
    try:
        return Options(**values)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise ExportError(f"{where}: {problem['msg']} (got {problem.get('input')!r})") from None


# --- the batch: which tensors the program takes, and which of them the model gets --------------


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """How a user's batch is laid out: the program's input names (the batch's keys, or for a
    tuple the forward's argument names then `labels`), whether it is a dict, and which entries
    the model's forward gets (a dict's entries its forward names, by keyword; a tuple's all but
    the last, in order)."""

    names: tuple[str, ...]
    keyed: bool
    model_args: tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module, batch: Batch, loss: bool = True) -> BatchShape:
        forward = inspect.signature(model.forward).parameters.values()
        named = [p.name for p in forward if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if isinstance(batch, Mapping):
            names = tuple(batch)
            if not names or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in batch.items()):
                raise ExportError("batch: a dict of named tensors (or a tuple of tensors) with at least one entry")
            takes_all = any(p.kind == p.VAR_KEYWORD for p in forward)
            args = tuple(n for n in names if takes_all or n in named)
            if not args:
                raise ExportError(f"batch: none of its entries {list(names)} is an argument of "
                                  f"{type(model).__name__}.forward{tuple(named)}")
            return cls(names, True, args)
        tensors = tuple(batch)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ExportError("batch: a dict of named tensors (or a tuple of tensors) with at least one entry")
        n_model = len(tensors) - 1 if loss and len(tensors) > 1 else len(tensors)
        inputs = named[:n_model] if len(named) >= n_model else [f"input_{i}" for i in range(n_model)]
        names = (*inputs, *([LABELS] if n_model < len(tensors) else []))
        if len(set(names)) < len(names):
            names = tuple(f"input_{i}" for i in range(len(tensors)))
        return cls(names, False, names[:n_model])

    def tensors(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        return tuple(batch[n] for n in self.names) if self.keyed else tuple(batch)  # type: ignore[index]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Batch:
        """The batch as the user's code sees it (a dict or a tuple) from the program's tensors."""
        return dict(zip(self.names, tensors)) if self.keyed else tuple(tensors)

    def call(self, forward: Callable[..., Any], batch: Batch) -> Any:
        """The model's forward on its entries of `batch`."""
        if self.keyed:
            return forward(**{n: batch[n] for n in self.model_args})  # type: ignore[index]
        return forward(*tuple(batch)[: len(self.model_args)])

    def rows(self, batch: Batch) -> int:
        """The batch's rows (dim 0 of every tensor, which must agree)."""
        sizes = {n: t.shape[BATCH_AXIS] if t.dim() else None for n, t in zip(self.names, self.tensors(batch))}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise ExportError(f"batch: data parallelism and accumulation cut every batch tensor along dim 0, "
                              f"and these have different first dimensions: {sizes}")
        return next(iter(sizes.values()))  # type: ignore[return-value]


# --- the training step: the user's loss, torch's data-parallel semantics -----------------------


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a rank's step does beyond the user's code: their loss on their batch layout, the
    data-parallel semantics (None: none), and the user's call site for the collectives issued
    on their behalf."""

    loss_fn: LossFn
    batch: BatchShape
    data_parallel: DataParallel | None = None
    site: str = ""


class OwnTrainingStep:
    """Mixed into the class of (a copy of) the user's module, so that its parameters keep their
    FQNs: the hooks exporters/capture/train.py traces a step through (module doc)."""

    computes_loss = True
    micro_batches = 1
    recipe: Recipe
    data_group: Any = None  # (DDP's process group on a DP x TP mesh: the rank's column; None: the world)

    def _data_group(self) -> Any:
        return self.data_group if self.data_group is not None else dist.group.WORLD

    def step_input_names(self) -> list[str]:
        return list(self.recipe.batch.names)

    def forward(self, *tensors: torch.Tensor, labels: torch.Tensor,
                all_labels: torch.Tensor | None = None) -> torch.Tensor:
        """The user's loss on the batch (or one micro-batch of it, its share 1/M)."""
        batch = self.recipe.batch.rebuild((*tensors, labels))
        outputs = self.recipe.batch.call(super().forward, batch)  # type: ignore[misc]
        with traced_at("", {**(fx_traceback.current_meta.get("nn_module_stack") or {}),
                            "L__loss__1": ("loss", type(self.recipe.loss_fn))}):  # (its ops named `loss/...`)
            loss = self.recipe.loss_fn(outputs, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ExportError(f"loss_fn must return a tensor with one element, it returns "
                              f"{type(loss).__name__}{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        if self.micro_batches == 1:
            return loss
        with traced_at(self.recipe.site, {"L__self__1": ("", type(self))}):  # (the recipe's 1/M: the user's loop)
            return loss / self.micro_batches

    def finalize_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a data-parallel step reports: every rank's, averaged (as a loop logs it)."""
        if self.recipe.data_parallel is None:
            return loss
        with traced_at(self.recipe.site, {"L__self__1": ("", type(self))}):  # (a module stack: not the backward's)
            return funcol.all_reduce(loss, "avg", self._data_group())

    def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """DDP: every gradient all-reduced with avg (FSDP's are reduce-scattered in backward)."""
        if self.recipe.data_parallel != "ddp":
            return grads
        out = {}
        for fqn, g in grads.items():
            with traced_at(self.recipe.site, _module_stack(self, fqn, backward=True)):  # type: ignore[arg-type]
                out[fqn] = funcol.all_reduce(g, "avg", self._data_group())
        return out

    def unshard_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """FSDP: every parameter all-gathered from the ranks' dim-0 shards for use."""
        if self.recipe.data_parallel != "fsdp":
            return params
        from torch.distributed.tensor import DTensor

        return {fqn: GatherShard.apply(p.to_local() if isinstance(p, DTensor) else p, self.recipe.site,
                                       _module_stack(self, fqn), _module_stack(self, fqn, backward=True))  # type: ignore[arg-type]
                for fqn, p in params.items()}


class GatherShard(torch.autograd.Function):
    """FSDP2's parameter all-gather along dim 0; its backward reduce-scatters the gradient with
    avg, as fully_shard does. Both are traced at the user's call site, under the parameter's module."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, site: str, stack: dict[str, Any], backward_stack: dict[str, Any]) -> torch.Tensor:
        ctx.site, ctx.stack = site, backward_stack
        with traced_at(site, stack):
            return funcol.all_gather_tensor(shard, BATCH_AXIS, dist.group.WORLD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        with traced_at(ctx.site, ctx.stack):
            return funcol.reduce_scatter_tensor(grad, "avg", BATCH_AXIS, dist.group.WORLD), None, None, None


def _module_stack(root: nn.Module, fqn: str, backward: bool = False) -> dict[str, tuple[str, Any]]:
    """The module stack of an op on parameter `fqn` (its owning module; marked backward, for its
    gradient), as exporters/capture/train.py records one."""
    owner = fqn.rpartition(".")[0]
    stack: dict[str, tuple[str, Any]] = {f"L__{owner or 'self'}__1": (owner, type(root.get_submodule(owner)))}
    if backward:
        stack[BACKWARD_KEY] = (owner, BACKWARD)
    return stack


@functools.cache
def _step_class(model_class: type[nn.Module]) -> type[nn.Module]:
    return type(model_class.__name__, (OwnTrainingStep, model_class), {"__module__": model_class.__module__})


def as_training_step(module: nn.Module, recipe: Recipe, micro_batches: int = 1) -> nn.Module:
    """`module` turned, in place, into one training step of `recipe` (OwnTrainingStep mixed into
    its class, its parameters keeping their FQNs)."""
    module.__class__ = _step_class(type(module))
    module.recipe, module.micro_batches = recipe, micro_batches  # type: ignore[assignment]
    return module


def reference_step(model: nn.Module, loss_fn: LossFn, batch: Batch) -> nn.Module:
    """The sequential training step of `model` with `loss_fn` on batches laid out as `batch` (a
    copy of the model): what `refine.exporters.check(out, reference_step(...))` compares an
    export_train directory with."""
    return as_training_step(copy.deepcopy(model), Recipe(loss_fn, BatchShape.of(model, batch)))


def _rank_module(model: nn.Module, parallelize: Parallelize | None, recipe: Recipe | None, micro_batches: int,
                 rank: int) -> nn.Module:
    """Rank `rank`'s module (called under its fake process group): a copy of `model`, parallelized
    by the user's `parallelize`, as a training step of `recipe` (None: the forward), its
    parameters sharded on dim 0 for FSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    from refine.exporters.strategies.data_parallel import shard_parameters

    module = copy.deepcopy(model)
    world = dist.get_world_size()
    if parallelize is not None:
        module = parallelize(module, init_device_mesh("cpu", (world,))) or module
    if recipe is not None:
        as_training_step(module, recipe, micro_batches)
        if recipe.data_parallel == "fsdp":
            shard_parameters(module, rank, world)
    return module


def _mesh_rank_module(model: nn.Module, parallelize: Parallelize | None, recipe: Recipe, micro_batches: int, dp: int,
                      tp: int, rank: int) -> nn.Module:
    """Rank `rank`'s step on a (dp, tp) mesh (called under its fake process group of D*T ranks): a
    copy of `model` under the user's plan on its row's TP mesh, its DDP collectives over its column
    (exporters/strategies/own_mesh.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    module = copy.deepcopy(model)
    module = (parallelize(module, grid["tp"]) if parallelize is not None else None) or module
    as_training_step(module, recipe, micro_batches)
    module.data_group = grid["dp"].get_group()  # type: ignore[assignment]
    return module


def _check_plan(model: nn.Module, options: Options, parallelize: Parallelize | None, rows: int | None) -> None:
    """The options fit together and the batch and the parameters split as they ask."""
    if parallelize is not None and options.data_parallel is not None and (options.data_parallel != "ddp"
                                                                          or options.dp is None):
        raise ExportError("parallelize with data_parallel needs a DP x TP mesh: pass data_parallel='ddp' and dp=D "
                          "(its DP size; world_size = D x the TP size)" + (" (FSDP with a TP plan is not built yet)"
                                                                          if options.data_parallel == "fsdp" else ""))
    if options.dp is not None and (parallelize is None or options.data_parallel is None):
        raise ExportError("dp: a DP x TP mesh takes both parallelize (the TP plan) and data_parallel='ddp'")
    if options.dp is not None and options.world_size % options.dp:
        raise ExportError(f"dp {options.dp} does not divide world_size {options.world_size} into mesh rows")
    if parallelize is None and options.data_parallel is None and options.world_size > 1:
        raise ExportError(f"world_size {options.world_size} with neither parallelize nor data_parallel: every rank "
                          "would run the sequential program; pass parallelize=... or data_parallel='ddp' or 'fsdp'")
    split = options.data_ranks * options.micro_batches
    if rows is not None and rows % split:
        raise ExportError(f"batch: its {rows} rows cannot be cut evenly into {split} pieces "
                          f"({options.data_ranks} data-parallel ranks x {options.micro_batches} micro-batches)")
    if options.data_parallel == "fsdp":
        for fqn, p in model.named_parameters():
            if p.dim() == 0 or p.shape[0] % options.world_size:
                raise ExportError(f"fsdp: parameter {fqn} of shape {list(p.shape)} cannot be split evenly between "
                                  f"{options.world_size} ranks along dim 0")


Ranges = Mapping[str, "int | tuple[int, Sequence[int]]"]


def input_layouts(names: Sequence[str], sliced: bool, ranges: Ranges | None
                   ) -> tuple[dict[str, dict[str, Any]] | None, dict[str, int] | None]:
    """refine.json's layouts of the program's inputs (each cut along dim 0 across data-parallel
    ranks, else replicated) with the values they may take beyond [0, high) (`also`: an ignore
    index), and the highs of the integer inputs, from `ranges` (name -> high or (high, also))."""
    unknown = sorted(set(ranges or {}) - set(names))
    if unknown:
        raise ExportError(f"ranges: {unknown} are not inputs {list(names)}")
    layouts: dict[str, dict[str, Any]] = {}
    highs: dict[str, int] = {}
    for name in names:
        spec = (ranges or {}).get(name)
        high, also = (spec, ()) if spec is None or isinstance(spec, int) else (spec[0], tuple(spec[1]))
        layout: dict[str, Any] = {"layout": "shard", "axis": BATCH_AXIS} if sliced else {"layout": "rep"}
        if also:
            if high is None:
                raise ExportError(f"ranges: {name}'s extra values {list(also)} need its high too: (high, {list(also)})")
            layout.update(range=[0, int(high)], also=[int(a) for a in also])
        if sliced or also:
            layouts[name] = layout
        if high is not None:
            highs[name] = int(high)
    return layouts or None, highs or None


def _semantics(options: Options, parallelize: Parallelize | None) -> str:
    what = {"ddp": ("the user's TP plan within each mesh row and " if options.dp is not None else "")
            + "DDP (each rank its batch slice, gradients all-reduced with avg)",
            "fsdp": "FSDP (parameters sharded on dim 0, all-gathered, gradients reduce-scattered with avg)",
            None: "the user's TP plan" if parallelize is not None else "one rank"}[options.data_parallel]
    return what + (f", {options.micro_batches} micro-batches accumulated" if options.micro_batches > 1 else "")


def export_train(model: nn.Module, loss_fn: LossFn, batch: Batch, world_size: int, out: Path | str, *,
                 parallelize: Parallelize | None = None, data_parallel: DataParallel | None = None,
                 micro_batches: int = 1, ranges: Ranges | None = None, layers: str | None = None,
                 workers: int | None = None, check: bool = False, dp: int | None = None) -> ExportResult:
    """Export one training step of the user's `model` with `loss_fn(outputs, batch)` on `batch`
    over `world_size` ranks to the model directory `out` (module doc for `parallelize`,
    `data_parallel`, `micro_batches` and `dp`, the DP size of a DP x TP mesh). Outputs: `loss` and
    `grad.<FQN>` per parameter.

    `batch`: a dict of named tensors (the program's inputs, by those names; the model's forward
    gets the entries it names) or a tuple (the forward gets all but the last, named `labels`).
    `ranges`: for integer entries, the values they take: `high` for [0, high) (labels: the classes),
    or `(high, [-100])` for those and an ignore index (refine then meets batches whose ranks
    ignore different numbers of labels). `layers`:
    the ModuleList whose distinct layers become functions (not with accumulation or FSDP).
    `check`: also run torch and the programs on random inputs; an ExportError if they differ.
    """
    from refine.exporters.capture.export import export

    options = _options(world_size=world_size, data_parallel=data_parallel, micro_batches=micro_batches, dp=dp)
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise ExportError("export_train(model, loss_fn, batch, ...): model must be an nn.Module and loss_fn callable")
    shape = BatchShape.of(model, batch)
    split = options.data_parallel is not None or options.micro_batches > 1
    _check_plan(model, options, parallelize, shape.rows(batch) if split else None)
    if layers is not None and (options.micro_batches > 1 or options.data_parallel == "fsdp"):
        raise ExportError("layers: accumulation and FSDP steps are exported flat (pass layers=None)")
    recipe = Recipe(loss_fn, shape, options.data_parallel, user_call_site())
    keep_frames_of(loss_fn)
    description = (f"{type(model).__name__}: one training step of the user's own module and loss, "
                   f"{_semantics(options, parallelize)}")
    if options.dp is not None:
        from refine.exporters.strategies.own_mesh import export_rows

        within_row, highs = input_layouts(shape.names, False, ranges)  # (every rank of a row takes the row's rows)
        result = export_rows(
            lambda: as_training_step(copy.deepcopy(model), dataclasses.replace(recipe, data_parallel=None)),
            functools.partial(_mesh_rank_module, model, parallelize, recipe, options.micro_batches, options.dp,
                              options.world_size // options.dp),
            shape.tensors(batch), shape.names, options.world_size, options.dp, out, within_row=within_row,
            highs=highs, layers=layers, workers=workers, description=description)
    else:
        seq = as_training_step(copy.deepcopy(model), dataclasses.replace(recipe, data_parallel=None))
        layouts, highs = input_layouts(shape.names, options.data_parallel is not None, ranges)
        result = export(
            seq, functools.partial(_rank_module, model, parallelize, recipe, options.micro_batches),
            shape.tensors(batch), options.world_size, out, input_layouts=layouts, input_ranges=highs,
            description=f"{description}, exported by refine.exporters.export_train",
            layers=layers, workers=workers, train=True, same_program=options.data_parallel == "ddp")
    if check:
        _checked(out, reference_step(model, loss_fn, batch))
    return result


def export_forward(model: nn.Module, inputs: Batch, world_size: int, out: Path | str, *,
                   parallelize: Parallelize | None = None, data_parallel: Literal["ddp"] | None = None,
                   ranges: Ranges | None = None, layers: str | None = None, workers: int | None = None,
                   check: bool = False) -> ExportResult:
    """Export the forward of the user's `model` on `inputs` (a tuple: its positional arguments; a
    dict: by name, in the order of its forward's arguments) over `world_size` ranks: each a copy
    parallelized by `parallelize(model, mesh)`, or with `data_parallel="ddp"` a replica on its
    slice of the inputs along dim 0 (and of the outputs)."""
    from refine.exporters.capture.export import export

    options = _options(world_size=world_size, data_parallel=data_parallel)
    if options.data_parallel == "fsdp":
        raise ExportError("export_forward: data_parallel 'fsdp' is a training step's (export_train)")
    if not isinstance(model, nn.Module):
        raise ExportError("export_forward(model, inputs, ...): model must be an nn.Module")
    args = _positional(model, inputs)
    _check_plan(model, options, parallelize, BatchShape.of(model, inputs, loss=False).rows(inputs)
                if options.data_parallel else None)
    names = [p for p in inspect.signature(model.forward).parameters][: len(args)]
    layouts, highs = input_layouts(names, options.data_parallel is not None, ranges)
    result = export(
        copy.deepcopy(model), functools.partial(_rank_module, model, parallelize, None, 1), args, options.world_size,
        out, input_layouts=layouts, input_ranges=highs, layers=layers, workers=workers,
        description=f"{type(model).__name__}: the forward of the user's own module, "
        f"{_semantics(options, parallelize)}, exported by refine.exporters.export_forward",
        same_program=options.data_parallel == "ddp")
    if check:
        _checked(out, copy.deepcopy(model))
    return result


def _positional(model: nn.Module, inputs: Batch) -> tuple[torch.Tensor, ...]:
    """The forward's arguments: a tuple as it is, a dict's entries in the forward's order (every
    entry one of its arguments)."""
    if not isinstance(inputs, Mapping):
        return tuple(inputs)
    order = [p for p in inspect.signature(model.forward).parameters]
    unknown = [k for k in inputs if k not in order]
    if unknown:
        raise ExportError(f"inputs: {unknown} are not arguments of {type(model).__name__}.forward{tuple(order)}")
    taken = [k for k in order if k in inputs]
    if taken != order[: len(taken)]:
        raise ExportError(f"inputs: the forward's first {len(taken)} arguments are {order[:len(taken)]}, "
                          f"the inputs name {taken}")
    return tuple(inputs[k] for k in taken)


def _checked(out: Path | str, reference: nn.Module) -> None:
    """The numeric check of the export (refine.exporters.check), an ExportError naming what differs."""
    from refine.exporters.capture.numeric import check

    outcome = check(out, reference)
    if not outcome.ok:
        failed = [line for line in outcome.lines if line.startswith("FAIL")]
        raise ExportError(f"{out}: the exported programs do not compute what torch computes: {failed[0] if failed else ''}")


def default_loss(outputs: Any, batch: Batch) -> torch.Tensor:
    """Token cross-entropy of the outputs (logits) against the batch's last entry (labels), mean
    over tokens: `refine export --train`'s loss, for a training step given no loss of its own."""
    labels = batch[list(batch)[-1]] if isinstance(batch, Mapping) else tuple(batch)[-1]
    return token_cross_entropy(outputs, labels)
