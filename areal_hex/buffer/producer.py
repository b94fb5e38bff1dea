"""The rollout side of the buffer (asyncio, redis.asyncio): the staleness gate, appending
groups to the stream, and watching policy-version updates.

Gate rule (B groups per step, bound eta): with the trainer at version v, at most
(v + eta + 1) * B groups may have been admitted since the run began; `admit(n)` waits while
submitted + n exceeds that, i.e. a single producer blocks exactly when
submitted >= (v + eta + 1) * B. It also waits while the stream holds `max_pending` or more
unconsumed + pending groups (backpressure: memory is bounded by waiting, never by trimming).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import redis
import redis.asyncio

from areal_hex.buffer import scripts
from areal_hex.buffer.codec import encode_group
from areal_hex.buffer.keys import GROUP, PAYLOAD_FIELD, BufferKeys
from areal_hex.config.redis import BufferConfig
from areal_hex.record import GroupRecord


@dataclass(frozen=True)
class VersionUpdate:
    version: int
    path: str  # weights directory of this version ("" when none was published)


def _parse_update(data: bytes | str) -> VersionUpdate | None:
    try:
        msg = json.loads(data)
        return VersionUpdate(int(msg["version"]), str(msg.get("path") or ""))
    except (ValueError, KeyError, TypeError):
        return None  # a foreign message on our channel: the poll fallback still applies


class RedisTrajectoryProducer:
    """`TrajectoryProducer` over a Redis stream. Use from one event loop."""

    def __init__(self, client: redis.asyncio.Redis, run_id: str, cfg: BufferConfig) -> None:
        self.r = client
        self.keys = BufferKeys(run_id)
        self.cfg = cfg
        self._admit = client.register_script(scripts.ADMIT)
        self._release = client.register_script(scripts.RELEASE)
        self._group_ready = False
        # Blocked admits wait on this event; the listener swaps in a fresh one per bump.
        self._bump = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:  # id 0: entries added before the group existed are still delivered
            await self.r.xgroup_create(self.keys.traj, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    # ------------------------------------------------------------ gate
    async def admit(self, n: int = 1) -> None:
        """Wait until the gate and backpressure let `n` more groups in, then count them."""
        if n <= 0:
            raise ValueError(f"admit(n): n must be positive, got {n}")
        await self._ensure_group()
        c = self.cfg
        args = [n, c.max_staleness, c.groups_per_step, c.max_pending]
        deadline = time.monotonic() + c.gate_timeout_s
        while True:
            status, sub, v, backlog = await self._admit(
                keys=[self.keys.submitted, self.keys.version, self.keys.traj], args=args
            )
            if status == 1:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(self._timeout_message(n, int(status), sub, v, backlog))
            self._start_listener()
            try:  # wake on a version bump, or poll (acks that free backlog are not signalled)
                await asyncio.wait_for(self._bump.wait(), timeout=min(remaining, c.poll_interval_s))
            except asyncio.TimeoutError:
                pass

    def _timeout_message(self, n: int, status: int, sub: int, v: int, backlog: int) -> str:
        c = self.cfg
        eta, b = c.max_staleness, c.groups_per_step
        head = (
            f"buffer gate (run {self.keys.run_id}): waited {c.gate_timeout_s:g} s "
            f"to admit {n} group(s): "
        )
        if status == 0:
            return head + (
                f"submitted={sub} + n={n} > (v + eta + 1) * B = ({v} + {eta} + 1) * {b} = "
                f"{(v + eta + 1) * b} with policy version v={v}, eta={eta} "
                f"(buffer.max_staleness), B={b} (buffer.groups_per_step); the trainer has not "
                f"published a newer version: is it running and consuming {self.keys.traj}?"
            )
        return head + (
            f"backpressure: {backlog} groups unconsumed or pending >= buffer.max_pending="
            f"{c.max_pending} (submitted={sub}, v={v}); is the trainer consuming and acking?"
        )

    async def release(self, n: int = 1) -> int:
        """Give back `n` admissions whose groups will not be put (e.g. a prompt failed), so
        the trainer is not left waiting for groups that never come. Returns submitted."""
        return int(await self._release(keys=[self.keys.submitted], args=[n]))

    def _start_listener(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        pubsub = self.r.pubsub()
        try:
            await pubsub.subscribe(self.keys.weights_channel)
            async for msg in pubsub.listen():
                if msg.get("type") == "message":
                    self._bump.set()
                    self._bump = asyncio.Event()
        except (redis.ConnectionError, OSError):
            pass  # the gate's poll fallback keeps working; the next wait restarts us
        finally:
            await pubsub.aclose()

    # ------------------------------------------------------------ data
    async def put(self, group: GroupRecord) -> str:
        """Append an admitted group; returns its stream entry id."""
        await self._ensure_group()
        entry_id = await self.r.xadd(self.keys.traj, {PAYLOAD_FIELD: encode_group(group)})
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def put_many(self, groups: Sequence[GroupRecord]) -> list[str]:
        """Append several admitted groups in one round trip (in order)."""
        await self._ensure_group()
        pipe = self.r.pipeline(transaction=False)
        for g in groups:
            pipe.xadd(self.keys.traj, {PAYLOAD_FIELD: encode_group(g)})
        ids = await pipe.execute()
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def version(self) -> int:
        return int(await self.r.get(self.keys.version) or 0)

    async def current(self) -> VersionUpdate:
        v, path = await self.r.mget(self.keys.version, self.keys.weights_path)
        return VersionUpdate(int(v or 0), (path or b"").decode())

    async def watch_versions(
        self, include_current: bool = True, poll_s: float = 1.0
    ) -> AsyncIterator[VersionUpdate]:
        """Yield each newer policy version (increasing), from pub/sub with a poll fallback
        (a missed message is found by reading the version key). With `include_current`, the
        version at subscription time comes first. A lost connection is retried every
        `poll_s` seconds; the iterator only ends when the caller stops it."""
        last = -1 if include_current else (await self.current()).version
        while True:
            pubsub = self.r.pubsub()
            try:
                await pubsub.subscribe(self.keys.weights_channel)
                async for upd in self._updates(pubsub, poll_s):
                    if upd.version > last:
                        last = upd.version
                        yield upd
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                await asyncio.sleep(poll_s)  # Redis restarting: resubscribe, re-read the key
            finally:
                await pubsub.aclose()

    async def _updates(
        self, pubsub: redis.asyncio.client.PubSub, poll_s: float
    ) -> AsyncIterator[VersionUpdate]:
        while True:
            # Read the key right after subscribing and after every quiet period, so an
            # update published while we were not listening is not lost.
            yield await self.current()
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_s)
            while msg is not None:
                if msg.get("type") == "message":
                    upd = _parse_update(msg["data"])
                    if upd is not None:
                        yield upd
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            try:
                await self._listener
            except (asyncio.CancelledError, Exception):
                pass
            self._listener = None
