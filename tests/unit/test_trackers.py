"""Trackers log the same scalars as the metric rows: TensorBoard event files and a W&B
offline run directory are read back and compared with the rows written to metrics.jsonl."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tracker_files import tensorboard_scalars, wandb_history

from areal_hex.errors import UsageError
from areal_hex.run_files import RunPaths, TrainerRow, append_row, read_rows
from areal_hex.trackers import Trackers, _require, open_trackers, scalars


def rows() -> list[TrainerRow]:
    return [
        TrainerRow(
            step=s,
            version=s,
            loss=0.25 * s,
            tokens_total=100 * s,
            version_lag_hist={"0": s, "1": 1},
            mismatch={
                "server": {"http://127.0.0.1:30000": {"abs_dlogp": 0.01 * s, "k3": 0.001}},
                "gpu_kind": {"L40S": {"abs_dlogp": 0.01 * s, "k3": 0.001, "tokens": 10.0}},
            },
            grad_norm=None,
        )
        for s in (1, 2, 3)
    ]


@pytest.mark.timeout(180)
def test_tensorboard_and_wandb_offline_equal_metrics_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    paths = RunPaths.at(tmp_path)
    trackers = open_trackers(
        ["tensorboard", "wandb"], tmp_path, "r1", "trainer", "areal-hex", "offline"
    )
    trackers.log_config({"trainer": {"lr": 0.001}})
    for row in rows():  # what the trainer does with each step row
        append_row(paths.metrics, row)
        trackers.observe(row)
    trackers.close()
    written = read_rows(paths.metrics, TrainerRow)
    expected = {r.step: scalars(r, "trainer") for r in written}
    assert expected[2]["trainer/version_lag_hist/0"] == 2.0
    # nested dicts flatten level by level; a URL key is one level
    assert expected[2]["trainer/mismatch/gpu_kind/L40S/abs_dlogp"] == pytest.approx(0.02)
    assert expected[1]["trainer/mismatch/server/http___127.0.0.1_30000/k3"] == 0.001
    assert "trainer/grad_norm" not in expected[1]  # unset values are not logged as 0

    tb = tensorboard_scalars(tmp_path / "tensorboard" / "trainer")
    assert set(tb) == set(expected[1])
    for step, values in expected.items():
        for tag, value in values.items():
            assert tb[tag][step] == pytest.approx(value, rel=1e-6), (tag, step)

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's service process writes the file: on a loaded machine its last records can
    # land after finish() has returned
    deadline = time.monotonic() + 30
    while len(history := wandb_history(run_file)) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [int(h["_step"]) for h in history] == [1, 2, 3]
    for h in history:
        values = expected[int(h["_step"])]
        assert {k: v for k, v in h.items() if not k.startswith("_")} == pytest.approx(values)


def test_rollout_rows_count_their_own_steps() -> None:
    from areal_hex.run_files import RolloutRow

    seen: list[tuple[int, dict[str, float]]] = []

    class Recorder:
        def log_config(self, config: dict) -> None: ...
        def log_scalars(self, values: dict[str, float], step: int) -> None:
            seen.append((step, values))

        def log_image(self, name: str, path: Path) -> None: ...
        def close(self) -> None: ...

    t = Trackers([Recorder()], "rollout")
    t.observe(RolloutRow(groups_produced_total=3))
    t.observe(RolloutRow(groups_produced_total=5, finish_reasons={"stop": 4}))
    assert [s for s, _ in seen] == [0, 1]
    assert seen[1][1]["rollout/groups_produced_total"] == 5.0
    assert seen[1][1]["rollout/finish_reasons/stop"] == 4.0
    assert "rollout/final" not in seen[1][1]  # booleans are not scalars


def test_missing_package_names_the_extra(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"pip install 'areal-hex\[mlflow\]'"):
        _require("mlflow_not_installed_here", "mlflow")
    with pytest.raises(UsageError, match="unknown tracker 'neptune'"):
        open_trackers(["neptune"], tmp_path, "r", "trainer", "p", "offline")


def test_run_trackers_from_the_config(tmp_path: Path) -> None:
    from areal_hex.config import load_config
    from areal_hex.trackers import open_run_trackers

    assert open_run_trackers(load_config(None, ["run.run_id=r"]), "trainer") is None
    cfg = load_config(
        None, ["run.run_id=r", f"run.output_dir={tmp_path}", "run.trackers=[tensorboard]"]
    )
    trackers = open_run_trackers(cfg, "trainer")
    assert trackers is not None
    trackers.observe(TrainerRow(step=4, loss=2.0))
    trackers.close()
    tb = tensorboard_scalars(tmp_path / "r" / "tensorboard" / "trainer")
    assert tb["trainer/loss"] == {4: 2.0}


def test_unknown_tracker_in_the_config_names_the_field() -> None:
    from areal_hex.config import load_config
    from areal_hex.config.base import ConfigError

    with pytest.raises(ConfigError, match=r"run\.trackers\.0: Input should be 'tensorboard'"):
        load_config(None, ["run.trackers=[neptune]"])
