"""A small process supervisor: start services, watch them, restart the ones allowed to
restart, stop everything cleanly, and say which process failed and why.

Each service runs in its own session (process group), so that stopping it also stops
whatever it spawned (the DeepSpeed launcher's ranks, SGLang's workers) and a Ctrl-C on
the terminal reaches only the supervisor, which then stops the services in order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

OnExit = Literal["fail", "restart", "finish"]


@dataclass
class ProcessSpec:
    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's env
    # What the process exiting means: "fail": a non-zero exit fails the run (0: it is
    # done); "restart": start it again (up to max_restarts, any exit code); "finish": exit
    # code 0 ends the run successfully, non-zero fails it.
    on_exit: OnExit = "fail"
    # A "fail" or "finish" process that exits non-zero is started again (up to
    # max_restarts) instead of failing the run.
    restart_on_failure: bool = False
    max_restarts: int = 3
    cpus: set[int] | None = None  # CPU affinity (None: inherit)
    cwd: str | None = None


@dataclass
class Managed:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    returncode: int | None = None


@dataclass
class Outcome:
    """How a watch ended: `finished` (a "finish" process exited 0), `failed` (with the
    process name, its exit code and last log lines) or `interrupted`."""

    status: Literal["finished", "failed", "interrupted", "stopped"]
    name: str | None = None
    returncode: int | None = None
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("finished", "stopped")


def tail_lines(path: Path, n: int = 30, max_bytes: int = 64_000) -> str:
    """The last `n` lines of a log file (reads at most `max_bytes` from its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-n:])


def _set_affinity(cpus: set[int] | None) -> Callable[[], None] | None:
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None

    def apply() -> None:  # in the child, between fork and exec: inherited by its children
        os.sched_setaffinity(0, cpus)

    return apply


def _group_alive(pgid: int) -> bool:
    """Is any process of group `pgid` alive (zombies waiting to be reaped do not count)?"""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Supervisor:
    """Owns the processes it starts; `stop()` (or leaving the `with` block) ends them all."""

    def __init__(
        self, poll_s: float = 0.5, stop_timeout_s: float = 20.0, pid_file: Path | None = None
    ) -> None:
        self.poll_s = poll_s
        self.pid_file = pid_file  # kept current: {name: pid} of every started process
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, Managed] = {}
        self.events: list[tuple[float, str, str]] = []  # (time, name, what happened)

    # ------------------------------------------------------------ starting
    def start(self, spec: ProcessSpec) -> Managed:
        if spec.name in self.procs and self.running(spec.name):
            raise RuntimeError(f"{spec.name} is already running")
        m = self.procs.get(spec.name) or Managed(spec)
        m.spec = spec
        self.procs[spec.name] = m
        self._spawn(m)
        return m

    def _spawn(self, m: Managed) -> None:
        spec = m.spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **spec.env}
        with open(spec.log_path, "ab") as log:
            log.write(f"\n=== start {spec.name}: {' '.join(spec.command)}\n".encode())
            log.flush()
            m.proc = subprocess.Popen(
                spec.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.cwd,
                start_new_session=True,
                preexec_fn=_set_affinity(spec.cpus),
            )
        m.started_at = time.monotonic()
        m.returncode = None
        self.events.append((time.time(), spec.name, "start"))
        self._write_pids()

    def _write_pids(self) -> None:
        if self.pid_file is None:
            return
        pids = {n: m.proc.pid for n, m in self.procs.items() if m.proc is not None}
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids))
        tmp.replace(self.pid_file)

    def running(self, name: str) -> bool:
        m = self.procs.get(name)
        return m is not None and m.proc is not None and m.proc.poll() is None

    def pid(self, name: str) -> int | None:
        m = self.procs.get(name)
        return m.proc.pid if m and m.proc else None

    def tail(self, name: str, n: int = 30) -> str:
        return tail_lines(self.procs[name].spec.log_path, n)

    # ------------------------------------------------------------ watching
    def check(self) -> Outcome | None:
        """One pass over the processes: restart what may restart; an Outcome when the run
        has finished or failed, else None."""
        for name, m in self.procs.items():
            if m.proc is None or m.returncode is not None:
                continue
            rc = m.proc.poll()
            if rc is None:
                continue
            m.returncode = rc
            self.events.append((time.time(), name, f"exit {rc}"))
            spec = m.spec
            if spec.on_exit == "finish" and rc == 0:
                return Outcome("finished", name, rc)
            if spec.on_exit == "fail" and rc == 0:
                continue  # done with its work (the controller after its last group)
            may_restart = spec.on_exit == "restart" or spec.restart_on_failure
            if may_restart and m.restarts < spec.max_restarts:
                self._signal(m.proc, signal.SIGKILL)  # what it left behind (ranks, workers)
                self._wait_group(m.proc.pid, 10.0)
                m.restarts += 1
                with open(spec.log_path, "ab") as log:
                    log.write(f"\n=== {name} exited ({rc}); restart {m.restarts}\n".encode())
                self._spawn(m)
                self.events.append((time.time(), name, "restart"))
                continue
            return Outcome("failed", name, rc, self.tail(name))
        return None

    def watch(
        self,
        on_tick: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        timeout_s: float | None = None,
    ) -> Outcome:
        """Poll until a process finishes the run or fails, `should_stop()` says so, or
        Ctrl-C; `on_tick` runs every poll (progress display)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                outcome = self.check()
                if outcome is not None:
                    return outcome
                if on_tick is not None:
                    on_tick()
                if should_stop is not None and should_stop():
                    return Outcome("stopped")
                if deadline is not None and time.monotonic() > deadline:
                    return Outcome("failed", None, None, f"timed out after {timeout_s:.0f} s")
                time.sleep(self.poll_s)
        except KeyboardInterrupt:
            return Outcome("interrupted")

    # ------------------------------------------------------------ stopping
    def stop(self, names: Sequence[str] | None = None, timeout_s: float | None = None) -> None:
        """SIGTERM each process group (in the given order, default: reverse start order),
        wait up to `timeout_s` for each, then SIGKILL."""
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        order = list(names) if names is not None else list(reversed(self.procs))
        for name in order:
            m = self.procs.get(name)
            if m is None or m.proc is None:
                continue
            if m.proc.poll() is None or _group_alive(m.proc.pid):
                self._signal(m.proc, signal.SIGTERM)
                # the whole group: a launcher may exit at once while its ranks still
                # write their last checkpoint
                if not self._wait_group(m.proc.pid, timeout_s):
                    self._signal(m.proc, signal.SIGKILL)
                m.proc.wait()
                self.events.append((time.time(), name, "stopped"))
            # children left behind in its group (e.g. ranks of a killed launcher)
            self._signal(m.proc, signal.SIGKILL)
            if m.returncode is None:
                m.returncode = m.proc.returncode

    @staticmethod
    def _wait_group(pgid: int, timeout_s: float) -> bool:
        """Wait until no live process is left in the process group; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while _group_alive(pgid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # its own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
