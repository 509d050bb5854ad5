"""Megatron-Core's own GPTModel, exported as it ships: TP 1 is the sequential program, TP N the ranks.

Needs the `megatron` extra (megatron-core, the version pyproject.toml pins; its hard dependencies are torch, numpy and
packaging). Nothing of Megatron is rewritten: the model is built from `GPTModel` and
`get_gpt_layer_local_spec()` under a fake process group with
`parallel_state.initialize_model_parallel`, and traced while `refine.exporters.frameworks.megatron_shims`
replaces three CUDA-only helpers that compute no model value. Under sequence parallelism the
norms are `SequenceParallelNorm` (below); with `bug`, one module of layer 0 is swapped through
the layer spec (exporters/frameworks/megatron_bugs.py).

How each rank's parameter relates to the TP 1 model's is not written here: it is read off the
partition attributes Megatron sets on its tensor-parallel parameters (`tensor_model_parallel`,
`partition_dim`, `partition_stride`; exporters/capture/layouts.py), and every parameter without them
must hold the same values on every rank (else the export fails naming it).

MoE (config tiny-moe): every layer's MLP is Megatron's MoELayer (TopKRouter, SequentialMLP
experts: no grouped GEMM without Transformer Engine), its allgather token dispatcher at EP 1 and
its alltoall dispatcher with `ep` (EP borrowing the TP ranks, expert TP tp/ep; exported at
ep == tp), under the MoE shims and static-shape forms of megatron_shims. Each rank's local
experts are named by their global index, as Megatron's checkpoints name them, and all of an
MoE's weights are drawn by name (`_draw_moe_weights`): an EP rank builds only its experts.

Weights: the same seed gives the same master weights at every TP degree (with
`use_cpu_initialization` Megatron draws each full weight and keeps the rank's chunk, by its own
partition_dim and stride). Megatron initializes biases and norm weights to constants, which
would hide a bias added once per rank; those are redrawn from the seed, full size, and cut the
way Megatron cuts its master weights (`megatron_chunk`).
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from refine.exporters.zoo.configs import MegatronConfig, MegatronMoEConfig, validate_megatron, validate_megatron_moe
from refine.exporters.errors import ExportError
from refine.exporters.frameworks.megatron_bugs import MegatronBug, megatron_bug
from refine.version import installed

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

LAYER_STACK = "decoder.layers"


def _require_megatron() -> None:
    """Import Megatron-Core (quietly: it warns that Apex and Transformer Engine are absent)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ExportError(f"--framework megatron-core needs Megatron-Core (pip install -e '.[megatron]'): {exc}") from None


def init_tensor_parallel(tp: int, ep: int = 1) -> None:
    """Megatron's parallel state for one TP group of all `tp` ranks of the current (fake) world
    (a previous rank's state, left in this process, is dropped first); an MoE's experts over `ep`
    expert-parallel ranks of those, each expert split over tp/ep (expert TP)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=tp // ep, create_gloo_process_groups=False)


@contextlib.contextmanager
def sequential_world() -> Iterator[None]:
    """A one-rank world (Megatron needs a process group even at TP 1), with its parallel state."""
    from megatron.core import parallel_state

    from refine.exporters.capture.tracing import fake_process_group

    with fake_process_group(0, 1):
        init_tensor_parallel(1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def megatron_chunk(full: torch.Tensor, dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of `full` as Megatron cuts a master weight (tensor_parallel.layers.
    _initialize_affine_weight_cpu): `dim` split into pieces of size/(world*stride), the rank
    keeping pieces rank, rank+world, ... in order."""
    pieces = torch.split(full, full.shape[dim] // (world * stride), dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


def _draw_parameter(p: torch.nn.Parameter, name: str, seed: int, rank: int, world: int, constant: bool) -> None:
    """`p` drawn from `seed` by `name`: the full tensor (around its constant where it is one at init,
    else normal with Megatron's init std 0.02), this rank's part cut by the parameter's Megatron
    partition attributes over `world` ranks."""
    flat = p.detach().reshape(-1)
    parallel = bool(getattr(p, "tensor_model_parallel", False))
    dim, stride = getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1)
    shape = list(p.shape)
    if parallel:
        shape[dim] *= world
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full = flat[0].item() + 0.5 * torch.randn(shape, generator=gen) if constant else 0.02 * torch.randn(shape, generator=gen)
    p.copy_(megatron_chunk(full, dim, stride, rank, world) if parallel and world > 1 else full)


