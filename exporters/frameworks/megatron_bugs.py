"""Historical tensor-parallel mistakes reintroduced into Megatron-Core's own modules.

Each bug swaps one module of the first transformer layer, on the rank side only, for a
subclass of the Megatron-Core module it replaces, through Megatron's own layer spec
(`ModuleSpec.submodules`): the sequential model (TP 1) and refine.json stay those of the
stock model, so the verifier must find the difference itself. Classes refer to BUGS.md.

| bug | class | what layer 0's ranks do |
|---|---|---|
| `bias_before_allreduce` | 3 | MLP linear_fc2 (row-parallel): every rank adds the full bias to its partial sum, then the sum is reduced |
| `missing_allreduce` | 1 | MLP linear_fc2: the partial sums are returned as if complete (no all-reduce / reduce-scatter) |
| `glu_stride_1` | 6 | SwiGLU linear_fc1 built with partition_stride 1: rank k holds chunk k of [gate; up], not [gate_k; up_k] (Megatron's kitchen path) |
| `qkv_stride_3` | 6 | fused QKV linear_qkv built with partition_stride 3 (the old [Q|K|V] layout) over Megatron-Core's per-group [q..., k, v] rows |
| `sp_norm_grad_unreduced` | 4 (backward) | training step under SP: finalize_model_grads leaves out the all-reduce of the norms' gradients (every rank keeps its partial) |
| `moe_router_grad_unreduced` | 4 (backward) | training step of an MoE config under SP: layer 0's router weight is not marked `sequence_parallel`, so finalize_model_grads leaves its gradient a per-rank partial (each rank routes only its sequence chunk) |
| `sp_scatter_as_slice` | 1 (backward) | training step under SP: the embeddings cut to the rank's sequence chunk by a plain slice, not Megatron's scatter_to_sequence_parallel_region (the same forward; its backward all-gather is missing) |
| `ce_gathered_logits` | 5 | stock Megatron: GPTModel.forward(runtime_gather_output=True) with labels gathers the logits to the whole vocabulary, then feeds them to the vocab-parallel cross-entropy (loss + log TP; Megatron-LM issue 7452) |
| `ce_label_smoothing` | 5 | stock Megatron: vocab_parallel_cross_entropy(label_smoothing=0.1) averages the log-probabilities over the local vocabulary (Megatron-LM issues 737, 7464); on both sides, the sequential TP 1 being right |
| `ce_unmasked_backward` | 5 (backward) | the cross-entropy's backward subtracts 1 at the target on every rank, not only on the rank that owns it |

`bias_after_allreduce` is the same subclass as `bias_before_allreduce` with the bias where
Megatron adds it, so that a test can show the injection machinery itself verifies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from refine.exporters.errors import ExportError

if TYPE_CHECKING:
    import torch


def _row_parallel_class(bias_first: bool, reduce: bool) -> type:
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    class FaultyRowParallelLinear(RowParallelLinear):  # type: ignore[misc, valid-type]
        """RowParallelLinear.forward with the bias added before the reduction (`bias_first`) or
        the reduction left out (`reduce=False`); returns (output, None) like skip_bias_add=False."""

        def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
            output_parallel = self._forward_impl(
                input=input_, weight=self.weight, bias=self.bias if bias_first else None,
                gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                tp_group=None, grad_output_buffer=None,
            )
            if not reduce:
                output = output_parallel
            elif self.sequence_parallel:
                output = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
            else:
                output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
            if not bias_first and self.bias is not None:
                output = output + self.bias
            return output, None

    return FaultyRowParallelLinear


def _column_parallel_class(stride: int) -> type:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class StridedColumnParallelLinear(ColumnParallelLinear):  # type: ignore[misc, valid-type]
        """ColumnParallelLinear built with partition_stride `stride`, whatever its caller asks."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["stride"] = stride
            super().__init__(*args, **kwargs)

    return StridedColumnParallelLinear


