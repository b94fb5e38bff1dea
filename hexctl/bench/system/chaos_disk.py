"""The `disk_full` fault of bench chaos: the job's run directory lives on a tmpfs of its
own (`SmallDisk`, mounted before the job starts; a tmpfs size is a limit, not memory
taken), which the fault shrinks to what is used at that moment: the filesystem is full
to the last page, and every writer of the run (the trainer's weights and checkpoints,
Valkey's append-only file, the logs) meets ENOSPC from then on. The launcher must stop
the run (exit 1) naming the filesystem and the free space needed, write the summary or
say why not, and print the resume hint; the bench then grows the filesystem back and
resumes, and the unfinished publications (`weights/.v<N>.tmp-<pid>`) left at the stop
must be gone after the resume.

Mounting needs root (CAP_SYS_ADMIN); without it the fault is reported `skipped`, with
the reason, and the job runs on the ordinary disk.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from areal_hex.run_files import RunPaths
from hexctl.bench import BenchFailed

MIB = 1 << 20
ROOMY = 4096 * MIB  # the tmpfs's size before the fault and after it (a limit only)
DEVICE = "areal-hex-chaos"  # the tmpfs's name in /proc/mounts, as the launcher names it
PAGE = 4096


class SmallDisk:
    """A tmpfs at `mount` while the job runs (`with SmallDisk(path, wanted):`); `skipped`
    says why none was mounted when one was wanted. On leaving, the run directory is
    copied to `keep` (the bench's output directory) and the tmpfs unmounted."""

    def __init__(self, mount: Path, wanted: bool, keep: Path) -> None:
        self.mount, self.wanted, self.keep = mount, wanted, keep
        self.mounted = False
        self.skipped: str | None = None
        self.copy_error: str | None = None

    def __enter__(self) -> SmallDisk:
        if not self.wanted:
            return self
        if os.geteuid() != 0:
            self.skipped = "mounting a tmpfs for the run directory needs root"
            return self
        self.mount.mkdir(parents=True, exist_ok=True)
        done = _tool("mount", "-t", "tmpfs", "-o", f"size={ROOMY}", DEVICE, str(self.mount))
        if done.returncode != 0:
            self.skipped = f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
            return self
        self.mounted = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.mounted:
            return
        try:
            shutil.copytree(self.mount, self.keep, dirs_exist_ok=True, symlinks=True)
        except OSError as exc:  # shutil.Error too: what could not be copied is named
            self.copy_error = str(exc)[:500]
        finally:
            if _tool("umount", str(self.mount)).returncode != 0:
                _tool("umount", "-l", str(self.mount))  # busy: detach it now
            self.mounted = False

    def fill(self, attempts: int = 20) -> dict[str, Any]:
        """Shrink the tmpfs to what it holds now (it grows while the run writes: retried
        until a size holds). Returns the size, and what was used and free before."""
        before = shutil.disk_usage(self.mount)
        for _ in range(attempts):
            used = shutil.disk_usage(self.mount).used
            size = -(-used // PAGE) * PAGE
            if self.resize(size):
                free = before.free / MIB
                return {"size_mib": size / MIB, "used_mib": used / MIB, "free_mib_before": free}
            time.sleep(0.05)
        raise BenchFailed(f"could not shrink the tmpfs at {self.mount} to its usage")

    def grow(self) -> bool:
        return self.resize(ROOMY)

    def resize(self, size: int) -> bool:
        return _tool("mount", "-o", f"remount,size={size}", str(self.mount)).returncode == 0


def _tool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


def stale_publications(run_dir: Path) -> list[str]:
    """The unfinished weight publications in the run's weights folder."""
    return sorted(p.name for p in RunPaths.at(run_dir).weights_dir.glob(".v*.tmp-*"))


def stop_checks(run_dir: Path, said: str, t: float) -> dict[str, Any]:
    """What the launcher said and left when the full disk stopped it: `said` is its log
    since the fault. `disk_named`: a line naming the filesystem (its mount point) and the free
    space needed; `resume_hint`; `summary`: "written" (after the fault), "explained" (the
    log says why not) or "missing"."""
    lines = said.splitlines()
    full = [ln for ln in lines if "disk full: filesystem" in ln]
    named = [ln for ln in full if str(run_dir.parent) in ln and "MiB free" in ln]
    summary = RunPaths.at(run_dir).summary
    if summary.is_file() and summary.stat().st_mtime > t:
        written = "written"
    elif any("summary.json not written" in ln for ln in lines):
        written = "explained"
    else:
        written = "missing"
    return {
        "message": (named or full or [""])[-1].strip(),
        "disk_named": bool(named) and any("needs at least" in ln for ln in named),
        "resume_hint": any(f"--resume {run_dir}" in ln for ln in lines),
        "summary": written,
    }


def disk_full_ok(fault: dict[str, Any]) -> bool:
    """The stop was clean and the resume removed what the stop left half-written."""
    return (
        fault.get("launcher_exit") == 1
        and bool(fault.get("disk_named"))
        and bool(fault.get("resume_hint"))
        and fault.get("summary") in ("written", "explained")
        and not fault.get("tmp_left")
        and bool(fault.get("grown"))
    )