def _is_constant(p: torch.nn.Parameter) -> bool:
    flat = p.detach().reshape(-1)
    return flat.numel() > 0 and bool(torch.all(flat == flat[0]))


def _redraw_constants(model: torch.nn.Module, seed: int, rank: int, world: int) -> None:
    """Biases and norm weights (constants at init) redrawn from `seed`: the full tensor drawn per
    name, and this rank's part of it cut by the parameter's Megatron partition attributes."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _is_constant(p):  # (the rest: drawn by Megatron's init method, same master weight at every TP)
                _draw_parameter(p, name, seed, rank, world, constant=True)


def _draw_moe_weights(model: torch.nn.Module, seed: int) -> None:
    """Every weight of an MoE model drawn from `seed` by its name as the sequential model names it
    (an expert by its global index, `_global_experts`): the full tensor drawn per name (a
    constant at init, biases and norm weights, around that constant; the rest normal with
    Megatron's init std 0.02), this rank's part cut by the parameter's Megatron partition
    attributes over its TP group (an expert's: over its expert-TP group). Megatron's own draws
    cannot serve: an EP rank builds only its experts, so its draws after the first MoE layer
    are not the sequential model's."""
    from megatron.core import parallel_state

    tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    etp_rank, etp = (parallel_state.get_expert_tensor_parallel_rank(),
                     parallel_state.get_expert_tensor_parallel_world_size())
    with torch.no_grad():
        for name, p in model.named_parameters():
            expert = ".experts." in name
            rank, world = (etp_rank, etp) if expert else (tp_rank, tp)
            _draw_parameter(p, name, seed, rank, world, constant=_is_constant(p))
            if expert and bool(getattr(p, "tensor_model_parallel", False)) and world == 1 and tp > 1:
                p.tensor_model_parallel = False  # (whole on its EP rank: expert TP 1, no TP split)


def _global_experts(model: torch.nn.Module) -> None:
    """Each SequentialMLP's local experts named by their global index, as Megatron's own checkpoint
    names them (SequentialMLP.sharded_state_dict: EP rank * local experts + local index), so that
    an expert's weights bear the sequential model's name for them on the rank that holds it
    (SequentialMLP only iterates over its experts, which keeps their order)."""
    from collections import OrderedDict

    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if isinstance(module, SequentialMLP):
            offset = module.ep_group.rank() * module.num_local_experts
            experts = module.local_experts
            experts._modules = OrderedDict((str(offset + i), m) for i, m in enumerate(experts._modules.values()))


class SequenceParallelNorm:
    """The norm of the local spec under sequence parallelism. Megatron's local spec builds torch's
    LayerNorm/RMSNorm (WrappedTorchNorm), which refuses sequence_parallel because nothing marks
    its parameters; Megatron then expects Apex's FusedLayerNorm (CUDA only), which computes the
    same norm and marks its parameters `sequence_parallel` (their gradients are partial per rank
    and are all-reduced in finalize_model_grads). This builds the torch norm and marks them so."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def _block_spec(cfg: MegatronConfig, sp: bool, bug: MegatronBug | None = None) -> Any:
    """Megatron's local layer spec for every layer (with SequenceParallelNorm for its norms under
    SP, and `bug`'s module swapped into layer 0's spec)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    experts = cfg.experts if isinstance(cfg, MegatronMoEConfig) else None  # (an MoE: MoELayer, SequentialMLP experts)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm" if cfg.style == "llama" else "LayerNorm")
    if not sp and bug is None:
        return spec
    norm = LocalSpecProvider().layer_norm(rms_norm=cfg.style == "llama")
    if sp:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm = SequenceParallelNorm
    first = bug.edit_layer_spec(spec) if bug is not None else spec
    return TransformerBlockSubmodules(layer_specs=[first] + [spec] * (cfg.layers - 1), layer_norm=norm)


def _moe_settings(cfg: MegatronConfig, ep: int, dispatcher: str | None) -> dict[str, Any]:
    """TransformerConfig's MoE fields for an MoE config: its experts (SequentialMLP: no grouped
    GEMM), top-k routing, `ep` expert-parallel ranks and the token dispatcher (default: allgather
    at EP 1, alltoall above); nothing for a dense config."""
    if not isinstance(cfg, MegatronMoEConfig):
        return {}
    return dict(num_moe_experts=cfg.experts, moe_router_topk=cfg.topk, moe_ffn_hidden_size=cfg.intermediate,
                moe_grouped_gemm=False, expert_model_parallel_size=ep,
                **({"moe_shared_expert_intermediate_size": cfg.shared} if cfg.shared else {}),
                moe_token_dispatcher_type=dispatcher or ("allgather" if ep == 1 else "alltoall"))


def _transformer_config(cfg: MegatronConfig, tp: int, sp: bool, meta: bool, ep: int = 1,
                        dispatcher: str | None = None) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = cfg.style == "llama"
    moe = _moe_settings(cfg, ep, dispatcher)
    if moe:
        moe["expert_tensor_parallel_size"] = tp // ep
    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        num_query_groups=cfg.kv_heads, ffn_hidden_size=cfg.intermediate,
        tensor_model_parallel_size=tp, sequence_parallel=sp and tp > 1,
        use_cpu_initialization=not meta, init_model_with_meta_device=meta,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        normalization="RMSNorm" if llama else "LayerNorm", gated_linear_unit=llama,
        activation_func=torch.nn.functional.silu if llama else torch.nn.functional.gelu,
        add_bias_linear=not llama, params_dtype=torch.float32, **moe,
    )


