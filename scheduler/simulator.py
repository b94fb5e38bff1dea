"""Discrete-event replay of a plan: requests on continuous-batching instances, the
staleness gate, the buffer, trainer steps and weight syncs.

Each instance decodes its active requests in lock-step; a step with n active requests
takes step_fn(n) seconds (the cost model's decode step at batch n), a new request first
stalls the instance for its prefill, and a weight sync stalls it for its sync time. The
controller admits a group only while submitted ≤ (v + η + 1)·B, spreads samples over
instances with free slots (least loaded first); the trainer takes the B oldest finished
groups, steps, and publishes every k steps.
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
    max_staleness: int
    staleness_hist: dict[int, int]
    trainer_idle_frac: float
    rollout_busy_frac: float
    dropped: int = 0


def simulate(
    instances: list[SimInstance],
    *,
    batch_groups: int,
    group_size: int,
    staleness: int,
    publish_interval: int,
    train_step_s: float,
    mean_len: int,
    max_len: int,
    steps: int = 16,
    warmup: int = 3,
    seed: int = 0,
) -> SimResult:
    rng = random.Random(seed)
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, arg, stamp)
    seq = 0

    def push(t: float, kind: str, arg: int, stamp: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, arg, stamp))

    def reschedule(i: int) -> None:
        inst = instances[i]
        inst.stamp += 1
        nf = inst.next_finish()
        if nf is not None:
            push(nf, "done", i, inst.stamp)

    now, version, submitted, trained = 0.0, 0, 0, 0
    pending: deque[tuple[int, int]] = deque()  # (group, length) samples to dispatch
    group_left: dict[int, int] = {}
    group_ver: dict[int, int] = {}
    req_group: dict[int, int] = {}
    finished: deque[int] = deque()  # groups, oldest first
    trainer_busy, trainer_idle, hist = False, 0.0, {}
    idle_since, t_warm, gen_done, gen_warm = 0.0, None, 0, 0
    rid = 0

    def dispatch() -> None:
        nonlocal submitted, rid
        while True:
            if not pending and submitted < (version + staleness + 1) * batch_groups:
                g = submitted  # the gate admits one more group
                submitted += 1
                group_left[g], group_ver[g] = group_size, version
                for _ in range(group_size):
                    length = min(max_len, max(1, int(mean_len * rng.uniform(0.5, 1.5))))
                    pending.append((g, length))
            free = [i for i, x in enumerate(instances) if len(x.active) < x.slots]
            if not pending or not free:
                return
            i = min(free, key=lambda j: len(instances[j].active) / instances[j].slots)
            g, length = pending.popleft()
            inst = instances[i]
            inst.advance(now)
            inst.stall_until = max(inst.stall_until, now) + inst.prefill_s
            rid += 1
            req_group[rid] = g
            heapq.heappush(inst.active, (inst.tok + length, rid))
            reschedule(i)

    def try_train() -> None:
        nonlocal trainer_busy, trainer_idle
        if not trainer_busy and len(finished) >= batch_groups:
            batch = [finished.popleft() for _ in range(batch_groups)]
            for g in batch:
                lag = version - group_ver.pop(g)
                hist[lag] = hist.get(lag, 0) + 1
            trainer_busy = True
            trainer_idle += now - idle_since
            push(now + train_step_s, "step", 0)

    dispatch()
    while events and trained < steps:
        now, _, kind, arg, stamp = heapq.heappop(events)
        if kind == "done":
            inst = instances[arg]
            if stamp != inst.stamp:
                continue
            inst.advance(now)
            while inst.active and inst.active[0][0] <= inst.tok + 1e-9:
                _, r = heapq.heappop(inst.active)
                g = req_group.pop(r)
                gen_done += 1
                group_left[g] -= 1
                if group_left[g] == 0:
                    del group_left[g]
                    finished.append(g)
            reschedule(arg)
            dispatch()
            try_train()
        elif kind == "step":
            trainer_busy, idle_since = False, now
            trained += 1
            version += 1
            if trained == warmup:
                t_warm, gen_warm, trainer_idle = now, gen_done, 0.0
            if version % publish_interval == 0:
                for i, inst in enumerate(instances):
                    inst.advance(now)
                    inst.stall_until = max(inst.stall_until, now) + inst.sync_s
                    reschedule(i)
            dispatch()
            try_train()
    span = max(1e-9, now - (t_warm or 0.0))
    measured = trained - warmup
    busy = sum(x.busy_s for x in instances) / max(1e-9, now * len(instances))
    return SimResult(
        samples_per_s=measured * batch_groups * group_size / span,
        generation_samples_per_s=(gen_done - gen_warm) / span,
        steps=trained,
        max_staleness=max(hist, default=0),
        staleness_hist=dict(sorted(hist.items())),
        trainer_idle_frac=trainer_idle / span,
        rollout_busy_frac=busy,
    )
