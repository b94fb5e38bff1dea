"""The processes of bench chaos's job, and what its run directory says: finding the
pids to strike (a trainer rank, not its launcher), the faults that need more than a
signal (a truncated checkpoint, a cut append-only file, every process at once, two
resumes racing), starting `areal-hex run`, and the live ledger."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from areal_hex import lifetime
from areal_hex.config.base import load_yaml_text
from areal_hex.run_files import RunPaths, TrainerRow, read_rows
from hexctl.report.ledger import read_ledger
from trainer_service.checkpoint import complete_checkpoints

AOF_CUT_BYTES = 300  # cut from the end of Valkey's append-only file (`aof_truncate`)
RUN_ID = "chaos"


def pids_of(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "pids.json").read_text())


def rank_pids(pids: dict[str, int]) -> list[int]:
    """The trainer's ranks (not its launcher's processes)."""
    launchers = ("deepspeed.launcher", "torch.distributed.run")
    return [
        p
        for p, cmd in lifetime.group_members(pids["trainer"])
        if "-m trainer_service.main" in cmd and not any(x in cmd for x in launchers)
    ]


def kill_rank(pids: dict[str, int], rank: int | None = None) -> str:
    """SIGKILL one trainer rank (`rank`, found ahead, else the first), not its launcher:
    the launcher must notice."""
    pid = rank if rank is not None else rank_pids(pids)[0]
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL trainer rank {pid}"


def corrupt_newest(run_dir: Path) -> str:
    """Truncate the largest file of the newest complete checkpoint to half its size."""
    _, newest = complete_checkpoints(RunPaths.at(run_dir).checkpoint_dir)[-1]
    victim = max((f for f in newest.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    return f"truncated {victim.relative_to(run_dir)} ({size} -> {size // 2} bytes)"


def power_loss(run_dir: Path, launcher: subprocess.Popen[bytes]) -> str:
    """SIGKILL the launcher and every process group of the run at once."""
    pids = pids_of(run_dir)
    launcher.send_signal(signal.SIGKILL)
    for pid in (p for name, p in pids.items() if name != "launcher"):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    groups = sorted(p for name, p in pids.items() if name != "launcher")
    return f"SIGKILL launcher {launcher.pid} and process groups {groups}"


def cut_aof(run_dir: Path, nbytes: int = AOF_CUT_BYTES) -> str:
    """Cut the last `nbytes` of Valkey's newest append-only increment (nothing runs)."""
    incr = sorted((run_dir / "valkey" / "appendonlydir").glob("*.incr.aof"))[-1]
    size = incr.stat().st_size
    with open(incr, "r+b") as f:
        f.truncate(max(0, size - nbytes))
    return f"cut {incr.relative_to(run_dir)} ({size} -> {max(0, size - nbytes)} bytes)"


def racing_resumes(run_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Two `--resume` at once: the one that runs, and the other's exit code and words."""
    racers = [start_launcher(["--resume", str(run_dir)], log) for _ in range(2)]
    first = wait_for(lambda: any(r.poll() is not None for r in racers), 120.0)
    loser = next((r for r in racers if r.poll() is not None), None)
    if not first or loser is None:
        return racers[0], {"loser_exit": None}
    winner = racers[1] if loser is racers[0] else racers[0]
    said = [ln for ln in log.read_text(errors="replace").splitlines() if "in use by" in ln]
    return winner, {"loser_exit": loser.returncode, "loser_said": said[-1] if said else ""}


def survivors(run_dir: Path, timeout_s: float) -> dict[str, list[int]]:
    """Processes of the run still alive `timeout_s` after its launcher died (or none,
    as soon as they are all gone)."""
    from hexctl.launch.supervisor import live_processes

    def left() -> dict[str, list[int]]:
        return live_processes(run_dir / "pids.json", f"{run_dir.name}/")

    wait_for(lambda: not left(), timeout_s)
    return left()


def start_launcher(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "hexctl.cli", "run", *args, "--no-progress"]
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def steps_done(run_dir: Path) -> list[TrainerRow]:
    return read_rows(RunPaths.at(run_dir).metrics, TrainerRow)


def live_ledger(run_dir: Path, timeout_s: float = 60.0) -> dict[str, Any] | None:
    """The ledger read from the running Valkey (waiting while it restarts). A commit
    landing between the checkpoint read and the counters read shows its groups as
    missing; such a read is repeated."""
    import redis

    cfg = load_yaml_text((run_dir / "config.yaml").read_text(), str(run_dir / "config.yaml"))
    client = redis.Redis.from_url(cfg["redis"]["url"], socket_timeout=5)
    deadline = time.monotonic() + timeout_s
    out = None
    try:
        while True:
            try:
                out = read_ledger(client, RUN_ID, RunPaths.at(run_dir))
                if out.get("groups_lost") == 0:
                    return out
            except redis.RedisError:
                pass
            if time.monotonic() >= deadline:
                return out
            time.sleep(0.5)
    finally:
        client.close()


def wait_for(cond: Any, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return False
