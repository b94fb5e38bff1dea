"""bench chaos's own logic: the fault plan, the disk-full and task faults' checks."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml

from hexctl.bench import BenchFailed
from hexctl.bench.system.chaos import KINDS, fault_kinds, fault_ok, fault_plan, struck_processes
from hexctl.bench.system.chaos_disk import SmallDisk, disk_full_ok, stop_checks
from hexctl.bench.system.chaos_task import NOOP_TASK, task_instances, task_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")


def test_fault_plan_gives_distinct_steps_when_faults_outnumber_them() -> None:
    for seed in range(50):
        plan = fault_plan(list(KINDS), 30, seed)
        steps = [s for s, _ in plan]
        assert sorted(k for _, k in plan) == sorted(KINDS)
        assert steps == sorted(steps) and len(set(steps)) == len(steps), seed
    # more faults than steps between the first and the last: still one step each
    crowded = fault_plan(["inference"] * 12, 10, seed=3)
    assert [s for s, _ in crowded] == list(range(2, 14))


def test_unknown_fault_kind_is_named() -> None:
    assert fault_kinds(" task_kill, disk_full ,") == ["task_kill", "disk_full"]
    with pytest.raises(BenchFailed, match="unknown fault kind.*disk_ful\\b.*expected"):
        fault_kinds("disk_ful,trainer")


def test_stop_checks_read_the_launcher_words(tmp_path: Path) -> None:
    run_dir = tmp_path / "disk" / "chaos"
    run_dir.mkdir(parents=True)
    said = (
        f"error: disk full: filesystem {tmp_path / 'disk'} (areal-hex-chaos, tmpfs) holding "
        f"{run_dir} has 0.0 MiB free; the run needs at least 9.3 MiB free to write its next "
        "checkpoint and weights; the run was stopped.\n"
        "summary.json not written (No space left on device): --resume writes it\n"
        f"continue with: areal-hex run --resume {run_dir}\n"
    )
    got = stop_checks(run_dir, said, t=0.0)
    assert got["disk_named"] and got["resume_hint"] and got["summary"] == "explained"
    assert got["message"].startswith("error: disk full: filesystem")
    # no filesystem named, no hint, no word on the summary: each one missing is seen
    bare = stop_checks(run_dir, "error: trainer exited with code 1\n", t=0.0)
    assert bare == {"message": "", "disk_named": False, "resume_hint": False, "summary": "missing"}
    (run_dir / "summary.json").write_text("{}")
    assert stop_checks(run_dir, said, t=0.0)["summary"] == "written"
    old = os.stat(run_dir / "summary.json").st_mtime
    assert stop_checks(run_dir, said, t=old + 1)["summary"] == "explained"  # an old one


def test_disk_full_passes_only_a_clean_stop_and_a_clean_resume() -> None:
    good = {
        "kind": "disk_full",
        "launcher_exit": 1,
        "disk_named": True,
        "resume_hint": True,
        "summary": "explained",
        "tmp_left": [],
        "grown": True,
        "completed": True,
        "lost": 0,
        "trained_twice": 0,
        "produced_twice": 0,
        "survivors_after_10s": 0,
    }
    assert disk_full_ok(good) and fault_ok(good)
    for key, bad in [
        ("launcher_exit", 2),
        ("disk_named", False),
        ("resume_hint", False),
        ("summary", "missing"),
        ("tmp_left", [".v9.tmp-123"]),
        ("lost", 1),
        ("survivors_after_10s", 1),
    ]:
        assert not fault_ok({**good, key: bad}), key
    skipped = {"kind": "disk_full", "struck": False, "skipped": "needs root"}
    assert not fault_ok({**skipped, "completed": True, "lost": None, "trained_twice": None})


def test_small_disk_without_root_is_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with SmallDisk(tmp_path / "disk", True, tmp_path / "keep") as disk:
        assert not disk.mounted and "needs root" in (disk.skipped or "")
    with SmallDisk(tmp_path / "disk", False, tmp_path / "keep") as disk:
        assert not disk.mounted and disk.skipped is None


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_small_disk_fills_grows_and_is_unmounted(tmp_path: Path) -> None:
    mount = tmp_path / "disk"
    with SmallDisk(mount, True, tmp_path / "keep") as disk:
        if disk.skipped:  # root without CAP_SYS_ADMIN (a container)
            pytest.skip(disk.skipped)
        (mount / "run").mkdir()
        (mount / "run" / "a").write_bytes(b"x" * 100_000)
        filled = disk.fill()
        assert filled["size_mib"] * (1 << 20) >= 100_000
        with pytest.raises(OSError) as exc:
            (mount / "run" / "b").write_bytes(b"y" * 200_000)
        assert exc.value.errno == errno.ENOSPC
        assert disk.grow()
        (mount / "run" / "b").write_bytes(b"y" * 200_000)
    assert (tmp_path / "keep" / "run" / "b").stat().st_size == 200_000
    assert not os.path.ismount(mount)


def test_task_kill_adds_a_noop_task_only_where_none_is(tmp_path: Path) -> None:
    [added] = task_overrides(TINY, [])
    assert added.startswith("workflow.tasks=")
    mine = "workflow.tasks=[{name: ref, role: custom, instances: 2, command: [sleep, '9']}]"
    assert task_overrides(TINY, [mine]) == []
    # the override is valid config, and its instances are what the fault strikes
    from areal_hex.config import load_config, save_config

    cfg = load_config(TINY, [added])
    assert [t.name for t in cfg.workflow.tasks] == [NOOP_TASK]
    save_config(cfg, tmp_path / "run" / "config.yaml")
    assert task_instances(tmp_path / "run") == [f"{NOOP_TASK}-0"]
    save_config(load_config(TINY, [mine]), tmp_path / "run" / "config.yaml")
    assert task_instances(tmp_path / "run") == ["ref-0", "ref-1"]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["workflow"]["tasks"]


def test_repeated_task_kills_strike_each_task_in_turn(tmp_path: Path) -> None:
    from areal_hex.config import load_config, save_config

    ppo = str(Path(TINY).parent / "tiny_cpu_ppo.yaml")
    assert task_overrides(ppo, []) == []  # its reference worker and reward model
    save_config(load_config(ppo, []), tmp_path / "run" / "config.yaml")
    struck = [struck_processes("task_kill", tmp_path / "run", n) for n in range(4)]
    assert struck == [("reference-0",), ("rm-0",), ("reference-0",), ("rm-0",)]


def test_an_interrupted_bench_stops_the_launcher_at_once() -> None:
    """On an interrupt or a failure the job's launcher is stopped, not waited for to
    its end (it runs in a session of its own: a Ctrl-C of the bench does not reach it)."""
    import subprocess
    import time

    from hexctl.bench.system.chaos import Job

    job = Job.__new__(Job)
    job.deadline = time.monotonic() + 600
    job.launcher = subprocess.Popen(["sleep", "60"], start_new_session=True)
    t0 = time.monotonic()
    assert job.finish(wait=False) == -15  # SIGTERM
    assert time.monotonic() - t0 < 10
    job.launcher = subprocess.Popen(["true"])
    assert job.finish() == 0
