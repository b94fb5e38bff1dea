"""`areal-hex serve` and `areal-hex bench rollout` as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_hex.api import SamplingParams
from areal_hex.config import ModelConfig, TinyModelConfig
from areal_hex.models import materialize
from areal_hex.net import free_port
from rollout_service.client import GenerationError, InferenceClient

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.mark.timeout(120)
async def test_serve_command_runs_the_builtin_server(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=0), weights / "v0")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=1), weights / "v1")
    port = free_port()
    cfg = {
        "model": {"path": str(weights / "v0")},
        "inference": {"base_port": port - 1, "num_servers": 2, "weights_dir": str(weights),
                      "api_key": "k"},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "hexctl.cli", "serve", str(path), "--index", "1"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with InferenceClient(f"http://127.0.0.1:{port}", api_key="k") as c:
            await c.wait_healthy(timeout_s=90, interval_s=0.2)
            res = await c.generate([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
            assert len(res.output_ids) == 4 and len(res.logprobs) == 4
            assert res.weight_version == 0
            await c.pause()
            await c.update_weights_from_disk(str(weights / "v1"), 1)
            await c.resume()
            assert (await c.generate([5], SamplingParams(max_new_tokens=1))).weight_version == 1
            async with InferenceClient(c.base_url) as anonymous:
                with pytest.raises(GenerationError) as err:
                    await anonymous.generate([5], SamplingParams(max_new_tokens=1))
                assert err.value.status == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down cleanly, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM), out.decode()[-2000:]
    assert b"Traceback" not in out


def test_serve_rejects_bad_index() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hexctl.cli", "serve", "model.tiny={}", "--index", "3"],
        env=env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--index 3" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(240)
def test_bench_rollout_json() -> None:
    args = "--requests 6 --batch-size 3 --min-new 4 --max-new 12 --max-prompt 12 --rounds 1".split()
    cmd = [sys.executable, "-m", "hexctl.cli", "bench", "rollout", "--json", *args]
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["requests"] == 6 and result["server_tokens"] == result["useful_tokens"]
    for key in ("server_tokens_per_s", "hf_generate_tokens_per_s", "p50_latency_s"):
        assert result[key] > 0, key
    assert result["p99_latency_s"] >= result["p50_latency_s"]
    assert result["rounds"] == 1 and len(result["server_tokens_per_s_rounds"]) == 1
    assert result["server_decode_steps"] > 0 and result["server_prefill_batches"] > 0
    assert result["ratio"] == pytest.approx(
        result["server_tokens_per_s"] / result["hf_generate_tokens_per_s"]
    )


def test_bench_cuda_without_cuda_exits_cleanly() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cmd = [sys.executable, "-m", "hexctl.cli", "bench", "rollout", "--json",
           "--device", "cuda", "--model-size", "0.5b"]  # fmt: skip
    out = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "CUDA is not available" in out.stderr
    assert "Traceback" not in out.stderr
