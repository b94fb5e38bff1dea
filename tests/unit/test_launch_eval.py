"""`areal-hex eval` through a real built-in server on loopback, checked against greedy
decoding with the HF model directly and the same reward function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_hex.config import load_config
from hexctl.report.evaluate import EvalOptions, evaluate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from areal_hex.models import materialize

    cfg = load_config(None, ["model.tiny.num_layers=1", "model.tiny.hidden_size=32"])
    return materialize(cfg.model, tmp_path_factory.mktemp("w") / "v0")


def overrides(weights: Path) -> list[str]:
    return [
        f"model.path={weights}",
        "rollout.max_new_tokens=12",
        "data.arithmetic.max_value=5",
        "data.limit=6",
    ]


def greedy_reference(cfg, weights: Path) -> float:  # cfg: ExperimentConfig
    """pass@1 computed without the server: HF greedy generate + math_reward."""
    import torch

    from areal_hex.data import build_prompts, load_problems
    from areal_hex.models import load_model, load_tokenizer
    from areal_hex.rewards import math_reward

    tok, model = load_tokenizer(weights), load_model(weights)
    prompts = build_prompts(load_problems(cfg.data, "test"), tok, cfg.data).prompts
    right = 0.0
    for p in prompts:
        x = torch.tensor([p.input_ids])
        with torch.no_grad():
            out = model.generate(
                x, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id
            )
        right += math_reward(tok.decode(out[0, x.shape[1] :], skip_special_tokens=True), p.answer)
    return right / len(prompts)


@pytest.mark.timeout(180)
def test_eval_matches_direct_greedy_decoding(weights: Path) -> None:
    cfg = load_config(None, overrides(weights))
    res = evaluate(cfg, EvalOptions(str(weights), split="test", k=3))
    assert res["problems"] == 6 and res["split"] == "test" and res["version"] == "0"
    assert res["pass@1"] == pytest.approx(greedy_reference(cfg, weights))
    assert 0.0 <= res["sampled_accuracy"] <= res["pass@3"] <= 1.0


@pytest.mark.timeout(180)
def test_eval_cli_json_and_bad_version(weights: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "hexctl.cli", "eval", *overrides(weights)]
    res = subprocess.run(
        [*base, "--weights", str(weights), "--n", "2", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["problems"] == 2 and set(out) >= {"pass@1", "weights", "seconds"}
    bad = subprocess.run(
        [*base, f"run.output_dir={tmp_path}", "run.run_id=r", "--weights", "v7"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "version 7 not in" in bad.stderr and "Traceback" not in bad.stderr
