"""π_ref log-probs from the workflow's reference task, scored by the rollout controller.

The reference task (`workflow.tasks` entry with `role: reference`) is an inference server
holding the initial policy v0 that never loads another version: the controller reaches it
at `TaskSpec.instance_urls()`, apart from the generation servers, so the weight sync never
calls it and the dispatcher never counts it. With `algo.kl_coef > 0`, every kept group is
scored there on its way to the buffer (`ScoredProducer`, the producer the controller puts
through), and each completion's `ref_logprobs` travels in the group record: the trainer
then needs no reference model.

The request is SGLang's prompt scoring on `/generate`, so a real SGLang server works as
the reference worker: the group's G sequences (prompt + completion) in the batch form,
`sampling_params: {"max_new_tokens": 0, "temperature": T}`, `return_logprob: true` and
`logprob_start_len: P - 1` (P the prompt length). Each response's
`meta_info.input_token_logprobs` holds one `[logprob, token_id, text]` per position from
P - 1: the first has logprob null (SGLang never computes the start position's), the next
T are the completion's tokens, each given everything before it.

Temperature: the trainer's KL compares π and π_ref at the group's sampling temperature.
The built-in server scores prompt tokens at the request's temperature; SGLang scores them
at T = 1 (`log_softmax(logits)`) whatever the request says, so an SGLang reference worker
is refused for a group sampled at T != 1 (greedy, T = 0, is scored at 1 by both) rather
than giving a KL term against the wrong distribution.

Availability: a worker that cannot be reached or answers 5xx (restarting after a crash:
the launcher restarts it) is retried with doubling delays, on another instance when one
is up, for up to `retry_s`; each outage is logged when it starts and when it ends. A
group is never put without its scores because the worker is down: past `retry_s` the
error propagates and stops the run (the group's admission is given back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from areal_hex.api import GiveBackReason, ProducerPosition, TrajectoryProducer, VersionUpdate
from areal_hex.record import GroupRecord
from rollout_service.client import GenerationError

log = logging.getLogger(__name__)
GREEDY_BELOW = 1e-6  # a temperature below this samples greedily: scored at T = 1


class ScoringClient(Protocol):
    """What the scorer calls on one reference instance (`InferenceClient` does)."""

    base_url: str

    async def generate_raw(self, payload: dict[str, Any]) -> Any: ...

    async def server_info(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class ReferenceScoringError(RuntimeError):
    """The reference worker refused a request, answered nonsense, stayed down past
    `retry_s`, or cannot score at the group's temperature."""


def scoring_request(group: GroupRecord, rows: Sequence[int], rid: str) -> dict[str, Any]:
    """The `/generate` body that scores completions `rows` of `group` (SGLang's batch
    form, one rid per sequence)."""
    prompt = group.prompt_ids.tolist()
    return {
        "input_ids": [prompt + group.completions[i].token_ids.tolist() for i in rows],
        "sampling_params": {"max_new_tokens": 0, "temperature": float(group.temperature)},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
        "rid": [f"{rid}-{i}" for i in rows],
    }


def parse_scores(body: Any, group: GroupRecord, rows: Sequence[int]) -> list[np.ndarray]:
    """(T_i,) float32 log-probs of each completion in `rows`, read from the responses'
    `input_token_logprobs` (token ids checked against the completion's)."""
    if not isinstance(body, list) or len(body) != len(rows):
        raise ReferenceScoringError(
            f"expected a list of {len(rows)} responses, got {type(body).__name__}"
        )
    out = []
    for i, resp in zip(rows, body, strict=True):
        tokens = group.completions[i].token_ids
        meta = resp.get("meta_info") if isinstance(resp, dict) else None
        entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(entries, list) or len(entries) != len(tokens) + 1:
            got = len(entries) if isinstance(entries, list) else "no"
            raise ReferenceScoringError(
                f"completion {i}: {got} input_token_logprobs, expected {len(tokens) + 1} "
                "(the prompt's last position, then one per completion token)"
            )
        try:
            ids = [int(e[1]) for e in entries[1:]]
            logprobs = np.asarray([float(e[0]) for e in entries[1:]], dtype=np.float32)
        except (TypeError, ValueError, IndexError) as exc:
            raise ReferenceScoringError(
                f"completion {i}: input_token_logprobs entries are not "
                f"[logprob, token_id, text] ({exc})"
            ) from None
        if ids != tokens.tolist():
            raise ReferenceScoringError(
                f"completion {i}: scored token ids differ from the completion's"
            )
        out.append(logprobs)
    return out


