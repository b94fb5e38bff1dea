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
    """Leave-one-out baseline: A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r)).
    With `std_normalize` the result is additionally divided by the group std, which makes
    it GRPO scaled by G/(G-1), not RLOO; `rloo` is the unnormalised estimator.
    (N, G) -> (N, G)."""
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


def rloo_baseline(rewards: Tensor, std_normalize: bool = False, eps: float = 1e-6) -> Tensor:
    """RLOO (Ahmadian et al.): A_i = r_i - mean_{j != i} r_j, never std-normalised
    (`std_normalize` is ignored). (N, G) -> (N, G)."""
    return leave_one_out_baseline(rewards, std_normalize=False)


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": mean_baseline,
    "loo": leave_one_out_baseline,
    "rloo": rloo_baseline,
    "drgrpo": no_std_baseline,
}


def batch_normalize(adv: Tensor, keep: Tensor, eps: float = 1e-6) -> Tensor:
    """Batch-level normalisation: (A - mean) / (std + eps) with mean and population std
    over the completions where `keep` is true (informative groups); the others stay 0 so
    that groups without signal never gain one. adv, keep: (M,) -> (M,)."""
    if int(keep.sum()) == 0:
        return adv * 0.0
    sel = adv[keep]
    out = (adv - sel.mean()) / (sel.std(correction=0) + eps)
    return out.masked_fill(~keep, 0.0)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_len - buffer
    tokens, then linear down to -factor at max_len, and -factor beyond. (M,) -> (M,)."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"algo.overlong_buffer {buffer}: expected 0 < buffer <= {max_len}")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0, max=float(buffer))
    return -factor * over / buffer


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
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")


K3_CAP = 10.0  # the largest k3 value a clamped estimate keeps (AReaL, verl)


def kl_estimate(
    logp: Tensor, ref_logp: Tensor, kind: str = "k3", clamp: float | None = None
) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    k1 = log(p/q); k2 = (log(p/q))^2 / 2; k3 = q/p - 1 - log(q/p) (unbiased, >= 0);
    k3+ has k3's value and k2's gradient (straight-through: k2 + sg(k3 - k2)), since the
    gradient of k3 is a biased estimate of the KL gradient and k2's is not.
    `clamp` bounds the log-ratio to [-clamp, clamp] first (exp(-log_ratio) overflows when
    the policy drifts far from the reference on a token) and, with it, k3's value to at
    most K3_CAP, as AReaL and verl do (the log-ratio clamp alone leaves e^c - 1 - c:
    2.2e4 at c = 10).
    """
    log_ratio = logp - ref_logp  # log(pi / pi_ref)
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    k2 = 0.5 * log_ratio.square()
    k3 = (-log_ratio).exp() - 1.0 + log_ratio
    if clamp is not None:
        k3 = k3.clamp(max=K3_CAP)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return k2
    if kind == "k3":
        return k3
    if kind == "k3+":
        return k2 + (k3 - k2).detach()
    raise ValueError(f"algo.kl_estimator {kind!r}: expected one of {KL_ESTIMATORS}")


def mismatch_sums(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Train-inference mismatch per row over the tokens in `mask`: sum |log pi_train -
    log pi_infer| and the k3 estimate of KL(pi_infer || pi_train) from the inference
    samples. (N, T) each -> ((N,), (N,)); divide by the token count for means."""
    mask = mask.float()
    abs_d = ((prox_logp - behav_logp).abs() * mask).sum(dim=1)
    k3 = (kl_estimate(behav_logp, prox_logp, "k3") * mask).sum(dim=1)
    return abs_d, k3


# ---------------------------------------------------------------- objectives
@dataclass
class PPOTerms:
    """Per-token outputs of the objective, (N, T) each; statistics use `mask`."""

    loss: Tensor  # per-token loss, not yet aggregated
    ratio: Tensor  # pi_theta / pi_prox (detached; GSPO: the sequence ratio on each token)
    clipped: Tensor  # bool: the clipped branch was taken (gradient zero; CISPO: weight cut)
    dual_clipped: Tensor  # bool: the dual-clip bound was taken
    behav_weight: Tensor  # pi_prox / pi_behav after the cap (ones when not decoupled)
    behav_masked: Tensor  # bool: token dropped because its weight left [floor, cap]


def _clip_surrogate(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r, 1 - low, 1 + high)) and where the clipped branch won."""
    import torch

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(pg_unclipped, pg_clipped), pg_clipped > pg_unclipped


def ppo_surrogate(
    logp: Tensor, prox_logp: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Token-level PPO: r_t = pi_theta / pi_prox per token. -> (loss, ratio, clipped)."""
    ratio = (logp - prox_logp).exp()
    pg, clipped = _clip_surrogate(ratio, adv, clip_low, clip_high)
    return pg, ratio, clipped


