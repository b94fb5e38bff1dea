"""Weights over the network: the built-in server joins a gloo group whose rank 0 is a
trainer-side broadcaster in another process (trainer_service.publish.NetworkSink, on
loopback), the controller's WeightSync drives /init_weights_update_group and
/update_weights_from_distributed bucket by bucket, and the server then samples with
exactly the broadcast weights. Bad bodies are 400s naming what is wrong."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import load_model, materialize
from areal_hex.net import free_port
from areal_hex.weight_net import Manifest
from rollout_service.client import GenerationError, InferenceClient
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.weight_sync import NetworkSource, UpdateGate, WeightSync
from rollout_service.server.main import ServerThread, build_server_app
from tests.fakes import MemoryProducer

pytestmark = pytest.mark.timeout(300)
BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """weights/v0 and weights/v1: two tiny models with different random weights."""
    root = tmp_path_factory.mktemp("weights")
    for version in (0, 1):
        materialize(ModelConfig(tiny=TinyModelConfig(), seed=version), root / f"v{version}")
    return root


def trainer_side(
    model_dirs: list[str], port: int, manifests: Any, results: Any, timeout_s: float = 60.0
) -> None:
    """Rank 0 in its own process: publish version i + 1 = the weights of model_dirs[i],
    each over the same group, as the trainer's rank 0 does."""
    from areal_hex.models import load_model
    from trainer_service.publish import NetworkSink

    sink = NetworkSink(
        master_address="127.0.0.1",
        master_port=port,
        server_ranks=1,
        backend="gloo",
        bucket_bytes=BUCKET_BYTES,
        timeout_s=timeout_s,
        put_manifest=lambda m: manifests.put(m.to_json()),
    )
    times = []
    for i, d in enumerate(model_dirs):
        model = load_model(d, "cpu", "float32")
        tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        sink.publish(i + 1, tensors, lambda v, p: None)
        times.append(sink.last_sync_s)
    sink.close()
    results.put({"failures": sink.failures, "sync_s": times})


def recompute(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output_t | prompt, output_<t) at temperature 1, one forward pass."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T_out, V)
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


