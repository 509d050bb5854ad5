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

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import torch
from torch import nn

from refine.exporters.errors import ExportError
from refine.exporters.strategies.mesh import mesh_json, mesh_layout, row_copies, write_rows

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

BATCH_AXIS = 0


def export_rows(sequential: Callable[[], nn.Module], rank_step: Callable[[int], nn.Module],
                batch: Sequence[torch.Tensor], names: Sequence[str], world_size: int, dp: int, out: Path | str, *,
                within_row: Mapping[str, dict[str, Any]] | None, highs: Mapping[str, int] | None,
                layers: str | None, workers: int | None, description: str) -> ExportResult:
    """The DP x TP export (module doc): `sequential()` the step on the whole `batch` (tensors named
    `names`, split along dim 0 between the rows), `rank_step(rank)` mesh rank `rank`'s step (built
    under its fake process group of all ranks); `within_row`, `highs`: the batch's layouts and
    value ranges within a row (exporters/strategies/own.py `input_layouts`)."""
    from refine.config import SEQ_NAME, rank_file_name
    from refine.dist import register_schemas
    from refine.exporters.capture import export as api
    from refine.exporters.capture import train_program
    from refine.exporters.capture.rename import readable_node_names

    tp = world_size // dp
    out = Path(out)
    api._check_out_dir(out)  # before the slow part
    rows = int(batch[0].shape[BATCH_AXIS])
    row_batch = tuple(t[: rows // dp] for t in batch)  # (mesh row 0's rows)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="refine-own-mesh-") as tmp:
        row = api.export(sequential(), rank_step, row_batch, tp, Path(tmp) / "row", input_layouts=within_row,
                         input_ranges=highs, layers=layers, workers=workers, train=True, process_group_size=world_size)
        row_ranks = [onnx.load(str(row.out_dir / rank_file_name(t))) for t in range(tp)]
    seq_start = time.perf_counter()
    seq_info: dict[str, Any] = {}
    seq = train_program.to_onnx(sequential(), batch, layers=layers, info=seq_info)
    seq_seconds = time.perf_counter() - seq_start
    readable_node_names(seq)
    register_schemas()
    api._check_onnx(seq, SEQ_NAME)
    batched = set(names)
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
