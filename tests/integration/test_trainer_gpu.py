"""ZeRO-2 and ZeRO-3 on CUDA in bf16 with a ~0.45B-parameter Qwen3 built from a config
(skipped without a GPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

# 28 layers x (3.1M attention + 12.6M MLP) ~ 0.44B parameters
SIZE = {
    "num_layers": 28,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "num_kv_heads": 8,
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from areal_hex.config import ModelConfig, TinyModelConfig
    from areal_hex.models import materialize
    from trainer_service.sources import write_replay
    from trainer_service.synthetic import synthetic_groups

    d = tmp_path_factory.mktemp("gpu")
    model_dir = materialize(ModelConfig(tiny=TinyModelConfig(**SIZE)), d / "model")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    groups = synthetic_groups(8, 4, vocab, prompt_len=64, completion_len=(64, 256), seed=1)
    return {"dir": d, "model": model_dir, "replay": write_replay(d / "g.jsonl", groups)}


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_cuda_bf16(assets: dict[str, Path], stage: int) -> None:
    from safetensors import safe_open

    name = f"zero{stage}"
    cfg = {
        "run": {"run_id": name, "output_dir": str(assets["dir"] / "runs")},
        "model": {"path": str(assets["model"])},
        "buffer": {"groups_per_step": 4},
        "trainer": {
            "device": "cuda",
            "zero_stage": stage,
            "total_steps": 2,
            "lr": 1e-5,
            "replay_path": str(assets["replay"]),
            "micro_batch_tokens": 2048,
        },
    }
    path = assets["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [sys.executable, "-m", "hexctl.cli", "train", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = assets["dir"] / "runs" / name
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows)
    with safe_open(str(run / "weights" / "v2" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert len(keys) > 100
        w = f.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert str(w.dtype) == "torch.bfloat16"
    assert json.loads((run / "weights" / "v2" / "config.json").read_text())["dtype"] == "bfloat16"
