"""On a real Valkey: a trainer restarted with no checkpoint rejoins the run at version 0
(the groups of the versions it lost are dropped, counted and owed to the controller,
never trained into the fresh model), and one Valkey serves a data directory at a time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from areal_hex.buffer import EmbeddedValkey, RedisTrajectoryProducer, RedisWeightPublisher
from areal_hex.buffer.embedded import EmbeddedServerError, RedisEndpoint
from areal_hex.buffer.keys import BufferKeys
from areal_hex.config import BufferConfig, RedisConfig, TrainerConfig
from areal_hex.config.algo import AlgoConfig
from areal_hex.record import Completion, GroupRecord
from areal_hex.run_files import RunPaths
from hexctl.report.ledger import read_ledger
from trainer_service.loop import Trainer, TrainerPaths
from trainer_service.sources import BufferSource

pytestmark = pytest.mark.timeout(120)


def _group(i: int, version: int) -> GroupRecord:
    comp = Completion(np.arange(2), np.zeros(2), np.full(2, version), "stop", 1.0)
    return GroupRecord(f"p{i}", [1], [comp])


def _trainer(run: Path, source: BufferSource) -> Trainer:
    """The real loop around the buffer; no engine is needed to rejoin at version 0 (its
    weights are the initial model directory, already there)."""
    model = run / "weights" / "v0"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    paths = TrainerPaths(model, run, run / "weights", run / "checkpoints")
    ctx = SimpleNamespace(rank=0, engine=None, before_update=None)
    cfg = TrainerConfig(total_steps=10, batch_timeout_s=5)
    return Trainer(cfg, AlgoConfig(), paths, ctx, 2, source)  # type: ignore[arg-type]


def test_a_trainer_restarted_without_a_checkpoint_rejoins_at_v0(tmp_path: Path) -> None:
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = BufferConfig(groups_per_step=2, max_staleness=1, gate_timeout_s=5)
    with EmbeddedValkey(appendonly=False) as server:
        endpoint = RedisEndpoint(server.url)
        r = endpoint.sync_client()
        keys = BufferKeys(run_id)
        first = BufferSource(RedisConfig(url=server.url), cfg, run_id, retry_s=5)

        async def produce(versions: list[int], first_index: int) -> None:
            p = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
            for i, v in enumerate(versions, start=first_index):
                p.set_serving_version(v)
                await p.admit()
                await p.put(_group(i, v))
            await p.aclose()

        # the first trainer trained 3 steps (publishing v1..v3) and died before any
        # checkpoint: its 6 groups are pending, 2 more wait in the stream
        for v in range(4):
            first.set_version(v, f"/w/v{v}")
            asyncio.run(produce([v, v], first_index=2 * v))
            if v < 3:
                assert len(first.get_batch(2, timeout_s=5).groups) == 2
        first.close()
        assert int(r.get(keys.version)) == 3

        restarted = BufferSource(RedisConfig(url=server.url), cfg, run_id, retry_s=5)
        trainer = _trainer(tmp_path, restarted)
        trainer.resume()
        assert int(r.get(keys.version)) == 0  # the servers are told to reload v0
        assert r.get(keys.weights_path).decode() == str(tmp_path / "weights" / "v0")
        batch = trainer._take(2)
        assert batch is not None
        assert sorted(g.prompt_id for g in batch.groups) == ["p0", "p1"]  # made by v0
        assert batch.version_lags == [0, 0]  # nothing from the lost versions, no negative lag
        # the next batch: the v3 groups still unread are dropped too, which opens the
        # gate (at v0 it counts (0 + 1 + 1) x 2) for the controller's groups made by v0
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(trainer._take, 2)
            asyncio.run(produce([0, 0], first_index=8))
            batch = second.result(timeout=30)
        assert batch is not None and sorted(g.prompt_id for g in batch.groups) == ["p8", "p9"]
        assert int(r.get(keys.groups_dropped_stale)) == 6  # v1..v3: counted and handed back
        owed = asyncio.run(_position(endpoint, run_id, cfg))
        assert owed == 6  # the controller makes as many again
        led = read_ledger(r, run_id, RunPaths.at(tmp_path))
        assert led["groups_lost"] == 0 and led["groups_dropped_stale"] == 6
        assert led["groups_pending"] == 4  # trained since no checkpoint: to be trained again
        restarted.close()
        r.close()


async def _position(endpoint: RedisEndpoint, run_id: str, cfg: BufferConfig) -> int:
    p = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
    try:
        return (await p.position()).owed
    finally:
        await p.aclose()


def test_batch_timeout_says_what_is_missing(tmp_path: Path) -> None:
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = BufferConfig(groups_per_step=2, max_staleness=1)
    with EmbeddedValkey(appendonly=False) as server:
        source = BufferSource(RedisConfig(url=server.url), cfg, run_id, retry_s=5)
        trainer = _trainer(tmp_path, source)
        trainer.cfg.batch_timeout_s = 1.0
        with pytest.raises(TimeoutError) as err:
            trainer._take(2)
        source.close()
    msg = str(err.value)
    assert "no batch for step 1 after 1 s (trainer.batch_timeout_s)" in msg
    assert "0 of 2 fresh groups" in msg and "0 unread in the stream" in msg
    assert "the gate counts 0 of 4 admissions" in msg


# A process that starts Valkey on a directory and dies at once, leaving the server.
ORPHANING = textwrap.dedent(
    """
    import os, sys
    from areal_hex.buffer import EmbeddedValkey
    s = EmbeddedValkey(data_dir=sys.argv[1], die_with_parent=False).start()
    print(s.pid, flush=True)
    os._exit(0)
    """
)


def test_one_valkey_per_data_directory(tmp_path: Path) -> None:
    data = tmp_path / "valkey"
    with EmbeddedValkey(data_dir=str(data)) as first:
        second = EmbeddedValkey(data_dir=str(data))
        with pytest.raises(EmbeddedServerError, match=f"pid {os.getpid()}, valkey-server"):
            second.start(timeout_s=0.5)
        assert first.running()
    # the first stopped: the directory is free again
    with EmbeddedValkey(data_dir=str(data)) as again:
        assert again.running()
    # a server left behind by a dead owner still holds the directory
    out = subprocess.run(
        [sys.executable, "-c", ORPHANING, str(data)], capture_output=True, text=True, check=True
    )
    orphan = int(out.stdout.strip())
    try:
        with pytest.raises(EmbeddedServerError, match=f"valkey-server {orphan}"):
            EmbeddedValkey(data_dir=str(data)).start(timeout_s=0.5)
    finally:
        os.kill(orphan, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:  # the lock goes with the server
        try:
            with EmbeddedValkey(data_dir=str(data)) as last:
                assert last.running()
            break
        except EmbeddedServerError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_controllers_follow_a_restore_to_a_lower_version() -> None:
    """A restore starts a new lineage: its version is followed though lower than what was
    published before, and a late message of the old lineage is not."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = BufferConfig(groups_per_step=2)
    with EmbeddedValkey(appendonly=False) as server:
        endpoint = RedisEndpoint(server.url)
        old = RedisWeightPublisher(endpoint.sync_client(), run_id, cfg)
        old.set_version(3, "/w/v3")

        async def follow() -> list[tuple[int, int]]:
            p = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
            seen: list[tuple[int, int]] = []
            try:
                async for upd in p.watch_versions(poll_s=0.1):
                    seen.append((upd.lineage, upd.version))
                    if len(seen) == 1:  # the restored trainer: back to v0
                        new = RedisWeightPublisher(endpoint.sync_client(), run_id, cfg)
                        new.restore(0, "/w/v0")
                        new.set_version(0, "/w/v0")
                    if len(seen) == 2:
                        # a message of the dead trainer's, delivered late, then v1
                        late = {"version": 4, "path": "/w/v4", "lineage": old.lineage}
                        old.r.publish(BufferKeys(run_id).weights_channel, json.dumps(late))
                        new.set_version(1, "/w/v1")
                    if len(seen) == 3:
                        return seen
            finally:
                await p.aclose()
            return seen

        assert asyncio.run(asyncio.wait_for(follow(), 20)) == [(0, 3), (1, 0), (1, 1)]


