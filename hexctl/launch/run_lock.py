"""One launcher per run directory: `RunLock` holds an exclusive `flock` on the run's
`launch.lock` for the launcher's whole life, taken before anything else is written there.
A second launcher (or a second `--resume`) of the same run fails at once with
`RunInUse`, naming the holder's pid, instead of racing it for config.yaml and the ports.

The lock is the kernel's: it ends with the holder's process (even one killed by SIGKILL),
so a stale lock file never blocks a resume. Services do not inherit it (the supervisor's
children close inherited descriptors at exec).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from areal_hex.errors import UsageError
from areal_hex.run_files import RunPaths


class RunInUse(UsageError):
    """Another launcher holds the run directory's lock."""


class RunLock:
    """`with RunLock(run_dir):` ... ; `acquire()` creates the run directory if needed."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = RunPaths.at(self.run_dir).lock
        self._fd: int | None = None

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunInUse(
                f"{self.run_dir} is in use by another areal-hex launcher ({holder}, lock "
                f"{self.path}): wait for it to end or stop it; two launchers of one run "
                "would race for its files and ports"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int, wait_s: float = 1.0) -> str:
    """`pid N` from the lock file, written by the holder right after it locked (a lock
    taken a moment ago may not show it yet: read again for up to `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        except OSError:
            text = ""
        if text.isdigit():
            return f"pid {text}"
        if time.monotonic() >= deadline:
            return "pid unknown: it is still starting"
        time.sleep(0.02)
