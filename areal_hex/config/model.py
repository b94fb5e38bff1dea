"""Which model and tokenizer to use."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_hex.config.base import Section


class TinyModelConfig(Section):
    """A small Qwen3 built from a config with a locally built tokenizer (no downloads)."""

    num_layers: int = Field(2, gt=0)
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(512, gt=0)
    # Supervised warm start on task text before RL (0: random weights). An RL run needs a
    # policy that sometimes earns a reward; a random 2-layer model never does.
    sft_steps: int = Field(0, ge=0)
    sft_lr: float = Field(3e-3, gt=0)
    sft_batch_size: int = Field(32, gt=0)


class ModelConfig(Section):
    # HF hub name or local directory; None with `tiny` set builds the tiny model.
    path: str | None = None
    tokenizer_path: str | None = None
    tiny: TinyModelConfig | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
