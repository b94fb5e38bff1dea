"""The gate's ledger holds after any sequence of crashes: every admission ever made is
acked, dropped, dead-lettered, in the stream, given back (filtered, failed, abandoned,
reclaimed from a dead producer) or held by a producer; and a resume recounts the gate
from that durable state alone."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hex.buffer import (
    EmbeddedValkey,
    RedisEndpoint,
    RedisTrajectoryConsumer,
    RedisTrajectoryProducer,
    RedisWeightPublisher,
)
from areal_hex.buffer.keys import GIVE_BACK_REASONS, BufferKeys
from areal_hex.config.buffer import BufferConfig
from areal_hex.record import Completion, GroupRecord

pytestmark = pytest.mark.timeout(300)

OPS = [
    "admit",
    "put",
    "filtered",
    "failed",
    "abandoned",
    "controller_crash",
    "controller_stop",
    "train",
    "train_no_ack",
    "trainer_crash",
    "publish",
    "resume",
]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[RedisEndpoint]:
    with EmbeddedValkey(appendonly=False) as server:
        yield RedisEndpoint(server.url, server=server)


def _group(version: int) -> GroupRecord:
    comp = Completion(np.arange(2), np.zeros(2), np.full(2, version), "stop", 1.0)
    return GroupRecord("p", [1], [comp])


def ledger(r: object, keys: BufferKeys) -> dict[str, int]:
    def get(key: str) -> int:
        return int(r.get(key) or 0)  # type: ignore[attr-defined]

    out = {
        "admitted": get(keys.admitted),
        "acked": get(keys.acked),
        "dropped": get(keys.groups_dropped_stale),
        "dead": get(keys.dead_count),
        "in_stream": int(r.xlen(keys.traj)),  # type: ignore[attr-defined]
        "held": sum(int(v) for v in r.hvals(keys.leases)),  # type: ignore[attr-defined]
        "submitted": get(keys.submitted),
    }
    out.update({f"given_back_{x}": get(keys.given_back(x)) for x in GIVE_BACK_REASONS})
    return out


def unaccounted(led: dict[str, int]) -> int:
    """admitted - (acked + dropped + dead + in the stream + given back + held)."""
    parts = ["acked", "dropped", "dead", "in_stream", "held"]
    parts += [f"given_back_{x}" for x in GIVE_BACK_REASONS]
    return led["admitted"] - sum(led[p] for p in parts)


async def _play(endpoint: RedisEndpoint, ops: list[str]) -> None:
    run_id = f"t{uuid.uuid4().hex[:10]}"
    keys = BufferKeys(run_id)
    # eta 0: a publish makes every group in the stream stale (dropped when read)
    cfg = BufferConfig(groups_per_step=3, max_staleness=0, gate_timeout_s=0.01, lease_ttl_s=60)
    r = endpoint.sync_client()
    client = endpoint.async_client()
    pub = RedisWeightPublisher(r, run_id, cfg)
    producer = RedisTrajectoryProducer(client, run_id, cfg)
    consumer = RedisTrajectoryConsumer(r, run_id, cfg, keepalive=False)
    version = committed = 0
    lift = 0  # a resume may lift the gate's count to version x B, above what is backed
    try:
        for op in ops:
            held = await producer.held()
            if op == "admit":
                try:
                    await producer.admit()
                except TimeoutError:
                    pass  # the gate or backpressure said no: nothing counted
            elif op == "put" and held:
                await producer.put(_group(version))
            elif op in ("filtered", "failed", "abandoned") and held:
                await producer.release(1, op)  # type: ignore[arg-type]
            elif op == "controller_crash":
                # SIGKILL: the heartbeat stops and the lease key expires (deleted here)
                await producer.aclose()
                r.delete(keys.lease(producer.holder))
                producer = RedisTrajectoryProducer(client, run_id, cfg)
                await producer.position()  # a new controller starts: reclaims the dead one's
            elif op == "controller_stop":
                await producer.give_back_all()
                await producer.aclose()
                producer = RedisTrajectoryProducer(client, run_id, cfg)
            elif op in ("train", "train_no_ack"):
                try:
                    batch = consumer.get_batch(1, timeout_s=0.01)
                except TimeoutError:
                    continue
                if op == "train":
                    consumer.ack(batch.entry_ids)
            elif op == "trainer_crash":  # its pending entries are redelivered to the next
                consumer.close()
                consumer = RedisTrajectoryConsumer(r, run_id, cfg, keepalive=False)
            elif op == "publish":
                version += 1
                pub.set_version(version, f"/w/v{version}")
                committed = version if version % 2 == 0 else committed
            elif op == "resume":  # a trainer restored from its last checkpoint
                version = committed
                count = pub.restore(version, f"/w/v{version}")
                led = ledger(r, keys)
                recount = led["acked"] + led["dead"] + led["in_stream"]
                assert count == max(recount + led["held"], version * cfg.groups_per_step)
                lift = count - recount - led["held"]
            led = ledger(r, keys)
            assert unaccounted(led) == 0, (op, led)
            put_counted = led["acked"] + led["dead"] + led["in_stream"]  # dropped: handed back
            assert led["submitted"] == put_counted + led["held"] + lift, (op, lift, led)
    finally:
        consumer.close()
        await producer.aclose()
        await client.aclose()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=40))
def test_every_admission_is_accounted_for_after_any_crashes(
    endpoint: RedisEndpoint, ops: list[str]
) -> None:
    asyncio.run(_play(endpoint, ops))


def test_a_chosen_crash_sequence(endpoint: RedisEndpoint) -> None:
    """One sequence with every kind of event, so the property is never vacuous."""
    ops = ["admit"] * 4 + ["put", "put", "filtered", "controller_crash"]
    ops += ["admit", "admit", "put", "train_no_ack", "trainer_crash", "train", "publish"]
    ops += ["admit", "put", "train", "resume", "admit", "abandoned", "controller_stop"]
    asyncio.run(_play(endpoint, ops))


async def test_a_retried_put_appends_its_group_once(endpoint: RedisEndpoint) -> None:
    """A put whose reply was lost (Valkey restarting) is retried: with the group's put
    token, the retry returns the first entry id and ends no second admission."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    keys, r = BufferKeys(run_id), endpoint.sync_client()
    cfg = BufferConfig(groups_per_step=4, max_staleness=0)
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
    try:
        await p.admit(2)
        group = _group(0)
        group.metadata["put_token"] = "ctl-7"
        first = await p.put(group)
        assert await p.put(group) == first
        assert r.xlen(keys.traj) == 1 and await p.held() == 1
        assert unaccounted(ledger(r, keys)) == 0
        untokened = _group(0)
        assert await p.put(untokened) != await p.put(untokened)  # no token: each call appends
    finally:
        await p.aclose()


