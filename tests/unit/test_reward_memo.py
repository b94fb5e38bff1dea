"""The reward's shortcuts give math-verify's rewards: plain integers compared without it,
parses remembered per answer text, and completions of a real run scored as that run did
(by workers that made their first checks as they started)."""

from __future__ import annotations

import asyncio

import pytest

from areal_hex.data import Prompt
from areal_hex.math_check import (
    WARM_UP,
    ParseMemo,
    extract_final_answer,
    math_reward,
    parse_misses,
    plain_integer_reward,
)
from areal_hex.rewards import RewardPool

# Plain integers, with the neighbours and lengths where a shortcut would go wrong.
PLAIN = ["0", "1", "7", "17", "18", "71", "100", "-17", "123456789", "-999999999"]


def test_plain_integers_score_as_math_verify_does() -> None:
    for gold in ["0", "17", "-17", "123456789"]:
        for answer in PLAIN:
            want = math_reward(f"2 + 15 = {answer}\n#### {answer}", gold)
            assert plain_integer_reward(answer, gold) == want, (answer, gold)


@pytest.mark.parametrize(
    "text", ["017", "+5", "-0", "1,000", "1 7", " 17", "17.0", "1234567890", "", "x", "17?"]
)
def test_other_texts_are_left_to_math_verify(text: str) -> None:
    assert plain_integer_reward(text, "17") is None
    assert plain_integer_reward("17", text) is None


def test_parse_memo_gives_the_parse_and_is_bounded() -> None:
    from math_verify import parse

    memo = ParseMemo(2)
    first = memo("\\frac{1}{2}")
    assert str(first) == str(parse("\\boxed{\\frac{1}{2}}"))
    assert memo("\\frac{1}{2}") is first and (memo.hits, memo.misses) == (1, 1)
    memo("17")
    memo("x^{2}")  # the oldest goes
    assert memo("\\frac{1}{2}") is not first and memo.misses == 4
    assert memo("") == [] and memo("") == [] and memo.misses == 6  # empty: parsed again
    with pytest.raises(ValueError, match="size"):
        ParseMemo(0)


# Completions of a README run (tiny_cpu.yaml) and the rewards that run gave them.
RUN = [
    ("5", [("3 + 2 = 5", 0.0), ("3 + 2 = 4\n#### 4", 0.0), ("3 + 2 = 5\n#### 0", 0.0),
           ("3 + 2 = 5\n#### Pant\n### ", 0.0), ("3 + 2 = 5\n#### 5", 1.0)]),
    ("16", [("14 + 2 = 16\n#### 16", 1.0), ("14 + 2 = 17\n#### 17s= 5", 0.0),
            ("14 + 2 + 17", 0.0)]),
    ("11", [("11 + 0 = 11\n#### 11", 1.0), ("11 + 0 = 1+1\n#### 21", 0.0),
            ("11 + 0 = 11\n####311", 0.0), ("11 + 0 = 11\n#### 1G", 0.0)]),
    ("33", [("15 + 18 = 33\n#### 33", 1.0), ("15 + 18 = 33ant\n#####w ", 0.0)]),
    ("28", [("13 + 15 = 28\n#### 28", 1.0), ("13 + 15 = 28\n#### 28\ta", 0.0),
            ("1\t + 15 = 28\n#### 28", 1.0), ("13 + 15 = 29\n#### 29", 0.0)]),
    ("35", [("17 + 18 = 35\n####=== 7", 0.0), ("17 + 18 = 35\n#### 34", 0.0),
            ("16 + 19 = 35\n#### 35l", 1.0)]),
    ("26", [("16 + 10 = 26\n#### 26t\na", 1.0), ("16 + 10 = 26\n#### 26", 1.0)]),
    ("21", [("8 + 13 = 21\n#### 21", 1.0), ("8 + 13 = 21\n#### 2nttt6", 0.0),
            ("3 + 13 = 21\n##jisii8 + 1", 0.0), ("8 + 13 = 21\n#### 29", 0.0)]),
]  # fmt: skip


