"""Stopping a child process the face started (a profiling server, a bench's server), and
the face itself stopped by SIGTERM as by Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def sigterm_as_ctrl_c() -> None:
    """SIGTERM (a scheduler's stop, `kill`) raises KeyboardInterrupt in the main thread,
    so a command stops through its `finally` blocks as on Ctrl-C."""
    signal.signal(signal.SIGTERM, _interrupt)


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`; always reaped."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
