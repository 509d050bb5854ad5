"""torchtitan's Llama 3 and Qwen3-MoE, exported as they ship: model code, sharding config and parallelize path.

Needs the `torchtitan` extra (pyproject.toml pins the version that installs beside torch 2.13).
Nothing of torchtitan is rewritten: the model is `Llama3Model` built from a config made by
torchtitan's own helpers (`_build_llama3_layers`, its `Embedding`, `RMSNorm`, `Linear` and
`ComplexRoPE` configs), its sharding config set by `Llama3Model.Config.update_from_config` (which
calls `set_llama3_sharding_config`), and each rank parallelized by `parallelize_llama`'s own
steps for its backend (`Module.parallelize(ParallelDims)`), under a fake process group of the
whole world and torchtitan's own `ParallelDims` meshes. The sequential program is the same model
at one rank, through the same path. `exporters/frameworks/torchtitan_shims.py` lists the CPU shims
(where torchtitan assumes CUDA); each is as small as it can be.

Context parallelism runs as torchtitan's trainer runs it: FlexAttention, the data side's
positions and block mask handed to the forward as inputs, cut along the sequence with the tokens
(`attention_masks`, `trainer_forward`). FSDP is `fully_shard`'s layout in a traceable form
(exporters/frameworks/torchtitan_fsdp.py), on DTensors (full_dtensor) or on spmd_types'
annotated local tensors, over dp_shard and, on full_dtensor under CP, over cp too (as
`resolve_fsdp_mesh` has it: on full_dtensor torchtitan's CP always runs with FSDP).

How each rank's parameter relates to the sequential one is read off what torchtitan left on it
(exporters/capture/layouts.py): a DTensor's placements, or, under the default `spmd_types`
backend, the SPMD type and partition spec spmd_types records on the plain local tensor.

Weights: the same seed draws the same full weights on every side (torchtitan's own
initializers, `init_states`), before `parallelize` cuts each rank's part, as loading one
checkpoint does; the RMSNorm weights, ones at init, are redrawn from the seed (a constant would
hide a norm applied once per rank).
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from refine.config import Mesh
from refine.exporters.errors import ExportError
from refine.exporters.frameworks.torchtitan_bugs import BUGS, TorchtitanBug, torchtitan_bug
from refine.exporters.zoo.configs import TorchtitanConfig, validate_torchtitan_ep, validate_torchtitan
from refine.version import installed

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

MODEL_WORDS = {"llama3": "Llama 3", "qwen3_moe": "Qwen3-MoE"}  # --model -> the report's words


def _require_torchtitan() -> None:
    """Import torchtitan (with its CPU shims' import stand-in), or one ExportError saying how to install it."""
    from refine.exporters.frameworks.torchtitan_shims import import_torchtitan

    try:
        import_torchtitan()
    except ImportError as exc:
        raise ExportError(f"--framework torchtitan needs torchtitan (pip install -e '.[torchtitan]'): {exc}") from None


def model_config(cfg: TorchtitanConfig, flex_block: int | None = None, model: str = "llama3") -> Any:
    """torchtitan's model config of these sizes: Llama 3 (`llama3_config`) or Qwen3-MoE
    (`qwen3_moe_config`)."""
    if model == "qwen3_moe":
        return qwen3_moe_config(cfg)
    return llama3_config(cfg, flex_block)


def llama3_config(cfg: TorchtitanConfig, flex_block: int | None = None) -> Any:
    """torchtitan's `Llama3Model.Config` of these sizes, made as its own registry makes Llama 3's
    (`_debugmodel`, `_8b`, ...): fused QKV, SwiGLU FFN, RMSNorm, complex RoPE with Llama scaling;
    each layer's inner attention torchtitan's `ScaledDotProductAttention` (shim 3), or with
    `flex_block` its FlexAttention of that block size (context parallelism needs it: shim 8;
    torchtitan's CP asks for a sequence of CP x block size, its default block is 128)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers, _output_linear_init

    layers = _build_llama3_layers(
        n_layers=cfg.n_layers, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, hidden_dim=cfg.hidden_dim,
        rope=ComplexRoPE.Config(dim=cfg.dim // cfg.n_heads, max_seq_len=cfg.seq_len, theta=cfg.rope_theta, scaling="llama"),
        attn_backend="flex", fuse_qkv=True,
    )
    for layer in layers:
        layer.attention.inner_attention = (ScaledDotProductAttention.Config() if flex_block is None
                                           else FlexAttention.Config(block_size=flex_block))
    return Llama3Model.Config(
        dim=cfg.dim, vocab_size=cfg.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=cfg.dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size, param_init=_output_linear_init(cfg.dim)),
        layers=layers,
    )


def qwen3_moe_config(cfg: TorchtitanConfig) -> Any:
    """torchtitan's `Qwen3Model.Config` of these sizes with MoE layers, made as its registry makes
    `debugmodel_moe` (`_build_qwen3_moe_layers`: fused QKV, QK norm, CosSin RoPE, a softmax
    top-k router with normalised scores, GroupedExperts behind its token dispatcher, the
    "standard" all-to-all backend); each layer's inner attention torchtitan's
    `ScaledDotProductAttention` (shim 3)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    head_dim = cfg.dim // cfg.n_heads
    layers = _build_qwen3_moe_layers(
        n_layers=cfg.n_layers, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=head_dim,
        moe_hidden_dim=cfg.hidden_dim, num_experts=cfg.num_experts, top_k=cfg.top_k, fuse_qkv=True,
        attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=cfg.seq_len, theta=cfg.rope_theta),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=cfg.vocab_size, dim=cfg.dim, norm=_qwen3_norm(cfg.dim),
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )


