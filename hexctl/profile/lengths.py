"""`profile --local`, answer lengths: the initial policy's, and the length a run's answers
will have on average.

A profile times the initial policy, and its answers are what it measures the mean length
of. A run trains that policy toward the answers its reward favours, so the answers it
generates move from the initial policy's toward the rewarded ones, and stay there once
it has learnt what the reward asks (the README job: 16.5 tokens for the initial policy's
answers, 19.8 for those the rule rewards; three runs generated 16.1-16.2 at the first
step, 20.0 at the last ten, 19.5-19.7 over the window the fidelity is measured in, and
trained 18.8-18.9 there). Generation and training cost per token, so the cost model
prices a sample at the length of a run that has learnt it: the profile scores the
answers whose length it measures with the job's rule reward and takes the rewarded
ones' mean (`run_response_tokens`). Where fewer than `MIN_REWARDED` answers are
rewarded (too few to say), or the reward is not the rule (a reward model, weights over
several), the initial policy's mean stands.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from areal_hex.config import ExperimentConfig

# (prompt ids, answer ids) -> the job's reward of the answer
Scorer = Callable[[Sequence[int], Sequence[int]], float]
MIN_REWARDED = 16  # rewarded answers that make their mean length the run's


def rule_scorer(cfg: ExperimentConfig, tok: Any, prompts: Sequence[Any]) -> Scorer | None:
    """The job's rule reward of an answer to one of `prompts` (`areal_hex.data.Prompt`:
    ids and gold answer), decoded as the controller decodes it; None where the job's
    reward is not the rule."""
    if cfg.rollout.reward != "rule":
        return None
    from areal_hex.math_check import extract_final_answer, math_reward, plain_integer_reward

    gold = {tuple(p.input_ids): p.answer for p in prompts}

    def score(prompt: Sequence[int], answer: Sequence[int]) -> float:
        want = gold.get(tuple(prompt))
        text = tok.decode(list(answer), skip_special_tokens=True)
        final = extract_final_answer(text)
        if want is None or final is None:
            return 0.0
        quick = plain_integer_reward(final, want)
        return quick if quick is not None else math_reward(text, want)

    return score


def rewarded_mean(
    answered: Sequence[tuple[Sequence[int], Sequence[int]]], score: Scorer | None
) -> float | None:
    """Mean length of the answers (prompt ids, answer ids) that `score` rewards (above
    0); None without a scorer or with fewer than `MIN_REWARDED` rewarded answers."""
    if score is None:
        return None
    lengths = [len(a) for p, a in answered if score(p, a) > 0]
    return statistics.fmean(lengths) if len(lengths) >= MIN_REWARDED else None


def run_response_tokens(initial: float, rewarded: float | None) -> float:
    """The mean answer length a run generates and trains on: its rewarded answers'
    (`rewarded_mean`), the initial policy's mean without those."""
    return initial if rewarded is None else rewarded
