"""Real DeepSpeed on CPU (gloo), launched through `areal-hex train`: 2 ranks equal 1 rank,
micro-batches equal the whole batch, ZeRO-3 gathers for publication, SIGKILL + resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from areal_hex.config import ModelConfig, TinyModelConfig
    from areal_hex.models import load_model, materialize
    from trainer_service.sources import write_replay
    from trainer_service.synthetic import synthetic_groups

    d = tmp_path_factory.mktemp("trainer")
    model_dir = materialize(ModelConfig(tiny=TinyModelConfig(), seed=3), d / "model")
    model = load_model(model_dir)
    # behaviour log-probs of the initial model at T = 0.7, shifted a little so the
    # decoupled weight pi_prox / pi_behav is not exactly 1
    groups = synthetic_groups(12, 4, model.config.vocab_size, seed=5, temperature=0.7, model=model)
    for g in groups:
        for c in g.completions:
            c.logprobs = c.logprobs - 0.05
    replay = write_replay(d / "groups.jsonl", groups)
    return {"dir": d, "model": model_dir, "replay": replay}


def run_train(
    assets: dict[str, Path], name: str, overrides: dict, wait: bool = True
) -> tuple[Path, subprocess.Popen | None]:
    cfg = {
        "run": {"run_id": name, "output_dir": str(assets["dir"] / "runs")},
        "model": {"path": str(assets["model"])},
        "buffer": {"groups_per_step": 4},
        "algo": {"aggregation": "seq_mean_token_mean", "behav_cap": 5.0},
        "trainer": {
            "total_steps": 2,
            "lr": 1e-3,
            # Adam divides each gradient element by its own magnitude, so summation-order
            # noise on near-zero elements (~1e-10) could move them by up to lr; eps bounds
            # that gain to lr / eps while real gradients (>> eps) train as usual.
            "adam_eps": 1e-6,
            "replay_path": str(assets["replay"]),
            "checkpoint_every": 100,
            "micro_batch_tokens": 4096,
        },
    }
    for key, value in overrides.items():
        section, field = key.split(".")
        cfg.setdefault(section, {})[field] = value
    path = assets["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "areal_hex.cli", "train", str(path)]
    log = open(assets["dir"] / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    run_dir = assets["dir"] / "runs" / name
    if not wait:
        return run_dir, proc
    try:
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log.close()
    assert rc == 0, (assets["dir"] / f"{name}.log").read_text()[-3000:]
    return run_dir, None


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path, version: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "weights" / f"v{version}" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k].float() - b[k].float()).abs().max().item()
        assert diff <= atol, f"{k}: max abs diff {diff}"


@pytest.mark.timeout(600)
def test_ranks_and_micro_batches_match_whole_batch(assets: dict[str, Path]) -> None:
    import torch

    whole, _ = run_train(assets, "whole", {})
    micro, _ = run_train(assets, "micro", {"trainer.micro_batch_tokens": 40})
    two, _ = run_train(
        assets,
        "two",
        {"trainer.num_ranks": 2, "trainer.zero_stage": 2, "trainer.micro_batch_tokens": 40},
    )
    ref = metrics(whole)
    for other in (micro, two):
        got = metrics(other)
        assert [m["step"] for m in got] == [1, 2]
        for a, b in zip(ref, got, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
            assert b["behav_weight_mean"] == pytest.approx(a["behav_weight_mean"], abs=1e-5)
            assert b["clip_frac"] == pytest.approx(a["clip_frac"], abs=1e-6)
    # the weights moved, and moved identically
    init = weights(whole, 1)
    w_whole = weights(whole, 2)
    assert any(not torch.equal(init[k], w_whole[k]) for k in init)
    assert_same_weights(w_whole, weights(micro, 2), 1e-5)
    assert_same_weights(w_whole, weights(two, 2), 1e-5)
    assert metrics(two)[-1]["groups_trained_total"] == 8


def fill_buffer(url: str, run_id: str, groups: list) -> None:
    import asyncio

    from areal_hex.buffer import RedisEndpoint, RedisTrajectoryProducer
    from areal_hex.config import BufferConfig

    async def put() -> None:
        prod = RedisTrajectoryProducer(
            RedisEndpoint(url).async_client(),
            run_id,
            BufferConfig(groups_per_step=4, max_staleness=100),
        )
        await prod.admit(len(groups))
        await prod.put_many(groups)
        await prod.aclose()

    asyncio.run(put())


@pytest.mark.timeout(600)
def test_sigkill_then_resume_trains_each_group_once(assets: dict[str, Path]) -> None:
    """Real buffer (embedded Valkey): kill -9 the trainer mid-run, restart with
    resume: auto; every group is acknowledged exactly once and the final weights equal an
    uninterrupted run's."""
    import redis

    from areal_hex.buffer import BufferKeys, EmbeddedValkey, read_stats
    from trainer_service.sources import ReplayConsumer

    groups = ReplayConsumer(assets["replay"]).groups[:12] * 2  # 24 entries, 6 steps of 4
    with EmbeddedValkey(appendonly=False) as server:
        over = {
            "redis.url": server.url,
            "buffer.max_staleness": 100,
            "trainer.replay_path": None,
            "trainer.total_steps": 6,
            "trainer.checkpoint_every": 2,
            "trainer.publish_every": 2,
        }
        for name in ("straight", "killed"):
            fill_buffer(server.url, name, groups)
        straight, _ = run_train(assets, "straight", over)
        run_dir, proc = run_train(assets, "killed", over, wait=False)
        assert proc is not None
        deadline = time.monotonic() + 240
        path = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if path.is_file() and any(m["step"] >= 3 for m in metrics(run_dir)):
                break
            assert proc.poll() is None, "trainer exited before it could be killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        first = metrics(run_dir)
        assert first[-1]["step"] < 6
        r = redis.Redis.from_url(server.url)
        mid = read_stats(r, BufferKeys("killed"))
        assert mid.pending > 0  # trained after the last commit, so not acknowledged
        # a half-written checkpoint must never be picked: fake one at a later step
        (run_dir / "checkpoints" / "step5").mkdir(parents=True)
        run_train(assets, "killed", {**over, "trainer.resume": "auto"})
        rows = metrics(run_dir)
        resumed = rows[len(first) :]
        start = resumed[0]["step"]
        assert start in (3, 5), f"resumed at step {start}"
        assert [m["step"] for m in resumed] == list(range(start, 7))
        by_step = {m["step"]: m for m in metrics(straight)}
        for m in resumed:
            assert m["loss"] == pytest.approx(by_step[m["step"]]["loss"], abs=1e-5)
            assert m["groups_trained_total"] == 4 * m["step"]
        assert_same_weights(weights(straight, 6), weights(run_dir, 6), 1e-5)
        end = read_stats(r, BufferKeys("killed"))
        assert (end.stream_length, end.pending, end.version) == (0, 0, 6)
        assert int(r.get(BufferKeys("killed").acked)) == 24  # each group acked exactly once
        assert end.submitted == 24
