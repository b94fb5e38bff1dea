"""`bench trl`: the mapping of the job onto trl.GRPOConfig, the prompts and reward TRL's
run gets, and the JSON the bench prints (the two runs and the evals replaced: they take
minutes; TRL itself never runs here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_hex.config import ConfigError, load_config
from areal_hex.data import build_prompts, iterate_prompts, load_problems
from areal_hex.models import build_tokenizer
from hexctl.bench.system import trl as bench
from hexctl.bench.system.trl_worker import gsm8k_reward, load_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")
HAVE_TRL = importlib.util.find_spec("trl") is not None


def test_the_readme_job_maps_onto_grpo_config() -> None:
    kw = bench.grpo_config_kwargs(load_config(TINY), seed=3, output_dir="/x")
    assert kw["num_generations"] == 16
    assert kw["per_device_train_batch_size"] == 8 * 16  # one step = 8 groups of 16
    assert (kw["gradient_accumulation_steps"], kw["num_iterations"]) == (1, 1)
    assert (kw["max_completion_length"], kw["temperature"], kw["top_k"]) == (24, 1.2, 0)
    assert (kw["max_steps"], kw["learning_rate"], kw["lr_scheduler_type"]) == (80, 3e-4, "constant")
    assert (kw["loss_type"], kw["scale_rewards"], kw["beta"]) == ("dapo", "group", 0.0)
    assert (kw["epsilon"], kw["epsilon_high"], kw["delta"]) == (0.2, 0.28, None)
    assert (kw["max_grad_norm"], kw["adam_beta2"], kw["weight_decay"]) == (1.0, 0.999, 0.0)
    assert (kw["bf16"], kw["gradient_checkpointing"], kw["use_cpu"]) == (False, False, True)
    assert (kw["shuffle_dataset"], kw["seed"]) == (False, 3)


def test_other_settings_map_to_their_trl_names() -> None:
    cfg = load_config(TINY, [
        "trainer.warmup_steps=5", "algo.advantage=drgrpo", "algo.objective=gspo",
        "algo.aggregation=seq_mean_token_mean", "algo.kl_coef=0.01", "algo.dual_clip=3.0",
        "algo.overlong_mask=true",
    ])  # fmt: skip
    kw = bench.grpo_config_kwargs(cfg, 0, "/x")
    assert kw["lr_scheduler_type"] == "constant_with_warmup" and kw["warmup_steps"] == 5
    assert (kw["scale_rewards"], kw["importance_sampling_level"]) == ("none", "sequence")
    assert (kw["loss_type"], kw["beta"], kw["delta"]) == ("grpo", 0.01, 3.0)
    assert kw["mask_truncated_completions"] is True


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("algo.advantage=rloo", "algo.advantage"),
        ("algo.aggregation=seq_mean_token_sum", "algo.aggregation"),
        ("algo.ppo_minibatches=2", "algo.ppo_minibatches"),
        ("algo.overlong_buffer=4", "algo.overlong_buffer"),
        ("rollout.dynamic_sampling=true", "rollout.dynamic_sampling"),
    ],
)
def test_a_setting_trl_cannot_reproduce_is_refused(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        bench.grpo_config_kwargs(load_config(TINY, [override]), 0, "/x")


def test_kl_maps_only_as_trls_k3() -> None:
    cfg = load_config(TINY, ["algo.kl_coef=0.01", "algo.kl_estimator=k2"])
    with pytest.raises(ConfigError, match="algo.kl_"):
        bench.grpo_config_kwargs(cfg, 0, "/x")


@pytest.mark.skipif(not HAVE_TRL, reason="trl not installed (pip install -e .[trl])")
def test_trl_accepts_the_mapping(tmp_path: Path) -> None:
    from trl import GRPOConfig

    kw = bench.grpo_config_kwargs(load_config(TINY), 0, str(tmp_path))
    args = GRPOConfig(**kw)
    # one generation batch = one optimizer step's 8 prompts x 16 completions
    assert (args.generation_batch_size, args.steps_per_generation) == (128, 1)
    assert args.loss_type == "dapo" and args.scale_rewards == "group"


def test_trl_gets_the_controllers_prompts_in_its_order() -> None:
    cfg = load_config(TINY)
    tok = build_tokenizer()
    rows = bench.prompt_rows(cfg, tok, 20)
    prompts = build_prompts(load_problems(cfg.data, cfg.data.split), tok, cfg.data).prompts
    want = [p for _, p in zip(range(20), iterate_prompts(prompts, cfg.data.seed), strict=False)]
    assert [r["ids"] for r in rows] == [list(p.input_ids) for _, p in want]
    assert [r["answer"] for r in rows] == [p.answer for _, p in want]
    assert rows[0]["prompt"].startswith("<|im_start|>user\n")


def test_trls_tokenization_is_checked_against_the_controllers(tmp_path: Path) -> None:
    tok = build_tokenizer()
    rows = bench.prompt_rows(load_config(TINY), tok, 4)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_rows(path, tok) == [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]
    rows[2]["ids"] = rows[2]["ids"][1:]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="differ"):
        load_rows(path, tok)


def test_the_reward_is_the_runs_math_reward() -> None:
    got = gsm8k_reward(["13 + 4 = 17\n#### 17", "#### 16", "13 + 4 = 17"], ["17"] * 3)
    assert got == [1.0, 0.0, 0.0]


def _fake_side(rate: float) -> dict[str, Any]:
    steady = rate * (1.1 if rate > 150 else 1.5)
    return {"samples_per_s": rate, "steady_samples_per_s": steady, "wall_s": 6000 / rate}


@pytest.mark.skipif(not HAVE_TRL, reason="trl not installed (pip install -e .[trl])")
def test_json_of_runs_back_to_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    order: list[str] = []
    rates = iter([300.0, 200.0, 100.0, 250.0])

    def areal(
        config: str, overrides: list[str], out: Path, run_id: str, profile: Path | None = None
    ) -> dict[str, Any]:
        order.append(run_id)
        assert profile == tmp_path / "profile"  # the machine profiled once, given to each run
        seed = next(o for o in overrides if o.startswith("run.seed="))
        assert f"inference.{seed[4:]}" in overrides and any("model.path=" in o for o in overrides)
        run_dir = out / run_id
        run_dir.mkdir()
        return {**_fake_side(next(rates)), "run_dir": str(run_dir)}

    def trl(spec: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
        order.append(name)
        assert Path(spec["v0"], "config.json").is_file()
        assert len(Path(spec["rows"]).read_text().splitlines()) == 2 * 8
        return _fake_side(next(rates))

    profiled: list[list[str]] = []

    def profile(config: str, overrides: list[str], out: Path) -> tuple[Path, float]:
        profiled.append(overrides)
        return out / "profile", 12.34

    monkeypatch.setattr(bench, "run_areal", areal)
    monkeypatch.setattr(bench, "run_trl", trl)
    monkeypatch.setattr(bench, "profile_machine", profile)
    pass1 = {"latest": 0.5, "final": 0.25, "v0": 0.1}  # areal-hex's, TRL's, v0
    monkeypatch.setattr(bench, "evaluate", lambda cfg, weights, log: pass1[Path(weights).name])
    argv = ["bench", "trl", "--json", "--steps", "2", "--repeats", "2", "--output-dir",
            str(tmp_path), "model.tiny.sft_steps=0"]  # fmt: skip
    from hexctl.cli import main

    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)  # stdout is the one JSON object, nothing else
    # the two sides alternate which goes first
    assert order == ["areal-s0-r0", "trl-s0-r0", "trl-s0-r1", "areal-s0-r1"]
    assert out["ratios"] == [300 / 200, 250 / 100]
    assert (out["ratio_min"], out["ratio_max"]) == (1.5, 2.5)
    assert out["ratio_median"] == 2.0
    assert out["steady_ratios"] == pytest.approx([330 / 220, 275 / 150])  # per run
    assert out["wall_ratios"] == pytest.approx([300 / 200, 250 / 100])
    assert out["areal_hex_pass@1"] == [0.5, 0.5] and out["trl_pass@1"] == [0.25, 0.25]
    assert [r["first"] for r in out["runs"]] == ["areal-hex", "trl"]
    assert out["v0_pass@1"] == 0.1 and out["steps"] == 2
    assert out["grpo_config"]["max_steps"] == 2
    assert len(profiled) == 1 and any(o.startswith("model.path=") for o in profiled[0])
    assert out["profile_seconds"] == 12.3


def test_without_trl_the_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hexctl.cli import main

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl -> ImportError
    assert main(["bench", "trl", "--json"]) == 2
    assert "pip install -e .[trl]" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_TRL, reason="trl not installed (pip install -e .[trl])")
def test_a_missing_model_path_is_named(tmp_path: Path) -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "hexctl.cli", "bench", "trl", "--json", "--steps", "1"]
    argv += ["--output-dir", str(tmp_path / "out"), f"model.path={tmp_path / 'nowhere'}"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"model.path {tmp_path / 'nowhere'}: does not exist" in r.stderr
    assert "Traceback" not in r.stderr
