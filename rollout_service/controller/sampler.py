"""One sample (one completion of one prompt), driven to the end across aborts and failures.

- abort (a weight update paused the server): keep the partial tokens and their
  log-probs, append them to the input, lower `max_new_tokens` by their count, wait until
  the update is over, resend (to whichever server has the least work then);
- error or `request_timeout_s`: the server is marked unhealthy and the request goes to
  another server with the tokens so far, at most `max_retries` times.

Each token is tagged with its version: the server's per-token report, else the
`weight_version` of the response that carried it; a version the server could not state
as an integer (None, e.g. SGLang's "default") means the version the controller last
applied.

Only a server's own failures (rollout_service.controller.dispatch.SERVER_ERRORS) are retried
elsewhere; anything else is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from areal_hex.api import GenerateResult, SamplingParams
from rollout_service.client import GenerationError
from rollout_service.controller.dispatch import SERVER_ERRORS, Dispatcher, ServerState
from rollout_service.controller.weight_sync import UpdateGate

log = logging.getLogger(__name__)


class SampleFailed(RuntimeError):
    """A sample ran out of retries; its group cannot be completed."""


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    segments: int = 0  # /generate responses that contributed (1 without aborts)
    server: int = -1  # index of the server that produced the last segment


@dataclass
class SamplerCounters:
    requests_total: int = 0
    requests_retried_total: int = 0  # failed attempts resent elsewhere
    requests_aborted_total: int = 0  # abort finishes resumed
    tokens_total: int = 0


def _is_client_error(exc: BaseException) -> bool:
    """A 4xx says the request was refused, not that the server is down."""
    status = exc.status if isinstance(exc, GenerationError) else None
    return status is not None and 400 <= status < 500


class Sampler:
    def __init__(
        self,
        dispatcher: Dispatcher,
        gate: UpdateGate,
        sampling: SamplingParams,
        request_timeout_s: float,
        max_retries: int,
    ) -> None:
        self.dispatcher = dispatcher
        self.gate = gate
        self.sampling = sampling
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.counters = SamplerCounters()
        self._background: set[asyncio.Task[None]] = set()

    def _version(self, version: int | None) -> int:
        return self.gate.version if version is None else version

    def _versions(self, res: GenerateResult) -> list[int]:
        """Each output token's policy version: the server's per-token report if it sends
        one, else the version of the response."""
        if res.token_versions is not None:
            if None not in res.token_versions:  # every token's version stated: as sent
                return list(res.token_versions)  # type: ignore[arg-type]
            return [self._version(v) for v in res.token_versions]
        return [self._version(res.weight_version)] * len(res.output_ids)

    async def sample_group(self, prompt_ids: list[int], n: int, rid: str) -> list[Sample]:
        """`n` samples of one prompt in one `/generate` call (one HTTP round trip
        instead of n), in the batch form with a rid per sample, so that a timeout can
        abort each by the id the server knows it by; samples that come back aborted, or
        all of them if the call fails, go on one by one through `sample`, from the
        tokens they have."""
        rids = [f"{rid}s{i}" for i in range(n)]
        await self.gate.wait_open()
        server = await self.dispatcher.acquire()
        if n < 2:
            return await _all([self.sample(prompt_ids, r) for r in rids])
        outs = [Sample() for _ in range(n)]
        self.counters.requests_total += n
        base = f"{rid}.g{self.counters.requests_total}"
        seg = [f"{base}_{i}" for i in range(n)]
        limit = self.sampling.max_new_tokens
        try:
            with self.dispatcher.lease(server, n * (len(prompt_ids) + limit), n):
                results = await asyncio.wait_for(
                    server.client.generate_batch([prompt_ids] * n, self.sampling, seg),
                    self.request_timeout_s,
                )
        except SERVER_ERRORS as exc:
            if isinstance(exc, asyncio.TimeoutError):
                for r in seg:
                    self._abort_quietly(server, r)
            elif not _is_client_error(exc):
                self.dispatcher.suspect(server, str(exc))
            self.counters.requests_retried_total += n
            log.info("group %s failed on %s (%s); sampling one by one", rid, server.url, exc)
            results = [None] * n
        todo = []
        for out, res, r in zip(outs, results, rids, strict=True):
            if res is not None:
                self._take(out, res, server)
                if res.finish_reason != "abort":
                    out.finish_reason = res.finish_reason
                    continue
                self.counters.requests_aborted_total += 1
                if len(out.token_ids) >= limit:
                    out.finish_reason = "length"
                    continue
            todo.append(self.sample(prompt_ids, r, out))
        await _all(todo)
        return outs

    def _request_id(self, rid: str, out: Sample) -> str:
        """A fresh rid per attempt (a server may still hold the previous one); counted."""
        self.counters.requests_total += 1
        return f"{rid}.{out.segments}.{self.counters.requests_total}"

    def _take(self, out: Sample, res: GenerateResult, server: ServerState) -> None:
        out.server = server.index
        server.tokens_total += len(res.output_ids)
        out.token_ids += res.output_ids
        out.logprobs += res.logprobs
        out.versions += self._versions(res)
        out.segments += 1
        self.counters.tokens_total += len(res.output_ids)

    async def sample(self, prompt_ids: list[int], rid: str, out: Sample | None = None) -> Sample:
        """One sample to its end; `out`: the tokens it already has (they are kept)."""
        out = out if out is not None else Sample()
        failures = 0
        exclude: set[int] = set()
        limit = self.sampling.max_new_tokens
        while True:
            await self.gate.wait_open()
            server = await self.dispatcher.acquire(exclude)
            remaining = limit - len(out.token_ids)
            epoch = self.gate.epoch
            try:
                res = await self._send(server, prompt_ids + out.token_ids, remaining, rid, out)
            except SERVER_ERRORS as exc:
                failures += 1
                reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else str(exc)
                if not _is_client_error(exc):
                    self.dispatcher.suspect(server, reason)
                exclude.add(server.index)
                if failures > self.max_retries:
                    raise SampleFailed(
                        f"request {rid}: {failures} failed attempts "
                        f"(rollout.max_retries={self.max_retries}); last: {reason}"
                    ) from exc
                self.counters.requests_retried_total += 1
                log.info("request %s failed on %s (%s); retrying", rid, server.url, reason)
                continue
            self._take(out, res, server)
            if res.finish_reason != "abort":
                out.finish_reason = res.finish_reason
                return out
            self.counters.requests_aborted_total += 1
            if len(out.token_ids) >= limit:
                out.finish_reason = "length"
                return out
            ours = epoch != self.gate.epoch or not self.gate.is_open
            if not ours and not res.output_ids:
                # Aborted by someone else with no progress: count it, so a server that
                # aborts everything cannot hold a sample forever.
                failures += 1
                exclude.add(server.index)
                if failures > self.max_retries:
                    raise SampleFailed(f"request {rid}: aborted {failures} times without progress")

    async def _send(
        self, server: ServerState, input_ids: list[int], remaining: int, rid: str, out: Sample
    ) -> GenerateResult:
        sampling = replace(self.sampling, max_new_tokens=remaining)
        # A fresh rid per attempt: a server may still hold the previous one.
        seg_rid = self._request_id(rid, out)
        with self.dispatcher.lease(server, len(input_ids) + remaining):
            try:
                return await asyncio.wait_for(
                    server.client.generate(input_ids, sampling, seg_rid), self.request_timeout_s
                )
            except asyncio.TimeoutError:
                self._abort_quietly(server, seg_rid)
                raise

    def _abort_quietly(self, server: ServerState, rid: str) -> None:
        """Best effort: tell a slow server to drop the request we gave up on."""
        task = asyncio.get_running_loop().create_task(server.client.abort(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _all(coros: list[Coroutine[Any, Any, Sample]]) -> list[Sample]:
    """Run the coroutines; on the first SampleFailed (or other error) cancel the rest."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        done, _ = (
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION) if tasks else ((), ())
        )
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
