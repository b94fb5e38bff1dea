"""The workflow's task graph in the plan: which node group each priced task (reference,
reward model) is reserved on, chosen by what it costs and what the pipeline needs.

The pipeline's rate is min(generation, training, every priced task's rate). A task's
machines are set aside before the MILP sizes the pools on the rest (`scheduler/tasks.py`)
and their price leaves the budget, so a faster kind for a task is bought with the pools'
money. With a budget the choice is searched in rounds: first each task on its cheapest
allowed group; then, from the rate the pools reached, each task on the cheapest group
that keeps up with it (else its fastest), and again from the new plan's rate, until a
choice repeats (`MAX_ROUNDS` at most); then each task alone on every other group that
keeps up with the best plan's pools (a cheap kind may take machines the pools would
use). The best plan (rate, then cost) wins, so a choice that costs the pools more than
it gains is not taken. At a target rate
each task takes the cheapest group that keeps up with the target. A custom task stays
on its cheapest allowed group, unpriced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_hex.config import ConfigError
from scheduler.cluster import Cluster, machine_name
from scheduler.costmodel import train_passes
from scheduler.model_shape import ModelShape
from scheduler.placing import TARGET_TOLERANCE
from scheduler.profile import Profile
from scheduler.task_costs import TaskOption, priced_gpu_tasks, task_options
from scheduler.workload import Workload

# scheduler/planner.py's PlanResult: the planner imports this module, so its type is not
# imported back (no import cycle, tests/unit/test_architecture.py)
PlanResult = Any

MAX_ROUNDS = 4
MAX_MOVES = 8  # single-task moves tried after the rounds
KEEPS_UP = 1e-6  # relative slack in "the task's rate is at least the pipeline's"

Choice = dict[str, TaskOption]
# plan_on(groups, bound, full): the plan with each task's machines on `groups[task]`, its
# rate capped at `bound` (rate, task), with baselines and replay when `full`
PlanOn = Callable[[dict[str, str] | None, tuple[float, str] | None, bool], "PlanResult"]


@dataclass(frozen=True)
class TaskCost:
    """What the plan reports of a task beyond generate and train."""

    task: str
    role: str
    kind: str | None  # None: a CPU task
    zone: str | None
    instances: int
    gpus: int  # per instance
    samples_per_s: float | None  # None: not priced (custom, or on CPU)
    usd_per_h: float
    reason: str


def place_tasks(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    prof: Profile | None,
    budget: float | None,
    target: float | None,
    plan_on: PlanOn,
) -> PlanResult:
    """The plan with every priced task on the group its cost chooses (module docstring)."""
    opts = {t.name: task_options(cl, t, m, w, prof) for t in priced_gpu_tasks(w)}
    if not opts:
        res = plan_on(None, None, True)
    elif target is not None:
        choice = _keeping_up(opts, target)
        short = [o for o in choice.values() if o.samples_per_s < target * (1 - TARGET_TOLERANCE)]
        if short:
            o = short[0]
            raise ConfigError(
                f"target {target:g} samples/s: task {o.task!r} ({o.role}) reaches at most "
                f"{o.samples_per_s:.3f} samples/s on any allowed kind ({o.kind}): expected "
                "more instances or GPUs per instance, a faster kind allowed, or a lower target"
            )
        res = plan_on(_groups(choice), _bound(choice), True)
    else:
        res = _searched(opts, plan_on)
    res.tasks = _report(cl, m, w, res, opts)
    return res


def _searched(opts: dict[str, list[TaskOption]], plan_on: PlanOn) -> PlanResult:
    """The rounds of the module docstring (budget objective), then the moves."""
    tried: dict[tuple[tuple[str, str], ...], tuple[Choice, PlanResult | None]] = {}

    def attempt(choice: Choice) -> None:
        key = tuple(sorted((name, o.group) for name, o in choice.items()))
        if key in tried:
            return
        try:
            tried[key] = (choice, plan_on(_groups(choice), _bound(choice), not tried))
        except ConfigError:
            if not tried:
                raise
            tried[key] = (choice, None)  # it leaves the pools too little

    choice = _cheapest(opts)
    for _ in range(MAX_ROUNDS):
        before = len(tried)
        attempt(choice)
        res = list(tried.values())[-1][1]
        if len(tried) == before or res is None:
            break
        choice = _keeping_up(opts, res.pool_rate)
    for move in _moves(opts, _best(tried)):
        attempt(_best(tried)[0] | move)
    first = next(iter(tried))
    choice, res = _best(tried)
    if tried[first][0] is not choice:  # only the first choice was planned in full
        res = plan_on(_groups(choice), _bound(choice), True)
    return res


def _best(tried: dict) -> tuple[Choice, PlanResult]:
    """The fastest plan tried, then the cheapest."""
    done = [(c, r) for c, r in tried.values() if r is not None]
    return max(done, key=lambda cr: (_rate(cr[1]), -cr[1].plan.predicted.cost_usd_per_h))


def _moves(opts: dict[str, list[TaskOption]], best: tuple[Choice, PlanResult]) -> list[Choice]:
    """Changes to try from the best plan (`MAX_MOVES` at most): one task on another group
    that keeps up with its pools, and every task together on one such group (they share
    its machines): the cheapest kind that keeps up may take machines the pools would
    use."""
    choice, res = best
    keep = {
        name: {o.group: o for o in os if o.samples_per_s >= res.pool_rate * (1 - KEEPS_UP)}
        for name, os in opts.items()
    }
    out: list[Choice] = []
    for g in sorted(set.intersection(*(set(k) for k in keep.values()))):
        if len(keep) > 1:
            out.append({name: k[g] for name, k in keep.items()})
    for name, k in keep.items():
        for o in sorted(k.values(), key=lambda o: (o.usd_per_h, o.group)):
            if o.group != choice[name].group:
                out.append({name: o})
    return out[:MAX_MOVES]


def _rate(res: PlanResult) -> float:
    return round(res.plan.predicted.samples_per_s, 6)


def _cheapest(opts: dict[str, list[TaskOption]]) -> Choice:
    return {
        n: min(os, key=lambda o: (o.usd_per_h, -o.samples_per_s, o.group)) for n, os in opts.items()
    }


def _keeping_up(opts: dict[str, list[TaskOption]], need: float) -> Choice:
    """Each task on its cheapest group reaching `need` samples/s, else its fastest."""
    out: Choice = {}
    for name, os in opts.items():
        keep = [o for o in os if o.samples_per_s >= need * (1 - KEEPS_UP)]
        out[name] = (
            min(keep, key=lambda o: (o.usd_per_h, -o.samples_per_s, o.group))
            if keep
            else max(os, key=lambda o: (o.samples_per_s, -o.usd_per_h, o.group))
        )
    return out


def _groups(choice: Choice) -> dict[str, str]:
    return {name: o.group for name, o in choice.items()}


def _bound(choice: Choice) -> tuple[float, str]:
    slowest = min(choice.values(), key=lambda o: (o.samples_per_s, o.task))
    return slowest.samples_per_s, slowest.task


def _report(
    cl: Cluster, m: ModelShape, w: Workload, res: PlanResult, opts: dict[str, list[TaskOption]]
) -> list[TaskCost]:
    """Each task's kind, rate and reason, also written into the plan's `decisions.tasks`."""
    rate = res.plan.predicted.samples_per_s
    group_of = {machine_name(g.name, i): g for g in cl.spec.node_groups for i in range(g.nodes)}
    by_name = {t.task: t for t in res.plan.decisions.tasks}
    out = []
    for task in w.tasks:
        placed = by_name.get(task.name)
        kind = group = chosen = None
        if placed is not None and placed.gpu_kind is not None:
            kind, group = placed.gpu_kind, group_of[placed.slots[0].node]
            chosen = next((o for o in opts.get(task.name, []) if o.group == group.name), None)
        price = 0.0 if group is None else task.instances * task.gpus * group.usd_per_gpu_hour
        reason = _reason(task.role, task.gpus, chosen, opts.get(task.name, []), rate)
        if chosen is not None and chosen.samples_per_s < res.pool_rate * (1 - KEEPS_UP):
            n = math.ceil(task.instances * res.pool_rate / chosen.samples_per_s * (1 - KEEPS_UP))
            reason += (
                f"; {n} instances on {chosen.kind} would keep up with the pools' "
                f"{res.pool_rate:.3f} samples/s (workflow.tasks: instances)"
            )
        speed = None if chosen is None else round(chosen.samples_per_s, 4)
        if placed is not None:
            placed.predicted_samples_per_s, placed.reason = speed, reason
        zone = None if group is None else group.zone
        out.append(
            TaskCost(task.name, task.role, kind, zone, task.instances, task.gpus, speed,
                     round(price, 2), reason)
        )  # fmt: skip
    if w.critic:
        out.append(_critic(m, w, res))
    return out


def _reason(
    role: str, gpus: int, chosen: TaskOption | None, opts: list[TaskOption], rate: float
) -> str:
    if chosen is None:
        where = "on CPU" if gpus == 0 else "on its cheapest allowed kind"
        return f"{role} task {where}; its work is not priced"
    others = [o for o in opts if o.kind != chosen.kind]
    seen = ", ".join(
        f"{o.kind} {o.samples_per_s:.3f}" for o in sorted(others, key=lambda o: o.usd_per_h)
    )
    alt = f" (other kinds, samples/s: {seen})" if seen else " (the only allowed kind that holds it)"
    if chosen.samples_per_s >= rate * (1 - KEEPS_UP):
        cheaper = [o for o in others if o.usd_per_h < chosen.usd_per_h]
        up = sorted({o.kind for o in cheaper if o.samples_per_s >= rate * (1 - KEEPS_UP)})
        how = "the cheapest allowed kind that keeps up" if cheaper else "the cheapest allowed kind"
        if up:
            how = (
                f"keeps up; the cheaper {', '.join(up)} would too, but on machines the pools "
                "use (a slower plan)"
            )
        return f"{how}: {chosen.samples_per_s:.3f} >= the plan's {rate:.3f} samples/s{alt}"
    faster = [o for o in others if o.samples_per_s > chosen.samples_per_s]
    why = (
        "a faster kind would leave the pools less budget than it gains"
        if faster
        else "no allowed kind is faster: add instances or GPUs per instance"
    )
    return f"binds the plan at {chosen.samples_per_s:.3f} samples/s; {why}{alt}"


def _critic(m: ModelShape, w: Workload, res: PlanResult) -> TaskCost:
    """PPO's critic: no devices of its own, its cost inside the train pool's step."""
    c = res.solution.trainer
    share = 4 / train_passes(w)
    return TaskCost(
        "critic", "critic", c.kind, "+".join(c.zones), 1, c.dp,
        round(res.plan.predicted.training_samples_per_s, 4), 0.0,
        f"in the train pool's ranks: its values forward and update are {share:.0%} of each "
        f"step's compute ({m.name} shape) and its gradients double the all-reduce",
    )  # fmt: skip
