"""Zoo model names and sizes (and Megatron-Core GPTModel configs), and the check that a TP
degree splits them evenly.

Pure Python (no torch), so that `refine export` rejects bad arguments at once, and works out
what to export before the heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from refine.exporters.errors import ExportError

MODELS = ("llama", "qwen2", "gpt2", "mixtral")  # mixtral: exporters/zoo/moe.py


@dataclass(frozen=True)
class ZooConfig:
    """Sizes of a zoo model (and of its example input)."""

    hidden: int = 64
    heads: int = 8
    kv_heads: int = 8
    intermediate: int = 128
    layers: int = 2
    vocab: int = 128
    batch: int = 2
    seq_len: int = 8

    def parameters(self) -> int:
        """About how many weights a Llama-style model of these sizes has (embeddings, head, layers)."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return 2 * self.vocab * self.hidden + self.layers * (attention + 3 * self.hidden * self.intermediate)


CONFIGS: dict[str, ZooConfig] = {
    # multi-head attention: every TP degree dividing 8 works
    "tiny": ZooConfig(),
    # grouped-query attention (4 query heads per key/value head): TP 1 or 2
    "tiny-gqa": ZooConfig(kv_heads=2),
    # batch 1 (a sequence-parallel gather of batch 1 is a stack read back by a view)
    "tiny-b1": ZooConfig(batch=1),
    # Llama 3 sizes (8 key/value heads: TP up to 8), batch 2 x 16 tokens; export them with --meta.
    "llama3-8b": ZooConfig(hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32, vocab=128256,
                           batch=2, seq_len=16),
    "llama3-70b": ZooConfig(hidden=8192, heads=64, kv_heads=8, intermediate=28672, layers=80, vocab=128256,
                            batch=2, seq_len=16),
    "llama3-405b": ZooConfig(hidden=16384, heads=128, kv_heads=8, intermediate=53248, layers=126, vocab=128256,
                             batch=2, seq_len=16),
}



