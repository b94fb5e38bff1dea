"""The fork server's own process: import the services' heavy modules once, then fork
each service on request (`python -m hexctl.launch.zygote REQ_FD REP_FD RUN_DIR MODULE...`;
`-PACKAGE`: kept out of those imports, `MODULE:ATTR`: a value read, see `preload`;
`@WORD`, `@`: groups, see `groups`).

The inference server and the trainer each import torch and transformers' model modules
(about 3.3 s of CPU each on this project's 2-core machine); forked from one parent that
has imported them, each child starts with them loaded. What only the trainer imports
(DeepSpeed) a branch of the parent imports on another core while the parent imports what
only the others do (FastAPI), and the branch forks the trainer. The launcher's side is
`forkserver.py`.

Fork safety: the parent starts no thread, no CUDA context and does not load the CUDA
driver (each is checked after the imports; any refuses every request, and the launcher
starts plain processes).
Settings a library reads when it is loaded (OpenMP's wait policy) are the parent's, so
the launcher forks only a service whose own settings agree (`forkserver.LOADTIME`); the
thread counts each child sets itself (`apply_threads`). DeepSpeed is imported only for a
CPU trainer, with the CPU accelerator the trainer sets.

Each request is a JSON line {argv, env, cwd, log, cpus, launcher}; the reply a JSON line
{pid} or {error}. A request is served by a short-lived middle process that forks the
service and exits, so that the service is re-parented to the launcher (a child
subreaper): the launcher waits for it, signals its group and reads its exit code as it
does for a process it started itself.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from typing import Any

PRELOADED_ENV = "AREAL_HEX_PRELOADED"  # set in each forked service's environment
_PR_SET_PDEATHSIG = 1


def apply_threads() -> None:
    """torch's intra-op threads from this process's OMP_NUM_THREADS, when torch was
    loaded before it was set (a forked service; a rank run in-process)."""
    torch = sys.modules.get("torch")
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))


def preload(modules: list[str]) -> list[str]:
    """Import `modules`; returns what failed (a service imports it again itself). A name
    `-PACKAGE` is not imported: PACKAGE looks absent while the others import (an optional
    dependency of theirs that no service uses), and can be imported again afterwards.
    `MODULE:ATTR` imports MODULE and reads its ATTR (a value it computes on first use)."""
    hidden = [m[1:] for m in modules if m.startswith("-") and m[1:] not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # find_spec: not installed
    failed = []
    try:
        for name in modules:
            if name.startswith("-"):
                continue
            module, _, attr = name.partition(":")
            try:
                loaded = importlib.import_module(module)
                if attr:
                    getattr(loaded, attr)
            except Exception as exc:  # any import error: that module is the child's to load
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return failed


def fork_unsafe() -> str | None:
    """Why forking this process now would not be safe, or None."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    if threads != 1:
        names = sorted(t.name for t in threading.enumerate())
        return f"{threads} threads after the imports (Python's: {names})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by the imports"
    if _cuda_driver_loaded():  # e.g. a device count asked: the driver is not fork-safe
        return "the CUDA driver was loaded by the imports"
    return None


def _cuda_driver_loaded() -> bool:
    """Is the CUDA driver library mapped into this process (loaded at its first use)?"""
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def _wait_reparented(launcher: int, timeout_s: float = 10.0) -> None:
    """Until the middle process is gone and this one is the launcher's child."""
    deadline = time.monotonic() + timeout_s
    while os.getppid() != launcher:
        if time.monotonic() > deadline:
            os._exit(1)  # the launcher is gone
        time.sleep(0.001)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _redirect(log: str) -> None:
    """stdin from /dev/null, stdout and stderr appended to `log`; no other descriptor of
    the parent stays open."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in [int(f) for f in os.listdir("/proc/self/fd")]:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)


def _entry(argv: list[str]) -> int:
    """Run `python -m MODULE ARGS...` in this process; its exit code."""
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"not a `python -m MODULE` command: {argv}")
    sys.argv = ["", *argv[3:]]
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def child(request: dict[str, Any]) -> None:
    """The forked service: its session, launcher, logs, cores, directory, environment and
    threads, then its entry point; never returns."""
    code = 1
    try:
        _wait_reparented(int(request["launcher"]))
        os.setsid()
        _die_with_parent()
        _redirect(request["log"])
        if request.get("cpus"):
            os.sched_setaffinity(0, set(request["cpus"]))
        if request.get("cwd"):
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**request["env"], PRELOADED_ENV: "1"})
        apply_threads()
        gc.enable()  # as in a fresh interpreter; its entry may defer collection itself
        code = _entry(list(request["argv"]))
        threading_shutdown = getattr(threading, "_shutdown", None)
        if threading_shutdown is not None:
            threading_shutdown()  # as at interpreter exit: non-daemon threads finish
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def spawn(request: dict[str, Any]) -> int:
    """Fork the service of `request` through a middle process; its pid."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                child(request)
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    os.waitpid(middle, 0)  # the service is the launcher's child from here
    if not data:
        raise OSError("the middle process forked nothing")
    return int(data)


