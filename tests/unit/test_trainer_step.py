"""The step's loss and gradients do not depend on how the batch is cut into micro-batches
(global denominators), for every aggregation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from areal_hex.config import AlgoConfig, ModelConfig, TinyModelConfig
from trainer_service.step import StepContext, _accumulate, _prepare


class PlainEngine:
    """The three engine calls the step makes, on a plain module (DeepSpeed's own path is
    covered by tests/integration/test_trainer_dist.py)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, **kw: Any) -> Any:
        return self.model(**kw)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


@pytest.fixture(scope="module")
def model_and_groups(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list]:
    from areal_hex.models import load_model, materialize
    from trainer_service.synthetic import synthetic_groups

    d = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path_factory.mktemp("m"))
    model = load_model(d).train()
    groups = synthetic_groups(3, 4, model.config.vocab_size, seed=2, temperature=0.8)
    return model, groups


def grads(model: Any, groups: list, algo: AlgoConfig, budget: int) -> tuple[float, dict, int]:
    model.zero_grad(set_to_none=True)
    ctx = StepContext(PlainEngine(model), algo, budget, 16, 0, rank=0, world=1)
    prepared = _prepare(ctx, groups)
    sums = {k: 0.0 for k in ("loss", "tokens", "clipped", "dual_clipped", "behav_w",
                             "behav_masked", "entropy", "kl")}  # fmt: skip
    _accumulate(ctx, prepared, sums)
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sums["loss"], g, len(prepared.mbs)


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_len"]
)
def test_micro_batches_equal_whole_batch(model_and_groups: tuple, aggregation: str) -> None:
    model, groups = model_and_groups
    algo = AlgoConfig(aggregation=aggregation, behav_cap=2.0)
    loss_whole, g_whole, n_whole = grads(model, groups, algo, budget=4096)
    loss_micro, g_micro, n_micro = grads(model, groups, algo, budget=40)
    assert n_whole == 1 and n_micro >= 4
    assert loss_micro == pytest.approx(loss_whole, abs=1e-6)
    assert loss_whole != 0.0
    for k, g in g_whole.items():
        torch.testing.assert_close(g_micro[k], g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        {"objective": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
        {"objective": "cispo"},
        {"entropy_coeff": 0.01},
        # synthetic behaviour log-probs give w in [0.01, 0.23]: the band masks part
        {"behav_cap_mode": "mask", "behav_floor": 0.05, "batch_normalize": True},
    ],
    ids=["gspo", "cispo", "entropy", "icepop_batchnorm"],
)
def test_objectives_split_like_the_whole_batch(model_and_groups: tuple, extra: dict) -> None:
    model, groups = model_and_groups
    algo = AlgoConfig(aggregation="seq_mean_token_mean", behav_cap=2.0, **extra)
    loss_whole, g_whole, _ = grads(model, groups, algo, budget=4096)
    loss_micro, g_micro, n_micro = grads(model, groups, algo, budget=40)
    assert n_micro >= 4
    assert loss_micro == pytest.approx(loss_whole, abs=1e-6)
    assert any(g.abs().sum() > 0 for g in g_whole.values())
    for k, g in g_whole.items():
        torch.testing.assert_close(g_micro[k], g, atol=1e-6, rtol=1e-5)
