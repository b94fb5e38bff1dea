"""The answer length a profile prices a run at (`hexctl/profile/lengths.py`): the mean of
the initial policy's answers that the job's rule reward rewards (scored on the tiny
tokenizer), the initial mean where too few are or the reward is not the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config import load_config
from areal_hex.data import Prompt
from areal_hex.models import build_tokenizer
from hexctl.profile.lengths import (
    MIN_REWARDED,
    rewarded_mean,
    rule_scorer,
    run_response_tokens,
)

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _prompts(tok: object) -> list[Prompt]:
    texts = {"p1": ("What is 13 + 4?", "17"), "p2": ("What is 2 + 5?", "7")}
    return [
        Prompt(pid, tok.encode(q, add_special_tokens=False), gold, q)  # type: ignore[attr-defined]
        for pid, (q, gold) in texts.items()
    ]


def test_the_rule_rewards_the_answer_with_the_gold_final_line() -> None:
    tok = build_tokenizer()
    prompts = _prompts(tok)
    score = rule_scorer(load_config(TINY), tok, prompts)
    assert score is not None

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    p1, p2 = prompts[0].input_ids, prompts[1].input_ids
    right, bare, wrong = ids("13 + 4 = 17\n#### 17"), ids("13 + 4 = 17"), ids("2 + 5 = 8\n#### 8")
    short = ids("2 + 5 = 7\n#### 7")
    answered = [(p1, right), (p1, bare), (p2, wrong), (p2, short)]
    assert [score(p, a) for p, a in answered] == [1.0, 0.0, 0.0, 1.0]
    # the rewarded answers' mean length: those with their final line, once there are
    # enough of them to say
    many = answered * (MIN_REWARDED // 2)
    assert rewarded_mean(many, score) == pytest.approx((len(right) + len(short)) / 2)
    assert rewarded_mean(answered, score) is None  # two rewarded: too few
    assert rewarded_mean([(p1, bare), (p2, wrong)] * MIN_REWARDED, score) is None
    assert rewarded_mean(many, None) is None


def test_a_reward_other_than_the_rule_scores_nothing() -> None:
    tok = build_tokenizer()
    cfg = load_config(TINY)
    for reward in ("model", {"rule": 1.0, "model": 0.5}):
        rollout = cfg.rollout.model_copy(update={"reward": reward})
        other = cfg.model_copy(update={"rollout": rollout})
        assert rule_scorer(other, tok, _prompts(tok)) is None


def test_a_run_is_priced_at_the_rewarded_length() -> None:
    assert run_response_tokens(16.5, 19.8) == 19.8
    assert run_response_tokens(16.5, None) == 16.5
    # rewarded answers shorter than the mean (a reward for brevity): the run shortens
    assert run_response_tokens(20.0, 12.0) == 12.0
