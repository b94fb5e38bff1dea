"""The profile's update rounds as a box node makes them (`continuous_load` with
`Reloads`): the run's controller keeps a built-in server full while it updates the
weights every `RELOAD_EVERY_S`, from disk or over the network from a trainer's rank 0 of
its own (`trainer_service.publish.broadcast_versions`, here on loopback), and the median
pause comes back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from areal_hex.config import InferenceConfig, ModelConfig, load_config
from hexctl.job.prepare import materialize_v0
from hexctl.profile.controller import FIRST_VERSION, Reloads, broadcaster, continuous_load
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

        async def served() -> int:
            async with InferenceClient(url, timeout_s=30) as client:
                return await client.weight_version()

        version = asyncio.run(served())
    assert rate > 0 and cpu > 0
    assert pause is not None and 0 < pause < 5.0
    # the updates reached the server: over the network, an update without a manifest
    # (or a group) would leave the version where it was
    assert version >= FIRST_VERSION
