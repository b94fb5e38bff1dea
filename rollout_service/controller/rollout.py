"""The rollout controller: prompts in, scored groups out, weights kept current.

Per prompt: `await producer.admit()` (the staleness gate), then `group_size` samples
spread over the servers (see `sampler.py`, `dispatch.py`), rewards in a process pool,
one `GroupRecord` to `producer.put()`. At most `max_concurrent_groups` prompts run.

Weight updates follow the buffer's version notifications through `WeightSync` (weight_sync.py,
the whole protocol top to bottom): pause, load, resume, then the gate learns the new version.

Stopping (SIGTERM/SIGINT via `request_stop`, or `max_groups` reached): no new prompt is
admitted; groups in flight get `stop_grace_s` to finish and be put; the rest are
cancelled, counted in `groups_abandoned_total` (and `groups_in_flight` of the last
metrics line), and their admissions are given back to the gate (`producer.release`), as
are those of groups that failed, so `<run>:submitted` counts exactly the groups put.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from areal_hex.api import (
    GenerationClient,
    GiveBackReason,
    ProducerPosition,
    SamplingParams,
    TrajectoryProducer,
)
from areal_hex.buffer.errors import BUFFER_ERRORS, is_connection_error
from areal_hex.config.rollout import RolloutConfig
from areal_hex.data import Prompt, iterate_prompts
from areal_hex.net import async_retry
from areal_hex.record import Completion, GroupRecord
from areal_hex.rewards import GroupScorer, RewardPool
from areal_hex.run_files import RolloutRow, append_row
from rollout_service.controller.colocate import Phases
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.sampler import Sample, SampleFailed, Sampler
from rollout_service.controller.weight_sync import NetworkSource, UpdateGate, WeightSync

log = logging.getLogger(__name__)
CANCEL_AGAIN_S = 1.0  # a stop cancels what the controller waits on, again after this
T = TypeVar("T")


class RolloutController:
    def __init__(
        self,
        clients: Sequence[GenerationClient],
        producer: TrajectoryProducer,
        prompts: Sequence[Prompt],
        decode: Callable[[list[int]], str],
        cfg: RolloutConfig,
        *,
        max_groups: int | None = None,
        metrics_path: str | Path | None = None,
        stop_token_ids: Sequence[int] = (),
        weights_dir: str | None = None,
        seed: int = 0,
        rewards: GroupScorer | None = None,
        gpu_kinds: Sequence[str] = (),
        settle_s: float = 0.0,
        buffer_retry_s: float = 60.0,
        network: NetworkSource | None = None,
        final_version: int | None = None,
        phases: Phases | None = None,
    ) -> None:
        """`settle_s`: at start, how long to wait for admissions still held by another
        producer (a killed predecessor whose lease has not expired yet) to come back;
        `buffer_retry_s` (`buffer.retry_s`): how long a buffer call is retried while the
        buffer is unreachable. `final_version`: the trainer's last; with it, a controller
        at `max_groups` waits until that version is published, making the groups the
        trainer drops meanwhile (owed), so a run always gets its steps' worth. `phases`:
        the placement's turns on shared devices (colocate.py, lend.py)."""
        self.cfg = cfg
        self.buffer_retry_s = buffer_retry_s
        self.final_version = final_version
        self.settle_s = settle_s
        self.gpu_kinds = list(gpu_kinds)  # GPU kind of server i (per-kind mismatch)
        self.producer = producer
        self.prompts = list(prompts)
        self.decode = decode
        self.max_groups = max_groups
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        # called with every metrics row (e.g. the Prometheus collector)
        self.row_observers: list[Callable[[RolloutRow], None]] = []
        self.gate_wait_observers: list[Callable[[float], None]] = []  # seconds per admit
        self.weights_dir = weights_dir
        self.seed = seed
        self.rewards = rewards
        self._owns_rewards = rewards is None
        self.gate = UpdateGate()
        self.dispatcher = Dispatcher(clients, cfg.probe_interval_s)
        self.weights = WeightSync(self.dispatcher, producer, self.gate, weights_dir, network)
        self.dispatcher.on_recover = self.weights.recover
        self.colocation = phases(self.weights, lambda: self._tasks) if phases else None
        self._admit = self.colocation.gated(producer.admit) if self.colocation else producer.admit
        sampling = SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_token_ids=list(stop_token_ids),
        )
        self.sampler = Sampler(
            self.dispatcher, self.gate, sampling, cfg.request_timeout_s, cfg.max_retries
        )
        self._rid_prefix = uuid.uuid4().hex[:8]
        self._t0 = time.monotonic()
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self._reward_sum = self._reward_n = 0.0  # since the last metrics line
        self._reward_sum_total = self._reward_n_total = 0.0
        self._last: dict[str, float] = {}
        self.start = ProducerPosition(0, 0)  # where production stood when this run began
        self.owed = 0  # groups owed over the whole run, as last read
        # dynamic sampling stopped at dynamic_sampling_max_factor: the run cannot get its
        # steps' worth of kept groups (`areal-hex rollout` then fails, rather than wait)
        self.sampling_exhausted = False

    # ------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        """Stop admitting prompts; in-flight groups get `stop_grace_s` to finish."""
        if not self._stop.is_set():
            log.info("stop requested: finishing in-flight groups")
        self._stop.set()

    async def run(self) -> dict[str, Any]:
        """Produce groups until `max_groups` or a stop; returns the final metrics line."""
        self._t0 = time.monotonic()
        self._last = {"t": self._t0, "samples": 0, "tokens": 0}
        if self.rewards is None:
            self.rewards = RewardPool(self.cfg.reward_workers, self.cfg.reward_timeout_s)
        if self._owns_rewards:
            await self.rewards.start()
        await self.dispatcher.probe_all()
        self.dispatcher.start_probing()
        await self.weights.start(self.cfg.update_pause)
        background = [
            asyncio.create_task(self._metrics_loop()),
            asyncio.create_task(self.weights.follow()),
        ]
        for t in background:
            t.add_done_callback(self._background_done)
        try:
            await self._produce()
        finally:
            # A weight update under way finishes first: cancelled halfway, it would leave
            # the servers paused.
            await self.weights.settle(self.cfg.stop_grace_s)
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.dispatcher.aclose()
            if self._owns_rewards:
                await self.rewards.aclose()
            final = self.write_metrics(final=True)
        if self._fatal is not None:
            raise self._fatal
        return final

    async def _resume_position(self) -> ProducerPosition:
        """The durable position, once admissions held by others came back (or `settle_s`
        passed): a restart continues the prompt order and owes the groups never made."""
        deadline = time.monotonic() + self.settle_s
        while True:
            pos = await self._buffer_call(self.producer.position, "position")
            if pos.held == 0 or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if pos.admitted:
            log.info(
                "resuming at prompt %d (%d group(s) owed: abandoned, reclaimed or dropped)",
                pos.admitted,
                pos.owed,
            )
        self.owed = pos.owed
        return pos

    async def _produce(self) -> None:
        self.start = await self._resume_position()
        seq = self.start.admitted
        # the data position: prompt number `seq` of the seeded epoch order
        prompts = itertools.islice(iterate_prompts(self.prompts, self.seed), seq, None)
        slots = asyncio.Semaphore(self.cfg.max_concurrent_groups)
        try:
            while await self._want_more(seq):
                if not await self._until_stop(slots.acquire()):
                    break
                t_gate = time.monotonic()
                admitted = await self._until_stop(self._buffer_call(self._admit, "admit"))
                for observe in self.gate_wait_observers:
                    observe(time.monotonic() - t_gate)
                if not admitted:
                    slots.release()
                    break
                epoch, prompt = next(prompts)
                task = asyncio.create_task(self._group(seq, epoch, prompt))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(lambda _t: slots.release())
                seq += 1
        except asyncio.CancelledError:
            for t in self._tasks:
                t.cancel()
            raise
        except Exception:  # e.g. the gate timed out: in-flight groups still end cleanly
            self.request_stop()
            await self._drain()
            raise
        await self._drain()

    async def _want_more(self, seq: int) -> bool:
        """Another group? Up to `max_groups` kept groups over the whole run, plus those
        owed (see `_wait_owed`)."""
        if self.max_groups is None:
            return True
        while True:
            if await self._below_target(seq - self.owed):
                return True
            # dynamic sampling gave up: no group owed can be made either
            if self.sampling_exhausted or not await self._wait_owed():
                return False

    async def _wait_owed(self) -> bool:
        """At the target: until the trainer publishes `final_version` (or a stop), watch
        for groups it drops; True once more are owed than counted so far."""
        if self.final_version is None:
            return False
        while not self._stop.is_set():
            pos = await self._buffer_call(self.producer.position, "position")
            if pos.owed > self.owed:
                more = pos.owed - self.owed
                log.info("%d more group(s) owed (failed, or dropped by the trainer)", more)
                self.owed = pos.owed
                return True
            if await self._buffer_call(self.producer.version, "version") >= self.final_version:
                return False
            await self._until_stop(asyncio.sleep(0.25))  # the last steps wait for these
        return False

    async def _below_target(self, seq: int) -> bool:
        """Fewer than `max_groups` kept groups (earlier controllers' included, those owed
        taken off `seq`)? With dynamic sampling, filtered groups do not count, so wait for
        in-flight ones to learn whether they were kept, up to
        `dynamic_sampling_max_factor` x `max_groups` produced."""
        assert self.max_groups is not None
        if not self.cfg.dynamic_sampling:
            return seq < self.max_groups
        if seq >= self.max_groups * self.cfg.dynamic_sampling_max_factor:
            self.sampling_exhausted = True
            log.error(
                "dynamic sampling: %d groups produced, %d filtered (all rewards equal); "
                "stopping at rollout.dynamic_sampling_max_factor=%d",
                seq,
                self.stats["groups_filtered_total"],
                self.cfg.dynamic_sampling_max_factor,
            )
            return False
        filtered0 = self.start.given_back.get("filtered", 0)
        while seq - filtered0 - self.stats["groups_filtered_total"] >= self.max_groups:
            if not self._tasks or not await self._until_stop(
                asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
            ):
                return False
        return True

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        """A background loop that dies of an error stops the run and fails it."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("background task failed: %r", exc, exc_info=exc)
        if self._fatal is None:
            self._fatal = exc
        self.request_stop()

    async def _until_stop(self, aw: Awaitable[T]) -> bool:
        """Await `aw` unless a stop comes first (then cancel it); True if it completed."""
        if self._stop.is_set():
            if asyncio.iscoroutine(aw):
                aw.close()
            return False
        task = asyncio.ensure_future(aw)
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            task.result()  # re-raises e.g. the gate's TimeoutError
            return True
        try:  # a cancel can be lost on its way (Python 3.11 loses one in some races): again
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_AGAIN_S)
        finally:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False

    async def _drain(self) -> None:
        """Let in-flight groups finish; after a stop, for `stop_grace_s` at most."""
        if self._tasks:
            await self._until_stop(asyncio.wait(set(self._tasks)))
        if self._tasks:
            log.info("%d group(s) in flight at stop", len(self._tasks))
            await asyncio.wait(set(self._tasks), timeout=self.cfg.stop_grace_s)
        self.stats["groups_in_flight_at_stop"] = len(self._tasks)
        pending = set(self._tasks)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            await self._release(len(pending), "abandoned")

    async def _release(self, n: int, reason: GiveBackReason) -> None:
        if n <= 0:
            return
        try:
            await self.producer.release(n, reason)
            self.stats["admissions_released_total"] += n
        except BUFFER_ERRORS as exc:  # the buffer is gone
            log.error("could not give back %d admission(s) to the gate: %s", n, exc)

    # ------------------------------------------------------------ groups
    async def _group(self, seq: int, epoch: int, prompt: Prompt) -> None:
        created = time.time()
        try:
            samples = await self._samples(prompt, f"{self._rid_prefix}-g{seq}")
            texts = [self.decode(s.token_ids) for s in samples]
            assert self.rewards is not None
            rewards = await self.rewards.score_group(prompt, texts)
            group = GroupRecord(
                prompt_id=prompt.id,
                prompt_ids=prompt.input_ids,
                completions=[
                    self._completion(s, r, text)
                    for s, r, text in zip(samples, rewards, texts, strict=True)
                ],
                temperature=self.cfg.temperature,
                created_at=created,
                finished_at=time.time(),
                metadata={
                    "seq": str(seq),
                    "epoch": str(epoch),
                    # a put retried through a Valkey restart appends the group once
                    "put_token": f"{self._rid_prefix}-{seq}",
                    "answer": prompt.answer,
                },
            )
            filtered = self.cfg.dynamic_sampling and len(set(rewards)) == 1
            if filtered:  # no gradient: give its gate slot back before it takes a buffer one
                await self._release(1, "filtered")
            else:
                await self._put(group)
        except asyncio.CancelledError:
            self.stats["groups_abandoned_total"] += 1
            raise
        except SampleFailed as exc:
            self.stats["groups_failed_total"] += 1
            log.error("group %d (%s) failed: %s", seq, prompt.id, exc)
            await self._release(1, "failed")
            return
        except Exception as exc:  # a bug or a lost buffer: stop rather than spin
            self.stats["groups_failed_total"] += 1
            log.exception("group %d (%s): unexpected error", seq, prompt.id)
            await self._release(1, "failed")
            if self._fatal is None:
                self._fatal = exc
            self.request_stop()
            return
        self.stats["groups_produced_total"] += 1
        self.stats["groups_filtered_total"] += int(filtered)
        self.stats["samples_total"] += len(samples)
        self.finish_reasons.update(s.finish_reason for s in samples)
        self._reward_sum += float(sum(rewards))
        self._reward_n += len(rewards)
        self._reward_sum_total += float(sum(rewards))
        self._reward_n_total += len(rewards)

    def _completion(self, s: Sample, reward: float, text: str) -> Completion:
        """A scored sample, with the server that produced its last tokens and that
        server's GPU kind ("" where not known): the trainer reports the train-inference
        mismatch by both."""
        kinds = self.gpu_kinds
        server = self.dispatcher.servers[s.server].url if s.server >= 0 else ""
        kind = kinds[s.server] if 0 <= s.server < len(kinds) else ""
        return Completion(
            s.token_ids, s.logprobs, s.versions, s.finish_reason, reward, text, server, kind
        )

    async def _samples(self, prompt: Prompt, rid: str) -> list[Sample]:
        """All `group_size` samples, or SampleFailed (the others are cancelled)."""
        return await self.sampler.sample_group(list(prompt.input_ids), self.cfg.group_size, rid)

    async def _put(self, group: GroupRecord) -> None:
        await self._buffer_call(lambda: self.producer.put(group), "put")
        if self.colocation is not None:
            await self.colocation.after_put()

    async def _buffer_call(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """`call()`, retried while the buffer is unreachable (a Redis restart), for up to
        `buffer.retry_s`; then the error propagates."""
        return await async_retry(
            call, retry_if=is_connection_error, within_s=self.buffer_retry_s, what=f"buffer {what}"
        )

    # ------------------------------------------------------------ weights
    async def update_weights(self, version: int, path: str) -> None:
        """Pause every healthy server, load `path` as `version`, resume (WeightSync)."""
        await self.weights.update(version, path)

    # ------------------------------------------------------------ metrics
    def snapshot(self) -> RolloutRow:
        """Current metrics; rates and reward_mean over the time since the last line."""
        now = time.monotonic()
        c, rs = self.sampler.counters, self.rewards.stats if self.rewards else None
        dt = max(now - self._last.get("t", now), 1e-9)
        samples, tokens = self.stats["samples_total"], c.tokens_total
        return RolloutRow(
            time=time.time(),
            elapsed_s=round(now - self._t0, 3),
            version=self.gate.version,
            groups_produced_total=self.stats["groups_produced_total"],
            groups_filtered_total=self.stats["groups_filtered_total"],
            groups_in_flight=len(self._tasks),
            groups_failed_total=self.stats["groups_failed_total"],
            groups_abandoned_total=self.stats["groups_abandoned_total"],
            samples_total=samples,
            samples_per_s=(samples - self._last.get("samples", 0)) / dt,
            tokens_total=tokens,
            tokens_per_s=(tokens - self._last.get("tokens", 0)) / dt,
            reward_mean=self._reward_sum / self._reward_n if self._reward_n else None,
            reward_mean_total=(
                self._reward_sum_total / self._reward_n_total if self._reward_n_total else None
            ),
            reward_failures_total=rs.failures if rs else 0,
            reward_timeouts_total=rs.timeouts if rs else 0,
            reward_cached_total=rs.cached if rs else 0,
            requests_total=c.requests_total,
            requests_retried_total=c.requests_retried_total,
            requests_aborted_total=c.requests_aborted_total,
            weight_syncs_total=self.weights.syncs_total,
            weight_sync_s_total=round(self.weights.sync_s_total, 3),
            gen_busy_s=round(self.dispatcher.busy_s, 3),
            servers_healthy=self.dispatcher.num_healthy,
            finish_reasons=dict(self.finish_reasons),
            **(self.colocation.row_fields() if self.colocation else {}),
        )

    def _start_interval(self) -> None:
        """Rates and reward_mean of the next metrics line count from now."""
        self._last = {
            "t": time.monotonic(),
            "samples": self.stats["samples_total"],
            "tokens": self.sampler.counters.tokens_total,
        }
        self._reward_sum = self._reward_n = 0.0

    def write_metrics(self, final: bool = False) -> dict[str, Any]:
        row = self.snapshot()
        self._start_interval()
        if final:
            row.final = True
            row.groups_in_flight = self.stats["groups_in_flight_at_stop"]
            row.admissions_released_total = self.stats["admissions_released_total"]
        if self.metrics_path is not None:
            append_row(self.metrics_path, row)
        for observe in self.row_observers:
            observe(row)
        return row.model_dump()

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.metrics_interval_s)
            s = self.write_metrics()
            reward = "-" if s["reward_mean"] is None else f"{s['reward_mean']:.3f}"
            log.info(
                "groups %d (+%d in flight, %d failed) | %.1f samples/s | reward %s | v%d | "
                "%d/%d servers | retried %d aborted %d",
                s["groups_produced_total"],
                s["groups_in_flight"],
                s["groups_failed_total"],
                s["samples_per_s"],
                reward,
                s["version"],
                s["servers_healthy"],
                len(self.dispatcher.servers),
                s["requests_retried_total"],
                s["requests_aborted_total"],
            )
