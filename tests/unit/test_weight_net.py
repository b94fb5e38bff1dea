"""Weights over the network, the parts that need no second process: bucket planning,
the manifest, the config's checks, the controller's side of the protocol against fake
servers, and the cost model's network term."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from areal_hex.config import ConfigError, load_config
from areal_hex.config.checks import check_run, weight_sync_backend
from areal_hex.weight_net import BucketSpec, GroupSpec, Manifest, parse_dtype, plan_buckets
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.weight_sync import NetworkSource, UpdateGate, WeightSync
from tests.fakes import FakeServer, MemoryProducer


def test_buckets_keep_order_and_size() -> None:
    t = {
        "a": torch.zeros(10),  # 40 bytes
        "b": torch.zeros(10),
        "c": torch.zeros(100, dtype=torch.bfloat16),  # 200 bytes: a bucket of its own
        "d": torch.zeros(5),
    }
    buckets = plan_buckets(t, bucket_bytes=100)
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert buckets[1].dtypes == ["bfloat16"] and buckets[1].shapes == [[100]]
    assert [b.nbytes for b in buckets] == [80, 200, 20]


def test_manifest_round_trip() -> None:
    g = GroupSpec("10.0.0.1", 29500, 3, "areal-hex-weights-0", "gloo")
    m = Manifest(7, g, [BucketSpec(["w"], ["float32"], [[2, 3]])])
    back = Manifest.from_json(m.to_json())
    assert back == m and back.nbytes == 24


def test_dtype_names() -> None:
    assert parse_dtype("bfloat16") == torch.bfloat16
    assert parse_dtype("torch.float32") == torch.float32
    for bad in ("int3", "bool", "__class__"):
        with pytest.raises(ValueError, match="dtype"):
            parse_dtype(bad)


def test_config_refuses_what_does_nothing(tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.weight_sync=network", f"trainer.replay_path={tmp_path}"])
    with pytest.raises(ConfigError, match="needs the buffer"):
        check_run(cfg)
    cfg = load_config(None, ["rollout.weight_sync_port=29500"])  # disk is the default
    with pytest.raises(ConfigError, match="rollout.weight_sync_port .* only applies"):
        check_run(cfg)
    with pytest.raises(ConfigError, match="weight_sync"):
        load_config(None, ["rollout.weight_sync=ftp"])
    check_run(load_config(None, ["rollout.weight_sync=network", "rollout.weight_sync_port=1"]))
    for key in ("address=h", "port=1", "ifname=eth0", "bucket_mb=64", "timeout_s=9"):
        with pytest.raises(ConfigError, match=f"is now 'rollout.weight_sync_{key.split('=')[0]}'"):
            load_config(None, [f"trainer.weight_sync_{key}"])
    assert weight_sync_backend(load_config(None, [])) == "gloo"
    gpu = ["trainer.device=cuda", "inference.device=cuda"]
    assert weight_sync_backend(load_config(None, gpu)) == "nccl"


def manifest(version: int, epoch: int = 0) -> Manifest:
    g = GroupSpec("10.0.0.1", 29500, 3, f"areal-hex-weights-{epoch}", "gloo")
    buckets = [BucketSpec([n], ["float32"], [[4]]) for n in ("w1", "w2", "w3")]
    return Manifest(version, g, buckets)


async def test_controller_joins_once_then_sends_every_bucket_in_order() -> None:
    servers = [FakeServer("s0"), FakeServer("s1")]
    published = {1: manifest(1), 2: manifest(2), 3: manifest(3, epoch=1)}

    async def read(v: int) -> Manifest | None:
        return published.get(v)

    d = Dispatcher(servers)
    assert await d.wait_healthy(5) == 2
    producer = MemoryProducer()
    sync = WeightSync(d, producer, UpdateGate(), None, NetworkSource(read, timeout_s=1))
    await sync.start("abort")
    await sync.update(1, "")
    # server i is rank 1 + i of the group; buckets in the manifest's order
    assert [s.groups for s in servers] == [{"areal-hex-weights-0": 1}, {"areal-hex-weights-0": 2}]
    assert [n for _, (n,) in servers[0].buckets] == ["w1", "w2", "w3"]
    assert [s.version for s in servers] == [1, 1]  # set by the last bucket only
    assert [s.updates for s in servers] == [[("", 1)], [("", 1)]]
    await sync.update(2, "")  # same group: no new join
    assert len(servers[1].buckets) == 6 and servers[1].groups == {"areal-hex-weights-0": 2}
    await sync.update(3, "")  # the trainer formed a new group: leave the old, join it
    assert [s.groups for s in servers] == [{"areal-hex-weights-1": 1}, {"areal-hex-weights-1": 2}]
    assert [s.version for s in servers] == [3, 3]
    assert producer.serving == 3


async def test_a_failed_server_is_left_out_until_the_next_group() -> None:
    servers = [FakeServer("s0"), FakeServer("s1")]
    published = {1: manifest(1), 2: manifest(2), 3: manifest(3), 4: manifest(4, epoch=1)}

    async def read(v: int) -> Manifest | None:
        return published.get(v)

    d = Dispatcher(servers, probe_interval_s=60)
    await d.wait_healthy(5)
    sync = WeightSync(d, MemoryProducer(), UpdateGate(), None, NetworkSource(read, timeout_s=1))
    await sync.start("abort")
    await sync.update(1, "")
    servers[1].down = True
    await sync.update(2, "")
    assert not d.servers[1].healthy and servers[0].version == 2
    servers[1].down = False
    servers[1].groups.clear()  # it restarted: out of every group
    await sync.recover(d.servers[1])
    assert "s1" not in sync.joined and servers[1].version == 1  # keeps what it had
    d.servers[1].healthy = True
    await sync.update(3, "")  # the old group still: s1 is not in it, but it goes on
    assert servers[0].version == 3 and servers[1].version == 1
    assert servers[1].running.is_set() and not servers[1].groups
    await sync.update(4, "")  # the next group: every server joins it
    assert servers[1].groups == {"areal-hex-weights-1": 2} and servers[1].version == 4


async def test_a_missing_manifest_leaves_the_weights() -> None:
    server = FakeServer("s0")

    async def read(v: int) -> Manifest | None:
        return None

    d = Dispatcher([server])
    await d.wait_healthy(5)
    sync = WeightSync(
        d, MemoryProducer(), UpdateGate(), None, NetworkSource(read, timeout_s=0.3, poll_s=0.05)
    )
    await sync.start("abort")
    await sync.update(1, "")
    assert server.version == 0 and not server.groups and d.servers[0].healthy


def test_cost_model_charges_the_mode_over_the_link(tmp_path: Path) -> None:
    import yaml

    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.sync_cost import weight_sync_s
    from scheduler.workload import Workload

    spec = {
        "name": "two-zones",
        "zones": [
            {"name": "a", "region": "r", "inter_node_bandwidth_gbs": 100},
            {"name": "b", "region": "r", "inter_node_bandwidth_gbs": 100},
        ],
        "links": [{"a": "a", "b": "b", "bandwidth_gbs": 1.25, "latency_ms": 10}],
        "node_groups": [
            {"name": n, "gpu": "H100", "gpus_per_node": 8, "nodes": 1, "zone": n,
             "usd_per_gpu_hour": 1, "intra_node": {"kind": "nvlink", "bandwidth_gbs": 900}}
            for n in ("a", "b")
        ],
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec))
    cl, m = load_cluster(tmp_path / "c.yaml"), load_model_shape("qwen3-0.6b")
    disk = Workload()
    net = Workload(weight_sync="network", constants={"weight_sync_bucket_mb": 256})
    n = m.params
    # disk: latency + 5 x 2N / 1.25 GB/s (today's calibrated term)
    assert weight_sync_s(cl, m, disk, "a", "b") == pytest.approx(0.01 + 5 * 2 * n / 1.25e9)
    # network: 2N bytes in ceil(2N / 256 MiB) buckets, one pause and 5 ms per bucket
    buckets = -(-2 * n // (256 * 2**20))
    want = 0.01 + buckets * 0.005 + 2 * n / 1.25e9
    assert weight_sync_s(cl, m, net, "a", "b") == pytest.approx(want)
    # the same mode inside one zone crosses its faster link
    assert weight_sync_s(cl, m, net, "a", "a") < weight_sync_s(cl, m, net, "a", "b") / 20


async def _one_server_at_v1() -> tuple[
    FakeServer, dict[int, Manifest], Dispatcher, MemoryProducer, WeightSync
]:
    """One server, recovered through the WeightSync, at v1 over the network."""
    published = {1: manifest(1), 2: manifest(2)}
    server, d, producer, sync = await _one_server(published)
    await sync.update(1, "")
    return server, published, d, producer, sync


async def _one_server(
    published: dict[int, Manifest],
) -> tuple[FakeServer, Dispatcher, MemoryProducer, WeightSync]:
    """One server at v0, recovered through the WeightSync; `published`: the manifests."""
    server = FakeServer("s0")

    async def read(v: int) -> Manifest | None:
        return published.get(v)

    d = Dispatcher([server], probe_interval_s=60)
    await d.wait_healthy(5)
    producer = MemoryProducer()
    sync = WeightSync(d, producer, UpdateGate(), None, NetworkSource(read, timeout_s=1))
    d.on_recover = sync.recover
    await sync.start("abort")
    return server, d, producer, sync


async def test_a_restarted_server_holds_the_gate_until_a_version_is_sent_again() -> None:
    """Network sync, one server killed while v2 was broadcast: the gate keeps v1 (the
    servers did not get v2), the restarted server (back at v0) lowers it to v0, so no
    group is made for weights the trainer would drop; the trainer's redelivery of v2
    (a new group, a new lineage) brings it back and the gate follows."""
    server, published, d, producer, sync = await _one_server_at_v1()
    assert producer.serving == 1 and sync.serving == 1
    server.down = True  # killed during v2's broadcast
    await sync.update(2, "")
    assert not d.servers[0].healthy and producer.serving == 1  # not v2: nobody has it
    server.down, server.version = False, 0  # restarted with its initial weights
    server.groups.clear()
    assert await d.probe_all() == 1
    assert producer.serving == 0 and server.version == 0  # the gate holds
    published[2] = manifest(2, epoch=1)  # the trainer sends v2 again, over a new group
    await sync.update(2, "")
    assert server.version == 2 and server.groups == {"areal-hex-weights-1": 1}
    assert producer.serving == 2


def test_redelivery_is_due_at_once_after_a_failure_and_adapts_to_slow_batches() -> None:
    from trainer_service.publish import NetworkSink, Redelivery

    sink = NetworkSink("127.0.0.1", 1, 1, "gloo", 1 << 20, 5.0, lambda m: None)
    other = NetworkSink("127.0.0.1", 1, 1, "gloo", 1 << 20, 5.0, lambda m: None)
    assert sink.group_spec().group_name != other.group_spec().group_name  # per process
    assert sink.group_spec().group_name.endswith("-0")
    r = Redelivery(min_s=30.0, max_s=100.0, last_group=0.0)
    assert not r.due(sink, 29.0) and r.due(sink, 30.0)
    sink.undelivered = 7
    assert r.due(sink, 3.0)  # a failed broadcast: soon
    sink.undelivered = None
    r.group_arrived(20.0)
    r.group_arrived(60.0)  # a slow batch: 40 s between groups
    assert r.after_s == 120.0 and not r.due(sink, 150.0) and r.due(sink, 180.0)
    r.sent(180.0)
    assert r.after_s == 100.0 and r.tries == 1 and not r.due(sink, 200.0)


async def test_a_version_sent_again_while_the_server_was_down_reaches_it_on_recovery() -> None:
    """The trainer sent v2 again (a new group) while the only server was down: nobody
    took it then; once the server is back, the controller has it join that group and
    load v2 at once, instead of waiting for a version that needs groups to be made."""
    server, published, d, producer, sync = await _one_server_at_v1()
    server.down = True
    await sync.update(2, "")  # the broadcast fails: the server is gone
    published[2] = manifest(2, epoch=1)
    await sync.update(2, "")  # sent again while it is down: no server to take it
    assert producer.serving == 1
    server.down, server.version = False, 0
    server.groups.clear()
    assert await d.probe_all() == 1
    for _ in range(100):
        if server.version == 2:
            break
        await asyncio.sleep(0.02)
    assert server.version == 2 and server.groups == {"areal-hex-weights-1": 1}
    assert producer.serving == 2


async def test_a_stale_version_is_given_up_for_a_newer_and_never_received_twice() -> None:
    """The manifest of a version whose trainer died (cleared by the launcher) is not
    waited for once a newer version is announced; the same version announced again
    with the group it was already received over is not waited for either."""
    server = FakeServer("s0")
    published = {3: manifest(3)}

    async def read(v: int) -> Manifest | None:
        return published.get(v)

    newer = [False]
    source = NetworkSource(read, timeout_s=30, poll_s=0.01)
    t0 = asyncio.get_running_loop().time()
    task = asyncio.ensure_future(source.manifest(2, lambda: newer[0]))
    await asyncio.sleep(0.1)
    newer[0] = True
    assert await task is None and asyncio.get_running_loop().time() - t0 < 5
    d = Dispatcher([server], probe_interval_s=60)
    await d.wait_healthy(5)
    sync = WeightSync(d, MemoryProducer(), UpdateGate(), None, source)
    await sync.start("abort")
    await sync.update(3, "")
    await sync.update(3, "")  # a restore announced v3 again: nothing new to receive
    assert len(server.buckets) == 3 and server.version == 3


async def test_a_server_down_when_a_new_group_was_announced_joins_it_when_back() -> None:
    """The first group's version was announced while the only server was down (the
    trainer waits in it for every rank): the server, back, joins it at once."""
    server, d, producer, sync = await _one_server({1: manifest(1)})
    server.down = True
    await sync.update(1, "")
    assert producer.serving == 0 and not server.groups
    server.down = False
    assert await d.probe_all() == 1
    for _ in range(100):
        if server.version == 1:
            break
        await asyncio.sleep(0.02)
    assert server.version == 1 and producer.serving == 1
