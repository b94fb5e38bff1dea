from __future__ import annotations

import asyncio
import os
import time

import pytest

from areal_hex.rewards import RewardPool, extract_final_answer, math_reward


# Reward functions the spawned workers import from this module.
def slow_on_hang(completion: str, gold: str) -> float:
    if "hang" in completion:
        time.sleep(60)
    return math_reward(completion, gold)


def raise_on_bad(completion: str, gold: str) -> float:
    if "bad" in completion:
        raise ValueError("malformed answer")
    return math_reward(completion, gold)


def worker_pid(completion: str, gold: str) -> float:
    return float(os.getpid())


def die_on_crash(completion: str, gold: str) -> float:
    if "crash" in completion:
        os._exit(3)
    return math_reward(completion, gold)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234.\nmore text", "1,234"),
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{x^{2}}", "x^{2}"),
        ("#### 5 but \\boxed{6}", "6"),
        ("no answer here 7", None),
        ("####   ", None),
        ("#### $18", "18"),
    ],
)
def test_extract_final_answer(completion: str, expected: str | None) -> None:
    assert extract_final_answer(completion) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "reward"),
    [
        ("3 + 4 = 7\n#### 7", "7", 1.0),
        ("3 + 4 = 8\n#### 8", "7", 0.0),
        ("#### 1,234", "1234", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 3", "-3", 0.0),
        ("The answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("7", "7", 0.0),  # no #### and no \boxed{}: no final answer
        ("#### seven", "7", 0.0),
    ],
)
def test_math_reward(completion: str, gold: str, reward: float) -> None:
    assert math_reward(completion, gold) == reward


@pytest.mark.timeout(90)
async def test_pool_scores_and_survives_timeout_exception_crash() -> None:
    pool = RewardPool(workers=2, timeout_s=3.0, fn=slow_on_hang)
    await pool.start()
    try:
        t0 = time.monotonic()
        rewards = await pool.score_many(["#### 7", "#### 8", "hang #### 7", "\\boxed{7}"], "7")
        assert rewards == [1.0, 0.0, 0.0, 1.0]
        assert time.monotonic() - t0 < 30  # the hung answer was cut off, not awaited
        assert pool.stats.timeouts == 1 and pool.stats.failures == 1
        # the group's one call timed out (pool replaced), then each answer alone: the
        # hung one timed out again (replaced again)
        assert pool.stats.restarts == 2
        assert await pool.score("#### 7", "7") == 1.0  # the replaced pool works
        assert pool.stats.calls == 5
    finally:
        await pool.aclose()

    pool = RewardPool(workers=1, timeout_s=5.0, fn=raise_on_bad)
    await pool.start()
    try:
        group = ["bad #### 7", "#### 7", "#### 7", "bad #### 7", "#### 7"]
        assert await pool.score_many(group, "7") == [0.0, 1.0, 1.0, 0.0, 1.0]
        assert pool.stats.calls == 2  # identical completions are scored once
        assert pool.stats.failures == 1 and pool.stats.timeouts == 0
        assert pool.stats.restarts == 0
    finally:
        await pool.aclose()

    pool = RewardPool(workers=1, timeout_s=5.0, fn=die_on_crash)
    await pool.start()
    try:
        assert await pool.score("crash", "7") == 0.0
        assert pool.stats.failures == 1 and pool.stats.restarts == 1
        assert await pool.score("#### 7", "7") == 1.0
    finally:
        await pool.aclose()


@pytest.mark.timeout(60)
async def test_pool_never_blocks_event_loop() -> None:
    pool = RewardPool(workers=1, timeout_s=2.0, fn=slow_on_hang)
    await pool.start()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    t = asyncio.create_task(ticker())
    try:
        assert await pool.score("hang", "7") == 0.0
        assert ticks >= 20  # the loop kept running during the 2 s the answer hung
    finally:
        t.cancel()
        await pool.aclose()


@pytest.mark.timeout(60)
async def test_a_group_is_one_worker_call() -> None:
    pool = RewardPool(workers=2, timeout_s=5.0, fn=worker_pid)
    await pool.start()
    try:
        pids = await pool.score_many([f"#### {i}" for i in range(6)], "7")
        assert len(set(pids)) == 1 and pids[0] != os.getpid()
        assert pool.stats.calls == 6 and pool.stats.failures == 0
    finally:
        await pool.aclose()
    pool = RewardPool(workers=1, timeout_s=5.0)  # math_reward, the gold parsed once
    await pool.start()
    try:
        group = ["#### 7", "\\boxed{7.0}", "#### 8", "no answer", "#### 7"]
        assert await pool.score_many(group, "7") == [1.0, 1.0, 0.0, 0.0, 1.0]
        assert [math_reward(c, "7") for c in group] == [1.0, 1.0, 0.0, 0.0, 1.0]
    finally:
        await pool.aclose()


@pytest.mark.timeout(60)
async def test_answers_are_checked_once_per_final_answer_and_gold() -> None:
    """math_reward depends on the final answer and the gold one only: a group's answers
    that reach the same final answer by different text are one check, a later group
    repeating them is none, an answer without a final answer is 0 without a check, and
    the same answer against another gold answer is checked again. Two plain integers
    need no check at all."""
    pool = RewardPool(workers=1, timeout_s=5.0)
    await pool.start()
    try:
        group = ["3 + 4 = 7\n#### 7.0", "so it is 7 #### 7.0", "\\boxed{8.0}", "no answer"]
        assert await pool.score_many(group, "7") == [1.0, 1.0, 0.0, 0.0]
        assert pool.stats.calls == 2 and pool.stats.cached == 2
        again = ["first 7 #### 7.0", "\\boxed{8.0}", "#### 8.0"]
        assert await pool.score_many(again, "7") == [1.0, 0.0, 0.0]
        assert pool.stats.calls == 2 and pool.stats.cached == 5  # "8.0" either way
        assert await pool.score_many(["#### 8.0"], "8") == [1.0]
        assert pool.stats.calls == 3
        assert await pool.score_many(["#### 7", "#### 8", "\\boxed{7}"], "7") == [1.0, 0.0, 1.0]
        assert pool.stats.calls == 3 and pool.stats.cached == 8
    finally:
        await pool.aclose()
    pool = RewardPool(workers=1, timeout_s=5.0, fn=raise_on_bad)  # failures not remembered
    await pool.start()
    try:
        assert await pool.score_many(["bad #### 7", "#### 7"], "7") == [0.0, 1.0]
        assert await pool.score_many(["bad #### 7", "#### 7"], "7") == [0.0, 1.0]
        assert pool.stats.failures == 2 and pool.stats.calls == 3
    finally:
        await pool.aclose()


@pytest.mark.timeout(120)
def test_workers_die_with_a_sigkilled_owner(tmp_path) -> None:
    """A controller SIGKILLed mid-run leaves no reward worker behind (they are the owner's
    children: without a death signal they would idle under init forever)."""
    import json
    import signal
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(
        "import asyncio, json, os, signal\n"
        "from areal_hex.rewards import RewardPool\n"
        "async def main():\n"
        "    pool = RewardPool(workers=2, timeout_s=5.0)\n"
        "    await pool.start()\n"
        "    print(json.dumps([p.pid for p in pool._pool._processes.values()]), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    workers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [p for p in workers if _alive(p)]
        time.sleep(0.1)
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False
