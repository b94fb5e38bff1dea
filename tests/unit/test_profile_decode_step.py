"""The profile's decode step from two answer lengths: a pair in which the machine stalled
the short wave (no longer than the long one) is measured again instead of entering the
median as a step of ~0 s, which once made a kind's batch-1 decode 1 µs and its planned
generation 1,381 samples/s."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from areal_hex.config import ExperimentConfig
from hexctl.profile.generation import _Driver


class _Timed(_Driver):
    """A driver whose waves take scripted times (seconds per (long, short) pair)."""

    def __init__(self, times: list[tuple[float, float]]) -> None:
        super().__init__(None, ExperimentConfig(), [[1, 2, 3]])
        self.times: Iterator[float] = iter(t for pair in times for t in pair)

    async def wave(self, work: list[list[int]], sp: Any) -> tuple[float, list]:
        return next(self.times), []


def test_a_stalled_short_wave_is_measured_again() -> None:
    long_n = max(8, ExperimentConfig().rollout.max_new_tokens)
    short_n = max(2, long_n // 4)
    step = 0.01
    good = (0.1 + long_n * step, 0.1 + short_n * step)  # prefill 0.1 s cancels
    stalled = (0.1 + long_n * step, 0.1 + long_n * step + 0.5)
    d = _Timed([stalled, good, stalled, good, good])
    assert asyncio.run(d.decode_step(4)) == pytest.approx(step)


def test_without_a_usable_pair_the_long_wave_per_token_stands_in() -> None:
    long_n = max(8, ExperimentConfig().rollout.max_new_tokens)
    stalled = (long_n * 0.02, long_n * 0.02)
    d = _Timed([stalled] * 6)
    assert asyncio.run(d.decode_step(4)) == pytest.approx(0.02)