async def test_a_put_without_a_token_records_its_own_and_ends_one_admission(
    endpoint: RedisEndpoint,
) -> None:
    """No caller's token: the put leaves `<holder>-<seq>` (for the run ledger), answers
    XADD's own entry id, and ends exactly one admission of the lease."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    keys, r = BufferKeys(run_id), endpoint.sync_client()
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, BufferConfig(groups_per_step=4))
    try:
        await p.admit(3)
        ids = [await p.put(_group(0)) for _ in range(2)]
        assert [e.decode() for e, _ in r.xrange(keys.traj)] == ids
        assert await p.held() == 1
        names = sorted(k.decode() for k in r.scan_iter(match=keys.put_token("*")))
        assert names == [keys.put_token(f"{p.holder}-{i}") for i in range(2)]
        assert r.get(names[0]) == b"1" and 0 < r.ttl(names[0]) <= 86_400
        await p.put(_group(0))
        await p.put(_group(0))  # more puts than admissions: the lease stays at zero
        assert await p.held() == 0 and r.hget(keys.leases, p.holder) is None
    finally:
        await p.aclose()


@pytest.mark.parametrize("token", [None, "ctl-1"])
async def test_a_put_that_cannot_append_keeps_its_admission(
    endpoint: RedisEndpoint, token: str | None
) -> None:
    """The XADD fails when run (the stream's key holds a string): the script after it
    fails too, so the lease still holds the admission and no token is recorded."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    keys, r = BufferKeys(run_id), endpoint.sync_client()
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, BufferConfig(groups_per_step=4))
    try:
        await p.admit(1)
        r.delete(keys.traj)
        r.set(keys.traj, "not a stream")
        group = _group(0)
        if token:
            group.metadata["put_token"] = token
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await p.put(group)
        assert await p.held() == 1
        assert list(r.scan_iter(match=keys.put_token("*"))) == []
    finally:
        await p.aclose()


def test_a_prompt_put_by_two_controllers_is_counted_produced_twice(
    endpoint: RedisEndpoint,
) -> None:
    """Each put leaves a token `<controller>-<seq>`: two controllers producing the same
    data position (as a resumed run beside a surviving one would) show up in the ledger."""
    from hexctl.report.ledger import produced_twice

    keys = BufferKeys(f"twice-{uuid.uuid4().hex[:6]}")
    r = endpoint.sync_client()
    for token in ("aaaa-0", "aaaa-1", "bbbb-2", "bbbb-3"):
        r.set(keys.put_token(token), 1)
    assert produced_twice(r, keys) == 0
    r.set(keys.put_token("cccc-1"), 1)  # a second controller made prompt 1 again
    assert produced_twice(r, keys) == 1