@contextlib.contextmanager
def one_rank_all_reduce() -> Iterator[None]:
    """`_functional_collectives.all_reduce` over a group of one rank is the identity (no
    collective recorded) while the block runs; over more ranks, itself."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    saved = funcol.all_reduce

    def all_reduce(t: torch.Tensor, reduceOp: str, group: Any, tag: str = "") -> torch.Tensor:  # noqa: N803 - torch's name
        return t if dist.get_world_size(group) == 1 else saved(t, reduceOp, group, tag)

    funcol.all_reduce = all_reduce  # type: ignore[assignment]
    try:
        yield
    finally:
        funcol.all_reduce = saved  # type: ignore[assignment]


class _JobConfig:
    """What `update_from_config` reads of a trainer's config: its `parallelism`."""

    def __init__(self, parallelism: Any) -> None:
        self.parallelism = parallelism


def parallelism(tp: int, sp: bool, fsdp: int, cp: int, pp: int, backend: str, ep: int = 1) -> Any:
    """torchtitan's `ParallelismConfig` of these degrees; CP without its load balancer (each rank
    one contiguous run of the sequence: head-tail chunks have no refine.json layout). `ep`: its
    `expert_parallel_degree` (EP borrows the TP ranks: torchtitan's AllToAllTokenDispatcher,
    exported at static capacity, torchtitan_shims.py shim 11)."""
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(
        tensor_parallel_degree=tp, enable_sequence_parallel=sp, data_parallel_shard_degree=fsdp,
        context_parallel_degree=cp, pipeline_parallel_degree=pp, spmd_backend=backend,
        context_parallel_load_balancer=None, expert_parallel_degree=ep,
    )


