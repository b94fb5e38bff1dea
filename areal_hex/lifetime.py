"""A run's processes live no longer than the launcher that started them.

Two mechanisms, because a launcher killed by SIGKILL runs no cleanup of its own:
- `die_with_parent()`, the supervisor's pre-exec hook: Linux SIGKILLs each service it
  starts when the launcher dies (PR_SET_PDEATHSIG; it survives exec, so the DeepSpeed
  runner that `areal-hex train` execs carries it);
- `tie_to_launcher()`, called by every service process (the CLI entry and each trainer
  rank): once the launcher named in `AREAL_HEX_LAUNCHER` is gone, it SIGKILLs every
  process group of the run (`AREAL_HEX_PIDS`, the launcher's pid file: each service is
  a process group of its own), its own last. That reaches what the death signal cannot:
  DeepSpeed's ranks, the controller's reward workers, a Valkey started by `buffer
  serve`, and a service that is stopped (SIGSTOP: it cannot act, but SIGKILL ends it).
  Its own parent's death arrives as SIGHUP (replacing the supervisor's SIGKILL, which
  would end it before it could act), and a daemon thread also checks the launcher, for
  a death missed while the signal was being set.

The launcher is named by pid and start time (`/proc/<pid>/stat`), so a reused pid is
not mistaken for it, and a zombie counts as gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ENV = "AREAL_HEX_LAUNCHER"  # "<pid>:<start time>" of the launcher of this process
PIDS_ENV = "AREAL_HEX_PIDS"  # the launcher's pid file: {service: its process group}
_PR_SET_PDEATHSIG = 1


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None if it is gone)."""
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def token(pid: int | None = None) -> str:
    """`<pid>:<start time>` naming a process (default: this one) for `alive`."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid) or ''}"


def alive(tok: str) -> bool:
    """Is the process `token` named still running (not a zombie, not a reused pid)?"""
    pid_s, _, started = tok.partition(":")
    fields = _stat(int(pid_s))
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return not started or (len(fields) > 19 and fields[19] == started)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A pre-exec hook: the child gets `sig` when the thread that started it dies (Linux;
    None elsewhere or off the main thread, where the signal would follow a thread)."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:  # between fork and exec: one foreign call, resolved in the parent
        prctl(_PR_SET_PDEATHSIG, sig)

    return hook


def _end_run(*_: object) -> None:
    """SIGKILL the run's other service groups (those whose processes name the run
    directory, so a reused pid is spared), then this process's own group."""
    pid_file = os.environ.get(PIDS_ENV)
    if pid_file:
        mark = f"{Path(pid_file).parent.name}/"
        try:
            groups = json.loads(Path(pid_file).read_text())
        except (OSError, ValueError):
            groups = {}
        for name, pgid in groups.items():
            if name == "launcher" or pgid == os.getpgrp():
                continue
            if any(mark in cmd for _, cmd in group_members(int(pgid))):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(pgid), signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def tie_to_launcher(poll_s: float = 0.5) -> threading.Thread | None:
    """With `AREAL_HEX_LAUNCHER` set: the run's process groups, this one's last, are
    SIGKILLed once the launcher (or this process's parent) is gone. Returns the watching
    thread; None when no launcher is named (a standalone service). Call from the main
    thread."""
    tok = os.environ.get(ENV)
    if not tok:
        return None
    hook = die_with_parent(signal.SIGHUP)
    if hook is not None:  # the parent's death: SIGHUP, which ends the group
        signal.signal(signal.SIGHUP, _end_run)
        hook()

    def watch() -> None:
        while alive(tok):
            time.sleep(poll_s)
        _end_run()

    t = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    t.start()
    return t


def command(pid: int) -> str | None:
    """The command line of a live process (None if it is gone or a zombie)."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return None


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes of process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is None or len(fields) < 3 or fields[0] == "Z" or int(fields[2]) != pgid:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        out.append((int(entry.name), cmd))
    return out
