"""The tiny reward model's data and build: every constructed answer is labelled with the
rule's own reward, the held-out examples never share a problem with the training ones,
and the build is deterministic and cached (a second call reads it)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from areal_hex.config import ExperimentConfig
from areal_hex.config.base import build
from areal_hex.data import generate_arithmetic
from areal_hex.models import build_tokenizer
from areal_hex.reward_model import (
    INFO_FILE,
    completions,
    examples,
    load_reward_model,
    tiny_key,
    tiny_reward_model,
)
from areal_hex.rewards import math_reward

SMALL = {
    "model": {"tiny": {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64}},
    "data": {"num_generated": 30},
    "rollout": {"reward_model": {"tiny_train_steps": 3}},
}


def test_labels_are_the_rules_reward() -> None:
    rng = random.Random(0)
    problems = generate_arithmetic(40, "train")
    seen = set()
    for p in problems:
        for text, label in completions(p, rng):
            assert math_reward(text, p.answer) == label, (text, p.answer)
            seen.add(label)
    assert seen == {0.0, 1.0}


def test_train_and_heldout_examples_share_no_problem() -> None:
    cfg = build(ExperimentConfig, SMALL, "test")
    tok = build_tokenizer()
    train = {e.text.split("<|im_end|>")[0] for e in examples(cfg, tok, "train")}
    test = {e.text.split("<|im_end|>")[0] for e in examples(cfg, tok, "test")}
    assert train and test and not train & test


@pytest.mark.timeout(120)
def test_built_once_deterministic_and_cached(tmp_path: Path) -> None:
    import torch

    cfg = build(ExperimentConfig, SMALL, "test")
    a = tiny_reward_model(cfg, tmp_path / "a")
    info = json.loads((a / INFO_FILE).read_text())
    assert a.name == tiny_key(cfg)[0] and info["steps"] == 3
    assert 0 <= info["heldout_accuracy"] <= 1 and info["test_examples"] > 0
    assert tiny_reward_model(cfg, tmp_path / "a") == a  # cached: not trained again
    assert json.loads((a / INFO_FILE).read_text()) == info
    b = tiny_reward_model(cfg, tmp_path / "b")
    wa, wb = load_reward_model(a).state_dict(), load_reward_model(b).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    other = build(ExperimentConfig, {**SMALL, "model": {**SMALL["model"], "seed": 1}}, "t")
    assert tiny_key(other)[0] != tiny_key(cfg)[0]
