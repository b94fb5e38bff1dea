"""The step's loss and gradients do not depend on how the batch is cut into micro-batches
(global denominators), for every aggregation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fakes import PlainEngine

from areal_hex.config import AlgoConfig, ModelConfig, TinyModelConfig
from trainer_service.step import StepContext, _accumulate, _prepare


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


def test_train_inference_mismatch_by_server_and_kind(model_and_groups: tuple) -> None:
    import numpy as np

    from trainer_service.step import train_inference_mismatch
    from trainer_service.synthetic import _model_logprobs, synthetic_groups

    model, _ = model_and_groups
    groups = synthetic_groups(3, 2, model.config.vocab_size, seed=5, temperature=0.8)
    origin = [[("http://a", "H20")] * 2, [("http://a", "H20"), ("http://b", "H800")]]
    origin.append([("http://b", "H800")] * 2)
    for g, pairs in zip(groups, origin, strict=True):
        for c, (server, kind) in zip(g.completions, pairs, strict=True):
            c.server, c.gpu_kind = server, kind
    groups[2].completions[1].versions[:] = 1  # another version's tokens: not counted
    ctx = StepContext(PlainEngine(model), AlgoConfig(), 4096, 16, 0, rank=0, world=1)
    out = train_inference_mismatch(ctx, [_prepare(ctx, groups)])

    # closed form: the HF model's own log-probs at the sampling temperature
    expected: dict[str, list[float]] = {}
    for g in groups:
        for c in g.completions:
            server, kind = c.server, c.gpu_kind
            own = c.versions == 0
            prox = _model_logprobs(model, g.prompt_ids, c.token_ids, 0.8)
            d = prox[own] - c.logprobs[own]
            k3 = np.exp(d) - 1 - d
            for key in (f"server/{server}", f"gpu_kind/{kind}"):
                acc = expected.setdefault(key, [0.0, 0.0, 0.0])
                acc[0] += float(np.abs(d).sum())
                acc[1] += float(k3.sum())
                acc[2] += int(own.sum())
    got = {f"{k}/{n}": v for k, by in out.items() for n, v in by.items()}
    assert set(got) == set(expected)
    for key, (a, k3, n) in expected.items():
        assert got[key]["tokens"] == n
        assert got[key]["abs_dlogp"] == pytest.approx(a / n, rel=1e-4)
        assert got[key]["k3"] == pytest.approx(k3 / n, rel=1e-4)


def test_drift_by_lag_from_the_tokens_versions(model_and_groups: tuple) -> None:
    import numpy as np

    from trainer_service.step import drift_by_lag
    from trainer_service.synthetic import _model_logprobs, synthetic_groups

    model, _ = model_and_groups
    groups = synthetic_groups(2, 2, model.config.vocab_size, seed=7, temperature=0.8)
    # trained version 3: lags 3 (v0), 1 (v2) and 0 (v3), a reload inside one completion
    groups[0].completions[1].versions[:] = 2
    c = groups[1].completions[0]
    c.versions[: len(c.versions) // 2] = 2
    c.versions[len(c.versions) // 2 :] = 3
    ctx = StepContext(PlainEngine(model), AlgoConfig(), 4096, 16, 0, rank=0, world=1)
    ctx.version = 3
    out = drift_by_lag(ctx, [_prepare(ctx, groups)])

    expected: dict[str, list[float]] = {}
    for g in groups:
        for c in g.completions:
            d = _model_logprobs(model, g.prompt_ids, c.token_ids, 0.8) - c.logprobs
            for lag in np.unique(3 - c.versions):
                sel = (3 - c.versions) == lag
                acc = expected.setdefault(str(int(lag)), [0.0, 0.0, 0.0])
                acc[0] += float(np.abs(d[sel]).sum())
                acc[1] += float((np.exp(d[sel]) - 1 - d[sel]).sum())
                acc[2] += int(sel.sum())
    assert set(out) == set(expected) == {"0", "1", "3"}
    for lag, (a, k3, n) in expected.items():
        assert out[lag]["tokens"] == n
        assert out[lag]["abs_dlogp"] == pytest.approx(a / n, rel=1e-4)
        assert out[lag]["k3"] == pytest.approx(k3 / n, rel=1e-4)
    ctx.algo = AlgoConfig(decoupled=False)  # no proximal log-probs: nothing to report
    assert drift_by_lag(ctx, [_prepare(ctx, groups)]) == {}


def test_informative_denominator_leaves_out_degenerate_groups(model_and_groups: tuple) -> None:
    from trainer_service.synthetic import synthetic_groups

    model, _ = model_and_groups
    groups = synthetic_groups(3, 4, model.config.vocab_size, seed=2, temperature=0.8)
    for c in groups[1].completions:  # group 1: all rewards equal -> advantage 0
        c.reward = 1.0
    groups[0].completions[0].reward, groups[0].completions[1].reward = 1.0, 0.0
    groups[2].completions[0].reward, groups[2].completions[1].reward = 1.0, 0.0
    ctx = StepContext(PlainEngine(model), AlgoConfig(), 4096, 16, 0, rank=0, world=1)
    every = _prepare(ctx, groups).counts
    ctx.algo = AlgoConfig(denominator="informative")
    informative = _prepare(ctx, groups).counts
    dropped = sum(len(c.token_ids) for c in groups[1].completions)
    assert informative.tokens == every.tokens - dropped
    assert informative.sequences == every.sequences - 4
    # the token-mean loss is the same sum over fewer tokens: larger by that ratio
    loss_all, _, _ = grads(model, groups, AlgoConfig(), 4096)
    loss_inf, _, _ = grads(model, groups, AlgoConfig(denominator="informative"), 4096)
    assert loss_inf == pytest.approx(loss_all * every.tokens / informative.tokens, rel=1e-5)
