"""The answer length a profile prices a run at (`hexctl/profile/lengths.py`): the middle
of the initial policy's mean and its rewarded answers', scored with the job's rule
reward on the tiny tokenizer; the initial mean where nothing is rewarded or the reward
is not the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config import load_config
from areal_hex.data import Prompt
from areal_hex.models import build_tokenizer
from hexctl.profile.lengths import rewarded_mean, rule_scorer, run_response_tokens

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
    answered = [(p1, right), (p1, bare), (p2, wrong), (p2, ids("2 + 5 = 7\n#### 7"))]
    assert [score(p, a) for p, a in answered] == [1.0, 0.0, 0.0, 1.0]
    # the rewarded answers' mean length: the two with their final line
    assert rewarded_mean(answered, score) == pytest.approx((len(right) + 16) / 2)
    assert rewarded_mean([(p1, bare), (p2, wrong)], score) is None
    assert rewarded_mean(answered, None) is None


def test_a_reward_other_than_the_rule_scores_nothing() -> None:
    tok = build_tokenizer()
    cfg = load_config(TINY)
    for reward in ("model", {"rule": 1.0, "model": 0.5}):
        rollout = cfg.rollout.model_copy(update={"reward": reward})
        other = cfg.model_copy(update={"rollout": rollout})
        assert rule_scorer(other, tok, _prompts(tok)) is None


def test_a_run_is_priced_between_the_initial_and_the_rewarded_length() -> None:
    assert run_response_tokens(16.2, 21.7) == pytest.approx(18.95)
    assert run_response_tokens(16.2, None) == 16.2
    # rewarded answers shorter than the mean (a reward for brevity): the run shortens
    assert run_response_tokens(20.0, 12.0) == pytest.approx(16.0)
