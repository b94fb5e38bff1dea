"""Baselines that are plans: the best plan of each one-kind inventory.

A plan is compared with what the same money buys on one GPU kind, and with what one kind
needs to reach the same rate. Both are plans of the one-kind inventory (the machines of
that kind, in their zones and racks), made by the same search as the plan itself, and
priced on the same machines; so a one-kind baseline is at least the best plan of that
inventory at the budget, and a cost ratio is reported only where both sides reach the
rate. Each such plan is also a candidate of the mixed search (`planner.search`): when it
is faster, or as fast for less, it is the plan.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from areal_hex.config import ConfigError
from scheduler.cluster import Cluster, one_kind
from scheduler.milp import COST_NODES, PlanSpace, solution_for, solve
from scheduler.model_shape import ModelShape
from scheduler.placing import TARGET_TOLERANCE, Placed, placed, polished
from scheduler.profile import Profile
from scheduler.workload import Workload

# How an inventory is planned: the planner's own search (seeds off), given by the planner,
# which imports this module: (inventory, model, workload, profile; budget, target,
# time limit) -> (its plan space, its best plan).
PlanInventory = Callable[..., "tuple[PlanSpace, Placed]"]


def kinds_of(p: PlanSpace) -> list[str]:
    """The GPU kinds that can generate (a one-kind plan needs a rollout instance)."""
    return sorted({r.kind for r in p.rollouts})


def one_kind_plan(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    kind: str,
    *,
    plan_inventory: PlanInventory,
    budget: float | None = None,
    target: float | None = None,
    prof: Profile | None = None,
    time_limit_s: float = 60.0,
) -> Placed | None:
    """The best plan of `kind`'s machines under `budget` (or the cheapest at `target`),
    as a plan of the whole inventory `p`; None where that kind has no plan (or none that
    reaches the target)."""
    sub = one_kind(cl, kind)
    found: list[Placed] = []
    try:
        sp, got = plan_inventory(
            sub, m, w, prof, budget=budget, target=target, time_limit_s=time_limit_s
        )
        found.append(_in_full(cl, m, w, p, sp, got))
    except ConfigError:
        pass
    if budget is not None:  # phase 1 of the whole inventory, kept to the kind, seeds too
        sol = solve(
            p,
            budget,
            time_limit_s=time_limit_s,
            allowed_kinds={kind},
            cheapest=False,
            max_nodes=COST_NODES,
        )
        if sol is not None:
            start = placed(cl, m, w, p, sol)
            found.append(polished(cl, m, w, p, start, budget, None, {kind}, cheapest=False)[0])
        return max(found, key=lambda x: (x.rate, -x.solution.cost), default=None)
    reach = [x for x in found if x.rate >= target * (1 - TARGET_TOLERANCE)]
    return min(reach, key=lambda x: x.solution.cost, default=None)


def one_kind_plans(
    cl: Cluster, m: ModelShape, w: Workload, p: PlanSpace, kinds: list[str], **kw: object
) -> list[Placed | None]:
    """`one_kind_plan` for each of `kinds`, side by side: each is its own CBC subprocess
    and placement, and the kinds share nothing but the read-only inventory."""
    if len(kinds) < 2:
        return [one_kind_plan(cl, m, w, p, kind, **kw) for kind in kinds]  # type: ignore[arg-type]
    with ThreadPoolExecutor(max_workers=min(len(kinds), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda k: one_kind_plan(cl, m, w, p, k, **kw), kinds))  # type: ignore[arg-type]


def _in_full(
    cl: Cluster, m: ModelShape, w: Workload, p: PlanSpace, sp: PlanSpace, got: Placed
) -> Placed:
    """A one-kind inventory's plan as the same decision in the whole inventory's space,
    placed on the whole inventory (the same machines: groups it does not use take no part
    in the mapping)."""
    rollout = {_rkey(r): i for i, r in enumerate(p.rollouts)}
    trainer = {_tkey(c): i for i, c in enumerate(p.trainers)}
    sol = got.solution
    c_idx = trainer[_tkey(sol.trainer)]
    reps = {rollout[_rkey(sp.rollouts[i])]: n for i, n in sol.replicas.items()}
    mix = solution_for(p, c_idx, reps, sol.status, sol.gap, sol.solve_s)
    return placed(cl, m, w, p, mix)


def _rkey(r) -> tuple:
    return (r.group, r.tp, r.batch)


def _tkey(c) -> tuple:
    return (c.parts, c.per_node, c.zero)