def test_before_any_restore_a_version_ahead_of_the_buffer_is_kept() -> None:
    """With no restore yet, versions may be the servers' own numbering (a profile's load
    reloads them to v1000+ while the buffer stays at 0): nothing is dropped as ahead."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    cfg = BufferConfig(groups_per_step=2, max_staleness=1)
    with EmbeddedValkey(appendonly=False) as server:
        endpoint = RedisEndpoint(server.url)

        async def produce() -> None:
            p = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg)
            for i in range(2):
                await p.admit()
                await p.put(_group(i, 1001))
            await p.aclose()

        asyncio.run(produce())
        source = BufferSource(RedisConfig(url=server.url), cfg, run_id, retry_s=5)
        try:
            assert len(source.get_batch(2, timeout_s=5).groups) == 2
            assert (
                int(endpoint.sync_client().get(BufferKeys(run_id).groups_dropped_stale) or 0) == 0
            )
        finally:
            source.close()


def test_a_fresh_trainer_has_nothing_to_rejoin(tmp_path: Path) -> None:
    """No checkpoint and the buffer still at version 0: a fresh run. Nothing is restored
    or announced (the servers already serve v0)."""
    run_id = f"t{uuid.uuid4().hex[:10]}"
    with EmbeddedValkey(appendonly=False) as server:
        source = BufferSource(RedisConfig(url=server.url), BufferConfig(), run_id, retry_s=5)
        try:
            _trainer(tmp_path, source).resume()
            r = RedisEndpoint(server.url).sync_client()
            assert r.get(BufferKeys(run_id).lineage) is None
            assert r.get(BufferKeys(run_id).version) is None
        finally:
            source.close()
