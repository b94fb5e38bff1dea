"""The record of each start of a run directory (an attempt): `attempts/<n>/events.json`
is written as the attempt goes, so that a killed launcher's attempt counts too, and
`events.json` lists every attempt."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from areal_hex.run_files import RunPaths
from hexctl.launch.disk import is_disk_full
from hexctl.launch.supervisor import Supervisor


def begin_attempt(run_dir: Path) -> int:
    """Number this start of the run directory (`attempts/<n>/`) before anything runs, so
    that an attempt whose launcher is killed still counts."""
    paths = RunPaths.at(run_dir)
    done = paths.attempts()
    n = (done[-1] + 1) if done else 1
    paths.attempt(n).mkdir(parents=True, exist_ok=True)
    return n


def write_events(
    run_dir: Path, sup: Supervisor, t_start: float, t_ready: float, n: int, ended: bool = True
) -> None:
    """Attempt n's events into `attempts/<n>/events.json`, and every attempt's into
    `events.json` (its top level: this attempt's). Written as the attempt goes (`ended`
    false: `t_end` is the time of the write), so a killed launcher leaves its attempt's
    events up to its last write."""
    paths = RunPaths.at(run_dir)
    data = {
        "t_start": t_start,
        "t_services_ready": t_ready,
        "t_end": time.time(),
        "ended": ended,
        "events": [{"time": t, "process": name, "event": e} for t, name, e in sup.events],
        "restarts": {name: m.restarts for name, m in sup.procs.items()},
    }
    _write_json(paths.attempt(n) / "events.json", data)
    every = []
    for k in paths.attempts():
        f = paths.attempt(k) / "events.json"
        with contextlib.suppress(OSError, json.JSONDecodeError):
            every.append(json.loads(f.read_text()))
    _write_json(paths.events, {**data, "attempt": n, "attempts": every})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # a launcher killed mid-write leaves the previous version


class AttemptLog:
    """Keeps the attempt's events file current while the run is watched (on each new
    event, and every `every_s`)."""

    def __init__(self, run_dir: Path, sup: Supervisor, t_start: float, n: int) -> None:
        self.run_dir, self.sup, self.t_start, self.n = run_dir, sup, t_start, n
        self.t_ready = t_start
        self._seen = -1
        self._last = 0.0

    def tick(self, every_s: float = 5.0) -> None:
        now = time.monotonic()
        if len(self.sup.events) == self._seen and now - self._last < every_s:
            return
        self._seen, self._last = len(self.sup.events), now
        write_events(self.run_dir, self.sup, self.t_start, self.t_ready, self.n, ended=False)

    def end(self) -> None:
        write_events(self.run_dir, self.sup, self.t_start, self.t_ready, self.n)


def end_attempt(attempt: AttemptLog) -> str:
    """Writes the attempt's end; on a full disk, what was not written (else "")."""
    try:
        attempt.end()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        return f"\nevents.json not updated ({exc.strerror})"
    return ""
