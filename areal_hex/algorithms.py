"""RL algorithms as pure tensor functions: GRPO advantages, the decoupled PPO objective,
loss aggregation with global denominators, KL estimators.

Shapes: `N` sequences (completions), `G` completions per group, `T` tokens per padded
sequence. Token tensors are (N, T) with a 0/1 `mask` marking real completion tokens.

Nothing here knows about DeepSpeed or ranks: the trainer computes the global counts for
a whole optimizer step once and passes them in, so a loss split over micro-batches and
ranks sums to exactly the loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from areal_hex.config.algo import AlgoConfig


# ---------------------------------------------------------------- advantages
def _degenerate(rewards: Tensor) -> Tensor:
    """(N, G) -> (N,) bool: groups whose rewards are all equal (no learning signal)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def mean_baseline(rewards: Tensor, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: A = (r - mean(r)) / (std(r) + eps) per group; std is the population std
    (correction 0), defined for G = 1 too. (N, G) -> (N, G)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (rewards.std(dim=1, correction=0, keepdim=True) + eps)
    return centred


def leave_one_out_baseline(
    rewards: Tensor, std_normalize: bool = False, eps: float = 1e-6
) -> Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r)). (N, G) -> (N, G)."""
    g = rewards.shape[1]
    if g < 2:
        return rewards * 0.0
    adv = (rewards - rewards.mean(dim=1, keepdim=True)) * (g / (g - 1))
    if std_normalize:
        adv = adv / (rewards.std(dim=1, correction=0, keepdim=True) + eps)
    return adv


def no_std_baseline(rewards: Tensor, std_normalize: bool = False, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO: A = r - mean(r), never divided by the std (the std biases towards easy and
    hard prompts). `std_normalize` is ignored. (N, G) -> (N, G)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": mean_baseline,
    "loo": leave_one_out_baseline,
    "drgrpo": no_std_baseline,
}


def grpo_advantages(
    rewards: Tensor, kind: str = "grpo", std_normalize: bool = True, eps: float = 1e-6
) -> tuple[Tensor, int]:
    """Per-completion advantages for groups of equal size, and how many groups were
    degenerate (all rewards equal: their advantages are exactly zero, not float noise).

    rewards: (N_groups, G) -> advantages (N_groups, G), degenerate count.
    """
    if kind not in ADVANTAGES:
        raise ValueError(f"algo.advantage {kind!r}: expected one of {sorted(ADVANTAGES)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected shape (groups, G), got {tuple(rewards.shape)}")
    adv = ADVANTAGES[kind](rewards, std_normalize=std_normalize, eps=eps)
    flat = _degenerate(rewards)
    adv = adv.masked_fill(flat[:, None], 0.0)
    return adv, int(flat.sum().item())


# ---------------------------------------------------------------- KL
def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    k1 = log(p/q); k2 = (log(p/q))^2 / 2; k3 = q/p - 1 - log(q/p) (unbiased, >= 0).
    """
    log_ratio = logp - ref_logp  # log(pi / pi_ref)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return (-log_ratio).exp() - 1.0 + log_ratio
    raise ValueError(f"algo.kl_estimator {kind!r}: expected one of k1, k2, k3")


