"""The ledger's arithmetic and its times: groups accounted from durable counters and the
committed checkpoint, never negative by construction, rates over the time actually run."""

from __future__ import annotations

import json
from pathlib import Path

from areal_hex.run_files import TrainerRow
from hexctl.launch.progress import format_line, service_status
from hexctl.report.ledger import (
    active_seconds,
    committed_state,
    interruptions,
    ledger,
    steady_rate,
    trained_twice,
)
from trainer_service.checkpoint import MARKER, record_committed


def counters(**kw: int) -> dict[str, int]:
    base = {
        "admitted": 0,
        "acked": 0,
        "groups_dropped_stale": 0,
        "dead_count": 0,
        "in_flight": 0,
        "in_stream": 0,
        "committed_in_stream": 0,
        "produced_twice": 0,
    }
    base |= {f"given_back_{r}": 0 for r in ("filtered", "failed", "abandoned", "reclaimed")}
    return base | kw


def test_a_trainer_crash_after_its_commit_counts_each_group_once() -> None:
    # 40 committed (38 acked, 2 acked by nobody yet: the crash came between), 6 trained
    # after the checkpoint and still pending, 5 unconsumed, 3 generating, 2 dropped,
    # 4 filtered, 1 failed and 7 reclaimed from a killed controller
    c = counters(
        admitted=40 + 6 + 5 + 3 + 2 + 4 + 1 + 7,
        acked=38,
        groups_dropped_stale=2,
        in_stream=2 + 6 + 5,
        committed_in_stream=2,
        in_flight=3,
        given_back_filtered=4,
        given_back_failed=1,
        given_back_reclaimed=7,
    )
    out = ledger(c, {"step": 5, "totals": {"groups_trained_total": 40}}, twice=0)
    assert out["groups_lost"] == 0
    assert out["groups_produced"] == 40 + 6 + 5 + 3 + 2 + 4
    assert (out["groups_pending"], out["groups_in_flight"]) == (11, 3)


def test_a_vanished_group_is_counted_lost() -> None:
    c = counters(admitted=10, acked=8, in_stream=1)
    out = ledger(c, {"step": 1, "totals": {"groups_trained_total": 8}}, twice=0)
    assert out["groups_lost"] == 1


def test_without_the_buffer_only_the_checkpoint_speaks() -> None:
    out = ledger(None, {"step": 3, "totals": {"groups_trained_total": 24}}, twice=0)
    assert out["groups_lost"] is None and out["groups_trained"] == 24
    assert "could not be read" in out["ledger_error"]


def test_committed_records_and_groups_trained_twice(tmp_path: Path) -> None:
    log = tmp_path / "committed.jsonl"
    record_committed(log, 5, ["1-0", "2-0"])
    record_committed(log, 5, ["1-0", "2-0"])  # a resume from that checkpoint: not again
    record_committed(log, 10, ["3-0", "4-0"])
    assert trained_twice(log) == 0
    record_committed(log, 15, ["4-0", "5-0"])
    assert trained_twice(log) == 1
    ckpt = tmp_path / "ckpt" / "step10"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text(json.dumps({"step": 10, "ack_ids": ["3-0"], "totals": {}}))
    (tmp_path / "ckpt" / "step15").mkdir()  # incomplete: ignored
    assert committed_state(tmp_path / "ckpt")["step"] == 10
    assert committed_state(tmp_path / "none")["step"] == 0


def test_time_actually_run_leaves_out_downtime() -> None:
    attempts = [
        {
            "t_start": 0.0,
            "t_services_ready": 10.0,
            "t_end": 110.0,
            "events": [
                {"time": 50.0, "process": "trainer", "event": "exit -9"},
                {"time": 58.0, "process": "trainer", "event": "restart"},
            ],
        },
        {"t_start": 500.0, "t_services_ready": 505.0, "t_end": 545.0, "events": []},
    ]
    assert active_seconds(attempts) == 100.0 - 8.0 + 40.0
    breaks = interruptions(attempts)
    assert breaks == [50.0, 110.0, 545.0]
    rows = [
        TrainerRow(step=1, time=20.0, groups_trained_total=8),
        TrainerRow(step=2, time=22.0, groups_trained_total=16),
        TrainerRow(step=3, time=60.0, groups_trained_total=24),  # across the crash
        TrainerRow(step=3, time=62.0, groups_trained_total=24),  # retrained after it
        TrainerRow(step=4, time=64.0, groups_trained_total=32),
        TrainerRow(step=5, time=520.0, groups_trained_total=40),  # across attempts
        TrainerRow(step=6, time=522.0, groups_trained_total=48),
    ]
    # three uninterrupted steps of 8 groups x 4 samples, 2 s each
    assert steady_rate(rows, 4, breaks) == 3 * 8 * 4 / 6.0


def test_progress_says_what_each_process_does_before_the_first_step(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text("=== start trainer\n[status] starting DeepSpeed\nUsing /x as root\n")
    assert service_status(log) == "starting DeepSpeed"
    with log.open("a") as f:
        f.write("Building extension module deepspeed_shm_comm...\nninja: [1/3] c++\n")
    assert service_status(log) == "building DeepSpeed's op (first run only)"
    with log.open("a") as f:
        f.write("=== trainer exited (-9); restart 1\n")
    assert service_status(log) is None  # restarted: nothing said since
    assert service_status(tmp_path / "missing.log") is None
    line = format_line({"step": 0, "doing": {"trainer": "loading the model"}}, 40, 75.0)
    assert line == "step 0/40 | trainer: loading the model | elapsed 1m15s"


def test_chaos_plan_strikes_every_kind_once_at_distinct_steps() -> None:
    from hexctl.bench.system.chaos import KINDS, fault_plan

    plan = fault_plan(list(KINDS), 30, seed=1)
    steps = [s for s, _ in plan]
    assert sorted(k for _, k in plan) == sorted(KINDS)
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    # the early trainer kill comes after step 1, before the first checkpoint (step 3); the
    # job runs before each of the others and after the last
    assert plan[0] == (1, "trainer_early")
    assert 4 <= steps[1] and steps[-1] <= 26
    assert fault_plan(list(KINDS), 30, seed=1) == plan != fault_plan(list(KINDS), 30, seed=2)
