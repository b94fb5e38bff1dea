"""`areal-hex bench host`: the window means and spreads it reports, and its CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hexctl.bench.system.host import spread, windows

ROOT = Path(__file__).resolve().parents[2]


def test_windows_lie_within_the_run_and_average_what_they_cover() -> None:
    samples = [{"t": 5.0 * i, "v": float(v)} for i, v in enumerate([1, 2, 3, 4, 5, 6])]
    # samples at 0..25 s, one every 5 s: the run covers 30 s; 10-s windows start at 0..20
    assert windows(samples, "v", 10.0, 5.0) == [1.5, 2.5, 3.5, 4.5, 5.5]
    # a window longer than the run: one mean of everything
    assert windows(samples, "v", 100.0, 5.0) == [3.5]


def test_spread_is_relative_to_the_median() -> None:
    s = spread([80.0, 100.0, 110.0])
    assert s["median"] == 100.0
    assert s["low"] == pytest.approx(-0.2)
    assert s["high"] == pytest.approx(0.1)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "hexctl.cli", "bench", "host", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_bench_host_prints_one_json_object() -> None:
    p = _cli("--json", "--seconds", "2", "--every", "0.5", "--probe", "0.1", "--window", "1")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert 2 <= len(out["samples"]) <= 4
    assert [s["t"] for s in out["samples"]] == sorted(s["t"] for s in out["samples"])
    for key in ("matmul_gflops", "python_m_per_s"):
        assert out[key]["samples"]["min"] > 0
        assert out[key]["windows"]["min"] <= out[key]["windows"]["median"]


def test_a_probe_longer_than_the_interval_is_refused() -> None:
    p = _cli("--seconds", "1", "--every", "0.5", "--probe", "0.5")
    assert p.returncode == 1
    assert "--probe (0.5 s) must be shorter than --every (0.5 s)" in p.stderr
    assert "Traceback" not in p.stderr
