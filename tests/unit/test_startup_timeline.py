"""The start-up timeline from the launcher's events, the services' [status] lines and
the first metrics row."""

from __future__ import annotations

import time
from pathlib import Path

from areal_hex.run_files import TrainerRow
from hexctl.report.startup import format_timeline, startup_timeline


def _line(t: float, text: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return f"{stamp},{int(round(t % 1 * 1000)):03d} trainer: {text}"


def test_timeline_from_events_logs_and_the_first_step(tmp_path: Path) -> None:
    t0 = float(int(time.time()))
    events = {
        "t_start": t0,
        "events": [
            {"time": t0 - 40.0, "process": "launcher", "event": "command"},
            {"time": t0 - 0.5, "process": "launcher", "event": "prepared (config, v0 weights)"},
            {"time": t0 + 0.1, "process": "redis", "event": "start"},
            {"time": t0 + 0.4, "process": "redis", "event": "ready"},
            {"time": t0 + 0.5, "process": "trainer", "event": "start"},
            {"time": t0 + 6.2, "process": "inference-0", "event": "ready"},
            {"time": t0 + 30.0, "process": "controller", "event": "exit 0"},
        ],
    }
    log = tmp_path / "trainer.log"
    log.write_text(
        "\n".join(
            [
                "=== start trainer: python -m hexctl.cli train config.yaml",
                _line(t0 - 100.0, "[status] loading the model"),  # an earlier attempt's
                "trainer: [status] a line without its time",
                _line(t0 + 3.25, "[status] loading the model"),
                _line(t0 + 4.5, "[status] waiting for the first batch"),
                _line(t0 + 5.0, "done at step 2, version 2"),
            ]
        )
    )
    # a row of an earlier attempt (a resume) is not this attempt's first step
    rows = [TrainerRow(step=1, time=t0 - 50.0), TrainerRow(step=2, time=t0 + 7.5, wait_s=1.25)]
    got = startup_timeline(events, rows, {"trainer": log, "controller": tmp_path / "none.log"})
    assert got is not None
    assert got["command_to_services_s"] == 40.0
    assert got["first_step_s"] == 7.5 and got["first_batch_wait_s"] == 1.25
    assert [(r["process"], r["event"], r["at_s"]) for r in got["events"][-3:]] == [
        ("trainer", "status: loading the model", 3.25),
        ("trainer", "status: waiting for the first batch", 4.5),
        ("inference-0", "ready", 6.2),  # in time order; exits are not start-up
    ]
    line = format_timeline(got)
    assert "redis ready 0.4" in line and "trainer waiting for the first batch 4.5" in line
    assert line.endswith("first step 7.5 (batch wait 1.2)")
    assert "redis start" not in line and "trainer start" not in line  # all start at once
    assert startup_timeline({}, rows) is None
