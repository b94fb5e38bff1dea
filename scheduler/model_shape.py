"""Model shapes for the cost model: presets or an HF `config.json`.

Only what the cost model needs: layers, hidden size, heads, KV heads, head dim, MLP size,
vocabulary, tied embeddings, and the parameter count derived from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from areal_hex.config import ConfigError


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool

    @property
    def params(self) -> int:
        """Parameter count of a dense decoder (Qwen3/Llama layout: q/k/v/o, gated MLP,
        RMSNorms; Qwen3's q/k norms are `head_dim` each)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h + 2 * d
        mlp = 3 * h * self.intermediate
        layer = attn + mlp + 2 * h
        embed = self.vocab * h * (1 if self.tied_embeddings else 2)
        return self.layers * layer + embed + h

    def hf_config(self) -> dict[str, int | bool]:
        """The HF `config.json` keys of this shape (what `load_model_shape` reads back):
        `Qwen3Config(**shape.hf_config())` builds a model of it with random weights."""
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tied_embeddings,
        }

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, bf16: 2 · layers · KV heads · head dim · 2 bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _m(name: str, L: int, h: int, nh: int, kv: int, inter: int, vocab: int, tied: bool):
    return ModelShape(name, L, h, nh, kv, 128, inter, vocab, tied)


# Shapes from each model's published config.json (Qwen/Qwen3-*, meta-llama/Meta-Llama-3-*,
# deepseek-ai/DeepSeek-R1-Distill-Qwen-7B: Qwen2.5-Math-7B's shape).
PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _m("Qwen/Qwen3-0.6B", 28, 1024, 16, 8, 3072, 151936, True),
        _m("Qwen/Qwen3-1.7B", 28, 2048, 16, 8, 6144, 151936, True),
        _m("Qwen/Qwen3-4B", 36, 2560, 32, 8, 9728, 151936, True),
        _m("Qwen/Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, False),
        _m("Qwen/Qwen3-14B", 40, 5120, 40, 8, 17408, 151936, False),
        _m("Qwen/Qwen3-32B", 64, 5120, 64, 8, 25600, 151936, False),
        _m("meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, False),
        _m("meta-llama/Meta-Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, False),
        _m("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 28, 3584, 28, 4, 18944, 152064, False),
    )
}


def _short(name: str) -> str:
    return name.split("/")[-1].lower().replace("meta-", "").replace("-instruct", "")


def load_model_shape(name_or_path: str) -> ModelShape:
    """A preset (full HF name or short form like `qwen3-8b`, `llama-3-70b`) or a path to
    an HF `config.json` (or the directory holding it)."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return _from_config(p, name_or_path)
    key = _short(name_or_path)
    for preset in PRESETS.values():
        if _short(preset.name) == key:
            return preset
    names = ", ".join(PRESETS)
    raise ConfigError(
        f"--model {name_or_path!r}: not a preset and no config.json there (presets: {names})"
    )


def _from_config(path: Path, label: str) -> ModelShape:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read an HF config.json: {exc}") from None
    need = ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(missing)} (expected an HF config.json)")
    h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelShape(
        name=label,
        layers=int(cfg["num_hidden_layers"]),
        hidden=h,
        heads=nh,
        kv_heads=int(cfg.get("num_key_value_heads") or nh),
        head_dim=int(cfg.get("head_dim") or h // nh),
        intermediate=int(cfg.get("intermediate_size") or 4 * h),
        vocab=int(cfg["vocab_size"]),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
