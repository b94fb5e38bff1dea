"""An asynchronous run's servers at the batch its controller holds them at: the groups in
flight spread evenly over the servers, none above its own batch."""

from __future__ import annotations

from scheduler.predict import held_batches
from scheduler.workload import Workload


def _w(staleness: int = 4) -> Workload:
    return Workload(
        groups_per_step=8, group_size=8, prompt_tokens=34, response_tokens=15,
        max_response_tokens=16, max_staleness=staleness,
    )  # fmt: skip


def test_the_groups_in_flight_are_spread_evenly() -> None:
    assert held_batches(_w(), [128, 128], 16) == [64, 64]
    assert held_batches(_w(), [128], 16) == [128]
    assert held_batches(_w(), [128], 8) == [64]  # 8 groups of 8 on a batch of 128


def test_what_a_small_server_cannot_take_goes_to_the_others() -> None:
    assert held_batches(_w(), [128, 32, 128], 20) == [64, 32, 64]
    assert held_batches(_w(), [8, 128], 20) == [8, 128]  # 152 left for one of 128


def test_no_more_than_the_staleness_gate_lets_generate() -> None:
    # eta 2: (2 - 1) x 8 groups generate, whatever the controller's cap
    assert held_batches(_w(staleness=2), [128, 128], 40) == [32, 32]
    assert held_batches(_w(staleness=1), [128], 40) == [32]  # at least half a step's