# ---------------------------------------------------------------- decoupled PPO
@dataclass
class PPOTerms:
    """Per-token outputs of the objective, (N, T) each; statistics use `mask`."""

    loss: Tensor  # per-token loss, not yet aggregated
    ratio: Tensor  # pi_theta / pi_prox (detached)
    clipped: Tensor  # bool: the clipped branch was taken (gradient zero)
    dual_clipped: Tensor  # bool: the dual-clip bound was taken
    behav_weight: Tensor  # pi_prox / pi_behav after the cap (ones when not decoupled)
    behav_masked: Tensor  # bool: token dropped because its weight exceeded the cap


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    decoupled: bool = True,
    behav_cap: float | None = None,
    behav_cap_mode: str = "truncate",
) -> PPOTerms:
    """The decoupled PPO objective (AReaL), per token.

    r = pi_theta / pi_prox; surrogate = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A);
    with `dual_clip` = c, for A < 0 the loss is bounded by -c A. The surrogate is
    multiplied by the detached behaviour weight w = pi_prox / pi_behav, capped at
    `behav_cap` ("truncate": min(w, cap); "mask": tokens with w > cap get weight 0).
    With `decoupled` False, pi_prox is pi_behav: standard PPO/GRPO, no weight.

    logp: (N, T) with grad; prox_logp, behav_logp: (N, T); advantages: (N, T) or (N, 1).
    """
    import torch

    if not decoupled:
        prox_logp = behav_logp
    prox_logp = prox_logp.detach()
    ratio = (logp - prox_logp).exp()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    adv = advantages.detach().expand_as(logp)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"algo.dual_clip {dual_clip}: expected a value > 1")
        bound = -adv * dual_clip
        dual_clipped = (adv < 0) & (pg > bound)
        pg = torch.where(dual_clipped, bound, pg)

    weight = torch.ones_like(prox_logp)
    masked = torch.zeros_like(clipped)
    if decoupled:
        weight = (prox_logp - behav_logp.detach()).exp()
        if behav_cap is not None:
            if behav_cap_mode == "truncate":
                weight = weight.clamp(max=behav_cap)
            elif behav_cap_mode == "mask":
                masked = weight > behav_cap
                weight = weight.masked_fill(masked, 0.0)
            else:
                raise ValueError(
                    f"algo.behav_cap_mode {behav_cap_mode!r}: expected truncate or mask"
                )
    return PPOTerms(
        loss=pg * weight,
        ratio=ratio.detach(),
        clipped=clipped,
        dual_clipped=dual_clipped,
        behav_weight=weight,
        behav_masked=masked,
    )


# ---------------------------------------------------------------- aggregation
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_len")


@dataclass
class GlobalCounts:
    """Denominators of one optimizer step, counted over the WHOLE batch (all ranks, all
    micro-batches) before it is split up."""

    tokens: int  # completion tokens in the step
    sequences: int  # completions in the step
    fixed_len: int = 1  # Dr. GRPO's constant length (the generation budget)


def token_weights(mask: Tensor, mode: str, counts: GlobalCounts) -> Tensor:
    """(N, T) weights such that sum(loss * weights) over every micro-batch of the step
    equals the chosen aggregate of the whole step's per-token loss.

    - token_mean: sum / global tokens
    - seq_mean_token_mean: mean over sequences of each sequence's token mean
    - seq_mean_token_sum: mean over sequences of each sequence's token sum
    - fixed_len: sum / (global sequences * fixed_len)  (Dr. GRPO)
    """
    mask = mask.float()
    if mode == "token_mean":
        return mask / max(counts.tokens, 1)
    if mode == "seq_mean_token_mean":
        lens = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (N, 1)
        return mask / lens / max(counts.sequences, 1)
    if mode == "seq_mean_token_sum":
        return mask / max(counts.sequences, 1)
    if mode == "fixed_len":
        return mask / (max(counts.sequences, 1) * max(counts.fixed_len, 1))
    raise ValueError(f"algo.aggregation {mode!r}: expected one of {AGGREGATIONS}")


def aggregate(loss: Tensor, mask: Tensor, mode: str, counts: GlobalCounts) -> Tensor:
    """Scalar contribution of one micro-batch: sum(loss * weights)."""
    return (loss * token_weights(mask, mode, counts)).sum()


# ---------------------------------------------------------------- one-call objective
def policy_loss(
    cfg: AlgoConfig,
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    counts: GlobalCounts,
    ref_logp: Tensor | None = None,
) -> tuple[Tensor, PPOTerms]:
    """The configured objective for one micro-batch: decoupled PPO (+ KL in the loss when
    `kl_coef` > 0 and not `kl_in_reward`), aggregated with the step's global counts."""
    terms = decoupled_ppo_loss(
        logp,
        prox_logp,
        behav_logp,
        advantages,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        decoupled=cfg.decoupled,
        behav_cap=cfg.behav_cap,
        behav_cap_mode=cfg.behav_cap_mode,
    )
    per_token = terms.loss
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        if ref_logp is None:
            raise ValueError("algo.kl_coef > 0 needs reference log-probs (ref_logp)")
        per_token = per_token + cfg.kl_coef * kl_estimate(logp, ref_logp, cfg.kl_estimator)
    return aggregate(per_token, mask, cfg.aggregation, counts), terms