def groups(modules: list[str]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """`modules` as (shared, own, by word): those every service needs, imported first;
    after `@`, those of the services no group names; after `@WORD`, those of the services
    whose command has the word WORD (`train`), imported by a branch (`Branch`) beside the
    others. A `-PACKAGE` is kept out of every group's imports."""
    hidden = [m for m in modules if m.startswith("-")]
    shared: list[str] = []
    own: list[str] = []
    by_word: dict[str, list[str]] = {}
    current = shared
    for name in modules:
        if name.startswith("@"):
            current = own if name == "@" else by_word.setdefault(name[1:], [])
        elif not name.startswith("-"):
            current.append(name)
    return [*hidden, *shared], [*hidden, *own], {w: [*hidden, *m] for w, m in by_word.items()}


class Branch:
    """A second fork server, forked once the shared modules are imported: it imports its
    group's modules while this process imports its own (on another core), then forks the
    services whose command has its word; requests and replies pass through this one."""

    def __init__(self, word: str, modules: list[str], close: tuple[int, ...]) -> None:
        self.word = word
        req_r, self._req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                for fd in (*close, self._req_w, rep_r):
                    os.close(fd)
                _die_with_parent()
                started = time.process_time()
                failed = preload(modules)
                code = answer(req_r, rep_w, modules, failed, started, f"fork server ({word})")
            finally:
                os._exit(code)
        os.close(req_r)
        os.close(rep_w)
        self._replies = os.fdopen(rep_r, "rb")
        self.hello: dict[str, Any] | None = None

    def ask(self, line: bytes) -> bytes:
        """Its reply to the request `line` (waits for its imports the first time)."""
        if self.hello is None:
            self.hello = json.loads(self._replies.readline() or b'{"why": "it exited"}')
        if not self.hello.get("ready"):
            return json.dumps({"error": f"its fork server: {self.hello.get('why')}"}).encode()
        os.write(self._req_w, line)
        reply = self._replies.readline()
        if not reply:
            raise OSError(f"the fork server of `{self.word}` exited")
        return reply.rstrip(b"\n")

    def close(self) -> None:
        os.close(self._req_w)  # it ends at the end of its requests
        self._replies.close()
        os.waitpid(self.pid, 0)


def _reply(line: bytes, branches: list[Branch]) -> bytes:
    try:
        request = json.loads(line)
        branch = next((b for b in branches if b.word in request["argv"][3:]), None)
        if branch is not None:
            return branch.ask(line)
        return json.dumps({"pid": spawn(request)}).encode()
    except Exception as exc:  # any failure: that start falls back to a process
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()


def answer(
    req_fd: int, rep_fd: int, modules: list[str], failed: list[str], started: float,
    name: str = "fork server", branches: tuple[Branch, ...] = (),
) -> int:  # fmt: skip
    """Say whether forking is safe, then serve requests until the launcher closes its
    end (those of a branch's word through it)."""
    # what the imports made is frozen, never collected, so its pages stay shared
    gc.freeze()
    why = fork_unsafe()
    hello = {"ready": why is None, "why": why, "failed": failed}
    hello["cpu_s"] = round(time.process_time() - started, 3)
    loaded = [m for m in modules if not m.startswith(("-", "@"))]
    skipped = list(dict.fromkeys(m[1:] for m in modules if m.startswith("-")))
    print(f"{name}: {len(loaded)} modules imported in {hello['cpu_s']} s of CPU "
          f"(not loaded: {', '.join(skipped) or 'none'}); failed: {failed or 'none'}; "
          f"{'ready' if why is None else why}", flush=True)  # fmt: skip
    with os.fdopen(req_fd, "rb") as requests, os.fdopen(rep_fd, "wb", buffering=0) as replies:
        replies.write(json.dumps(hello).encode() + b"\n")
        if why is None:
            for line in requests:
                replies.write(_reply(line, list(branches)) + b"\n")
    for branch in branches:
        branch.close()
    return 0 if why is None else 1


def serve(req_fd: int, rep_fd: int, modules: list[str]) -> int:
    """Import the shared modules, fork a branch per `@WORD` group, import this process's
    own, then answer."""
    started = time.process_time()
    # the imports make little cyclic garbage, yet each full collection on the way scans
    # all loaded so far (gc_freeze.py)
    gc.disable()
    shared, own, by_word = groups(modules)
    failed = preload(shared)
    branches = tuple(Branch(w, m, (req_fd, rep_fd)) for w, m in by_word.items())
    failed += preload(own)
    return answer(req_fd, rep_fd, [*shared, *own], failed, started, branches=branches)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit() or not argv[1].isdigit():
        print("usage: python -m hexctl.launch.zygote REQ_FD REP_FD RUN_DIR [MODULE|-PACKAGE...]",
              file=sys.stderr)  # fmt: skip
        return 2
    return serve(int(argv[0]), int(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
