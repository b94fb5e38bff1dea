"""Live progress of a run from its `metrics.jsonl` (trainer) and `rollout.jsonl`
(controller): one line refreshed in place on a terminal, plain log lines otherwise. Until
the first step is done, the line says what each process is doing (from the `[status]`
lines of its log, and DeepSpeed's own messages while it builds its op)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from areal_hex.run_files import STATUS_MARK, RolloutRow, RowTail, RunPaths, TrainerRow

# Log lines of other tools that say what a process is busy with, and how to say it.
KNOWN_PHASES = (
    ("Building extension module", "building DeepSpeed's op (first run only)"),
    ("Loading extension module", "loading DeepSpeed's op"),
)


def service_status(log: Path, max_bytes: int = 16_000) -> str | None:
    """What the last status line of a service's log says it is doing, if anything."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("=== "):  # the supervisor's (re)start line: nothing said since
            return None
        at = line.find(STATUS_MARK)
        if at >= 0:
            return line[at + len(STATUS_MARK) :].strip()
        for needle, what in KNOWN_PHASES:
            if needle in line:
                return what
    return None


def _fmt_duration(s: float | None) -> str:
    if s is None or s != s or s < 0:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_line(
    state: dict[str, Any],
    total_steps: int,
    elapsed_s: float,
    stalled: dict[str, float] | None = None,
) -> str:
    """One status line, e.g. `step 12/40 | reward 0.42 | version lag 1 (max 2) | ...`;
    before the first step, e.g. `step 0/40 | trainer: loading the model | ...`; servers
    that stopped answering first: `STALLED inference-0 (no answer 12 s) | step ...`; a run
    without a step for long (`state["no_step_s"]` set) first of all: `NO STEP for 2m40s`."""
    step = int(state.get("step", 0))
    parts = [f"STALLED {n} (no answer {s:.0f} s)" for n, s in sorted((stalled or {}).items())]
    if state.get("no_step_s") is not None:
        parts.insert(0, f"NO STEP for {_fmt_duration(state['no_step_s'])}")
    parts.append(f"step {step}/{total_steps}")
    if step == 0 and state.get("doing"):
        doing = [f"{name}: {what}" for name, what in state["doing"].items()]
        return " | ".join([*parts, *doing, f"elapsed {_fmt_duration(elapsed_s)}"])
    r = state.get("reward_mean")
    parts.append(f"reward {r:.3f}" if isinstance(r, (int, float)) else "reward -")
    if "lag" in state:
        parts.append(f"version lag {state['lag']} (max {state.get('max_lag', 0)})")
    sps = state.get("samples_per_s")
    parts.append(f"{sps:.1f} samples/s" if isinstance(sps, (int, float)) else "- samples/s")
    if "groups_produced_total" in state:
        parts.append(f"groups {state['groups_produced_total']}")
    eta = None
    if step > 0 and step < total_steps:
        t_first = state.get("t_first_step_elapsed", 0.0)
        per_step = (elapsed_s - t_first) / max(step - 1, 1) if step > 1 else elapsed_s
        eta = per_step * (total_steps - step)
    elif step >= total_steps:
        eta = 0.0
    parts.append(f"elapsed {_fmt_duration(elapsed_s)}")
    parts.append(f"ETA {_fmt_duration(eta)}")
    return " | ".join(parts)


class Progress:
    """Call `tick()` periodically; it redraws when something changed."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        stream: TextIO,
        enabled: bool = True,
        min_interval_s: float = 0.5,
        log_interval_s: float = 15.0,
        mode: str = "auto",
        services: Sequence[str] = (),
    ) -> None:
        """`services`: processes whose status lines are shown until the first step."""
        paths = RunPaths.at(run_dir)
        self.logs = {name: paths.log(name) for name in services}
        self.metrics = RowTail(paths.metrics, TrainerRow)
        self.rollout = RowTail(paths.rollout, RolloutRow)
        self.total_steps = total_steps
        self.stream = stream
        self.enabled = enabled
        # auto: redraw in place on a terminal; "live" always, "log" never
        isatty = bool(getattr(stream, "isatty", lambda: False)())
        self.tty = {"live": True, "log": False}.get(mode, isatty)
        self.t0 = time.monotonic()
        self.state: dict[str, Any] = {}
        self.min_interval_s = min_interval_s
        self.log_interval_s = log_interval_s
        self._last_draw = 0.0
        self._last_step_logged = -1
        self._width = 0
        self.stalled: dict[str, float] = {}  # server -> seconds without an answer
        self._stalled_logged: Any = set()

    def update(self) -> bool:
        """Fold new lines into the state; True if there was any."""
        changed = False
        for row in self.metrics.read():
            changed = True
            if self.state.get("step", 0) == 0:
                self.state["t_first_step_elapsed"] = time.monotonic() - self.t0
            self.state["step"] = row.step
            self.state["reward_mean"] = row.reward_mean
            self.state["lag"] = row.max_version_lag
            self.state["max_lag"] = max(self.state.get("max_lag", 0), row.max_version_lag)
        for r in self.rollout.read():
            changed = True
            self.state["samples_per_s"] = r.samples_per_s
            self.state["groups_produced_total"] = r.groups_produced_total
        if self.state.get("step", 0) == 0 and self.logs:
            doing = {n: w for n, log in self.logs.items() if (w := service_status(log))}
            changed |= doing != self.state.get("doing")
            self.state["doing"] = doing
        return changed

    def tick(self) -> None:
        changed = self.update()
        if not self.enabled:
            return
        now = time.monotonic()
        line = format_line(self.state, self.total_steps, now - self.t0, self.stalled)
        if self.tty:
            if now - self._last_draw < self.min_interval_s:
                return
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
            self._width = len(line)
            self._last_draw = now
            return
        step = int(self.state.get("step", 0))
        new_step = changed and step != self._last_step_logged
        stalls = set(self.stalled) | ({"run"} if self.state.get("no_step_s") else set())
        new_stall = bool(stalls) and stalls != self._stalled_logged
        self._stalled_logged = stalls
        if new_step or new_stall or now - self._last_draw >= self.log_interval_s:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_draw = now
            self._last_step_logged = step

    def close(self) -> None:
        self.update()
        if self.enabled and self.tty:
            line = format_line(
                self.state, self.total_steps, time.monotonic() - self.t0, self.stalled
            )
            self.stream.write("\r" + line + " " * max(0, self._width - len(line)) + "\n")
            self.stream.flush()