def gspo_surrogate(
    logp: Tensor, prox_logp: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO (Zheng et al.): one length-normalised ratio per sequence,
    s = exp(mean_t log(pi_theta / pi_prox)), clipped like PPO. On each token it appears as
    sg(s) * pi_theta / sg(pi_theta), so that token's gradient is s * grad log pi_theta /
    |y| once aggregated by sequence, and the value is s on every token. Its clip range is
    orders of magnitude narrower than PPO's (the paper: 3e-4 / 4e-4)."""
    lens = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (N, 1)
    seq_log_ratio = ((logp - prox_logp) * mask).sum(dim=1, keepdim=True) / lens  # (N, 1)
    seq_ratio = seq_log_ratio.exp()
    ratio = seq_ratio.detach() * (logp - logp.detach()).exp()  # (N, T), value s
    pg, clipped = _clip_surrogate(ratio, adv, clip_low, clip_high)
    return pg, ratio, clipped


def cispo_surrogate(
    logp: Tensor, prox_logp: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1): -sg(clip(r, 1 - low, 1 + high)) * A * log pi_theta. The IS
    weight is clipped, never the gradient: every token keeps a gradient, scaled by the
    clipped weight (PPO's clip zeroes the gradient of clipped tokens)."""
    ratio = (logp - prox_logp).exp()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    return -adv * clipped_ratio * logp, ratio, clipped_ratio != ratio.detach()


SURROGATES: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor]]] = {
    "ppo": ppo_surrogate,
    "gspo": gspo_surrogate,
    "cispo": cispo_surrogate,
}


def behaviour_weight(
    prox_logp: Tensor,
    behav_logp: Tensor,
    cap: float | None,
    mode: str = "truncate",
    floor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Detached w = pi_prox / pi_behav per token and the tokens masked out.

    "truncate": min(w, cap) (truncated IS); "mask": tokens with w > cap get weight 0.
    `floor` masks tokens with w < floor in either mode, so with "mask" and both bounds
    only tokens inside [floor, cap] train (IcePop-style two-sided masking).
    """
    w = (prox_logp - behav_logp).detach().exp()
    masked = w < floor if floor is not None else w < 0
    if cap is not None:
        if mode == "truncate":
            w = w.clamp(max=cap)
        elif mode == "mask":
            masked = masked | (w > cap)
        else:
            raise ValueError(f"algo.behav_cap_mode {mode!r}: expected truncate or mask")
    return w.masked_fill(masked, 0.0), masked


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
    objective: str = "ppo",
    mask: Tensor | None = None,
    behav_floor: float | None = None,
) -> PPOTerms:
    """The decoupled objective (AReaL), per token.

    `objective` picks the surrogate on r = pi_theta / pi_prox ("ppo": token ratio,
    surrogate = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); "gspo": sequence ratio;
    "cispo": clipped IS weight on log pi). With `dual_clip` = c, for A < 0 the loss is
    bounded by -c A. The surrogate is multiplied by the detached behaviour weight
    w = pi_prox / pi_behav (see `behaviour_weight`). With `decoupled` False, pi_prox is
    pi_behav: standard PPO/GRPO, no weight.

    logp: (N, T) with grad; prox_logp, behav_logp: (N, T); advantages: (N, T) or (N, 1);
    mask: (N, T) real completion tokens (GSPO's sequence mean; default all).
    """
    import torch

    if objective not in SURROGATES:
        raise ValueError(f"algo.objective {objective!r}: expected one of {sorted(SURROGATES)}")
    if not decoupled:
        prox_logp = behav_logp
    prox_logp = prox_logp.detach()
    mask = torch.ones_like(logp) if mask is None else mask.float()
    adv = advantages.detach().expand_as(logp)
    pg, ratio, clipped = SURROGATES[objective](logp, prox_logp, adv, mask, clip_low, clip_high)
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
        weight, masked = behaviour_weight(
            prox_logp, behav_logp, behav_cap, behav_cap_mode, behav_floor
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
    entropy: Tensor | None = None,
) -> tuple[Tensor, PPOTerms]:
    """The configured objective for one micro-batch: the surrogate (+ kl_coef x KL in the
    loss when not `kl_in_reward`, - entropy_coeff x entropy), aggregated with the step's
    global counts. `entropy` (N, T) must carry its gradient when entropy_coeff > 0."""
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
        objective=cfg.objective,
        mask=mask,
        behav_floor=cfg.behav_floor,
    )
    per_token = terms.loss
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        if ref_logp is None:
            raise ValueError("algo.kl_coef > 0 needs reference log-probs (ref_logp)")
        kl = kl_estimate(logp, ref_logp, cfg.kl_estimator, cfg.kl_clamp)
        per_token = per_token + cfg.kl_coef * kl
    if cfg.entropy_coeff > 0:
        if entropy is None:
            raise ValueError("algo.entropy_coeff > 0 needs the per-token entropy")
        per_token = per_token - cfg.entropy_coeff * entropy
    return aggregate(per_token, mask, cfg.aggregation, counts), terms


def entropy_from_logp(logp_all: Tensor) -> Tensor:
    """(..., V) log-softmax -> (...) entropy in nats, differentiable."""
    return -(logp_all.exp() * logp_all).sum(dim=-1)
