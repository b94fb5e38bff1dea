"""The start-up timeline of a run: which process started and was ready when, from the
launcher's command to the first optimizer step (summary.json `startup`).

Its times are seconds since the services started (`events.json` `t_start`, after the
run directory and the v0 weights); the launcher's own milestones before that (the
command, the prepared run directory with v0) come out negative. `first_step_s` is the
wait a user sees: services started to the first optimizer step, the warm start excluded.
Status lines are as the launcher saw them (its poll: within `Supervisor.poll_s`)."""

from __future__ import annotations

from typing import Any

from areal_hex.run_files import TrainerRow

# events of the timeline: a process's start and readiness, its [status] lines, and the
# launcher's own milestones (process "launcher")
_KINDS = ("start", "ready")


def startup_timeline(events: dict[str, Any], metrics: list[TrainerRow]) -> dict[str, Any] | None:
    """The timeline of the attempt in `events` (events.json: the latest), or None without
    one; its first step is the first of `metrics` after it started (a resumed run's)."""
    t0 = events.get("t_start")
    if t0 is None:
        return None
    first = next((r for r in metrics if r.time >= t0), None)
    rows = []
    for e in events.get("events", []):
        what = str(e["event"])
        if what in _KINDS or what.startswith("status: ") or e["process"] == "launcher":
            rows.append({"at_s": round(e["time"] - t0, 2), "process": e["process"], "event": what})
    out: dict[str, Any] = {"events": rows}
    command = [r["at_s"] for r in rows if r["process"] == "launcher" and r["event"] == "command"]
    if command:
        out["command_to_services_s"] = -command[0]  # prepare: run directory, v0 weights
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
