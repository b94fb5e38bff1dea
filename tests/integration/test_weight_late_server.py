"""A server that is not up when the first weights go over the network: the update goes
to the server that is (the trainer's group is sized to the members the controller
records in the run's Valkey, so nobody waits for the missing one and no healthy server
is marked unhealthy); once the late server is up it asks for a new group, and the next
version reaches both, over real gloo groups, real servers and a real Valkey. The
controller's start (`rollout.wait_for_servers`) goes on with the server that is up
(`first`), or waits for both (`all`) and ends naming the late one when it does not come."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis
import torch

from areal_hex.api import SamplingParams
from areal_hex.buffer.embedded import EmbeddedValkey
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig, load_config
from areal_hex.models import load_model, materialize
from areal_hex.net import free_port
from rollout_service.client import InferenceClient
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.weight_sync import UpdateGate, WeightSync
from rollout_service.controller.wiring import network_source, wait_for_servers
from rollout_service.server.main import ServerThread, build_server_app
from tests.fakes import MemoryProducer
from tests.integration.test_weight_network import recompute

pytestmark = pytest.mark.timeout(120)
RUN = "late-run"


def trainer_side(model_dir: str, port: int, url: str, go: Any, results: Any) -> None:
    """Rank 0 as the trainer wires it (trainer_service.main.make_network_sink): two
    planned servers, members and regroup requests read from Valkey; publishes the
    weights of `model_dir` as each version `go` gives, until None."""
    import redis

    from areal_hex.weight_net import (
        agree_members,
        manifest_key,
        members_key,
        regroup_key,
    )
    from trainer_service.publish import NetworkSink

    client = redis.Redis.from_url(url)

    def members(group_name: str, timeout_s: float) -> list[str]:
        key = members_key(RUN, group_name)
        return agree_members(
            lambda: client.get(key), lambda v: client.set(key, v, nx=True), timeout_s
        )

    def asked() -> str | None:
        raw = client.get(regroup_key(RUN))
        return None if raw is None else raw.decode()

    sink = NetworkSink(
        master_address="127.0.0.1",
        master_port=port,
        server_ranks=2,
        backend="gloo",
        bucket_bytes=64 * 1024,
        timeout_s=60.0,
        put_manifest=lambda m: client.set(manifest_key(RUN, m.version), m.to_json()),
        members=members,
        regroup_asked=asked,
        join_timeout_s=10.0,
    )
    model = load_model(model_dir, "cpu", "float32")
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    while (version := go.get()) is not None:
        t0 = time.monotonic()
        sink.publish(version, tensors, lambda v, p: None)
        results.put((version, sink.failures, time.monotonic() - t0))
    sink.close()


async def test_a_late_server_is_not_waited_for_and_gets_the_next_version(tmp_path: Path) -> None:
    for version in (0, 1):
        materialize(ModelConfig(tiny=TinyModelConfig(), seed=version), tmp_path / f"v{version}")
    expect = load_model(tmp_path / "v1", "cpu", "float32")
    valkey = EmbeddedValkey(appendonly=False).start()
    ctx = mp.get_context("spawn")
    go, results = ctx.Queue(), ctx.Queue()
    cfg = load_config(None, ["rollout.weight_sync=network", f"run.run_id={RUN}"])
    source = network_source(cfg, aredis.Redis.from_url(valkey.url))
    assert source is not None
    inf = InferenceConfig(weights_dir=str(tmp_path))

    def server(port: int = 0) -> ServerThread:
        app = build_server_app(ModelConfig(path=str(tmp_path / "v0")), inf)
        return ServerThread(app, port=port)

    proc = None
    try:
        with server() as early_url:
            # ports taken once the early server listens, so none of them is its
            store_port, late_port = free_port(), free_port()
            assert store_port != late_port
            late_url = f"http://127.0.0.1:{late_port}"
            args = (str(tmp_path / "v1"), store_port, valkey.url, go, results)
            proc = ctx.Process(target=trainer_side, args=args)
            proc.start()
            async with (
                InferenceClient(early_url, timeout_s=60) as early,
                InferenceClient(late_url, timeout_s=60) as late,
            ):
                d = Dispatcher([early, late], probe_interval_s=60)
                assert await wait_for_servers(d, cfg.rollout) == 1  # `first`, the default
                every = cfg.rollout.model_copy(
                    update={"wait_for_servers": "all", "startup_timeout_s": 0.5}
                )
                with pytest.raises(TimeoutError, match=f"down: {late_url} "):
                    await wait_for_servers(d, every)
                sync = WeightSync(d, MemoryProducer(), UpdateGate(), None, source)
                d.on_recover = sync.recover
                await sync.start("abort")
                go.put(1)
                t0 = time.monotonic()
                await sync.update(1, "")
                assert time.monotonic() - t0 < 20  # not a rendezvous timeout
                assert await early.weight_version() == 1 and d.servers[0].healthy
                one = await asyncio.to_thread(results.get, True, 30)
                assert one[:2] == (1, 0)  # v1 delivered to the server that was up
                with server(late_port):
                    # `all` now finds both; the late one asks for a new group on its way
                    every.startup_timeout_s = 30
                    assert await wait_for_servers(d, every) == 2
                    assert await late.weight_version() == 0
                    go.put(2)
                    await sync.update(2, "")
                    two = await asyncio.to_thread(results.get, True, 30)
                    assert two[:2] == (2, 0)
                    assert [await c.weight_version() for c in (early, late)] == [2, 2]
                    prompt = [4, 8, 15, 16]
                    res = await late.generate(prompt, SamplingParams(max_new_tokens=8))
                    want = recompute(expect, prompt, res.output_ids)
                    torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
                    assert all(s.healthy for s in d.servers)
    finally:
        go.put(None)
        if proc is not None:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        valkey.stop()
    assert proc is not None and proc.exitcode == 0
