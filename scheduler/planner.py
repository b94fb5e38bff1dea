"""`make_plan`: cost model → phase 1 MILP → phase 2 METIS → simulator → `Plan`, with the
homogeneous and synchronous baselines computed in the same call. The `Plan` record is
written by `plan_record.to_plan`; the search over η and k that calls `make_plan` per
pair is `tuning.py`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from areal_hex.config import ConfigError
from areal_hex.plan import Plan
from scheduler.assess import Assessment, assess
from scheduler.by_placement import placement_plans
from scheduler.cluster import Cluster, merge_identical
from scheduler.colocated import Colocated, best_colocated, replayed
from scheduler.costmodel import (
    rollout_configs,
)
from scheduler.hybrid import hybrid_pick
from scheduler.milp import PlanSpace, Solution, build_problem, solve
from scheduler.model_shape import ModelShape
from scheduler.one_kind import kinds_of, one_kind_plans
from scheduler.partition import Placement, PlacementCost
from scheduler.placing import (
    TARGET_TOLERANCE,
    Placed,
    cheaper_at_rate,
    placed,
    polished,
    seed_for_target,
)
from scheduler.plan_record import to_plan
from scheduler.polish import GAIN
from scheduler.profile import Profile
from scheduler.replay import simulate_solution
from scheduler.simulator import SimResult
from scheduler.task_graph import TaskCost, place_tasks
from scheduler.tasks import Reserved, reserve_tasks
from scheduler.topology import Topology
from scheduler.trainers import trainer_configs
from scheduler.workload import Workload


@dataclass
class PlanResult:
    plan: Plan
    solution: Solution
    placement: Placement
    problem: PlanSpace
    sim: SimResult | None
    homogeneous: dict[str, float] = field(default_factory=dict)  # kind -> best rate
    synchronous: float = 0.0
    cost: PlacementCost | None = None
    rate: float = 0.0  # the placed plan's rate (= the solution's exact rate without racks)
    first_fit: Placed | None = None  # the naive placement, where the topology makes it differ
    first_fit_sim: SimResult | None = None
    assessment: Assessment | None = None
    pool_rate: float = 0.0  # what the pools reach before any task's bound (searched)
    tasks: list[TaskCost] = field(default_factory=list)  # beyond generate and train
    # the best plan of each placement the planner priced, the pick among them (`plan`)
    # included: disaggregated always, colocated and hybrid where they generate
    by_placement: dict[str, Plan] = field(default_factory=dict)


def problem_for(cl: Cluster, m: ModelShape, w: Workload, prof: Profile | None = None) -> PlanSpace:
    rollouts = rollout_configs(cl, m, w, prof)
    trainers = trainer_configs(cl, m, w, prof)
    if not rollouts and w.rollout_tp is not None:
        raise ConfigError(
            f"no rollout instance at TP {w.rollout_tp} fits cluster {cl.name!r} for model "
            f"{m.name} (TP must divide the GPUs per node and the {m.heads} attention heads, "
            f"and the weights plus one request's KV cache must fit)"
        )
    if not rollouts:
        largest = max(g.gpus_per_node for g in cl.spec.node_groups)
        raise ConfigError(
            f"model {m.name} ({m.params / 1e9:.1f}B parameters) fits on no GPU of cluster "
            f"{cl.name!r} for generation, even at TP {largest} (weights plus one request's KV "
            f"cache of {w.prompt_tokens + w.max_response_tokens} tokens must fit)"
        )
    if not trainers:
        raise ConfigError(
            f"model {m.name} ({m.params / 1e9:.1f}B parameters) cannot be trained on cluster "
            f"{cl.name!r}: no GPU kind holds its ZeRO-3 states and activations at any "
            f"data-parallel size up to {w.samples_per_step} ranks"
        )
    return build_problem(cl, m, w, rollouts, trainers)


def cheapest_cost(p: PlanSpace, time_limit_s: float) -> float | None:
    sol = solve(p, target=1e-9, time_limit_s=time_limit_s)
    return None if sol is None else sol.cost


@dataclass
class Searched:
    best: Placed
    pick_rate: float  # the MILP pick's placed rate, where the search started
    moves: int
    one_kind: dict[str, float] = field(default_factory=dict)  # kind -> its plan's rate


def plan_inventory(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    prof: Profile | None,
    *,
    budget: float | None = None,
    target: float | None = None,
    time_limit_s: float = 60.0,
) -> tuple[PlanSpace, Placed]:
    """An inventory's own plan space and its best plan by `search` (no one-kind seeds:
    the one-kind baselines plan their inventories with this)."""
    sp = problem_for(cl, m, w, prof)
    got = search(
        cl, m, w, sp, budget=budget, target=target, time_limit_s=time_limit_s,
        seeds=False, cheapest=False,
    )  # fmt: skip
    return sp, got.best


def search(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    *,
    budget: float | None = None,
    target: float | None = None,
    prof: Profile | None = None,
    time_limit_s: float = 60.0,
    seeds: bool = True,
    cheapest: bool = True,
) -> Searched:
    """The placed plan: the fastest under `budget` (then the cheapest at that rate), or
    the cheapest at `target`. The local search starts from phase 1's pick and, with
    `seeds`, also from the best plan of each one-kind inventory (`one_kind.one_kind_plan`),
    which the mix then never falls below. Without `cheapest` a budget plan keeps the
    fastest mix found, not the cheapest at its rate (for a baseline, which is a rate)."""

    if target is not None:
        best = _target_seed(cl, m, w, p, target, prof, time_limit_s, seeds)
        pick = best.rate
        best, moves = polished(cl, m, w, p, best, None, target)
        return Searched(best, pick, moves)
    kinds = kinds_of(p) if seeds else []
    with ThreadPoolExecutor(max_workers=1) as aside:
        # the one-kind plans need nothing from phase 1's pick: they run beside it (each
        # solve is a CBC subprocess, so two cores make them about free)
        seeded = aside.submit(
            one_kind_plans,
            cl,
            m,
            w,
            p,
            kinds,
            plan_inventory=plan_inventory,
            budget=budget,
            prof=prof,
            time_limit_s=time_limit_s,
        )
        try:
            sol = solve(p, budget=budget, time_limit_s=time_limit_s, cheapest=cheapest)
            if sol is None:
                raise ConfigError(_infeasible_message(p, budget, time_limit_s))
            best = placed(cl, m, w, p, sol)
            pick = best.rate
            best, moves = polished(cl, m, w, p, best, budget, None, cheapest=cheapest)
        except BaseException:
            seeded.cancel()
            raise
        one_kind_best = seeded.result()
    rates: dict[str, float] = {}
    for kind, hp in zip(kinds, one_kind_best, strict=True):
        rates[kind] = hp.rate if hp is not None else 0.0
        if hp is not None and hp.rate > best.rate * (1 + GAIN):
            pick = hp.rate  # searched from, across kinds
            best, moves = polished(cl, m, w, p, hp, budget, None)
    if cheapest:
        best = cheaper_at_rate(cl, m, w, p, best, time_limit_s)
    return Searched(best, pick, moves, rates)


def _target_seed(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    target: float,
    prof: Profile | None,
    time_limit_s: float,
    seeds: bool,
) -> Placed:
    """A placed plan reaching `target`: phase 1's cheapest plan at the target (asked for
    more where placement costs rate); else the fastest plan with every GPU affordable,
    searched exactly as a `--budget` plan is (from the MILP pick and every one-kind plan),
    so a target at or below the disaggregated rate `plan --budget` reported for the
    inventory is met."""
    bound = reach_bound(cl, p)
    if target > bound:
        raise ConfigError(
            f"target {target:g} samples/s is above what the cluster can reach ({bound:.3f} "
            "samples/s would need every GPU generating, the fastest trainer, and no pause "
            "for weight syncs)"
        )
    try:
        return seed_for_target(cl, m, w, p, target, time_limit_s)
    except ConfigError:
        pass
    price = sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    top = search(cl, m, w, p, budget=price, prof=prof, time_limit_s=time_limit_s, seeds=seeds).best
    if top.rate >= target * (1 - TARGET_TOLERANCE):
        return top
    raise ConfigError(
        f"target {target:g} samples/s is above what the cluster can reach ({top.rate:.3f} "
        f"samples/s, the fastest plan with every GPU affordable, placed on its machines)"
    )


def reach_bound(cl: Cluster, p: PlanSpace) -> float:
    """An upper bound of any plan's rate: the fastest trainer, and every GPU generating
    at its group's best rate per GPU with no pause."""
    gen: dict[str, float] = {}
    for r in p.rollouts:
        gen[r.group] = max(gen.get(r.group, 0.0), r.samples_per_s / r.tp)
    total = sum(gen.get(g.name, 0.0) * g.nodes * g.gpus_per_node for g in cl.spec.node_groups)
    return min(total, max((c.samples_per_s for c in p.trainers), default=0.0))


