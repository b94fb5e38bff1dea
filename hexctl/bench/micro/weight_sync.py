"""Weight sync, disk against network, one version at a time, in one run.

    areal-hex bench weight-sync --json [--rounds 5] [--hidden 64 --layers 2]
        [--address A] [--host H]

A built-in inference server (this process, `--host`) and a trainer-side rank 0 (a
spawned process: `trainer_service.publish.NetworkSink`, the trainer's own code, master
address `--address`) take turns publishing versions; the controller's `WeightSync`
loads each on the server. Per round, from the publish's start to the server serving the
version (pause, load, continue included):

- disk: write `weights/v<N>` (`write_model_dir`), then `/update_weights_from_disk`;
- network: manifest + announce, the group's broadcast of every bucket, and the
  `/update_weights_from_distributed` calls (the group is formed in a warm-up round).

Prints one JSON object: medians over `--rounds`, the ratio disk / network, and each
side's parts. With `--address` and `--host` set to two namespaces' addresses (and
GLOO_SOCKET_IFNAME where needed) it measures the link between them.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hexctl.bench import BenchFailed


async def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
    from areal_hex.models import load_model, materialize
    from areal_hex.net import free_port
    from areal_hex.weight_net import Manifest
    from rollout_service.client import InferenceClient
    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.weight_sync import NetworkSource, UpdateGate, WeightSync
    from rollout_service.server.main import ServerThread, build_server_app
    from trainer_service.publish import broadcast_versions, write_model_dir

    tiny = TinyModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                           intermediate_size=2 * args.hidden)  # fmt: skip
    weights = root / "weights"
    src = materialize(ModelConfig(tiny=tiny), weights / "v0")
    tensors = {k: v for k, v in load_model(src, "cpu", "float32").state_dict().items()}
    tensors.pop("lm_head.weight", None)  # tied to the embedding: published once
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    port = free_port()
    rank0 = (str(src), args.address, port, args.bucket_mb, go, out)
    proc = ctx.Process(target=broadcast_versions, args=rank0)
    proc.start()
    manifests: dict[int, Manifest] = {}

    async def read(version: int) -> Manifest | None:
        return manifests.get(version)

    inf = InferenceConfig(weights_dir=str(weights), num_threads=1)
    app = build_server_app(ModelConfig(path=str(src)), inf)
    disk_s, disk_write, net_s, net_sent = [], [], [], []
    try:
        with ServerThread(app, host=args.host) as url:
            async with InferenceClient(url, timeout_s=120) as client:
                d = Dispatcher([client])
                await d.wait_healthy(60)
                gate = UpdateGate()
                disk = WeightSync(d, _Producer(), gate, str(weights))
                net = WeightSync(d, _Producer(), gate, None, NetworkSource(read, timeout_s=120))
                for sync in (disk, net):
                    await sync.start("in_place")
                version = 0
                for r in range(args.rounds + 1):  # round 0 forms the group: a warm-up
                    version += 1
                    t0 = time.time()
                    t1 = time.perf_counter()
                    path = write_model_dir(tensors, src, weights / f"v{version}")
                    disk_write.append(time.perf_counter() - t1)
                    await disk.update(version, str(path))
                    disk_s.append(time.time() - t0)
                    version += 1
                    go.put(version)
                    kind, text, t0 = await asyncio.to_thread(out.get, True, 120)
                    manifests[version] = Manifest.from_json(text)
                    await net.update(version, "")
                    net_s.append(time.time() - t0)
                    _, sent, failures = await asyncio.to_thread(out.get, True, 120)
                    if failures:
                        raise BenchFailed("the broadcast failed")
                    net_sent.append(sent)
                    if r == 0:
                        disk_s, disk_write, net_s, net_sent = [], [], [], []
                served = await client.weight_version()
    finally:
        go.put(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    med = statistics.median
    return {
        "params": sum(t.numel() for t in tensors.values()),
        "weights_mb": round(nbytes / 2**20, 3),
        "buckets": len(manifests[version].buckets),
        "rounds": args.rounds,
        "disk_s": med(disk_s),
        "network_s": med(net_s),
        "ratio": med(disk_s) / med(net_s),
        "disk_write_s": med(disk_write),
        "network_broadcast_s": med(net_sent),
        "disk_all_s": disk_s,
        "network_all_s": net_s,
        "served_version": served,
    }


class _Producer:
    """What WeightSync tells the buffer; nothing to tell here."""

    def set_serving_version(self, version: int) -> None:
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after a warm-up)")
    p.add_argument("--hidden", type=int, default=64, help="tiny Qwen3 width (64: ~0.3 MB)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=512.0)
    p.add_argument("--address", default="127.0.0.1", help="rank 0's address (the trainer)")
    p.add_argument("--host", default="127.0.0.1", help="the server's address")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        return asyncio.run(measure(args, Path(tmp)))
