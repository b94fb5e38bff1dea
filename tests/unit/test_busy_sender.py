"""A trainer that trains while it sends: over the network its broadcast, timed while it
trained (`TrainerOption.broadcast_s`), comes before the server's own part of the update
(the pause, its receive under its quota, the continue), not within it, in a run that
training binds; where generation binds, the trainer sends while it waits for its batch."""

from __future__ import annotations

import pytest

from scheduler.costmodel import RolloutOption, pipeline_rate
from scheduler.sync_cost import busy_sender_syncs, sender_bound_rate
from scheduler.workload import Workload


def _workload(sync: str = "network") -> Workload:
    return Workload(
        groups_per_step=4,
        group_size=16,
        prompt_tokens=34,
        response_tokens=16,
        max_response_tokens=24,
        max_staleness=4,
        weight_sync=sync,
    )


def _option(rate: float) -> RolloutOption:
    return RolloutOption("g", "CPU", "z", 1, 64, 0.0001, 0.00001, rate, 16 * rate, 1.0)


def test_the_busy_senders_broadcast_bounds_the_copy_not_the_servers_own_part() -> None:
    # (fixed, copy on the links): near, and behind an uplink
    fixed, arrive = [0.06, 0.08], [0.02, 0.30]
    syncs = [f + a for f, a in zip(fixed, arrive, strict=True)]
    got = busy_sender_syncs(_workload(), syncs, arrive, 0.09)
    # near: its own 0.06 s after the 0.09 s send (not max(0.08, 0.09) = 0.09);
    # behind the uplink the send is within the copy's 0.30 s
    assert got == pytest.approx([0.15, 0.38])
    # from disk no broadcast: the parts as they are
    assert busy_sender_syncs(_workload("disk"), syncs, arrive, 0.09) == pytest.approx(syncs)


def _items(*rates: float) -> list[tuple[RolloutOption, float, int]]:
    return [(_option(r), 0.09, 1) for r in rates]


def test_where_generation_keeps_up_with_the_busy_pauses_they_are_the_pauses() -> None:
    w = _workload()
    rate, gen, syncs = sender_bound_rate(w, 100.0, _items(300.0, 280.0), [0.15, 0.17], 0.09)
    assert rate == pytest.approx(100.0)  # training binds: the trainer never waits
    assert syncs == pytest.approx([0.15, 0.17])
    busy = [(o, b, 1) for (o, _, _), b in zip(_items(300.0, 280.0), [0.15, 0.17], strict=True)]
    assert gen == pytest.approx(pipeline_rate(w, 100.0, busy)[1])


def test_a_trainer_that_waits_part_of_its_send_pauses_the_servers_part_of_the_way() -> None:
    """Generation that keeps up with the free pauses but not with the busy ones: the
    trainer waits for part of each send, and the rate falls between the two."""
    w = _workload()
    items, busy = _items(300.0, 280.0), [0.15, 0.17]
    train = 300.0
    free_rate, _ = pipeline_rate(w, train, items)
    assert free_rate == pytest.approx(train)
    slow = [(o, b, 1) for (o, _, _), b in zip(items, busy, strict=True)]
    all_busy, _ = pipeline_rate(w, train, slow)
    rate, gen, syncs = sender_bound_rate(w, train, items, busy, 0.09)
    assert all_busy < rate < train
    assert gen == pytest.approx(rate, rel=1e-6)
    assert 0.09 < syncs[0] < 0.15 and 0.09 < syncs[1] < 0.17
    # the wait left per publish covers what the busy pause does not: share = 1 − wait/send
    share = 1 - w.publish_every * w.samples_per_step * (1 / rate - 1 / train) / 0.09
    assert syncs[1] == pytest.approx(0.09 + share * 0.08)


def test_a_trainer_that_waits_longer_than_its_send_leaves_the_free_pauses() -> None:
    w = _workload()
    items = _items(100.0)
    rate, gen, syncs = sender_bound_rate(w, 300.0, items, [0.5], 0.09)
    assert syncs == pytest.approx([0.09])
    assert (rate, gen) == pytest.approx(pipeline_rate(w, 300.0, items))
    # no send measured: the free pauses whatever binds
    rate, _, syncs = sender_bound_rate(w, 100.0, _items(300.0), [0.5], 0.0)
    assert syncs == pytest.approx([0.09]) and rate == pytest.approx(100.0)


