"""One objective: what a plan reports is reachable, and no shown baseline beats it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scheduler import polish
from scheduler.cluster import load_cluster
from scheduler.milp import solution_for
from scheduler.model_shape import load_model_shape
from scheduler.placing import placed
from scheduler.planner import make_plan
from scheduler.polish import cost_of, fits
from scheduler.workload import load_workload

EX = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["h800_h20", "hetrl_a100_l40s_l4", "multi_region"])
def test_plan_never_below_its_homogeneous_baselines(name: str) -> None:
    cl = load_cluster(EX / "clusters" / f"{name}.yaml")
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    price = sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    res = make_plan(cl, m, w, budget=0.4 * price, simulate_plan=False)
    assert res.homogeneous  # the baselines were computed
    assert res.plan.predicted.samples_per_s >= round(max(res.homogeneous.values()), 4)


@pytest.mark.parametrize("share", [0.5, 0.9, 0.99, 1.0])
def test_target_at_or_below_the_reported_reach_succeeds(share: float) -> None:
    cl = load_cluster(EX / "clusters" / "hetrl_a100_l40s_l4.yaml")
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    reach = make_plan(cl, m, w, budget=60, simulate_plan=False, baselines=False)
    rate = reach.plan.predicted.samples_per_s
    res = make_plan(cl, m, w, target=share * rate, simulate_plan=False, baselines=False)
    assert res.plan.predicted.samples_per_s >= share * rate * (1 - 1e-9)


def _racks() -> tuple:
    cl = load_cluster(EX / "clusters" / "racks_h800_h20.yaml")
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    price = sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    return cl, m, w, 0.6 * price


def test_local_search_lifts_the_milp_pick_on_the_placed_rate() -> None:
    """On the racks inventory the MILP's pick (conservative pauses, no placement) is not
    the best placed mix: the search from it reaches more within the same budget, every
    GPU it takes exists, and the buffer replay agrees with the new figure."""
    cl, m, w, budget = _racks()
    res = make_plan(cl, m, w, budget=budget, baselines=False)
    b, pred = res.plan.baselines, res.plan.predicted
    assert b.local_search_moves >= 1
    assert pred.samples_per_s > b.milp_pick_samples_per_s * 1.02
    assert pred.cost_usd_per_h <= budget
    assert fits(res.problem, res.solution.extra["trainer_index"], res.solution.replicas)
    assert abs(res.sim.samples_per_s - pred.samples_per_s) / pred.samples_per_s <= 0.05


def test_after_the_search_no_single_addition_within_the_budget_raises_the_rate() -> None:
    """What the report's "unspent (nothing it buys raises the rate)" claims, checked by
    brute force: every one-instance addition and every other trainer that fits the
    unspent money places at or below the plan's rate."""
    cl, m, w, budget = _racks()
    res = make_plan(cl, m, w, budget=budget, baselines=False, simulate_plan=False)
    p, sol = res.problem, res.solution
    c = sol.extra["trainer_index"]
    mixes = [(c, {**sol.replicas, j: sol.replicas.get(j, 0) + 1}) for j in range(len(p.rollouts))]
    mixes += [(c2, sol.replicas) for c2 in range(len(p.trainers)) if c2 != c]
    tried = 0
    for c2, reps in mixes:
        if cost_of(p, c2, reps) > budget or not fits(p, c2, reps):
            continue
        tried += 1
        got = placed(cl, m, w, p, solution_for(p, c2, reps, "ok", 0.0, 0.0))
        assert got.rate <= res.rate * (1 + 1e-4)
    assert tried > 0


