"""GAE, whitening and the value loss: against values worked out by hand, and against
verl's and AReaL's outputs on the same random inputs, recorded in
tests/data/ppo_reference.json by scripts/record_ppo_reference.py (neither is imported
here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from areal_hex.algorithms import GlobalCounts, aggregate
from areal_hex.gae import (
    Moments,
    explained_variance,
    gae,
    terminal_rewards,
    value_loss,
    whiten,
)

T = torch.tensor
REF = json.loads((Path(__file__).parents[1] / "data" / "ppo_reference.json").read_text())


def _ref_inputs() -> dict[str, torch.Tensor]:
    return {k: T(v) for k, v in REF["inputs"].items()}


def test_gae_by_hand() -> None:
    # one row: prompt position 0, completion at 1..3, padding at 4; reward 1 at the end.
    # gamma 0.5, lam 0.5; V = [9, 0.2, 0.4, 0.8, 7]
    # t=3: delta = 1 + 0 - 0.8 = 0.2,             A = 0.2
    # t=2: delta = 0 + 0.5*0.8 - 0.4 = 0,          A = 0 + 0.25*0.2 = 0.05
    # t=1: delta = 0 + 0.5*0.4 - 0.2 = 0,          A = 0.25*0.05 = 0.0125
    mask = T([[0.0, 1.0, 1.0, 1.0, 0.0]])
    values = T([[9.0, 0.2, 0.4, 0.8, 7.0]])
    rewards = terminal_rewards(T([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert adv[0, 1:4].tolist() == pytest.approx([0.0125, 0.05, 0.2])
    assert ret[0, 1:4].tolist() == pytest.approx([0.2125, 0.45, 1.0])


def test_gae_lam_one_gamma_one_is_reward_minus_value() -> None:
    # gamma = lam = 1: A_t = R - V(s_t), the Monte-Carlo return minus the baseline
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    values = T([[0.1, 0.2, 0.3], [0.5, -0.5, 4.0]])
    rewards = terminal_rewards(T([2.0, -1.0]), mask)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([1.9, 1.8, 1.7])
    assert adv[1, :2].tolist() == pytest.approx([-1.5, -0.5])
    assert ret[0].tolist() == pytest.approx([2.0, 2.0, 2.0])


def test_terminal_rewards_skips_empty_rows() -> None:
    out = terminal_rewards(T([3.0, 5.0]), T([[0.0, 0.0], [1.0, 0.0]]))
    assert out.tolist() == [[0.0, 0.0], [5.0, 0.0]]


def test_gae_equals_verl_and_areal() -> None:
    x = _ref_inputs()
    g, lam = REF["params"]["gamma"], REF["params"]["lam"]
    rewards = terminal_rewards(x["scores"], x["mask"])
    assert torch.equal(rewards, x["rewards"])
    adv, ret = gae(rewards, x["values"], x["mask"], g, lam)
    m = x["mask"].bool()
    # AReaL: raw advantages and returns; verl: returns, and advantages whitened
    assert torch.allclose(adv[m], T(REF["areal"]["advantages"])[m], atol=1e-5)
    assert torch.allclose(ret[m], T(REF["areal"]["returns"])[m], atol=1e-5)
    assert torch.allclose(ret[m], T(REF["verl"]["returns"])[m], atol=1e-5)
    white = whiten(adv, x["mask"])
    assert torch.allclose(white[m], T(REF["verl"]["whitened_advantages"])[m], atol=1e-5)
    assert white[~m].abs().sum() == 0
    # a different gamma would not pass: the check can fail
    other, _ = gae(rewards, x["values"], x["mask"], g * 0.9, lam)
    assert not torch.allclose(other[m], T(REF["areal"]["advantages"])[m], atol=1e-3)


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_len"]
)
def test_clipped_value_loss_equals_verl(mode: str) -> None:
    x = _ref_inputs()
    ret = T(REF["verl"]["returns"])
    terms = value_loss(x["new_values"], x["values"], ret, clip=REF["params"]["value_clip"])
    mask = x["mask"]
    counts = GlobalCounts(
        tokens=int(mask.sum()),
        sequences=int((mask.sum(dim=1) > 0).sum()),
        fixed_len=REF["params"]["fixed_len"],
    )
    got = aggregate(terms.loss, mask, mode, counts)
    assert float(got) == pytest.approx(REF["verl"]["value_loss"][mode], abs=1e-5)
    frac = float((terms.clipped * mask).sum() / mask.sum())
    assert frac == pytest.approx(REF["verl"]["value_clip_frac"], abs=1e-6)


def test_clipped_value_loss_equals_areal() -> None:
    x = _ref_inputs()
    ret = T(REF["areal"]["returns"])
    terms = value_loss(x["new_values"], x["values"], ret, clip=REF["params"]["value_clip"])
    counts = GlobalCounts(tokens=int(x["mask"].sum()), sequences=len(x["mask"]))
    got = aggregate(terms.loss, x["mask"], "token_mean", counts)
    assert float(got) == pytest.approx(REF["areal"]["value_loss_token_mean"], abs=1e-5)
    clipped = terms.clipped & x["mask"].bool()
    assert clipped.tolist() == REF["areal"]["value_clipped"]


def test_value_loss_by_hand_and_gradient() -> None:
    # V_old 0, R 1, clip 0.2: V = 0.5 -> unclipped error 0.25, clipped (0.2 - 1)^2 = 0.64
    # (kept: the larger), gradient 0 (the clipped branch does not depend on V beyond c);
    # V = 0.1 -> inside the clip: both 0.81, gradient (V - R) = -0.9
    v = T([[0.5, 0.1]], requires_grad=True)
    terms = value_loss(v, T([[0.0, 0.0]]), T([[1.0, 1.0]]), clip=0.2)
    assert terms.loss.tolist()[0] == pytest.approx([0.32, 0.405])
    assert terms.clipped.tolist() == [[True, False]]
    terms.loss.sum().backward()
    assert v.grad is not None and v.grad.tolist()[0] == pytest.approx([0.0, -0.9])
    plain = value_loss(T([[0.5]]), T([[0.0]]), T([[1.0]]), clip=None)
    assert plain.loss.item() == pytest.approx(0.125) and not plain.clipped.any()
    with pytest.raises(ValueError, match="algo.value_clip"):
        value_loss(T([[0.5]]), T([[0.0]]), T([[1.0]]), clip=0.0)


def test_whiten_from_summed_moments_equals_whole() -> None:
    # statistics added over two shares give the whole batch's whitening
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    parts = Moments.of(x[:2], mask[:2]) + Moments.of(x[2:], mask[2:])
    whole = whiten(x, mask)
    assert torch.allclose(whiten(x[:2], mask[:2], parts), whole[:2], atol=1e-6)
    sel = x[mask.bool()]
    mean, var = parts.mean_var()
    assert mean == pytest.approx(float(sel.mean()), abs=1e-6)
    assert var == pytest.approx(float(sel.var(correction=1)), abs=1e-6)


def test_explained_variance() -> None:
    ret = T([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(Moments.of(ret - ret, mask), Moments.of(ret, mask)) == 1.0
    const = torch.full_like(ret, 2.5)
    assert explained_variance(Moments.of(ret - const, mask), Moments.of(ret, mask)) == 0.0
    assert math.isnan(explained_variance(Moments.of(ret, mask), Moments.of(const, mask)))