@dataclass
class _Instance:
    client: ScoringClient
    outstanding: int = 0  # sequences sent and not yet answered
    down_until: float = 0.0  # monotonic time before which it is not tried again
    down_since: float | None = None  # start of the outage under way (None: up)
    scores_temperature: bool | None = None  # None: not asked yet
    answered: bool = False  # has answered once (before: still starting, not down)


@dataclass
class ReferenceStats:
    groups_scored: int = 0
    sequences_scored: int = 0
    retries: int = 0
    outages: int = 0
    score_s: float = 0.0  # wall time of the successful scoring calls
    per_instance: dict[str, int] = field(default_factory=dict)  # sequences per instance


class ReferenceScorer:
    """Scores groups on the reference task's instances, balanced by outstanding work."""

    def __init__(
        self,
        clients: Sequence[ScoringClient],
        retry_s: float = 600.0,
        first_delay_s: float = 0.5,
        max_delay_s: float = 5.0,
    ) -> None:
        if not clients:
            raise ValueError("ReferenceScorer: expected at least one reference instance")
        self.instances = [_Instance(c) for c in clients]
        self.retry_s = retry_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.stats = ReferenceStats()

    async def score(self, group: GroupRecord, rid: str) -> None:
        """Set `ref_logprobs` on every completion of `group` (empty ones need no call)."""
        rows = [i for i, c in enumerate(group.completions) if len(c.token_ids)]
        scores = await self._with_retries(group, rows, rid) if rows else []
        for c in group.completions:
            c.ref_logprobs = np.zeros(0, dtype=np.float32)
        for i, s in zip(rows, scores, strict=True):
            group.completions[i].ref_logprobs = s
        self.stats.groups_scored += 1
        self.stats.sequences_scored += len(rows)

    async def _with_retries(
        self, group: GroupRecord, rows: list[int], rid: str
    ) -> list[np.ndarray]:
        deadline = time.monotonic() + self.retry_s
        delay, attempt = self.first_delay_s, 0
        while True:
            inst = self._pick()
            if inst is None:  # every instance is down: wait for the first to be retried
                wake = min(i.down_until for i in self.instances)
                await asyncio.sleep(max(0.0, wake - time.monotonic()))
                continue
            try:  # a rid of its own per attempt: a timed-out one may still run there
                attempt += 1
                return await self._call(inst, group, rows, f"{rid}.{attempt}")
            except GenerationError as exc:
                if not _retryable(exc) or time.monotonic() + delay > deadline:
                    raise ReferenceScoringError(
                        f"reference worker {inst.client.base_url}: {exc.message} "
                        f"(given up after {self.retry_s:.0f} s of retries)"
                        if _retryable(exc)
                        else f"reference worker refused the scoring request: {exc}"
                    ) from exc
                self._went_down(inst, exc, delay)
                self.stats.retries += 1
                delay = min(delay * 2, self.max_delay_s)

    def _pick(self) -> _Instance | None:
        """The instance with the least outstanding sequences among those not down."""
        now = time.monotonic()
        live = [i for i in self.instances if i.down_until <= now]
        return min(live, key=lambda i: i.outstanding) if live else None

    async def _call(
        self, inst: _Instance, group: GroupRecord, rows: list[int], rid: str
    ) -> list[np.ndarray]:
        inst.outstanding += len(rows)
        t0 = time.perf_counter()
        try:
            await self._check_temperature(inst, group.temperature)
            body = await inst.client.generate_raw(scoring_request(group, rows, rid))
        finally:
            inst.outstanding -= len(rows)
        scores = parse_scores(body, group, rows)
        self.stats.score_s += time.perf_counter() - t0
        url = inst.client.base_url
        self.stats.per_instance[url] = self.stats.per_instance.get(url, 0) + len(rows)
        inst.answered = True
        if inst.down_since is not None:
            log.info(
                "reference worker %s is back after %.1f s",
                url,
                time.monotonic() - inst.down_since,
            )
            inst.down_since = None
        return scores

    async def _check_temperature(self, inst: _Instance, temperature: float) -> None:
        """Refuse an SGLang worker for a group sampled at T != 1 (see the module doc)."""
        if inst.scores_temperature is None:
            info = await inst.client.server_info()
            inst.scores_temperature = bool(info.get("output_token_versions"))
        at_one = temperature < GREEDY_BELOW or abs(temperature - 1.0) < 1e-6
        if not inst.scores_temperature and not at_one:
            raise ReferenceScoringError(
                f"reference worker {inst.client.base_url} is an SGLang server, which scores "
                f"prompt tokens at temperature 1; the groups are sampled at "
                f"rollout.temperature={temperature}: expected rollout.temperature 1.0 (or "
                "0), or the built-in server (inference.backend builtin) as the reference task"
            )

    def _went_down(self, inst: _Instance, exc: GenerationError, delay: float) -> None:
        inst.down_until = time.monotonic() + delay
        if inst.down_since is None:
            inst.down_since = time.monotonic()
            self.stats.outages += 1
            what = "unavailable" if inst.answered else "not answering yet (starting?)"
            log.log(
                logging.WARNING if inst.answered else logging.INFO,
                "reference worker %s %s (%s): retrying for up to %.0f s",
                inst.client.base_url,
                what,
                exc.message,
                self.retry_s,
            )

    async def aclose(self) -> None:
        await asyncio.gather(*(i.client.close() for i in self.instances), return_exceptions=True)


