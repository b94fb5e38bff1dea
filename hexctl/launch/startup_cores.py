"""Every core for the start, the planned cores from the first step.

With `run.pin_cores` each process has its side's cores (the servers one half, the
trainer the other, Valkey and the controller beside one of them). The start is another
shape of work: imports, DeepSpeed and the model on each side, of unequal length, so a
pinned side that is done idles while the other still starts. Until the run's first
optimizer step every process may therefore run on every core the launcher has; then
each is moved to its planned cores, every thread of every process in its group (the
controller's reward workers, Valkey's server), and a process restarted later starts
pinned as before. The steady state runs exactly as planned.

Before that, while the fork server imports the services' modules (the start's critical
path: seconds of one core), one core is kept for it: the plain processes started then
(Valkey, the controller and its reward workers, each importing on its own) run on the
other cores until the first forked service is started (`release`: the imports are done),
so that on a 2-core machine they take nothing from those imports.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

from areal_hex.config import ExperimentConfig
from areal_hex.lifetime import group_members
from hexctl.job.cores import core_groups, usable_cores
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


def reserved_core(usable: set[int] | None, host: set[int] | None = None) -> int | None:
    """The core kept for the fork server's imports during the start: the last usable one
    outside `host` (where Valkey and the controller are planned), else the last usable
    one; None with fewer than two usable cores (nothing to keep it from)."""
    if not usable or len(usable) < 2:
        return None
    return max((usable - (host or set())) or usable)


def run_cores(cfg: ExperimentConfig, specs: Sequence[ProcessSpec], host: str) -> StartupCores:
    """The `StartupCores` of a local run whose Valkey and controller are on the `host`
    side ("trainer" or "inference")."""
    usable = usable_cores()
    inference, trainer = core_groups(cfg.run.pin_cores, cfg.workflow.placement_in_effect())
    reserve = reserved_core(usable, inference if host == "inference" else trainer)
    return StartupCores(specs, reserve, usable)


class StartupCores:
    """The planned affinity of `specs`, held back until the first step (`check`); with
    `reserve` (a core of `usable`), the plain processes kept off it until `release`."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        reserve: int | None = None,
        usable: set[int] | None = None,
    ) -> None:
        self.planned = {s.name: s for s in specs if s.cpus}
        self.done = not self.planned or not hasattr(os, "sched_setaffinity")
        self._first_seen: int | None = None
        can = hasattr(os, "sched_setaffinity") and usable is not None and reserve in usable
        self.others = (usable or set()) - {reserve} if can else set()
        self.usable = set(usable or ())
        self.held: set[str] = set()  # the plain processes kept off the reserved core

    def unpinned(self, specs: Sequence[ProcessSpec], forking: bool = False) -> list[ProcessSpec]:
        """`specs` as they start: without their affinity while the start lasts; with
        `forking` (a fork server imports for the `fork` ones), the others off the
        reserved core until `release`."""
        out = list(specs)
        if not self.done:
            out = [dataclasses.replace(s, cpus=None) if s.name in self.planned else s for s in out]
        if not forking or not self.others:
            return out
        self.held = {s.name for s in out if not s.fork}
        return [dataclasses.replace(s, cpus=set(self.others)) if not s.fork else s for s in out]

    def release(self, sup: Supervisor) -> int:
        """The processes held off the reserved core on every usable core again (their
        planned cores follow at the first step), restarts too, and an event says when;
        returns how many threads were moved (a later call moves none)."""
        moved = 0
        if self.held:  # the start-up timeline (summary.json `startup`)
            sup.events.append((time.time(), "launcher", "the fork server's core shared again"))
        for name in sorted(self.held):
            m = sup.procs.get(name)
            if m is None:
                continue
            m.spec = dataclasses.replace(m.spec, cpus=None)
            pid = sup.pid(name)
            if pid is not None and sup.running(name):
                moved += pin_group(pid, self.usable)
        self.held = set()
        return moved

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