def _redraw_constants(model: torch.nn.Module, seed: int) -> None:
    """Parameters torchtitan initializes to a constant (the RMSNorm weights: ones; biases: zeros)
    redrawn from `seed`, per name, full size: the same on every side (a constant would hide a
    norm or a bias applied once per rank)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() == 0 or not bool(torch.all(flat == flat[0])):
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.copy_(flat[0].item() + 0.5 * torch.randn(p.shape, generator=gen))


def inject_module(model_cfg: Any, bug: TorchtitanBug) -> None:
    """A twin's module, put into layer 0's config before torchtitan sets its sharding config:
    `attention.wo` with a bias, as torchtitan's ScaledBiasRowwiseLinear (bias / TP on every
    rank) or a plain Linear."""
    from torchtitan.models.common import Linear, ScaledBiasRowwiseLinear

    attention = model_cfg.layers[0].attention
    if bug.name in ("rowwise_bias_invariant", "rowwise_scaled_bias"):
        wo = attention.wo
        attention.wo = ScaledBiasRowwiseLinear.Config(in_features=wo.in_features, out_features=wo.out_features,
                                                      bias=True, param_init=wo.param_init)
    elif bug.name == "rowwise_plain_bias":
        wo = attention.wo
        attention.wo = Linear.Config(in_features=wo.in_features, out_features=wo.out_features, bias=True,
                                     param_init=wo.param_init)


def inject_typing(model_cfg: Any, bug: TorchtitanBug) -> None:
    """A twin's typing, edited into the sharding config torchtitan set on layer 0: a state typed
    I (invariant) on TP where torchtitan types it R (its gradient a partial sum to be reduced),
    or the routed experts' output typed R where torchtitan types it P."""
    import dataclasses

    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_activation_placement, dense_param_placement

    layer = model_cfg.layers[0]
    if bug.name == "moe_experts_output_replicate":  # the routed experts' output typed R on TP, not P
        experts = layer.moe.routed_experts
        experts.sharding_config = dataclasses.replace(experts.sharding_config,
                                                      out_src_shardings=dense_activation_placement(tp=spmd.R))
        return
    target = {"sp_norm_invariant": (layer.attention_norm, "weight"),
              "rowwise_bias_invariant": (layer.attention.wo, "bias"),
              "moe_router_grad_invariant": (layer.moe.router.gate, "weight") if bug.moe else None}.get(bug.name)
    if target is None:
        return
    module_cfg, state = target
    sharding = module_cfg.sharding_config
    shardings = {**sharding.state_shardings, state: dense_param_placement(tp=spmd.I)}
    module_cfg.sharding_config = dataclasses.replace(sharding, state_shardings=shardings)


