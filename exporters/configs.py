"""Zoo model names and sizes, and the check that a TP degree splits them evenly.

Pure Python (no torch), so that `refine export` rejects bad arguments at once, and works out
what to export before the heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporters.errors import ExportError

MODELS = ("llama", "qwen2", "gpt2")


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


CONFIGS: dict[str, ZooConfig] = {
    # multi-head attention: every TP degree dividing 8 works
    "tiny": ZooConfig(),
    # grouped-query attention (4 query heads per key/value head): TP 1 or 2
    "tiny-gqa": ZooConfig(kv_heads=2),
}


def zoo_config(model: str, config: str) -> ZooConfig:
    """The sizes of `model` under config name `config`."""
    if model not in MODELS:
        raise ExportError(f"unknown model {model!r} (known: {', '.join(MODELS)})")
    if config not in CONFIGS:
        raise ExportError(f"unknown config {config!r} (known: {', '.join(CONFIGS)})")
    cfg = CONFIGS[config]
    if model == "gpt2" and cfg.kv_heads != cfg.heads:
        raise ExportError(f"gpt2 has no grouped-query attention, which config {config!r} needs")
    return cfg


def validate(model: str, config: str, tp: int, sp: bool) -> ZooConfig:
    """The config, if `tp` (and `sp`) split it evenly; an ExportError naming the clash otherwise."""
    cfg = zoo_config(model, config)
    if tp < 1:
        raise ExportError(f"--tp must be at least 1, got {tp}")
    sizes = {"attention heads": cfg.heads, "key/value heads": cfg.kv_heads, "intermediate size": cfg.intermediate}
    if sp:
        sizes["sequence length"] = cfg.seq_len
    for what, size in sizes.items():
        if size % tp:
            hint = " (config 'tiny' has 8)" if what == "key/value heads" else ""
            raise ExportError(f"{model} config {config!r}: {what} {size} not divisible by --tp {tp}{hint}")
    return cfg