async def tokens_generated(client: InferenceClient) -> float:
    for line in (await client.metrics_text()).splitlines():
        if line.startswith("sglang:generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("generation_tokens_total missing from /metrics")


def start(weights: Path) -> ServerThread:
    inf = InferenceConfig(weights_dir=str(weights))
    return ServerThread(build_server_app(ModelConfig(path=str(weights / "v0")), inf))


async def test_weights_broadcast_then_generated_with(weights: Path) -> None:
    models = {v: load_model(weights / f"v{v}", "cpu", "float32") for v in (0, 1)}
    ctx = mp.get_context("spawn")
    manifests, results = ctx.Queue(), ctx.Queue()
    # v1's weights as version 1, then v0's as version 2, through one group
    dirs = [str(weights / "v1"), str(weights / "v0")]
    proc = ctx.Process(target=trainer_side, args=(dirs, free_port(), manifests, results))
    proc.start()
    seen: dict[int, Manifest] = {}

    async def read(version: int) -> Manifest | None:
        while not manifests.empty():
            m = Manifest.from_json(manifests.get())
            seen[m.version] = m
        return seen.get(version)

    prompt = [5, 9, 14, 3, 7]
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    try:
        with start(weights) as url:
            async with InferenceClient(url, timeout_s=120) as c:
                dispatcher = Dispatcher([c])
                assert await dispatcher.wait_healthy(30) == 1
                producer = MemoryProducer()
                sync = WeightSync(
                    dispatcher, producer, UpdateGate(), None, NetworkSource(read, timeout_s=120)
                )
                await sync.start("in_place")
                # the trainer side is up (its first manifest is out) before requests run
                assert await NetworkSource(read, timeout_s=120).manifest(1) is not None
                long = SamplingParams(max_new_tokens=480, ignore_eos=True)
                for version, expect in ((1, models[1]), (2, models[0])):
                    # in flight through the update: kept (in_place), its later tokens
                    # sampled by the new weights
                    before = await tokens_generated(c)
                    running = asyncio.ensure_future(c.generate(prompt, long))
                    while await tokens_generated(c) == before:
                        await asyncio.sleep(0.005)
                    await c.pause("in_place")  # held from here: surely in flight
                    await sync.update(version, "")
                    kept = await running
                    assert kept.finish_reason == "length" and kept.token_versions is not None
                    assert kept.token_versions[0] == version - 1
                    assert kept.token_versions[-1] == version
                    assert await c.weight_version() == version
                    assert len(seen[version].buckets) > 1
                    res = await c.generate(prompt, sampling)
                    got = torch.tensor(res.logprobs)
                    torch.testing.assert_close(
                        got, recompute(expect, prompt, res.output_ids), atol=1e-4, rtol=0
                    )
                    other = models[0] if expect is models[1] else models[1]
                    assert (got - recompute(other, prompt, res.output_ids)).abs().max() > 1e-3
                assert dispatcher.servers[0].healthy
                assert sync.joined == {url: seen[1].group.group_name}
                assert seen[2].group == seen[1].group  # the group was reused
                # a controller that lost track of the membership asks again: no error
                await c.init_weights_update_group(seen[1].group, 1)
                other = dataclasses.replace(seen[1].group, master_port=free_port())
                with pytest.raises(GenerationError, match="already joined as rank 1 of"):
                    await c.init_weights_update_group(other, 1)
        out = await asyncio.to_thread(results.get, True, 60)
        assert out["failures"] == 0
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


async def test_a_group_that_never_formed_is_replaced(weights: Path) -> None:
    """Version 1's group never forms (no server joins it): the trainer gives up after its
    timeout and version 2 comes with a new group, which the server joins and receives."""
    model = load_model(weights / "v1", "cpu", "float32")
    ctx = mp.get_context("spawn")
    manifests, results = ctx.Queue(), ctx.Queue()
    dirs = [str(weights / "v1"), str(weights / "v1")]
    args = (dirs, free_port(), manifests, results, 3.0)
    proc = ctx.Process(target=trainer_side, args=args)
    proc.start()
    seen: dict[int, Manifest] = {}

    async def read(version: int) -> Manifest | None:
        while not manifests.empty():
            m = Manifest.from_json(manifests.get())
            seen[m.version] = m
        return seen.get(version)

    try:
        with start(weights) as url:
            async with InferenceClient(url, timeout_s=60) as c:
                d = Dispatcher([c])
                assert await d.wait_healthy(30) == 1
                net = NetworkSource(read, timeout_s=120)
                sync = WeightSync(d, MemoryProducer(), UpdateGate(), None, net)
                await sync.start("abort")
                await sync.update(2, "")  # version 1 is skipped: its group never forms
                assert seen[2].group.group_name != seen[1].group.group_name
                assert await c.weight_version() == 2
                prompt = [4, 8, 15, 16]
                res = await c.generate(prompt, SamplingParams(max_new_tokens=8))
                expect = recompute(model, prompt, res.output_ids)
                torch.testing.assert_close(torch.tensor(res.logprobs), expect, atol=1e-4, rtol=0)
        out = await asyncio.to_thread(results.get, True, 60)
        assert out["failures"] == 1
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


BAD = [
    ("/init_weights_update_group", {"master_port": 1, "rank_offset": 1, "world_size": 2}),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2},
    ),
    (
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "mpi",
        },
    ),
    (
        "/init_weights_update_group",  # NCCL on a CPU server
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]},
    ),
    ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    (
        "/update_weights_from_distributed",
        {"names": ["nope.weight"], "dtypes": ["float32"], "shapes": [[4]]},
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[3, 3]]},
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["model.norm.weight"], "dtypes": ["int3"], "shapes": [[64]]},
    ),
    (
        "/update_weights_from_distributed",  # a group never joined
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]},
    ),
    (
        "/update_weights_from_distributed",
        {
            "names": ["model.norm.weight"],
            "dtypes": ["float32"],
            "shapes": [[64]],
            "load_format": "flattened_bucket",
        },
    ),
    ("/destroy_weights_update_group", {"group_name": "never-joined"}),
]


async def test_bad_weight_requests_are_400(weights: Path) -> None:
    with start(weights) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for path, body in BAD:
                r = await http.post(path, json=body)
                assert r.status_code == 400, (path, body, r.text)
                msg = r.json()
                assert msg.get("success") is False or "error" in msg, msg
            # the refused calls left the server as it was
            info = (await http.get("/get_model_info")).json()
            assert info["weight_version"] == "0"
            assert (await http.get("/health")).status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_short_run_syncs_over_the_network(tmp_path: Path) -> None:
    """`areal-hex run` of the tiny example with rollout.weight_sync=network: the run
    completes, every version reached the server over the group and none was written."""
    root = Path(__file__).resolve().parents[2]
    steps = 3
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.run_id=net",
        "run.profile_first=false",
        "model.tiny.sft_steps=20",
        f"trainer.total_steps={steps}",
        f"trainer.checkpoint_every={steps}",
        "rollout.group_size=4",
        "buffer.groups_per_step=4",
        "rollout.weight_sync=network",
        f"inference.base_port={free_port()}",
    ]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    example = root / "examples" / "tiny_cpu.yaml"
    res = subprocess.run(
        [sys.executable, "-m", "hexctl.cli", "run", str(example), *overrides, "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    run = tmp_path / "net"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    # from the second step on, each waited for the send before it: its time, and the
    # step's work after that wait (serial with the sends)
    for r in rows[1:]:
        assert r["write_s"] is not None and 0 < r["write_s"] < 60, r
        assert 0 <= r["write_delay_s"] < r["write_s"] + 1 and 0 < r["after_fence_s"] < 60, r
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v0"]  # nothing on disk
    last = json.loads((run / "rollout.jsonl").read_text().splitlines()[-1])
    assert last["weight_syncs_total"] == steps and last["servers_healthy"] == 1
    assert "weight update (" not in (run / "logs" / "controller.log").read_text()  # no failure
