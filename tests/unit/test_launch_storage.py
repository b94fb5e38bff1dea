"""Damaged storage is named at the start of an attempt: an append-only file cut short
(Valkey loads what is whole; the cut is named), one damaged inside (Valkey refuses it:
exit 2 naming it), and checkpoints whose weights version is gone from disk."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import redis

from areal_hex.buffer.embedded import EmbeddedServerError, EmbeddedValkey
from hexctl.launch.storage import (
    DamagedStorage,
    aof_damage,
    aof_refused,
    forget_weight_groups,
    weights_missing,
)


def _written_then_killed(data_dir: Path) -> tuple[int, Path]:
    v = EmbeddedValkey(data_dir=str(data_dir), appendfsync="always", die_with_parent=False)
    v.start()
    client = redis.Redis.from_url(v.url)
    for i in range(100):
        client.xadd("s", {"i": i})
    client.close()
    assert v.pid is not None
    os.kill(v.pid, signal.SIGKILL)
    v.stop()
    incr = next((data_dir / "appendonlydir").glob("*.incr.aof"))
    return int(v.port or 0), incr


@pytest.mark.timeout(60)
def test_a_cut_append_only_file_is_named(tmp_path: Path) -> None:
    _, incr = _written_then_killed(tmp_path)
    assert aof_damage(tmp_path) is None  # a clean start says nothing
    incr.write_bytes(incr.read_bytes()[:-37])
    v = EmbeddedValkey(data_dir=str(tmp_path), die_with_parent=False).start()
    try:
        assert redis.Redis.from_url(v.url).xlen("s") == 99
    finally:
        v.stop()
    said = aof_damage(tmp_path)
    assert said is not None and f"{incr} at byte " in said and "groups_lost" in said
    v = EmbeddedValkey(data_dir=str(tmp_path), die_with_parent=False).start()
    v.stop()
    assert aof_damage(tmp_path) is None  # only this start's log counts


@pytest.mark.timeout(60)
def test_an_append_only_file_damaged_inside_is_refused_by_name(tmp_path: Path) -> None:
    _, incr = _written_then_killed(tmp_path)
    data = bytearray(incr.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"#garbage"
    incr.write_bytes(bytes(data))
    with pytest.raises(EmbeddedServerError):
        EmbeddedValkey(data_dir=str(tmp_path), die_with_parent=False).start(timeout_s=5)
    refused = aof_refused(tmp_path)
    assert isinstance(refused, DamagedStorage)
    assert f"cannot load the append-only file in {tmp_path / 'appendonlydir'}" in str(refused)


def test_the_newest_checkpoints_weights_gone_are_named(tmp_path: Path) -> None:
    for step in (0, 20, 40, 100):
        d = tmp_path / "checkpoints" / f"step{step}"
        d.mkdir(parents=True)
        (d / "COMPLETE").write_text(json.dumps({"step": step, "version": step}))
    (tmp_path / "weights" / "v100").mkdir(parents=True)  # removal cut short: no config
    gone = weights_missing(tmp_path / "checkpoints", tmp_path / "weights")
    assert gone == f"step100 -> {tmp_path / 'weights' / 'v100'}"
    (tmp_path / "weights" / "v100" / "config.json").write_text("{}")
    # step 40's weights went with trainer.keep_versions: not damage
    assert weights_missing(tmp_path / "checkpoints", tmp_path / "weights") is None


@pytest.mark.timeout(60)
def test_the_manifests_of_gone_trainers_are_forgotten(tmp_path: Path) -> None:
    v = EmbeddedValkey(data_dir=str(tmp_path), die_with_parent=False).start()
    try:
        client = redis.Redis.from_url(v.url)
        for version in (17, 18):
            client.set(f"run1:weights_manifest:{version}", "{}")
        client.set("run2:weights_manifest:18", "{}")
        client.set("run1:version", "18")
        assert forget_weight_groups(client, "run1") == 2
        assert sorted(client.keys("*")) == [b"run1:version", b"run2:weights_manifest:18"]
        assert forget_weight_groups(client, "run1") == 0
        client.close()
    finally:
        v.stop()
