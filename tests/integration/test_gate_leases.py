"""The staleness gate cannot leak: admissions held by a producer that dies (SIGKILL) go
back to the gate once its lease expires, so crash after crash never deadlocks the run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from areal_hex.buffer import EmbeddedValkey, RedisEndpoint, RedisTrajectoryProducer
from areal_hex.buffer.keys import BufferKeys
from areal_hex.config.buffer import BufferConfig

pytestmark = pytest.mark.timeout(120)

B, ETA, TTL_S = 4, 1, 0.5  # the gate's bound at version 0: (0 + 1 + 1) * 4 = 8

# A producer that admits `n` groups, puts one and dies holding the rest.
CHILD = """
import asyncio, json, sys
import numpy as np
import redis.asyncio
from areal_hex.buffer import RedisTrajectoryProducer
from areal_hex.config.buffer import BufferConfig
from areal_hex.record import Completion, GroupRecord

url, run_id, n, cfg = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])

async def main() -> None:
    p = RedisTrajectoryProducer(redis.asyncio.Redis.from_url(url), run_id, BufferConfig(**cfg))
    for _ in range(n):
        await p.admit()
    comp = Completion(np.arange(2), np.zeros(2), np.zeros(2, dtype=int), "stop", 1.0)
    await p.put(GroupRecord("p", [1], [comp]))
    print("holding", await p.held(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def endpoint() -> Iterator[RedisEndpoint]:
    with EmbeddedValkey(appendonly=False) as server:
        yield RedisEndpoint(server.url, server=server)


def _cfg() -> dict[str, object]:
    return {
        "groups_per_step": B,
        "max_staleness": ETA,
        "gate_timeout_s": 10.0,
        "lease_ttl_s": TTL_S,
    }


def _crash_holding(endpoint: RedisEndpoint, run_id: str, n: int) -> int:
    """Run a producer that admits `n`, puts 1, then SIGKILL it; returns what it held."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, endpoint.url, run_id, str(n), json.dumps(_cfg())],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("holding"), f"producer did not get its admissions: {line!r}"
        return int(line.split()[1])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


async def test_three_crashes_in_a_row_leak_nothing(endpoint: RedisEndpoint) -> None:
    run_id = f"t{uuid.uuid4().hex[:10]}"
    keys, r = BufferKeys(run_id), endpoint.sync_client()
    # Without reclaiming, 4 + 3 + 4 = 11 admissions held by the dead exceed the bound of 8:
    # the second or third start would wait forever.
    held = [_crash_holding(endpoint, run_id, n) for n in (5, 4, 5)]
    assert held == [4, 3, 4]

    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, BufferConfig(**_cfg()))
    try:
        for _ in range(8 - 3):  # three groups were put; the rest of the bound is free again
            await p.admit()
        # admitted - (in the stream + held by a live producer) = 0
        assert int(r.get(keys.submitted)) == r.xlen(keys.traj) + await p.held() == 8
        assert r.hkeys(keys.leases) == [p.holder.encode()]
        p.cfg = p.cfg.model_copy(update={"gate_timeout_s": 1.0})
        with pytest.raises(TimeoutError, match="submitted=8"):  # and the bound still holds
            await p.admit()
    finally:
        await p.aclose()


async def test_a_live_producers_admissions_are_not_reclaimed(endpoint: RedisEndpoint) -> None:
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = BufferConfig(**_cfg())
    a = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
    b = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
    try:
        for _ in range(3):
            await a.admit()
        await asyncio.sleep(3 * TTL_S)  # a's heartbeat keeps its lease across several TTLs
        await b.admit()
        assert (await a.held(), await b.held()) == (3, 1)
        assert int(endpoint.sync_client().get(BufferKeys(run_id).submitted)) == 4
        assert await a.release(2) == 2 and await a.held() == 1
    finally:
        await a.aclose()
        await b.aclose()
