"""Real DeepSpeed on CPU (gloo), launched through `areal-hex train`: 2 ranks in
micro-batches (ZeRO-2; ZeRO-3 via torchrun) equal 1 rank on the whole batch, SIGKILL +
resume on the real buffer, published weights served by the inference engine.
(Micro-batches alone: tests/unit/test_trainer_step.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
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
        # two optimizer updates per step: the second one sees ratios != 1 (clipping)
        "algo": {"aggregation": "seq_mean_token_mean", "behav_cap": 5.0, "ppo_minibatches": 2},
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
    cmd = [sys.executable, "-m", "hexctl.cli", "train", str(path)]
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


def whole_run(assets: dict[str, Path]) -> Path:
    """The reference run (1 rank, whole batch), made once per module."""
    run_dir = assets["dir"] / "runs" / "whole"
    if not (run_dir / "weights" / "v2" / "model.safetensors").is_file():
        run_train(assets, "whole", {})
    return run_dir


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

    whole = whole_run(assets)
    two, _ = run_train(
        assets,
        "two",
        {"trainer.num_ranks": 2, "trainer.zero_stage": 2, "trainer.micro_batch_tokens": 40},
    )
    # ZeRO-3 through the torchrun launcher: parameters gathered for forward and publication
    three, _ = run_train(
        assets,
        "three",
        {"trainer.num_ranks": 2, "trainer.zero_stage": 3, "trainer.launcher": "torchrun"},
    )
    ref = metrics(whole)
    for other in (two, three):
        got = metrics(other)
        assert [m["step"] for m in got] == [1, 2]
        for a, b in zip(ref, got, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
            assert b["behav_weight_mean"] == pytest.approx(a["behav_weight_mean"], abs=1e-5)
            assert b["clip_frac"] == pytest.approx(a["clip_frac"], abs=1e-6)
    # the weights moved, and moved identically
    after1, w_whole = weights(whole, 1), weights(whole, 2)
    assert any(not torch.equal(after1[k], w_whole[k]) for k in after1)
    assert_same_weights(w_whole, weights(two, 2), 1e-5)
    assert_same_weights(w_whole, weights(three, 2), 1e-5)
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


@pytest.mark.timeout(600)
def test_sigterm_checkpoints_the_last_completed_step(assets: dict[str, Path]) -> None:
    """SIGTERM to the trainer's process group (what the launcher sends) while it waits for
    a batch: it checkpoints the steps done since the last checkpoint, acknowledges their
    groups and exits; the resume continues from that step, each group trained once."""
    import redis

    from areal_hex.buffer import BufferKeys, EmbeddedValkey
    from hexctl.launch.supervisor import Supervisor
    from hexctl.report.ledger import trained_twice
    from trainer_service.checkpoint import read_committed
    from trainer_service.sources import ReplayConsumer

    groups = ReplayConsumer(assets["replay"]).groups[:12] * 2  # 24 entries, 6 steps of 4
    with EmbeddedValkey(appendonly=False) as server:
        over = {
            "redis.url": server.url,
            "buffer.max_staleness": 100,
            "trainer.replay_path": None,
            "trainer.total_steps": 6,
            "trainer.checkpoint_every": 4,
            "trainer.publish_every": 2,
        }
        fill_buffer(server.url, "termed", groups[:12])  # 3 steps; then it waits for more
        run_dir, proc = run_train(assets, "termed", over, wait=False)
        assert proc is not None
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or metrics(run_dir)[-1]["step"] < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "no step 3"
            time.sleep(0.05)
        time.sleep(1.0)  # waiting for step 4's batch
        os.killpg(proc.pid, signal.SIGTERM)
        assert Supervisor._wait_group(proc.pid, 120), "the trainer did not exit"
        proc.wait(timeout=10)
        assert (run_dir / "checkpoints" / "step3" / "COMPLETE").is_file()
        r = redis.Redis.from_url(server.url)
        assert int(r.get(BufferKeys("termed").acked)) == 12  # all three steps committed
        assert [c["step"] for c in read_committed(run_dir / "committed.jsonl")] == [3]

        fill_buffer(server.url, "termed", groups[12:])
        run_train(assets, "termed", over)
        assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
        assert int(r.get(BufferKeys("termed").acked)) == 24
        assert trained_twice(run_dir / "committed.jsonl") == 0
        assert "stopped (checkpointed) at step 3" in (assets["dir"] / "termed.log").read_text()


@pytest.mark.timeout(300)
def test_published_weights_serve_the_trainers_log_probs(assets: dict[str, Path]) -> None:
    """v2 loaded by the inference engine samples with the log-probs the trainer's own
    model (restored from its DeepSpeed checkpoint) assigns to the same tokens."""
    import asyncio

    import torch

    from areal_hex.config import InferenceConfig, ModelConfig
    from areal_hex.models import load_model
    from rollout_service.server.main import build_engine
    from rollout_service.wire import SamplingParamsIn
    from trainer_service.batching import collate, flatten_groups
    from trainer_service.engine import token_logprobs
    from trainer_service.sources import ReplayConsumer
    from trainer_service.synthetic import synthetic_groups

    run_dir = whole_run(assets)
    v2 = run_dir / "weights" / "v2"
    prompt = ReplayConsumer(assets["replay"]).groups[0].prompt_ids.tolist()
    engine = build_engine(ModelConfig(path=str(assets["model"])), InferenceConfig())

    async def sample() -> tuple[list[int], list[float], str]:
        engine.start()
        try:
            await engine.update_weights(str(v2), "2", abort_all=False)
            req = await engine.generate(
                prompt, SamplingParamsIn(max_new_tokens=12, temperature=0.7), "r"
            )
            return req.output_ids, req.logprobs, req.weight_version
        finally:
            engine.stop()

    out_ids, server_lp, version = asyncio.run(sample())
    assert version == "2" and len(out_ids) > 0
    state = torch.load(
        run_dir / "checkpoints" / "step2" / "mp_rank_00_model_states.pt", weights_only=False
    )
    trained = load_model(assets["model"])
    trained.load_state_dict(state["module"])
    group = synthetic_groups(1, 1, 10, seed=0)[0]
    group.prompt_ids = np.asarray(prompt, dtype=np.int32)
    comp = group.completions[0]
    comp.token_ids = np.asarray(out_ids, dtype=np.int32)
    comp.logprobs = np.zeros(len(out_ids), dtype=np.float32)
    comp.versions = np.zeros(len(out_ids), dtype=np.int32)
    group.temperature = 0.7
    mb = collate(flatten_groups([group]), pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(trained, mb)
    ours = logp[mb.loss_mask > 0].tolist()
    assert ours == pytest.approx(server_lp, abs=1e-4)
    # and the published file holds exactly the trainer's weights
    published = weights(run_dir, 2)
    for k, v in published.items():
        assert torch.equal(v, state["module"][k]), k