def build(cfg: TorchtitanConfig, *, tp: int = 1, sp: bool = False, fsdp: int = 1, cp: int = 1, pp: int = 1,
          backend: str = "spmd_types", seed: int = 0, train: bool = False, bug: TorchtitanBug | None = None,
          micro_batches: int = 1, flex_block: int | None = None, vocab_parallel_loss: bool = True,
          model_name: str = "llama3", ep: int = 1) -> torch.nn.Module:
    """The `model_name` model (Llama 3 or Qwen3-MoE) for the calling rank of the current (fake) world, parallelized by
    torchtitan's own path for `backend`, its forward inside the trainer's SPMD region, with the
    twin `bug` put into layer 0's config (exporters/frameworks/torchtitan_bugs.py). With `pp`
    stages, the rank's stage (`pipeline_part`) running `micro_batches` micro-batches. With
    `flex_block` (a CP export, and its sequential program), FlexAttention of that block size,
    the forward taking the token positions and the trainer's block mask (`attention_masks`).
    `vocab_parallel_loss`: the sequential program's loss in the ranks' vocab-parallel form
    (`trainer_forward`). `ep`: torchtitan's expert-parallel degree (Qwen3-MoE: its all-to-all
    token dispatcher over ranks borrowed from TP)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.full_dtensor import validate_config

    from refine.exporters.frameworks.torchtitan_shims import spmd_region

    config = parallelism(tp, sp, fsdp, cp, pp, backend, ep)
    model_cfg = model_config(cfg, flex_block, model_name)
    if bug is not None:
        inject_module(model_cfg, bug)
    model_cfg.update_from_config(config=_JobConfig(config))  # torchtitan's sharding config (set_llama3_sharding_config)
    if bug is not None:
        inject_typing(model_cfg, bug)
    dist_utils.set_spmd_backend(backend)
    torch.manual_seed(seed)
    model = model_cfg.build()
    model.init_states()
    _redraw_constants(model, seed)
    world = tp * fsdp * cp * pp
    dims = ParallelDims.from_config(config, world)
    stage = None
    if pp > 1:  # pipeline_llm's steps: the whole model split into stages, then each part parallelized
        model, stage = pipeline_part(model, dims, config, model_cfg)
        peers = [int(r) for r in dims.get_mesh("pp").mesh.tolist()]  # stage -> this rank's partner there
        if bug is not None and bug.name == "pp_peer_stage_leader":
            peers = [s * tp for s in range(pp)]  # BUG: each stage's first rank, not this rank's place on the pp mesh
    if world > 1:
        # parallelize_llama's steps (torchtitan/models/llama3/parallelize.py) for this backend
        if backend in ("full_dtensor", "spmd_types"):
            validate_config(dims, model)
            model.parallelize(dims)
        elif dims.tp_enabled:
            model.parallelize(dims)
        if fsdp > 1 or (cp > 1 and backend == "full_dtensor"):
            # apply_fsdp_to_decoder's layout, traceable (exporters/frameworks/torchtitan_fsdp.py); on full_dtensor
            # under CP over cp too (resolve_fsdp_mesh). (On spmd_types under CP alone the parameters stay whole on
            # every rank and their gradients partial sums: torch 2.13's fully_shard refuses spmd_types' tensors.)
            from refine.exporters.frameworks.torchtitan_fsdp import apply_fsdp

            apply_fsdp(model, train=train, cp=cp > 1, divide=bug is not None and bug.name == "fsdp_grad_divided",
                       dims=dims if backend == "spmd_types" else None)
    if stage is not None:
        from refine.exporters.frameworks.torchtitan_pipeline import pipeline_train_step, residual_stream
    if stage is not None and train:
        pipeline_train_step(model, stage, peers, micro_batches, cfg.dim, cfg.vocab_size, config.pipeline_parallel_schedule,
                            bug, seq_parts=tp if sp else 1, dims=dims, stream=residual_stream(model_cfg))
    elif stage is not None:
        pipeline_forward(model, stage, peers, micro_batches, cfg.dim, dims, residual_stream(model_cfg),
                         seq_parts=tp if sp else 1)
    else:
        masks = attention_masks(model, dims, cfg.seq_len) if flex_block is not None else None
        trainer_forward(model, dims, cfg.vocab_size, train=train, one_rank=world == 1, masks=masks,
                        vocab_parallel_loss=vocab_parallel_loss,
                        drop_positions=world > 1 and bug is not None and bug.name == "cp_positions_dropped")
    if backend == "spmd_types":
        spmd_region(model, dims, ("forward", "training_step") if stage is not None and train else ("forward",))
    return model.eval()


def attention_masks(model: torch.nn.Module, dims: Any, seq_len: int) -> Any:
    """The block mask the trainer builds for a batch (`post_dataloading_process`): torchtitan's
    causal packed-document mask of the positions `0 .. seq_len - 1` (one document per row,
    `get_attention_masks`), under CP cut to the rank's rows of queries as `prepare_context_parallel_input`
    cuts it (`cp_shard`, no load balancer). The programs take its values as their input
    `attention_masks` (the mask is an input of torchtitan's forward, made by the data side), the
    ranks their rows: checked here to be what torch's CP cut of the mask keeps."""
    from torchtitan.distributed.context_parallel import cp_shard

    from refine.exporters.frameworks.torchtitan_shims import dense_mask

    positions = torch.arange(seq_len).unsqueeze(0)
    masks = model.get_attention_masks(positions)
    if not dims.cp_enabled:
        return masks
    whole = dense_mask(masks)
    _, masks = cp_shard(dims.get_mesh("cp"), (positions,), masks, None)
    cp_mesh = dims.get_mesh("cp")
    rows = torch.chunk(whole, cp_mesh.size(), dim=2)[cp_mesh.get_local_rank()]
    if not torch.equal(dense_mask(masks), rows):
        raise ExportError(f"torch's CP cut of the block mask on CP rank {cp_mesh.get_local_rank()} is not its even "
                          "chunk of the query rows: no refine.json layout says it")
    return masks


def example_mask(cfg: TorchtitanConfig, block: int) -> torch.Tensor:
    """The values of the trainer's block mask for the whole sequence (`attention_masks`, above),
    from torchtitan's `get_attention_masks` of a model built on the meta device (the mask reads
    the config alone)."""
    from refine.exporters.frameworks.torchtitan_shims import dense_mask

    with sequential_world(), torch.device("meta"):
        model = model_config(cfg, block).build()
    return dense_mask(model.get_attention_masks(torch.arange(cfg.seq_len).unsqueeze(0)))


def pipeline_part(model: torch.nn.Module, dims: Any, config: Any, model_cfg: Any) -> tuple[torch.nn.Module, int]:
    """This rank's model chunk and stage index, as torchtitan's `pipeline_llm` makes them: its
    stage metadata (`_get_pipeline_metadata`: one stage per rank under the default 1F1B
    schedule), its module names per stage (`_generate_llm_fqn_per_model_part`: the embedding and
    the head weighed as one layer each) and its split (`_split_module`: a copy of the model with
    the other stages' modules removed, so that the chunk's parameters keep their names)."""
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pipeline_metadata,
        _get_pp_rank_to_stage_indices_mapping,
        _split_module,
    )

    stages, layers, input_weight, output_weight = _get_pipeline_metadata(dims, config, model_cfg)
    names = _generate_llm_fqn_per_model_part(stages, layers, input_weight, output_weight)
    pp_mesh = dims.get_mesh("pp")
    indices = _get_pp_rank_to_stage_indices_mapping(pp_mesh.get_local_rank(), pp_mesh.size(),
                                                    config.pipeline_parallel_schedule, stages)
    if len(indices) != 1:
        raise ExportError(f"torchtitan's {config.pipeline_parallel_schedule} schedule puts {len(indices)} stages on a "
                          "rank: one stage per rank only")
    return _split_module(model, names[indices[0]]), indices[0]


