"""Never a silent hang: no step for run.stall_after_s while every process is alive is
reported with who waits for what, and stops the run unless run.stop_on_stall is off."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from areal_hex.config import load_config
from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, append_row
from hexctl.launch.progress import format_line
from hexctl.launch.stall import Stalled, StallWatch
from hexctl.launch.supervisor import ProcessSpec, Supervisor

SLEEP = [
    sys.executable,
    "-c",
    "import time; print('waiting for a batch', flush=True); time.sleep(60)",
]


def _wait(watch: StallWatch, step: int, limit_s: float) -> float:
    deadline = time.monotonic() + limit_s
    idle = watch.check(step)
    while idle < limit_s and time.monotonic() < deadline + 1:
        time.sleep(0.05)
        idle = watch.check(step)
    return idle


@pytest.mark.timeout(60)
def test_no_step_while_alive_is_named_then_stops(tmp_path: Path) -> None:
    paths = RunPaths.at(tmp_path)
    append_row(paths.metrics, TrainerRow(step=3, version=3))
    append_row(paths.rollout, RolloutRow(version=4, samples_per_s=0.0, servers_healthy=1))
    buffer = {"unconsumed": 0, "pending": 0, "version": 3, "groups_dropped_stale": 12}
    with Supervisor(poll_s=0.05) as sup:
        sup.start(ProcessSpec("trainer", SLEEP, paths.log("trainer")))
        sup.start(ProcessSpec("controller", SLEEP, paths.log("controller")))
        watch = StallWatch(sup, tmp_path, 0.6, True, lambda: buffer)
        assert watch.check(3) < 0.6
        time.sleep(0.4)
        assert watch.check(4) < 0.1  # a step starts the clock again
        with pytest.raises(Stalled) as caught:
            _wait(watch, 4, 0.6)
        text = str(caught.value)
        assert text.startswith("no optimizer step for 1 s (run.stall_after_s=0.6) while every")
        assert "last step 4 at version 3" in text
        assert "buffer: 0 groups ready, 0 being trained, version key 3, 12 dropped" in text
        assert "the trainer waits for groups the controller does not produce" in text
        assert "controller at version 4: 0.0 samples/s" in text
        assert "trainer last logged: waiting for a batch" in text
        sup.kill("controller", "test")
        while sup.running("controller"):
            time.sleep(0.02)
        quiet = StallWatch(sup, tmp_path, 0.3, True)
        assert _wait(quiet, 4, 0.3) >= 0.3  # a process down: not a hang (no raise)


@pytest.mark.timeout(60)
def test_a_restart_restarts_the_clock_and_report_only_says_once(tmp_path: Path) -> None:
    said: list[str] = []
    with Supervisor(poll_s=0.05) as sup:
        spec = ProcessSpec("trainer", SLEEP, tmp_path / "t.log")
        sup.start(spec)
        watch = StallWatch(sup, tmp_path, 0.5, False, say=said.append)
        time.sleep(0.4)
        sup.kill("trainer", "test")
        sup.procs["trainer"].proc.wait()  # type: ignore[union-attr]
        sup.start(spec)
        assert watch.check(0) < 0.1
        _wait(watch, 0, 0.5)
        _wait(watch, 0, 0.6)
    assert len(said) == 1 and said[0].startswith("stalled (run.stop_on_stall=false: the run go")


def test_the_progress_line_shows_the_wait_and_the_config_defaults() -> None:
    line = format_line({"step": 7, "no_step_s": 161.0}, 40, 300.0)
    assert line.startswith("NO STEP for 2m41s | step 7/40 |")
    cfg = load_config(None, [])
    assert cfg.run.stall_after_s == 300.0 and cfg.run.stop_on_stall is True
