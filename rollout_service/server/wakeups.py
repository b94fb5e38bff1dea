"""Calls from the engine's step-loop thread onto the serving event loop, one wake-up per
tick: each `loop.call_soon_threadsafe` writes the loop's self-pipe (a system call, and a
switch to the loop's thread), and a tick can finish dozens of requests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

Call = tuple[Callable[..., Any], tuple[Any, ...]]


class LoopPost:
    """`post(fn, *args)` runs fn(*args) on `loop`: at once from any other thread, after
    `flush()` from the step-loop thread (in the order posted)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.owner: threading.Thread | None = None  # the step-loop thread, once it runs
        self._pending: list[Call] = []

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        if threading.current_thread() is self.owner:
            self._pending.append((fn, args))
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def flush(self) -> None:
        """Send what the step-loop thread posted (call on that thread)."""
        if self._pending:
            calls, self._pending = self._pending, []
            self.loop.call_soon_threadsafe(_run_calls, calls)


def _run_calls(calls: list[Call]) -> None:
    for fn, args in calls:
        fn(*args)
