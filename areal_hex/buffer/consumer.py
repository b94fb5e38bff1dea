"""The training side of the buffer (synchronous redis-py): batches of fresh groups, explicit
acknowledgement, dead-lettering, stats, and weight-version publication.

Delivery guarantees (one consumer group, `trainer`):
- An entry leaves the stream only through `ack()` (XACK + XDEL), which the trainer calls
  after the optimizer step (or checkpoint) that used it committed. Until then it stays
  pending: a consumer restarted under the same name re-reads its own pending entries first,
  and another consumer reclaims entries idle longer than `reclaim_idle_ms` (XAUTOCLAIM).
- While the trainer holds delivered entries, a keepalive thread resets their idle time, so
  a slow step is not mistaken for a dead consumer.
- Groups older than v - eta, or with a token newer than v (its weights were lost to a
  trainer restart that rolled the version back), are acknowledged, deleted and counted
  (`<run>:groups_dropped_stale`) and handed back to the gate;
  malformed entries go to `<run>:dead` with the reason and raw payload (`<run>:dead_count`).

New entries, acks and version reads go through one connection kept for them (`SyncLink`:
replies read by hand, each payload received into a buffer of its own), and so do a
publisher's version bumps (its own); calls from several threads queue for it. The
keepalive thread and everything else use the client's pool.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence

import redis

from areal_hex.api import Batch, BufferStats
from areal_hex.buffer import scripts
from areal_hex.buffer.codec import DecodeError, decode_group_with_versions
from areal_hex.buffer.keys import GIVE_BACK_REASONS, GROUP, PAYLOAD_FIELD, BufferKeys
from areal_hex.buffer.sync_link import SyncLink
from areal_hex.config.buffer import BufferConfig
from areal_hex.record import GroupRecord

# (stream id, fields); fields None: deleted. A payload read by the consumer's own link is
# a read-only memoryview of the buffer it was received into.
Entry = tuple[str, dict[bytes, bytes | memoryview] | None]
Item = tuple[str, GroupRecord, int]  # (stream id, group, group version computed once)


def ensure_group(r: redis.Redis, keys: BufferKeys) -> None:
    try:  # id 0: entries added before the group existed are still delivered
        r.xgroup_create(keys.traj, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _sid(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _entries(resp: list | None) -> list[Entry]:
    """XREADGROUP's raw reply for one stream ([[stream, [[id, [field, value, ...]], ...]]],
    None when nothing came) as entries."""
    if not resp:
        return []
    return [
        (_sid(i), None if f is None else dict(zip(f[::2], f[1::2], strict=True)))
        for i, f in resp[0][1]
    ]


def read_stats(r: redis.Redis, keys: BufferKeys) -> BufferStats:
    """One snapshot of the buffer's counters (used by the consumer and `buffer stats`).
    Creates nothing: a run that never wrote reads as all zeros."""
    pipe = r.pipeline(transaction=True)
    pipe.xlen(keys.traj)
    pipe.xpending(keys.traj, GROUP)
    pipe.xinfo_groups(keys.traj)
    pipe.mget(keys.submitted, keys.groups_dropped_stale, keys.dead_count, keys.version)
    pipe.mget([keys.given_back(reason) for reason in GIVE_BACK_REASONS])
    length, pend, groups, counters, back = pipe.execute(raise_on_error=False)
    for reply in (counters, back):
        if isinstance(reply, Exception):
            raise reply
    # No stream or no group yet: XPENDING / XINFO answer with errors, which mean zero.
    pending = 0 if isinstance(pend, Exception) else int(pend["pending"])
    groups = [] if isinstance(groups, Exception) else groups
    info = next((g for g in groups if _sid(g["name"]) == GROUP), {})
    lag = info.get("lag")
    # Acked entries are deleted, so without a lag figure the rest of the stream is unread.
    unconsumed = int(lag) if lag is not None else max(0, int(length) - pending)
    sub, stale, dead, version = (int(x or 0) for x in counters)
    given_back = {r: int(x or 0) for r, x in zip(GIVE_BACK_REASONS, back, strict=True)}
    return BufferStats(int(length), pending, unconsumed, sub, stale, dead, version, given_back)


class RedisWeightPublisher:
    """`WeightPublisher`: SET the version (and path) and PUBLISH {version, path}."""

    def __init__(self, client: redis.Redis, run_id: str, cfg: BufferConfig) -> None:
        self.r = client
        self.keys = BufferKeys(run_id)
        self.cfg = cfg
        self._restore = client.register_script(scripts.RESTORE)
        self.lineage = int(client.get(self.keys.lineage) or 0)
        self._link = SyncLink(client)  # the connection publishes go through

    def set_version(self, version: int, weights_path: str) -> None:
        msg = json.dumps(
            {"version": int(version), "path": str(weights_path), "lineage": self.lineage}
        )
        k = self.keys
        replies = self._link.call(
            [
                (b"MULTI",),
                (b"SET", k.version, int(version)),
                (b"SET", k.weights_path, str(weights_path)),
                (b"PUBLISH", k.weights_channel, msg),
                (b"EXEC",),
            ]
        )
        for x in replies[-1] or ():  # an error inside the transaction's replies
            if isinstance(x, BaseException):
                raise x

    def restore(self, version: int, weights_path: str, position: int = 0) -> int:
        """On resume from a checkpoint at `version`: set the version without notifying and
        recompute the admission count from durable state (acked + dropped + dead-lettered +
        in the stream + held by live producers, at least version * B: a fresh Redis would
        otherwise let the gate open wider than the bound); the data position is raised to
        at least `position`, and a new lineage begins (the controllers follow the
        restored version even if it is lower). Returns the admission count."""
        k = self.keys
        keys = [k.version, k.weights_path, k.submitted, k.leases, k.given_back("reclaimed")]
        keys += [k.acked, k.groups_dropped_stale, k.dead_count, k.traj, k.admitted, k.lineage]
        args = [int(version), str(weights_path), self.cfg.groups_per_step, k.lease("")]
        count, _, lineage = self._restore(keys=keys, args=[*args, int(position)])
        self.lineage = int(lineage)
        return int(count)

    def position(self) -> int:
        """Admissions ever made (the controller's data position)."""
        return int(self.r.get(self.keys.admitted) or 0)


class RedisTrajectoryConsumer:
    """`TrajectoryConsumer` over a Redis stream, for the (synchronous) trainer."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        cfg: BufferConfig,
        name: str | None = None,
        keepalive: bool = True,
        copy_arrays: bool = False,
    ) -> None:
        """`name` defaults to `cfg.consumer_name`; `copy_arrays` decodes into writable
        arrays instead of read-only views of the received payloads."""
        self.r = client
        self.keys = BufferKeys(run_id)
        self.cfg = cfg
        self.name = name or cfg.consumer_name
        self.copy_arrays = copy_arrays
        self._rng = random.Random(cfg.shuffle_seed)
        self._ack = client.register_script(scripts.ACK_DELETE)
        self._link = SyncLink(client)  # the connection new entries and acks go through
        ensure_group(client, self.keys)
        self._history_cursor: str | None = "0-0"  # own pending entries, read first
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        # Delivered to the caller (or carried over a timed-out call), not yet acked.
        self._held: set[str] = set()
        self._carry: list[Item] = []
        self._filling: list[Item] = []  # what the get_batch under way has so far
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if keepalive and cfg.reclaim_idle_ms > 0:
            self._keeper = threading.Thread(target=self._keepalive, daemon=True)
            self._keeper.start()

    # ------------------------------------------------------------ reading
    def _read_history(self, count: int) -> list[Entry]:
        """This consumer's own pending entries (left by a previous process of this name)."""
        assert self._history_cursor is not None
        resp = self.r.xreadgroup(
            GROUP, self.name, {self.keys.traj: self._history_cursor}, count=count
        )
        entries = [(_sid(i), f) for i, f in (resp[0][1] if resp else [])]
        with self._lock:
            entries = [e for e in entries if e[0] not in self._held]
        if not resp or not resp[0][1]:
            self._history_cursor = None  # history exhausted: from now on only new entries
        else:
            self._history_cursor = _sid(resp[0][1][-1][0])
        return entries

    def _reclaim(self, count: int) -> list[Entry]:
        """Entries idle longer than reclaim_idle_ms in any consumer (a dead one's)."""
        now = time.monotonic()
        if now < self._next_claim:
            return []
        resp = self.r.xautoclaim(
            self.keys.traj,
            GROUP,
            self.name,
            min_idle_time=self.cfg.reclaim_idle_ms,
            start_id=self._claim_cursor,
            count=count,
        )
        cursor, claimed = _sid(resp[0]), resp[1]
        self._claim_cursor = cursor
        if cursor == "0-0":  # a full pass over the pending list: rest a while
            self._next_claim = now + max(self.cfg.poll_interval_s, 1.0)
        with self._lock:  # our own held entries may be idle too: they are not lost
            return [(_sid(i), f) for i, f in claimed if _sid(i) not in self._held]

    def _read_new(self, count: int, block_ms: int | None) -> tuple[list[Entry], int]:
        """New entries, and the policy version read in the same round trip (before the
        read blocks, as it is checked against)."""
        read = [b"XREADGROUP", b"GROUP", GROUP, self.name, b"COUNT", count]
        if block_ms is not None:
            read += [b"BLOCK", block_ms]
        read += [b"STREAMS", self.keys.traj, b">"]
        version, resp = self._link.call([(b"GET", self.keys.version), read])
        return _entries(resp), int(version or 0)

    def _fetch(self, count: int, block_ms: int | None) -> tuple[list[Entry], int]:
        try:
            return self._fetch_once(count, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The stream or group vanished (a server restarted without persistence, or a
            # FLUSHALL): recreate them and carry on with whatever arrives from now.
            ensure_group(self.r, self.keys)
            self._history_cursor, self._claim_cursor = None, "0-0"
            return [], self.version()

    def _fetch_once(self, count: int, block_ms: int | None) -> tuple[list[Entry], int]:
        """Own pending entries first, then reclaimed ones, then new ones; with the version."""
        if self._history_cursor is not None:
            entries = self._read_history(count)
            if entries or self._history_cursor is not None:
                return entries, self.version()
        entries = self._reclaim(count)
        if entries:
            return entries, self.version()
        return self._read_new(count, block_ms)

    # ------------------------------------------------------------ sorting
    def _triage(self, entries: list[Entry], v: int) -> tuple[list[Item], int, int]:
        """Decode entries: fresh groups are returned; stale ones are dropped and malformed
        ones dead-lettered, both acked and deleted in one transaction."""
        fresh: list[Item] = []
        stale: list[str] = []
        dead: list[tuple[str, str, bytes]] = []
        ceiling: float = v  # the newest version a group may carry (read once if passed)
        for entry_id, fields in entries:
            if not fields:
                dead.append((entry_id, "entry deleted before it was acknowledged", b""))
                continue
            payload = fields.get(PAYLOAD_FIELD)
            if payload is None:
                names = sorted(k.decode(errors="replace") for k in fields)
                dead.append((entry_id, f"no payload field 'd' (fields: {names})", b""))
                continue
            try:
                group, version, newest = decode_group_with_versions(payload, self.copy_arrays)
            except DecodeError as exc:
                dead.append((entry_id, str(exc), payload))
                continue
            if newest > ceiling == v:
                ceiling = self._ceiling(v)
            if version < v - self.cfg.max_staleness or newest > ceiling:
                # older than the bound, or newer than the policy: made by weights a
                # restarted trainer lost (it rolled back to an older version)
                stale.append(entry_id)
            else:
                fresh.append((entry_id, group, version))
        if stale or dead:
            self._discard(stale, dead)
        return fresh, len(stale), len(dead)

    def _ceiling(self, v: int) -> float:
        """The newest version a group may carry: the policy's now (a publication since `v`
        was read counts). Before any restore (`<run>:lineage` 0) there is none: the
        versions may be the servers' own numbering (a profile's load), not the buffer's."""
        version, lineage = self.r.mget(self.keys.version, self.keys.lineage)
        if not int(lineage or 0):
            return float("inf")
        return max(v, int(version or 0))

    def _discard(self, stale: list[str], dead: list[tuple[str, str, bytes]]) -> None:
        pipe = self.r.pipeline(transaction=True)
        for entry_id, reason, payload in dead:
            fields = {"reason": reason, "source_id": entry_id, "payload": payload}
            pipe.xadd(self.keys.dead, {**fields, "time": f"{time.time():.3f}"})
        if dead:
            pipe.incrby(self.keys.dead_count, len(dead))
        if stale:  # counted, and handed back to the gate so fresh groups replace them
            pipe.incrby(self.keys.groups_dropped_stale, len(stale))
            pipe.decrby(self.keys.submitted, len(stale))
        ids = stale + [d[0] for d in dead]
        pipe.xack(self.keys.traj, GROUP, *ids)
        pipe.xdel(self.keys.traj, *ids)
        pipe.execute()

    # ------------------------------------------------------------ contract
    def get_batch(
        self, n: int, timeout_s: float | None = None, *, version: int | None = None
    ) -> Batch:
        """Block until `n` fresh groups are delivered (oldest first, then shuffled).

        `version`: the weights the batch will train, when the trainer has them before
        their publication is announced (written in the background): staleness and the
        lags count from the newer of it and the published version.

        On timeout, raises TimeoutError; groups read so far are kept for the next call, as
        they are when the server is lost mid-way (the caller may retry)."""
        if n <= 0:
            raise ValueError(f"get_batch(n): n must be positive, got {n}")
        self._filling, self._carry = self._carry, []
        try:
            return self._fill(n, timeout_s, -1 if version is None else version)
        except redis.RedisError:
            self._carry = self._filling  # held by us: nobody else would serve them
            raise

    def _fill(self, n: int, timeout_s: float | None, trained: int) -> Batch:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        dropped = dead = 0
        have = self._filling
        # else the first read brings the version along
        v = max(self.version(), trained) if have else -1
        first = True
        while True:
            have, k = self._drop_stale_held(have, v)  # carried groups may have aged
            self._filling = have
            dropped += k
            if len(have) >= n:
                break
            left_ms = None if deadline is None else int((deadline - time.monotonic()) * 1000)
            if left_ms is not None and left_ms <= 0 and not first:
                self._carry = have
                raise TimeoutError(self._starved(len(have), n, timeout_s or 0.0, v))
            # Short blocking reads so that reclaiming runs between them; BLOCK 0 would
            # mean forever, so an expired deadline reads without blocking (None).
            block_ms = 1000 if left_ms is None else (min(1000, left_ms) if left_ms > 0 else None)
            first = False
            # Read ahead up to `prefetch` entries in one round trip; the surplus is held
            # (pending to us, kept alive) and served by the next calls.
            entries, v = self._fetch(max(n - len(have), self.cfg.prefetch), block_ms)
            v = max(v, trained)
            new, k_stale, k_dead = self._triage(entries, v)
            dropped, dead = dropped + k_stale, dead + k_dead
            with self._lock:
                self._held.update(i for i, _, _ in new)
            have = self._filling = have + new
        self._carry = have[n:]
        return self._batch(have[:n], v, dropped, dead)

    def _starved(self, have: int, n: int, timeout_s: float, v: int) -> str:
        """What a timed-out batch lacks and where the groups that would fill it stand."""
        st = read_stats(self.r, self.keys)
        held = sum(int(x) for x in self.r.hvals(self.keys.leases))
        cap = (v + self.cfg.max_staleness + 1) * self.cfg.groups_per_step
        return (
            f"buffer: {have} of {n} fresh groups after {timeout_s:g} s at policy version "
            f"{v} (stream {self.keys.traj}): {st.unconsumed} unread in the stream, "
            f"{held} being generated by controllers, the gate counts {st.submitted} of "
            f"{cap} admissions, {st.groups_dropped_stale} dropped as stale so far; is the rollout "
            "controller running and not done?"
        )

    def _drop_stale_held(self, have: list[Item], v: int) -> tuple[list[Item], int]:
        floor = v - self.cfg.max_staleness
        gone = [i for i, _, gv in have if gv < floor]
        if not gone:
            return have, 0
        self._discard(gone, [])
        with self._lock:
            self._held.difference_update(gone)
        return [it for it in have if it[2] >= floor], len(gone)

    def _batch(self, picked: list[Item], v: int, dropped: int, dead: int) -> Batch:
        order = list(range(len(picked)))
        self._rng.shuffle(order)  # oldest-first selection, random order within the batch
        items = [picked[i] for i in order]
        return Batch(
            entry_ids=[i for i, _, _ in items],
            groups=[g for _, g, _ in items],
            groups_dropped_stale=dropped,
            dead_lettered=dead,
            version_lags=[v - gv for _, _, gv in items],
        )

    def ack(self, entry_ids: Sequence[str]) -> None:
        """Acknowledge and delete entries after the step that used them committed."""
        ids = list(entry_ids)
        for lo in range(0, len(ids), scripts.MAX_IDS_PER_CALL):
            chunk = ids[lo : lo + scripts.MAX_IDS_PER_CALL]
            self._link.run_script(self._ack, [self.keys.traj, self.keys.acked], [GROUP, *chunk])
        with self._lock:
            self._held.difference_update(ids)

    def version(self) -> int:
        return int(self._link.call([(b"GET", self.keys.version)])[0] or 0)

    def stats(self) -> BufferStats:
        return read_stats(self.r, self.keys)

    # ------------------------------------------------------------ lifecycle
    def _keepalive(self) -> None:
        """Reset the idle time of held entries (XCLAIM JUSTID to ourselves) well within
        reclaim_idle_ms, so another consumer does not reclaim entries still in use."""
        period = max(0.05, self.cfg.reclaim_idle_ms / 3000)
        while not self._stop.wait(period):
            with self._lock:
                held = sorted(self._held)
            try:
                for lo in range(0, len(held), scripts.MAX_IDS_PER_CALL):
                    chunk = held[lo : lo + scripts.MAX_IDS_PER_CALL]
                    self.r.xclaim(self.keys.traj, GROUP, self.name, 0, chunk, justid=True)
            except redis.RedisError:
                pass  # transient: retried next period; reclaim_idle_ms leaves slack

    def close(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
            self._keeper = None
        self._link.close()

    def __enter__(self) -> RedisTrajectoryConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
