"""Which HF transformers model types refine can export under HF's own TP plan, and their configs.

Imports transformers' configuration classes only (no torch, no model code), so that
`refine export --framework transformers` rejects a bad model type, config file or TP degree in
one line before anything heavy is imported.

A tiny config of a model type is its configuration class built with small sizes: every size
attribute the class has (hidden size, heads, layers, vocabulary, experts, MLA ranks, ...) is
given a tiny value, the rest keep the class's defaults (so the architecture's own switches,
norms, activations, rope and tied embeddings are as shipped). Sizes are chosen so that HF's plan
splits them at the TP degree asked: 8 attention heads and 4 key/value heads of size 8 up to
TP 4, as many of each as ranks beyond. The plan itself is never touched here.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refine.exporters.errors import ExportError

TINY = "tiny"
BATCH, SEQ_LEN = 2, 8  # the example batch: 2 sequences of 8 tokens
# styles of HF's plans that shard experts: `moe_tp_experts` splits each expert over TP (exported:
# HF's own experts code on every rank), the others distribute experts over the ranks (issue 42)
MOE_STYLES = frozenset({"moe_tp_experts", "moe_identity_expert", "ep_router", "grouped_gemm", "ep_dispatch_experts"})
# HF's plan styles that shard a projection's output: the heads it computes are split over the ranks
_HEAD_SPLITTING = frozenset({"colwise", "packed_colwise"})


def _tiny_sizes(tp: int) -> dict[str, Any]:
    """Size attribute -> tiny value at TP `tp` (only the attributes a config class has are set)."""
    heads = max(8, tp)
    kv = 4 if tp <= 4 else tp
    head_dim = 8
    hidden = heads * head_dim
    return {
        # dense decoder
        "vocab_size": 128, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "max_position_embeddings": 64, "original_max_position_embeddings": 64, "sliding_window": 4,
        "sliding_window_size": 4, "max_window_layers": 2, "query_pre_attn_scalar": head_dim,
        "swa_num_attention_heads": heads, "swa_head_dim": head_dim, "attention_chunk_size": 4,
        "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "intermediate_size_mlp": 2 * hidden,
        "dense_intermediate_size": 2 * hidden, "ffn_hidden_size": 2 * hidden, "num_layers": 2,
        # GPT-J / CodeGen / GPT-NeoX spellings
        "n_embd": hidden, "n_head": heads, "n_layer": 2, "n_positions": 64, "n_ctx": 64, "rotary_dim": head_dim // 2,
        # mixture of experts
        "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
        "moe_num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32,
        "shared_intermediate_size": 32, "shared_experts_intermediate_size": 32, "expert_ffn_hidden_size": 32,
        "moe_shared_expert_intermediate_size": 32, "moe_k": 2, "num_experts_per_token": 2, "n_shared_experts": 1,
        # group-limited routing (DeepSeek-V3's): one group of the 4 experts, so every expert is a candidate
        "n_group": 1, "topk_group": 1,
        # multi-head latent attention
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "qk_head_dim": 8,
        "v_head_dim": head_dim, "o_lora_rank": 16, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 4,
        # linear attention and state-space layers
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_value_heads": heads,
        "linear_num_key_heads": kv, "linear_head_dim": 8, "linear_num_heads": heads, "mamba_n_heads": heads,
        "mamba_d_state": 8, "mamba_chunk_size": 4, "mamba_num_heads": heads, "mamba_head_dim": 8,
        "ssm_state_size": 8, "chunk_size": 4,
        # layers that share another layer's key/value cache (Gemma 3n): none of the 2
        "num_kv_shared_layers": 0,
    }


def _tiny(defaults: dict[str, Any], tp: int) -> dict[str, Any]:
    """The tiny values of the size attributes `defaults` has (a size the class derives itself,
    `"auto"`, stays derived from the tiny ones), and of its sub-configs (a multimodal model's
    `text_config`, `vision_config`: a dict with a `model_type`), each its class's defaults but
    for its tiny sizes."""
    tiny = _tiny_sizes(tp)
    sizes: dict[str, Any] = {k: v for k, v in tiny.items() if k in defaults and not isinstance(defaults[k], str)}
    if "kv_lora_rank" in sizes:  # multi-head latent attention: a key and value per query head, rotated at head_dim
        sizes.update(num_key_value_heads=tiny["num_attention_heads"], qk_rope_head_dim=tiny["head_dim"],
                     qk_head_dim=tiny["qk_nope_head_dim"] + tiny["head_dim"])
        sizes = {k: v for k, v in sizes.items() if k in defaults or k in ("num_key_value_heads",)}
    for key, sub in defaults.items():
        if isinstance(sub, dict) and isinstance(sub.get("model_type"), str):
            sizes[key] = {"model_type": sub["model_type"], **_tiny(sub, tp)}  # (the rest: the sub-class's defaults)
    return sizes


def _reads_mrope(cls: type) -> bool:
    """Whether a config class's model uses M-RoPE sections (`mrope_section`, by default sized for its
    own head size): its configuration module says so."""
    import inspect

    try:
        return "mrope_section" in Path(inspect.getfile(cls)).read_text()
    except (OSError, TypeError):
        return False


def _variants(cls: type, defaults: dict[str, Any], tp: int) -> Iterator[dict[str, Any]]:
    """The tiny sizes for a config class whose defaults are `defaults`, then the variants some
    classes' validations ask for, in turn: as many key/value heads as attention heads, and the
    class's own head size (a rope section or partial rotary factor made for it)."""
    sizes = _tiny(defaults, tp)
    vocab = sizes.get("vocab_size", 0)
    for i, token in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):
        if isinstance(defaults.get(token), int) and defaults[token] >= vocab:
            sizes[token] = vocab - 1 - i  # (a token id of the shipped vocabulary, outside the tiny one)
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and rope and _reads_mrope(cls):  # (M-RoPE: sections of the rotary half, summing to head_dim / 2)
        half = sizes.get("head_dim", 8) // 2
        section = [half // 4, half // 4, half - 2 * (half // 4)]
        nested = rope and all(isinstance(v, dict) for v in rope.values())  # (one entry per attention type)
        sizes["rope_parameters"] = ({k: {**v, "mrope_section": section} for k, v in rope.items()} if nested
                                    else {**rope, "mrope_section": section})
    yield sizes
    if "num_key_value_heads" in sizes:
        yield {**sizes, "num_key_value_heads": sizes.get("num_attention_heads")}
    own_head = {k: v for k, v in sizes.items() if k not in ("head_dim", "qk_head_dim", "v_head_dim")}
    if own_head != sizes:
        yield own_head
        if "num_key_value_heads" in own_head:
            yield {**own_head, "num_key_value_heads": own_head.get("num_attention_heads")}


@dataclass(frozen=True)
class HFConfig:
    """A model type's config (transformers' PreTrainedConfig) and where it came from."""

    model_type: str
    config: Any  # transformers.PreTrainedConfig
    source: str  # "tiny" or the JSON file's path

    @property
    def causal(self) -> bool:
        """Whether transformers has a causal-LM class for this model type (else: its base model)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return self.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    @property
    def vocab(self) -> int:
        return token_vocab(self.config, self.model_type)


def token_vocab(config: Any, model_type: str) -> int:
    """The token vocabulary size of an HF config (its text config's `vocab_size`); an ExportError
    saying so when it has none (a vision or audio encoder's config), never an AttributeError."""
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ExportError(f"model type {model_type!r} has no token vocabulary (its config has no vocab_size: its "
                          "inputs are not token ids, e.g. a vision or audio encoder): refine exports models of token ids")
    return vocab


def _transformers() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers
            from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise ExportError(f"--framework transformers needs HF transformers (pip install -e '.[torch]'): {exc}") from None
    hf_logging.set_verbosity_error()  # (its warnings about token ids of other vocabularies)
    return transformers


def known_model_types() -> list[str]:
    """Every model type transformers knows (its CONFIG_MAPPING), sorted."""
    from transformers import CONFIG_MAPPING

    _transformers()
    return sorted(CONFIG_MAPPING.keys())


def _class_plan(model_type: str, attribute: str) -> dict[str, str]:
    """A plan the model type's config class ships (a class attribute), {} if none."""
    from transformers import CONFIG_MAPPING

    _transformers()
    if model_type not in CONFIG_MAPPING:
        return {}
    return dict(getattr(CONFIG_MAPPING[model_type], attribute, None) or {})


def shipped_plan(model_type: str) -> dict[str, str]:
    """The TP plan the model type's config class ships (`base_model_tp_plan`), {} if none."""
    return _class_plan(model_type, "base_model_tp_plan")


def model_types_with_plan() -> list[str]:
    """The model types whose config class ships a TP plan, sorted."""
    return [t for t in known_model_types() if shipped_plan(t)]


def shipped_ep_plan(model_type: str) -> dict[str, str]:
    """The expert-parallel plan the model type's config class ships (`base_model_ep_plan`), {} if none."""
    return _class_plan(model_type, "base_model_ep_plan")


def model_types_with_ep_plan() -> list[str]:
    """The model types whose config class ships a TP plan and an expert-parallel plan, sorted."""
    return [t for t in model_types_with_plan() if expert_parallel(shipped_ep_plan(t))]


# the expert-parallel styles (the experts split over the ranks); moe_identity_expert is a TP style (LongCat's
# zero experts: the identity's input divided by the TP size, as moe_tp_experts sums over the ranks)
EP_STYLES = MOE_STYLES - {"moe_tp_experts", "moe_identity_expert"}


def expert_parallel(plan: dict[str, str]) -> bool:
    """Whether a TP plan distributes experts over the ranks (an expert-parallel style): its token
    dispatch exchanges rows whose counts depend on the routing, not exported yet (issue 42).
    `moe_tp_experts` (each expert's weights split over TP, every rank running every expert on
    every routed row, HF's experts implementation unchanged) and `moe_identity_expert` are
    exported."""
    return bool(EP_STYLES & set(plan.values()))


def tiny_config(model_type: str, tp: int) -> HFConfig:
    """The model type's configuration class with tiny sizes for TP `tp` (module doc)."""
    transformers = _transformers()
    if model_type not in transformers.CONFIG_MAPPING:
        raise ExportError(f"unknown model type {model_type!r} (transformers {transformers.__version__} knows "
                          f"{len(transformers.CONFIG_MAPPING.keys())}; `refine zoo --framework transformers --list` lists "
                          "those with a TP plan)")
    cls = transformers.CONFIG_MAPPING[model_type]
    failure: Exception | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            defaults = cls().to_dict()
        except Exception as exc:  # noqa: BLE001 - the class's own validation
            raise ExportError(f"model type {model_type!r}: its config class {cls.__name__} does not build even with "
                              f"its defaults: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
        for sizes in _variants(cls, defaults, tp):
            try:
                config = cls(**sizes, use_cache=False)
                break
            except Exception as exc:  # noqa: BLE001 - whatever the class's validation says is the reason
                failure = failure or exc
        else:
            raise ExportError(f"model type {model_type!r}: its config class {cls.__name__} does not build with tiny "
                              f"sizes: {type(failure).__name__}: {' '.join(str(failure).split())[:200]}")
    return HFConfig(model_type, config, TINY)


def file_config(path: str, model_type: str | None) -> HFConfig:
    """The config a config.json gives (its `model_type` says the class; `model_type`, if given,
    must agree)."""
    transformers = _transformers()
    file = Path(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{file}: not a readable config.json ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ExportError(f"{file}: a config.json is a JSON object with a `model_type`")
    kind = raw["model_type"]
    if model_type is not None and model_type != kind:
        raise ExportError(f"{file}: its model_type is {kind!r}, not --model-type {model_type!r}")
    if kind not in transformers.CONFIG_MAPPING:
        raise ExportError(f"{file}: unknown model type {kind!r} (transformers {transformers.__version__})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = transformers.CONFIG_MAPPING[kind].from_dict({**raw, "use_cache": False})
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"{file}: transformers cannot build a {kind} config from it: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]}") from None
    return HFConfig(kind, config, str(file))


def resolve_config(model_type: str | None, config: str, tp: int) -> HFConfig:
    """`--config tiny` (the model type's tiny config) or `--config FILE.json`."""
    if config == TINY:
        if model_type is None:
            raise ExportError("--framework transformers needs --model-type T (or --config FILE.json with a model_type)")
        return tiny_config(model_type, tp)
    if not Path(config).is_file():
        raise ExportError(f"--config {config!r}: neither 'tiny' nor a config.json file")
    return file_config(config, model_type)


# HF's experts implementations (`from_config(experts_implementation=...)`) an export can trace: `eager` loops
# over the experts a batch routes to (a data-dependent loop), which torch.export cannot capture
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
# HF's expert-parallel dispatch (`DistributedConfig(ep_implementation=...)`) over the TP ranks: AllReduceEP (no
# token moves) or AllToAllEP (routes exchanged by ragged all-to-alls: exporters/frameworks/transformers_all_to_all.py)
EP_IMPLEMENTATIONS = ("all_reduce", "all_to_all")


def validate(model_type: str | None, config: str, tp: int, sp: bool = False, train: bool = False,
             ep: int | None = None, experts: str | None = None, ep_implementation: str | None = None) -> HFConfig:
    """The config, if HF's shipped plan applies to it at TP `tp` (with `ep`: and its
    expert-parallel plan over the same ranks); an ExportError saying why not (no plan, experts
    split without --ep, heads that the plan cannot split evenly, SP)."""
    if tp < 2:
        raise ExportError(f"--tp must be at least 2 (HF's plan applies from tp_size 2), got {tp}")
    if ep is not None and ep != tp:
        raise ExportError(f"--ep {ep}: HF's expert parallelism is exported over the TP ranks themselves "
                          f"(ep_size == tp_size): pass --ep {tp}")
    if ep_implementation is not None and ep_implementation not in EP_IMPLEMENTATIONS:
        raise ExportError(f"--ep-implementation {ep_implementation!r}: one of {', '.join(EP_IMPLEMENTATIONS)} (HF's "
                          "`auto` picks one of the two: all_to_all for a training step)")
    if ep_implementation is not None and ep is None:
        raise ExportError("--ep-implementation is HF's expert-parallel dispatch: pass --ep N (= --tp)")
    if experts is not None and experts not in EXPERTS_IMPLEMENTATIONS:
        raise ExportError(f"--experts {experts!r}: one of {', '.join(EXPERTS_IMPLEMENTATIONS)} (HF's `eager` experts "
                          "loop over the experts a batch routes to, a loop torch.export cannot capture)")
    if sp:
        raise ExportError("transformers ships no sequence-parallel plan (DistributedConfig's enable_sequence_parallel "
                          "is 'not wired up yet' in its own words, and no base_model_tp_plan uses sequence_parallel): "
                          "drop --sp")
    hf = resolve_config(model_type, config, tp)
    text = hf.config.get_text_config()
    plan = dict(getattr(type(hf.config), "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None) or {})
    if not plan:
        raise ExportError(f"model type {hf.model_type!r} ships no tensor-parallel plan (its config's base_model_tp_plan "
                          f"is empty): transformers itself refuses tp_size={tp} (\"has no `tp_plan`\")")
    if expert_parallel(plan):
        raise ExportError(f"model type {hf.model_type!r}'s TP plan distributes its experts over the ranks "
                          f"({', '.join(sorted(EP_STYLES & set(plan.values())))}): its token dispatch is not exported "
                          "yet (issue 42); its expert-parallel plan is, with --ep")
    if ep is not None and not expert_parallel(dict(getattr(text, "base_model_ep_plan", None) or {})):
        raise ExportError(f"model type {hf.model_type!r} ships no expert-parallel plan (its config's "
                          "base_model_ep_plan names no expert-parallel style): drop --ep")
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    if not hf.causal and hf.model_type not in MODEL_MAPPING_NAMES:
        raise ExportError(f"model type {hf.model_type!r} has neither a causal-LM class nor a base model class in "
                          "transformers (AutoModelForCausalLM, AutoModel): nothing to build from its config alone")
    token_vocab(hf.config, hf.model_type)
    if not hf.causal and train:
        raise ExportError(f"model type {hf.model_type!r} has no causal-LM class (AutoModelForCausalLM), so no loss of "
                          "its own: export its base model's forward (drop --train)")
    _check_heads(hf, plan, tp)
    return hf


def _head_counts(text: Any, attr: str) -> list[Any]:
    """The values of a head count `attr`: one, or one per layer when the config is heterogeneous
    (HF's per-layer configs, e.g. EmbeddingGemma 2's key/value heads), whose global value HF
    refuses to read (AmbiguousGlobalPerLayerAttributeError)."""
    if attr in (getattr(text, "per_layer_attributes", None) or ()):
        return [getattr(layer, attr, None) for layer in text.per_layer_config]
    return [getattr(text, attr, None)]


def _check_heads(hf: HFConfig, plan: dict[str, str], tp: int) -> None:
    """The heads HF's plan splits divide by `tp` (HF's own get_kv_heads_per_rank): HF does not
    check this itself when it shards, and its attention would then view a rank's slice as whole
    heads of `head_dim` (an error, or heads cut in two)."""
    text = hf.config.get_text_config()
    split = {key.rsplit(".", 1)[-1] for key, style in plan.items() if style in _HEAD_SPLITTING}
    checks = (("attention heads", "num_attention_heads", {"q_proj", "qkv_proj", "query_key_value", "q_b_proj"}),
              ("key/value heads", "num_key_value_heads", {"k_proj", "qkv_proj", "query_key_value", "kv_b_proj"}))
    for what, attr, projections in checks:
        uneven = [h for h in _head_counts(text, attr) if isinstance(h, int) and h % tp]
        if not uneven or not split & projections:
            continue
        heads = uneven[0]
        raise ExportError(f"model type {hf.model_type!r} ({hf.source} config): {heads} {what} do not divide by --tp {tp}; "
                          f"HF's plan shards {', '.join(sorted(split & projections))} by output features anyway "
                          f"(get_kv_heads_per_rank gives None), and each rank's attention would then view its slice "
                          f"as whole heads: pick a TP degree dividing {heads}")