def _gpt_class() -> type:
    from megatron.core.models.gpt.gpt_model import GPTModel

    class MegatronGPT(GPTModel):  # type: ignore[misc, valid-type]
        """GPTModel called as Megatron's training loop calls it: position ids and the causal
        mask made from the batch's shape (megatron.training's get_ltor_masks_and_position_ids),
        token ids in, logits out ([batch, seq, vocab / TP]: vocab-parallel, parallel_output)."""

        computes_loss = True  # a training step's loss is Megatron's own (exporters/capture/train.py)
        reduce_sequence_parallel_grads = True  # finalize_model_grads' norm all-reduce (a bug twin leaves it out)
        runtime_gather_output: bool | None = None  # GPTModel.forward's own flag (None: as parallel_output says)
        # (logits, labels), both [seq, batch, ...] -> per-token loss; None: LanguageModule's own
        cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
            """Logits; with `labels`, the loss as pretrain_gpt's loss_func makes it: Megatron's
            per-token vocab-parallel cross-entropy, averaged over the tokens."""
            batch, seq = input_ids.shape
            positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
            causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device), diagonal=1)
            out = super().forward(input_ids, positions, causal[None, None], labels=labels,
                                  runtime_gather_output=self.runtime_gather_output)
            return out if labels is None else out.float().mean()

        def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            """LanguageModule's unfused loss ([b, s] labels to [s, b] and back), with
            `cross_entropy` in place of its vocab_parallel_cross_entropy when one is set."""
            if self.cross_entropy is None:
                return super().compute_language_model_loss(labels, logits)
            return self.cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()

        def finalize_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            """Megatron's finalize_model_grads for one TP group: the gradients of parameters marked
            `sequence_parallel` (the norms, under SP) summed over the TP group, as its
            _allreduce_non_tensor_model_parallel_grads does (one all-reduce per gradient here,
            where Megatron coalesces them into one buffer); the others as autograd left them."""
            import torch.distributed._functional_collectives as funcol
            from megatron.core import parallel_state

            if not (self.config.sequence_parallel and self.reduce_sequence_parallel_grads):
                return grads
            group = parallel_state.get_tensor_model_parallel_group()
            marked = {fqn for fqn, p in self.named_parameters() if getattr(p, "sequence_parallel", False)}
            return {fqn: funcol.all_reduce(g, "sum", group) if fqn in marked else g for fqn, g in grads.items()}

    return MegatronGPT


