"""A full disk stops a run cleanly instead of crashing its launcher or its services.

`DiskWatch.check()` runs on each tick of the launcher: when the filesystem of the run
directory has less free space than the run still needs to write its next checkpoint and
weights version (the size of the newest of each on disk, plus a margin for logs, the
append-only file and the report), it raises `DiskFull`, whose message names the
filesystem, the free space and the space needed; the launcher then stops the services
while they can still write their last state and the report, and prints the resume hint.
A write of the launcher's own that fails with ENOSPC anyway is named the same way.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

MIB = 1 << 20
MARGIN = 8 * MIB  # logs, the append-only file and the report until the run is stopped


class DiskFull(OSError):
    """The run's filesystem is (about to be) full; the message says which and how much."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def filesystem_of(path: Path) -> str:
    """`MOUNTPOINT (DEVICE, TYPE)` of the filesystem holding `path` (from /proc/mounts)."""
    target = os.path.realpath(path)
    best = ("/", "?", "?")
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        mounts = []
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, parts[0], parts[2])
    return f"{best[0]} ({best[1]}, {best[2]})"


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                continue
    return total


def _newest(root: Path, prefix: str) -> Path | None:
    found = [
        (int(p.name[len(prefix) :]), p)
        for p in root.glob(f"{prefix}*")
        if p.is_dir() and p.name[len(prefix) :].isdigit()
    ]
    return max(found)[1] if found else None


def _mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


class DiskWatch:
    """Free space of the run directory's filesystem against what the run still writes."""

    def __init__(self, run_dir: Path, weights_dir: Path, checkpoint_dir: Path) -> None:
        self.run_dir, self.weights_dir, self.checkpoint_dir = run_dir, weights_dir, checkpoint_dir
        self._needed: int | None = None
        self._sized_from: tuple[Path | None, Path | None] = (None, None)
        self._last = 0.0

    def needed(self) -> int:
        """Bytes the run needs free: one more checkpoint and weights version the size of
        its newest ones (written while those are kept), and the margin."""
        ckpt = _newest(self.checkpoint_dir, "step")
        weights = _newest(self.weights_dir, "v")
        if self._needed is None or self._sized_from != (ckpt, weights):
            sizes = [_du(p) for p in (ckpt, weights) if p is not None]
            self._needed = sum(sizes) + MARGIN
            self._sized_from = (ckpt, weights)
        return self._needed

    def check(self, every_s: float = 2.0) -> None:
        """Raises DiskFull when the free space is below `needed()` (looked at most every
        `every_s`)."""
        now = time.monotonic()
        if now - self._last < every_s:
            return
        self._last = now
        free = shutil.disk_usage(self.run_dir).free
        need = self.needed()
        if free < need:
            raise DiskFull(disk_full_message(self.run_dir, free, need))


def disk_full_message(run_dir: Path, free: int | None = None, need: int | None = None) -> str:
    """What is full, how much is free and needed (unless given: the newest checkpoint
    and weights in the run directory's usual places, as `DiskWatch` sizes them), and what
    to do."""
    if need is None:
        try:
            need = DiskWatch(run_dir, run_dir / "weights", run_dir / "checkpoints").needed()
        except OSError:
            need = None
    if free is None:
        try:
            free = shutil.disk_usage(run_dir).free
        except OSError:
            free = 0
    need_text = f"; the run needs at least {_mib(need)} free" if need else ""
    return (
        f"disk full: filesystem {filesystem_of(run_dir)} holding {run_dir} has "
        f"{_mib(free)} free{need_text} to write its next checkpoint and weights; the run "
        "was stopped. Free space there (or move the run directory), then resume"
    )


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


NO_SPACE = "No space left on device"  # strerror(ENOSPC), as a service's log shows it