def test_the_runs_prediction_reports_the_pauses_the_trainers_state_sets() -> None:
    """`predict._asynchronous`: the pause it reports and the rate it reaches are the busy
    sender's where training binds, the free pauses (no shorter than the send) where
    generation does."""
    from scheduler.costmodel import TrainerOption
    from scheduler.predict import _asynchronous

    w = _workload()

    def trainer(rate: float) -> TrainerOption:
        step = w.samples_per_step / rate
        return TrainerOption(
            "CPU", (("t", 1),), 1, 1, 0, step, step, 0.0, 0.0, 1.0, rate, 1.0, broadcast_s=0.09
        )

    opts = [_option(300.0), _option(280.0)]
    free = [0.06, 0.08]
    busy = [0.15, 0.17]
    bound = _asynchronous(w, None, opts, trainer(100.0), free, [None, None], busy)
    assert bound.weight_sync_s == pytest.approx(0.17)
    assert bound.pipeline_samples_per_s == pytest.approx(100.0)
    between = _asynchronous(w, None, opts, trainer(300.0), free, [None, None], busy)
    assert 0.09 < between.weight_sync_s < 0.17
    assert between.pipeline_samples_per_s < 300.0
    unbusy = _asynchronous(w, None, opts, trainer(300.0), free, [None, None])
    assert unbusy.weight_sync_s == pytest.approx(0.09)  # the send's floor, as before
    assert unbusy.pipeline_samples_per_s == pytest.approx(300.0)
    waiting = _asynchronous(w, None, opts, trainer(900.0), free, [None, None], busy)
    assert waiting.weight_sync_s == pytest.approx(0.09)


def test_a_placed_plan_is_priced_and_assessed_at_the_pauses_in_effect() -> None:
    """The planner's figure (`placing.placed_rate`) and the pauses its assessment reads
    (`placing.paused_items`) are the busy sender's where training binds."""
    from scheduler.partition import Placement, PlacementCost
    from scheduler.placing import paused_items, placed_rate

    w = _workload()
    rollout = [(_option(300.0), "n-1", [0]), (_option(280.0), "n-2", [0])]
    pl = Placement([("n-0", [0])], rollout)
    step = w.samples_per_step / 100.0  # training at 100 samples/s binds
    busy = PlacementCost(step, 0.0, [0.09, 0.09], [], [0.15, 0.17], 0.09)
    assert placed_rate(w, pl, busy)[0] == pytest.approx(100.0)
    assert [s for _, s, _ in paused_items(w, pl, busy)] == pytest.approx([0.15, 0.17])
    # no send measured: the free pauses
    free = PlacementCost(step, 0.0, [0.09, 0.09], [], [0.15, 0.17], 0.0)
    assert [s for _, s, _ in paused_items(w, pl, free)] == pytest.approx([0.09, 0.09])


def test_a_send_longer_than_the_step_sets_the_trainers_cycle_with_the_work_after_it() -> None:
    """The trainer's update waits for the send of the weights it changes (they are live),
    and the next send starts once the update is done: where the pause in effect (the
    send: announce, pause, every bucket) plus the step's work after it
    (`after_send_s`) outlasts the step, that sum is the cycle per publish."""
    w = _workload()
    k = w.publish_every * w.samples_per_step
    # generation far ahead of everything: only the trainer and its sends can bind
    items = [(_option(20_000.0), 0.09, 1)]
    free_rate, _, _ = sender_bound_rate(w, 400.0, items, [0.09], 0.09)
    assert free_rate == pytest.approx(400.0)  # a 0.09-s send within a 0.16-s step
    rate, _, syncs = sender_bound_rate(w, 400.0, items, [0.25], 0.09, after_send_s=0.02)
    assert rate < 400.0
    assert rate * (max(syncs) + 0.02) == pytest.approx(k, rel=1e-6)  # the cycle binds
    slower, _, _ = sender_bound_rate(w, 400.0, items, [0.25], 0.09, after_send_s=0.05)
    assert slower < rate
    # no send measured: nothing of this
    assert sender_bound_rate(w, 400.0, items, [0.25], 0.0, 0.05)[0] == pytest.approx(400.0)


def test_the_runs_prediction_and_the_planners_figure_both_take_the_send_cycle() -> None:
    from scheduler.costmodel import TrainerOption
    from scheduler.partition import Placement, PlacementCost
    from scheduler.placing import placed_rate
    from scheduler.predict import _asynchronous

    w = _workload()
    k = w.publish_every * w.samples_per_step
    step = w.samples_per_step / 400.0
    tr = TrainerOption(
        "CPU", (("t", 1),), 1, 1, 0, step, step, 0.0, 0.0, 1.0, 400.0, 1.0,
        broadcast_s=0.09, after_send_s=0.03,
    )  # fmt: skip
    opts = [_option(20_000.0)]
    got = _asynchronous(w, None, opts, tr, [0.09], [None], [0.25])
    assert got.pipeline_samples_per_s * (got.weight_sync_s + 0.03) == pytest.approx(k, rel=1e-6)
    pl = Placement([("n-0", [0])], [(_option(20_000.0), "n-1", [0])])
    cost = PlacementCost(step, 0.0, [0.09], [], [0.25], 0.09, 0.03)
    assert placed_rate(w, pl, cost)[0] == pytest.approx(got.pipeline_samples_per_s, rel=1e-6)