def make_plan(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    *,
    budget: float | None = None,
    target: float | None = None,
    prof: Profile | None = None,
    model_label: str | None = None,
    time_limit_s: float = 60.0,
    simulate_plan: bool = True,
    baselines: bool = True,
) -> PlanResult:
    """The plan: the workflow's tasks placed by their cost (`scheduler/task_graph.py`),
    the generation and training pools planned on the machines left."""
    if (budget is None) == (target is None):
        raise ConfigError("give exactly one of a budget ($/h) or a target rate (samples/s)")

    made: dict[tuple, PlanResult] = {}  # a choice planned twice (quick, then in full)

    def plan_on(
        groups: dict[str, str] | None, bound: tuple[float, str] | None, full: bool
    ) -> PlanResult:
        full = full and (simulate_plan or baselines)
        key = (tuple(sorted((groups or {}).items())), full)
        if key not in made:
            made[key] = _plan_reserved(
                cl, m, w, reserve_tasks(cl, w.tasks, groups), bound, budget=budget,
                target=target, prof=prof, model_label=model_label, time_limit_s=time_limit_s,
                simulate_plan=simulate_plan and full, baselines=baselines and full,
            )  # fmt: skip
        return made[key]

    return place_tasks(cl, m, w, prof, budget, target, plan_on)


