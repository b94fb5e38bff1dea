"""`rollout.reward`: rule, model or a weighted sum, refused with what was wrong and what
was expected; a model weight needs a reward-model task and a reward-model task a model
weight; `serve --reward-model` finds its instance's port."""

from __future__ import annotations

import argparse

import pytest

from areal_hex.config import ConfigError, ExperimentConfig
from areal_hex.config.base import build
from areal_hex.config.reward import reward_weights

RM_TASK = {
    "name": "rm",
    "role": "reward_model",
    "port": 31000,
    "instances": 2,
    "command": ["areal-hex", "serve", "{config}", "--reward-model", "--index", "{index}"],
}


def config(reward: object = None, tasks: list | None = None) -> ExperimentConfig:
    data: dict = {"rollout": {} if reward is None else {"reward": reward}}
    if tasks is not None:
        data["workflow"] = {"tasks": tasks}
    return build(ExperimentConfig, data, "test")


def test_the_default_is_the_rule() -> None:
    cfg = config()
    assert cfg.rollout.reward == "rule" and reward_weights(cfg.rollout.reward) == {"rule": 1.0}


@pytest.mark.parametrize(
    ("reward", "weights"),
    [("model", {"model": 1.0}), ({"rule": 1, "model": 0.5}, {"rule": 1.0, "model": 0.5})],
)
def test_model_and_weighted_sums_with_a_reward_model_task(reward: object, weights: dict) -> None:
    cfg = config(reward, [RM_TASK])
    assert reward_weights(cfg.rollout.reward) == weights


@pytest.mark.parametrize(
    ("reward", "says"),
    [
        ("rul", "unknown reward source 'rul'"),
        ({"rule": 1, "critic": 1}, "unknown reward source 'critic'"),
        ({"rule": 1, "model": 0}, "weight of 'model' is 0, which does nothing"),
        ({"model": "high"}, "weight of 'model' is 'high': expected a number"),
        ({"model": True}, "expected a number"),
        ({}, "expected 'rule', 'model', or weights"),
        (3, "expected 'rule', 'model', or weights"),
    ],
)
def test_bad_values_name_the_key_and_what_was_expected(reward: object, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(reward, [RM_TASK])
    assert "rollout.reward" in str(err.value) and says in str(err.value)


def test_a_model_weight_without_a_reward_model_task_names_both_keys() -> None:
    with pytest.raises(ConfigError) as err:
        config({"rule": 1.0, "model": 0.5})
    msg = str(err.value)
    assert "rollout.reward" in msg and "workflow.tasks" in msg and "role reward_model" in msg


def test_a_reward_model_task_the_reward_never_calls_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        config("rule", [RM_TASK])
    assert "task 'rm' has role reward_model" in str(err.value)
    assert "never be called" in str(err.value)


def test_serve_reward_model_port_of_each_instance() -> None:
    from hexctl.cli import UsageError, build_parser

    cfg = config("model", [RM_TASK])
    from hexctl.cli.serve_cmd import reward_model_port

    assert reward_model_port(cfg, 1, None) == 31001
    assert reward_model_port(cfg, 0, 4000) == 4000
    with pytest.raises(UsageError, match="instances of task 'rm'"):
        reward_model_port(cfg, 2, None)
    with pytest.raises(UsageError, match="no task with role reward_model"):
        reward_model_port(config(), 0, None)
    args = build_parser().parse_args(["serve", "c.yaml", "--reward-model", "--index", "1"])
    assert isinstance(args, argparse.Namespace) and args.reward_model and args.index == 1
