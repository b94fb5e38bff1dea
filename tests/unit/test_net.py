"""The one poll-until-ready loop and the one retry helper."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from areal_hex.net import (
    WaitAborted,
    async_retry,
    async_wait_until,
    free_port,
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
