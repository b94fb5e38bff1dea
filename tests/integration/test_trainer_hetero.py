"""Heterogeneous data parallelism on real DeepSpeed (gloo, CPU): two ranks, one slowed by
the test-only throttle (`AREAL_HEX_TEST_THROTTLE=1:4`, rank 1 takes 4x as long per
micro-batch), standing in for two GPU kinds in one trainer. Shares in proportion to the
ranks' speeds make the step shorter than equal shares, and the weights still move exactly
as one rank on the whole batch moves them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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

    d = tmp_path_factory.mktemp("hetero")
    model_dir = materialize(ModelConfig(tiny=TinyModelConfig(), seed=3), d / "model")
    model = load_model(model_dir)
    groups = synthetic_groups(
        24, 4, model.config.vocab_size, 8, (16, 32), seed=5, temperature=0.7, model=model
    )
    return {"dir": d, "model": model_dir, "replay": write_replay(d / "groups.jsonl", groups)}


def train(assets: dict[str, Path], name: str, trainer: dict, throttle: str | None) -> Path:
    cfg = {
        "run": {"run_id": name, "output_dir": str(assets["dir"] / "runs")},
        "model": {"path": str(assets["model"])},
        "buffer": {"groups_per_step": 8},
        "algo": {"aggregation": "seq_mean_token_mean"},
        "trainer": {
            "total_steps": 4,
            "lr": 1e-3,
            "adam_eps": 1e-6,  # see test_trainer_dist: bounds summation-order noise
            "replay_path": str(assets["replay"]),
            "checkpoint_every": 100,
            "micro_batch_tokens": 160,  # several micro-batches per rank
            **trainer,
        },
    }
    path = assets["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("AREAL_HEX_TEST_THROTTLE", None)
    if throttle is not None:
        env["AREAL_HEX_TEST_THROTTLE"] = throttle
    log_path = assets["dir"] / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_hex.cli", "train", str(path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, log_path.read_text()[-3000:]
    return assets["dir"] / "runs" / name


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "weights" / "v4" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_uneven_shares_are_exact(assets: dict[str, Path]) -> None:
    slow = "1:4"
    whole = train(assets, "whole", {}, None)
    equal = train(assets, "equal", {"num_ranks": 2}, slow)
    balanced = train(assets, "balanced", {"num_ranks": 2, "rank_speeds": [4.0, 1.0]}, slow)
    measured = train(assets, "measured", {"num_ranks": 2, "balance_measured": True}, slow)
    ref = weights(whole)
    for run in (equal, balanced, measured):
        got = weights(run)
        for k, v in ref.items():
            diff = (got[k].float() - v.float()).abs().max().item()
            assert diff <= 1e-5, f"{run.name} {k}: {diff}"
