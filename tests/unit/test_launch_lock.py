"""One launcher per run directory: the second one exits 2 naming the holder, before it
writes anything; the lock ends with its holder's process, even a SIGKILLed one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hexctl.launch.run_lock import RunInUse, RunLock

HOLD = """
import sys, time
from hexctl.launch.run_lock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_lock_names_the_holder_and_a_dead_holder_frees_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        with pytest.raises(RunInUse, match=rf"in use by another .* \(pid {proc.pid}, lock"):
            RunLock(run_dir).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunLock(run_dir) as lock:  # the kernel dropped the dead holder's lock
        assert lock.held and (run_dir / "launch.lock").read_text() == f"{os.getpid()}\n"
    assert not lock.held


@pytest.mark.timeout(120)
def test_a_second_launcher_of_one_run_exits_2_before_writing(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "racing"
    proc = _holder(run_dir)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        t0 = time.monotonic()
        second = subprocess.run(
            [
                sys.executable, "-m", "hexctl.cli", "run", "examples/tiny_cpu.yaml",
                f"run.output_dir={tmp_path / 'runs'}", "run.run_id=racing", "--no-progress",
                "--timeout", "30",
            ],
            capture_output=True, text=True, env=env, timeout=90,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"pid {proc.pid}" in second.stderr and "in use" in second.stderr
        assert time.monotonic() - t0 < 60
        assert sorted(p.name for p in run_dir.iterdir()) == ["launch.lock"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