def _slice_instead_of_scatter(embedding: Any) -> None:
    """LanguageModelEmbedding under SP with Megatron's own switch `scatter_to_sequence_parallel`
    off, and the rank's sequence chunk cut by a plain slice after it: the forward Megatron's
    scatter computes, without the all-gather its backward does."""
    from megatron.core import parallel_state

    embedding.scatter_to_sequence_parallel = False
    whole = embedding.forward

    def forward(input_ids: Any, position_ids: Any, tokentype_ids: Any = None) -> Any:
        out = whole(input_ids, position_ids, tokentype_ids)  # [s, b, h], every rank the whole sequence
        rank = parallel_state.get_tensor_model_parallel_rank()
        chunk = out.shape[0] // parallel_state.get_tensor_model_parallel_world_size()
        return out[rank * chunk:(rank + 1) * chunk].clone()  # (not a view: as Megatron clones its scatter's output)

    embedding.forward = forward


def _smoothed_cross_entropy(logits: Any, labels: Any) -> Any:
    """Megatron's own vocab_parallel_cross_entropy with its label smoothing argument at 0.1."""
    from megatron.core import tensor_parallel

    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels, 0.1)


def _unmasked_backward_cross_entropy(logits: Any, labels: Any) -> Any:
    """Megatron's cross-entropy with a backward that forgets the target mask."""
    import torch
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, _VocabParallelCrossEntropy

    class UnmaskedBackward(_VocabParallelCrossEntropy):  # type: ignore[misc, valid-type]
        """Every rank subtracts 1 at its local target index, also where another rank owns the target."""

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
            softmax, target_mask, masked_target_1d = ctx.saved_tensors
            grad_2d, arange_1d, _, grad_input = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
                softmax, target_mask)
            softmax_update = torch.ones_like(target_mask.view(-1), dtype=softmax.dtype)
            grad_input = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output)
            return grad_input, None, None

    return UnmaskedBackward.apply(logits, labels, 0.0)


@dataclass(frozen=True)
class MegatronBug:
    """One injected mistake: which layer-0 submodule it replaces, with what."""

    name: str
    bug_class: int | None  # None: a correct variant of the machinery
    title: str
    site: tuple[str, ...]  # path in the layer's ModuleSpec submodules (empty: a model-level change, edit_model)
    style: str | None = None  # the config style it needs (SwiGLU: llama)
    needs: str | None = None  # "sp,train": a plan it needs
    both_sides: bool = False  # a setting of the sequential model too (Megatron's own option)
    moe: bool = False  # needs an MoE config (tiny-moe: Megatron's MoELayer)

    def edit_model(self, model: Any) -> None:
        """A model-level change (after building): the gradient finalization left incomplete, one
        of Megatron's own loss options set, or the loss computed another way."""
        if self.name == "sp_norm_grad_unreduced":
            model.reduce_sequence_parallel_grads = False
        elif self.name == "moe_router_grad_unreduced":
            model.decoder.layers[0].mlp.router.weight.sequence_parallel = False
        elif self.name == "ce_gathered_logits":
            model.runtime_gather_output = True
        elif self.name == "ce_label_smoothing":
            model.cross_entropy = _smoothed_cross_entropy
        elif self.name == "ce_unmasked_backward":
            model.cross_entropy = _unmasked_backward_cross_entropy
        elif self.name == "sp_scatter_as_slice":
            _slice_instead_of_scatter(model.embedding)

    def module_class(self) -> type:
        if self.name in ("bias_before_allreduce", "bias_after_allreduce", "missing_allreduce"):
            return _row_parallel_class(bias_first=self.name == "bias_before_allreduce",
                                       reduce=self.name != "missing_allreduce")
        return _column_parallel_class(1 if self.name == "glu_stride_1" else 3)

    def edit_layer_spec(self, spec: Any) -> Any:
        """A copy of the layer spec with this bug's module swapped in (the spec itself if none)."""
        if not self.site:
            return spec
        spec = copy.deepcopy(spec)
        owner = spec
        for step in self.site[:-1]:
            owner = getattr(owner.submodules, step)
        setattr(owner.submodules, self.site[-1], self.module_class())
        return spec


