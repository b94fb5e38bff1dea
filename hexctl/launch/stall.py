"""Never a silent hang: a run whose trainer completes no optimizer step for
`run.stall_after_s` while its processes are alive is reported, saying which side waits
for what, and (`run.stop_on_stall`) stopped with a resume hint.

The clock starts when the services are ready (the launcher has found every inference
server's /health, however long a server on a small share of a core takes to start) and
starts again at each completed step and at each (re)start of a process (a restarted
trainer loads its model and checkpoint again before it can step). The diagnosis reads
what the launcher can see without asking the services: the trainer's newest metric row,
the controller's newest rollout row, the buffer's counters in Valkey (when it answers)
and the last line each service logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, read_rows
from hexctl.launch.supervisor import Supervisor, tail_lines


class Stalled(RuntimeError):
    """The run made no step for `run.stall_after_s`; the message says who waits for what."""


class StallWatch:
    def __init__(
        self,
        sup: Supervisor,
        run_dir: Path,
        limit_s: float,
        stop: bool,
        buffer: Callable[[], Mapping[str, Any] | None] = lambda: None,
        say: Callable[[str], None] = lambda text: None,
    ) -> None:
        """`limit_s`: run.stall_after_s; `stop`: run.stop_on_stall; `buffer`: the buffer's
        counters (None when Valkey does not answer); `say` hears a report that does not
        stop the run."""
        self.sup, self.paths, self.limit_s, self.stop = sup, RunPaths.at(run_dir), limit_s, stop
        self.buffer, self.say = buffer, say
        self._step = -1
        self._events = len(sup.events)
        self._since = time.monotonic()
        self.reported: str | None = None  # the report, once made (stop off: the run goes on)

    def no_step_s(self, step: int) -> float:
        """Seconds since the last step or (re)start of a process, `step` the newest."""
        now = time.monotonic()
        started = any(e in ("start", "restart") for _, _, e in self.sup.events[self._events :])
        if step != self._step or started:
            self._step, self._since, self._events = step, now, len(self.sup.events)
            self.reported = None
        return now - self._since

    def check(self, step: int) -> float:
        """Seconds without a step; raises Stalled past the limit (with `stop`), else
        reports once (`reported`) and lets the run go on."""
        idle = self.no_step_s(step)
        if idle < self.limit_s or self.reported is not None:
            return idle
        alive = [n for n in self.sup.procs if self.sup.running(n)]
        if len(alive) < len(self.sup.procs):
            return idle  # a process is down: the supervisor's business, not a hang
        self.reported = self.diagnose(step, idle)
        if self.stop:
            raise Stalled(self.reported)
        self.say(f"stalled (run.stop_on_stall=false: the run goes on): {self.reported}")
        return idle

    def diagnose(self, step: int, idle: float) -> str:
        trainer = (read_rows(self.paths.metrics, TrainerRow) or [None])[-1]
        rollout = (read_rows(self.paths.rollout, RolloutRow) or [None])[-1]
        parts = [
            f"no optimizer step for {idle:.0f} s (run.stall_after_s={self.limit_s:g}) while "
            f"every process is alive; last step {step}"
            + (f" at version {trainer.version}" if trainer else "")
        ]
        stats = self.buffer()
        if stats is not None:
            ready = int(stats.get("unconsumed", 0))
            parts.append(
                f"buffer: {ready} groups ready, {stats.get('pending', 0)} being trained, "
                f"version key {stats.get('version')}, {stats.get('groups_dropped_stale', 0)} "
                "dropped as stale"
            )
            parts.append(
                "the trainer waits for groups the controller does not produce"
                if ready == 0
                else "the trainer has groups to train and does not step"
            )
        if rollout is not None:
            parts.append(
                f"controller at version {rollout.version}: {rollout.samples_per_s:.1f} "
                f"samples/s, {rollout.groups_in_flight} groups in flight, "
                f"{rollout.servers_healthy} servers healthy"
            )
        for name in self.sup.procs:
            last = tail_lines(self.sup.procs[name].spec.log_path, 1).strip()
            if name.startswith(("trainer", "controller", "inference")) and last:
                parts.append(f"{name} last logged: {last[-200:]}")
        return "; ".join(parts)
