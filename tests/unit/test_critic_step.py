"""The critic's side of a step on a plain module: which reward each token gets (the
shaped outcome on the last token, KL on every token with `kl_in_reward`), and GAE over
the critic's values of the micro-batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from areal_hex.algorithms import kl_estimate
from areal_hex.config import AlgoConfig, ModelConfig, TinyModelConfig
from areal_hex.gae import gae
from trainer_service.batching import Shaping, collate, flatten_groups


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from areal_hex.models import materialize
    from trainer_service.critic import build_value_model
    from trainer_service.synthetic import synthetic_groups

    d = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path_factory.mktemp("m"))
    torch.manual_seed(0)
    groups = synthetic_groups(2, 3, 64, seed=3, completion_len=(3, 9))
    return {"critic": build_value_model(d), "groups": groups}


def test_value_model_is_the_actor_with_one_output(parts: dict[str, Any]) -> None:
    from trainer_service.critic import token_values

    items = flatten_groups(parts["groups"])
    mb = collate(items, 0)
    v = token_values(parts["critic"], mb)
    assert v.shape == mb.loss_mask.shape and v.dtype == torch.float32
    # no dropout before the head: the same input gives the same values in training mode
    assert parts["critic"].training
    torch.testing.assert_close(token_values(parts["critic"], mb), v)


def test_overlong_penalty_reaches_the_scores(parts: dict[str, Any]) -> None:
    from trainer_service.critic import sequence_scores

    groups = parts["groups"]
    items = flatten_groups(groups)
    plain = sequence_scores(groups, items, Shaping())
    assert plain.tolist() == [groups[it.group].rewards[it.completion] for it in items]
    # budget 8, buffer 4: a completion of n tokens loses max(0, n - 4) / 4 (to 1)
    shaped = sequence_scores(groups, items, Shaping(overlong_max=8, overlong_buffer=4))
    lens = np.array([it.num_completion_tokens for it in items])
    expect = plain - np.clip(lens - 4, 0, 4) / 4
    assert shaped == pytest.approx(expect)
    assert (lens > 4).any()


def test_kl_in_reward_is_paid_on_every_token(parts: dict[str, Any]) -> None:
    from trainer_service.critic import estimate, token_values

    groups = parts["groups"]
    items = flatten_groups(groups)
    mb = collate(items, 0)
    scores = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 1.0], dtype=np.float32)[: len(items)]
    g = torch.Generator().manual_seed(1)
    prox = -torch.rand(mb.loss_mask.shape, generator=g)
    ref = -torch.rand(mb.loss_mask.shape, generator=g)
    algo = AlgoConfig(advantage="gae", gamma=0.9, lam=0.8, kl_coef=0.1, kl_in_reward=True)
    got = estimate(parts["critic"], algo, [mb], scores, [prox], [ref])
    with torch.no_grad():
        values = token_values(parts["critic"], mb)
    m = mb.loss_mask
    rewards = -0.1 * kl_estimate(prox, ref, "k3") * m
    for row in range(len(items)):
        last = int(torch.nonzero(m[row])[-1])
        rewards[row, last] += float(scores[row])
    adv, ret = gae(rewards, values, m, 0.9, 0.8)
    torch.testing.assert_close(got.advantages[0], adv * m)
    torch.testing.assert_close(got.returns[0], ret)
    torch.testing.assert_close(got.old_values[0], values)
    # without the KL term the advantages differ
    plain = estimate(parts["critic"], algo.model_copy(update={"kl_in_reward": False}),
                     [mb], scores, [prox], [ref])  # fmt: skip
    assert not torch.allclose(plain.advantages[0], got.advantages[0])
    assert got.moments.count == float(m.sum())
