"""GRPO advantages, the decoupled PPO objective, KL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from areal_hex.config.base import Section


class AlgoConfig(Section):
    advantage: Literal["grpo", "loo", "drgrpo"] = "grpo"
    std_normalize: bool = True
    std_eps: float = Field(1e-6, gt=0)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    # Dual clip for negative advantages (None: off); must be > 1.
    dual_clip: float | None = None
    decoupled: bool = True
    # Cap on the behaviour weight pi_prox / pi_behav (None: no cap).
    behav_cap: float | None = 5.0
    behav_cap_mode: Literal["truncate", "mask"] = "truncate"
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_len"] = (
        "token_mean"
    )
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    # Optimizer updates per trainer step: the batch is split into this many minibatches
    # (by group), all scored by the same proximal policy (the weights at the step start).
    ppo_minibatches: int = Field(1, gt=0)
    # Dr. GRPO's constant length for aggregation "fixed_len" (None: rollout.max_new_tokens).
    fixed_len: int | None = Field(None, gt=0)

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, v: float | None) -> float | None:
        if v is not None and v <= 1.0:
            raise ValueError("expected a value > 1 (or null to turn dual clip off)")
        return v
