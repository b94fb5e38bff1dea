"""The host's CPU as `profile --local` measures it: the CPU seconds of the profile's
process tree (the controller, its rewards and, where the run starts one beside them,
Valkey) but the server's, less the CPU the readings of /proc themselves take."""

from __future__ import annotations

import os
import time
from pathlib import Path


def uncounted(exclude: set[int], valkey: int | None, valkey_elsewhere: bool) -> set[int]:
    """The processes whose CPU is not the host's work: the server's (`exclude`), and the
    profile's Valkey where the run's Valkey runs elsewhere (`redis.url` set); a run that
    starts its own runs it beside the controller, on the same cores."""
    return exclude | ({valkey} if valkey_elsewhere and valkey is not None else set())


class TreeCpu:
    """`_tree_cpu_s` less the CPU its own readings took: the walk of /proc is the
    profile's, not the host's work it measures (2 ms a reading at 90 processes here, ten
    readings a second: a tenth of the host's CPU a sample on a quiet machine, more the
    more processes a shared one runs)."""

    def __init__(self) -> None:
        self.reading_s = 0.0  # CPU the readings took so far

    def __call__(self, exclude: set[int]) -> float:
        t0 = time.thread_time()
        total = _tree_cpu_s(exclude)
        self.reading_s += time.thread_time() - t0
        return total - self.reading_s


def _tree_cpu_s(exclude: set[int]) -> float:
    """CPU seconds (user + system) of this process and its live descendants but
    `exclude` and theirs; this process's own time where /proc is missing."""
    proc = Path("/proc")
    if not proc.is_dir():
        return time.process_time()
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        ticks[int(d.name)] = int(fields[11]) + int(fields[12])
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")