_FC2 = ("mlp", "linear_fc2")
MEGATRON_BUGS: dict[str, MegatronBug] = {
    b.name: b for b in (
        MegatronBug("bias_before_allreduce", 3, "layer 0's MLP linear_fc2 adds the bias on every rank before the "
                    "all-reduce (bias counted TP times)", _FC2, style="gpt"),
        MegatronBug("bias_after_allreduce", None, "layer 0's MLP linear_fc2 rewritten with the bias after the "
                    "all-reduce (correct)", _FC2, style="gpt"),
        MegatronBug("missing_allreduce", 1, "layer 0's MLP linear_fc2 returns its partial sums unreduced", _FC2),
        MegatronBug("glu_stride_1", 6, "layer 0's SwiGLU linear_fc1 built with partition_stride 1 (each rank holds "
                    "a chunk of [gate; up], not its own gate and up rows)", ("mlp", "linear_fc1"), style="llama"),
        MegatronBug("qkv_stride_3", 6, "layer 0's fused linear_qkv built with partition_stride 3 (the [Q|K|V] "
                    "layout) over Megatron-Core's per-group [q..., k, v] rows", ("self_attention", "linear_qkv")),
        MegatronBug("sp_norm_grad_unreduced", 4, "finalize_model_grads leaves out the all-reduce of the sequence-"
                    "parallel norms' gradients", (), needs="sp,train"),
        MegatronBug("moe_router_grad_unreduced", 4, "layer 0's MoE router weight not marked sequence_parallel: "
                    "finalize_model_grads leaves its gradient partial on each rank", (), needs="sp,train", moe=True),
        MegatronBug("sp_scatter_as_slice", 1, "the embeddings cut to the rank's sequence chunk by a plain slice, not "
                    "Megatron's scatter_to_sequence_parallel_region (its backward all-gather missing)", (),
                    style="gpt", needs="sp,train"),
        MegatronBug("ce_gathered_logits", 5, "GPTModel.forward(runtime_gather_output=True): the loss gathers the "
                    "logits to the whole vocabulary and feeds them to the vocab-parallel cross-entropy (loss + log TP)",
                    (), needs="train"),
        MegatronBug("ce_label_smoothing", 5, "Megatron's own label smoothing (0.1) in vocab_parallel_cross_entropy: "
                    "the mean log-probability over the local vocabulary only", (), needs="train", both_sides=True),
        MegatronBug("ce_unmasked_backward", 5, "the cross-entropy's backward subtracts 1 at the target on every rank, "
                    "also where another rank owns it", (), needs="train"),
    )
}


def megatron_bug(name: str, style: str, sp: bool, train: bool, moe: bool = False) -> MegatronBug:
    """The bug named `name`, if it applies to a config of `style` (`moe`: an MoE config) and the
    plan; an ExportError otherwise."""
    if name not in MEGATRON_BUGS:
        raise ExportError(f"unknown megatron-core bug {name!r} (known: {', '.join(MEGATRON_BUGS)})")
    bug = MEGATRON_BUGS[name]
    if bug.moe and not moe:
        raise ExportError(f"megatron-core bug {name!r} is in Megatron's MoE layer: --config tiny-moe")
    if bug.style is not None and bug.style != style:
        raise ExportError(f"megatron-core bug {name!r} needs a {bug.style}-style config")
    if bug.needs == "sp,train" and not (sp and train):
        raise ExportError(f"megatron-core bug {name!r} is in a training step under sequence parallelism (--sp --train)")
    if bug.needs == "train" and not train:
        raise ExportError(f"megatron-core bug {name!r} is in the loss of a training step (--train)")
    return bug
