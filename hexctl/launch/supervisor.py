"""A small process supervisor: start services, watch them, restart the ones allowed to
restart, stop everything cleanly, and say which process failed and why.

Each service runs in its own session (process group), so that stopping it also stops
whatever it spawned (the DeepSpeed launcher's ranks, SGLang's workers) and a Ctrl-C on
the terminal reaches only the supervisor, which then stops the services in order.

No service outlives the supervisor's process, even one killed by SIGKILL: each child is
started with a death signal and is told who its launcher is, so that every process of
its group ends itself once the launcher is gone (areal_hex/lifetime.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from areal_hex import lifetime
from hexctl.launch.forkserver import ForkedProcess, ForkError, ForkServer, become_subreaper

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
    # Forked from the run's fork server where one is attached (`Supervisor.forker`) and
    # `command` is `python -m MODULE ...`; a plain process otherwise or on any failure.
    fork: bool = False


@dataclass
class Managed:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes] | ForkedProcess | None = None
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


def _pre_exec(cpus: set[int] | None) -> Callable[[], None] | None:
    """In the child, between fork and exec: the death signal, and the CPU affinity
    (inherited by its children)."""
    die = lifetime.die_with_parent()
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return die

    def apply() -> None:
        if die is not None:
            die()
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


LAUNCHER = "launcher"  # the supervisor's own entry in the pid file


def live_processes(pid_file: Path, mark: str) -> dict[str, list[int]]:
    """{name: live pids} of a pid file's processes that still run: every member of each
    service's process group whose command line holds `mark` (the run directory: their
    config is there), and the launcher if it is still an areal-hex process, so that a
    reused pid is not taken for them."""
    try:
        pids: dict[str, int] = json.loads(pid_file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, list[int]] = {}
    for name, pid in pids.items():
        if name == LAUNCHER:
            cmd = lifetime.command(pid)
            ours = cmd is not None and "areal" in cmd and pid != os.getpid()
            if ours:
                out[name] = [pid]
            continue
        members = lifetime.group_members(pid)
        if any(mark in cmd for _, cmd in members):
            out[name] = sorted(p for p, _ in members)
    return out


def stop_processes(live: dict[str, list[int]], timeout_s: float = 30.0) -> None:
    """SIGTERM what `live_processes` found (the launcher first: it stops its services in
    order), wait up to `timeout_s` for all of it to end, then SIGKILL what is left."""
    order = sorted(live, key=lambda n: n != LAUNCHER)
    for name in order:
        for pid in live[name]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    left = [p for pids in live.values() for p in pids]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if lifetime.command(p) is not None]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


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
        self.forker: ForkServer | None = None

    def attach(self, forker: ForkServer) -> None:
        """Start the `fork` processes from `forker` (closed with the supervisor); they
        are re-parented to this process, which waits for them as for its own."""
        if become_subreaper():
            self.forker = forker
        else:
            forker.close()

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
        env = {**os.environ, **spec.env, lifetime.ENV: lifetime.token()}
        if self.pid_file is not None:  # a service left alone ends the others too
            env[lifetime.PIDS_ENV] = str(self.pid_file.resolve())
        with open(spec.log_path, "ab") as log:
            log.write(f"\n=== start {spec.name}: {' '.join(spec.command)}\n".encode())
            log.flush()
            m.proc = self._forked(spec, env)
            if m.proc is None:
                m.proc = subprocess.Popen(
                    spec.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=spec.cwd,
                    start_new_session=True,
                    preexec_fn=_pre_exec(spec.cpus),
                )
        m.started_at = time.monotonic()
        m.returncode = None
        self.events.append((time.time(), spec.name, "start"))
        self._write_pids()

    def _forked(self, spec: ProcessSpec, env: dict[str, str]) -> ForkedProcess | None:
        """`spec` forked from the fork server, or None (none attached, not a `python -m`
        command, load-time settings of its own, or the fork server failed: said in its
        log and the events)."""
        forker = self.forker
        argv = spec.command
        if forker is None or not spec.fork or len(argv) < 3 or argv[1] != "-m":
            return None
        differs = forker.differs(env)
        why = f"its load-time environment differs ({', '.join(differs)})" if differs else None
        if why is None:
            try:
                return forker.spawn(argv, env, spec.log_path, spec.cwd, spec.cpus)
            except ForkError as exc:
                why = str(exc)
        self.events.append((time.time(), spec.name, f"plain process: {why}"))
        with open(spec.log_path, "ab") as log:
            log.write(f"=== a plain process: {why}\n".encode())
        return None

    def _write_pids(self) -> None:
        if self.pid_file is None:
            return
        pids = {n: m.proc.pid for n, m in self.procs.items() if m.proc is not None}
        pids[LAUNCHER] = os.getpid()
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids))
        tmp.replace(self.pid_file)

    def running(self, name: str) -> bool:
        m = self.procs.get(name)
        return m is not None and m.proc is not None and m.proc.poll() is None

    def pid(self, name: str) -> int | None:
        m = self.procs.get(name)
        return m.proc.pid if m and m.proc else None

    def kill(self, name: str, why: str) -> None:
        """SIGKILL a process's group (e.g. hung); `check` then treats it as dead."""
        m = self.procs.get(name)
        if m is None or m.proc is None or m.proc.poll() is not None:
            return
        self.events.append((time.time(), name, f"killed: {why}"))
        with open(m.spec.log_path, "ab") as log:
            log.write(f"\n=== {name} killed by the supervisor: {why}\n".encode())
        self._signal(m.proc, signal.SIGKILL)

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
    def _signal(proc: subprocess.Popen[bytes] | ForkedProcess, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # its own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.forker is not None:
            self.forker.close()
            become_subreaper(False)
