"""The reference task's π_ref log-probs equal the trainer's own reference pass.

A built-in server holds v0 (as the reference task does); the rollout controller's scorer
asks it, by SGLang's prompt-scoring request, for the log-probs of sampled completions at
their sampling temperature; the trainer's reference model (v0 loaded as the trainer
loads it) computes the same tokens' log-probs. They agree to float32 precision, and the
KL-regularised loss built from either is the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from areal_hex.algorithms import policy_loss
from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.config.algo import AlgoConfig
from areal_hex.models import load_model, materialize
from areal_hex.net import free_port
from areal_hex.record import Completion, GroupRecord
from rollout_service.client import InferenceClient
from rollout_service.controller.reference import build_reference_scorer
from rollout_service.server.main import ServerThread, build_server_app
from trainer_service.engine import token_logprobs
from trainer_service.reference import reference_logprobs
from trainer_service.step import StepContext, plan_micro_batches

pytestmark = pytest.mark.timeout(120)
TEMPERATURE = 1.3


async def _groups(url: str) -> list[GroupRecord]:
    """Two groups of completions sampled from v0 at TEMPERATURE (one empty completion)."""
    out = []
    async with InferenceClient(url) as c:
        for g, prompt in enumerate([[5, 6, 7, 8], [9, 10, 11]]):
            sp = SamplingParams(max_new_tokens=6 + g, temperature=TEMPERATURE, ignore_eos=True)
            res = await c.generate_batch([prompt] * 3, sp, [f"s{g}-{i}" for i in range(3)])
            comps = [
                Completion(r.output_ids, r.logprobs, [0] * len(r.output_ids), "length", float(i))
                for i, r in enumerate(res)
            ]
            out.append(GroupRecord(f"p{g}", prompt, comps, temperature=TEMPERATURE))
    out[1].completions.append(Completion([], [], [], "stop", 0.0))
    return out


def _ctx(algo: AlgoConfig, ref_model: object | None, policy: object) -> StepContext:
    return StepContext(
        engine=policy,
        algo=algo,
        micro_batch_tokens=64,
        fixed_len=8,
        pad_id=0,
        rank=0,
        world=1,
        ref_model=ref_model,
        lockstep=False,
    )


async def test_worker_ref_logprobs_equal_the_trainers_reference_pass(tmp_path: Path) -> None:
    v0 = tmp_path / "v0"
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=0), v0)
    app = build_server_app(ModelConfig(path=str(v0)), InferenceConfig())
    with ServerThread(app) as url:
        groups = await _groups(url)
        # a dead instance beside the live one: scoring goes around it
        dead = f"http://127.0.0.1:{free_port()}"
        scorer = build_reference_scorer([dead, url], None, 30.0, retry_s=30.0)
        try:
            for i, g in enumerate(groups):
                await scorer.score(g, f"ref-{i}")
        finally:
            await scorer.aclose()
    assert all(g.has_ref_logprobs for g in groups)
    assert scorer.stats.per_instance == {url: 6}  # the empty completion needs no call
    assert scorer.stats.outages == 1

    algo = AlgoConfig(kl_coef=0.1)
    ref_model = load_model(v0, "cpu", "float32").requires_grad_(False)
    policy = load_model(v0, "cpu", "float32")
    torch.nn.init.normal_(policy.lm_head.weight, std=0.05)  # π differs from π_ref
    with_records = _ctx(algo, None, policy)
    (mb,), _items, counts = plan_micro_batches(with_records, groups)
    assert mb.ref_logp is not None
    worker = reference_logprobs(with_records, mb)
    for g in groups:
        for c in g.completions:
            c.ref_logprobs = None
    in_trainer = _ctx(algo, ref_model, policy)
    (mb2,), _, _ = plan_micro_batches(in_trainer, groups)
    assert mb2.ref_logp is None
    own = reference_logprobs(in_trainer, mb2)
    mask = mb.loss_mask > 0
    assert int(mask.sum()) == 3 * 6 + 3 * 7
    diff = (worker - own).abs()[mask].max().item()
    assert diff < 1e-4, diff
    assert bool((worker[mask] != 0).all())

    with torch.no_grad():
        logp = token_logprobs(policy, mb)[0]
        adv = torch.randn(mb.input_ids.shape[0], 1, generator=torch.Generator().manual_seed(0))
        losses = [
            policy_loss(algo, logp, logp, mb.behav_logp, adv, mb.loss_mask, counts, ref_logp=r)[0]
            for r in (worker, own)
        ]
        no_kl = policy_loss(AlgoConfig(), logp, logp, mb.behav_logp, adv, mb.loss_mask, counts)[0]
    assert abs(float(losses[0] - losses[1])) < 1e-6
    assert abs(float(losses[0] - no_kl)) > 1e-4  # the KL term is really in the loss
    np.testing.assert_allclose(float(losses[0]), float(losses[1]), rtol=1e-5)
