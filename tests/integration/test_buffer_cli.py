"""`areal-hex buffer stats|serve`, `bench buffer`, and the embedded server's lifecycle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from areal_hex.buffer import (
    EmbeddedValkey,
    RedisEndpoint,
    RedisTrajectoryConsumer,
    RedisWeightPublisher,
    open_redis,
)
from areal_hex.buffer.embedded import redact
from areal_hex.buffer.keys import BufferKeys
from areal_hex.config.buffer import BufferConfig
from areal_hex.config.redis import RedisConfig
from areal_hex.net import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

pytestmark = pytest.mark.timeout(120)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hexctl.cli", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_stats_reports_the_run(tmp_path: Path) -> None:
    with EmbeddedValkey(appendonly=False) as server:
        r = RedisEndpoint(server.url).sync_client()
        keys = BufferKeys("run7")
        r.xgroup_create(keys.traj, "trainer", id="0", mkstream=True)
        for i in range(5):
            r.xadd(keys.traj, {b"d": b"x%d" % i})
        r.xreadgroup("trainer", "c", {keys.traj: ">"}, count=2)  # 2 pending, 3 unread
        r.set(keys.submitted, 9)
        r.set(keys.groups_dropped_stale, 4)
        r.set(keys.dead_count, 1)
        r.set(keys.given_back("filtered"), 6)
        RedisWeightPublisher(r, "run7", BufferConfig()).set_version(3, "/w/v3")
        out = cli("buffer", "stats", "run.run_id=run7", f"redis.url={server.url}", "--json")
        text = cli("buffer", "stats", "run.run_id=run7", f"redis.url={server.url}")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats == {
        "run_id": "run7",
        "stream_length": 5,
        "pending": 2,
        "unconsumed": 3,
        "submitted": 9,
        "groups_dropped_stale": 4,
        "dead_letter": 1,
        "version": 3,
        "given_back_filtered": 6,
        "given_back_failed": 0,
        "given_back_abandoned": 0,
        "given_back_reclaimed": 0,
        "acked": 0,
    }
    assert text.returncode == 0 and "unconsumed            3" in text.stdout
    assert "given_back_filtered   6" in text.stdout


def test_dead_lists_dead_letters() -> None:
    with EmbeddedValkey(appendonly=False) as server:
        r = RedisEndpoint(server.url).sync_client()
        keys = BufferKeys("run8")
        r.xadd(keys.traj, {b"d": b"\x00\x01garbage"})
        consumer = RedisTrajectoryConsumer(r, "run8", BufferConfig(), keepalive=False)
        with pytest.raises(TimeoutError):
            consumer.get_batch(1, timeout_s=0.3)
        consumer.close()
        base = ["buffer", "dead", "run.run_id=run8", f"redis.url={server.url}"]
        out = cli(*base, "--json")
        text = cli(*base)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["payload_bytes"] == 9 and "truncated" in row["reason"]
    assert text.returncode == 0 and row["source_id"] in text.stdout


def test_stats_errors_are_clear(tmp_path: Path) -> None:
    port = free_port()
    out = cli("buffer", "stats", "run.run_id=x", f"redis.url=redis://:pw@127.0.0.1:{port}/0")
    assert out.returncode == 2
    assert f"cannot reach redis at redis://:***@127.0.0.1:{port}/0" in out.stderr
    assert "Traceback" not in out.stderr and "pw@" not in out.stderr
    out = cli("buffer", "stats", "run.run_id=x")
    assert out.returncode == 2 and "redis.url is not set" in out.stderr
    out = cli("buffer", "stats", "redis.url=redis://127.0.0.1:1/0")
    assert out.returncode == 2 and "run.run_id is not set" in out.stderr


def test_serve_runs_until_sigterm_and_keeps_data(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    args = ["buffer", "serve", "run.run_id=x", "--port", str(port), "--dir", str(data)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hexctl.cli", *args],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert f"127.0.0.1:{port}" in proc.stdout.readline()
        r = redis.Redis(port=port)
        r.set("k", "v")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(redis.ConnectionError):  # the server went with it
        redis.Redis(port=port, socket_connect_timeout=1).ping()
    assert (data / "appendonlydir").is_dir()  # append-only data kept in --dir


def test_open_redis_embedded_lifecycle() -> None:
    ep = open_redis(RedisConfig(appendonly=False))
    assert ep.server is not None
    tmp = ep.server.dir
    assert ep.sync_client().ping()
    assert ep.sync_client().config_get("appendonly")["appendonly"] == "no"
    ep.close()
    assert not tmp.exists()  # temp data dir removed
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(ep.url, socket_connect_timeout=1).ping()


def test_open_redis_url_with_acl_user() -> None:
    with EmbeddedValkey(appendonly=False) as server:
        admin = RedisEndpoint(server.url).sync_client()
        admin.acl_setuser(
            "trainer",
            enabled=True,
            passwords=["+pw1"],
            keys=["*"],
            channels=["*"],
            commands=["+@all"],
        )
        url = f"redis://trainer:pw1@127.0.0.1:{server.port}/0"
        assert open_redis(RedisConfig(url=url)).sync_client().acl_whoami() == "trainer"
        bare = RedisConfig(
            url=f"redis://127.0.0.1:{server.port}/0", username="trainer", password="pw1"
        )
        assert open_redis(bare).sync_client().acl_whoami() == "trainer"
        assert redact(url) == f"redis://trainer:***@127.0.0.1:{server.port}/0"


@pytest.mark.timeout(180)
def test_bench_buffer_prints_one_json_object() -> None:
    start = time.monotonic()
    out = cli(
        "bench",
        "buffer",
        "--json",
        "--groups",
        "64",
        "--tokens",
        "64",
        "--repeats",
        "1",
        timeout=150,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["lost"] == 0 and result["raw_lost"] == 0
    assert result["groups_per_s"] > 0 and result["raw_xadd_per_s"] > 0
    assert result["ratio"] == pytest.approx(
        result["groups_per_s"] / result["raw_xadd_per_s"], rel=0.01
    )
    assert result["payload_bytes"] > 8 * 64 * 12  # 8 completions x 64 tokens x 3 arrays
    assert time.monotonic() - start < 150


def test_embedded_server_dies_with_its_owner() -> None:
    code = (
        "import time; from areal_hex.buffer import EmbeddedValkey; "
        "s = EmbeddedValkey(appendonly=False).start(); print(s.port, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert redis.Redis(port=port).ping()
    finally:
        proc.kill()  # SIGKILL: no atexit, no context exit
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            redis.Redis(port=port, socket_connect_timeout=0.5).ping()
        except redis.ConnectionError:
            return
        time.sleep(0.1)
    pytest.fail(f"valkey on port {port} outlived its owner")
