"""Row indexing `x[arange(N), idx]` in a traced graph, as the gather and scatter it is.

Vocab-parallel cross-entropy (Megatron-Core's, and most hand-written ones) picks each row's
target logit with `logits_2d[arange(N), target]` and, in its backward, subtracts from it with
`grad_2d[arange(N), target] -= update`. torch exports both as ONNX GatherND/ScatterND over a
concatenation of broadcast index tensors, where no lemma can see that the first index walks
the rows. With the first index the row arange of a 2-D `x`, both are one index per row along
axis 1, value for value:
    x[arange(N), idx]                   = gather(x, 1, idx[:, None])[:, 0]
    x[arange(N), idx] = v               = scatter(x, 1, idx[:, None], v[:, None])
    x[arange(N), idx] -= u  (functional: index_put(x, I, copy(x[I], x[I] - u)))
                                        = x - scatter(zeros_like(x), 1, idx[:, None], u[:, None])
(the last because x[i, j] - 0 is x[i, j] exactly, and each row is written once). Any other
indexing is left as it is. The rewrite is applied to the traced training step before its ONNX
translation; `export --check` compares the translated program with the model's own numbers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten
_ARANGES = (aten.arange.start_step, aten.arange.start, aten.arange.default)


def rewrite(gm: torch.fx.GraphModule) -> int:
    """Rewrite every row-indexed read and write of `gm` in place; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):  # writes first: they recognise the reads they subtract from
        if node.op == "call_function" and node.target is aten.index_put.default and _row_write(gm, node):
            count += 1
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.index.Tensor and _row_read(gm, node):
            count += 1
    if count:
        gm.recompile()
    return count


def _erase_unused(gm: torch.fx.GraphModule, *nodes: Any) -> None:
    """Erase these nodes, in order, where nothing reads them any more (only what the rewrite
    left unused: no dead-code pass over the rest of the graph, whose collectives must stay)."""
    for node in nodes:
        if isinstance(node, torch.fx.Node) and not node.users:
            gm.graph.erase_node(node)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _rows_index(x: Any, indices: Any) -> torch.fx.Node | None:
    """The column index `idx` when `indices` is [arange(N), idx] over a 2-D `x` of N rows."""
    xv = _val(x)
    if xv is None or xv.dim() != 2 or not isinstance(indices, (list, tuple)) or len(indices) != 2:
        return None
    rows, cols = indices
    if not _is_row_arange(rows, int(xv.shape[0])):
        return None
    cv = _val(cols)
    if cv is None or cv.dim() != 1 or int(cv.shape[0]) != int(xv.shape[0]) or cv.dtype not in (torch.int64, torch.int32):
        return None
    return cols


def _is_row_arange(node: Any, rows: int) -> bool:
    """`node` is arange(0, rows) with step 1 (integer)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _ARANGES:
        return False
    args = list(node.args)
    if node.target is aten.arange.default:
        args = [0, *args]
    start, end, step = (args + [1])[:3] if len(args) >= 2 else (None, None, None)
    val = _val(node)
    return (start == 0 and end == rows and step == 1 and val is not None
            and val.dtype in (torch.int64, torch.int32) and node.kwargs.get("dtype") in (None, torch.int64, torch.int32))


def _emit(gm: torch.fx.GraphModule, like: torch.fx.Node, target: Any, *args: Any) -> torch.fx.Node:
    """A new node computing target(*args) before `like`, with `like`'s metadata (its source line)
    and its fake value."""
    from torch._guards import detect_fake_mode

    with gm.graph.inserting_before(like):
        node = gm.graph.call_function(target, args)
    node.meta = {k: v for k, v in like.meta.items() if k != "val"}
    fake_args = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
    mode = detect_fake_mode([a for a in torch.utils._pytree.tree_leaves(fake_args) if isinstance(a, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*fake_args)
    return node


def _row_read(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    x, indices = node.args[0], node.args[1]
    idx = _rows_index(x, indices)
    if idx is None:
        return False
    column = _emit(gm, node, aten.unsqueeze.default, idx, 1)
    picked = _emit(gm, node, aten.gather.default, x, 1, column)
    out = _emit(gm, node, aten.squeeze.dim, picked, 1)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    return True


def _subtracted(x: torch.fx.Node, indices: Any, value: Any) -> Any:
    """`u` when `value` is copy(x[I], x[I] - u) or x[I] - u (the functional `x[I] -= u`), else None."""
    if isinstance(value, torch.fx.Node) and value.target is aten.copy.default:
        value = value.args[1]
    if not isinstance(value, torch.fx.Node) or value.target not in (aten.sub.Tensor, torch.ops.prims.sub.default) or value.kwargs.get("alpha", 1) != 1:
        return None
    read, u = value.args[0], value.args[1]
    if not (isinstance(read, torch.fx.Node) and read.target is aten.index.Tensor and read.args[0] is x
            and list(read.args[1]) == list(indices)):
        return None
    return u


def _row_write(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    x, indices, value = node.args[0], node.args[1], node.args[2]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    idx = _rows_index(x, indices)
    if idx is None or accumulate:
        return False
    xv, rows = _val(x), int(_val(x).shape[0])
    column = _emit(gm, node, aten.unsqueeze.default, idx, 1)
    u = _subtracted(x, indices, value)
    src = u if u is not None else value
    sv = _val(src)
    if sv is None or sv.dtype != xv.dtype or sv.dim() > 1:
        gm.graph.erase_node(column)
        return False
    if sv.dim() == 0 or int(sv.shape[0]) != rows:
        src = _emit(gm, node, aten.expand.default, src, [rows])
    src = _emit(gm, node, aten.unsqueeze.default, src, 1)
    if u is not None:
        zeros = _emit(gm, node, aten.zeros_like.default, x)
        out = _emit(gm, node, aten.sub.Tensor, x, _emit(gm, node, aten.scatter.src, zeros, 1, column, src))
    else:
        out = _emit(gm, node, aten.scatter.src, x, 1, column, src)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    if u is not None:  # the functional `x[I] -= u`'s own read, difference and copy, now unused
        copy = value if value.target is aten.copy.default else None
        diff = copy.args[1] if copy is not None else value
        _erase_unused(gm, copy, diff, diff.args[0])
    return True
