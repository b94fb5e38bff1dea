"""Evaluation a researcher can trust: every problem of the split is in the denominator,
a context that cannot hold prompt + answer is a config error, one file never silently
serves both train and test, and answers are scored by the configured reward workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from areal_hex.config import ConfigError, load_config
from areal_hex.data import DataError, load_problems
from hexctl.report.evaluate import EvalOptions, evaluate


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from areal_hex.models import materialize

    cfg = load_config(None, ["model.tiny.num_layers=1", "model.tiny.hidden_size=32"])
    return materialize(cfg.model, tmp_path_factory.mktemp("w") / "v0")


def _gsm_file(path: Path, questions: list[str]) -> Path:
    rows = [{"question": q, "answer": f"so\n#### {i}"} for i, q in enumerate(questions)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


QUESTIONS = ["What is 1 + 0?", "What is 2 + 0?", "Why " * 60 + "?", "How " * 60 + "?"]


def test_context_overflow_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="inference.context_length 512"):
        load_config(None, ["data.max_prompt_tokens=500", "rollout.max_new_tokens=32"])
    with pytest.raises(ConfigError, match="model.tiny.max_position_embeddings 64"):
        load_config(None, ["model.tiny.max_position_embeddings=64"])
    cfg = load_config(None, ["data.max_prompt_tokens=480", "rollout.max_new_tokens=32"])
    assert cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens == 512


@pytest.mark.timeout(180)
def test_skipped_prompts_stay_in_the_denominator(weights: Path, tmp_path: Path) -> None:
    data = _gsm_file(tmp_path / "test.jsonl", QUESTIONS)
    cfg = load_config(
        None,
        [f"model.path={weights}", "data.dataset=gsm8k", f"data.path={data}",
         "data.max_prompt_tokens=150", "rollout.max_new_tokens=4"],
    )  # fmt: skip
    res = evaluate(cfg, EvalOptions(str(weights), split="test"))
    # two questions render to more than 150 tokens: not sent, scored 0, still counted
    assert res["problems"] == 4 and res["skipped_overlong"] == 2
    assert res["refused"] == 0
    assert res["pass@1"] <= 0.5


@pytest.mark.timeout(180)
def test_a_server_refusal_scores_zero_and_is_counted(weights: Path, tmp_path: Path) -> None:
    from areal_hex.config import InferenceConfig, ModelConfig
    from rollout_service.server.main import ServerThread, build_server_app

    data = _gsm_file(tmp_path / "test.jsonl", QUESTIONS)
    cfg = load_config(
        None,
        [f"model.path={weights}", "data.dataset=gsm8k", f"data.path={data}",
         "data.max_prompt_tokens=400", "rollout.max_new_tokens=8"],
    )  # fmt: skip
    # a running server whose context (120) is smaller than the config's: long prompts 400
    app = build_server_app(ModelConfig(path=str(weights)), InferenceConfig(context_length=120))
    with ServerThread(app) as url:
        res = evaluate(cfg, EvalOptions(None, split="test", server_url=url))
    assert res["problems"] == 4 and res["skipped_overlong"] == 0
    assert res["refused"] == 2
    assert res["pass@1"] <= 0.5


def test_one_file_never_serves_two_splits_silently(tmp_path: Path) -> None:
    data = _gsm_file(tmp_path / "problems.jsonl", [f"What is {i} + 1?" for i in range(40)])
    cfg = load_config(None, ["data.dataset=gsm8k", f"data.path={data}"]).data
    for split in ("train", "test"):
        with pytest.raises(DataError, match="does not name split"):
            load_problems(cfg, split)
    # a file whose name names the split serves that split only
    named = _gsm_file(tmp_path / "gsm8k_test.jsonl", QUESTIONS)
    by_name = cfg.model_copy(update={"path": str(named)})
    assert len(load_problems(by_name, "test")) == 4
    with pytest.raises(DataError, match="data.file_split"):
        load_problems(by_name, "train")
    # explicit rules: a hash split (disjoint, covering) or the whole file on purpose
    hashed = cfg.model_copy(update={"file_split": "hash", "file_test_fraction": 0.25})
    train, test = load_problems(hashed, "train"), load_problems(hashed, "test")
    assert len(train) + len(test) == 40 and test and train
    assert not {p.question for p in train} & {p.question for p in test}
    as_is = cfg.model_copy(update={"file_split": "as_is"})
    assert len(load_problems(as_is, "test")) == 40


@pytest.mark.timeout(180)
def test_eval_scores_with_the_configured_reward_workers(
    weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import areal_hex.rewards as rewards

    seen: list[int] = []
    real = rewards.RewardPool

    def recording(workers: int, *args: Any, **kw: Any) -> Any:
        seen.append(workers)
        return real(workers, *args, **kw)

    monkeypatch.setattr(rewards, "RewardPool", recording)
    cfg = load_config(
        None,
        [f"model.path={weights}", "rollout.max_new_tokens=4", "rollout.reward_workers=2",
         "data.arithmetic.max_value=5", "data.limit=2"],
    )  # fmt: skip
    res = evaluate(cfg, EvalOptions(str(weights), split="test"))
    assert seen == [2] and res["problems"] == 2
