"""Live progress of a run from its `metrics.jsonl` (trainer) and `rollout.jsonl`
(controller): one line refreshed in place on a terminal, plain log lines otherwise."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


class JsonlTail:
    """Reads the complete lines appended to a JSONL file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()  # an incomplete last line waits for the next read
        rows = []
        for line in lines:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return JsonlTail(path).read() if path.exists() else []


def _fmt_duration(s: float | None) -> str:
    if s is None or s != s or s < 0:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_line(state: dict[str, Any], total_steps: int, elapsed_s: float) -> str:
    """One status line, e.g. `step 12/40 | reward 0.42 | staleness 1 (max 2) | ...`."""
    step = int(state.get("step", 0))
    parts = [f"step {step}/{total_steps}"]
    r = state.get("reward_mean")
    parts.append(f"reward {r:.3f}" if isinstance(r, (int, float)) else "reward -")
    if "staleness" in state:
        parts.append(f"staleness {state['staleness']} (max {state.get('max_staleness', 0)})")
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
    ) -> None:
        self.metrics = JsonlTail(run_dir / "metrics.jsonl")
        self.rollout = JsonlTail(run_dir / "rollout.jsonl")
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

    def update(self) -> bool:
        """Fold new lines into the state; True if there was any."""
        changed = False
        for row in self.metrics.read():
            changed = True
            if "step" in row and self.state.get("step", 0) == 0:
                self.state["t_first_step_elapsed"] = time.monotonic() - self.t0
            self.state["step"] = row.get("step", self.state.get("step", 0))
            self.state["reward_mean"] = row.get("reward_mean")
            self.state["staleness"] = row.get("max_staleness", 0)
            self.state["max_staleness"] = max(
                self.state.get("max_staleness", 0), int(row.get("max_staleness", 0))
            )
        for row in self.rollout.read():
            changed = True
            self.state["samples_per_s"] = row.get("samples_per_s")
            self.state["groups_produced_total"] = row.get("groups_produced_total", 0)
        return changed

    def tick(self) -> None:
        changed = self.update()
        if not self.enabled:
            return
        now = time.monotonic()
        line = format_line(self.state, self.total_steps, now - self.t0)
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
        if new_step or now - self._last_draw >= self.log_interval_s:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_draw = now
            self._last_step_logged = step

    def close(self) -> None:
        self.update()
        if self.enabled and self.tty:
            line = format_line(self.state, self.total_steps, time.monotonic() - self.t0)
            self.stream.write("\r" + line + " " * max(0, self._width - len(line)) + "\n")
            self.stream.flush()
