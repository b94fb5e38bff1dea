"""Start, watch, restart and stop the processes of a local run.

Each child runs in its own session (process group) so that a launcher's children
(deepspeed ranks) stop with it. Output goes to one log file per process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cores: list[int] | None = None  # CPU affinity (None: any core)
    max_restarts: int = 0  # >0: restart on a crash this many times
    # The run is over when a process marked `final` exits 0 (the trainer).
    final: bool = False


class ProcessFailed(RuntimeError):
    """A process died and could not be recovered; the message holds its last log lines."""


def tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open(errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return "(no log)"


class Managed:
    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        s = self.spec
        s.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **s.env}
        cores = s.cores

        def pin() -> None:  # runs in the child before exec
            if cores:
                os.sched_setaffinity(0, cores)

        with s.log.open("ab") as log:
            log.write(f"\n=== start {s.name}: {' '.join(s.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                s.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=pin if cores else None,
            )

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False


class Supervisor:
    """Owns the processes of a run. Use as a context manager: exiting stops everything."""

    def __init__(self, stop_timeout_s: float = 20.0) -> None:
        self.procs: dict[str, Managed] = {}
        self.stop_timeout_s = stop_timeout_s
        self.events: list[str] = []

    def start(self, spec: ProcessSpec) -> Managed:
        if spec.name in self.procs:
            raise ValueError(f"process {spec.name!r} already started")
        m = self.procs[spec.name] = Managed(spec)
        m.start()
        return m

    def check(self) -> bool:
        """Restart crashed restartable processes; True when a `final` process finished.
        Raises ProcessFailed for a crash that cannot be recovered."""
        done = False
        for m in self.procs.values():
            rc = m.poll()
            if rc is None:
                continue
            if rc == 0 and m.spec.final:
                done = True
                continue
            if rc == 0:
                continue
            if m.restarts < m.spec.max_restarts:
                m.restarts += 1
                self.events.append(f"{time.time():.3f} restart {m.spec.name} (exit {rc})")
                m.start()
                continue
            raise ProcessFailed(
                f"{m.spec.name} exited with code {rc} (restarts used: {m.restarts}); "
                f"last lines of {m.spec.log}:\n{tail(m.spec.log)}"
            )
        return done

    def stop(self, names: list[str] | None = None) -> None:
        """SIGTERM, wait, then SIGKILL; in reverse start order."""
        targets = [self.procs[n] for n in (names or list(self.procs))][::-1]
        for m in targets:
            m.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for m in targets:
            if not m.wait(max(0.0, deadline - time.monotonic())):
                m.signal(signal.SIGKILL)
                m.wait(5.0)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
