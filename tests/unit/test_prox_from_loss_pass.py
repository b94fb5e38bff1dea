"""With one optimizer update per step, the loss pass's own log-probs serve as the
proximal ones: the step gives the same loss, gradients and train/inference mismatch as
with the separate no-grad recompute, and makes one forward pass fewer per micro-batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from areal_hex.config import AlgoConfig, ModelConfig, TinyModelConfig
from trainer_service import step as step_mod
from trainer_service.prox import prox_from_loss_pass


class CountingEngine:
    """The engine calls `optimize` makes, on a plain module; `step` leaves the weights
    as they are so that the gradients of the step can be compared."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.forwards = 0

    def __call__(self, **kw: Any) -> Any:
        self.forwards += 1
        return self.model(**kw)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def get_global_grad_norm(self) -> None:
        return None


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list]:
    from areal_hex.models import load_model, materialize
    from trainer_service.synthetic import synthetic_groups

    d = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path_factory.mktemp("m"))
    model = load_model(d).train()
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    groups = synthetic_groups(3, 4, model.config.vocab_size, seed=4, temperature=0.8)
    return model, ref, groups


def _step(setup: tuple, algo: AlgoConfig, fused: bool, monkeypatch: Any) -> tuple:
    model, ref, groups = setup
    monkeypatch.setattr(step_mod, "prox_from_loss_pass", lambda a, c: fused and c is False)
    model.zero_grad(set_to_none=True)
    engine = CountingEngine(model)
    ctx = step_mod.StepContext(engine, algo, 40, 16, 0, rank=0, world=1, ref_model=ref)
    out = step_mod.optimize(ctx, groups)
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, g, engine.forwards


@pytest.mark.parametrize(
    "extra",
    [{}, {"kl_coef": 0.1, "objective": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}],
    ids=["ppo", "gspo_kl_in_loss"],
)
def test_same_loss_and_gradients_without_the_recompute(
    setup: tuple, extra: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    algo = AlgoConfig(behav_cap=2.0, **extra)
    assert prox_from_loss_pass(algo, has_critic=False)
    sep, g_sep, n_sep = _step(setup, algo, fused=False, monkeypatch=monkeypatch)
    own, g_own, n_own = _step(setup, algo, fused=True, monkeypatch=monkeypatch)
    micro = n_own  # one forward per micro-batch in the loss pass
    assert micro >= 3 and n_sep == 2 * micro  # the recompute is gone
    assert own.sums["loss"] != 0.0
    for k in ("loss", "behav_w", "clipped", "kl", "entropy"):
        assert own.sums[k] == pytest.approx(sep.sums[k], abs=1e-6), k
    assert own.maxima["behav_w_max"] == pytest.approx(sep.maxima["behav_w_max"], abs=1e-6)
    assert set(g_own) == set(g_sep)
    for k, g in g_sep.items():
        torch.testing.assert_close(g_own[k], g, atol=1e-6, rtol=0)
    for kind, by in sep.extra["mismatch"].items():
        for name, v in by.items():
            got = own.extra["mismatch"][kind][name]
            assert got["tokens"] == v["tokens"]
            assert got["abs_dlogp"] == pytest.approx(v["abs_dlogp"], abs=1e-6)


def test_recompute_kept_where_the_loss_pass_comes_too_late() -> None:
    assert not prox_from_loss_pass(AlgoConfig(ppo_minibatches=2), has_critic=False)
    assert not prox_from_loss_pass(AlgoConfig(kl_coef=0.1, kl_in_reward=True), False)
    assert not prox_from_loss_pass(AlgoConfig(advantage="gae"), has_critic=True)
    assert prox_from_loss_pass(AlgoConfig(kl_coef=0.1), has_critic=False)