def reduced(cfg: ZooConfig) -> ZooConfig:
    """The same model at tiny sizes: its attention heads and key/value heads (so every TP degree
    that splits it splits this, and GQA keeps its groups), head size 2, FFN and vocabulary small
    multiples of the heads (vocabulary at least 128), 2 layers, at most 16 tokens. A counterexample search on a model too
    big to simulate re-exports it at these sizes (refine/diagnose/reduced.py)."""
    return replace(cfg, hidden=2 * cfg.heads, intermediate=2 * cfg.heads, vocab=cfg.heads * -(-128 // cfg.heads), layers=2,
                   seq_len=min(cfg.seq_len, 16))


REDUCED = "-reduced"  # config name suffix of the reduced sizes of a config
for _name in ("llama3-8b", "llama3-70b", "llama3-405b"):
    CONFIGS[_name + REDUCED] = reduced(CONFIGS[_name])

# above this many weights an export with data would not fit in memory: --meta is required
MAX_PARAMETERS_WITH_DATA = 1 << 30


def zoo_config(model: str, config: str, layers: int | None = None) -> ZooConfig:
    """The sizes of `model` under config name `config`, with `layers` layers if given."""
    if model not in MODELS:
        raise ExportError(f"unknown model {model!r} (known: {', '.join(MODELS)})")
    if config not in CONFIGS:
        raise ExportError(f"unknown config {config!r} (known: {', '.join(CONFIGS)})")
    cfg = CONFIGS[config]
    if model == "gpt2" and cfg.kv_heads != cfg.heads:
        raise ExportError(f"gpt2 has no grouped-query attention, which config {config!r} needs")
    if layers is not None:
        if layers < 1:
            raise ExportError(f"--layers must be at least 1, got {layers}")
        cfg = replace(cfg, layers=layers)
    return cfg


def check_plan(plan: str, models: tuple[str, ...], model: str, ranks: int, short: str, size: int, what: str,
               config: str, least: int = 2) -> None:
    """A one-dimension plan (`plan` over `ranks` ranks, at least `least`; `short` for short)
    applies to `model` and splits its `what` (of `size`) evenly; an ExportError naming the clash
    otherwise."""
    if model not in models:
        raise ExportError(f"{plan} exports {', '.join(models)} only, not {model}")
    if ranks < least:
        raise ExportError(f"{plan} needs at least {least} rank{'s' if least > 1 else ''}, got {ranks}")
    if size % ranks:
        raise ExportError(f"{short} {ranks} does not divide the {what} {size} of config {config!r}")


def validate(
    model: str, config: str, tp: int, sp: bool, *, layers: int | None = None, meta: bool = False
) -> ZooConfig:
    """The config, if `tp` (and `sp`) split it evenly; an ExportError naming the clash otherwise."""
    cfg = zoo_config(model, config, layers)
    if tp < 1:
        raise ExportError(f"--tp must be at least 1, got {tp}")
    if sp and model == "mixtral":
        raise ExportError("mixtral has a TP plan only (no --sp)")
    if not meta and cfg.parameters() > MAX_PARAMETERS_WITH_DATA:
        raise ExportError(f"{model} config {config!r} has about {cfg.parameters() / 1e9:.1f}e9 weights, too many "
                          "to hold in memory: export it with --meta (weights declared, no data)")
    sizes = {"attention heads": cfg.heads, "key/value heads": cfg.kv_heads, "intermediate size": cfg.intermediate}
    if sp:
        sizes["sequence length"] = cfg.seq_len
    for what, size in sizes.items():
        if size % tp:
            hint = " (config 'tiny' has 8)" if what == "key/value heads" else ""
            raise ExportError(f"{model} config {config!r}: {what} {size} not divisible by --tp {tp}{hint}")
    return cfg


# --- Megatron-Core's GPTModel (exporters/frameworks/megatron.py) -----------------------------------------

FRAMEWORKS = ("zoo", "megatron-core", "torchtitan", "transformers")  # transformers: exporters/frameworks/transformers.py


@dataclass(frozen=True)
class MegatronConfig(ZooConfig):
    """Sizes of a Megatron-Core GPTModel and its flavour: `gpt` (learned positions, LayerNorm,
    GeLU, biases) or `llama` (RoPE, RMSNorm, SwiGLU, no biases); kv_heads is num_query_groups."""

    style: str = "gpt"


MEGATRON_CONFIGS: dict[str, MegatronConfig] = {
    # GPT style, multi-head attention, 4x MLP: TP 1/2/4/8
    "tiny": MegatronConfig(intermediate=256),
    # Llama style with grouped-query attention (2 query groups): TP 1/2, and 4/8 (fewer groups than
    # ranks: Megatron gathers the fused QKV and each rank repeats its group for its own heads)
    "tiny-llama": MegatronConfig(kv_heads=2, style="llama"),
    # GPT-3 125M (vocab padded to a multiple of 128, as Megatron pads it), batch 2 x 16 tokens
    "gpt-125m": MegatronConfig(hidden=768, heads=12, kv_heads=12, intermediate=3072, layers=12, vocab=50304,
                               seq_len=16),
    # Llama-3.1-405B shapes (8 query groups; TP 16 has fewer groups than ranks); export with --meta
    "llama3-405b": MegatronConfig(hidden=16384, heads=128, kv_heads=8, intermediate=53248, layers=126,
                                  vocab=128256, seq_len=16, style="llama"),
}


for _name in ("gpt-125m", "llama3-405b"):
    MEGATRON_CONFIGS[_name + REDUCED] = reduced(MEGATRON_CONFIGS[_name])  # type: ignore[assignment]


@dataclass(frozen=True)
class MegatronMoEConfig(MegatronConfig):
    """A Megatron-Core GPTModel whose every MLP is a `MoELayer` (its TopKRouter and SequentialMLP
    experts, each of FFN size `intermediate`): `experts` experts, top-`topk` routing."""

    experts: int = 4
    topk: int = 2
    shared: int = 0  # the shared expert's FFN size (moe_shared_expert_intermediate_size; 0: none)


# Llama style (no biases: Megatron's expert MLP adds its bias in place on the output of a region
# mapping at TP 1, which autograd refuses), 4 experts, top-2 routing: TP 1/2, EP 2 with TP 2
MEGATRON_CONFIGS["tiny-moe"] = MegatronMoEConfig(kv_heads=2, style="llama")  # type: ignore[assignment]
# ... with a shared expert beside the routed ones (Qwen2-MoE's and DeepSeek's, Megatron's SharedExpertMLP)
MEGATRON_CONFIGS["tiny-moe-shared"] = MegatronMoEConfig(kv_heads=2, style="llama", shared=128)  # type: ignore[assignment]
MOE_DISPATCHERS = ("allgather", "alltoall")  # Megatron's moe_token_dispatcher_type values exported


def validate_megatron(config: str, tp: int, sp: bool, *, layers: int | None = None, meta: bool = False) -> MegatronConfig:
    """The Megatron config, if `tp` (and `sp`) split it evenly; an ExportError naming the clash otherwise."""
    if config not in MEGATRON_CONFIGS:
        raise ExportError(f"unknown megatron-core config {config!r} (known: {', '.join(MEGATRON_CONFIGS)})")
    cfg = MEGATRON_CONFIGS[config]
    if layers is not None:
        if layers < 1:
            raise ExportError(f"--layers must be at least 1, got {layers}")
        cfg = replace(cfg, layers=layers)
    if tp < 1:
        raise ExportError(f"--tp must be at least 1, got {tp}")
    if not meta and cfg.parameters() > MAX_PARAMETERS_WITH_DATA:
        raise ExportError(f"megatron-core config {config!r} has about {cfg.parameters() / 1e9:.1f}e9 weights, too "
                          "many to hold in memory: export it with --meta (weights declared, no data)")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:  # fewer groups than ranks: Megatron gathers QKV and slices
        raise ExportError(f"megatron-core config {config!r}: query groups {cfg.kv_heads} neither a multiple "
                          f"nor a divisor of --tp {tp}")
    sizes = {"attention heads": cfg.heads, "FFN size": cfg.intermediate, "vocabulary": cfg.vocab}
    if sp:
        sizes["sequence length"] = cfg.seq_len
    for what, size in sizes.items():
        if size % tp:
            raise ExportError(f"megatron-core config {config!r}: {what} {size} not divisible by --tp {tp}")
    return cfg


def validate_megatron_moe(config: str, tp: int, sp: bool, ep: int, dispatcher: str | None, *, train: bool = False,
                          layers: int | None = None, meta: bool = False) -> MegatronConfig:
    """validate_megatron, and the MoE settings: `ep` expert-parallel ranks borrowed from the `tp`
    TP ranks (expert TP tp/ep), `dispatcher` Megatron's token dispatcher (None: allgather at EP 1,
    alltoall above); an ExportError naming the clash otherwise."""
    cfg = validate_megatron(config, tp, sp, layers=layers, meta=meta)
    moe = isinstance(cfg, MegatronMoEConfig)
    if not moe:
        if ep != 1 or dispatcher is not None:
            raise ExportError(f"--ep and the token dispatcher are for a Megatron MoE config (tiny-moe), not {config!r}")
        return cfg
    if dispatcher is not None and dispatcher not in MOE_DISPATCHERS:
        raise ExportError(f"unknown Megatron token dispatcher {dispatcher!r} (known: {', '.join(MOE_DISPATCHERS)})")
    if ep < 1 or tp % ep or cfg.experts % ep:
        raise ExportError(f"megatron-core config {config!r}: --ep {ep} must divide --tp {tp} (EP borrows the TP ranks) "
                          f"and the {cfg.experts} experts")
    if ep > 1 and (ep != tp or cfg.experts // ep < 2):
        raise ExportError(f"megatron-core config {config!r}: --ep {ep} is exported with --tp {ep} (each expert whole on "
                          f"its rank) and at least 2 experts per rank ({cfg.experts} experts)")
    if ep > 1 and dispatcher == "allgather":
        raise ExportError("--ep above 1 is exported with Megatron's alltoall token dispatcher only")
    if train and tp > 1 and not sp:
        raise ExportError("Megatron refuses an MoE training step under TP without sequence parallelism: pass --sp")
    return cfg


# --- torchtitan's Llama 3 (exporters/frameworks/torchtitan.py) -------------------------------------------

TORCHTITAN_BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")  # ParallelismConfig.spmd_backend


@dataclass(frozen=True)
class TorchtitanConfig:
    """Sizes of a torchtitan Llama 3 or Qwen3-MoE (its model config built by torchtitan's own
    helpers, `_build_llama3_layers`, `_build_qwen3_moe_layers`) and of the example batch.
    `--config FILE` reads these fields from a JSON object (missing ones: tiny's)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    hidden_dim: int = 128  # the SwiGLU FFN's width (Qwen3-MoE: each expert's)
    vocab_size: int = 128
    rope_theta: float = 500000.0
    batch: int = 2
    seq_len: int = 8
    num_experts: int = 4  # Qwen3-MoE: routed experts
    top_k: int = 2  # Qwen3-MoE: experts per token


TORCHTITAN_MODELS = ("llama3", "qwen3_moe")  # --framework torchtitan --model


TORCHTITAN_CONFIGS: dict[str, TorchtitanConfig] = {
    # grouped-query attention (2 query heads per key/value head, fused QKV): TP 1, 2 or 4
    "tiny": TorchtitanConfig(),
    # context parallelism: torch's CP cuts FlexAttention's block mask in blocks of 128 tokens
    "tiny-cp": TorchtitanConfig(batch=1, seq_len=256),
    # one sequence: under SP each rank's tokens are one contiguous window (with several sequences,
    # each sequence's window: expert parallelism's dispatch is proven for the first yet, docs/moe.md)
    "tiny-seq": TorchtitanConfig(batch=1, seq_len=16),
}


def validate_torchtitan_ep(ep: int, *, tp: int, fsdp: int, model: str, num_experts: int) -> None:
    """An ExportError (one sentence) unless `ep` is an expert-parallel degree this export supports:
    Qwen3-MoE's experts over the ranks borrowed from TP (ep divides tp and the experts; all of
    them yet: ep == tp), no FSDP."""
    if ep == 1:
        return
    if ep < 1:
        raise ExportError(f"--ep must be at least 1, got {ep}")
    if model != "qwen3_moe":
        raise ExportError(f"--framework torchtitan --ep {ep}: expert parallelism needs experts, pass --model qwen3_moe")
    if tp % ep:
        raise ExportError(f"--framework torchtitan --ep {ep}: EP borrows the TP ranks here, so it must divide --tp ({tp})")
    if ep != tp:
        raise ExportError(f"--framework torchtitan --ep {ep}: EP over part of the TP ranks is not supported yet (its "
                          f"expert mesh, ep x efsdp, has no refine.json mesh here), pass --ep {tp}")
    if num_experts % ep:
        raise ExportError(f"--framework torchtitan --ep {ep}: the {num_experts} experts do not split over {ep} ranks")
    if fsdp > 1:
        raise ExportError(f"--framework torchtitan --ep {ep}: expert parallelism with --tp alone is supported yet "
                          "(no --fsdp with it)")


def torchtitan_config(config: str) -> TorchtitanConfig:
    """A named config, or the sizes a JSON file gives (an ExportError naming a bad one)."""
    import json
    from dataclasses import fields
    from pathlib import Path

    if config in TORCHTITAN_CONFIGS:
        return TORCHTITAN_CONFIGS[config]
    path = Path(config)
    if not path.is_file():
        raise ExportError(f"unknown torchtitan config {config!r} (known: {', '.join(TORCHTITAN_CONFIGS)}, or a JSON file)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path}: not a JSON object of Llama 3 sizes ({exc})") from None
    known = {f.name: f.type for f in fields(TorchtitanConfig)}
    if not isinstance(raw, dict) or set(raw) - set(known):
        extra = sorted(set(raw) - set(known)) if isinstance(raw, dict) else []
        raise ExportError(f"{path}: a JSON object with fields among {', '.join(known)}" + (f"; not {extra}" if extra else ""))
    for name, value in raw.items():
        wanted = float if name == "rope_theta" else int
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (wanted is int and not isinstance(value, int)) \
                or value <= 0:
            raise ExportError(f"{path}: {name} must be a positive {wanted.__name__}, got {value!r}")
    return replace(TorchtitanConfig(), **raw)


def validate_torchtitan(config: str, *, tp: int = 1, sp: bool = False, fsdp: int = 1, cp: int = 1, pp: int = 1,
                        micro_batches: int = 1, backend: str = "spmd_types", model: str = "llama3") -> TorchtitanConfig:
    """The config, if the degrees split it as torchtitan requires; an ExportError naming the clash otherwise."""
    if model not in TORCHTITAN_MODELS:
        raise ExportError(f"--framework torchtitan exports {' or '.join(TORCHTITAN_MODELS)}: --model {model!r} is neither")
    cfg = torchtitan_config(config)
    if model == "qwen3_moe":
        if cp * pp > 1 or backend != "spmd_types":
            raise ExportError("--framework torchtitan --model qwen3_moe: only TP (with or without --sp) on the spmd_types "
                              "backend is supported so far (no --cp, --pp or DTensor backend with it)")
        if cfg.top_k > cfg.num_experts:
            raise ExportError(f"torchtitan config {config!r}: top_k {cfg.top_k} exceeds the {cfg.num_experts} experts")
    if backend not in TORCHTITAN_BACKENDS:
        raise ExportError(f"unknown torchtitan backend {backend!r} (known: {', '.join(TORCHTITAN_BACKENDS)})")
    for flag, degree in (("--tp", tp), ("--fsdp", fsdp), ("--cp", cp), ("--pp", pp), ("--micro-batches", micro_batches)):
        if degree < 1:
            raise ExportError(f"{flag} must be at least 1, got {degree}")
    if tp * fsdp * cp * pp < 2:
        raise ExportError("a torchtitan export needs at least 2 ranks: pass --tp N or --pp N")
    if sp and tp < 2:
        raise ExportError("--sp shards the sequence between TP ranks: pass --tp 2 or more")
    if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise ExportError(f"torchtitan config {config!r}: dim {cfg.dim}, heads {cfg.n_heads} and key/value heads "
                          f"{cfg.n_kv_heads} do not divide evenly")
    if (cfg.dim // cfg.n_heads) % 2:
        raise ExportError(f"torchtitan config {config!r}: RoPE needs an even head size, got {cfg.dim // cfg.n_heads}")
    sizes = {"key/value heads": (cfg.n_kv_heads, tp), "FFN width": (cfg.hidden_dim, tp),
             "vocabulary": (cfg.vocab_size, tp), "batch": (cfg.batch, fsdp * micro_batches),
             "sequence length": (cfg.seq_len, (tp if sp else 1) * 2 * cp if cp > 1 else (tp if sp else 1)),
             }
    for what, (size, parts) in sizes.items():
        if size % parts:
            raise ExportError(f"torchtitan config {config!r}: {what} {size} not divisible by {parts}")
    if pp > cfg.n_layers + 2:  # torchtitan's split counts the embedding and the head as one layer each
        raise ExportError(f"torchtitan config {config!r}: {cfg.n_layers} layers (+ embedding and head) cannot fill "
                          f"{pp} pipeline stages")
    if micro_batches > 1 and pp < 2:
        raise ExportError("--micro-batches is for a pipeline: pass --pp 2 or more")
    return cfg