async def test_a_runs_completions_score_as_that_run_did() -> None:
    pool = RewardPool(workers=1, timeout_s=30.0)
    await pool.start()
    try:
        for i, (gold, scored) in enumerate(RUN):
            texts = [t for t, _ in scored] * 2  # a group repeats its answers
            prompt = Prompt(id=f"p{i}", input_ids=[1], answer=gold, text="")
            got = await pool.score_group(prompt, texts)
            assert got == [r for _, r in scored] * 2, gold
    finally:
        await pool.aclose()
    # only the final answers that are not plain integers went to the worker: Pant, 17s= 5,
    # 1G, w, 28<tab>a, === 7, 35l, 26t and 2nttt6 (once each: the repeats are remembered)
    assert pool.stats.calls == 9 and pool.stats.failures == 0


def test_score_many_needs_no_worker_for_plain_integers() -> None:
    async def go() -> list[float]:
        pool = RewardPool(workers=1, timeout_s=5.0)  # never started: no worker to call
        return await pool.score_many(["#### 17", "#### 18", "no answer", "#### 17"], "17")

    assert asyncio.run(go()) == [1.0, 0.0, 0.0, 1.0]


# Answers a sampling policy writes (most from a README run) that parse to polynomials,
# with the cases where a shortcut would go wrong: a zero factor, terms that cancel,
# powers, products equal to the gold, repeated letters (not the imaginary unit).
POLYNOMIALS = [
    "j3", "3K6", "1r 3", "20nisss", "2h0", "a+ 7", "2^6", "27 7", "-a+a", "x-x+17",
    "(a+1)^2-a^2-2a", "aa-a^2", "x^{0}", "0^0", "2\\cdot 3", "16+1", "17x^{0}", "ii",
    "(x+1)^{2}", "x^{32}-x^{32}+17", "0\\cdot x + 17", "(-1)^{2}\\cdot 17", "28g", "00", "17i",
]  # fmt: skip
# Not polynomials in integers and generic letters: left to math-verify.
OTHERS = [
    "t", "3e", "i^2", "\\pi", "\\frac{a}{a}", "17.0", "8.5\\cdot 2", "17\\%", "x=17",
    "17,17", "\\{17\\}", "17^{-1}", "x^{65}", "(10^{64})^{64}", "\\sqrt{289}", "17!", "24%",
]  # fmt: skip


def test_polynomial_verdict_is_math_verifys() -> None:
    from math_verify import verify

    from areal_hex.math_check import polynomial_verdict

    memo = ParseMemo(256)
    decided = 0
    for gold in ["17", "0", "1", "-1", "64"]:
        for answer in POLYNOMIALS:
            got = polynomial_verdict(memo(gold), memo(answer))
            assert got is not None, (answer, gold)
            assert got == verify(memo(gold), memo(answer)), (answer, gold)
            decided += got
        for answer in OTHERS:
            assert polynomial_verdict(memo(gold), memo(answer)) is None, (answer, gold)
    assert decided >= 8  # some of them equal a gold answer: the test sees both verdicts
    assert polynomial_verdict(memo("\\frac{1}{2}"), memo("3r")) is None  # not an integer gold


def misses_in_worker(completion: str, gold: str) -> float:
    """A reward function for the pool below: the answers its worker has parsed."""
    return float(parse_misses())


def test_warm_up_answers_each_reach_the_parser() -> None:
    """Every warm-up answer is one the controller sends to a worker: it has a final
    answer, it is not a plain integer, and each is a new text to parse."""
    assert len(set(WARM_UP)) == len(WARM_UP)
    for a in WARM_UP:
        assert extract_final_answer(f"#### {a}") == a, a
        assert plain_integer_reward(a, "17") is None, a


@pytest.mark.timeout(60)
async def test_workers_start_warm() -> None:
    """A math_reward pool's worker has parsed the warm-up answers (and their gold answer)
    before its first call; a pool told not to warm has parsed none."""
    for warm, want in ((True, len(WARM_UP) + 1), (False, 0)):
        pool = RewardPool(workers=1, timeout_s=30.0, fn=misses_in_worker, warm=warm)
        await pool.start()
        try:
            assert await pool.score("#### x", "1") == float(want), warm
        finally:
            await pool.aclose()
    assert RewardPool(1, 5.0).warm and not RewardPool(1, 5.0, fn=misses_in_worker).warm
