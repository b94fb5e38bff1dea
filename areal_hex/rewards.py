"""Rewards: the model's final answer checked against the gold one with math-verify.

`math_reward` (areal_hex/math_check.py, with the final answer's rules) is a pure
function; `RewardPool` runs it in worker processes with a per-answer timeout so that a
slow or crashing check never blocks or kills the asyncio controller: such an answer
scores 0 and is counted in `failures`. A group's answers go to a worker in one call (one
round trip, the gold answer parsed once).

The reward of a completion depends on its final answer and the gold one only, so the
pool keys its work by (final answer, gold): answers a group repeats are checked once, an
answer with no final answer scores 0 without a worker call, and the last `CACHE` checked
pairs are remembered across groups (a confident policy repeats its answers to the same
prompt every epoch). A reward function other than `math_reward` is keyed by the whole
completion. Failures are never remembered.

A worker starts by checking a few odd answers (`math_check.warm_up`): the parser's
first use costs several times its later ones, and the pool starts while the controller
waits for its inference servers.

Answers that need no worker: a final answer and a gold one that are both plain integers
are compared in the controller (`plain_integer_reward`, math-verify's result on them,
microseconds); anything else goes to a worker, as its check takes milliseconds and may
hang (docs/rollout.md has the measurements). A worker remembers math-verify's parse of
each answer text it has seen (`ParseMemo`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Protocol

from areal_hex.data import Prompt
from areal_hex.math_check import (
    RewardFn,
    extract_final_answer,
    math_reward,
    ping,
    plain_integer_reward,
    score_each,
    worker_init,
)

log = logging.getLogger(__name__)

CACHE = 65536  # (final answer, gold) pairs remembered across groups


@dataclass
class RewardStats:
    calls: int = 0
    failures: int = 0  # timeouts + exceptions + worker crashes: each scored 0
    timeouts: int = 0
    restarts: int = 0  # worker pools replaced after a timeout or crash
    # answers scored without a worker call: remembered, no final answer, plain integers
    cached: int = 0


class GroupScorer(Protocol):
    """What the rollout controller needs to score a group: `RewardPool` (the rule), or a
    weighted sum with a reward model (rollout_service/controller/reward_model.py)."""

    stats: RewardStats

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def score_group(self, prompt: Prompt, completions: Sequence[str]) -> list[float]: ...


class RewardPool:
    """Scores answers in `workers` processes; at most `workers` run at once, and each has
    `timeout_s` of compute (time waiting for a free worker does not count).

    A timed-out answer leaves its worker busy, so the pool is replaced (its processes
    killed); answers that were running in the old pool are resubmitted once.
    """

    def __init__(
        self,
        workers: int,
        timeout_s: float,
        fn: RewardFn = math_reward,
        warm: bool | None = None,
    ) -> None:
        """`warm`: each worker checks a few odd answers as it starts (`math_check.warm_up`),
        so that the run's own checks do not pay for the parser's first use; None: when
        `fn` is `math_reward`."""
        if workers <= 0 or timeout_s <= 0:
            raise ValueError(f"RewardPool: workers ({workers}) and timeout_s ({timeout_s}) > 0")
        self.workers, self.timeout_s, self.fn = workers, timeout_s, fn
        self.warm = fn is math_reward if warm is None else warm
        self.stats = RewardStats()
        self._pool: ProcessPoolExecutor | None = None
        self._gen = 0
        self._slots: asyncio.Semaphore | None = None
        self._ready: asyncio.Event | None = None
        self._known: OrderedDict[tuple[str, str], float] = OrderedDict()

    def _key(self, completion: str) -> str | None:
        """What the reward depends on besides the gold answer; None: scores 0."""
        return extract_final_answer(completion) if self.fn is math_reward else completion

    async def start(self) -> None:
        """Spawn the workers and wait until each has imported math-verify (and, with
        `warm`, made its first checks)."""
        self._slots = asyncio.Semaphore(self.workers)
        self._ready = asyncio.Event()
        await self._new_pool()

    async def _new_pool(self) -> None:
        # spawn, not fork: the controller has threads (HTTP, tokenizer) a fork would copy.
        ctx = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(
            self.workers,
            mp_context=ctx,
            initializer=worker_init,
            initargs=(os.getpid(), self.warm),
        )
        pings = [asyncio.wrap_future(pool.submit(ping)) for _ in range(self.workers)]
        await asyncio.gather(*pings)
        self._pool = pool
        assert self._ready is not None
        self._ready.set()

    async def _restart(self, gen: int) -> None:
        """Replace the pool of generation `gen` (no-op if it was already replaced)."""
        assert self._ready is not None
        if gen != self._gen:
            return
        self._gen += 1
        self._ready.clear()
        self.stats.restarts += 1
        old, self._pool = self._pool, None
        if old is not None:
            _kill(old)
        await self._new_pool()

    async def score(self, completion: str, gold: str) -> float:
        """The reward of one answer; 0.0 (counted) on timeout, exception or crash."""
        got = await self._score_one(completion, gold)
        return 0.0 if got is None else got

    async def _score_one(self, completion: str, gold: str) -> float | None:
        """The reward of one answer; None (counted in `failures`) when it failed."""
        if self._slots is None or self._ready is None:
            raise RuntimeError("RewardPool.start() was not awaited")
        self.stats.calls += 1
        async with self._slots:
            for attempt in range(2):
                await self._ready.wait()
                gen, pool = self._gen, self._pool
                assert pool is not None
                try:
                    cf = pool.submit(self.fn, completion, gold)
                    return float(await asyncio.wait_for(asyncio.wrap_future(cf), self.timeout_s))
                except asyncio.TimeoutError:
                    self.stats.timeouts += 1
                    log.warning("reward timed out after %.1f s; scored 0", self.timeout_s)
                    await self._restart(gen)
                    break
                except (BrokenProcessPool, RuntimeError) as exc:
                    # RuntimeError: submit() to a pool another answer just shut down.
                    if gen != self._gen and attempt == 0:
                        continue  # our pool was replaced under us: resubmit once
                    log.warning("reward worker crashed (%s); scored 0", exc)
                    await self._restart(gen)
                    break
                except asyncio.CancelledError:
                    # A pool replaced by another answer's timeout cancels queued calls;
                    # that is not a cancellation of this task: resubmit once.
                    task = asyncio.current_task()
                    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
                    ours = cancelling is None or cancelling() > 0
                    if ours or gen == self._gen or attempt > 0:
                        raise
                    continue
                except Exception as exc:  # the reward function raised: score 0, count it
                    log.warning("reward raised %s: %s; scored 0", type(exc).__name__, exc)
                    break
        self.stats.failures += 1
        return None

    async def score_many(self, completions: Sequence[str], gold: str) -> list[float]:
        """Rewards of a group's completions. Completions are keyed by what their reward
        depends on (`_key`); each key not remembered is checked once, the distinct ones
        in one worker call (`score_each`) with `timeout_s` per answer. If that call times
        out or its worker dies, the pool is replaced and each answer is scored alone, so
        only the slow or crashing one scores 0 (and is not remembered)."""
        keys = [self._key(c) for c in completions]
        todo: dict[str, str] = {}  # key -> a completion that has it
        scores: dict[str | None, float] = {None: 0.0}
        for k, c in zip(keys, completions, strict=True):
            if k in scores or k in todo or (k, gold) in self._known:
                continue
            exact = plain_integer_reward(k, gold) if self.fn is math_reward else None
            if exact is None:
                todo[k] = c
            else:
                scores[k] = exact
        self.stats.cached += len(completions) - len(todo)
        if len(todo) == 1:
            got: list[float | None] = [await self._score_one(next(iter(todo.values())), gold)]
        elif todo:
            batch = await self._score_batch(list(todo.values()), gold)
            if batch is None:
                batch = list(
                    await asyncio.gather(*[self._score_one(c, gold) for c in todo.values()])
                )
            got = batch
        else:
            got = []
        for k, r in zip(todo, got, strict=True):
            scores[k] = 0.0 if r is None else r
            if r is not None:
                self._remember((k, gold), r)
        for k in keys:
            if k not in scores:
                scores[k] = self._known[(k, gold)]
                self._known.move_to_end((k, gold))
        return [scores[k] for k in keys]

    async def score_group(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        """`score_many` against the prompt's gold answer (`GroupScorer`)."""
        return await self.score_many(completions, prompt.answer)

    def _remember(self, key: tuple[str, str], score: float) -> None:
        self._known[key] = score
        if len(self._known) > CACHE:
            self._known.popitem(last=False)

    async def _score_batch(self, answers: list[str], gold: str) -> list[float | None] | None:
        """`answers` in one worker call, each None where the reward function raised;
        None when the call timed out or its worker died (the pool is then replaced)."""
        if self._slots is None or self._ready is None:
            raise RuntimeError("RewardPool.start() was not awaited")
        async with self._slots:
            await self._ready.wait()
            gen, pool = self._gen, self._pool
            assert pool is not None
            try:
                cf = pool.submit(score_each, self.fn, answers, gold)
                limit = self.timeout_s * len(answers)
                raw = await asyncio.wait_for(asyncio.wrap_future(cf), limit)
            except (asyncio.TimeoutError, BrokenProcessPool, RuntimeError):
                await self._restart(gen)
                return None
        self.stats.calls += len(answers)
        out: list[float | None] = []
        for r in raw:
            if isinstance(r, str):  # the reward function raised
                log.warning("reward raised %s; scored 0", r)
                self.stats.failures += 1
                out.append(None)
            else:
                out.append(float(r))
        return out

    async def aclose(self) -> None:
        if self._pool is not None:
            _kill(self._pool)
            self._pool = None


def _kill(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now, even with a worker stuck in a call (shutdown alone would wait)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        if p.is_alive():
            p.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.join(timeout=5)
