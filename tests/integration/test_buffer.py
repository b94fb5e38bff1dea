"""The trajectory buffer against a real embedded Valkey: delivery, gate, staleness, dead
letters, version notifications."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from areal_hex.buffer import (
    EmbeddedValkey,
    RedisEndpoint,
    RedisTrajectoryConsumer,
    RedisTrajectoryProducer,
    RedisWeightPublisher,
    VersionUpdate,
    encode_group,
    read_stats,
)
from areal_hex.buffer.codec import frame, unframe
from areal_hex.buffer.keys import BufferKeys
from areal_hex.config.buffer import BufferConfig
from areal_hex.record import Completion, GroupRecord

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[RedisEndpoint]:
    with EmbeddedValkey(appendonly=False) as server:
        yield RedisEndpoint(server.url, server=server)


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def group(i: int, version: int = 0, tokens: int = 2) -> GroupRecord:
    comp = Completion(
        np.arange(tokens), np.full(tokens, -0.5), np.full(tokens, version), "stop", float(i)
    )
    return GroupRecord(f"p{i}", [1, 2], [comp])


async def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def cfg(**kw: object) -> BufferConfig:
    base = {"groups_per_step": 4, "max_staleness": 1, "gate_timeout_s": 5.0}
    return BufferConfig(**{**base, **kw})


# ---------------------------------------------------------------- delivery
def test_ten_thousand_groups_round_trip_none_lost(endpoint: RedisEndpoint, run_id: str) -> None:
    total = 10_000
    # Batches of 250; backpressure engages on the way (the gate is kept out of it).
    c = cfg(groups_per_step=250, max_staleness=100, max_pending=500)

    async def produce() -> None:
        p = RedisTrajectoryProducer(endpoint.async_client(), run_id, c)
        for lo in range(0, total, 25):  # admit and put in chunks: fewer round trips
            await p.admit(25)
            await p.put_many([group(i) for i in range(lo, lo + 25)])
        await p.aclose()

    producer = threading.Thread(target=lambda: asyncio.run(produce()))
    producer.start()
    consumer = RedisTrajectoryConsumer(endpoint.sync_client(), run_id, c)
    seen: list[str] = []
    max_backlog = 0
    while len(seen) < total:
        batch = consumer.get_batch(min(250, total - len(seen)), timeout_s=30)
        seen += [g.prompt_id for g in batch.groups]
        max_backlog = max(max_backlog, consumer.stats().stream_length)
        consumer.ack(batch.entry_ids)
    producer.join(30)
    stats = consumer.stats()
    consumer.close()
    assert sorted(seen) == sorted(f"p{i}" for i in range(total))
    assert len(set(seen)) == total
    assert (stats.stream_length, stats.pending, stats.unconsumed) == (0, 0, 0)
    assert stats.submitted == total
    assert int(endpoint.sync_client().get(BufferKeys(run_id).acked)) == total
    assert max_backlog <= 500 + 25  # admits stop once max_pending are in the stream


def test_oldest_first_then_shuffled(endpoint: RedisEndpoint, run_id: str) -> None:
    c = cfg(groups_per_step=100)
    r = endpoint.sync_client()
    keys = BufferKeys(run_id)
    for i in range(12):
        r.xadd(keys.traj, {b"d": encode_group(group(i))})
    consumer = RedisTrajectoryConsumer(r, run_id, c)
    first = consumer.get_batch(6, timeout_s=5)
    second = consumer.get_batch(6, timeout_s=5)
    consumer.close()
    ids = [g.prompt_id for g in first.groups]
    assert sorted(ids) == sorted(f"p{i}" for i in range(6))  # the oldest six
    assert ids != [f"p{i}" for i in range(6)]  # shuffled within the batch (seeded)
    assert sorted(g.prompt_id for g in second.groups) == sorted(f"p{i}" for i in range(6, 12))
    assert consumer.stats().pending == 12  # nothing acknowledged without ack()


# ---------------------------------------------------------------- staleness gate
async def test_gate_blocks_exactly_at_bound_and_releases_on_version_bump(
    endpoint: RedisEndpoint, run_id: str
) -> None:
    # Poll far slower than the test: only the pub/sub notification can wake the gate.
    c = cfg(groups_per_step=4, max_staleness=1, poll_interval_s=30.0, gate_timeout_s=60)
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, c)
    for _ in range(8):  # (v + eta + 1) * B = (0 + 1 + 1) * 4
        await asyncio.wait_for(p.admit(), 2)
    blocked = asyncio.ensure_future(p.admit())
    sync = endpoint.sync_client()
    # Blocked, and listening for version bumps (else only the 30 s poll could wake it).
    await wait_until(lambda: sync.pubsub_numsub(p.keys.weights_channel)[0][1] == 1)
    await asyncio.sleep(0.3)
    assert not blocked.done()
    assert int(await p.r.get(p.keys.submitted)) == 8
    start = time.monotonic()
    RedisWeightPublisher(endpoint.sync_client(), run_id, c).set_version(1, "/w/v1")
    await asyncio.wait_for(blocked, 5)
    assert time.monotonic() - start < 5
    # v=1: bound 12; three more fit, the fourth blocks again.
    for _ in range(3):
        await asyncio.wait_for(p.admit(), 2)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(p.admit(), 0.5)
    assert int(await p.r.get(p.keys.submitted)) == 12
    await p.aclose()


async def test_gate_waits_for_the_servers_to_load_a_published_version(
    endpoint: RedisEndpoint, run_id: str
) -> None:
    # eta = 0 (sync): a group admitted for step 2 while the servers still hold v0 would be
    # generated by v0 and be too stale to train; the gate opens only once v1 is served.
    c = cfg(groups_per_step=2, max_staleness=0, poll_interval_s=30.0, gate_timeout_s=60)
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, c)
    p.set_serving_version(0)
    await asyncio.wait_for(p.admit(2), 2)
    blocked = asyncio.ensure_future(p.admit())
    await asyncio.sleep(0.2)
    RedisWeightPublisher(endpoint.sync_client(), run_id, c).set_version(1, "/w/v1")
    await asyncio.sleep(0.5)
    assert not blocked.done(), "admitted against v1 while the servers serve v0"
    p.set_serving_version(1)  # no publish follows: this alone must wake the waiter
    await asyncio.wait_for(blocked, 5)
    await asyncio.wait_for(p.admit(), 2)
    assert int(await p.r.get(p.keys.submitted)) == 4
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(p.admit(), 0.3)
    await p.aclose()


async def test_concurrent_admits_never_overshoot(endpoint: RedisEndpoint, run_id: str) -> None:
    c = cfg(groups_per_step=3, max_staleness=0, gate_timeout_s=1.0)
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, c)
    results = await asyncio.gather(*(p.admit() for _ in range(10)), return_exceptions=True)
    assert sum(r is None for r in results) == 3
    assert sum(isinstance(r, TimeoutError) for r in results) == 7
    assert int(await p.r.get(p.keys.submitted)) == 3
    await p.aclose()


async def test_gate_timeout_names_the_bound(endpoint: RedisEndpoint, run_id: str) -> None:
    c = cfg(groups_per_step=2, max_staleness=1, gate_timeout_s=0.3)
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, c)
    await p.admit(4)
    with pytest.raises(TimeoutError) as err:
        await p.admit()
    msg = str(err.value)
    for part in ("submitted=4", "v=0", "eta=1", "B=2", "(0 + 1 + 1) * 2 = 4", "0.3 s"):
        assert part in msg, msg
    assert await p.release(1) == 3  # a failed prompt gives its admission back
    await asyncio.wait_for(p.admit(), 1)
    await p.aclose()


async def test_backpressure_waits_for_acks(endpoint: RedisEndpoint, run_id: str) -> None:
    c = cfg(groups_per_step=3, max_pending=3, poll_interval_s=0.05, gate_timeout_s=0.4)
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, c)
    for i in range(3):
        await p.admit()
        await p.put(group(i))
    with pytest.raises(TimeoutError, match="backpressure: 3 groups .*max_pending=3"):
        await p.admit()
    consumer = RedisTrajectoryConsumer(endpoint.sync_client(), run_id, c)
    batch = consumer.get_batch(2, timeout_s=2)
    await asyncio.sleep(0.2)
    with pytest.raises(TimeoutError):  # read but not acknowledged: still counted
        await p.admit()
    consumer.ack(batch.entry_ids)
    await asyncio.wait_for(p.admit(), 2)
    consumer.close()
    await p.aclose()


# ---------------------------------------------------------------- staleness on consume
def test_stale_groups_dropped_and_counted(endpoint: RedisEndpoint, run_id: str) -> None:
    c = cfg(max_staleness=1)
    r = endpoint.sync_client()
    for i, version in enumerate([0, 1, 2, 3, 0, 3]):
        r.xadd(BufferKeys(run_id).traj, {b"d": encode_group(group(i, version))})
    r.set(BufferKeys(run_id).submitted, 6)  # the six groups put
    RedisWeightPublisher(r, run_id, c).set_version(3, "/w/v3")
    consumer = RedisTrajectoryConsumer(r, run_id, c)
    batch = consumer.get_batch(3, timeout_s=5)  # v - eta = 2: versions 0, 1, 0 go
    assert sorted(g.prompt_id for g in batch.groups) == ["p2", "p3", "p5"]
    assert sorted(batch.version_lags) == [0, 0, 1]
    assert batch.groups_dropped_stale == 3
    consumer.ack(batch.entry_ids)
    stats = consumer.stats()
    consumer.close()
    assert (stats.groups_dropped_stale, stats.stream_length, stats.pending) == (3, 0, 0)
    assert stats.submitted == 3  # the dropped groups' admissions went back to the gate


def test_staleness_counts_from_the_weights_that_train(endpoint: RedisEndpoint, run_id: str) -> None:
    # the trainer holds v3 while its publication is still being written: v2 is announced
    c = cfg(max_staleness=1)
    r = endpoint.sync_client()
    for i, version in enumerate([1, 2, 3, 1]):
        r.xadd(BufferKeys(run_id).traj, {b"d": encode_group(group(i, version))})
    r.set(BufferKeys(run_id).submitted, 4)
    RedisWeightPublisher(r, run_id, c).set_version(2, "/w/v2")
    consumer = RedisTrajectoryConsumer(r, run_id, c)
    batch = consumer.get_batch(2, timeout_s=5, version=3)  # 3 - eta = 2: versions 1 go
    assert sorted(g.prompt_id for g in batch.groups) == ["p1", "p2"]
    assert sorted(batch.version_lags) == [0, 1]
    assert batch.groups_dropped_stale == 2
    consumer.close()


# ---------------------------------------------------------------- dead letters
def _malformed(kind: str, i: int) -> dict[bytes, bytes]:
    good = encode_group(group(i))
    header, data = unframe(good)
    arrays = bytes(data)
    if kind == "truncated":
        return {b"d": good[: len(good) - 5]}
    if kind == "garbage":
        return {b"d": b"\xc1" + bytes([i % 256]) * 5}
    if kind == "no_payload":
        return {b"x": b"1"}
    if kind == "schema":
        header["schema"] = 99
    elif kind == "dtype":
        header["arrays"][1][1] = "<f4"  # tokens declared as float32
    elif kind == "lengths":
        header["lens"] = [3]
    return {b"d": frame(header, [arrays])}


DEAD_KINDS = {
    "truncated": "truncated: arrays declare",
    "garbage": "header",
    "no_payload": "no payload field",
    "schema": "schema: version 99 not supported",
    "dtype": "tokens: dtype '<f4', expected '<i4'",
    "lengths": "sum to 3",
}


def test_malformed_entries_go_to_dead_letter(endpoint: RedisEndpoint, run_id: str) -> None:
    r = endpoint.sync_client()
    keys = BufferKeys(run_id)
    sent: dict[str, str] = {}  # entry id -> kind
    good = 0
    for i in range(100):
        for kind in DEAD_KINDS:
            sent[r.xadd(keys.traj, _malformed(kind, i)).decode()] = kind
        if i % 2 == 1:  # good groups in between, the last entry is a good one
            r.xadd(keys.traj, {b"d": encode_group(group(i))})
            good += 1
    consumer = RedisTrajectoryConsumer(r, run_id, cfg())
    got: list[str] = []
    dead = 0
    while len(got) < good:
        batch = consumer.get_batch(10, timeout_s=5)
        got += [g.prompt_id for g in batch.groups]
        dead += batch.dead_lettered
        consumer.ack(batch.entry_ids)
    stats = consumer.stats()
    consumer.close()
    assert sorted(got) == sorted(f"p{i}" for i in range(1, 100, 2))
    assert dead == stats.dead_letter == r.xlen(keys.dead) == 600
    assert (stats.stream_length, stats.pending) == (0, 0)
    for _, fields in r.xrange(keys.dead):
        kind = sent[fields[b"source_id"].decode()]
        assert DEAD_KINDS[kind] in fields[b"reason"].decode(), (kind, fields[b"reason"])
        if kind == "truncated":
            assert len(fields[b"payload"]) > 0


def test_large_entries_decode_read_only_and_dead_letter_whole(
    endpoint: RedisEndpoint, run_id: str
) -> None:
    """Payloads of 100 kB, received into buffers of their own: a good one decodes into
    read-only arrays, a malformed one reaches the dead-letter stream byte for byte."""
    r = endpoint.sync_client()
    keys = BufferKeys(run_id)
    good = group(1, tokens=8_000)
    bad = encode_group(group(2, tokens=8_000))[:-5]  # truncated
    r.xadd(keys.traj, {b"d": bad})
    r.xadd(keys.traj, {b"d": encode_group(good)})
    consumer = RedisTrajectoryConsumer(r, run_id, cfg())
    batch = consumer.get_batch(1, timeout_s=5)
    consumer.ack(batch.entry_ids)
    consumer.close()
    (got,) = batch.groups
    assert batch.dead_lettered == 1 and got.prompt_id == "p1"
    tokens = got.completions[0].token_ids
    assert not tokens.flags.writeable and np.array_equal(tokens, np.arange(8_000))
    ((_, fields),) = r.xrange(keys.dead)
    assert fields[b"payload"] == bad


# ---------------------------------------------------------------- versions
async def test_watch_versions_yields_current_then_updates(
    endpoint: RedisEndpoint, run_id: str
) -> None:
    c = cfg()
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, c)
    pub = RedisWeightPublisher(endpoint.sync_client(), run_id, c)
    pub.set_version(2, "/w/v2")
    seen: list[VersionUpdate] = []

    async def watch() -> None:
        async for upd in p.watch_versions(poll_s=30.0):
            seen.append(upd)
            if upd.version == 4:
                return

    task = asyncio.ensure_future(watch())
    await wait_until(lambda: len(seen) >= 1)  # subscribed: the first item comes after that
    pub.set_version(3, "/w/v3")
    await asyncio.sleep(0.1)
    pub.set_version(4, "/w/v4")
    await asyncio.wait_for(task, 5)
    assert seen == [VersionUpdate(2, "/w/v2"), VersionUpdate(3, "/w/v3"), VersionUpdate(4, "/w/v4")]
    assert await p.version() == 4
    await p.aclose()


def test_restore_recounts_admissions_from_durable_state(
    endpoint: RedisEndpoint, run_id: str
) -> None:
    r, keys = endpoint.sync_client(), BufferKeys(run_id)
    pub = RedisWeightPublisher(r, run_id, cfg(groups_per_step=4))
    assert pub.restore(5, "/w/v5", position=23) == 20  # fresh Redis: submitted = v * B
    assert int(r.get(keys.admitted)) == 23  # the data position comes back from the checkpoint
    # 25 acked, 2 dropped (handed back), 1 dead-lettered, 3 in the stream, 2 held by a
    # live producer
    r.mset({keys.acked: 25, keys.groups_dropped_stale: 2, keys.dead_count: 1})
    for _ in range(3):
        r.xadd(keys.traj, {b"d": b"x"})
    r.hset(keys.leases, mapping={"alive": 2, "dead": 5})
    r.set(keys.lease("alive"), 1)
    r.set(keys.submitted, 45)  # 5 more than that: leaked by the dead holder
    assert pub.restore(6, "/w/v6") == 25 + 1 + 3 + 2
    assert r.hgetall(keys.leases) == {b"alive": b"2"}
    assert int(r.get(keys.given_back("reclaimed"))) == 5
    assert int(r.get(keys.version)) == 6
    assert int(r.get(keys.admitted)) == 23  # never lowered


def test_password_from_config(tmp_path: object) -> None:
    with EmbeddedValkey(appendonly=False, password="s3cret") as server:
        bare = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises(redis.AuthenticationError):
            RedisEndpoint(bare).sync_client().ping()
        assert RedisEndpoint(bare, password="s3cret").sync_client().ping()
        assert RedisEndpoint(server.url).sync_client().ping()  # password in the URL


def test_consumer_survives_a_wiped_server(endpoint: RedisEndpoint, run_id: str) -> None:
    r = endpoint.sync_client()
    keys = BufferKeys(run_id)
    consumer = RedisTrajectoryConsumer(r, run_id, cfg())
    r.delete(keys.traj)  # stream and group gone, as after a restart without persistence
    with pytest.raises(TimeoutError):
        consumer.get_batch(1, timeout_s=0.3)
    r.xadd(keys.traj, {b"d": encode_group(group(1))})
    batch = consumer.get_batch(1, timeout_s=5)
    consumer.close()
    assert [g.prompt_id for g in batch.groups] == ["p1"]


def test_stats_of_an_unknown_run_creates_nothing(endpoint: RedisEndpoint, run_id: str) -> None:
    r = endpoint.sync_client()
    stats = read_stats(r, BufferKeys(run_id))
    assert (stats.stream_length, stats.pending, stats.version) == (0, 0, 0)
    assert r.keys(f"{run_id}:*") == []


def test_config_needs_room_for_a_batch() -> None:
    with pytest.raises(ValueError, match=r"max_pending \(4\) must be at least groups_per_step"):
        BufferConfig(groups_per_step=8, max_pending=4)