def build(cfg: MegatronConfig, tp: int, sp: bool, seed: int, *, meta: bool = False,
          bug: MegatronBug | None = None, ep: int = 1, dispatcher: str | None = None) -> torch.nn.Module:
    """The GPTModel of `cfg` at TP `tp` (an MoE's experts over `ep` of those ranks, tokens moved
    by `dispatcher`) for the calling rank (Megatron's parallel state initialized), with `bug`
    injected into layer 0."""
    from megatron.core import parallel_state

    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():  # (torch's own norms too)
        model = _gpt_class()(
            config=_transformer_config(cfg, tp, sp, meta, ep, dispatcher), transformer_layer_spec=_block_spec(cfg, sp and tp > 1, bug),
            vocab_size=cfg.vocab, max_sequence_length=4 * cfg.seq_len, parallel_output=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope" if cfg.style == "llama" else "learned_absolute",
        )
    if isinstance(cfg, MegatronMoEConfig):
        _global_experts(model)  # (before the draws: they draw each expert by its global name)
        if not meta:
            _draw_moe_weights(model, seed)
    elif not meta:
        _redraw_constants(model, seed, parallel_state.get_tensor_model_parallel_rank(), tp)
    if bug is not None:
        bug.edit_model(model)
    return model.eval()


def example_inputs(cfg: MegatronConfig, seed: int, *, meta: bool = False, labels: bool = False) -> tuple[torch.Tensor, ...]:
    """The token ids of the config's batch (on the meta device: no values), and with `labels`
    target ids for a training step."""
    count = 2 if labels else 1
    if meta:
        return tuple(torch.zeros((cfg.batch, cfg.seq_len), dtype=torch.long, device="meta") for _ in range(count))
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=gen) for _ in range(count))


def rank_factory(cfg: MegatronConfig, tp: int, sp: bool, seed: int, *, meta: bool = False,
                 bug: MegatronBug | None = None, ep: int = 1,
                 dispatcher: str | None = None) -> Callable[[int], torch.nn.Module]:
    """rank -> the TP `tp` model, built under Megatron's parallel state (left initialized for
    the capture that follows; the next build resets it)."""

    def factory(rank: int) -> torch.nn.Module:
        init_tensor_parallel(tp, ep)
        return build(cfg, tp, sp, seed, meta=meta, bug=bug, ep=ep, dispatcher=dispatcher)

    return factory


@contextlib.contextmanager
def reference_model(entry: dict[str, Any]) -> Iterator[torch.nn.Module]:
    """The TP 1 torch model a manifest's zoo entry names, usable inside the block (refine.exporters.check)."""
    from refine.exporters.capture.tracing import quiet
    from refine.exporters.frameworks.megatron_shims import cpu_shims, moe_cpu_shims

    _require_megatron()
    cfg = validate_megatron(entry["config"], 1, False, layers=entry.get("layers"))
    with quiet(), cpu_shims(), moe_cpu_shims(), sequential_world():
        yield build(cfg, 1, False, entry["seed"])