def test_local_search_in_cost_mode_keeps_the_target_and_never_costs_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cl, m, w, budget = _racks()
    reach = make_plan(cl, m, w, budget=budget, baselines=False, simulate_plan=False)
    target = 0.8 * reach.plan.predicted.samples_per_s
    res = make_plan(cl, m, w, target=target, baselines=False, simulate_plan=False)
    monkeypatch.setattr(polish, "ROUNDS", 0)  # the MILP's pick, placed, unsearched
    pick = make_plan(cl, m, w, target=target, baselines=False, simulate_plan=False)
    assert pick.plan.baselines.local_search_moves == 0
    assert res.plan.predicted.samples_per_s >= target * (1 - 1e-4)
    assert res.plan.predicted.cost_usd_per_h < pick.plan.predicted.cost_usd_per_h


def test_a_faster_trainer_that_needs_one_more_instance_is_reached() -> None:
    """A profile of the thin box (`examples/box/thin.yaml`, measured by `bench hetero`) at
    $5/h: the MILP picks a trainer on a mem node and one mem instance (71 samples/s, the
    trainer binds); a trainer on a fast node ($3) gains only with a second mem instance,
    and neither change alone gains. The search takes the two as one move."""
    from scheduler.profile import load_profile

    d = Path(__file__).resolve().parents[1] / "data" / "box_thin_profile"
    cl = load_cluster(d / "cluster.yaml")
    m = load_model_shape(str(d / "model"))
    w = load_workload(d / "workload.yaml")
    prof = load_profile(d / "profile.yaml", m.params)
    res = make_plan(cl, m, w, budget=5, prof=prof, simulate_plan=False, baselines=False)
    assert res.plan.trainer.gpu_kind == "fast"
    assert sorted(i.gpu_kind for i in res.plan.rollout) == ["mem", "mem"]
    assert res.plan.baselines.milp_pick_samples_per_s < 72  # the pick: mem trains
    assert res.plan.predicted.samples_per_s > 1.5 * res.plan.baselines.milp_pick_samples_per_s


def test_the_milp_charges_only_the_pause_that_does_not_generate() -> None:
    """The thin box's profile, weights from disk, with the mem kind generating through
    part of each pause (`reload_overlap_s`): the MILP's generation bound and the exact
    evaluation both charge the rest, so the MILP's rate stays a lower bound of the exact
    one and the same budget plans at least the rate it planned before."""
    from scheduler.milp import build_problem, evaluate, gen_rate, solve
    from scheduler.profile import load_profile

    d = Path(__file__).resolve().parents[1] / "data" / "box_thin_profile"
    cl = load_cluster(d / "cluster.yaml")
    m = load_model_shape(str(d / "model"))
    w = load_workload(d / "workload.yaml").model_copy(update={"weight_sync": "disk"})
    prof = load_profile(d / "profile.yaml", m.params)
    before = make_plan(cl, m, w, budget=5, prof=prof, simulate_plan=False, baselines=False)
    prof.kinds["mem"].reload_overlap_s = 0.04
    after = make_plan(cl, m, w, budget=5, prof=prof, simulate_plan=False, baselines=False)
    assert after.plan.predicted.samples_per_s >= before.plan.predicted.samples_per_s - 1e-6
    from scheduler.costmodel import rollout_configs
    from scheduler.trainers import trainer_configs

    p = build_problem(cl, m, w, rollout_configs(cl, m, w, prof), trainer_configs(cl, m, w, prof))
    sol = solve(p, budget=5)
    assert sol is not None
    c = p.trainers.index(sol.trainer)
    rate, _ = evaluate(p, c, sol.replicas)
    assert sol.rate <= rate + 1e-6
    mem = [i for i, r in enumerate(p.rollouts) if r.kind == "mem"]
    assert all(p.rollouts[i].pause_overlap_s == 0.04 for i in mem)
    # the same instances, their overlap ignored: the generation bound charges more
    y = {mem[0]: 2}
    with_overlap = gen_rate(p, c, y)
    p.rollouts[mem[0]] = dataclasses.replace(p.rollouts[mem[0]], pause_overlap_s=0.0)
    assert gen_rate(p, c, y) < with_overlap
