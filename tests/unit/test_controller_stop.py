"""The weight sync and the controller's stop when a stop meets a weight update under way:
the servers are resumed and nothing waits for ever (fakes behind the client Protocol)."""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeServer, MemoryProducer

from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.weight_sync import UpdateGate, WeightSync


class SlowReload(FakeServer):
    """A server whose weight load takes 0.3 s."""

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = True
    ) -> None:
        await asyncio.sleep(0.3)
        await super().update_weights_from_disk(model_path, weight_version)


@pytest.mark.timeout(60)
async def test_stopping_waits_for_a_weight_update_under_way() -> None:
    server = SlowReload("a")
    d = Dispatcher([server])
    await d.probe_all()
    ws = WeightSync(d, MemoryProducer(), UpdateGate())
    assert await ws.settle(0.01)  # nothing under way
    task = asyncio.create_task(ws.update(1, "/w/v1"))
    await asyncio.sleep(0.05)
    assert not await ws.settle(0.01)  # paused, reloading
    assert not server.running.is_set()
    assert await ws.settle(5.0)
    # what the controller's stop waits for: loaded, counted, the server running again
    assert ws.syncs_total == 1 and server.version == 1 and server.running.is_set()
    await task


@pytest.mark.timeout(60)
async def test_a_weight_update_cancelled_halfway_still_resumes_the_servers() -> None:
    """The task that runs an update is cancelled while the servers are paused (a caller
    stopping its reload loop): they are resumed, not left paused for every later request."""

    server = SlowReload("a")
    d = Dispatcher([server])
    await d.probe_all()
    gate = UpdateGate()
    ws = WeightSync(d, MemoryProducer(), gate)
    task = asyncio.create_task(ws.update(1, "/w/v1"))
    await asyncio.sleep(0.05)
    assert not server.running.is_set()  # paused, reloading
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert server.running.is_set() and server.version == 1 and gate.version == 1
    assert await ws.settle(0.01)


async def test_a_stop_ends_a_wait_whose_first_cancel_was_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller's `_until_stop`: a wait that swallows the stop's cancel (as
    `asyncio.wait_for` on Python 3.11 can) is cancelled again until it ends."""
    import types

    from rollout_service.controller import rollout

    monkeypatch.setattr(rollout, "CANCEL_AGAIN_S", 0.05)
    lost = []

    async def swallows_one_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost.append(1)
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        await asyncio.sleep(3600)

    me = types.SimpleNamespace(_stop=asyncio.Event())
    asyncio.get_running_loop().call_later(0.02, me._stop.set)
    done = await asyncio.wait_for(
        rollout.RolloutController._until_stop(me, swallows_one_cancel()), 5
    )  # type: ignore[arg-type]
    assert done is False and lost == [1]
