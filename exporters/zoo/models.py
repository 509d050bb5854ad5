"""The model zoo: tiny Llama, Qwen2 and GPT-2 models with random weights, built reproducibly.

Every builder returns a module whose forward takes `input_ids` and returns the logits tensor
only (HF outputs carry a cache object that torch.export cannot return), with use_cache=False
and eager attention (plain MatMul/Softmax, which the verifier's lemmas and the reference
executor handle; SDPA would be one opaque op). Weights are HF's initialization plus a seeded
perturbation, so that no norm weight is exactly 1 and no bias exactly 0 and a wrongly
distributed weight cannot go unnoticed in a numeric check.

GPT-2: HF's GPT-2 cannot be tensor-parallelized by DTensor: its projections are `Conv1D`
modules ("ColwiseParallel currently only support nn.Linear and nn.Embedding!") and q/k/v are
one fused `c_attn` that the attention splits by the full hidden size. `MegatronGPT2` is the
same network written Megatron-style (separate q/k/v nn.Linear, heads inferred from the local
width), loaded from an HF GPT-2's weights; tests check it computes what HF's GPT-2 computes.
"""

from __future__ import annotations

from dataclasses import replace

import functools

import torch
from torch import nn

from refine.exporters.zoo.configs import ZooConfig, zoo_config

# --- HF causal LMs returning logits only ---------------------------------------------------


def _logits_only(cls: type) -> type:
    """A subclass of an HF causal LM whose forward(input_ids) returns the logits tensor.

    A subclass rather than a wrapper module keeps HF's parameter FQNs (`model.layers.0...`)."""

    def forward(self: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return cls.forward(self, input_ids=input_ids, use_cache=False).logits

    return type(f"{cls.__name__}Logits", (cls,), {"forward": forward, "__module__": __name__})


def _hf_config(model: str, cfg: ZooConfig):  # noqa: ANN202 - an HF config class
    common = dict(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=4 * cfg.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )
    if model == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if model == "mixtral":
        from transformers import MixtralConfig

        from refine.exporters.zoo.moe import EXPERTS, TOP_K

        return MixtralConfig(**common, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, router_jitter_noise=0.0)
    from transformers import Qwen2Config

    return Qwen2Config(**common)


def _perturb(module: nn.Module, seed: int) -> None:
    """Add seeded noise to every parameter (deterministic: same seed, same weights)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


# --- GPT-2, Megatron style -------------------------------------------------------------------


class GPT2Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections; the head count is the local width
    divided by the head size, so a column-parallel rank runs its heads unchanged."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (self.head_dim**0.5)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, intermediate)
        self.c_proj = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ZooConfig, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=eps)
        self.attn = GPT2Attention(cfg.hidden, cfg.heads)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=eps)
        self.mlp = GPT2MLP(cfg.hidden, cfg.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MegatronGPT2(nn.Module):
    """GPT-2 (learned positions, pre-LayerNorm, tanh-GELU MLP, tied LM head) with Linear layers."""

    def __init__(self, cfg: ZooConfig, positions: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(positions, cfg.hidden)
        self.h = nn.ModuleList(GPT2Block(cfg, eps) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @classmethod
    def from_hf(cls, hf: nn.Module, cfg: ZooConfig) -> "MegatronGPT2":
        """The same network as an HF GPT2LMHeadModel: Conv1D weights ([in, out]) are transposed,
        the fused c_attn is split into q, k, v."""
        t = hf.transformer
        model = cls(cfg, positions=t.wpe.weight.shape[0], eps=t.ln_f.eps)
        H = cfg.hidden
        with torch.no_grad():
            model.wte.weight.copy_(t.wte.weight)
            model.wpe.weight.copy_(t.wpe.weight)
            model.ln_f.load_state_dict(t.ln_f.state_dict())
            for ours, theirs in zip(model.h, t.h):
                ours.ln_1.load_state_dict(theirs.ln_1.state_dict())
                ours.ln_2.load_state_dict(theirs.ln_2.state_dict())
                w, b = theirs.attn.c_attn.weight, theirs.attn.c_attn.bias
                for i, proj in enumerate((ours.attn.q_proj, ours.attn.k_proj, ours.attn.v_proj)):
                    proj.weight.copy_(w[:, i * H : (i + 1) * H].T)
                    proj.bias.copy_(b[i * H : (i + 1) * H])
                pairs = ((ours.attn.c_proj, theirs.attn.c_proj), (ours.mlp.c_fc, theirs.mlp.c_fc),
                         (ours.mlp.c_proj, theirs.mlp.c_proj))
                for mine, conv in pairs:
                    mine.weight.copy_(conv.weight.T)
                    mine.bias.copy_(conv.bias)
        return model


def hf_gpt2(cfg: ZooConfig, seed: int) -> nn.Module:
    """The HF GPT2LMHeadModel the Megatron-style variant is loaded from (eval mode, perturbed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=cfg.vocab, n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads, n_inner=cfg.intermediate,
        n_positions=4 * cfg.seq_len, use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    hf = GPT2LMHeadModel(config).eval()
    _perturb(hf, seed)
    return hf


# --- entry points ------------------------------------------------------------------------------


def build(model: str, config: str, seed: int = 0, *, layers: int | None = None, meta: bool = False) -> nn.Module:
    """The full (unsharded) zoo model in eval mode; the same seed gives the same weights.

    `layers` overrides the config's layer count; `meta` builds it on the meta device (shapes
    and dtypes, no data: nothing allocated, for configs too large to hold)."""
    cfg = zoo_config(model, config, layers)
    if meta:
        with torch.device("meta"):
            if model == "gpt2":
                return MegatronGPT2(cfg, positions=4 * cfg.seq_len).eval()
            return _moe_dense(model, _hf_class(model)(_hf_config(model, cfg))).eval()
    if model == "gpt2":
        return MegatronGPT2.from_hf(hf_gpt2(cfg, seed), cfg).eval()
    torch.manual_seed(seed)
    module = _hf_class(model)(_hf_config(model, cfg)).eval()
    _perturb(module, seed)
    return _moe_dense(model, module).eval()


def _moe_dense(model: str, module: nn.Module) -> nn.Module:
    """Mixtral's MoE blocks as dense-dispatch twins (exporters/zoo/moe.py); other models as they are."""
    if model != "mixtral":
        return module
    from refine.exporters.zoo import moe

    return moe.use_dense_moe(module)


@functools.cache
def _hf_class(model: str) -> type:
    from transformers import LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM

    return _logits_only({"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM}.get(model, Qwen2ForCausalLM))


def example_inputs(model: str, config: str, seed: int = 0, *, meta: bool = False,
                   labels: bool = False, batch: int | None = None) -> tuple[torch.Tensor, ...]:
    """Token ids of the zoo config's batch (or `batch` rows) and sequence length (on the meta
    device: no values), and with `labels` a second tensor of target ids for a training step."""
    cfg = zoo_config(model, config)
    cfg = cfg if batch is None else replace(cfg, batch=batch)
    count = 2 if labels else 1
    if meta:
        return tuple(torch.zeros((cfg.batch, cfg.seq_len), dtype=torch.long, device="meta") for _ in range(count))
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=gen) for _ in range(count))
