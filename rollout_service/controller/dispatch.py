"""Spreading requests over inference servers: least outstanding work, health, re-probes.

Outstanding work of a server = the tokens its in-flight requests may still touch
(prompt + tokens so far + tokens still allowed), so a long continuation weighs more than a
short fresh prompt. A server that fails or times out is marked unhealthy and gets no
requests until a background probe finds it healthy again (and, if the policy moved on
meanwhile, has reloaded the current weights: see `on_recover`). A healthy server is
probed too, with a timeout: one that stops answering (hung, not dead) is marked
unhealthy as stalled, so no new request waits on it (the launcher replaces it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from areal_hex.api import GenerationClient
from areal_hex.net import async_wait_until, wait_event
from rollout_service.client import GenerationError

log = logging.getLogger(__name__)

# What a failed call to a server may raise: the client's error (an HTTP status, or the
# server unreachable), a connection error or a timeout. A programming error is not among
# them: it surfaces instead of marking a server unhealthy.
SERVER_ERRORS: tuple[type[BaseException], ...] = (
    GenerationError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
)


@dataclass
class ServerState:
    index: int
    client: GenerationClient
    healthy: bool = False
    outstanding_tokens: int = 0
    in_flight: int = 0  # calls
    requests_in_flight: int = 0  # their requests (a group's call: its samples)
    requests_total: int = 0
    failures_total: int = 0
    tokens_total: int = 0  # tokens generated here
    last_error: str = ""
    lent_away: bool = False  # hybrid: paused while the trainer steps on its devices

    @property
    def url(self) -> str:
        return self.client.base_url


class Dispatcher:
    """Chooses a server per request and tracks the work on each. One event loop."""

    def __init__(
        self,
        clients: Sequence[GenerationClient],
        probe_interval_s: float = 2.0,
        on_recover: Callable[[ServerState], Awaitable[None]] | None = None,
    ) -> None:
        if not clients:
            raise ValueError("Dispatcher: at least one inference server is needed")
        self.servers = [ServerState(i, c) for i, c in enumerate(clients)]
        self.probe_interval_s = probe_interval_s
        self.on_recover = on_recover
        self._changed = asyncio.Event()  # set whenever a server becomes healthy or free
        # the most requests a server is sent at once (None: no bound); the rest wait here
        # for whichever server frees first (hybrid: a lent server that continues takes
        # them at once, instead of waiting behind a server of its own's queue)
        self.max_requests: int | None = None
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._prober: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[bool]] = set()
        # called with (server, seconds) as each request ends (e.g. a latency histogram)
        self.request_observers: list[Callable[[ServerState, float], None]] = []

    # ------------------------------------------------------------ choice
    def pick(self, exclude: set[int] | None = None) -> ServerState | None:
        """The healthy server with the least outstanding work, avoiding `exclude` and
        servers lent away (hybrid) unless only those are healthy; None when no server is
        healthy, or when each one to use has `max_requests` requests already."""
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            return None
        avoid = exclude or set()
        preferred = [s for s in healthy if s.index not in avoid and not s.lent_away]
        preferred = preferred or [s for s in healthy if s.index not in avoid] or healthy
        if self.max_requests is not None:
            preferred = [s for s in preferred if s.requests_in_flight < self.max_requests]
            if not preferred:
                return None
        return min(preferred, key=lambda s: (s.outstanding_tokens, s.in_flight, s.index))

    def wake(self) -> None:
        """A server may take requests now: the waiting ones try again."""
        self._changed.set()

    async def acquire(self, exclude: set[int] | None = None) -> ServerState:
        """`pick`, waiting while no server is healthy (logging now and then) or every
        one to use is full."""
        waited = 0.0
        while True:
            self._changed.clear()
            s = self.pick(exclude)
            if s is not None:
                return s
            if not await wait_event(self._changed, 10.0) and not self.num_healthy:
                waited += 10.0
                log.warning("no healthy inference server for %.0f s; waiting", waited)

    @contextmanager
    def lease(self, server: ServerState, tokens: int, requests: int = 1) -> Iterator[None]:
        """Count `tokens` of work on `server` while a call of `requests` requests (a
        group's batch call: its samples) runs there."""
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        server.outstanding_tokens += tokens
        server.in_flight += 1
        server.requests_in_flight += requests
        server.requests_total += 1
        t0 = time.monotonic()
        try:
            yield
        finally:
            for observe in self.request_observers:
                observe(server, time.monotonic() - t0)
            server.outstanding_tokens -= tokens
            server.in_flight -= 1
            server.requests_in_flight -= requests
            if self.max_requests is not None:
                self._changed.set()
            if self.in_flight == 0 and self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    @property
    def busy_s(self) -> float:
        """Seconds during which at least one request was in flight on some server."""
        now = time.monotonic()
        return self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    @property
    def num_healthy(self) -> int:
        return sum(s.healthy for s in self.servers)

    # ------------------------------------------------------------ health
    def mark_unhealthy(self, server: ServerState, reason: str) -> None:
        server.failures_total += 1
        server.last_error = reason
        if server.healthy:
            log.warning("server %s marked unhealthy: %s", server.url, reason)
        server.healthy = False

    def suspect(self, server: ServerState, reason: str) -> None:
        """A request failed there: take the server out now and probe it at once, so a
        transient error (e.g. a keep-alive connection closed under us) costs one probe,
        while a dead server stays out until a periodic probe finds it back."""
        self.mark_unhealthy(server, reason)
        task = asyncio.get_running_loop().create_task(self.probe(server))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def mark_healthy(self, server: ServerState) -> None:
        if not server.healthy:
            log.info("server %s healthy", server.url)
        server.healthy = True
        self._changed.set()

    async def probe(self, server: ServerState) -> bool:
        """Check one unhealthy server; on success run `on_recover`, then mark it healthy."""
        try:
            ok = await asyncio.wait_for(server.client.health(), timeout=10.0)
        except SERVER_ERRORS:  # the server just stays unhealthy
            ok = False
        if not ok:
            return False
        if self.on_recover is not None:
            try:
                await self.on_recover(server)
            except SERVER_ERRORS as exc:
                server.last_error = f"recovery failed: {exc}"
                log.warning("server %s is up but could not recover: %s", server.url, exc)
                return False
        self.mark_healthy(server)
        return True

    async def probe_all(self) -> int:
        await asyncio.gather(*[self.probe(s) for s in self.servers if not s.healthy])
        return self.num_healthy

    async def check_live(self, timeout_s: float) -> None:
        """Probe the healthy servers; one with no answer in `timeout_s` is stalled."""

        async def one(server: ServerState) -> None:
            try:
                await asyncio.wait_for(server.client.health(), timeout=timeout_s)
            except asyncio.TimeoutError:  # an error is a request's to find (and retry)
                if server.healthy:
                    self.mark_unhealthy(server, f"stalled: no answer to /health in {timeout_s:g} s")
            except SERVER_ERRORS:
                pass

        await asyncio.gather(*[one(s) for s in self.servers if s.healthy])

    async def wait_healthy(self, timeout_s: float, min_servers: int = 1) -> int:
        """Probe until `min_servers` are healthy; raises TimeoutError naming the others."""

        async def enough() -> bool:
            return await self.probe_all() >= min_servers

        # a probe of a port not yet listening costs next to nothing; the first groups
        # start as soon as a server answers
        interval = min(self.probe_interval_s, 0.1)
        if not await async_wait_until(enough, timeout_s, interval_s=interval):
            down = ", ".join(
                f"{s.url} ({s.last_error or 'no answer to /health'})"
                for s in self.servers
                if not s.healthy
            )
            raise TimeoutError(
                f"{self.num_healthy} of {len(self.servers)} inference servers healthy "
                f"after {timeout_s:.0f} s (need {min_servers}); down: {down}"
            )
        return self.num_healthy

    def start_probing(self) -> None:
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe_all()
            # as long as a probe of an unhealthy server may take: a busy server on a
            # loaded machine answers late, a hung one never
            await self.check_live(timeout_s=max(10.0, 2 * self.probe_interval_s))

    async def aclose(self) -> None:
        for t in list(self._probes):
            t.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        if self._prober is not None:
            self._prober.cancel()
            try:
                await self._prober
            except asyncio.CancelledError:
                pass
            self._prober = None
