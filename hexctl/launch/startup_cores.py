"""Every core for the start, the planned cores from the first step.

With `run.pin_cores` each process has its side's cores (the servers one half, the
trainer the other, Valkey and the controller beside one of them). The start is another
shape of work: imports, DeepSpeed and the model on each side, of unequal length, so a
pinned side that is done idles while the other still starts. Until the run's first
optimizer step every process may therefore run on every core the launcher has; then
each is moved to its planned cores, every thread of every process in its group (the
controller's reward workers, Valkey's server), and a process restarted later starts
pinned as before. The steady state runs exactly as planned.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from areal_hex.lifetime import group_members
from hexctl.launch.supervisor import ProcessSpec, Supervisor


def pin_group(pgid: int, cpus: set[int]) -> int:
    """Set the affinity of every thread of every process of group `pgid` to `cpus`;
    returns how many threads were moved (one that ended meanwhile is skipped)."""
    moved = 0
    for pid, _ in group_members(pgid):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread ended, or is not ours to move
                continue
            moved += 1
    return moved


class StartupCores:
    """The planned affinity of `specs`, held back until the first step (`check`)."""

    def __init__(self, specs: Sequence[ProcessSpec]) -> None:
        self.planned = {s.name: s for s in specs if s.cpus}
        self.done = not self.planned or not hasattr(os, "sched_setaffinity")
        self._first_seen: int | None = None

    def unpinned(self, specs: Sequence[ProcessSpec]) -> list[ProcessSpec]:
        """`specs` as they start: without their affinity while the start lasts."""
        if self.done:
            return list(specs)
        return [dataclasses.replace(s, cpus=None) if s.name in self.planned else s for s in specs]

    def check(self, sup: Supervisor, step: int) -> bool:
        """Pin every process once `step` (the trainer's latest) moves past the first value
        seen (a resumed run starts at its checkpoint's step); True when it did."""
        if self.done:
            return False
        if self._first_seen is None:
            self._first_seen = step
        if step == self._first_seen:
            return False
        self.pin(sup)
        return True

    def pin(self, sup: Supervisor) -> None:
        """Each process to its planned cores, now and at any restart."""
        for name, spec in self.planned.items():
            m = sup.procs.get(name)
            if m is None:
                continue
            m.spec = spec
            pid = sup.pid(name)
            if pid is not None and sup.running(name):
                assert spec.cpus is not None
                pin_group(pid, spec.cpus)
        self.done = True
