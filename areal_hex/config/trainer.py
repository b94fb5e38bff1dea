"""The DeepSpeed trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_hex.config.base import Section


class TrainerConfig(Section):
    num_ranks: int = Field(1, gt=0)
    launcher: Literal["deepspeed", "torchrun"] = "deepspeed"
    zero_stage: int = Field(0, ge=0, le=3)
    device: Literal["cpu", "cuda"] = "cpu"
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    # Per-rank token budget of one micro-batch.
    micro_batch_tokens: int = Field(4096, gt=0)
    total_steps: int = Field(20, gt=0)
    publish_every: int = Field(1, gt=0)
    keep_versions: int = Field(3, gt=0)
    checkpoint_every: int = Field(10, gt=0)
    resume: str = "auto"
