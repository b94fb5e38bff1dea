"""The members of a weight-update group, agreed between the trainer and the controller
through the run's Valkey: a server not up when an update starts is not waited for, and
once it is up the trainer is asked for a new group that it joins."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aredis
import torch

from areal_hex.buffer.embedded import EmbeddedValkey
from areal_hex.config import load_config
from areal_hex.weight_net import (
    BucketSpec,
    GroupSpec,
    Manifest,
    agree_members,
    manifest_key,
    members_key,
    regroup_key,
)
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.weight_sync import UpdateGate, WeightSync
from rollout_service.controller.wiring import network_source
from tests.fakes import FakeServer, MemoryProducer
from trainer_service.publish import NetworkSink, Redelivery

RUN = "members-run"


@pytest.fixture
def valkey() -> Iterator[str]:
    server = EmbeddedValkey(appendonly=False).start()
    try:
        yield server.url
    finally:
        server.stop()


def manifest(version: int, epoch: int) -> Manifest:
    g = GroupSpec("10.0.0.1", 29500, 3, f"areal-hex-weights-x-{epoch}", "gloo")
    return Manifest(version, g, [BucketSpec(["w"], ["float32"], [[4]])])


async def test_a_server_up_late_is_not_waited_for_and_joins_the_next_group(valkey: str) -> None:
    """Two planned servers, the second not up at the first update: the group is recorded
    with the first only (the trainer sizes it 1 + 1), nobody is marked unhealthy; once
    the second is up the controller asks for a new group, and in it both load v1."""
    client = redis.Redis.from_url(valkey)
    cfg = load_config(None, ["rollout.weight_sync=network", f"run.run_id={RUN}"])
    source = network_source(cfg, aredis.Redis.from_url(valkey))
    assert source is not None
    servers = [FakeServer("s0"), FakeServer("s1")]
    servers[1].down = True
    d = Dispatcher(servers, probe_interval_s=60)
    assert await d.wait_healthy(5) == 1
    sync = WeightSync(d, MemoryProducer(), UpdateGate(), None, source)
    d.on_recover = sync.recover
    await sync.start("abort")
    first = manifest(1, epoch=0)
    client.set(manifest_key(RUN, 1), first.to_json())
    await sync.update(1, "")
    assert json.loads(client.get(members_key(RUN, first.group.group_name))) == ["s0"]
    assert servers[0].groups == {first.group.group_name: 1}
    assert servers[0].world_sizes == {first.group.group_name: 2}
    assert servers[0].version == 1 and d.servers[0].healthy
    assert client.get(regroup_key(RUN)) is None
    servers[1].down = False  # up at last, with its initial weights
    assert await d.probe_all() == 2
    assert client.get(regroup_key(RUN)) == first.group.group_name.encode()
    second = manifest(1, epoch=1)  # the trainer sends v1 again over a new group
    client.set(manifest_key(RUN, 1), second.to_json())
    await sync.update(1, "")
    name = second.group.group_name
    assert json.loads(client.get(members_key(RUN, name))) == ["s0", "s1"]
    assert [s.groups for s in servers] == [{name: 1}, {name: 2}]
    assert [s.world_sizes[name] for s in servers] == [3, 3]
    assert [s.version for s in servers] == [1, 1]


def test_the_trainer_reads_the_members_or_claims_an_empty_group(valkey: str) -> None:
    """The trainer waits for the record; none in time: it claims the group empty, and a
    controller that records later reads that back (it joins nobody to it)."""
    client = redis.Redis.from_url(valkey)
    key = members_key(RUN, "g0")

    def record_soon() -> None:
        time.sleep(0.2)
        client.set(key, json.dumps(["s0", "s1"]), nx=True)

    t = threading.Thread(target=record_soon)
    t.start()
    got = agree_members(lambda: client.get(key), lambda v: client.set(key, v, nx=True), 5.0)
    t.join()
    assert got == ["s0", "s1"]
    late = members_key(RUN, "g1")
    t0 = time.monotonic()
    got = agree_members(lambda: client.get(late), lambda v: client.set(late, v, nx=True), 0.3)
    assert got == [] and time.monotonic() - t0 < 2
    client.set(late, json.dumps(["s0"]), nx=True)  # the controller, too late
    assert json.loads(client.get(late)) == []


async def test_a_group_recorded_empty_is_joined_by_nobody(valkey: str) -> None:
    client = redis.Redis.from_url(valkey)
    cfg = load_config(None, ["rollout.weight_sync=network", f"run.run_id={RUN}"])
    source = network_source(cfg, aredis.Redis.from_url(valkey))
    assert source is not None
    server = FakeServer("s0")
    d = Dispatcher([server], probe_interval_s=60)
    await d.wait_healthy(5)
    sync = WeightSync(d, MemoryProducer(), UpdateGate(), None, source)
    await sync.start("abort")
    m = manifest(1, epoch=0)
    client.set(manifest_key(RUN, 1), m.to_json())
    client.set(members_key(RUN, m.group.group_name), "[]")  # the trainer gave up on it
    await sync.update(1, "")
    assert not server.groups and server.version == 0 and d.servers[0].healthy
    assert client.get(regroup_key(RUN)) == m.group.group_name.encode()


def test_a_group_with_no_member_is_not_formed_and_a_regroup_is_due() -> None:
    """No server up: the trainer forms no group (nothing waits for a rendezvous), the
    version is not counted undelivered; asked for a new group, a redelivery is due."""
    asked: list[str | None] = [None]
    left: list[Manifest] = []
    sink = NetworkSink(
        "127.0.0.1",
        1,
        2,
        "gloo",
        1 << 20,
        5.0,
        left.append,
        members=lambda name, timeout_s: [],
        regroup_asked=lambda: asked[0],
    )
    t0 = time.monotonic()
    sink.publish(1, {"w": torch.zeros(4)}, lambda v, p: None)
    assert time.monotonic() - t0 < 2 and sink.undelivered is None and sink.failures == 0
    assert left[0].group.group_name.endswith("-0") and sink.group_spec().group_name.endswith("-1")
    r = Redelivery(min_s=30.0, max_s=100.0, last_group=0.0)
    assert not r.due(sink, 1.0) and not sink.regroup_wanted()
    asked[0] = left[0].group.group_name
    assert sink.regroup_wanted() and r.due(sink, 1.0)
    asked[0] = "some-older-group"
    assert not sink.regroup_wanted()


def test_a_missing_member_fails_the_join_in_the_join_timeout() -> None:
    """Rank 0 of a group of two whose other member never comes: the rendezvous gives up
    in `join_timeout_s`, not in the broadcast timeout."""
    from areal_hex.net import free_port
    from areal_hex.weight_net import WeightGroup

    spec = GroupSpec("127.0.0.1", free_port(), 2, "areal-hex-weights-alone-0", "gloo")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        WeightGroup.join(spec, 0, timeout_s=120.0, join_timeout_s=1.0)
    assert time.monotonic() - t0 < 10