def export_megatron(
    config: str = "tiny",
    tp: int = 2,
    sp: bool = False,
    out: Path | str = Path("out"),
    seed: int = 0,
    *,
    layers: int | None = None,
    meta: bool = False,
    flat: bool = False,
    workers: int | None = None,
    bug: str | None = None,
    train: bool = False,
    ep: int = 1,
    dispatcher: str | None = None,
) -> ExportResult:
    """Export Megatron-Core's GPTModel at TP 1 (seq.onnx) and TP `tp` (the ranks) to `out`, with
    the mistake `bug` (exporters/frameworks/megatron_bugs.py) injected into the ranks' first layer; `train`:
    one training step (Megatron's loss, every gradient after its finalize_model_grads). An MoE config
    (tiny-moe): its experts over `ep` of the TP ranks, tokens moved by Megatron's `dispatcher`
    (allgather or alltoall; default allgather at EP 1, alltoall above), at static shapes
    (exporters/frameworks/megatron_shims.py)."""
    from refine.exporters.capture.export import bug_words, export
    from refine.exporters.capture.tracing import quiet
    from refine.exporters.capture.layers import inert_attributes
    from refine.exporters.frameworks.megatron_shims import (cpu_shims, functional_collectives, moe_cpu_shims,
                                                            moe_static_shapes)

    _require_megatron()
    cfg = validate_megatron_moe(config, tp, sp, ep, dispatcher, train=train, layers=layers, meta=meta)
    injected = megatron_bug(bug, cfg.style, sp, train, isinstance(cfg, MegatronMoEConfig)) if bug is not None else None
    moe = _moe_settings(cfg, ep, dispatcher)
    plan = ("TP+SP" if sp else "TP") + (f", MoE {moe['num_moe_experts']} experts top-{moe['moe_router_topk']}, "
                                        f"EP {ep}, {moe['moe_token_dispatcher_type']} dispatcher" if moe else "")
    traced_step = functional_collectives() if train else contextlib.nullcontext()
    with quiet(), cpu_shims("meta" if meta else "cpu"), moe_cpu_shims(), moe_static_shapes(), traced_step, \
            inert_attributes(inert_layer_number(_transformer_config(cfg, tp, sp, meta, ep, dispatcher))):
        return export(
            lambda: build(cfg, 1, False, seed, meta=meta, bug=injected if injected and injected.both_sides else None),
            rank_factory(cfg, tp, sp, seed, meta=meta, bug=injected, ep=ep, dispatcher=dispatcher),
            example_inputs(cfg, seed, meta=meta, labels=train),
            tp,
            out,
            seq_context=sequential_world,
            **({} if train else {"output_names": ["logits"],  # vocab-parallel, as Megatron leaves them
                                 "output_layouts": {"logits": {"layout": "shard", "axis": 2}}}),
            input_ranges={"input_ids": cfg.vocab, "labels": cfg.vocab},
            description=f"Megatron-Core {installed('megatron-core')} GPTModel config {config!r} ({cfg.style} style), {plan} over "
                        f"{tp} ranks, {'one training step' if train else 'forward'}, exported by `refine export --framework megatron-core`"
                        + (" (meta: no weight data)" if meta else "") + (bug_words(injected) if injected else ""),
            zoo={"framework": "megatron-core", "model": "gpt", "config": config, "tp": tp, "sp": sp, "seed": seed,
                 "layers": layers, "meta": meta, "flat": flat, "bug": bug, "train": train, "sizes": asdict(cfg),
                 **({"ep": ep, "dispatcher": moe["moe_token_dispatcher_type"]} if moe else {})},
            layers=None if flat else LAYER_STACK,
            workers=workers,
            train=train,
        )


def inert_layer_number(config: Any) -> dict[type, frozenset[str]]:
    """Megatron's `layer_number` as an inert attribute (refine.exporters.capture.layers.inert_attributes), if
    this config reads it in no forward: the layers then share one function. It is read by
    inference caches (an export passes no inference context), `no_rope_freq`, per-layer
    `cp_comm_type` lists and sliding-window skips; query-key layer scaling turns it into other
    attributes (norm_factor, the softmax scale), which the signature still compares."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if config.no_rope_freq or isinstance(config.cp_comm_type, list) or config.window_attn_skip_freq:
        return {}
    return {cls: frozenset({"layer_number"}) for cls in (TransformerLayer, Attention, DotProductAttention)}

