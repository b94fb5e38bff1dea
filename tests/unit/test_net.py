"""The one poll-until-ready loop and the one retry helper."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from areal_hex.net import (
    WaitAborted,
    async_retry,
    async_wait_until,
    free_port,
    http_ok,
    wait_event,
    wait_until,
)


def test_wait_until_ready_timeout_abort_and_expected_errors() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 2, 5.0, interval_s=0.001)
    assert not wait_until(lambda: False, 0.02, interval_s=0.005)
    with pytest.raises(WaitAborted):
        wait_until(lambda: False, 5.0, alive=lambda: False)

    tries = itertools.count()

    def flaky() -> bool:
        if next(tries) < 2:
            raise ConnectionError("not listening yet")
        return True

    assert wait_until(flaky, 5.0, interval_s=0.001, retry_on=(ConnectionError,))
    with pytest.raises(TypeError):  # an unexpected error is a bug: it surfaces
        wait_until(lambda: 1 + "x", 5.0, retry_on=(ConnectionError,))  # type: ignore[operator]


async def test_async_wait_until_and_retry() -> None:
    n = itertools.count()

    async def ready() -> bool:
        return next(n) >= 3

    assert await async_wait_until(ready, 5.0, interval_s=0.001)

    attempts = []

    async def call() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("down")
        return "ok"

    out = await async_retry(
        call, retry_if=lambda e: isinstance(e, ConnectionError), within_s=5.0, first_delay_s=0.001
    )
    assert out == "ok" and len(attempts) == 3

    async def broken() -> str:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        await async_retry(broken, retry_if=lambda e: isinstance(e, ConnectionError), within_s=5.0)


async def test_wait_event_is_set_times_out_and_never_loses_a_cancel() -> None:
    ev = asyncio.Event()
    assert not await wait_event(ev, 0.01)
    asyncio.get_running_loop().call_later(0.01, ev.set)
    assert await wait_event(ev, 5.0)
    assert await wait_event(ev, 0.0)  # already set: no wait needed to say so

    # The producer's gate loop: a cancel that arrives in the same loop turn as the event
    # it waits on must end the loop (asyncio.wait_for on Python 3.11 loses it).
    async def poll(holder: list[asyncio.Event]) -> None:
        while True:
            await wait_event(holder[0], 0.1)

    for _ in range(20):
        holder = [asyncio.Event()]
        task = asyncio.create_task(poll(holder))
        await asyncio.sleep(0.005)
        holder[0].set()
        holder[0] = asyncio.Event()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert done and task.cancelled()


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the handler's name)
        self.send_response(200 if self.path == "/v1/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_http_ok_answers_and_costs_little_cpu() -> None:
    """200 on the path under the URL's prefix; another status, a port nobody listens
    on: not ok. A poll of a port not yet listening costs well under a millisecond of
    CPU (a fresh httpx client cost ~20 ms), so the launcher's wait takes next to nothing
    from the processes starting beside it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert http_ok(f"{url}/v1")
        assert http_ok(f"{url}/v1/")
        assert not http_ok(url)  # /health: 503
    finally:
        server.shutdown()
        server.server_close()
    closed = f"http://127.0.0.1:{free_port()}"
    start = time.process_time()
    assert not any(http_ok(closed, timeout_s=1.0) for _ in range(50))
    assert (time.process_time() - start) / 50 < 0.005
