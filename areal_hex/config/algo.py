"""Advantages (GRPO family, or GAE with a critic), the decoupled PPO objective, KL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from areal_hex.config.base import Section

# The settings of the critic and GAE, meaningful only with advantage gae.
CRITIC_KEYS = frozenset(
    {"gamma", "lam", "whiten_advantages", "value_clip", "critic_lr", "critic_warmup_steps"}
)


class AlgoConfig(Section):
    # "loo" with std_normalize is GRPO scaled by G/(G-1); "rloo" is never std-normalised.
    # "gae": PPO with a critic (a value model trained beside the policy), token-level
    # advantages by GAE; the keys below it apply to it alone.
    advantage: Literal["grpo", "loo", "rloo", "drgrpo", "gae"] = "grpo"
    # GAE: discount and lambda (1 and 1: the outcome reward minus the critic's value).
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    # GAE: whiten the token advantages over the step (mean 0, variance 1).
    whiten_advantages: bool = True
    # The critic's new values stay within value_clip of the values it predicted at the
    # step start before the error stops shrinking (PPO's value clip; null: no clip).
    value_clip: float | None = Field(0.5, gt=0)
    # The critic's optimizer: its learning rate (null: trainer.lr) and the first steps
    # that train the critic alone (the policy is not updated during them).
    critic_lr: float | None = Field(None, gt=0)
    critic_warmup_steps: int = Field(0, ge=0)
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
    def _critic_keys_need_gae(self) -> AlgoConfig:
        # a key at its default says nothing (a saved, resolved config holds them all)
        fields = type(self).model_fields
        changed = {k for k in fields if getattr(self, k) != fields[k].default}
        if self.advantage != "gae":
            used = sorted(CRITIC_KEYS & changed)
            if used:
                raise ValueError(
                    f"{', '.join(used)} {'applies' if len(used) == 1 else 'apply'} to "
                    f"advantage gae only (advantage is {self.advantage!r}): remove "
                    f"{'it' if len(used) == 1 else 'them'}, or set advantage: gae"
                )
            return self
        if self.batch_normalize:
            raise ValueError(
                "batch_normalize does not apply to advantage gae: its token advantages are "
                "whitened over the step by whiten_advantages"
            )
        if "std_normalize" in changed:
            raise ValueError(
                "std_normalize does not apply to advantage gae (it scales group baselines): "
                "remove it; whiten_advantages normalises GAE's advantages"
            )
        if self.denominator == "informative":
            raise ValueError(
                "denominator informative counts groups whose rewards differ, but with "
                "advantage gae every completion has an advantage: use denominator all"
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
