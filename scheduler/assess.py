"""What a placed plan is worth and what holds it back, in the terms a user acts on.

binding: the resource the rate is stuck on: "training" (the trainer is the slower side),
"generation" (rollout instances are), refined to "weight sync" when publish pauses take
more than a sixth of the rollout instances' time, or "staleness gate" when the gate's
in-flight cap, not the GPUs, limits generation, or groups miss the staleness window
(`costmodel.window_fraction`) and are dropped. limits: further reasons the plan stops
where it does: "budget" (one more machine's price would buy a faster plan),
"inventory" (the GPUs of the binding pool's kinds are all in use).
homogeneous_ratio: the plan's rate over the best one-kind plan at the same budget.
cost_ratio: the cheapest one-kind plan that reaches the same rate, over this plan's cost
(None when no one-kind plan reaches it). recommended_mode: "synchronous" when the best
colocated synchronous plan at the same budget beats the asynchronous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.cluster import Cluster
from scheduler.costmodel import generation_at
from scheduler.milp import PlanSpace, solve, solve_per_kind

SYNC_SHARE_BINDS = 1 / 6  # pause share above which weight sync is named as the binding
WINDOW_LOSS_BINDS = 0.02  # share of generation lost to the staleness window that binds


@dataclass
class Assessment:
    binding: str
    limits: list[str] = field(default_factory=list)
    generation_utilisation: float = 0.0  # rate / generation capacity (pauses included)
    training_utilisation: float = 0.0  # rate / training rate
    homogeneous_ratio: float | None = None
    cost_ratio: float | None = None
    recommended_mode: str = "async"
    unspent_usd_per_h: float = 0.0


def assess(
    cl: Cluster,
    p: PlanSpace,
    placed,  # planner.Placed (imported lazily: the planner imports this module)
    train_rate: float,
    budget: float | None,
    homo: dict[str, float],
    sync_rate: float,
    time_limit_s: float,
    compare_cost: bool = True,
) -> Assessment:
    sol, rate = placed.solution, placed.rate
    capacity = sum(p.rollouts[i].samples_per_s * n for i, n in sol.replicas.items())
    in_flight = sum(p.rollouts[i].batch * n for i, n in sol.replicas.items())
    pl, syncs = placed.placement.rollout, placed.cost.sync_s
    items = [(rc, s, 1) for (rc, _, _), s in zip(pl, syncs, strict=True)]
    paused = generation_at(p.workload, items, rate, window=False)  # pauses, no window
    pause_share = 1 - paused / capacity if capacity > 0 else 0.0
    late = paused > 0 and placed.gen_rate < paused * (1 - WINDOW_LOSS_BINDS)
    if train_rate <= placed.gen_rate * (1 + 1e-6):
        binding = "training"
    elif late:
        binding = "staleness gate"
    elif pause_share > SYNC_SHARE_BINDS:
        binding = "weight sync"
    elif in_flight >= 0.98 * p.inflight:
        binding = "staleness gate"
    else:
        binding = "generation"
    out = Assessment(binding)
    out.generation_utilisation = round(rate / placed.gen_rate, 4) if placed.gen_rate else 0.0
    out.training_utilisation = round(rate / train_rate, 4) if train_rate else 0.0
    if budget is not None:
        out.unspent_usd_per_h = round(max(0.0, budget - sol.cost), 2)
        # budget binds when one more machine's worth of money buys a faster plan
        machine = max(g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
        more = solve(p, budget=budget + machine, time_limit_s=time_limit_s, cheapest=False)
        if more is not None and more.eval_rate > sol.eval_rate * 1.001:
            out.limits.append("budget")
    if _pool_full(cl, p, placed, binding):
        out.limits.append("inventory")
    best_homo = max(homo.values(), default=0.0)
    if best_homo > 0:
        out.homogeneous_ratio = round(rate / best_homo, 4)
    if compare_cost and sol.cost > 0:
        sols = solve_per_kind(p, target=rate, time_limit_s=time_limit_s).values()
        costs = [s.cost for s in sols if s is not None and s.eval_rate >= rate * (1 - 1e-6)]
        if len(set(sol.trainer.kinds) | {p.rollouts[i].kind for i in sol.replicas}) == 1:
            costs.append(sol.cost)  # the plan is itself a one-kind plan at this rate
        out.cost_ratio = round(min(costs) / sol.cost, 4) if costs else None
    if sync_rate > rate:
        out.recommended_mode = "synchronous"
    return out


def _free_gpus(cl: Cluster, p: PlanSpace, placed) -> dict[str, int]:
    used: dict[str, int] = {}
    for g, n in placed.solution.trainer.parts:
        used[g] = used.get(g, 0) + n
    for i, n in placed.solution.replicas.items():
        r = p.rollouts[i]
        used[r.group] = used.get(r.group, 0) + n * r.tp
    return {g.name: g.nodes * g.gpus_per_node - used.get(g.name, 0) for g in cl.spec.node_groups}


def _pool_full(cl: Cluster, p: PlanSpace, placed, binding: str) -> bool:
    """No free GPU of a kind that could serve the binding side."""
    free = _free_gpus(cl, p, placed)
    if binding == "training":
        kinds = set(placed.solution.trainer.kinds)  # a trainer across kinds grows by any
        return all(free[g.name] == 0 for g in cl.spec.node_groups if cl.kinds[g.name].name in kinds)
    groups = {r.group for r in p.rollouts}
    return all(free[g] == 0 for g in groups)
