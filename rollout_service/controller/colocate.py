"""Colocated placement, controller side: generation and training take turns on the same
devices (`workflow.placement: colocated`, synchronous: η = 0, k = 1).

One step, across processes:

1. generate: the staleness gate admits the step's B groups; the controller makes them on
   servers that hold their memory.
2. yield: the gate refuses the next admission (`TrajectoryProducer.admit`'s `on_hold`:
   the controller has submitted all it may until the next version) and the last group
   in flight is put: every healthy server pauses (mode abort: nothing of the controller's
   is in flight, only leftovers such as a health probe) and releases its memory
   (`/release_memory_occupation`: on a GPU the weights go to host memory and the KV
   cache back to the device; on CPU its engine holds none while idle). The trainer,
   which has its batch, steps on the devices.
3. take back: the trainer publishes v+1; before the weights load (`WeightSync`'s
   `before_update`, after it closed its gate) every server resumes its memory
   (`/resume_memory_occupation`) and continues, then loads v+1, and the gate admits the
   next batch.
   Should the gate reopen without a new version (admissions given back), the servers
   resume before the first request all the same: no request ever meets a released
   server.

A release decided while an update already started (the gate's epoch moved) or once the
admission came through is skipped, so a release never follows the resume it would undo.
A switch is one release and its resume; the time both took (all servers, as the
controller waits for them) is counted in each metrics row (`context_switches_total`,
`context_switch_s_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

from rollout_service.controller.dispatch import SERVER_ERRORS, Dispatcher, ServerState
from rollout_service.controller.weight_sync import UpdateGate, WeightSync

log = logging.getLogger(__name__)

Admit = Callable[[], Awaitable[None]]
InFlight = Callable[[], Collection[asyncio.Task[None]]]


class PhaseControl(Protocol):
    """What the controller calls of a placement whose generation shares devices."""

    def gated(self, admit: Callable[..., Awaitable[None]]) -> Admit: ...

    async def after_put(self) -> None: ...

    def row_fields(self) -> dict[str, float]: ...


# A placement's phase control, made from the controller's weight protocol and its groups
# in flight (`Colocation`, or `lend.Lending` with its servers and batch bound)
Phases = Callable[[WeightSync, InFlight], PhaseControl]


class Colocation:
    """Releases the servers' memory while the trainer steps and takes it back before
    the next weights load."""

    def __init__(self, weights: WeightSync, in_flight: InFlight) -> None:
        """`weights`: the controller's protocol, whose servers and gate these are (its
        updates resume the servers first); `in_flight()`: the groups being made now."""
        self.dispatcher: Dispatcher = weights.dispatcher
        self.gate: UpdateGate = weights.gate
        self.in_flight = in_flight
        weights.before_update.append(self.resume)
        self.released: list[ServerState] = []  # servers that gave their memory back
        self.switches_total = 0
        self.switch_s_total = 0.0
        self._release_s = 0.0  # of the switch under way
        self._lock = asyncio.Lock()

    def gated(self, admit: Callable[..., Awaitable[None]]) -> Admit:
        """`admit` (the producer's) that yields the devices while the gate holds."""

        async def admit_or_yield() -> None:
            held = asyncio.Event()
            got = asyncio.ensure_future(admit(on_hold=held.set))
            try:
                await _first(got, held.wait())
                if not got.done():
                    epoch = self.gate.epoch
                    pending = set(self.in_flight())
                    if pending:  # the step's last groups are being made: let them end
                        await _first(got, asyncio.wait(pending))
                    if not got.done():
                        await self.release(lambda: got.done() or self.gate.epoch != epoch)
                await got
            finally:
                if not got.done():
                    got.cancel()
            await self.resume()  # a gate reopened without a new version: take it back

        return admit_or_yield

    async def release(self, stale: Callable[[], bool] = lambda: False) -> None:
        """Every healthy server gives its memory back, unless `stale()` (the phase it
        was meant for is over) or it already did."""
        async with self._lock:
            if self.released or stale():
                return
            t0 = time.monotonic()
            servers = [s for s in self.dispatcher.servers if s.healthy]
            self.released = await self._each(servers, "release")
            self._release_s = time.monotonic() - t0

    async def resume(self) -> None:
        """Every server that released its memory takes it back (WeightSync's
        `before_update`, and after each admission)."""
        async with self._lock:
            if not self.released:
                return
            t0 = time.monotonic()
            await self._each(self.released, "resume")
            self.released = []
            self.switches_total += 1
            self.switch_s_total += self._release_s + time.monotonic() - t0

    async def _each(self, servers: list[ServerState], verb: str) -> list[ServerState]:
        """`verb` on every server at once; those that answered. "release": pause with
        abort (no group is in flight: anything the server still holds is a leftover,
        e.g. a health probe), then release; a server that refuses is continued and left
        holding its memory. "resume": take the memory back, then continue; a server that
        fails is marked unhealthy (recovery reloads it; a restarted server holds its
        memory)."""

        async def one(s: ServerState) -> bool:
            c = s.client
            try:
                if verb == "release":
                    await c.pause("abort")
                    await c.release_memory_occupation()
                else:
                    await c.resume_memory_occupation()
                    await c.resume()
            except SERVER_ERRORS as exc:
                if verb != "release":
                    self.dispatcher.mark_unhealthy(s, f"{verb} memory: {exc}")
                    return False
                log.warning("%s kept its memory (release refused: %s)", s.url, exc)
                with contextlib.suppress(*SERVER_ERRORS):
                    await c.resume()
                return False
            return True

        ok = await asyncio.gather(*[one(s) for s in servers])
        return [s for s, good in zip(servers, ok, strict=True) if good]

    async def after_put(self) -> None:
        """Nothing: the gate's hold, not a put, ends a colocated generation phase."""

    def row_fields(self) -> dict[str, float]:
        """The switch counters, for the controller's metrics row."""
        return {
            "context_switches_total": self.switches_total,
            "context_switch_s_total": round(self.switch_s_total, 4),
        }


async def _first(*aws: Awaitable[object]) -> None:
    """Until the first of `aws` is done; the others that this call started are
    cancelled (a future passed in is left running)."""
    futs = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f, a in zip(futs, aws, strict=True):
            if f is not a and not f.done():
                f.cancel()
