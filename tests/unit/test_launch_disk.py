"""A full disk is named (filesystem, free, needed) before the run's writes fail, and the
unfinished publication of a killed writer is removed at the next start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_hex.run_files import remove_stale_tmp
from hexctl.launch.disk import (
    MARGIN,
    MIB,
    DiskFull,
    DiskWatch,
    disk_full_message,
    filesystem_of,
)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (needs root and mount; skipped without them)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)])
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _fill(path: Path, nbytes: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * nbytes)


def test_the_watch_names_the_filesystem_free_and_needed(small_fs: Path) -> None:
    run = small_fs / "run"
    _fill(run / "checkpoints" / "step3" / "model.pt", 2 * MIB)
    _fill(run / "checkpoints" / "step6" / "model.pt", 1 * MIB)  # the newest counts
    _fill(run / "weights" / "v6" / "model.safetensors", MIB // 2)
    watch = DiskWatch(run, run / "weights", run / "checkpoints")
    assert watch.needed() == MIB + MIB // 2 + MARGIN
    watch.check()  # 12.5 MiB free, 9.5 MiB needed
    _fill(small_fs / "other" / "big", 4 * MIB)
    watch.check()  # looked at most every 2 s: not yet
    with pytest.raises(DiskFull) as caught:
        watch.check(every_s=0)
    text = str(caught.value)
    assert text.startswith(f"disk full: filesystem {small_fs} (tmpfs, tmpfs) holding {run}")
    assert "MiB free; the run needs at least 9.5 MiB free" in text and "resume" in text
    assert caught.value.errno == 28


def test_a_write_that_met_enospc_is_named_with_the_space_needed(tmp_path: Path) -> None:
    """A service's ENOSPC (no watch reading behind it) still says what the run needs."""
    run = tmp_path / "run"
    _fill(run / "checkpoints" / "step6" / "model.pt", 2 * MIB)
    _fill(run / "weights" / "v6" / "model.safetensors", MIB)
    text = disk_full_message(run)
    assert f"holding {run} has " in text
    assert f"the run needs at least {(3 * MIB + MARGIN) / MIB:.1f} MiB free" in text


def test_filesystem_of_a_path_is_its_longest_mount() -> None:
    assert filesystem_of(Path("/proc/self")).startswith("/proc (proc, proc)")


def test_a_dead_writers_publication_is_removed_a_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in (f".v47.tmp-{dead}", f".v48.tmp-{live.pid}", "v46"):
            _fill(tmp_path / name / "model.safetensors", 10)
        assert remove_stale_tmp(tmp_path) == [tmp_path / f".v47.tmp-{dead}"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".v48.tmp-{live.pid}", "v46"]
    finally:
        live.kill()
        live.wait()
    assert remove_stale_tmp(tmp_path) == [tmp_path / f".v48.tmp-{live.pid}"]
