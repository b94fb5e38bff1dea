"""Crash recovery: a consumer killed mid-batch, a Valkey restart from its append-only file,
reclaiming from a dead consumer while a live slow one keeps its entries."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from areal_hex.buffer import (
    EmbeddedValkey,
    RedisEndpoint,
    RedisTrajectoryConsumer,
    RedisTrajectoryProducer,
    RedisWeightPublisher,
    encode_group,
)
from areal_hex.buffer.keys import BufferKeys
from areal_hex.config.buffer import BufferConfig
from areal_hex.record import Completion, GroupRecord

REPO = Path(__file__).resolve().parents[2]

# A trainer that reads one batch, records what it read, and never acknowledges it.
CRASHING_CONSUMER = textwrap.dedent(
    """
    import sys, time
    import redis
    from areal_hex.buffer import RedisTrajectoryConsumer
    from areal_hex.config.buffer import BufferConfig
    url, run_id, name, out = sys.argv[1:5]
    cfg = BufferConfig(reclaim_idle_ms=int(sys.argv[5]))
    consumer = RedisTrajectoryConsumer(redis.Redis.from_url(url), run_id, cfg, name=name)
    batch = consumer.get_batch(5, timeout_s=20)
    with open(out + ".tmp", "w") as f:
        f.write("\\n".join(g.prompt_id for g in batch.groups))
    import os; os.replace(out + ".tmp", out)
    time.sleep(600)  # "training": killed here, before ack
    """
)


def group(i: int, version: int = 0) -> GroupRecord:
    comp = Completion(np.arange(3), np.full(3, -0.1), np.full(3, version), "stop", 1.0)
    return GroupRecord(f"p{i}", [1], [comp])


def fill(r: object, run_id: str, n: int) -> None:
    for i in range(n):
        r.xadd(BufferKeys(run_id).traj, {b"d": encode_group(group(i))})  # type: ignore[attr-defined]


def train_all(consumer: RedisTrajectoryConsumer, expected: int) -> Counter[str]:
    """Consume and 'commit' (ack) until `expected` groups were trained; count each."""
    trained: Counter[str] = Counter()
    while sum(trained.values()) < expected:
        batch = consumer.get_batch(min(4, expected - sum(trained.values())), timeout_s=10)
        trained.update(g.prompt_id for g in batch.groups)
        consumer.ack(batch.entry_ids)
    with pytest.raises(TimeoutError):  # and nothing comes back after the commit
        consumer.get_batch(1, timeout_s=0.5)
    return trained


def run_crashing_consumer(url: str, run_id: str, name: str, tmp: Path, idle_ms: int) -> list[str]:
    out = tmp / f"{name}.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [url, run_id, name, str(out), str(idle_ms)]
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_CONSUMER, *args], env=env)
    try:
        deadline = time.monotonic() + 30
        while not out.exists():
            assert proc.poll() is None, "consumer process exited early"
            assert time.monotonic() < deadline, "consumer process never read a batch"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    return out.read_text().split("\n")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("same_name", [True, False], ids=["restart-same-name", "reclaim"])
def test_killed_consumer_entries_trained_exactly_once(tmp_path: Path, same_name: bool) -> None:
    run_id = f"k{uuid.uuid4().hex[:8]}"
    with EmbeddedValkey(appendonly=False) as server:
        r = RedisEndpoint(server.url).sync_client()
        fill(r, run_id, 20)
        idle_ms = 300
        read = run_crashing_consumer(server.url, run_id, "trainer-0", tmp_path, idle_ms)
        assert len(read) == 5
        cfg = BufferConfig(reclaim_idle_ms=idle_ms)
        # It read ahead `prefetch` entries: all of them stay pending, none is lost.
        pending = RedisTrajectoryConsumer(r, run_id, cfg, keepalive=False).stats().pending
        assert pending == cfg.prefetch == 16
        name = "trainer-0" if same_name else "trainer-1"
        if not same_name:
            time.sleep(idle_ms / 1000 + 0.2)  # the dead consumer's entries go idle
        consumer = RedisTrajectoryConsumer(r, run_id, cfg, name=name)
        first = consumer.get_batch(5, timeout_s=10)
        # The abandoned entries come first, before any new one.
        assert sorted(g.prompt_id for g in first.groups) == sorted(read)
        consumer.ack(first.entry_ids)
        trained = train_all(consumer, 15)
        trained.update(g.prompt_id for g in first.groups)
        stats = consumer.stats()
        consumer.close()
    assert trained == Counter(f"p{i}" for i in range(20))  # each exactly once
    assert (stats.pending, stats.stream_length) == (0, 0)


@pytest.mark.timeout(90)
def test_live_slow_consumer_keeps_its_entries(tmp_path: Path) -> None:
    run_id = f"s{uuid.uuid4().hex[:8]}"
    # Keepalive every ~0.33 s: slack for a busy machine before entries look idle.
    cfg = BufferConfig(reclaim_idle_ms=1000)
    with EmbeddedValkey(appendonly=False) as server:
        r = RedisEndpoint(server.url).sync_client()
        fill(r, run_id, 4)
        slow = RedisTrajectoryConsumer(r, run_id, cfg, name="trainer-0")
        other = RedisTrajectoryConsumer(r, run_id, cfg, name="trainer-1")
        batch = slow.get_batch(4, timeout_s=5)
        # A step 2.5x longer than reclaim_idle_ms: the keepalive protects the entries.
        with pytest.raises(TimeoutError):
            other.get_batch(1, timeout_s=2.5)
        slow.ack(batch.entry_ids)
        slow.close()
        # Without the keepalive the same situation hands the entries to the other consumer.
        fill(r, run_id, 2)
        careless = RedisTrajectoryConsumer(r, run_id, cfg, name="trainer-2", keepalive=False)
        careless.get_batch(2, timeout_s=5)
        time.sleep(1.3)
        stolen = other.get_batch(2, timeout_s=5)
        assert len(stolen.groups) == 2
        other.close()


@pytest.mark.timeout(90)
def test_valkey_restart_with_append_only_file_loses_nothing(tmp_path: Path) -> None:
    run_id = f"a{uuid.uuid4().hex[:8]}"
    data = tmp_path / "valkey"
    cfg = BufferConfig(groups_per_step=4, prefetch=10)  # read exactly the batch
    server = EmbeddedValkey(data_dir=str(data), appendonly=True, appendfsync="always")
    with server:
        r = RedisEndpoint(server.url).sync_client()
        fill(r, run_id, 30)
        RedisWeightPublisher(r, run_id, cfg).set_version(2, "/w/v2")  # v0 groups still fresh
        r.set(BufferKeys(run_id).submitted, 30)
        consumer = RedisTrajectoryConsumer(r, run_id, cfg, keepalive=False)
        batch = consumer.get_batch(10, timeout_s=5)
        acked = batch.entry_ids[:5]
        consumer.ack(acked)
        consumer.close()
        pairs = list(zip(batch.entry_ids, batch.groups, strict=True))
        held = {g.prompt_id for i, g in pairs if i not in acked}
        done = {g.prompt_id for i, g in pairs if i in acked}
        server.kill()  # crash: only the fsynced append-only file survives
        server.start()  # same port and data directory
        r = RedisEndpoint(server.url).sync_client()
        consumer = RedisTrajectoryConsumer(r, run_id, cfg, keepalive=False)
        stats = consumer.stats()
        assert (stats.stream_length, stats.pending, stats.unconsumed) == (25, 5, 20)
        assert (stats.version, stats.submitted) == (2, 30)
        first = consumer.get_batch(5, timeout_s=5)
        assert {g.prompt_id for g in first.groups} == held  # pending entries come back first
        consumer.ack(first.entry_ids)
        trained = train_all(consumer, 20)
        consumer.close()
    trained.update(g.prompt_id for g in first.groups)
    assert trained == Counter(f"p{i}" for i in range(30) if f"p{i}" not in done)
    assert (data / "appendonlydir").is_dir()


@pytest.mark.timeout(90)
async def test_version_watch_survives_a_server_restart(tmp_path: Path) -> None:
    run_id = f"w{uuid.uuid4().hex[:8]}"
    cfg = BufferConfig()
    server = EmbeddedValkey(data_dir=str(tmp_path / "v"), appendonly=True, appendfsync="always")
    with server:
        ep = RedisEndpoint(server.url)
        producer = RedisTrajectoryProducer(ep.async_client(), run_id, cfg)
        seen: list[int] = []

        async def watch() -> None:
            async for upd in producer.watch_versions(poll_s=0.2):
                seen.append(upd.version)
                if upd.version == 2:
                    return

        task = asyncio.ensure_future(watch())
        deadline = time.monotonic() + 20
        while not seen:  # subscribed: the first item comes after that
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        RedisWeightPublisher(ep.sync_client(), run_id, cfg).set_version(1, "/w/v1")
        while len(seen) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        server.kill()
        await asyncio.sleep(0.5)
        server.start()
        RedisWeightPublisher(ep.sync_client(), run_id, cfg).set_version(2, "/w/v2")
        await asyncio.wait_for(task, 30)
        await producer.aclose()
    assert seen == [0, 1, 2]
