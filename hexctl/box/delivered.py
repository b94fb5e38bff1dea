"""What the machine delivered to each box node over a run's window (`cpu_delivered`).

A node's quota caps what it may use; the machine, shared with other work, may give it
less. While a run goes, `DeliverySampler` reads each node's counters every `SAMPLE_S`
(files only, nothing started in the nodes): from its cgroup the CPU it used
(`cpuacct.usage`, or v2's `usage_usec`) and its quota's periods, throttled periods and
throttled time (`cpu.stat`); from each of its threads (`tasks`, v2 `cgroup.threads`) the
time it waited runnable for a CPU (`/proc/TID/schedstat`, field 2, `run_delay`).

What the counters show on this kernel (a busy loop in a 0.2-core quota, 10 ms period,
3 s, docs/fidelity.md): a throttled thread counts as waiting, so `run_delay` holds the
quota's wait too (0.80 of the window alone, against 0.68 throttled); what is left,
`run_delay` less the throttled time, is not all the machine's loss either: alone the
loop waited 0.12-0.28 of the window beyond its throttled time (after each unthrottle,
for a CPU) and still used its whole quota (0.19-0.20 cores), while beside busy work the
machine favoured over it waited 0.89-0.94 beyond it and used 0.03-0.06. And a wait is
counted only when the thread gets a CPU back, so a starved thread's wait comes late, in
lumps. So the figure that says whether a node got its CPU is `withheld_share`
(`withheld_s`): per sampling interval, with each wait placed in the time it spans, the
wait beyond throttling up to the quota the node left unused while it had work, summed
over the window, over the quota's CPU in it. The raw figures are kept beside it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

SAMPLE_S = 0.5  # seconds between readings
# a node whose machine withheld more than this share of its quota over the window is
# named on stderr: a busy loop alone in its quota reads 0.000-0.011, one beside favoured
# work 0.71-0.83; r37's trainer node took 1.25-1.96 times its replica's compute a step
# in the box rounds (20-49 % of its quota, were it the machine's doing)
HELD_BACK = 0.10


@dataclass(frozen=True)
class NodeCgroup:
    """Where a node's counters are: its `cpu` cgroup, and the group counting its use."""

    name: str
    cpu: Path  # cpu.stat; the node's threads
    acct: Path | None  # cpuacct.usage; None: the cpu cgroup's cpu.stat usage_usec (v2)
    quota_cores: float

    @staticmethod
    def of(node: Any) -> NodeCgroup:
        """From a box node (`emulate.NodeState`)."""
        cpu = Path(node.cgroup)
        acct = Path(node.acct) if node.acct else cpu
        counted = acct if (acct / "cpuacct.usage").is_file() else None
        return NodeCgroup(node.name, cpu, counted, node.cpu)


@dataclass(frozen=True)
class Reading:
    """A node's cumulative counters at `time` (wall clock, as the metrics rows')."""

    time: float
    used_s: float  # CPU its cgroup used
    periods: int  # quota periods in which it ran
    throttled: int  # ... in which it ran out of quota
    throttled_s: float  # time its run queues spent throttled, summed over CPUs
    run_delay_s: float  # time its threads waited runnable, summed over threads
    threads: int  # threads read
    waiting: int = 0  # threads whose wait grew since the reading before


class ThreadWaits:
    """The run-queue wait of every thread a node has had: a thread that ends keeps what
    it had at its last reading; a thread id whose count goes back is a new thread."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self.last: dict[str, int] = {}
        self.sum = 0  # of every thread's wait, at its last reading, ended threads' too

    def total(self, tids: list[str]) -> tuple[int, int, int]:
        """(wait ns of every thread seen so far, threads read now, threads whose wait
        grew since their last reading)."""
        read = grew = 0
        for tid in tids:
            try:
                wait = int(read_bytes(f"{self.proc}/{tid}/schedstat").split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it ended between the listing and the read
            before = self.last.get(tid, 0)
            if wait < before:  # a count that went back is a new thread's: the old one's
                before = 0  # wait stays counted
            self.sum += wait - before
            grew += wait > before
            self.last[tid] = wait
            read += 1
        return self.sum, read, grew


def read_bytes(path: str | Path) -> bytes:
    """A small kernel file's bytes: a third of the CPU of `Path.read_text` (5 against 18
    microseconds a thread's schedstat here), which the sampler pays for every thread."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def read_all_bytes(path: Path) -> bytes:
    """A kernel file of any length (a cgroup's thread list)."""
    with open(path, "rb") as f:
        return f.read()


