"""Hybrid placement, controller side: the trainer's devices also generate, while it waits.

`workflow.placement: hybrid`: the servers of their own generate all the time (as
disaggregated); the last `workflow.lent_servers` servers run on the trainer's devices and
generate only while the trainer waits for its next batch. One step, across processes:

1. the trainer waits: every server, lent ones included, makes groups.
2. the trainer has its batch: the groups put by this controller, less those the trainer
   dropped as stale, reach the trainer's next step (`(steps done + 1) · B`, steps done
   read from the version the trainer published, one a step): the lent servers pause and
   the dispatcher sends them nothing new while another server is healthy. Lent after
   the last two updates (generation binds: they are lent every step) they pause in place
   (`/pause_generation` mode `in_place`: their requests in flight stay, with their KV
   cache, for the next lend); else with mode `abort` (their requests end with the tokens
   they have and go on on a server of its own). The trainer steps on its devices. Each
   server is sent at most what it runs at once and one group more (asynchronous:
   `Dispatcher.max_requests`), so a paused server holds little and the rest waits in the
   controller for the first server free.
3. the trainer publishes v+1: the weight update pauses, loads and continues the servers
   of their own and the lent servers that generate; a lent server paused for the
   trainer is left out (its load would take the trainer's devices and hold the other
   servers' continue). Then, unless the next batch is already made (generation ahead of
   the trainer), the lent servers load the version served, if they lack it, and
   continue (what they held goes on, with the new weights, as in any in-place update);
   otherwise they stay paused, and what they hold ends (mode `abort`) to go on on a
   server of its own: a group held on a paused server would wait out every step while
   generation keeps ahead.

A lend is one pause and its continue, the continue with its load
(`context_switches_total`, `context_switch_s_total` in each metrics row, as the
controller waits for every lent server; `lent_loads_total`, `lent_tokens_total`: the
loads a continue made and the tokens the lent servers generated). No request is given up
by a lend: a held request goes on where it is, an aborted one elsewhere from the tokens
it has. The groups the
trainer dropped as stale count for no batch: they are read from the buffer
(`position().groups_dropped_stale`) before the lent servers pause and after each update,
so a drop never keeps them paused while the trainer waits (counted as put, every drop
would: the trainer a group short, the lend a group ahead). Groups in the buffer from
before a restart are not counted: the lent servers then generate a little longer than
the trainer needs, which costs the trainer a share of its devices, never a group.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from areal_hex.buffer.errors import BUFFER_ERRORS
from rollout_service.controller.colocate import Admit, Colocation, InFlight, Phases
from rollout_service.controller.dispatch import SERVER_ERRORS, ServerState
from rollout_service.controller.weight_sync import WeightSync

log = logging.getLogger(__name__)

Loaded = tuple[int, str]  # (version, path) of the weights a server holds


class Lending:
    """Pauses the servers lent by the trainer's devices while the trainer steps."""

    def __init__(
        self,
        weights: WeightSync,
        in_flight: InFlight,
        *,
        lent: int,
        groups_per_step: int,
        max_requests: int | None = None,
    ) -> None:
        """`weights`: the controller's protocol (its updates continue every server, then
        call `settle`); `lent`: how many of the last servers the trainer's devices hold;
        `groups_per_step`: B, the trainer's batch in groups; `max_requests`: the requests
        each server is sent at once, the rest waiting in the controller for the first
        server free, so that a lent server that continues takes them at once (None: no
        bound). `in_flight` is unused (the signature of every phase
        control)."""
        servers = weights.dispatcher.servers
        if not 0 < lent < len(servers):
            raise ValueError(
                f"{lent} lent server(s) of {len(servers)}: expected at least one lent and "
                "one of its own"
            )
        self.weights = weights
        self.lent: list[ServerState] = servers[-lent:]
        self.groups_per_step = groups_per_step
        weights.after_update.append(self.after_update)
        weights.dispatcher.max_requests = max_requests
        self.put_total = 0  # groups this controller put
        self.first_version: int | None = None  # the trainer's version at the first put
        self.away = False  # the lent servers are paused: the trainer has its devices
        self.switches_total = 0
        self.switch_s_total = 0.0
        self._pause_s = 0.0  # of the lend under way
        self._lock = asyncio.Lock()
        self.loads_total = 0  # weight loads a continue made
        self.dropped = 0  # groups the trainer dropped as stale since the first put
        self._dropped_before: int | None = None  # its count before the first put
        self._loaded: dict[int, Loaded] = {}  # lent server index -> the weights it holds
        self._left: set[int] = set()  # lent servers the last update left out
        self._holding: set[int] = set()  # lent servers paused in place, holding requests
        self.lent_updates = 0  # the updates in a row after which the lent servers generated
        if weights.network is None:  # over the network every server takes each broadcast
            weights.leave_out = self.leave_out

    def leave_out(self, s: ServerState, weights: Loaded) -> bool:
        """Whether the weight update loading `weights` leaves `s` out: a lent server
        paused for the trainer (it loads them when it continues)."""
        if all(s is not x for x in self.lent):
            return False
        if s.lent_away:
            self._left.add(s.index)
            return True
        self._left.discard(s.index)
        self._loaded[s.index] = weights
        return False

    def gated(self, admit: Callable[..., Awaitable[None]]) -> Admit:
        """Admissions are the staleness gate's alone: the lent servers follow the puts."""
        return admit

    def trainer_has_batch(self) -> bool:
        """The groups put, less those the trainer dropped as stale, reach the batch of
        the trainer's next step."""
        if self.first_version is None:
            return False
        steps_done = max(0, self.weights.serving - self.first_version)
        kept = self.put_total - self.dropped
        return kept >= (steps_done + 1) * self.groups_per_step

    async def after_put(self) -> None:
        """One more group in the buffer: the trainer may have its batch now."""
        if self.first_version is None:
            self.first_version = self.weights.serving
            await self._count_dropped()
        self.put_total += 1
        await self.settle()

    async def _count_dropped(self) -> None:
        """Read the groups the trainer dropped as stale since the first put: each one
        put counts for no batch (left as it was where the buffer cannot be read)."""
        try:
            total = (await self.weights.producer.position()).groups_dropped_stale
        except BUFFER_ERRORS as exc:
            log.warning("the groups dropped as stale could not be read: %s", exc)
            return
        if self._dropped_before is None:
            self._dropped_before = total
        self.dropped = total - self._dropped_before

    async def after_update(self) -> None:
        """A new version is served (the update continued every server it loaded): the
        lent servers are told again what they do, generate or pause."""
        await self.settle(again=True)

    async def settle(self, again: bool = False) -> None:
        """Pause the lent servers if the trainer has its batch, continue them if not;
        `again`: even if that is what they were last told."""
        async with self._lock:
            away = self.trainer_has_batch()
            if away == self.away and not again:
                return
            if away:  # the trainer may have dropped some of them at its last fetch
                await self._count_dropped()
                away = self.trainer_has_batch()
                if away == self.away and not again:
                    return
            if again:  # one more update with the lent servers lent, or none
                self.lent_updates = 0 if away else self.lent_updates + 1
            t0 = time.monotonic()
            await asyncio.gather(*[self._one(s, away) for s in self.lent])
            if away and not self.away:
                self._pause_s = time.monotonic() - t0
            elif self.away and not away:
                self._count_switch(time.monotonic() - t0)
            self.away = away

    def _count_switch(self, continue_s: float) -> None:
        self.switches_total += 1
        self.switch_s_total += self._pause_s + continue_s
        self._pause_s = 0.0

    async def _one(self, s: ServerState, away: bool) -> None:
        """Pause `s`, its requests ended for a server of their own to go on with
        (`away`), or bring it to the version served and continue it; a server that fails
        the call is left as it is (the dispatcher's probe finds a dead one)."""
        s.lent_away = away
        try:
            if away:
                await self._pause(s)
                return
            self._left.discard(s.index)
            self._holding.discard(s.index)  # what it holds goes on as it continues
            want = self.weights.applied
            if want is not None and self.weights.network is None:
                if self._loaded.get(s.index) != want:
                    await s.client.update_weights_from_disk(want[1], want[0], False)
                    self._loaded[s.index] = want
                    self.loads_total += 1
            await s.client.resume()
            self.weights.dispatcher.wake()  # the requests waiting for a server come here
        except SERVER_ERRORS as exc:
            verb = "pause" if away else "continue"
            log.warning("%s: %s for the trainer failed: %s", s.url, verb, exc)
            s.lent_away = False

    async def _pause(self, s: ServerState) -> None:
        """Pause `s`. Lent at the last two updates (generation binds: it is lent every
        step), in place: what it runs waits, with its KV cache, for the next lend, a step
        away. Else, or once it stays paused through an update (the trainer has its next
        batch already), what it holds ends (pause mode `abort`) and goes on on a server
        of its own: held, it would wait out steps and come back too stale to train."""
        if s.index not in self._left:
            held = self.lent_updates >= 2
            await s.client.pause("in_place" if held else "abort")
            if held:
                self._holding.add(s.index)
        elif s.index in self._holding:
            await s.client.pause("abort")
            self._holding.discard(s.index)

    def row_fields(self) -> dict[str, float]:
        """The lend counters, for the controller's metrics row."""
        return {
            "context_switches_total": self.switches_total,
            "context_switch_s_total": round(self.switch_s_total, 4),
            "lent_loads_total": self.loads_total,
            "lent_tokens_total": sum(s.tokens_total for s in self.lent),
        }


def phases_for(
    placement: str, lent: int, groups_per_step: int, max_requests: int | None = None
) -> Phases | None:
    """The phase control of `placement` (workflow.placement); None: disaggregated."""
    if placement == "colocated":
        return Colocation
    if placement == "hybrid":
        return functools.partial(
            Lending, lent=lent, groups_per_step=groups_per_step, max_requests=max_requests
        )
    return None


def server_requests(max_running_requests: int, group_size: int, asynchronous: bool) -> int | None:
    """A hybrid's `max_requests`: asynchronous, what a server runs at once and one group
    more (queued there, so that it never waits for the next); synchronous, no bound (the
    whole batch is sent at once, as the price's replay has it)."""
    return max_running_requests + group_size if asynchronous else None
