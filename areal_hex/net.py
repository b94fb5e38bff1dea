"""Ports and waiting: the one `free_port` and the one poll-until-ready loop of the project.

Every "start something, then wait until it answers" in the code goes through
`wait_until` / `async_wait_until`: the caller says what "ready" is, which exceptions mean
"not yet" (anything else is a bug and surfaces), and how to tell that the thing waited for
can no longer come (its process exited).
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

log = logging.getLogger(__name__)
T = TypeVar("T")


class WaitAborted(Exception):
    """What was waited for can no longer come: `alive()` said so."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free now (it may be taken again before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(n: int, start: int, host: str = "127.0.0.1") -> int:
    """`start` if ports start..start+n-1 are free, else a block from the OS's free ports
    (not the next numbers after `start`: two runs started together would both pick them)."""
    if start + n < 65536 and all(port_free(start + i, host) for i in range(n)):
        return start
    for _ in range(50):
        base = free_port(host)
        if base + n < 65536 and all(port_free(base + i, host) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports found on {host}")


def wait_until(
    ready: Callable[[], bool],
    timeout_s: float | None,
    *,
    interval_s: float = 0.25,
    alive: Callable[[], bool] | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
) -> bool:
    """Poll `ready()` every `interval_s` until it returns True (-> True) or `timeout_s`
    passes (-> False; None waits for ever). Exceptions in `retry_on` count as "not yet".
    Raises WaitAborted as soon as `alive()` returns False."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if alive is not None and not alive():
            raise WaitAborted()
        try:
            if ready():
                return True
        except retry_on:
            pass
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def http_ok(url: str, path: str = "/health", timeout_s: float = 2.0) -> bool:
    """True if GET `url` + `path` answers 200; False if nothing listens there, the
    connection fails or times out, or it answers otherwise. Plain `http.client`: a poll
    every quarter second costs a fraction of a millisecond, where a fresh httpx client
    (its TLS context built each time) costs ~20 ms of CPU, taken from the processes that
    are starting beside it."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.netloc, timeout=timeout_s)
    try:
        conn.request("GET", parts.path.rstrip("/") + path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


async def async_wait_until(
    ready: Callable[[], Awaitable[bool]],
    timeout_s: float | None,
    *,
    interval_s: float = 0.25,
    alive: Callable[[], bool] | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
) -> bool:
    """`wait_until` for a coroutine `ready()`, sleeping on the event loop."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while True:
        if alive is not None and not alive():
            raise WaitAborted()
        try:
            if await ready():
                return True
        except retry_on:
            pass
        if deadline is not None and loop.time() >= deadline:
            return False
        await asyncio.sleep(interval_s)


async def async_retry(
    call: Callable[[], Awaitable[T]],
    *,
    retry_if: Callable[[BaseException], bool],
    within_s: float,
    first_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
    what: str = "call",
) -> T:
    """`await call()`, retried with doubling delays while it fails with an error for
    which `retry_if` is true, for up to `within_s` seconds; then (or on any other error)
    the error propagates."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    delay = first_delay_s
    while True:
        try:
            return await call()
        except Exception as exc:
            if not retry_if(exc) or loop.time() > deadline:
                raise
            log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """`event.wait()` for up to `timeout_s` seconds; True if it was set.

    Not `asyncio.wait_for`: on Python 3.11 it returns normally when a cancellation
    arrives in the same loop turn as the event, and a polling loop around it (the
    producer's gate) then goes on after its task was cancelled.
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=max(0.0, timeout_s))
    finally:
        waiter.cancel()
    return bool(done)
