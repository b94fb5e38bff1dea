"""The report's train-inference mismatch plot: one series per server and per GPU kind,
from the steps' `mismatch` rows; no plot when nothing was measured."""

from __future__ import annotations

from pathlib import Path

from areal_hex.run_files import RunPaths, TrainerRow, append_row
from hexctl.report.mismatch import mismatch_series
from hexctl.report.summary import write_plots


def m(abs_dlogp: float, k3: float, tokens: int) -> dict[str, float]:
    return {"abs_dlogp": abs_dlogp, "k3": k3, "tokens": tokens}


def rows() -> list[TrainerRow]:
    return [
        TrainerRow(
            step=1,
            mismatch={
                "server": {"http://a:1": m(0.01, 0.001, 10), "http://b:2": m(0.2, 0.05, 5)},
                "gpu_kind": {"H800": m(0.01, 0.001, 10), "H20": m(0.2, 0.05, 5)},
            },
        ),
        TrainerRow(step=2),  # nothing of the trained version in this batch
        TrainerRow(
            step=3,
            mismatch={
                "server": {"http://a:1": m(0.02, 0.002, 8)},
                "gpu_kind": {"H800": m(0.02, 0.002, 8)},
            },
        ),
    ]


def test_series_per_server_and_kind() -> None:
    by_server = mismatch_series(rows(), "server", "abs_dlogp")
    assert by_server == {"http://a:1": ([1, 3], [0.01, 0.02]), "http://b:2": ([1], [0.2])}
    assert mismatch_series(rows(), "gpu_kind", "k3") == {
        "H800": ([1, 3], [0.001, 0.002]),
        "H20": ([1], [0.05]),
    }


def test_report_draws_it_only_when_measured(tmp_path: Path) -> None:
    paths = RunPaths.at(tmp_path)
    append_row(paths.metrics, TrainerRow(step=1, reward_mean=0.5))
    plots = write_plots(tmp_path, {})
    assert "mismatch.png" not in {p.name for p in plots}  # naive PPO: no recompute
    for r in rows():
        append_row(paths.metrics, r)
    plots = write_plots(tmp_path, {})
    png = paths.report / "mismatch.png"
    assert png in plots and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_totals_are_token_weighted() -> None:
    from hexctl.report.summary import drift_totals, mismatch_totals

    got = mismatch_totals(rows())
    a = got["server"]["http://a:1"]
    assert a["tokens"] == 18
    assert abs(a["abs_dlogp"] - (0.01 * 10 + 0.02 * 8) / 18) < 1e-12
    assert abs(a["k3"] - (0.001 * 10 + 0.002 * 8) / 18) < 1e-12
    assert got["gpu_kind"]["H20"] == m(0.2, 0.05, 5)
    drift = [
        TrainerRow(step=1, drift_by_lag={"0": m(0.0, 0.0, 4), "2": m(0.03, 0.004, 6)}),
        TrainerRow(step=2, drift_by_lag={"10": m(0.5, 0.1, 1), "2": m(0.01, 0.002, 2)}),
    ]
    totals = drift_totals(drift)
    assert list(totals) == ["0", "2", "10"]  # by lag, not as text
    assert totals["2"]["tokens"] == 8
    assert abs(totals["2"]["abs_dlogp"] - (0.03 * 6 + 0.01 * 2) / 8) < 1e-12
    assert abs(totals["2"]["k3"] - (0.004 * 6 + 0.002 * 2) / 8) < 1e-12
