"""The rollout controller: sampling, group size, rewards, retries."""

from __future__ import annotations

from pydantic import Field

from areal_hex.config.base import Section


class RolloutConfig(Section):
    group_size: int = Field(4, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    # Prompts in flight at once (each is a group of `group_size` requests).
    max_concurrent_groups: int = Field(16, gt=0)
    request_timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(3, ge=0)
    reward_workers: int = Field(1, gt=0)
    reward_timeout_s: float = Field(5.0, gt=0)