def _stat(path: Path) -> dict[str, int]:
    pairs = (line.split() for line in read_bytes(path).splitlines())
    return {p[0].decode(): int(p[1]) for p in pairs if len(p) == 2}


def read_node(node: NodeCgroup, waits: ThreadWaits) -> Reading:
    """The node's counters now (v1 or v2)."""
    now = time.time()
    stat = _stat(node.cpu / "cpu.stat")
    if node.acct is not None:
        used_s = int(read_bytes(node.acct / "cpuacct.usage")) / 1e9
    else:
        used_s = stat.get("usage_usec", 0) / 1e6
    v2 = "throttled_usec" in stat
    throttled_s = stat["throttled_usec"] / 1e6 if v2 else stat.get("throttled_time", 0) / 1e9
    listing = node.cpu / ("cgroup.threads" if v2 else "tasks")
    wait_ns, threads, grew = waits.total(read_all_bytes(listing).decode().split())
    return Reading(now, used_s, stat.get("nr_periods", 0), stat.get("nr_throttled", 0),
                   throttled_s, wait_ns / 1e9, threads, grew)  # fmt: skip


class DeliverySampler:
    """Reads every node every `every_s` on a thread of its own, from `start` to `stop`
    (also a context manager); `readings` by node. A node whose files went away (the
    box taken down) stops being read."""

    def __init__(self, nodes: list[NodeCgroup], every_s: float = SAMPLE_S) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.every_s = every_s
        self.readings: dict[str, list[Reading]] = {n: [] for n in self.nodes}
        self._waits = {n: ThreadWaits() for n in self.nodes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-delivered", daemon=True)

    def read_all(self) -> None:
        for name, node in list(self.nodes.items()):
            try:
                self.readings[name].append(read_node(node, self._waits[name]))
            except (OSError, KeyError, ValueError):
                del self.nodes[name]

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.read_all()

    def start(self) -> DeliverySampler:
        self.read_all()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.read_all()

    def __enter__(self) -> DeliverySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- the window
def at(readings: list[Reading], t: float) -> Reading | None:
    """The counters at `t`, linear between the readings either side; None outside them."""
    for a, b in zip(readings, readings[1:], strict=False):
        if a.time <= t <= b.time:
            f = 0.0 if b.time == a.time else (t - a.time) / (b.time - a.time)
            v = [x + (y - x) * f for x, y in zip(astuple(a), astuple(b), strict=True)]
            return Reading(t, v[1], round(v[2]), round(v[3]), v[4], v[5], max(a.threads, b.threads))
    return None


def cut(readings: list[Reading], t0: float, t1: float) -> list[Reading]:
    """The readings of [t0, t1], the ends interpolated; empty where they do not span it."""
    first, last = at(readings, t0), at(readings, t1)
    if first is None or last is None or t1 <= t0:
        return []
    return [first, *(r for r in readings if t0 < r.time < t1), last]


def spread_back(amounts: list[float], room: list[float]) -> list[float]:
    """Each interval's counted wait placed in the time it spans: a thread's wait is
    counted when it gets a CPU back, so what an interval shows fills that interval and
    then the ones before it, each up to its `room` (its length times the threads that
    waited in it, at least one)."""
    left_room = list(room)
    placed = [0.0] * len(amounts)
    for i, amount in enumerate(amounts):
        j = i
        while amount > 1e-12 and j >= 0:
            part = min(amount, left_room[j])
            placed[j] += part
            left_room[j] -= part
            amount -= part
            j -= 1
        placed[i] += amount  # more than the readings before it hold: kept where counted
    return placed


def withheld_s(readings: list[Reading], quota: float, t0: float, t1: float) -> tuple[float, float]:
    """(the quota's CPU-seconds the machine withheld, the threads' wait beyond throttling)
    in [t0, t1]. Per interval between readings, the waits placed in the time they span
    (`spread_back`, over every reading, so that a wait counted after the window still
    falls in it): the wait beyond the interval's throttled time, up to the quota left
    unused in it less the quota of the time the node had nothing to run (the interval
    less its CPU used and its waits); an interval at an end of the window by its share."""
    gaps = [(a, b, b.time - a.time) for a, b in zip(readings, readings[1:], strict=False)]
    delays = [b.run_delay_s - a.run_delay_s for a, b, _ in gaps]
    placed = spread_back(delays, [dt * max(1, b.waiting) for _, b, dt in gaps])
    withheld = machine = 0.0
    for (a, b, dt), wait in zip(gaps, placed, strict=True):
        share = max(0.0, min(b.time, t1) - max(a.time, t0)) / dt if dt > 0 else 0.0
        if share == 0.0:
            continue
        throttled, used = b.throttled_s - a.throttled_s, b.used_s - a.used_s
        beyond = max(0.0, wait - throttled)
        idle = max(0.0, dt - used - wait)
        machine += share * beyond
        withheld += share * min(beyond, max(0.0, quota * (dt - idle) - used))
    return withheld, machine


def node_figures(readings: list[Reading], quota: float, t0: float, t1: float) -> dict[str, Any]:
    """What the machine delivered to a node over [t0, t1]: CPU used beside its quota's,
    the share of its periods it ran out of quota in, its threads' wait for a CPU (thread
    seconds per second: all of it, the throttled part, and the rest, the machine's), and
    the quota's CPU the machine withheld while the node waited (`withheld_share`)."""
    span = cut(readings, t0, t1)
    if not span:
        return {"unavailable": "the readings do not span the window"}
    first, last = span[0], span[-1]
    wall = t1 - t0
    withheld, machine = withheld_s(readings, quota, t0, t1)
    periods = last.periods - first.periods
    return {
        "used_cores": round((last.used_s - first.used_s) / wall, 4),
        "quota_cores": quota,
        "throttled_share": round((last.throttled - first.throttled) / periods, 4)
        if periods > 0
        else None,
        "run_delay_share": round((last.run_delay_s - first.run_delay_s) / wall, 4),
        "throttled_wait_share": round((last.throttled_s - first.throttled_s) / wall, 4),
        "machine_wait_share": round(machine / wall, 4),
        "withheld_cores": round(withheld / wall, 4),
        "withheld_share": round(withheld / (quota * wall), 4),
        "threads": max(r.threads for r in span),
    }


def delivered_block(
    readings: dict[str, list[Reading]], quotas: dict[str, float], t0: float, t1: float
) -> dict[str, Any]:
    """Every node that had threads in [t0, t1], its figures (`node_figures`), and the
    nodes whose machine withheld more than `HELD_BACK` of their quota (`held_back`)."""
    nodes: dict[str, Any] = {}
    for name, got in readings.items():
        if any(r.threads for r in got if t0 <= r.time <= t1):
            nodes[name] = node_figures(got, quotas[name], t0, t1)
    held = [n for n, f in nodes.items() if (f.get("withheld_share") or 0.0) > HELD_BACK]
    return {
        "window": {"from": round(t0, 3), "to": round(t1, 3), "seconds": round(t1 - t0, 3)},
        "sample_s": SAMPLE_S,
        "held_back_above": HELD_BACK,
        "nodes": nodes,
        "held_back": held,
    }


def held_back_lines(run: str, block: dict[str, Any]) -> list[str]:
    """One line per node the machine held back in `run`'s window."""
    out = []
    for name in block.get("held_back", []):
        f = block["nodes"][name]
        out.append(
            f"{run}: node {name} waited for the machine: it used {f['used_cores']:.3f} of "
            f"its {f['quota_cores']:g} cores over the {block['window']['seconds']:.1f}-s "
            f"window, and {f['withheld_share']:.0%} of its quota was withheld while its "
            f"threads waited (not the quota: throttled in {f['throttled_share'] or 0:.0%} "
            f"of its periods)"
        )
    return out
