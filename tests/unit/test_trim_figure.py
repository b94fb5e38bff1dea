"""The profile's heap-trim figure: each trimmed round against the plain round before it,
per-step medians of CPU seconds, so one noisy round cannot move the hybrid's price."""

from __future__ import annotations

import statistics

import pytest

from hexctl.profile.training import (
    TimedStep,
    _tokens_per_s,
    _trim_figures,
    round_cpu_s_per_token,
    trim_step_ratio,
)
from scheduler.lending import heap_trim_s
from scheduler.profile import DeviceRates, Profile

TOKENS = 6400  # a step's tokens


def _round(step_cpu_s: float, trim_cpu_s: float = 0.0, n: int = 10, **kw: float) -> list:
    """n steps at `step_cpu_s` CPU seconds each (wall as given, else the same)."""
    wall = kw.get("wall_s", step_cpu_s)
    return [
        TimedStep(TOKENS, wall, step_cpu_s, kw.get("trim_s", trim_cpu_s), trim_cpu_s)
        for _ in range(n)
    ]


def _hybrid_trim_s(plain: list, trimmed: list, plain_rate: float = 100000.0) -> float:
    """The seconds a hybrid's trainer step of 0.064 s is priced longer by its trim, from
    a profile holding these rounds' figure."""
    figures = _trim_figures(plain_rate, plain, trimmed)
    rates = DeviceRates(
        device="cpu",
        decode_step_s={1: 0.01},
        decode_context=40,
        prefill_tokens_per_s=1000.0,
        train_tokens_per_s=plain_rate,
        train_trim_tokens_per_s=figures["trim_tokens_per_s"],
    )
    prof = Profile(model="m", params=1, kinds={"CPU": rates})
    assert prof.with_heap_trim().kinds["CPU"].train_tokens_per_s == pytest.approx(
        figures["trim_tokens_per_s"]
    )
    return heap_trim_s(prof, "CPU", 0.064)


def test_one_outlier_trimmed_round_prices_the_hybrid_as_without_it() -> None:
    plain = [_round(0.064) for _ in range(3)]
    clean = [_round(0.088, 0.006) for _ in range(3)]
    # the second trimmed round 3x slower throughout (its trims and steps alike)
    noisy = [clean[0], _round(0.264, 0.018), clean[2]]
    assert trim_step_ratio(plain, clean) == pytest.approx(0.094 / 0.064)
    assert trim_step_ratio(plain, noisy) == pytest.approx(trim_step_ratio(plain, clean))
    assert _hybrid_trim_s(plain, noisy) == pytest.approx(_hybrid_trim_s(plain, clean))
    assert _hybrid_trim_s(plain, clean) == pytest.approx(0.064 * (0.094 / 0.064 - 1))


def test_a_neighbour_through_two_round_pairs_leaves_the_figure() -> None:
    """Two of three trimmed rounds slowed by a neighbour: the median of the rounds' own
    wall rates sinks (as a profile's once did, to 0.21 of the plain rate), the CPU
    figure of each pair does not."""
    plain = [_round(0.064) for _ in range(3)]
    slow = [_round(0.088, 0.006, wall_s=0.264, trim_s=0.018) for _ in range(2)]
    trimmed = [_round(0.088, 0.006), *slow]
    # a neighbour held the core through trimmed rounds 2 and 3 (wall 3x the CPU's)
    assert trim_step_ratio(plain, trimmed) == pytest.approx(0.094 / 0.064)
    walls = [_tokens_per_s(r) for r in trimmed], [_tokens_per_s(r) for r in plain]
    old = statistics.median(walls[0]) / statistics.median(walls[1])
    assert old < 0.6 * 0.064 / 0.094  # the rounds' own rates: far below the cost


def test_each_rounds_first_step_and_single_noisy_steps_are_left_out() -> None:
    steps = _round(0.088, 0.006)
    steps[0] = TimedStep(TOKENS, 0.5, 0.5, 0.05, 0.05)  # pays for the round before
    steps[4] = TimedStep(TOKENS, 0.4, 0.4, 0.0, 0.0)
    assert round_cpu_s_per_token(steps) == pytest.approx(0.094 / TOKENS)


def test_per_step_trim_call_figures_are_the_median_after_each_rounds_first() -> None:
    plain = [_round(0.064) for _ in range(3)]
    trimmed = [_round(0.088, 0.006, trim_s=0.007) for _ in range(3)]
    trimmed[0][0] = TimedStep(TOKENS, 0.088, 0.088, 0.2, 0.2)
    figures = _trim_figures(100000.0, plain, trimmed)
    assert figures["trim_call_s"] == pytest.approx(0.007)
    assert figures["trim_call_cpu_s"] == pytest.approx(0.006)
    assert figures["trim_tokens_per_s"] == pytest.approx(100000.0 * 0.064 / 0.094)
    assert _trim_figures(100000.0, plain, []) == {}


def test_rounds_that_cannot_be_paired_are_refused() -> None:
    with pytest.raises(ValueError, match="expected at least one trimmed round"):
        trim_step_ratio([], [_round(0.088, 0.006)])
    with pytest.raises(ValueError, match="expected at least one trimmed round"):
        trim_step_ratio([_round(0.064)], [])
