"""GRPO advantages, the decoupled PPO objective, KL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from areal_hex.config.base import Section


class AlgoConfig(Section):
    # "loo" with std_normalize is GRPO scaled by G/(G-1); "rloo" is never std-normalised.
    advantage: Literal["grpo", "loo", "rloo", "drgrpo"] = "grpo"
    std_normalize: bool = True
    # Normalise advantages again over the whole batch (informative groups only).
    batch_normalize: bool = False
    # Surrogate: token-level PPO, GSPO (sequence ratio) or CISPO (clipped IS weight).
    objective: Literal["ppo", "gspo", "cispo"] = "ppo"
    std_eps: float = Field(1e-6, gt=0)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    # Dual clip for negative advantages (None: off); must be > 1.
    dual_clip: float | None = None
    decoupled: bool = True
    # Cap on the behaviour weight pi_prox / pi_behav (None: no cap).
    behav_cap: float | None = 5.0
    behav_cap_mode: Literal["truncate", "mask"] = "truncate"
    # Lower bound on pi_prox / pi_behav: tokens below it are masked (IcePop with "mask").
    behav_floor: float | None = Field(None, ge=0)
    # Entropy bonus: - entropy_coeff x entropy per token.
    entropy_coeff: float = Field(0.0, ge=0)
    # Drop completions cut at max_new_tokens (finish "length") from the loss.
    overlong_mask: bool = False
    # DAPO soft overlong penalty: reward - factor x (len - (max - buffer)) / buffer past
    # max_new_tokens - buffer (None: off).
    overlong_buffer: int | None = Field(None, gt=0)
    overlong_penalty: float = Field(1.0, ge=0)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_len"] = (
        "token_mean"
    )
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    # Clamp on log(pi / pi_ref) before the estimator (None: none).
    kl_clamp: float | None = Field(None, gt=0)
    kl_in_reward: bool = False
    # Optimizer updates per trainer step: the batch is split into this many minibatches
    # (by group), all scored by the same proximal policy (the weights at the step start).
    ppo_minibatches: int = Field(1, gt=0)
    # Denominators (tokens, sequences) of the aggregation: "all" completions of the step,
    # or only those of "informative" groups (rewards not all equal), so that groups
    # without signal do not scale the step down when dynamic sampling is off.
    denominator: Literal["all", "informative"] = "all"
    # Dr. GRPO's constant length for aggregation "fixed_len" (None: rollout.max_new_tokens).
    fixed_len: int | None = Field(None, gt=0)

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, v: float | None) -> float | None:
        if v is not None and v <= 1.0:
            raise ValueError("expected a value > 1 (or null to turn dual clip off)")
        return v

    @model_validator(mode="after")
    def _dual_clip_needs_a_clipped_ratio(self) -> AlgoConfig:
        # CISPO's loss -A·sg(w)·log π is <= 0 < -A·c whenever A < 0: the bound never binds.
        if self.dual_clip is not None and self.objective == "cispo":
            raise ValueError(
                "dual_clip has no effect with objective cispo (its loss -A·w·log π never "
                "exceeds -A·c for A < 0): set dual_clip to null, or use objective ppo or gspo"
            )
        return self

    @model_validator(mode="after")
    def _floor_below_cap(self) -> AlgoConfig:
        if self.behav_floor is not None and self.behav_cap is not None:
            if self.behav_floor >= self.behav_cap:
                raise ValueError(
                    f"behav_floor {self.behav_floor} must be below behav_cap {self.behav_cap}"
                )
        return self
