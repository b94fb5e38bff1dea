"""Valkey killed and restarted on its append-only file: the trainer's buffer source and
the producer reconnect (with backoff) instead of failing, and nothing put or acknowledged
before the kill is lost."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from areal_hex.buffer import EmbeddedValkey, RedisTrajectoryProducer
from areal_hex.buffer.embedded import RedisEndpoint
from areal_hex.buffer.keys import BufferKeys
from areal_hex.config import BufferConfig, RedisConfig
from areal_hex.record import Completion, GroupRecord
from trainer_service.sources import BufferSource

pytestmark = pytest.mark.timeout(120)


def _group() -> GroupRecord:
    comp = Completion(np.arange(2), np.zeros(2), np.zeros(2, dtype=int), "stop", 1.0)
    return GroupRecord("p", [1], [comp])


def _restart_later(server: EmbeddedValkey, after_s: float) -> threading.Thread:
    def restart() -> None:
        time.sleep(after_s)
        server.start()  # same port, same data directory: the append-only file is replayed

    t = threading.Thread(target=restart)
    t.start()
    return t


def test_services_reconnect_after_a_valkey_restart(tmp_path: Path) -> None:
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = BufferConfig(groups_per_step=2, max_staleness=4, gate_timeout_s=30)
    server = EmbeddedValkey(data_dir=str(tmp_path / "valkey"), appendfsync="always").start()
    endpoint = RedisEndpoint(server.url)

    async def produce(n: int) -> None:
        p = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
        for _ in range(n):
            await p.admit()
            await p.put(_group())
        await p.aclose()

    source = BufferSource(RedisConfig(url=server.url), cfg, run_id, retry_s=30)
    try:
        asyncio.run(produce(4))
        first = source.get_batch(2, timeout_s=5)
        source.ack(first.entry_ids)

        server.kill()  # SIGKILL: only the append-only file survives
        restart = _restart_later(server, 1.5)
        t0 = time.monotonic()
        second = source.get_batch(2, timeout_s=5)  # retried until Valkey is back
        assert time.monotonic() - t0 >= 1.0
        restart.join()
        source.ack(second.entry_ids)

        keys, r = BufferKeys(run_id), endpoint.sync_client()
        assert int(r.get(keys.acked)) == 4  # the ack before the kill survived it
        assert int(r.get(keys.admitted)) == 4 and r.xlen(keys.traj) == 0
        assert set(first.entry_ids).isdisjoint(second.entry_ids)

        server.kill()
        restart = _restart_later(server, 1.0)
        source.set_version(1, "/w/v1")  # published while Valkey is down: retried until back
        restart.join()
        asyncio.run(produce(2))
        assert int(r.get(keys.admitted)) == 6 and int(r.get(keys.version)) == 1
    finally:
        source.close()
        server.stop()


def test_the_ledger_reads_a_stopped_valkeys_append_only_file(tmp_path: Path) -> None:
    from areal_hex.run_files import RunPaths
    from hexctl.report.ledger import ledger_from_aof

    run_id = "r"
    keys = BufferKeys(run_id)
    with EmbeddedValkey(data_dir=str(tmp_path / "valkey"), appendfsync="always") as server:
        r = RedisEndpoint(server.url).sync_client()
        r.mset({keys.admitted: 7, keys.acked: 4, keys.given_back("reclaimed"): 2})
        r.xadd(keys.traj, {b"d": b"x"})
    before = sorted(p.name for p in (tmp_path / "valkey").rglob("*"))
    out = ledger_from_aof(tmp_path / "valkey", run_id, RunPaths.at(tmp_path))
    # no checkpoint: nothing counts as trained, so the 4 acked groups are unaccounted
    assert (out["groups_admitted"], out["groups_reclaimed"], out["groups_pending"]) == (7, 2, 1)
    assert out["groups_lost"] == 4
    assert sorted(p.name for p in (tmp_path / "valkey").rglob("*")) == before  # untouched
