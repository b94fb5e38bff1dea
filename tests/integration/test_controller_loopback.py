"""The rollout controller with real parts on loopback: two `areal-hex serve` processes
(tiny Qwen3), an embedded Valkey, the buffer's producer/consumer/publisher."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from areal_hex.buffer import (
    EmbeddedValkey,
    RedisEndpoint,
    RedisTrajectoryConsumer,
    RedisTrajectoryProducer,
    RedisWeightPublisher,
    read_stats,
)
from areal_hex.buffer.keys import BufferKeys
from areal_hex.config import BufferConfig, DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
from areal_hex.data import build_prompts, generate_arithmetic
from areal_hex.models import load_model, load_tokenizer, materialize
from areal_hex.net import free_port
from areal_hex.record import GroupRecord
from rollout_service.client import InferenceClient
from rollout_service.controller.rollout import RolloutController

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


@dataclass
class Stack:
    weights: Path
    config: Path
    ports: list[int]
    procs: list[subprocess.Popen[bytes]]
    endpoint: RedisEndpoint

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]


def start_server(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hexctl.cli", "serve", str(config), "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("ctl")
    weights = root / "weights"
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=0), weights / "v0")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=1), weights / "v1")
    config = root / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(weights / "v0")},
                "inference": {"weights_dir": str(weights), "max_running_requests": 32},
            }
        )
    )
    ports = [free_port(), free_port()]
    procs = [start_server(config, p, root / f"server{i}.log") for i, p in enumerate(ports)]
    valkey = EmbeddedValkey(appendonly=False).start()
    try:
        yield Stack(weights, config, ports, procs, RedisEndpoint(valkey.url, server=valkey))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        valkey.stop()


TOK = None


def tokenizer(stack: Stack):
    global TOK
    if TOK is None:
        TOK = load_tokenizer(stack.weights / "v0")
    return TOK


async def make_controller(
    stack: Stack, run_id: str, buf: BufferConfig, max_groups: int | None, **rollout: object
) -> tuple[RolloutController, list[InferenceClient], RedisTrajectoryProducer]:
    tok = tokenizer(stack)
    prompts = build_prompts(generate_arithmetic(16, "train"), tok, DataConfig()).prompts
    clients = [InferenceClient(u, timeout_s=None) for u in stack.urls()]
    producer = RedisTrajectoryProducer(stack.endpoint.async_client(), run_id, buf)
    base = {"group_size": 4, "max_new_tokens": 48, "metrics_interval_s": 0.5}
    ctl = RolloutController(
        clients,
        producer,
        prompts,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        RolloutConfig(**{**base, **rollout}),
        max_groups=max_groups,
        stop_token_ids=[tok.eos_token_id],
        weights_dir=str(stack.weights),
    )
    await ctl.dispatcher.wait_healthy(timeout_s=120, min_servers=len(clients))
    return ctl, clients, producer


async def close(clients: list[InferenceClient], producer: RedisTrajectoryProducer) -> None:
    await producer.aclose()
    await producer.r.aclose()
    for c in clients:
        await c.close()


def read_groups(stack: Stack, run_id: str, buf: BufferConfig, n: int) -> list[GroupRecord]:
    consumer = RedisTrajectoryConsumer(stack.endpoint.sync_client(), run_id, buf)
    batch = consumer.get_batch(n, timeout_s=10)
    consumer.ack(batch.entry_ids)
    return batch.groups


async def wait_for(cond, timeout_s: float = 60.0, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(step)


async def test_gate_respected_and_stop_consistent(stack: Stack) -> None:
    run_id = f"g{uuid.uuid4().hex[:8]}"
    buf = BufferConfig(groups_per_step=2, max_staleness=0, gate_timeout_s=60)
    ctl, clients, producer = await make_controller(stack, run_id, buf, None, max_new_tokens=8)
    run = asyncio.create_task(ctl.run())
    try:
        await wait_for(lambda: ctl.stats["groups_produced_total"] >= 2)
        await asyncio.sleep(1.5)  # the gate (v=0, eta=0, B=2) must hold the third prompt
        stats = read_stats(stack.endpoint.sync_client(), BufferKeys(run_id))
        assert stats.submitted == 2 and stats.stream_length == 2
        assert ctl.stats["groups_produced_total"] == 2 and len(ctl._tasks) == 0
    finally:
        ctl.request_stop()
        final = await asyncio.wait_for(run, 30)
        await close(clients, producer)
    assert final["groups_produced_total"] == 2 and final["groups_in_flight"] == 0
    assert read_stats(stack.endpoint.sync_client(), BufferKeys(run_id)).submitted == 2
    groups = read_groups(stack, run_id, buf, 2)
    assert all(len(g.completions) == 4 for g in groups)


async def test_dynamic_sampling_ledger_with_real_buffer(stack: Stack) -> None:
    """Filtered groups never reach the stream and give their admission back: the stream
    and the gate hold exactly produced - filtered groups, each with its servers."""
    run_id = f"d{uuid.uuid4().hex[:8]}"
    buf = BufferConfig(groups_per_step=2, max_staleness=50, gate_timeout_s=60)
    ctl, clients, producer = await make_controller(
        stack, run_id, buf, 3, max_new_tokens=8, dynamic_sampling=True,
        dynamic_sampling_max_factor=2,
    )  # fmt: skip
    try:
        final = await asyncio.wait_for(ctl.run(), 120)
    finally:
        await close(clients, producer)
    produced, filtered = final["groups_produced_total"], ctl.stats["groups_filtered_total"]
    kept = produced - filtered
    assert 3 <= produced <= 6 and kept <= 3
    assert kept == 3 or produced == 6  # enough informative groups, or the bound was hit
    stats = read_stats(stack.endpoint.sync_client(), BufferKeys(run_id))
    assert stats.stream_length == kept and stats.submitted == kept
    for g in read_groups(stack, run_id, buf, kept) if kept else []:
        assert len(set(g.rewards.tolist())) > 1
        assert {c.server for c in g.completions} <= set(stack.urls())


@pytest.mark.parametrize("pause", ["abort", "auto", "in_place"])
async def test_weight_reload_interrupts_and_resumes(stack: Stack, pause: str) -> None:
    # abort: requests in flight end and are resent (SGLang's way); auto: our servers
    # report per-token versions, so they keep the requests and recompute their KV cache;
    # in_place: they keep the requests and the KV cache the old weights computed.
    run_id = f"w{uuid.uuid4().hex[:8]}"
    buf = BufferConfig(groups_per_step=8, max_staleness=1, gate_timeout_s=60)
    ctl, clients, producer = await make_controller(
        stack, run_id, buf, 8, max_new_tokens=300, max_concurrent_groups=8, update_pause=pause
    )
    for c in clients:  # the servers are shared by the module's tests: start from v0
        await c.update_weights_from_disk(str(stack.weights / "v0"), 0)
    run = asyncio.create_task(ctl.run())
    try:
        await wait_for(lambda: ctl.dispatcher.in_flight >= 8)
        # publish while they run: some answers end early (EOS), so do not wait long
        await asyncio.sleep(0.05)
        publisher = RedisWeightPublisher(stack.endpoint.sync_client(), run_id, buf)
        publisher.set_version(1, str(stack.weights / "v1"))
        final = await asyncio.wait_for(run, 120)
    finally:
        await close(clients, producer)
    assert final["version"] == 1 and final["weight_syncs_total"] == 1
    assert final["groups_produced_total"] == 8
    if pause == "abort":
        assert final["requests_aborted_total"] >= 1
    else:
        kept = "in_place" if pause == "in_place" else "retract"
        assert ctl.weights.pause_mode == kept and final["requests_aborted_total"] == 0
    for c in clients:
        async with InferenceClient(c.base_url) as fresh:
            assert (await fresh.weight_version()) == 1
    groups = read_groups(stack, run_id, buf, 8)
    prompts = {tuple(g.prompt_ids) for g in groups}
    assert len(groups) == 8 and len(prompts) == 8
    mixed = []
    for g in groups:
        assert len(g.completions) == 4 and g.temperature == 1.0
        for c in g.completions:
            n = len(c.token_ids)
            assert 0 < n <= 300 and len(c.logprobs) == n == len(c.versions)
            assert c.finish_reason in ("stop", "length") and np.all(c.logprobs <= 0)
            assert set(c.versions.tolist()) <= {0, 1} and np.all(np.diff(c.versions) >= 0)
            assert c.finish_reason == "length" or c.token_ids[-1] == tokenizer(stack).eos_token_id
            if c.versions[0] == 0 and c.versions[-1] == 1:
                mixed.append((g, c))
    assert mixed, "no completion spans the reload"
    # in_place: the tokens after the reload were sampled over a KV cache of v0, so only
    # the ones before it recompute exactly from one version's weights
    exact = (0,) if pause == "in_place" else (0, 1)
    check_logprobs_match_versions(stack, *mixed[0], versions=exact)


def check_logprobs_match_versions(
    stack: Stack, g: GroupRecord, c, versions: tuple[int, ...] = (0, 1)
) -> None:
    """Recompute the behaviour log-probs with each version's weights: the tokens before
    the reload came from v0, the rest from v1 given the full prefix."""
    import torch

    ids = torch.tensor([[*g.prompt_ids.tolist(), *c.token_ids.tolist()]])
    p = len(g.prompt_ids)
    for v in versions:
        model = load_model(stack.weights / f"v{v}")
        with torch.no_grad():
            logits = model(ids).logits[0, p - 1 : -1]  # (T, V): predicts each output token
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, p:, None])[:, 0].numpy()
        mask = c.versions == v
        np.testing.assert_allclose(lp[mask], c.logprobs[mask], atol=2e-3)


def test_rollout_cli_runs_and_stops_on_sigterm(stack: Stack, tmp_path: Path) -> None:
    run_id = f"c{uuid.uuid4().hex[:8]}"
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path)},
        "redis": {"url": stack.endpoint.url},
        "model": {"path": str(stack.weights / "v0")},
        "inference": {"server_urls": stack.urls(), "weights_dir": str(stack.weights)},
        "buffer": {"groups_per_step": 4, "max_staleness": 0},
        "rollout": {"group_size": 2, "max_new_tokens": 16, "metrics_interval_s": 0.5},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "hexctl.cli", "rollout", str(path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / run_id / "rollout.jsonl"
    r = stack.endpoint.sync_client()
    try:
        deadline = time.monotonic() + 90
        while read_stats(r, BufferKeys(run_id)).stream_length < 4:  # gate: (0 + 0 + 1) * 4
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert b"Traceback" not in err
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    final = lines[-1]
    assert final["final"] is True and final == json.loads(out.decode().strip().splitlines()[-1])
    assert final["groups_produced_total"] == 4 and final["groups_in_flight"] == 0
    for key in ("samples_per_s", "reward_mean", "reward_failures_total", "gen_busy_s",
                "requests_retried_total", "requests_aborted_total"):  # fmt: skip
        assert key in final
    stats = read_stats(r, BufferKeys(run_id))
    assert stats.submitted == stats.stream_length == 4


async def test_killed_server_requests_finish_elsewhere(stack: Stack) -> None:
    run_id = f"k{uuid.uuid4().hex[:8]}"
    buf = BufferConfig(groups_per_step=100, gate_timeout_s=60)
    ctl, clients, producer = await make_controller(
        stack, run_id, buf, 6, max_new_tokens=300, request_timeout_s=30, max_concurrent_groups=6
    )
    run = asyncio.create_task(ctl.run())
    victim = ctl.dispatcher.servers[1]
    try:
        await wait_for(lambda: victim.in_flight >= 2)
        stack.procs[1].kill()
        stack.procs[1].wait(timeout=10)
        final = await asyncio.wait_for(run, 120)
    finally:
        await close(clients, producer)
    assert final["groups_produced_total"] == 6 and final["groups_failed_total"] == 0
    assert final["requests_retried_total"] >= 2 and final["servers_healthy"] == 1
    assert not victim.healthy and victim.failures_total >= 1
    groups = read_groups(stack, run_id, buf, 6)
    assert sum(len(g.completions) for g in groups) == 24


def test_rollout_cli_usage_errors(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "hexctl.cli", "rollout"]
    cases = [
        (["model.tiny={}"], "run.run_id is not set"),
        (["run.run_id=x", "model.tiny={}"], "redis.url is not set"),
        (
            ["run.run_id=x", "model.tiny={}", "redis.url=redis://127.0.0.1:1/0",
             "data.dataset=gsm8k", f"data.path={tmp_path / 'missing.jsonl'}"],
            "missing.jsonl: no such file",
        ),
    ]  # fmt: skip
    for args, message in cases:
        out = subprocess.run([*base, *args], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr[-2000:]
        assert message in out.stderr and "Traceback" not in out.stderr
