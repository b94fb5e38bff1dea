"""The controller's reference scorer: SGLang's prompt-scoring request, the responses read
back per completion, balance over instances, and retries while a worker is down. The
clients here stand in for servers that cannot run in a unit test (SGLang, a restarting
worker); the built-in server is checked in tests/integration/test_reference_worker.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from areal_hex.record import Completion, GroupRecord
from rollout_service.client import GenerationError
from rollout_service.controller.reference import (
    ReferenceScorer,
    ReferenceScoringError,
    parse_scores,
    scoring_request,
)


def _group(temperature: float = 1.0) -> GroupRecord:
    comps = [
        Completion([3, 4], [-1.0, -1.0], [0, 0], "stop", 1.0),
        Completion([], [], [], "stop", 0.0),
        Completion([5, 6, 7], [-1.0] * 3, [0] * 3, "length", 0.0),
    ]
    return GroupRecord("p", [1, 2], comps, temperature=temperature)


def _answer(body: dict[str, Any]) -> list[dict[str, Any]]:
    """SGLang's answer to prompt scoring: from logprob_start_len on, one entry per
    position, the first with logprob null; here log p(token) = -token / 10."""
    start = body["logprob_start_len"]
    out = []
    for ids in body["input_ids"]:
        entries = [[None, ids[start], None]] + [[-t / 10, t, None] for t in ids[start + 1 :]]
        out.append({"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": entries}})
    return out


@dataclass
class Worker:
    """A reference instance: `down` calls fail as a killed server's do (no status);
    `sglang` answers /get_server_info as SGLang does (no output_token_versions)."""

    base_url: str
    down: int = 0
    status: int | None = None
    sglang: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def generate_raw(self, payload: dict[str, Any]) -> Any:
        await asyncio.sleep(0.01)
        if self.down:
            self.down -= 1
            raise GenerationError(self.base_url, "connection refused", self.status)
        self.bodies.append(payload)
        return _answer(payload)

    async def server_info(self) -> dict[str, Any]:
        return {} if self.sglang else {"output_token_versions": True}

    async def close(self) -> None:
        pass


def test_request_is_sglang_prompt_scoring_of_the_completions() -> None:
    body = scoring_request(_group(0.7), [0, 2], "r")
    assert body == {
        "input_ids": [[1, 2, 3, 4], [1, 2, 5, 6, 7]],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
        "return_logprob": True,
        "logprob_start_len": 1,
        "rid": ["r-0", "r-2"],
    }
    scores = parse_scores(_answer(body), _group(), [0, 2])
    np.testing.assert_allclose(scores[0], [-0.3, -0.4], rtol=1e-6)
    np.testing.assert_allclose(scores[1], [-0.5, -0.6, -0.7], rtol=1e-6)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            lambda a: a[0]["meta_info"]["input_token_logprobs"].pop(),
            "2 input_token_logprobs, expected 3",
        ),
        (lambda a: a[1]["meta_info"]["input_token_logprobs"][1].__setitem__(1, 9), "differ"),
        (lambda a: a[0]["meta_info"]["input_token_logprobs"][2].__setitem__(0, None), "not"),
        (lambda a: a.pop(), "expected a list of 2"),
    ],
)
def test_a_response_that_does_not_fit_is_refused(edit: Any, words: str) -> None:
    answer = _answer(scoring_request(_group(), [0, 2], "r"))
    edit(answer)
    with pytest.raises(ReferenceScoringError, match=words):
        parse_scores(answer, _group(), [0, 2])


async def test_scores_every_completion_over_the_least_busy_instances() -> None:
    a, b = Worker("http://a"), Worker("http://b")
    scorer = ReferenceScorer([a, b])
    groups = [_group() for _ in range(6)]
    await asyncio.gather(*(scorer.score(g, f"g{i}") for i, g in enumerate(groups)))
    for g in groups:
        np.testing.assert_allclose(g.completions[0].ref_logprobs, [-0.3, -0.4], rtol=1e-6)
        assert g.completions[1].ref_logprobs.shape == (0,)
    assert len(a.bodies) == len(b.bodies) == 3  # concurrent groups spread evenly
    assert scorer.stats.groups_scored == 6 and scorer.stats.sequences_scored == 12


async def test_a_restarting_worker_is_waited_for_and_nothing_is_lost() -> None:
    w = Worker("http://ref", down=3)
    scorer = ReferenceScorer([w], retry_s=10.0, first_delay_s=0.01, max_delay_s=0.02)
    g = _group()
    await scorer.score(g, "g0")
    assert g.has_ref_logprobs and len(w.bodies) == 1
    assert w.bodies[0]["rid"] == ["g0.4-0", "g0.4-2"]  # a rid of its own per attempt
    assert scorer.stats.retries == 3 and scorer.stats.outages == 1


async def test_retries_are_bounded_then_the_error_names_the_worker() -> None:
    w = Worker("http://ref", down=10**6, status=503)
    scorer = ReferenceScorer([w], retry_s=0.2, first_delay_s=0.02, max_delay_s=0.05)
    with pytest.raises(ReferenceScoringError, match=r"http://ref: .*given up after 0 s"):
        await scorer.score(_group(), "g0")
    assert 2 <= scorer.stats.retries < 20


async def test_a_refused_request_is_not_retried() -> None:
    w = Worker("http://ref", down=1, status=400)
    scorer = ReferenceScorer([w], retry_s=10.0)
    with pytest.raises(ReferenceScoringError, match="refused the scoring request"):
        await scorer.score(_group(), "g0")
    assert scorer.stats.retries == 0


async def test_sglang_worker_refused_for_groups_sampled_at_another_temperature() -> None:
    scorer = ReferenceScorer([Worker("http://sg", sglang=True)])
    await scorer.score(_group(1.0), "g0")  # T = 1: SGLang's input log-probs are these
    await scorer.score(_group(0.0), "g1")  # greedy: scored at T = 1 by both servers
    with pytest.raises(ReferenceScoringError, match="rollout.temperature=1.2"):
        await scorer.score(_group(1.2), "g2")


def _controller(worker: Worker, retry_s: float, rewards: Any) -> tuple[Any, Any, Any]:
    from fakes import TOK, FakeServer, MemoryProducer

    from areal_hex.config import DataConfig, RolloutConfig
    from areal_hex.data import build_prompts, generate_arithmetic
    from rollout_service.controller.reference import ScoredProducer
    from rollout_service.controller.rollout import RolloutController

    producer = MemoryProducer(groups_per_step=100)
    scorer = ReferenceScorer([worker], retry_s=retry_s, first_delay_s=0.01, max_delay_s=0.02)
    prompts = build_prompts(generate_arithmetic(8, "train"), TOK, DataConfig()).prompts
    cfg = RolloutConfig(group_size=3, max_new_tokens=16, metrics_interval_s=0.2, stop_grace_s=1)
    ctl = RolloutController(
        [FakeServer("a")],
        ScoredProducer(producer, scorer),
        prompts,
        lambda ids: TOK.decode(ids, skip_special_tokens=True),
        cfg,
        max_groups=4,
        rewards=rewards,
    )
    return ctl, producer, scorer


@pytest.mark.timeout(60)
async def test_controller_puts_groups_only_scored_through_a_worker_restart() -> None:
    from areal_hex.rewards import RewardPool

    rewards = RewardPool(workers=1, timeout_s=10.0)
    await rewards.start()
    try:
        worker = Worker("http://ref", down=5)
        ctl, producer, scorer = _controller(worker, 30.0, rewards)
        final = await ctl.run()
        assert len(producer.groups) == 4 and final["groups_failed_total"] == 0
        for g in producer.groups:
            for c in g.completions:
                np.testing.assert_allclose(c.ref_logprobs, -c.token_ids / 10, rtol=1e-6)
        assert scorer.stats.retries == 5 and scorer.stats.groups_scored == 4
        assert all("-ref." in rid for b in worker.bodies for rid in b["rid"])

        # down past the bound: the run stops, and nothing reaches the buffer unscored
        ctl, producer, _ = _controller(Worker("http://ref", down=10**6), 0.2, rewards)
        with pytest.raises(ReferenceScoringError, match="given up"):
            await ctl.run()
        assert producer.groups == [] and producer.submitted == 0  # admissions given back
    finally:
        await rewards.aclose()
