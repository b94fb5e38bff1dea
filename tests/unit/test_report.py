"""Run report and progress display from real JSONL files written the way the trainer and
controller write them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from areal_hex.config import load_config
from areal_hex.run_files import RolloutRow, RowTail, TrainerRow
from hexctl.launch.progress import Progress, format_line
from hexctl.report.summary import accounting, summarize, write_report


def write_run(run_dir: Path, steps: int = 10, b: int = 4) -> None:
    t0 = 1000.0
    (run_dir / "weights" / "v0").mkdir(parents=True)
    (run_dir / f"weights/v{steps}").mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            row = {
                "step": s,
                "version": s,
                "time": t0 + 2.0 * s,
                "reward_mean": s / steps,
                "version_lag_hist": {"0": b // 2, "1": b - b // 2},
                "max_version_lag": 1 if s > 1 else 0,
                "groups_trained_total": s * b,
                "groups_dropped_stale_total": 1,
                "dead_letter_total": 0,
                "compute_s": 1.0,
                "publish_s": 0.1,
                "sequences": b * 8,
            }
            f.write(json.dumps(row) + "\n")
    with open(run_dir / "rollout.jsonl", "w") as f:
        for i in range(5):
            row = {"time": t0 + 4.0 * i, "samples_per_s": 10.0 + i, "gen_busy_s": 3.0 * i}
            f.write(json.dumps({**row, "groups_produced_total": 10 * i}) + "\n")
        final = {"time": t0 + 25, "groups_produced_total": steps * b + 4, "groups_in_flight": 2}
        f.write(json.dumps({**final, "final": True, "samples_per_s": 0.0}) + "\n")
    events = {"t_start": t0 - 5, "t_services_ready": t0, "t_end": t0 + 30, "restarts": {}}
    (run_dir / "events.json").write_text(json.dumps(events))


def test_summary_numbers_and_plots(tmp_path: Path) -> None:
    write_run(tmp_path)
    cfg = load_config(None, ["run.run_id=r", "buffer.groups_per_step=4", "rollout.group_size=8"])
    buffer = {
        "unconsumed": 2,
        "pending": 1,
        "submitted": 44,
        "groups_dropped_stale": 1,
        "dead_letter": 0,
    }
    s = write_report(tmp_path, cfg, buffer=buffer)
    assert s["steps"] == 10 and s["final_version"] == 10
    assert s["final_reward"] == pytest.approx(0.95)  # mean of the last 2 of 10 steps
    assert s["max_version_lag"] == 1
    assert s["version_lag_hist"] == {"0": 20, "1": 20}
    # 9 steps x 4 groups x 8 samples between the first and last step (18 s apart)
    assert s["samples_per_s"] == pytest.approx(9 * 4 * 8 / 18.0)
    assert s["samples_per_s_wall"] == pytest.approx(10 * 4 * 8 / 20.0)
    assert s["wall_time_s"] == pytest.approx(35.0)
    assert s["groups_produced"] == 44 and s["groups_trained"] == 40
    assert s["in_buffer_at_stop"] == 3 and s["groups_lost"] == 0
    assert s["in_flight_controller"] == 2
    assert s["versions_on_disk"] == [0, 10]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 10
    for name in ("reward", "version_lag", "throughput", "timeline"):
        png = tmp_path / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_accounting_finds_a_lost_group() -> None:
    metrics = [
        TrainerRow(groups_trained_total=8, groups_dropped_stale_total=0, dead_letter_total=0)
    ]
    rollout = [RolloutRow(groups_produced_total=11, final=True, groups_in_flight=0)]
    buffer = {
        "unconsumed": 2,
        "pending": 0,
        "submitted": 11,
        "groups_dropped_stale": 0,
        "dead_letter": 0,
    }
    assert accounting(metrics, rollout, buffer)["groups_lost"] == 1


def test_accounting_sums_the_runs_of_a_restarted_controller() -> None:
    """A requeued job starts a new controller that counts from zero: the first one's
    groups still count (its final row, or its last row when it was killed)."""
    metrics = [TrainerRow(groups_trained_total=24)]
    rollout = [
        RolloutRow(elapsed_s=2.0, groups_produced_total=8),
        RolloutRow(elapsed_s=4.0, groups_produced_total=12, final=True),
        RolloutRow(elapsed_s=2.0, groups_produced_total=10),  # killed: no final row
        RolloutRow(elapsed_s=1.0, groups_produced_total=6),
        RolloutRow(elapsed_s=3.0, groups_produced_total=14, final=True),
    ]
    buffer = {
        "unconsumed": 12,
        "pending": 0,
        "submitted": 40,
        "groups_dropped_stale": 0,
        "dead_letter": 0,
    }
    acc = accounting(metrics, rollout, buffer)
    assert acc["groups_produced"] == 12 + 10 + 14
    assert acc["groups_lost"] == 0


def test_summary_of_an_empty_run(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.run_id=r"])
    s = summarize(tmp_path, cfg, None, outcome="failed")
    assert s["steps"] == 0 and s["final_reward"] is None and s["outcome"] == "failed"


def test_jsonl_tail_waits_for_complete_lines(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    tail = RowTail(p, TrainerRow)
    assert tail.read() == []
    with open(p, "w") as f:
        f.write('{"step": 1}\n{"step"')
    assert tail.read() == [TrainerRow(step=1)]
    with open(p, "a") as f:
        f.write(": 2}\n")
    assert tail.read() == [TrainerRow(step=2)]
    assert tail.read() == []


def test_format_line_and_eta() -> None:
    state = {
        "step": 5,
        "reward_mean": 0.25,
        "lag": 1,
        "max_lag": 2,
        "samples_per_s": 12.5,
        "t_first_step_elapsed": 10.0,
    }
    line = format_line(state, 10, elapsed_s=30.0)  # 4 steps in 20 s after the first
    assert "step 5/10" in line and "reward 0.250" in line and "version lag 1 (max 2)" in line
    assert "12.5 samples/s" in line and "ETA 0m25s" in line


def test_progress_plain_lines_when_not_a_tty(tmp_path: Path) -> None:
    out = io.StringIO()
    view = Progress(tmp_path, 3, out, log_interval_s=1e9)
    view.tick()  # nothing yet: no line
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "reward_mean": 0.5, "max_version_lag": 0}) + "\n")
    view.tick()
    view.tick()  # nothing new: no extra line
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "reward_mean": 0.75, "max_version_lag": 1}) + "\n")
    view.tick()
    view.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("step 1/3 | reward 0.500")
    assert lines[1].startswith("step 2/3 | reward 0.750 | version lag 1 (max 1)")


def test_progress_redraws_in_place_on_a_tty(tmp_path: Path) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    view = Progress(tmp_path, 3, out, min_interval_s=0.0)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 2, "reward_mean": 0.1}) + "\n")
    view.tick()
    view.close()
    text = out.getvalue()
    assert text.startswith("\rstep 2/3") and text.endswith("\n") and text.count("\r") == 2


def test_metric_rows_refuse_unknown_keys(tmp_path: Path) -> None:
    import pydantic

    from areal_hex.run_files import append_row, read_rows

    with pytest.raises(pydantic.ValidationError, match="reward_avg"):
        TrainerRow(step=1, reward_avg=0.5)  # a renamed field fails where it is written
    p = tmp_path / "metrics.jsonl"
    append_row(p, TrainerRow(step=3, reward_mean=0.25))
    p.open("a").write('{"step": 4, "rewrd_mean": 1.0}\n')
    with pytest.raises(pydantic.ValidationError, match="rewrd_mean"):
        read_rows(p, TrainerRow)  # ... and where it is read


def test_report_plots_go_to_the_trackers_as_images(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_run(tmp_path)
    cfg = load_config(None, ["run.run_id=r", "run.trackers=[tensorboard]"])
    s = write_report(tmp_path, cfg)
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "report"))
    acc.Reload()
    images = set(acc.Tags()["images"])
    assert images == {f"report/{Path(p).stem}" for p in s["plots"]} and images


def test_rows_an_older_version_wrote_read_under_the_new_names(tmp_path: Path) -> None:
    from areal_hex.run_files import read_rows

    old = {"step": 3, "dropped_stale_total": 2, "staleness_hist": {"1": 4}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n")
    (row,) = read_rows(tmp_path / "metrics.jsonl", TrainerRow)
    assert (row.groups_dropped_stale_total, row.version_lag_hist) == (2, {"1": 4})
    with pytest.raises(ValueError, match="no_such_field"):
        TrainerRow.model_validate({"no_such_field": 1})
