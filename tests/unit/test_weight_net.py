"""Weights over the network, the parts that need no second process: bucket planning,
the manifest, the config's checks, the controller's side of the protocol against fake
servers, and the cost model's network term."""

from __future__ import annotations

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
    from scheduler.costmodel import weight_sync_s
    from scheduler.model_shape import load_model_shape
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
