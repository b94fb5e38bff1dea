"""The start-up timeline from the launcher's events and the first metrics row."""

from __future__ import annotations

from areal_hex.run_files import TrainerRow
from hexctl.report.startup import format_timeline, startup_timeline


def test_timeline_from_events_and_the_first_step() -> None:
    events = {
        "t_start": 100.0,
        "events": [
            {"time": 60.0, "process": "launcher", "event": "command"},
            {"time": 99.5, "process": "launcher", "event": "prepared (config, v0 weights)"},
            {"time": 100.1, "process": "redis", "event": "start"},
            {"time": 100.4, "process": "redis", "event": "ready"},
            {"time": 100.5, "process": "trainer", "event": "start"},
            {"time": 104.0, "process": "trainer", "event": "status: waiting for the first batch"},
            {"time": 106.2, "process": "inference-0", "event": "ready"},
            {"time": 130.0, "process": "controller", "event": "exit 0"},
        ],
    }
    # a row of an earlier attempt (a resume) is not this attempt's first step
    rows = [TrainerRow(step=1, time=50.0), TrainerRow(step=2, time=107.5, wait_s=2.25)]
    got = startup_timeline(events, rows)
    assert got is not None
    assert got["command_to_services_s"] == 40.0
    assert got["first_step_s"] == 7.5 and got["first_batch_wait_s"] == 2.25
    assert [e["event"] for e in got["events"]][-1] == "ready"  # exits are not start-up
    line = format_timeline(got)
    assert "redis ready 0.4" in line and "trainer waiting for the first batch 4.0" in line
    assert line.endswith("first step 7.5 (batch wait 2.2)")
    assert "redis start" not in line and "trainer start" not in line  # all start at once
    assert startup_timeline({}, rows) is None
