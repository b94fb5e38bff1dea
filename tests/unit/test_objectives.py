"""GSPO, CISPO, IcePop masking, entropy bonus, KL clamp / k3+, overlong shaping, batch
normalisation and RLOO, each against a closed form computed here (values and gradients)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from areal_hex.algorithms import (
    GlobalCounts,
    aggregate,
    batch_normalize,
    decoupled_ppo_loss,
    entropy_from_logp,
    grpo_advantages,
    kl_estimate,
    overlong_penalty,
    policy_loss,
)
from areal_hex.config import AlgoConfig, ConfigError, load_config
from areal_hex.record import Completion, GroupRecord
from trainer_service.batching import Shaping, flatten_groups, sequence_advantages

T = torch.tensor
LN = math.log


# ---------------------------------------------------------------- GSPO
def _gspo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # seq 0: token ratios 1.1, 0.9 (A = +1); seq 1: ratio 2 (A = +1) then a padded token
    # whose ratio 5 must not enter the sequence mean
    prox = T([[-1.0, -2.0], [-0.5, -3.0]])
    logp = prox + T([[LN(1.1), LN(0.9)], [LN(2.0), LN(5.0)]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    return logp.requires_grad_(True), prox, T([[1.0], [1.0]]), mask


def test_gspo_sequence_ratio_value_and_clip() -> None:
    logp, prox, adv, mask = _gspo_inputs()
    out = decoupled_ppo_loss(
        logp, prox, prox, adv, 0.2, 0.28, decoupled=False, objective="gspo", mask=mask
    )
    s0 = math.sqrt(1.1 * 0.9)  # exp(mean log ratio), inside [0.8, 1.28]
    assert out.ratio[0].tolist() == pytest.approx([s0, s0], rel=1e-6)
    assert out.ratio[1, 0].item() == pytest.approx(2.0, rel=1e-6)  # padding ignored
    values = (out.loss * mask).flatten().tolist()
    assert values == pytest.approx([-s0, -s0, -1.28, 0.0], rel=1e-6)
    assert out.clipped.tolist() == [[False, False], [True, True]]


def test_gspo_gradient_is_the_sequence_objective_gradient() -> None:
    logp, prox, adv, mask = _gspo_inputs()
    out = decoupled_ppo_loss(
        logp, prox, prox, adv, 0.2, 0.28, decoupled=False, objective="gspo", mask=mask
    )
    agg = aggregate(out.loss, mask, "seq_mean_token_mean", GlobalCounts(3, 2))
    agg.backward()
    # closed form: J = -(1/2) * [A0 s0(theta) + A1 clip(s1)]; dJ/dlogp_0t = -A0 s0 / (2 |y0|)
    s0 = math.sqrt(1.1 * 0.9)
    assert agg.item() == pytest.approx(-(s0 + 1.28) / 2, rel=1e-6)
    assert logp.grad.flatten().tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0, 0.0], rel=1e-6)


# ---------------------------------------------------------------- CISPO
def test_cispo_clips_the_weight_and_keeps_every_gradient() -> None:
    prox = T([[-1.0, -2.0, -0.5]])
    logp = (prox + T([[LN(1.5), LN(0.5), LN(1.1)]])).requires_grad_(True)
    adv = T([[1.0, -1.0, 2.0]])
    out = decoupled_ppo_loss(logp, prox, prox, adv, 0.2, 0.28, decoupled=False, objective="cispo")
    w = [1.28, 0.8, 1.1]  # clip(r, 0.8, 1.28), detached
    lp = logp.detach()[0].tolist()
    expected = [-a * wi * li for a, wi, li in zip([1.0, -1.0, 2.0], w, lp, strict=True)]
    assert out.loss[0].tolist() == pytest.approx(expected, rel=1e-6)
    assert out.clipped[0].tolist() == [True, True, False]
    out.loss.sum().backward()
    # gradient -A * clip(r): non-zero on clipped tokens too (PPO would give 0 there)
    assert logp.grad[0].tolist() == pytest.approx([-1.28, 0.8, -2.2], rel=1e-6)


# ---------------------------------------------------------------- IcePop band
def test_two_sided_behaviour_mask() -> None:
    behav = T([[-2.0, -1.0, -3.0, -1.5]])
    w = T([[2.0, 1.0, 8.0, 0.25]])
    prox = behav + w.log()
    logp = prox.clone().requires_grad_(True)  # r = 1
    adv = T([[1.0, 1.0, 1.0, 1.0]])
    out = decoupled_ppo_loss(
        logp, prox, behav, adv, behav_cap=5.0, behav_cap_mode="mask", behav_floor=0.5
    )
    # inside [0.5, 5]: tokens 0 (w 2) and 1 (w 1); 8 is above, 0.25 below
    assert out.behav_masked[0].tolist() == [False, False, True, True]
    assert out.loss[0].tolist() == pytest.approx([-2.0, -1.0, 0.0, 0.0], rel=1e-6)
    out.loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.0, -1.0, 0.0, 0.0], rel=1e-6)


def test_floor_must_be_below_cap_in_config() -> None:
    with pytest.raises(ConfigError, match="behav_floor"):
        load_config(None, ["algo.behav_floor=6", "algo.behav_cap=5"])


# ---------------------------------------------------------------- entropy bonus
def test_entropy_bonus_value_and_gradient() -> None:
    z = T([[[1.0, 0.0, -1.0]]]).requires_grad_(True)  # (N=1, T=1, V=3)
    ent = entropy_from_logp(torch.log_softmax(z, -1))
    zero = T([[0.0]])
    cfg = AlgoConfig(entropy_coeff=0.1, decoupled=False)
    loss, _ = policy_loss(
        cfg, zero, zero, zero, T([[0.0]]), T([[1.0]]), GlobalCounts(1, 1), entropy=ent
    )
    p = torch.softmax(z.detach()[0, 0], -1)
    h = float(-(p * p.log()).sum())
    assert loss.item() == pytest.approx(-0.1 * h, rel=1e-6)
    loss.backward()
    # dH/dz_i = -p_i (log p_i + H)
    expected = (0.1 * p * (p.log() + h)).tolist()
    assert z.grad[0, 0].tolist() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(cfg, zero, zero, zero, T([[0.0]]), T([[1.0]]), GlobalCounts(1, 1))


# ---------------------------------------------------------------- KL variants
def test_kl_clamp_bounds_the_log_ratio() -> None:
    logp, ref = T([0.0]), T([-5.0])  # log ratio 5
    assert kl_estimate(logp, ref, "k1", clamp=1.0).item() == pytest.approx(1.0)
    assert kl_estimate(logp, ref, "k3", clamp=1.0).item() == pytest.approx(math.exp(-1.0))
    assert kl_estimate(ref, logp, "k3", clamp=1.0).item() == pytest.approx(math.e - 2.0)


def test_k3_plus_has_k3_value_and_k2_gradient() -> None:
    ref = T([LN(0.25)])
    logp = T([LN(0.5)]).requires_grad_(True)
    val = kl_estimate(logp, ref, "k3+")
    assert val.item() == pytest.approx(0.5 - 1 + LN(2.0))  # k3's value
    val.backward()
    assert logp.grad.item() == pytest.approx(LN(2.0))  # d k2 / d logp = log ratio
    logp.grad = None
    kl_estimate(logp, ref, "k3").backward()
    assert logp.grad.item() == pytest.approx(0.5)  # k3's own gradient: 1 - q/p


# ---------------------------------------------------------------- advantages and shaping
def test_rloo_never_std_normalised_and_loo_is() -> None:
    r = T([[3.0, 1.0, 2.0]])
    adv, _ = grpo_advantages(r, "rloo", std_normalize=True)
    assert adv[0].tolist() == pytest.approx([1.5, -1.5, 0.0])
    adv, _ = grpo_advantages(r, "loo", std_normalize=True, eps=0.0)
    s = math.sqrt(2.0 / 3.0)
    assert adv[0].tolist() == pytest.approx([1.5 / s, -1.5 / s, 0.0], rel=1e-6)


def test_batch_normalize_over_informative_completions() -> None:
    adv = T([1.0, -1.0, 0.0, 0.0, 2.0, -2.0])
    keep = T([True, True, False, False, True, True])
    s = math.sqrt(10.0 / 4.0)
    out = batch_normalize(adv, keep, eps=0.0)
    assert out.tolist() == pytest.approx([1 / s, -1 / s, 0.0, 0.0, 2 / s, -2 / s], rel=1e-6)
    assert batch_normalize(adv, torch.zeros(6, dtype=torch.bool)).abs().sum().item() == 0.0


def test_overlong_penalty_is_linear_in_the_buffer() -> None:
    pen = overlong_penalty(T([5, 6, 8, 10, 12]), max_len=10, buffer=4, factor=2.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -1.0, -2.0, -2.0])
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(T([1]), max_len=4, buffer=8)


def _comp(n: int, reward: float, finish: str = "stop") -> Completion:
    return Completion(list(range(1, n + 1)), [-0.5] * n, [1] * n, finish, reward)


def test_overlong_mask_and_penalty_in_batching() -> None:
    g = GroupRecord("p", [9], [_comp(2, 1.0), _comp(8, 1.0, "length"), _comp(6, 0.0)])
    items = flatten_groups([g], drop_truncated=True)
    assert [it.completion for it in items] == [0, 2]  # the truncated one carries no loss
    # budget 8, buffer 4: lengths 2, 8, 6 -> penalties 0, -1, -0.5 -> rewards 1, 0, -0.5
    shaping = Shaping(overlong_max=8, overlong_buffer=4)
    adv, flat, every = sequence_advantages([g], items, "grpo", False, 1e-6, None, shaping)
    mean = (1.0 + 0.0 - 0.5) / 3
    assert every.tolist() == pytest.approx([1 - mean, -mean, -0.5 - mean], rel=1e-6)
    assert adv.tolist() == pytest.approx([1 - mean, -0.5 - mean], rel=1e-6)
    assert flat == 0


def test_batch_normalize_in_batching_keeps_degenerate_groups_at_zero() -> None:
    g0 = GroupRecord("a", [9], [_comp(1, 1.0), _comp(1, 0.0)])
    g1 = GroupRecord("b", [9], [_comp(1, 1.0), _comp(1, 1.0)])
    items = flatten_groups([g0, g1])
    shaping = Shaping(batch_normalize=True, eps=0.0)
    adv, flat, _ = sequence_advantages([g0, g1], items, "drgrpo", False, 0.0, None, shaping)
    # informative advantages 0.5, -0.5: mean 0, std 0.5 -> 1, -1; group b stays 0
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    assert flat == 1
    assert np.all(adv[2:] == 0.0)


def test_overlong_buffer_beyond_budget_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="overlong_buffer"):
        load_config(None, ["rollout.max_new_tokens=16", "algo.overlong_buffer=32"])


def test_clamped_k3_value_is_capped_like_areal_and_verl() -> None:
    logp, ref = torch.tensor([-20.0]), torch.tensor([-10.0])  # log(pi/pi_ref) = -10
    assert kl_estimate(logp, ref, "k3", clamp=10.0).item() == pytest.approx(10.0)
    assert kl_estimate(logp, ref, "k3+", clamp=10.0).item() == pytest.approx(10.0)
    # without a clamp the estimator is left as it is (e^10 - 1 - 10)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(10) - 11, rel=1e-5)


def test_dual_clip_with_cispo_is_refused() -> None:
    from pydantic import ValidationError

    from areal_hex.config.algo import AlgoConfig

    with pytest.raises(ValidationError, match="dual_clip has no effect with objective cispo"):
        AlgoConfig(objective="cispo", dual_clip=3.0)
    assert AlgoConfig(objective="gspo", dual_clip=3.0).dual_clip == 3.0
