"""Algorithm values checked against numbers worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
import torch

from areal_hex.algorithms import (
    GlobalCounts,
    aggregate,
    decoupled_ppo_loss,
    entropy_from_logp,
    grpo_advantages,
    kl_estimate,
    policy_loss,
    token_weights,
)
from areal_hex.config import AlgoConfig, ConfigError, load_config

T = torch.tensor


def test_grpo_mean_baseline_with_std() -> None:
    # rewards 3, 1, 2: mean 2, centred 1, -1, 0; population std sqrt(2/3)
    adv, flat = grpo_advantages(T([[3.0, 1.0, 2.0]]), "grpo", std_normalize=True, eps=0.0)
    s = math.sqrt(2.0 / 3.0)
    assert adv.tolist()[0] == pytest.approx([1 / s, -1 / s, 0.0], abs=1e-6)
    assert flat == 0


def test_grpo_std_epsilon_is_added() -> None:
    # rewards 1, 0: mean 0.5, std 0.5, eps 0.5 -> +-0.5 / 1.0
    adv, _ = grpo_advantages(T([[1.0, 0.0]]), "grpo", std_normalize=True, eps=0.5)
    assert adv.tolist()[0] == pytest.approx([0.5, -0.5])


def test_grpo_without_std_and_drgrpo() -> None:
    adv, _ = grpo_advantages(T([[3.0, 1.0, 2.0]]), "grpo", std_normalize=False)
    assert adv.tolist()[0] == pytest.approx([1.0, -1.0, 0.0])
    # Dr. GRPO never divides by the std, even when asked to.
    adv, _ = grpo_advantages(T([[3.0, 1.0, 2.0]]), "drgrpo", std_normalize=True)
    assert adv.tolist()[0] == pytest.approx([1.0, -1.0, 0.0])


def test_leave_one_out() -> None:
    # baselines: for 3 -> (1+2)/2 = 1.5; for 1 -> (3+2)/2 = 2.5; for 2 -> (3+1)/2 = 2
    adv, _ = grpo_advantages(T([[3.0, 1.0, 2.0]]), "loo", std_normalize=False)
    assert adv.tolist()[0] == pytest.approx([1.5, -1.5, 0.0])


def test_equal_rewards_give_zero_and_are_counted() -> None:
    rewards = T([[0.3, 0.3, 0.3], [1.0, 0.0, 1.0], [2.0, 2.0, 2.0]])
    for kind in ("grpo", "loo", "drgrpo"):
        adv, flat = grpo_advantages(rewards, kind, std_normalize=True, eps=1e-6)
        assert flat == 2
        assert adv[0].tolist() == [0.0, 0.0, 0.0]
        assert adv[2].tolist() == [0.0, 0.0, 0.0]
        assert adv[1].abs().sum().item() > 0


def test_advantage_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="algo.advantage"):
        grpo_advantages(T([[1.0, 0.0]]), "nope")
    with pytest.raises(ValueError, match="shape"):
        grpo_advantages(T([1.0, 0.0]), "grpo")


def _ppo_inputs() -> dict[str, torch.Tensor]:
    # token:        0: r=1.5 A=+1 w=2   1: r=0.5 A=-1 w=1   2: r=1.1 A=+2 w=8   3: r=5 A=-1 w=1
    behav = T([[-2.0, -1.0, -3.0, -1.5]])
    prox = behav + T([[math.log(2.0), 0.0, math.log(8.0), 0.0]])
    logp = prox + T([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(5.0)]])
    return {
        "logp": logp.requires_grad_(True),
        "prox_logp": prox,
        "behav_logp": behav,
        "advantages": T([[1.0, -1.0, 2.0, -1.0]]),
    }


def test_decoupled_ppo_values_truncate() -> None:
    x = _ppo_inputs()
    out = decoupled_ppo_loss(**x, clip_low=0.2, clip_high=0.28, behav_cap=5.0)
    # 0: min(1.5, 1.28) * 1 -> -1.28 * w 2 = -2.56 (clipped)
    # 1: A<0: max(0.5, 0.8) = 0.8 (clipped); w 1
    # 2: r 1.1 inside [0.8, 1.28] -> -2.2 * min(8, 5) = -11
    # 3: A<0: max(5, 1.28) = 5, no dual clip -> 5
    assert out.loss.tolist()[0] == pytest.approx([-2.56, 0.8, -11.0, 5.0], rel=1e-5)
    assert out.clipped.tolist()[0] == [True, True, False, False]
    assert out.behav_weight.tolist()[0] == pytest.approx([2.0, 1.0, 5.0, 1.0], rel=1e-5)
    out.loss.sum().backward()
    # d/dlogp of -A r w = -A r w on unclipped tokens, 0 on clipped ones
    assert x["logp"].grad.tolist()[0] == pytest.approx([0.0, 0.0, -11.0, 5.0], rel=1e-5)


def test_behaviour_weight_is_detached() -> None:
    x = _ppo_inputs()
    prox = x["prox_logp"].clone().requires_grad_(True)
    behav = x["behav_logp"].clone().requires_grad_(True)
    x["prox_logp"], x["behav_logp"] = prox, behav
    decoupled_ppo_loss(**x, behav_cap=5.0).loss.sum().backward()
    assert prox.grad is None and behav.grad is None


def test_decoupled_ppo_mask_mode_and_dual_clip() -> None:
    out = decoupled_ppo_loss(**_ppo_inputs(), behav_cap=5.0, behav_cap_mode="mask", dual_clip=3.0)
    # token 2 has w = 8 > 5: masked to 0; token 3: loss 5 bounded by -A * 3 = 3
    assert out.loss.tolist()[0] == pytest.approx([-2.56, 0.8, 0.0, 3.0], rel=1e-5)
    assert out.behav_masked.tolist()[0] == [False, False, True, False]
    assert out.dual_clipped.tolist()[0] == [False, False, False, True]


def test_not_decoupled_is_standard_ppo() -> None:
    x = _ppo_inputs()
    out = decoupled_ppo_loss(**x, decoupled=False, behav_cap=5.0)
    # r = pi / pi_behav: 3, 0.5, 8.8, 5 ; clipped to [0.8, 1.28]; no behaviour weight
    # 0: A=1: max(-3, -1.28) = -1.28; 1: 0.8; 2: A=2: max(-17.6, -2.56) = -2.56; 3: 5
    assert out.loss.tolist()[0] == pytest.approx([-1.28, 0.8, -2.56, 5.0], rel=1e-5)
    assert out.behav_weight.tolist()[0] == [1.0, 1.0, 1.0, 1.0]


def test_decoupled_weight_applies_without_cap() -> None:
    out = decoupled_ppo_loss(**_ppo_inputs(), behav_cap=None)
    assert out.loss.tolist()[0][2] == pytest.approx(-2.2 * 8.0, rel=1e-5)


def test_kl_estimators() -> None:
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    ln2 = math.log(2.0)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    # k3 = q/p - 1 - log(q/p) = 0.5 - 1 + ln 2
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + ln2)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k9")


LOSS = T([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = T([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
EXPECTED = {
    "token_mean": (1 + 2 + 3 + 4) / 4,
    "seq_mean_token_mean": (2.0 + 4.0) / 2,
    "seq_mean_token_sum": (6.0 + 4.0) / 2,
    "fixed_len": 10.0 / (2 * 4),
}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_aggregation_whole_and_split(mode: str) -> None:
    counts = GlobalCounts(tokens=4, sequences=2, fixed_len=4)
    whole = aggregate(LOSS, MASK, mode, counts).item()
    assert whole == pytest.approx(EXPECTED[mode])
    # Two micro-batches (or two ranks), one sequence each, with the step's global counts;
    # a different padded length in the second piece must not matter.
    split = aggregate(LOSS[:1], MASK[:1], mode, counts) + aggregate(
        LOSS[1:, :2], MASK[1:, :2], mode, counts
    )
    assert split.item() == pytest.approx(whole, abs=1e-7)


def test_token_weights_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="algo.aggregation"):
        token_weights(MASK, "sum", GlobalCounts(4, 2))


def test_policy_loss_adds_kl_in_loss() -> None:
    cfg = AlgoConfig(kl_coef=0.5, kl_estimator="k1", decoupled=False, aggregation="token_mean")
    logp = T([[math.log(0.5)]])
    ref = T([[math.log(0.25)]])
    loss, _ = policy_loss(
        cfg, logp, logp, logp, T([[0.0]]), T([[1.0]]), GlobalCounts(1, 1), ref_logp=ref
    )
    # advantage 0: only the KL term 0.5 * ln 2
    assert loss.item() == pytest.approx(0.5 * math.log(2.0))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(cfg, logp, logp, logp, T([[0.0]]), T([[1.0]]), GlobalCounts(1, 1))


def test_entropy() -> None:
    # uniform over 4 -> ln 4
    uniform = torch.log_softmax(torch.zeros(1, 4), dim=-1)
    assert entropy_from_logp(uniform).item() == pytest.approx(math.log(4.0))


def test_dual_clip_config_validated() -> None:
    with pytest.raises(ConfigError, match="algo.dual_clip"):
        load_config(None, ["algo.dual_clip=0.5"])