def _plan_reserved(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    reserved: Reserved,
    bound: tuple[float, str] | None,
    *,
    budget: float | None,
    target: float | None,
    prof: Profile | None,
    model_label: str | None,
    time_limit_s: float,
    simulate_plan: bool,
    baselines: bool,
) -> PlanResult:
    """`make_plan` with the tasks' machines set aside (`reserved`) and the pipeline's rate
    at most `bound` (the slowest priced task's rate, and its name)."""
    whole_budget = budget
    budget = _pools_budget(reserved, budget)
    inventory = cl = reserved.cluster
    cl, names = merge_identical(cl)  # the plan speaks the inventory's machine names
    p = problem_for(cl, m, w, prof)
    found = search(
        cl,
        m,
        w,
        p,
        budget=budget,
        target=target,
        prof=prof,
        time_limit_s=time_limit_s,
        seeds=len(kinds_of(p)) > 1,
    )
    pool_rate = found.best.rate
    if bound is not None and target is None and pool_rate > bound[0] * (1 + 1e-6):
        found = _at_bound(cl, m, w, p, found, bound[0], prof, time_limit_s)
    best = found.best
    homo, sync, cost_ratio, colocated = found.one_kind, 0.0, None, None
    if baselines:
        best, homo, cost_ratio, colocated = _compared(
            cl, m, w, p, best, homo, budget, target, prof, time_limit_s
        )
        sync = 0.0 if colocated is None else colocated.samples_per_s
    sol, placement = best.solution, best.placement
    if best.rate <= 0 and sync <= 0:
        raise ConfigError(
            f"no plan generates anything on cluster {cl.spec.name!r}: every "
            "rollout instance would spend all its time paused for weight syncs; raise "
            "the workload's publish_every or groups_per_step, or run synchronously"
        )
    simulate_plan = simulate_plan and best.rate > 0
    sim = simulate_solution(cl, m, w, sol, placement, best.cost) if simulate_plan else None
    ff = ff_sim = None
    if Topology(cl).declared:
        ff = placed(cl, m, w, p, sol, naive=True)
        if simulate_plan:
            ff_sim = simulate_solution(cl, m, w, sol, ff.placement, ff.cost)
    train_rate = w.samples_per_step / best.cost.train_step_s
    verdict = assess(cl, m, p, best, train_rate, budget, homo, sync, time_limit_s, cost_ratio)
    if names:
        best = replace(best, placement=_renamed(best.placement, names))
        ff = None if ff is None else replace(ff, placement=_renamed(ff.placement, names))
        placement = best.placement
    plan = to_plan(
        inventory, m, w, best, budget, target, model_label, sim, homo, sync, ff, ff_sim, verdict
    )
    plan.decisions.tasks = reserved.placements
    plan.baselines.disaggregated_samples_per_s = round(best.rate, 4)
    hybrid = hybrid_pick(p, w, best.solution, prof) if baselines else None
    plan.baselines.hybrid_samples_per_s = None if hybrid is None else round(hybrid.samples_per_s, 4)
    cap = bound[0] if bound is not None else float("inf")
    col = 0.0 if colocated is None else min(colocated.samples_per_s, cap)
    hyb = 0.0 if hybrid is None else min(hybrid.samples_per_s, cap)
    by_placement = placement_plans(cl, w, plan, colocated, hybrid, names, target)
    if "colocated" in by_placement and col > max(best.rate, hyb):
        plan = by_placement["colocated"]  # the faster placement
    elif "hybrid" in by_placement and hyb > best.rate * (1 + 1e-6):
        plan = by_placement["hybrid"]
    for each in by_placement.values():
        if bound is not None:
            _capped(each, *bound)
        each.predicted.cost_usd_per_h = round(each.predicted.cost_usd_per_h + reserved.usd_per_h, 2)
        each.budget_usd_per_h = whole_budget
    plan.baselines.local_search_moves = found.moves
    plan.baselines.milp_pick_samples_per_s = round(found.pick_rate, 4)
    return PlanResult(
        plan, sol, placement, p, sim, homo, sync, best.cost, best.rate, ff, ff_sim,
        pool_rate=pool_rate, by_placement=by_placement,
    )  # fmt: skip


