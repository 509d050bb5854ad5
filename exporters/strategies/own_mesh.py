"""Your own module's training step on a DP x TP mesh: your TP plan within each row, DDP over each column.

`export_train(model, loss_fn, batch, world_size, out, parallelize=plan, data_parallel="ddp", dp=D)`
(exporters/strategies/own.py) with both a TP plan and DDP: the world_size = D*T ranks form the mesh
`{"shape": [D, T], "dims": ["dp", "tp"]}`, row-major, rank d*T + t at (dp=d, tp=t), as
`init_device_mesh(device, (D, T), mesh_dim_names=("dp", "tp"))` lays them out. Rank (d, t) runs, as
torch does:

- `parallelize(copy of model, mesh["tp"])`: the user's plan on its row's 1-D TP mesh, TP rank t;
- DDP over its column `mesh["dp"]`: batch rows [d*B/D, (d+1)*B/D) of every batch tensor, its loss
  exactly as `loss_fn` computes it on them, every gradient (after the TP plan's own reductions)
  and the reported loss all-reduced with avg over the column.

Row 0's T ranks are captured (refine.exporters.capture.export, at the row's batch, in a fake process
group of all D*T ranks, so that the DDP all-reduces name their columns), the sequential step on the
whole batch apart, and the other rows are row 0's programs with their groups moved
(exporters/strategies/mesh.py `row_copies`): the cost grows with D only by the files written, and
`refine verify` proves row 0 alone, the other rows by symmetry (docs/rows.md).

refine.json: every batch tensor split along dim 0 over `dp` (with the values `ranges` gives); each
parameter its plan's layout over `tp`; the loss and each gradient likewise.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from torch import nn

from refine.exporters.errors import ExportError
from refine.exporters.strategies.mesh import DIMS, mesh_json, mesh_layout, row_copies, write_rows
from refine.exporters.strategies.own import (BATCH_AXIS, Batch, BatchShape, Parallelize, Ranges, Recipe,
                                             as_training_step, input_layouts)

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult


def mesh_rank_module(model: nn.Module, parallelize: Parallelize, recipe: Recipe, micro_batches: int, dp: int, tp: int,
                     rank: int) -> nn.Module:
    """Mesh rank `rank`'s step (called under its fake process group of D*T ranks): a copy of
    `model` under the user's plan on its row's TP mesh, its DDP collectives over its column."""
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh("cpu", (dp, tp), mesh_dim_names=DIMS)
    module = copy.deepcopy(model)
    module = parallelize(module, grid["tp"]) or module
    as_training_step(module, recipe, micro_batches)
    module.data_group = grid["dp"].get_group()  # type: ignore[assignment]
    return module


def export_train_on_mesh(model: nn.Module, recipe: Recipe, batch: Batch, world_size: int, dp: int, out: Path | str, *,
                         parallelize: Parallelize, micro_batches: int, ranges: Ranges | None, layers: str | None,
                         workers: int | None, description: str) -> ExportResult:
    """The DP x TP export (module doc) of `model`'s training step `recipe` on `batch`."""
    from refine.dist import register_schemas
    from refine.exporters.capture import export as api
    from refine.exporters.capture import train_program
    from refine.exporters.capture.rename import readable_node_names
    from refine.config import SEQ_NAME, rank_file_name

    tp = world_size // dp
    out = Path(out)
    api._check_out_dir(out)  # before the slow part
    shape: BatchShape = recipe.batch
    whole = shape.tensors(batch)
    rows = shape.rows(batch)
    row_batch = tuple(t[: rows // dp] for t in whole)  # (mesh row 0's rows)

    def sequential() -> nn.Module:
        return as_training_step(copy.deepcopy(model), dataclasses.replace(recipe, data_parallel=None))

    start = time.perf_counter()
    within_row, highs = input_layouts(shape.names, False, ranges)  # (every rank of a row takes the row's rows)
    with tempfile.TemporaryDirectory(prefix="refine-own-mesh-") as tmp:
        row = api.export(sequential(), functools.partial(mesh_rank_module, model, parallelize, recipe, micro_batches,
                                                         dp, tp),
                         row_batch, tp, Path(tmp) / "row", input_layouts=within_row, input_ranges=highs, layers=layers,
                         workers=workers, train=True, process_group_size=world_size)
        row_ranks = [onnx.load(str(row.out_dir / rank_file_name(t))) for t in range(tp)]
    seq_start = time.perf_counter()
    seq_info: dict[str, Any] = {}
    seq = train_program.to_onnx(sequential(), whole, layers=layers, info=seq_info)
    seq_seconds = time.perf_counter() - seq_start
    readable_node_names(seq)
    register_schemas()
    api._check_onnx(seq, SEQ_NAME)
    batched = set(shape.names)
    if any(layout.get("layout") != "rep" for name, layout in row.config["inputs"].items() if name in batched):
        raise ExportError(f"a batch tensor is split within a mesh row by the plan: {row.config['inputs']}")
    inputs = {name: {**layout, "layout": "shard", "axis": BATCH_AXIS, "over": "dp"} if name in batched
              else mesh_layout(layout, "tp") for name, layout in row.config["inputs"].items()}
    refine_json: dict[str, Any] = {
        "world_size": world_size, "mesh": mesh_json(tp, dp), "inputs": inputs,
        "outputs": {name: mesh_layout(layout, "tp") for name, layout in row.config["outputs"].items()},
        "description": f"{description}; a {dp} x {tp} mesh (dp, tp): the TP plan within each row, DDP over each "
                       "column, exported by refine.exporters.export_train (exporters/strategies/own_mesh.py)",
    }
    return write_rows(out, seq, seq_info, seq_seconds, row, row_copies(row_ranks, dp), refine_json, start,
                      whole_batch=rows, extra={})
