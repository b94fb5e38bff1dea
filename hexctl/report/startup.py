"""The start-up timeline of a run: which process started and was ready when, from the
launcher's command to the first optimizer step (summary.json `startup`).

Its times are seconds since the services started (`events.json` `t_start`, after the
run directory and the v0 weights); the launcher's own milestones before that (the
command, the prepared run directory with v0) come out negative. Readiness: Valkey
answering PING and each server its /health (the launcher's events), and the `[status]`
lines the trainer and the controller log, at the times on those lines. `first_step_s`
is the wait a user sees: services started to the first optimizer step, the warm start
excluded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from areal_hex.run_files import STATUS_MARK, TrainerRow

# "2026-11-28 21:37:46,393 <logger> ... [status] what": logging's asctime (local time)
_STAMP_LEN = len("2026-11-28 21:37:46,393")


def status_lines(log: Path, since: float) -> list[tuple[float, str]]:
    """(time, what) of the `[status]` lines of `log` written at or after `since`."""
    out = []
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        at = line.find(STATUS_MARK)
        if at < 0 or len(line) < _STAMP_LEN:
            continue
        stamp, _, millis = line[:_STAMP_LEN].partition(",")
        try:
            t = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        except ValueError:
            continue  # a line without the time (an older log format)
        if t >= since:
            out.append((t, line[at + len(STATUS_MARK) :].strip()))
    return out


def startup_timeline(
    events: dict[str, Any], metrics: list[TrainerRow], logs: dict[str, Path] | None = None
) -> dict[str, Any] | None:
    """The timeline of the attempt in `events` (events.json: the latest), or None without
    one; `logs`: the processes whose `[status]` lines join it. Its first step is the first
    of `metrics` after the attempt started (a resumed run's)."""
    t0 = events.get("t_start")
    if t0 is None:
        return None
    seen = []
    for e in events.get("events", []):
        what = str(e["event"])
        if what in ("start", "ready") or e["process"] == "launcher":
            seen.append((e["time"], e["process"], what))
    for name, log in (logs or {}).items():
        seen += [(t, name, f"status: {what}") for t, what in status_lines(log, t0 - 1.0)]
    rows = [{"at_s": round(t - t0, 2), "process": p, "event": what} for t, p, what in sorted(seen)]
    out: dict[str, Any] = {"events": rows}
    command = [r["at_s"] for r in rows if r["process"] == "launcher" and r["event"] == "command"]
    if command:
        out["command_to_services_s"] = -command[0]  # prepare: run directory, v0 weights
    first = next((r for r in metrics if r.time >= t0), None)
    if first is not None:
        out["first_step_s"] = round(first.time - t0, 2)
        # how long the trainer, ready, waited for its first batch (0: it was the later one)
        out["first_batch_wait_s"] = round(first.wait_s, 2)
    return out


def format_timeline(startup: dict[str, Any]) -> str:
    """One line: `start-up (s after the services start): redis ready 0.3, ...`."""
    parts = []
    for r in startup.get("events", []):
        if r["event"] == "start":
            continue  # the services start together; readiness is what differs
        what = r["event"].removeprefix("status: ")
        parts.append(f"{r['process']} {what} {r['at_s']:.1f}")
    if "first_step_s" in startup:
        wait = startup.get("first_batch_wait_s", 0.0)
        parts.append(f"first step {startup['first_step_s']:.1f} (batch wait {wait:.1f})")
    return "start-up (s after the services start): " + ", ".join(parts)