def _pools_budget(reserved: Reserved, budget: float | None) -> float | None:
    """The budget left for the pools once the tasks' machines are paid for."""
    if budget is None or not reserved.usd_per_h:
        return budget
    if reserved.usd_per_h >= budget:
        raise ConfigError(
            f"the workflow's tasks cost ${reserved.usd_per_h:.2f}/h of the ${budget:.2f}/h "
            "budget: expected budget left for the generation and training pools"
        )
    return budget - reserved.usd_per_h


def _capped(plan: Plan, rate: float, task: str) -> None:
    """The plan's rate at most the slowest task's `rate` (and the replay's, which runs
    the pools only); that task named as binding where it does."""
    if plan.predicted.samples_per_s <= rate:
        return
    plan.predicted.samples_per_s = round(rate, 4)
    plan.baselines.binding = f"task {task}"
    simulated = plan.baselines.simulated_samples_per_s
    if simulated is not None:
        plan.baselines.simulated_samples_per_s = round(min(simulated, rate), 4)


def _compared(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    best: Placed,
    homo: dict[str, float],
    budget: float | None,
    target: float | None,
    prof: Profile | None,
    time_limit_s: float,
) -> tuple[Placed, dict[str, float], float | None, Colocated | None]:
    """(the plan, one-kind rates, cost ratio, best colocated plan): the baselines at the
    plan's budget (at a target: at the plan's cost)."""
    best, cost_ratio = _one_kind_at_rate(cl, m, w, p, best, target, prof, time_limit_s)
    spend = budget if budget is not None else best.solution.cost
    if budget is None:  # at a target: what the plan's money buys on one kind
        kinds = kinds_of(p)
        got = one_kind_plans(
            cl, m, w, p, kinds, plan_inventory=plan_inventory, budget=spend, prof=prof,
            time_limit_s=time_limit_s,
        )  # fmt: skip
        homo = {k: 0.0 if g is None else g.rate for k, g in zip(kinds, got, strict=True)}
    pick = best_colocated(p, w, spend, prof)
    # the plan records the colocated price its run is held against
    return best, homo, cost_ratio, None if pick is None else replayed(cl, m, w, prof, pick)


