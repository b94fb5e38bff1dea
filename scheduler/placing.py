"""A phase-1 mix placed on machines, and the local search on the placed rate: from the
MILP's pick (`polish.polish`), to a target (`seed_for_target`), and at a rate for less
money (`cheaper_at_rate`). `make_plan` (scheduler/planner.py) sequences them."""

from __future__ import annotations

from dataclasses import dataclass

from areal_hex.config import ConfigError
from scheduler.cluster import Cluster
from scheduler.costmodel import RolloutOption, scaled
from scheduler.milp import PlanSpace, Solution, solution_for, solve
from scheduler.model_shape import ModelShape
from scheduler.partition import Placement, PlacementCost, evaluate, first_fit, place
from scheduler.polish import polish
from scheduler.sync_cost import sender_bound_rate
from scheduler.workload import Workload

# plans report rates to 4 significant decimals: a target equal to a reported reach is met
TARGET_TOLERANCE = 1e-4


@dataclass
class Placed:
    """A phase-1 solution on concrete machines, priced on the topology."""

    solution: Solution
    placement: Placement
    cost: PlacementCost
    rate: float
    gen_rate: float


def placed(
    cl: Cluster, m: ModelShape, w: Workload, p: PlanSpace, sol: Solution, naive: bool = False
) -> Placed:
    """Phase 2 for `sol` (METIS, or first-fit when `naive`), priced on the topology."""
    replicas = [(p.rollouts[i], n) for i, n in sol.replicas.items()]
    pl = first_fit(cl, sol.trainer, replicas) if naive else place(cl, m, w, sol.trainer, replicas)
    cost = evaluate(cl, m, w, sol.trainer, pl)
    rate, gen = placed_rate(w, pl, cost)
    return Placed(sol, pl, cost, rate, gen)


def polished(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    got: Placed,
    budget: float | None,
    target: float | None,
    kinds: set[str] | None = None,
    cheapest: bool = True,
) -> tuple[Placed, int]:
    """`polish.polish` from a placed solution: (the best placed mix it reaches, moves).
    With a budget and `cheapest`, a second search then looks for a cheaper mix at the
    rate the first reached (the lexicographic order phase 1 uses)."""
    sol = got.solution
    start = (sol.extra["trainer_index"], dict(sol.replicas))
    done = {(start[0], tuple(sorted(start[1].items()))): got}

    def rate(c: int, reps: dict[int, int]) -> float:
        key = (c, tuple(sorted(reps.items())))
        if key not in done:
            mix = solution_for(p, c, reps, sol.status, sol.gap, sol.solve_s)
            done[key] = placed(cl, m, w, p, mix)
        return done[key].rate

    out = polish(
        p,
        start,
        rate,
        budget=budget,
        target=target,
        allowed_kinds=kinds,
        tolerance=TARGET_TOLERANCE,
    )
    moves = out.moves
    if target is None and budget is not None and cheapest and out.rate > 0:
        at = (out.trainer, out.replicas)
        out = polish(p, at, rate, target=out.rate, allowed_kinds=kinds, tolerance=TARGET_TOLERANCE)
        moves += out.moves
    return done[(out.trainer, tuple(sorted(out.replicas.items())))], moves


def placed_rate(w: Workload, pl: Placement, cost: PlacementCost) -> tuple[float, float]:
    """(rate, generation rate) of a placed plan, as `milp.evaluate` but with the trainer's
    step and each instance's sync pause from the placement: R = min(t, Σh / (1 + Σ h·s /
    (kBG)), each instance's staleness window), instances whose pause share reaches 1
    generating nothing; where training binds, the pauses of a trainer that trains while
    it sends (`sync_cost.sender_bound_rate`)."""
    rate, gen, _ = _sender_bound(w, pl, cost)
    return rate, gen


def _sender_bound(
    w: Workload, pl: Placement, cost: PlacementCost
) -> tuple[float, float, list[tuple[RolloutOption, float, int]]]:
    """`placed_rate`'s (rate, generation rate) and the instances with the pauses in effect
    at that rate."""
    train = w.samples_per_step / cost.train_step_s
    items = placed_items(pl, cost)
    busy = cost.busy_sync_s or cost.sync_s
    rate, gen, syncs = sender_bound_rate(w, train, items, busy, cost.send_s, cost.after_send_s)
    return rate, gen, [(o, s, n) for (o, _, n), s in zip(items, syncs, strict=True)]


def paused_items(
    w: Workload, pl: Placement, cost: PlacementCost
) -> list[tuple[RolloutOption, float, int]]:
    """`placed_items` with each instance's pause as the trainer's state at the placed rate
    sets it (`sync_cost.sender_bound_rate`)."""
    return _sender_bound(w, pl, cost)[2]


def placed_items(pl: Placement, cost: PlacementCost) -> list[tuple[RolloutOption, float, int]]:
    """(instance, its pause per publish, 1) of a placed plan, each instance's rate what its
    links carry (`PlacementCost.gen_factors`)."""
    factors = cost.gen_factors or [1.0] * len(pl.rollout)
    return [
        (scaled(rc, f), s, 1)
        for (rc, _, _), s, f in zip(pl.rollout, cost.sync_s, factors, strict=True)
    ]


def seed_for_target(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    target: float,
    time_limit_s: float,
) -> Placed:
    """A placed plan reaching `target`, for the local search to make cheaper: phase 1's
    cheapest plan at the target; where its conservative rate or the placement falls
    short, phase 1 asked for proportionally more. ConfigError where neither reaches it
    (`planner.search` then seeds from the fastest plan)."""
    ok = target * (1 - TARGET_TOLERANCE)
    sol = solve(p, target=target, time_limit_s=time_limit_s)
    if sol is not None:
        got = placed(cl, m, w, p, sol)
        if got.rate >= ok:
            return got
        aim = target
        for _ in range(4):  # placement on a rack topology cost rate the MILP did not see
            aim *= target / max(got.rate, 1e-12) * 1.001
            more = solve(p, target=aim, time_limit_s=time_limit_s)
            if more is None:
                break
            got = placed(cl, m, w, p, more)
            if got.rate >= ok:
                return got
    raise ConfigError(f"phase 1 found no placed plan at {target:g} samples/s")


def cheaper_at_rate(
    cl: Cluster, m: ModelShape, w: Workload, p: PlanSpace, best: Placed, time_limit_s: float
) -> Placed:
    """The cheapest plan phase 1 finds at the rate `best` reaches, searched for a lower
    cost at that rate: kept when it is cheaper (a search from the rate-maximising mix may
    stop at a dearer one)."""
    try:
        alt = seed_for_target(cl, m, w, p, best.rate, time_limit_s)
    except ConfigError:
        return best
    alt = polished(cl, m, w, p, alt, None, best.rate)[0]
    keeps = alt.rate >= best.rate * (1 - TARGET_TOLERANCE)
    return alt if keeps and alt.solution.cost < best.solution.cost - 1e-9 else best
