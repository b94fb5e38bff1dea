"""Rewards from a reward model: the controller's client of the reward-model task, and
the weighted sum of `rollout.reward` (areal_hex/config/reward.py).

Per group, one `/classify` call carries every completion (prompt text + completion
text, SGLang's batch shape: rollout_service/classify_wire.py); the score of each is
the first of its outputs. The call goes to the task's instances in turn. While none
answers (an instance restarting after a crash: connection refused, a timeout, a 5xx),
the call is retried with doubling delays for up to `rollout.reward_model.wait_s`, and
each wait is logged; past it `RewardModelUnavailable` stops the run. A group is never
scored without its model score, so nothing is dropped or mis-scored while an instance
restarts. A 4xx (a request the server refuses) is not retried: it would fail again.

    scorer = build_scorer(cfg)        # None: rollout.reward is "rule" (the default pool)
    await scorer.start(); rewards = await scorer.score_group(prompt, texts)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from areal_hex.config.reward import reward_weights
from areal_hex.data import Prompt
from areal_hex.rewards import GroupScorer, RewardPool, RewardStats
from rollout_service.classify_wire import read_answers

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig

log = logging.getLogger(__name__)
FIRST_DELAY_S, MAX_DELAY_S = 0.2, 5.0


class RewardModelUnavailable(RuntimeError):
    """No reward-model instance answered within `rollout.reward_model.wait_s`."""


class RewardModelRefused(RuntimeError):
    """A reward-model instance refused a request (4xx): retrying would not help."""


class _Down(Exception):
    """An instance did not answer (refused connection, timeout, 5xx, a broken body)."""


@dataclass
class RewardModelStats:
    calls: int = 0  # groups scored
    texts: int = 0
    retries: int = 0  # attempts that found no instance answering
    waited_s: float = 0.0  # time spent waiting for an instance to come back


class RewardModelClient:
    """Scores texts on the reward-model instances at `urls` (POST /classify)."""

    def __init__(
        self, urls: Sequence[str], api_key: str | None, timeout_s: float, wait_s: float
    ) -> None:
        if not urls:
            raise ValueError("RewardModelClient: no instance urls")
        self.urls = [u.rstrip("/") for u in urls]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s, self.wait_s = timeout_s, wait_s
        self.stats = RewardModelStats()
        self._next = 0
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, headers=self.headers)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def score(self, texts: Sequence[str]) -> list[float]:
        """The score of each text, from whichever instance answers first in turn."""
        if not texts:
            return []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        delay = FIRST_DELAY_S
        while True:
            start, self._next = self._next, (self._next + 1) % len(self.urls)
            errors = []
            for k in range(len(self.urls)):
                url = self.urls[(start + k) % len(self.urls)]
                try:
                    scores = await self._call(url, texts)
                except _Down as exc:
                    errors.append(f"{url}: {exc}")
                    continue
                self._count(texts, loop.time() - t0)
                return scores
            self.stats.retries += 1
            waited = loop.time() - t0
            if waited >= self.wait_s:
                raise RewardModelUnavailable(
                    f"no reward-model instance answered for {waited:.0f} s "
                    f"(rollout.reward_model.wait_s={self.wait_s:g}): {'; '.join(errors)}"
                )
            if delay == FIRST_DELAY_S or delay == MAX_DELAY_S:  # its first wait, then each 5 s
                log.warning(
                    "reward model unavailable for %.1f s (%s); the group waits",
                    waited,
                    "; ".join(errors),
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)

    def _count(self, texts: Sequence[str], waited_s: float) -> None:
        self.stats.calls += 1
        self.stats.texts += len(texts)
        if waited_s > 1.0:
            self.stats.waited_s += waited_s
            log.info("reward model back after %.1f s; the group was scored", waited_s)

    async def _call(self, url: str, texts: Sequence[str]) -> list[float]:
        if self._session is None:
            raise RuntimeError("RewardModelClient.start() was not awaited")
        try:
            async with self._session.post(f"{url}/classify", json={"text": list(texts)}) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _Down(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        if status >= 500:
            raise _Down(f"HTTP {status}")
        if status != 200:
            body = raw.decode("utf-8", "replace")[:300]
            raise RewardModelRefused(f"{url}/classify answered HTTP {status}: {body}")
        try:
            return [a.score for a in read_answers(json.loads(raw), len(texts))]
        except ValueError as exc:  # includes pydantic's ValidationError
            raise _Down(f"unreadable answer: {exc}") from None


class WeightedRewards:
    """`GroupScorer` of `rollout.reward`: Σ weight × source over the sources it names,
    the rule (a `RewardPool`) and the reward model scored side by side."""

    def __init__(
        self,
        weights: dict[str, float],
        rule: RewardPool | None,
        model: RewardModelClient | None,
    ) -> None:
        if ("rule" in weights) != (rule is not None) or ("model" in weights) != (model is not None):
            raise ValueError(f"WeightedRewards: weights {weights} and the sources given differ")
        self.weights, self.rule, self.model = weights, rule, model
        self.stats: RewardStats = rule.stats if rule is not None else RewardStats()

    async def start(self) -> None:
        if self.rule is not None:
            await self.rule.start()
        if self.model is not None:
            await self.model.start()

    async def aclose(self) -> None:
        if self.rule is not None:
            await self.rule.aclose()
        if self.model is not None:
            await self.model.aclose()

    async def score_group(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        parts: dict[str, asyncio.Future[list[float]]] = {}
        if self.rule is not None:
            parts["rule"] = asyncio.ensure_future(self.rule.score_group(prompt, completions))
        if self.model is not None:
            texts = [prompt.text + c for c in completions]
            parts["model"] = asyncio.ensure_future(self.model.score(texts))
        try:
            got = dict(zip(parts, await asyncio.gather(*parts.values()), strict=True))
        finally:
            for f in parts.values():
                f.cancel()
        return [sum(self.weights[k] * got[k][i] for k in got) for i in range(len(completions))]


def build_scorer(cfg: ExperimentConfig) -> GroupScorer | None:
    """The scorer `rollout.reward` asks for; None for the rule alone (the controller's
    own pool). The controller does not start or close a scorer it is given."""
    weights = reward_weights(cfg.rollout.reward)
    if "model" not in weights:
        return None
    task = cfg.workflow.task_with_role("reward_model")
    assert task is not None  # the config refuses a model weight without the task
    rm, ro = cfg.rollout.reward_model, cfg.rollout
    model = RewardModelClient(task.instance_urls(), cfg.inference.api_key, rm.timeout_s, rm.wait_s)
    rule = RewardPool(ro.reward_workers, ro.reward_timeout_s) if "rule" in weights else None
    log.info("rewards: %s (reward model at %s)", weights, ", ".join(model.urls))
    return WeightedRewards(dict(weights), rule, model)