class ScoredProducer:
    """The buffer's producer with π_ref scoring in front of `put`: a group reaches the
    buffer only with every completion's `ref_logprobs`. A put the controller retries
    (the buffer restarting) does not score again."""

    def __init__(self, inner: TrajectoryProducer, scorer: ReferenceScorer) -> None:
        self.inner = inner
        self.scorer = scorer

    async def put(self, group: GroupRecord) -> str:
        if not group.has_ref_logprobs:
            await self.scorer.score(
                group, f"{group.metadata.get('put_token', group.prompt_id)}-ref"
            )
        return await self.inner.put(group)

    async def admit(self, n: int = 1, on_hold: Callable[[], None] | None = None) -> None:
        await self.inner.admit(n, on_hold)

    async def version(self) -> int:
        return await self.inner.version()

    def set_serving_version(self, version: int) -> None:
        self.inner.set_serving_version(version)

    async def release(self, n: int = 1, reason: GiveBackReason = "failed") -> int:
        return await self.inner.release(n, reason)

    async def position(self) -> ProducerPosition:
        return await self.inner.position()

    def watch_versions(self) -> AsyncIterator[VersionUpdate]:
        return self.inner.watch_versions()


def _retryable(exc: GenerationError) -> bool:
    """Unreachable (status None) or a server-side failure (5xx, e.g. 503 while loading)."""
    return exc.status is None or exc.status >= 500


def build_reference_scorer(
    urls: Sequence[str], api_key: str | None, request_timeout_s: float, retry_s: float
) -> ReferenceScorer:
    """A scorer over the reference task's instances at `urls`."""
    from rollout_service.client import InferenceClient

    clients = [InferenceClient(u, api_key=api_key, timeout_s=request_timeout_s) for u in urls]
    return ReferenceScorer(clients, retry_s=retry_s)