def _at_bound(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    found: Searched,
    bound: float,
    prof: Profile | None,
    time_limit_s: float,
) -> Searched:
    """Where a task binds below the pools' rate: the cheapest pools that still reach the
    task's rate (money the pools cannot turn into rate stays unspent); `found` where none
    is cheaper."""
    try:
        at = search(cl, m, w, p, target=bound, prof=prof, time_limit_s=time_limit_s,
                    seeds=len(kinds_of(p)) > 1)  # fmt: skip
    except ConfigError:
        return found
    if at.best.solution.cost < found.best.solution.cost and at.best.rate >= bound * (
        1 - TARGET_TOLERANCE
    ):
        return replace(at, one_kind=found.one_kind)
    return found


def _one_kind_at_rate(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    p: PlanSpace,
    best: Placed,
    target: float | None,
    prof: Profile | None,
    time_limit_s: float,
) -> tuple[Placed, float | None]:
    """(the plan, cost ratio): the cheapest one-kind plan reaching the plan's rate (the
    target, at a target) over the plan's cost, None where no one-kind plan reaches it.
    Where one is cheaper than the mix, it is the plan (ratio 1): a mix is not worth more
    money than one kind at the same rate."""
    goal = target if target is not None else best.rate
    plans = one_kind_plans(
        cl,
        m,
        w,
        p,
        kinds_of(p),
        plan_inventory=plan_inventory,
        target=goal,
        prof=prof,
        time_limit_s=time_limit_s,
    )
    cheapest = min((x for x in plans if x is not None), key=lambda x: x.solution.cost, default=None)
    if cheapest is None:
        return best, None
    if cheapest.solution.cost < best.solution.cost - 1e-9:
        best = cheapest
    return best, round(cheapest.solution.cost / best.solution.cost, 4)


def _renamed(pl: Placement, names: dict[str, str]) -> Placement:
    """`pl` with merged machine names (`cluster.merge_identical`) as the inventory's."""
    return replace(
        pl,
        trainer=[(names.get(n, n), ids) for n, ids in pl.trainer],
        rollout=[(rc, names.get(n, n), ids) for rc, n, ids in pl.rollout],
    )


def _infeasible_message(p: PlanSpace, budget: float, time_limit_s: float) -> str:
    low = cheapest_cost(p, time_limit_s)
    if low is None:
        return "no feasible plan: no trainer and rollout pool fit this cluster together"
    return (
        f"budget ${budget:.2f}/h is below the cheapest feasible plan, ${low:.2f}/h "
        f"(one trainer and one rollout instance); raise --budget to at least {low:.2f}"
    )


def synchronous_rate(p: PlanSpace, w: Workload, budget: float) -> float:
    """Best colocated synchronous plan's rate (η = 0, the trainer's GPUs also generate,
    each phase waits for the other, one context switch a step: `scheduler/colocated.py`)."""
    pick = best_colocated(p, w, budget)
    return 0.0 if pick is None else pick.samples_per_s
