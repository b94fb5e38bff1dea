"""The profile's update rounds as a box node makes them (`continuous_load` with
`Reloads`): the run's controller keeps a built-in server full while it updates the
weights every `RELOAD_EVERY_S`, from disk or over the network from a trainer's rank 0 of
its own (`trainer_service.publish.broadcast_versions`, here on loopback), and the median
pause comes back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from areal_hex.config import InferenceConfig, ModelConfig, load_config
from hexctl.job.prepare import materialize_v0
from hexctl.profile.controller import (
    FIRST_VERSION,
    Reloads,
    broadcaster,
    continuous_load,
    idle_updates,
)
from rollout_service.client import InferenceClient
from rollout_service.server.main import ServerThread, build_server_app

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "model.tiny.sft_steps=0",
    "rollout.group_size=4",
    "rollout.max_new_tokens=8",
    "rollout.max_concurrent_groups=4",
    "inference.max_running_requests=16",
]

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("sync", ["disk", "network"])
def test_update_rounds_pause_the_server_and_load_each_version(tmp_path: Path, sync: str) -> None:
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml", SMALL)
    v0 = materialize_v0(cfg, tmp_path / "weights")
    inf = InferenceConfig(weights_dir=str(v0.parent), max_running_requests=16, num_threads=1)
    app = build_server_app(ModelConfig(path=str(v0)), inf)
    reloads = Reloads(sync=sync, address="127.0.0.1", bucket_mb=0.05)  # several buckets
    with ServerThread(app) as url:
        rate, cpu, pause = asyncio.run(
            continuous_load(url, cfg, v0, set(), reloads=reloads, min_window_s=1.0)
        )
        if sync == "network":  # rounds sharing one rank 0: each load forms a group anew
            with broadcaster(v0, reloads) as rank0:
                for _ in range(2):
                    load = continuous_load(url, cfg, v0, set(), reloads, 0.5, rank0=rank0)
                    again = asyncio.run(load)[2]
                    assert again is not None and 0 < again < 5.0
                # a synchronous run's: nothing in flight, the same rank 0, a group anew
                idle = asyncio.run(idle_updates(url, cfg, v0, rank0, 3))
                assert len(idle) == 3 and all(0 < p < 5.0 for p in idle)

        async def served() -> int:
            async with InferenceClient(url, timeout_s=30) as client:
                return await client.weight_version()

        version = asyncio.run(served())
    assert rate > 0 and cpu > 0
    assert pause is not None and 0 < pause < 5.0
    # the updates reached the server: over the network, an update without a manifest
    # (or a group) would leave the version where it was
    assert version >= FIRST_VERSION
    if sync == "network":  # the last of the idle updates: FIRST_VERSION - 1, then 3 more
        assert version == FIRST_VERSION + 2


def _taken(receiver: Any, n: int) -> list[int]:
    """The versions `receiver` has taken whole, waiting up to 5 s for `n` of them."""
    got: list[int] = []
    for _ in range(50):
        got += receiver.received()
        if len(got) >= n:
            break
        time.sleep(0.1)
    return got


def test_a_receiver_takes_every_version_a_trainers_sink_broadcasts() -> None:
    """The training profile's receiver (`WeightReceiver`): the trainer's own
    `NetworkSink` publishes to it as to a server; several buckets, a new group after a
    regroup, each version taken whole."""
    import torch

    from hexctl.profile.receiver import WeightReceiver

    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3)}
    with WeightReceiver() as receiver:
        sink = receiver.sink(bucket_mb=20 / 2**20)  # 20 bytes: a bucket per tensor
        for version in (1, 2):
            sink.publish(version, tensors, lambda v, p: None)
        sink.close()
        sink.epoch += 1  # the next version forms a new group, which it joins
        sink.publish(3, tensors, lambda v, p: None)
        sink.close()
        assert sink.failures == 0
        got = _taken(receiver, 3)
    assert got == [1, 2, 3]


def test_two_receivers_each_take_every_version_before_it_counts() -> None:
    """`WeightReceiver` with two ranks: the sink's group has both servers' ranks, and a
    version counts as taken once each has it whole."""
    import torch

    from hexctl.profile.receiver import WeightReceiver

    tensors = {"a": torch.arange(6, dtype=torch.float32)}
    with WeightReceiver([None, None]) as receiver:
        sink = receiver.sink(bucket_mb=1.0)
        assert sink.server_ranks == 2
        for version in (1, 2):
            sink.publish(version, tensors, lambda v, p: None)
        sink.close()
        assert sink.failures == 0
        got = _taken(receiver, 2)
    assert got == [1, 2]


def test_training_rounds_publish_over_the_network(tmp_path: Path) -> None:
    """`measure_training(..., network=True)`: the steps broadcast each version to a
    receiver, as a box node's run that syncs over the network does."""
    from hexctl.profile.devices import local_devices
    from hexctl.profile.training import measure_training

    cfg = load_config(ROOT / "examples/tiny_cpu.yaml", SMALL)
    v0 = materialize_v0(cfg, tmp_path)
    dev = local_devices(cfg)
    rates = measure_training(cfg, v0, dev, 10, 6.0, rounds=(1, 2), network=True, pair=True)
    assert rates.publish_sync == "network"
    assert rates.tokens_per_s > 0 and rates.publish_s is not None
    assert rates.broadcast_s is not None and 0 < rates.broadcast_s < 30
    # one round more to two receivers (off a box node, in no cgroup)
    assert rates.broadcast_pair_s is not None and 0 < rates.broadcast_pair_s < 30
    # the step's update after its wait for the send, timed on the publishing steps
    assert rates.after_send_s is not None and 0 < rates.after_send_s < 30


def test_the_receiver_ends_when_the_profile_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the process that started a `WeightReceiver` (a profile killed outright)
    leaves no receiver: it is in neither the node's cgroup nor its namespace, where
    `box down` looks, so it notices its parent is gone and ends."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from hexctl.profile.receiver import WeightReceiver\n"
        "with WeightReceiver() as r:\n"
        "    print(r.proc.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for _ in range(100):  # it polls for its parent every second
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"the receiver {child} outlived its killed parent by 10 s")
    finally:
        proc.kill()
