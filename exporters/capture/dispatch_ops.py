"""MoE dispatch ops torchlib cannot translate, as the static ONNX of equal values they are.

Token-choice MoE code (torchtitan's token dispatcher and GroupedExperts, Megatron-Core's
permute and grouped GEMM) groups the routed tokens by expert and multiplies each group by its
expert's weights. Two of its ops have no torchlib translation:

- **`aten.sort.stable`** (`torch.argsort(ids, stable=True)`). ONNX's TopK is a stable sort when k
  is the whole axis: its spec breaks ties by the lower index ("the element with the lower index
  will appear first"), for the largest and for the smallest alike, which is what a stable sort
  does. So `sort(x, dim, descending, stable=True) = TopK(x, k = x.shape[dim], axis = dim,
  largest = descending, sorted = 1)`, value for value and index for index (onnx.reference's
  TopK, refine's simulator, breaks ties the same way).
- **`aten._grouped_mm`** of a 2-D `A [R, K]` by a 3-D `B [G, K, N]` at offsets `offs [G]` (the
  cumulative group ends): row i of the result is `A[i] @ B[g(i)]`, where `g(i)` is the group
  whose rows hold i, the number of offsets `<= i`. That is a Gather of each row's weights and
  one batched MatMul: `MatMul(A[:, None, :], Gather(B, g, axis=0))[:, 0, :]`, with `g` computed
  in the program from `offs` (the framework's own counts stay visible). Rows past the last
  offset, which torch leaves unwritten (and HF's fallback zero), are zero. Its backward for the
  weights, a 2-D `A [K, R]` by a 2-D `B [R, N]`, is per group g the product over g's rows only:
  `out[g] = A @ (B * [g(i) = g])`, one MatMul of A by the rows of B masked per group.

HF's experts (`transformers.integrations.moe`) run the same grouped GEMM through their own custom
ops when `torch._grouped_mm` cannot (`transformers::grouped_mm_fallback`, a loop over the groups,
and its backward): translated the same way (`hf_grouped_mm`, `hf_grouped_mm_backward`).

`export --check` compares the translated program with torch's own numbers.
"""

from __future__ import annotations

from typing import Any

import onnxscript

_op = onnxscript.opset18


def sort_stable(self: Any, stable: bool | None = None, dim: int = -1, descending: bool = False) -> tuple[Any, Any]:
    """aten.sort.stable -> TopK over the whole axis (module doc)."""
    rank = len(self.shape)
    axis = dim + rank if dim < 0 else dim
    k = _op.Shape(self, start=axis, end=axis + 1)
    values, indices = _op.TopK(self, k, axis=axis, largest=int(bool(descending)), sorted=1)
    return values, indices


def _row_groups(offs: Any, rows: Any) -> Any:
    """Each row's group: the number of group ends `offs` at or before it (G for rows past the
    last end)."""
    ends = _op.Cast(offs, to=onnxscript.INT64.dtype)
    passed = _op.LessOrEqual(_op.Unsqueeze(ends, [0]), _op.Unsqueeze(rows, [1]))  # [R, G]: group g ended by row i
    return _op.ReduceSum(_op.Cast(passed, to=onnxscript.INT64.dtype), [1], keepdims=0)


def _arange(shape_of: Any, axis: int) -> Any:
    """0 .. n-1 for the length n of `shape_of` along `axis`."""
    n = _op.Squeeze(_op.Shape(shape_of, start=axis, end=axis + 1), [0])
    return _op.Range(_op.Constant(value_int=0), n, _op.Constant(value_int=1))


def _rows_by_groups(a: Any, b: Any, offs: Any) -> Any:
    """Row i of a [R, K] times b[g(i)] of b [G, K, N]; zero for a row past the last end (its
    group clamped to the last one for the gather, then its product times 0: the products are
    finite)."""
    group = _row_groups(offs, _arange(a, 0))
    groups = _op.Shape(b, start=0, end=1)
    weights = _op.Gather(b, _op.Min(group, _op.Sub(groups, _op.Constant(value_ints=[1]))), axis=0)  # [R, K, N]
    product = _op.Squeeze(_op.MatMul(_op.Unsqueeze(a, [1]), weights), [1])
    grouped = _op.Unsqueeze(_op.Less(group, groups), [1])  # [R, 1]: the row lies in a group
    return _op.Mul(product, _op.CastLike(grouped, product))


def _groups_of_rows(a: Any, b: Any, offs: Any) -> Any:
    """out[g] = a [K, R] times the rows of b [R, N] in group g (rows past the last end: none)."""
    group = _row_groups(offs, _arange(b, 0))  # [R]
    member = _op.Equal(_op.Unsqueeze(_arange(offs, 0), [1]), _op.Unsqueeze(group, [0]))  # [G, R]
    masked = _op.Mul(_op.Unsqueeze(_op.CastLike(member, b), [2]), _op.Unsqueeze(b, [0]))  # [G, R, N]
    return _op.MatMul(_op.Unsqueeze(a, [0]), masked)  # [G, K, N]


def grouped_mm(self: Any, mat2: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    """aten._grouped_mm at offsets, without a bias or `out_dtype` (module doc):
    - 2-D `A [R, K]` by 3-D `B [G, K, N]`: each row's group's weights gathered, one batched MatMul;
    - 2-D `A [K, R]` by 2-D `B [R, N]` (the weights' gradient): group g's columns of A by its rows
      of B, `out[g] = A diag(row in g) B`, one MatMul of A by the rows of B masked per group
      (rows past the last end count in no group).
    Any other form fails loudly."""
    if offs is None or bias is not None or out_dtype is not None or len(self.shape) != 2 or len(mat2.shape) not in (2, 3):
        raise NotImplementedError("aten._grouped_mm: only a 2-D input by 3-D weights, or 2-D by 2-D, at offsets, "
                                  "without a bias or an output dtype of its own, has an ONNX translation")
    return _rows_by_groups(self, mat2, offs) if len(mat2.shape) == 3 else _groups_of_rows(self, mat2, offs)


def hf_grouped_mm(input: Any, weight: Any, offs: Any) -> Any:  # noqa: A002 - HF's schema names
    """transformers::grouped_mm_fallback (HF's experts when `torch._grouped_mm` cannot run: a
    float32 model, a CPU): the 2-D by 3-D grouped GEMM at offsets, its loop over the groups one
    batched MatMul (rows past the last end zero, as HF leaves them)."""
    return _rows_by_groups(input, weight, offs)


def hf_grouped_mm_backward(input: Any, weight: Any, offs: Any, grad_output: Any) -> tuple[Any, Any]:  # noqa: A002
    """transformers::grouped_mm_fallback_backward: each row's gradient is its group's weights
    transposed times the row's output gradient (the same grouped GEMM), each group's weight
    gradient its rows of the input times theirs (the 2-D by 2-D form)."""
    grad_input = _rows_by_groups(grad_output, _op.Transpose(weight, perm=[0, 2, 1]), offs)
    grad_weight = _groups_of_rows(_op.Transpose(input, perm=[1, 0]), grad_output, offs)
    return grad_input, grad_weight
