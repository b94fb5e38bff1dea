"""The step-loop thread's results reach the event loop in one wake-up per tick."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from rollout_service.server.wakeups import LoopPost


async def test_posts_from_the_owner_wait_for_flush_and_arrive_in_order_in_one_wakeup() -> None:
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    wakeups = 0
    post = LoopPost(loop)
    real = loop.call_soon_threadsafe

    def counting(fn: Any, *args: Any) -> Any:
        nonlocal wakeups
        wakeups += 1
        return real(fn, *args)

    post.loop = type("L", (), {"call_soon_threadsafe": staticmethod(counting)})()
    done = asyncio.Event()

    def tick() -> None:
        for i in range(20):
            post.post(seen.append, i)
        assert wakeups == 0  # nothing sent before the flush
        post.post(done.set)
        post.flush()
        post.flush()  # nothing left: no second wake-up

    thread = threading.Thread(target=tick)
    post.owner = thread
    thread.start()
    await asyncio.wait_for(done.wait(), 5)
    thread.join()
    assert seen == list(range(20))
    assert wakeups == 1


async def test_posts_from_another_thread_go_at_once() -> None:
    loop = asyncio.get_running_loop()
    post = LoopPost(loop)
    post.owner = threading.Thread(target=lambda: None)  # not this one
    got = asyncio.Event()
    threading.Thread(target=post.post, args=(got.set,)).start()
    await asyncio.wait_for(got.wait(), 5)
