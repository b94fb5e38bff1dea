"""The launcher's side of the fork server (`zygote.py`): start it, ask it for services,
wait for them as for any child.

`run.fork_services` (on by default for local runs) starts the services of a local run
that import torch (inference servers, trainer, `areal-hex` workflow tasks) from one
parent that has imported torch, transformers' model modules and FastAPI once (the
trainer from a branch of it that has imported DeepSpeed instead of FastAPI:
fork_services.py). Any failure (the parent not safe to fork, a request refused, the
parent gone) starts that service as a plain process, as with the switch off.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from areal_hex import lifetime

_PR_SET_CHILD_SUBREAPER = 36

# Environment read by a library as it is loaded (OpenMP, MKL, OpenBLAS, the interpreter,
# the dynamic linker): a forked service has its parent's, so it is forked only where its
# own agree. The thread counts it sets itself (zygote.py
# `apply_threads`); OpenBLAS (numpy's) starts its threads at import, so the parent runs
# it with one thread unless OPENBLAS_NUM_THREADS says otherwise (the services compute
# with torch).
LOADTIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "PYTHON", "LD_", "MALLOC_")
PER_CHILD = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED", "OPENBLAS_NUM_THREADS"}


class ForkError(RuntimeError):
    """The fork server could not start a service (the caller starts a plain process)."""


def loadtime_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOADTIME) and k not in PER_CHILD}


def become_subreaper(on: bool = True) -> bool:
    """Make this process the reaper of its orphaned descendants (Linux), so that a service
    the fork server's middle process leaves is this process's child; `on=False`: no more
    (a process that runs more than the one supervisor, e.g. a bench)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(_PR_SET_CHILD_SUBREAPER, int(on)) == 0


class ForkedProcess:
    """A forked service, this process's child: what the supervisor uses of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is not known
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The fork server of a run: started at once, importing while the launcher goes on;
    the first request waits until it is ready (`ready_timeout_s`)."""

    def __init__(
        self,
        run_dir: Path,
        modules: list[str],
        env: Mapping[str, str],
        log_path: Path,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.run_dir, self.modules = run_dir, list(modules)
        self.started_at = time.time()
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self.env.setdefault("OPENBLAS_NUM_THREADS", "1")
        self.ready_timeout_s = ready_timeout_s
        self.ready: bool | None = None  # None: not heard from yet
        self.why = ""  # why it is not used, once it is not
        self.hello: dict[str, Any] = {}
        self._buf = b""
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # the run directory on its command line: the run's processes are found by it
        argv = [sys.executable, "-m", "hexctl.launch.zygote", str(req_r), str(rep_w)]
        try:
            with open(log_path, "ab") as log:
                self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                    [*argv, f"{run_dir}/", *modules],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    pass_fds=(req_r, rep_w),
                    start_new_session=True,
                    preexec_fn=lifetime.die_with_parent(),
                )
        except OSError:
            self.proc = None
            self.close()
            raise
        finally:
            os.close(req_r)
            os.close(rep_w)

    def differs(self, env: Mapping[str, str]) -> list[str]:
        """The load-time settings a service with `env` would not have forked (none: it runs
        as it would as a plain process)."""
        mine, its = loadtime_env(self.env), loadtime_env(env)
        return sorted(k for k in mine.keys() | its.keys() if mine.get(k) != its.get(k))

    def _line(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._rep_r], [], [], left)[0]:
                raise ForkError(f"no answer from the fork server in {timeout_s:.0f} s")
            chunk = os.read(self._rep_r, 65536)
            if not chunk:
                raise ForkError("the fork server exited")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return dict(json.loads(line))

    def wait_ready(self) -> bool:
        """Whether services can be forked (waits for the imports the first time)."""
        if self.ready is None:
            try:
                self.hello = self._line(self.ready_timeout_s)
                self.ready = bool(self.hello.get("ready"))
                self.why = "" if self.ready else str(self.hello.get("why"))
            except (ForkError, ValueError) as exc:
                self.ready, self.why = False, str(exc)
            if not self.ready:
                self.close()
        return bool(self.ready)

    def spawn(
        self, argv: list[str], env: Mapping[str, str], log: Path, cwd: str | None,
        cpus: set[int] | None,
    ) -> ForkedProcess:  # fmt: skip
        """Fork the service `argv` (`python -m MODULE ...`) with its environment, log,
        directory and cores; ForkError if it cannot."""
        if not self.wait_ready():
            raise ForkError(f"fork server not used: {self.why}")
        request = {
            "argv": argv, "env": dict(env), "log": str(log), "cwd": cwd,
            "cpus": sorted(cpus) if cpus else None, "launcher": os.getpid(),
        }  # fmt: skip
        try:
            os.write(self._req_w, json.dumps(request).encode() + b"\n")
            reply = self._line(30.0)
        except (OSError, ValueError, ForkError) as exc:
            self.ready, self.why = False, f"the fork server is gone ({exc})"
            self.close()
            raise ForkError(self.why) from None
        if "pid" not in reply:
            raise ForkError(f"the fork server refused: {reply.get('error')}")
        return ForkedProcess(int(reply["pid"]))

    def close(self) -> None:
        """End the fork server (the services it forked are the launcher's, not its)."""
        for fd in (self._req_w, self._rep_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._req_w = self._rep_r = -1
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
