"""Discrete-event replay of a plan: requests on continuous-batching instances, the
staleness gate, the buffer, trainer steps and weight syncs.

Each instance decodes its active requests in lock-step; a step with n active requests
takes step_fn(n) seconds (the cost model's decode step at batch n), a new request first
stalls the instance for its prefill, and a weight sync stalls it for its sync time. The
controller admits a group only while submitted ≤ (v + η + 1)·B (groups dropped as stale
taken off, as the buffer does) (and, if set, fewer than
`max_inflight_groups` admitted groups are unfinished, the controller's cap), spreads
samples over instances with free slots (least loaded first). A group's version is that of
the weights the instances held when it was admitted. The trainer drops, and counts,
finished groups older than v − η (as `areal_hex/buffer/consumer.py` does), takes the B
oldest of the rest, steps, and every k steps publishes: every instance pauses for its sync
time and serves the new version afterwards. v is the buffer's version, the last one
published (the trainer's step count moves on between publishes, the buffer's does not):
with k > 1 the gate opens k·B groups at a publish and none until the next, which the
closed-form rate of `costmodel.pipeline_rate` does not model.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SimInstance:
    name: str
    slots: int
    prefill_s: float
    sync_s: float
    step_fn: Callable[[int], float]  # active requests -> seconds per decode step
    tok: float = 0.0  # tokens decoded by every active request since start
    t: float = 0.0  # time `tok` refers to
    stall_until: float = 0.0
    active: list[tuple[float, int]] = field(default_factory=list)  # heap (finish tok, req)
    queue: deque[tuple[int, int]] = field(default_factory=deque)  # (group, length) waiting
    busy_s: float = 0.0
    stamp: int = 0

    def advance(self, now: float) -> None:
        n = len(self.active)
        if n:
            self.busy_s += now - self.t
            start = max(self.t, self.stall_until)
            if now > start:
                self.tok += (now - start) / self.step_fn(n)
        self.t = now

    def next_finish(self) -> float | None:
        if not self.active:
            return None
        start = max(self.t, self.stall_until)
        return start + max(0.0, self.active[0][0] - self.tok) * self.step_fn(len(self.active))


@dataclass
class SimResult:
    samples_per_s: float
    generation_samples_per_s: float
    steps: int
    max_version_lag: int
    version_lag_hist: dict[int, int]  # versions behind the buffer's -> groups trained
    trainer_idle_frac: float
    rollout_busy_frac: float
    groups_dropped_stale: int = 0  # finished groups older than v - eta, dropped unused


@dataclass
class _Workload:
    groups_per_step: int
    group_size: int
    max_staleness: int
    publish_every: int
    train_step_s: float
    mean_len: int
    max_len: int
    steps: int
    warmup: int
    max_inflight_groups: int | None = None  # admitted, unfinished groups at most


class Simulation:
    """One replay. State: the event queue, the gate's counters, the samples waiting for a
    slot, finished groups (oldest first) and the trainer. Events: "done" (an instance's
    earliest request finished; stale if the instance was rescheduled since) and "step"
    (the trainer finished an optimizer step)."""

    def __init__(self, instances: list[SimInstance], w: _Workload, seed: int) -> None:
        self.inst, self.w = instances, w
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, str, int, int]] = []  # (t, seq, kind, arg, stamp)
        self.seq = 0
        self.now, self.version, self.submitted, self.trained = 0.0, 0, 0, 0
        self.served = 0  # version of the weights the instances hold (the last publish)
        self.groups_dropped_stale = 0
        self.given_back = 0  # dropped groups, handed back to the gate as the buffer does
        self.group_left: dict[int, int] = {}  # samples still generating, per group
        self.group_ver: dict[int, int] = {}  # version of the weights that generate it
        self.req_group: dict[int, int] = {}
        self.finished: deque[int] = deque()  # groups, oldest first
        self.trainer_busy, self.trainer_idle, self.idle_since = False, 0.0, 0.0
        self.hist: dict[int, int] = {}
        self.t_warm: float | None = None
        self.gen_done = self.gen_warm = self.rid = 0

    # ------------------------------------------------------------ events
    def push(self, t: float, kind: str, arg: int, stamp: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, arg, stamp))

    def reschedule(self, i: int) -> None:
        inst = self.inst[i]
        inst.stamp += 1
        nf = inst.next_finish()
        if nf is not None:
            self.push(nf, "done", i, inst.stamp)

    # ------------------------------------------------------------ controller
    def admit(self) -> bool:
        """The gate admits one more group while submitted < (v + η + 1)·B and the
        controller's cap on unfinished groups, if any, has room. The whole group goes to
        one instance (one batched request, as the controller sends it): the one with the
        most free slots."""
        w = self.w
        if (
            self.submitted - self.given_back
            >= (self.served + w.max_staleness + 1) * w.groups_per_step
        ):
            return False
        if w.max_inflight_groups is not None and len(self.group_left) >= w.max_inflight_groups:
            return False
        g = self.submitted
        self.submitted += 1
        self.group_left[g], self.group_ver[g] = w.group_size, self.served
        inst = max(self.inst, key=lambda x: (x.slots - len(x.active) - len(x.queue)) / x.slots)
        for _ in range(w.group_size):
            length = min(w.max_len, max(1, int(w.mean_len * self.rng.uniform(0.5, 1.5))))
            inst.queue.append((g, length))
        return True

    def dispatch(self) -> None:
        """Start queued samples where slots are free; admit groups while an instance has
        free slots and nothing queued for them."""
        while True:
            for i, inst in enumerate(self.inst):
                started = False
                while inst.queue and len(inst.active) < inst.slots:
                    if not started:
                        inst.advance(self.now)
                        started = True
                    g, length = inst.queue.popleft()
                    inst.stall_until = max(inst.stall_until, self.now) + inst.prefill_s
                    self.rid += 1
                    self.req_group[self.rid] = g
                    heapq.heappush(inst.active, (inst.tok + length, self.rid))
                if started:
                    self.reschedule(i)
            room = any(len(x.active) + len(x.queue) < x.slots for x in self.inst)
            if not room or not self.admit():
                return

    def on_done(self, i: int) -> None:
        inst = self.inst[i]
        inst.advance(self.now)
        while inst.active and inst.active[0][0] <= inst.tok + 1e-9:
            _, r = heapq.heappop(inst.active)
            g = self.req_group.pop(r)
            self.gen_done += 1
            self.group_left[g] -= 1
            if self.group_left[g] == 0:
                del self.group_left[g]
                self.finished.append(g)
        self.reschedule(i)

    # ------------------------------------------------------------ trainer
    def drop_stale(self) -> None:
        """The consumer's rule: a group older than v − η is dropped, counted and handed
        back to the gate."""
        floor = self.served - self.w.max_staleness
        keep: deque[int] = deque()
        for g in self.finished:
            if self.group_ver[g] >= floor:
                keep.append(g)
            else:
                del self.group_ver[g]
                self.groups_dropped_stale += 1
                self.given_back += 1
        self.finished = keep

    def try_train(self) -> None:
        """Start a step on the B oldest fresh finished groups when the trainer is free."""
        b = self.w.groups_per_step
        if self.trainer_busy:
            return
        self.drop_stale()
        if len(self.finished) < b:
            return
        for g in [self.finished.popleft() for _ in range(b)]:
            lag = self.served - self.group_ver.pop(g)
            self.hist[lag] = self.hist.get(lag, 0) + 1
        self.trainer_busy = True
        self.trainer_idle += self.now - self.idle_since
        self.push(self.now + self.w.train_step_s, "step", 0)

    def on_step(self) -> None:
        """A step committed: the version moves on; every k steps the instances sync."""
        self.trainer_busy, self.idle_since = False, self.now
        self.trained += 1
        self.version += 1
        if self.trained == self.w.warmup:
            self.t_warm, self.gen_warm, self.trainer_idle = self.now, self.gen_done, 0.0
        if self.version % self.w.publish_every == 0:
            self.served = self.version
            for i, inst in enumerate(self.inst):
                inst.advance(self.now)
                inst.stall_until = max(inst.stall_until, self.now) + inst.sync_s
                self.reschedule(i)

    # ------------------------------------------------------------ run
    def run(self) -> SimResult:
        self.dispatch()
        while self.events and self.trained < self.w.steps:
            self.now, _, kind, arg, stamp = heapq.heappop(self.events)
            if kind == "done":
                if stamp != self.inst[arg].stamp:
                    continue
                self.on_done(arg)
            else:
                self.on_step()
            self.dispatch()
            self.try_train()
        return self.result()

    def result(self) -> SimResult:
        w, now = self.w, self.now
        span = max(1e-9, now - (self.t_warm or 0.0))
        measured = self.trained - w.warmup
        busy = sum(x.busy_s for x in self.inst) / max(1e-9, now * len(self.inst))
        return SimResult(
            samples_per_s=measured * w.groups_per_step * w.group_size / span,
            generation_samples_per_s=(self.gen_done - self.gen_warm) / span,
            steps=self.trained,
            max_version_lag=max(self.hist, default=0),
            version_lag_hist=dict(sorted(self.hist.items())),
            trainer_idle_frac=self.trainer_idle / span,
            rollout_busy_frac=busy,
            groups_dropped_stale=self.groups_dropped_stale,
        )


def simulate(
    instances: list[SimInstance],
    *,
    groups_per_step: int,
    group_size: int,
    max_staleness: int,
    publish_every: int,
    train_step_s: float,
    mean_len: int,
    max_len: int,
    steps: int = 16,
    warmup: int = 3,
    seed: int = 0,
    max_inflight_groups: int | None = None,
) -> SimResult:
    w = _Workload(
        groups_per_step,
        group_size,
        max_staleness,
        publish_every,
        train_step_s,
        mean_len,
        max_len,
        steps,
        warmup,
        max_inflight_groups,
    )
    return Simulation(instances, w, seed).run()
