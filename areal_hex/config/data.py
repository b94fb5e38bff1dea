"""Datasets and prompts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_hex.config.base import Section


class DataConfig(Section):
    # arithmetic: generated GSM8K-format problems (no downloads).
    dataset: Literal["arithmetic", "gsm8k", "math500"] = "arithmetic"
    # Local parquet/jsonl file; None for gsm8k/math500 means the HF hub dataset.
    path: str | None = None
    split: str = "train"
    eval_split: str = "test"
    num_generated: int = Field(2000, gt=0)
    max_prompt_tokens: int = Field(256, gt=0)
    use_chat_template: bool = True
    seed: int = 0