def pipeline_forward(part: torch.nn.Module, stage: int, peers: list[int], micro_batches: int, dim: int,
                     dims: Any, stream: Any = None, seq_parts: int = 1) -> None:
    """`part(tokens)` as stage `stage` (its partner on stage s: global rank `peers[s]`) runs one
    forward of the batch: cut into `micro_batches` micro-batches along the batch (as torchtitan's schedule cuts it), each passed
    through torchtitan's own forward of the chunk (`Decoder.forward` skips the modules the split
    removed: a later stage's input is the previous stage's activations), received from the stage
    before and sent to the stage after (refine's traceable `send` / `recv`: torch.distributed's
    point-to-point calls cannot be traced). The last stage returns the logits, the others what
    they send (exporters/strategies/pipeline.py's convention). Every stage takes the token ids.
    `seq_parts`: the activations between stages hold 1/seq_parts of the sequence (SP)."""
    from refine.exporters.capture.collectives import recv, send
    from refine.exporters.frameworks.torchtitan_pipeline import as_stage_input, local, trainer_input

    forward = part.forward
    first, last = stage == 0, stage == len(peers) - 1

    @functools.wraps(forward)
    def run_stage(tokens: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        batch, seq_len = tokens.shape
        size = batch // micro_batches
        outputs = []
        for k in range(micro_batches):
            x = trainer_input(tokens[k * size:(k + 1) * size], dims) if first else as_stage_input(
                recv(torch.zeros(size, seq_len // seq_parts, dim), peers[stage - 1]), stream, dims)
            y = local(forward(x))
            outputs.append(y if last else send(y, peers[stage + 1]))
        if not last:
            return tuple(outputs)
        return torch.cat(outputs, dim=0) if micro_batches > 1 else outputs[0]

    part.forward = run_stage  # type: ignore[method-assign]


def stage_outputs(rank: int, stages: int, micro_batches: int, world: int) -> list[str]:
    """Rank `rank`'s outputs: `logits` on the last stage, its sends (`sent.K`) on the others (the
    names exporters/strategies/pipeline.py gives them; frameworks import no strategy). pp is the
    outermost dim of torchtitan's mesh: a stage is a run of world / stages ranks."""
    return ["logits"] if rank // (world // stages) == stages - 1 else [f"sent.{k}" for k in range(micro_batches)]


def trainer_forward(model: torch.nn.Module, dims: Any, vocab_size: int, *, train: bool, one_rank: bool,
                    masks: Any = None, vocab_parallel_loss: bool = True, drop_positions: bool = False) -> None:
    """`model(tokens)` (the logits) and `model(tokens, labels=labels)` (the training loss) as
    torchtitan's Trainer runs them (`post_dataloading_process`, `_forward_backward_body`):

    - with the trainer's block mask `masks` (FlexAttention: a CP export), `model(tokens,
      positions)`: the token positions are an input, as the data loader hands them over, and
      under CP the rank's tokens, positions and labels are its run of the sequence (annotated
      S(1) on the CP axis, `annotate_input_spmd_types`), the valid tokens counted over the CP
      group (`dist_sum_tensor`, as `train_step` counts them over the batch mesh), and the loss
      reported is the ranks' shares summed over it (below), the gradients those of the rank's own share;

    - under `full_dtensor` the tokens (and labels) become DTensors first
      (`full_dtensor.parallelize_inputs`), and the rank's local logits (or its local share of the
      loss, as the trainer's `dist_sum` takes it: `to_local`) are returned;
    - with data or context parallelism the loss reported is the shares summed over the trainer's
      loss mesh (dp x cp: `finalize_loss`, the trainer's `dist_sum(accumulated_loss, loss_mesh)`);
    - the loss is torchtitan's `CrossEntropyLoss` (the vocab-parallel `_LossParallelCrossEntropy`
      where the logits are split over TP) of the logits against the labels, summed, over the
      global count of valid tokens (`train_step`: labels not IGNORE_INDEX). exporters/capture/train.py
      differentiates it (`computes_loss`).

    `one_rank` (the sequential program) with `vocab_parallel_loss` (the ranks split the logits over
    TP): the loss is the same `_LossParallelCrossEntropy` over the one rank (its three
    all-reduces over one rank are the identity), where torchtitan's one-rank run takes
    `F.cross_entropy`: the same function (tests/test_torchtitan.py checks it on numbers), in the
    form whose backward the ranks' fused one is proved against. Without it, the ranks' own
    `F.cross_entropy`. `drop_positions`: the twin `cp_positions_dropped` (the positions not
    handed to torchtitan's forward)."""
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss, _LossParallelCrossEntropy
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab_size).build()
    forward = model.forward
    dtensor_inputs = dims.spmd_backend == "full_dtensor" and not one_rank

    def step(tokens: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor | None,
             mask: torch.Tensor | None) -> torch.Tensor:
        global_valid_tokens = (labels != IGNORE_INDEX).sum() if labels is not None else None
        if global_valid_tokens is not None and dims.dp_enabled:  # (train_step: summed over the batch mesh)
            global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens, dims.get_mesh("batch"))
        if global_valid_tokens is not None and dims.cp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens, dims.get_mesh("cp"))
        extra = {} if masks is None or drop_positions else {"positions": positions}  # (BUG when dropped)
        if dtensor_inputs:
            tokens, wrapped, extra = full_dtensor.parallelize_inputs(dims, tokens, tokens if labels is None else labels,
                                                                     extra)
            labels = None if labels is None else wrapped
        elif dims.cp_enabled:
            # (the forward has no labels: a copy of the tokens stands in, typed as labels are, I on TP)
            annotate_input_spmd_types(dims, tokens, tokens.clone() if labels is None else labels, extra)
        if masks is not None:
            masks.refine_dense = mask  # the values the block mask holds: this program's input (shim 8)
        pred = forward(tokens, attention_masks=masks, **extra) if masks is not None else forward(tokens)
        if labels is None:
            return pred.to_local() if isinstance(pred, DTensor) else pred
        if not one_rank or not vocab_parallel_loss:
            loss, _ = loss_fn(pred, labels, global_valid_tokens)
            return loss.to_local() if isinstance(loss, DTensor) else loss  # (the rank's share: `_dist_reduce`'s to_local)
        import torch.distributed as dist

        with one_rank_all_reduce():
            summed = _LossParallelCrossEntropy.apply(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                                     dist.group.WORLD, vocab_size)
        return summed / global_valid_tokens

    if masks is None:
        @functools.wraps(forward)
        def forward_as_trained(tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            return step(tokens, labels, None, None)
    else:
        @functools.wraps(forward)
        def forward_as_trained(tokens: torch.Tensor, positions: torch.Tensor,  # type: ignore[misc]
                               attention_masks: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            return step(tokens, labels, positions, attention_masks)

    model.forward = forward_as_trained  # type: ignore[method-assign]
    if train:
        model.computes_loss = True  # type: ignore[assignment]
    if train and dims.dp_cp_enabled:
        model.finalize_loss = functools.partial(dist_utils.dist_sum_tensor, mesh=dims.get_mesh("loss"))  # type: ignore[assignment]


def example_inputs(cfg: TorchtitanConfig, seed: int, *, labels: bool = False,
                   flex_block: int | None = None) -> tuple[torch.Tensor, ...]:
    """The token ids of the config's batch; with `flex_block` (CP) their positions (one document
    per row, shared by the rows: `[1, seq_len]`) and the trainer's block mask's values
    (`example_mask`); with `labels` the target ids of a training step."""
    gen = torch.Generator().manual_seed(seed)
    tokens, *rest = (torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=gen) for _ in range(1 + labels))
    flex = () if flex_block is None else (torch.arange(cfg.seq_len).unsqueeze(0), example_mask(cfg, flex_block))
    return (tokens, *flex, *rest)


CP_BLOCK = 128  # torch's CP cuts the block mask in blocks of flex's default size (_create_cp_block_mask)


def flex_block(cp: int) -> int | None:
    """FlexAttention's block size for a CP export (None: no CP, SDPA)."""
    return CP_BLOCK if cp > 1 else None


@contextlib.contextmanager
def reference_model(entry: dict[str, Any]) -> Iterator[torch.nn.Module]:
    """The one-rank torch model a manifest's zoo entry names, usable inside the block
    (refine.exporters.check): built from the sizes the export recorded (a `--config FILE` need
    not still exist), with the CPU shims and a one-rank world."""
    from refine.exporters.capture.tracing import quiet
    from refine.exporters.frameworks.torchtitan_shims import cpu_shims

    _require_torchtitan()
    cfg = TorchtitanConfig(**entry["sizes"])
    with quiet(), cpu_shims(), sequential_world():
        bug = BUGS[entry["bug"]] if entry.get("bug") else None
        yield build(cfg, backend=entry["backend"], seed=entry["seed"], train=entry["train"], bug=bug,
                    flex_block=flex_block(entry.get("cp", 1)), vocab_parallel_loss=entry.get("tp", 1) > 1,
                    model_name=entry.get("model", "llama3"))


@contextlib.contextmanager
def sequential_world() -> Iterator[None]:
    """A one-rank world: torchtitan builds its meshes even for one rank."""
    from refine.exporters.capture.tracing import fake_process_group

    with fake_process_group(0, 1):
        yield


def export_torchtitan(
    config: str = "tiny",
    out: Path | str = Path("out"),
    *,
    tp: int = 1,
    sp: bool = False,
    fsdp: int = 1,
    cp: int = 1,
    pp: int = 1,
    micro_batches: int = 1,
    backend: str = "spmd_types",
    train: bool = False,
    bug: str | None = None,
    seed: int = 0,
    workers: int | None = None,
    model: str = "llama3",
    ep: int = 1,
) -> ExportResult:
    """Export torchtitan's `model` (Llama 3 or Qwen3-MoE) at one rank (seq.onnx) and parallelized (the ranks) to `out`,
    with the twin `bug` (exporters/frameworks/torchtitan_bugs.py) in layer 0 (its module on both
    sides, its typing on the ranks). `ep`: expert parallelism (Qwen3-MoE, ep dividing tp: the
    experts split over ranks borrowed from TP, routes moved by torchtitan's all-to-all token
    dispatcher)."""
    from refine.exporters.capture.export import bug_words, export
    from refine.exporters.capture.tracing import quiet
    from refine.exporters.frameworks.torchtitan_shims import cpu_shims

    cfg = validate_torchtitan(config, tp=tp, sp=sp, fsdp=fsdp, cp=cp, pp=pp, micro_batches=micro_batches, backend=backend,
                              model=model)
    validate_torchtitan_ep(ep, tp=tp, fsdp=fsdp, model=model, num_experts=cfg.num_experts)
    if fsdp > 1 and cp * pp > 1:
        raise ExportError("--framework torchtitan --fsdp: FSDP alone or with --tp is supported yet (no --cp or --pp "
                          "with it: the trainer's positions under FSDP x CP are per batch row, which the export does "
                          "not build yet)")
    if cp > 1 and pp > 1:
        raise ExportError("--framework torchtitan --cp: context parallelism alone or with --tp is supported yet "
                          "(no --pp with it)")
    if cp > 1 and cfg.seq_len % (cp * CP_BLOCK):
        raise ExportError(f"--framework torchtitan --cp {cp}: torch's CP cuts FlexAttention's block mask in blocks of "
                          f"{CP_BLOCK}, so the sequence must be a multiple of {cp * CP_BLOCK}, not {cfg.seq_len} "
                          "(--config FILE with seq_len)")
    if backend == "partial_dtensor":
        raise ExportError("--framework torchtitan --backend partial_dtensor is not supported yet: torch.export's "
                          "run_decompositions fails on the DTensors its local_map regions build (\"_torchbind_obj0 is not "
                          "a constant\"); use spmd_types or full_dtensor")
    injected = torchtitan_bug(bug, sp=sp, train=train, backend=backend, cp=cp, pp=pp, tp=tp,
                              model=model, fsdp=fsdp, ep=ep) if bug is not None else None
    _require_torchtitan()
    world = tp * fsdp * cp * pp
    plan = "+".join(name for name, on in (("TP", tp > 1), ("SP", sp), (f"EP {ep}", ep > 1), ("FSDP", fsdp > 1),
                                             ("CP", cp > 1), ("PP", pp > 1)) if on)
    block = flex_block(cp)
    mesh = export_mesh(tp=tp, fsdp=fsdp, cp=cp, pp=pp)
    with quiet(), cpu_shims():
        return export(
            lambda: build(cfg, backend=backend, seed=seed, train=train, bug=injected, flex_block=block,
                          vocab_parallel_loss=tp > 1, model_name=model),
            lambda rank: build(cfg, tp=tp, sp=sp, fsdp=fsdp, cp=cp, pp=pp, backend=backend, seed=seed, train=train,
                               bug=injected, micro_batches=micro_batches, flex_block=block, model_name=model, ep=ep),
            example_inputs(cfg, seed, labels=train, flex_block=block),
            world,
            out,
            seq_context=sequential_world,
            **({} if train else {"output_names": ["logits"]}),
            **({} if pp == 1 or train else {"rank_output_names": functools.partial(
                stage_outputs, stages=pp, micro_batches=micro_batches, world=world)}),  # (logits: on the last stage)
            input_ranges={"tokens": cfg.vocab_size, "labels": cfg.vocab_size, "positions": cfg.seq_len},
            **declared_layouts(tp=tp, fsdp=fsdp, cp=cp, train=train, mesh=mesh is not None),
            description=f"torchtitan {installed('torchtitan')} {MODEL_WORDS[model]} config {config!r}, {plan} over {world} ranks "
                        f"({backend}), {'one training step' if train else 'forward'}, exported by "
                        "`refine export --framework torchtitan`" + (bug_words(injected) if injected else ""),
            zoo={"framework": "torchtitan", "model": model, "config": config, "tp": tp, "sp": sp, "ep": ep, "fsdp": fsdp,
                 "cp": cp, "pp": pp, "micro_batches": micro_batches, "backend": backend, "seed": seed, "train": train,
                 "bug": bug, "sizes": asdict(cfg)},
            workers=workers,
            train=train,
            mesh=mesh,
        )


def declared_layouts(*, tp: int, fsdp: int, cp: int, train: bool, mesh: bool) -> dict[str, Any]:
    """refine.json's layouts of the inputs the trainer cuts and, for a forward, of logits split over
    two mesh dims (shapes alone cannot say which mesh dim splits which axis; --check confirms it):
    FSDP's batch rows over dp_shard, CP's run of the sequence over cp (the positions' and the
    mask's query rows too: the rows share them), each then cut by the next dim (the logits' vocab
    shard over tp). `mesh`: refine.json has a mesh (layouts name their dim)."""
    def over(dim: str) -> dict[str, str]:
        return {"over": dim} if mesh else {}

    cuts = [(0, "dp_shard")] * (fsdp > 1) + [(1, "cp")] * (cp > 1)  # (the batch rows, then the sequence)

    def cut(axes: list[tuple[int, str]]) -> dict[str, Any]:
        (axis, dim), *rest = axes
        return {"layout": "shard", "axis": axis, **over(dim), **({"then": {"axis": rest[0][0], "over": rest[0][1]}} if rest else {})}

    inputs = {name: cut(cuts) for name in ("tokens", "labels")[:1 + train]} if cuts else {}
    if cp > 1:
        sequence = {"layout": "shard", "axis": 1, **over("cp")}
        inputs.update(positions=sequence, attention_masks={"layout": "shard", "axis": 2, **over("cp")})
    logits = cuts + [(2, "tp")] * (tp > 1)
    outputs = {"logits": cut(logits)} if not train and len(logits) == 2 else {}
    return {**({"input_layouts": inputs} if inputs else {}), **({"output_layouts": outputs} if outputs else {})}


def export_mesh(*, tp: int, fsdp: int, cp: int, pp: int) -> Mesh | None:
    """refine.json's `mesh`: torchtitan's world mesh (`ParallelDims`, its dims in its order) with the
    dims of one rank left out; None where one dim holds every rank (layouts split over the world)."""
    dims = [(name, size) for name, size in (("pp", pp), ("dp_shard", fsdp), ("cp", cp), ("tp", tp)) if size > 1]
    if len(dims) < 2:
        return None
    return Mesh(dims=[name for name, _ in dims], shape=[size for _, size in dims])
