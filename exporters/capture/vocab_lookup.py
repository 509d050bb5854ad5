"""DTensor's vocab-parallel embedding lookup, in a form torch.export can capture.

A lookup in a table sharded along its rows (`Shard(0)`: HF's `embedding_rowwise`, torch's
`RowwiseParallel` on an `nn.Embedding`) is computed by DTensor in two ops: the lookup masks the
ids this rank does not own and keeps the mask in its output's `_MaskPartial` placement (a
Python object); the redistribution that sums the ranks' rows reads the mask back from that
placement and zeroes those rows first. torch.export records the two ops separately (its
training IR keeps DTensor ops whole), so the mask made inside the first is a tensor the second
reads from outside the graph: it is lifted as a fake constant and the export fails ("fake
tensor in the exported program constant's list ... lifted_tensor_N", or "Constant tensor ...
is not in the constants dictionary" in run_decompositions).

While a forward is captured (`vocab_parallel_lookup()`), such a lookup is handled by DTensor's
custom-op hook (`_custom_op_handlers`, the hook torch's own `loss_parallel` uses): the same
computation, both steps in the one op. The ids outside the rank's rows
[offset, offset + size) (DTensor's own `Shard.local_shard_size_and_offset`) are looked up at
local row 0 and their rows zeroed, and the result is a plain sum `Partial()` (the mask already
applied), which the caller's redistribution all-reduces as DTensor's would have. The values are
those of DTensor's `_MaskPartial._mask_tensor` / `MaskBuffer.apply_mask`, spelled with
`masked_fill` (their `x[mask] = 0` would lift its 0 as another constant). Any other placement
of the table or the ids goes to DTensor's own strategy. A training step is traced by make_fx
over eager autograd (refine.exporters.capture.train), where DTensor's own two ops trace fine:
this hook is not used there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _lookup(op_call: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """aten.embedding(weight, ids, ...) on DTensors: the vocab-parallel lookup when the table is
    row-sharded on a 1-D mesh and the ids replicated, else DTensor's own dispatch."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    weight, ids = args[0], args[1]
    row_sharded = isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and weight.placements == (Shard(0),)
    replicated_ids = not isinstance(ids, DTensor) or ids.placements == (Replicate(),)
    if not (row_sharded and replicated_ids and weight.dim() == 2):
        return _default(op_call, args, kwargs)
    mesh = weight.device_mesh
    size, offset = Shard.local_shard_size_and_offset(weight.shape[0], mesh.size(0), mesh.get_local_rank(0))
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
    foreign = (local_ids < offset) | (local_ids >= offset + size)
    rows = op_call(weight.to_local(), (local_ids - offset).masked_fill(foreign, 0), *args[2:], **kwargs)
    rows = rows.masked_fill(foreign.unsqueeze(-1), 0.0)
    shape = torch.Size((*ids.shape, weight.shape[1]))
    spec = DTensorSpec(mesh, (Partial(),), tensor_meta=TensorMeta(shape, rows.stride(), rows.dtype))
    return DTensor(rows, spec, requires_grad=rows.requires_grad)


def _default(op_call: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor's own dispatch of `op_call`, this hook set aside for the call."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    own = handlers.pop(op_call)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = own


@contextlib.contextmanager
def vocab_parallel_lookup() -> Iterator[None]:
    """While the block runs, a row-sharded DTensor embedding is looked up in one op (module doc);
    DTensor's previous hook for aten.embedding, if any, is restored on exit."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    op = torch.ops.aten.embedding.default
    saved = handlers.get(op)
    handlers[op] = _lookup
    try:
        yield
    finally:
        if saved is None:
            handlers.pop(op, None)
        else:
            handlers[op] = saved
