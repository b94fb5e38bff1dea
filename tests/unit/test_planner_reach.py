"""Planner v3: a target at or below any reported rate is met, baselines are plans of the
one-kind inventories, cost ratios compare plans that both reach the rate, a one-kind plan
says why, and the search scales with node groups."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hexctl.bench.micro.plan import many_groups_cluster
from scheduler.cluster import ClusterSpec, load_cluster, make_cluster, merge_identical, one_kind
from scheduler.model_shape import load_model_shape
from scheduler.placing import TARGET_TOLERANCE
from scheduler.planner import make_plan
from scheduler.workload import Workload, load_workload

EX = Path(__file__).resolve().parents[2] / "examples"
M = load_model_shape("qwen3-8b")
MATH = load_workload(EX / "workloads" / "math_grpo.yaml")


def _price(cl) -> float:
    return sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)


@pytest.mark.timeout(300)
def test_target_met_below_a_budget_plans_reach() -> None:
    """H100 + L40S over four racks: phase 1's full-price pick (all H100s training, L40S
    generating behind 12.5 GB/s NICs) places at about 9 samples/s, while a --budget plan
    at half the price reaches 15; a target of 0.99 and 1.0 x that reach is met (it used
    to exit 2, 'above what the cluster can reach (9.478)')."""
    cl = load_cluster(EX / "clusters" / "racks_h100_l40s.yaml")
    reach = make_plan(cl, M, MATH, budget=0.5 * _price(cl), simulate_plan=False)
    rate = reach.rate  # the disaggregated pools' (a target plans those)
    assert rate > 14.0
    for share in (0.99, 1.0):
        got = make_plan(cl, M, MATH, target=share * rate, simulate_plan=False, baselines=False)
        assert got.plan.predicted.samples_per_s >= share * rate * (1 - TARGET_TOLERANCE)
        assert got.plan.predicted.cost_usd_per_h <= reach.plan.predicted.cost_usd_per_h + 1e-6


@pytest.mark.timeout(300)
def test_a_target_above_any_plan_fails_at_once() -> None:
    cl = load_cluster(EX / "clusters" / "h800_h20.yaml")
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="above what the cluster can reach"):
        make_plan(cl, M, MATH, target=1e6, simulate_plan=False)
    assert time.perf_counter() - t0 < 5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inventory", ["arealhex_ib_sxm", "racks_h800_h20"])
def test_one_kind_baselines_are_plans_and_cost_ratios_compare_reached_rates(
    inventory: str,
) -> None:
    cl = load_cluster(EX / "clusters" / f"{inventory}.yaml")
    budget = 0.6 * _price(cl)
    res = make_plan(cl, M, MATH, budget=budget, simulate_plan=False)
    # the disaggregated pools' rate: the one-kind baselines and the cost ratio are theirs
    b, rate, cost = res.plan.baselines, res.rate, res.solution.cost
    for kind in sorted({k.name for k in cl.kinds.values()}):
        alone = make_plan(one_kind(cl, kind), M, MATH, budget=budget, simulate_plan=False)
        # the baseline is at least the one-kind inventory's own plan at the budget
        assert res.homogeneous[kind] >= alone.rate * (1 - 1e-4)  # both disaggregated
    assert rate >= max(res.homogeneous.values()) * (1 - 1e-4)
    # a cost ratio only where a one-kind plan reaches the rate, and never below 1: a
    # one-kind plan as fast for less would have been the plan
    reached = []
    for kind in res.homogeneous:
        try:
            at = make_plan(
                one_kind(cl, kind), M, MATH, target=rate, simulate_plan=False, baselines=False
            )
        except Exception:
            continue
        reached.append(at.plan.predicted.cost_usd_per_h)
    if b.cost_ratio is None:
        assert not reached
    else:
        assert b.cost_ratio >= 1.0 - 1e-4
        assert reached
    # money left that buys a machine is not called the limit
    machine = min(g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    if budget - cost >= machine:
        assert "budget" not in b.limits


@pytest.mark.timeout(300)
def test_cheapest_mix_at_the_all_h800_rate_costs_no_more_than_all_h800() -> None:
    """AReaL-Hex on InfiniBand, SXM boards, R1-Distill-Qwen-7B, math_grpo: the mix at
    the all-H800 plan's rate used to cost $119.09/h against that plan's $105.60."""
    cl = load_cluster(EX / "clusters" / "arealhex_ib_sxm.yaml")
    m = load_model_shape("deepseek-r1-distill-qwen-7b")
    h800 = make_plan(one_kind(cl, "H800"), m, MATH, budget=126.72, simulate_plan=False)
    rate = h800.plan.predicted.samples_per_s
    mix = make_plan(cl, m, MATH, target=rate, simulate_plan=False)
    assert mix.plan.predicted.samples_per_s >= rate * (1 - TARGET_TOLERANCE)
    assert mix.plan.predicted.cost_usd_per_h <= h800.plan.predicted.cost_usd_per_h + 1e-6
    assert mix.plan.baselines.cost_ratio is not None and mix.plan.baselines.cost_ratio >= 1.0


@pytest.mark.timeout(300)
def test_a_one_kind_plan_says_what_a_mix_would_need() -> None:
    """AReaL-Hex setting, math_grpo: all H800; an H20 instance would pause 54.6 s per
    publish (16.4 GB over the 1.5 GB/s link between the kinds, x5) every ~30 s step."""
    cl = load_cluster(EX / "clusters" / "arealhex_setting.yaml")
    res = make_plan(cl, M, MATH, budget=126.72, simulate_plan=False)
    reason = res.plan.baselines.one_kind_reason
    assert {i.gpu_kind for i in res.plan.rollout} == {"H800"}
    assert reason is not None and reason.startswith("H20 instances would pause 54.6 s")
    assert "1.5 GB/s" in reason and "a mix would need at least a link of" in reason
    mixed = load_cluster(EX / "clusters" / "mixed_trainer_h800_h20.yaml")
    long_cot = load_workload(EX / "workloads" / "long_cot.yaml")
    mix = make_plan(mixed, M, long_cot, budget=180, simulate_plan=False, baselines=False)
    assert mix.plan.baselines.one_kind_reason is None  # a mix needs no excuse


def _lots(distinct: bool) -> ClusterSpec:
    groups = [
        {
            "name": f"lot{i}",
            "gpu": "H100" if i % 3 else "H20",
            "gpus_per_node": 8,
            "nodes": 2,
            "zone": "dc",
            "usd_per_gpu_hour": (2.99 if i % 3 else 1.85) + (0.01 * i if distinct else 0.0),
            "intra_node": {"kind": "nvlink", "bandwidth_gbs": 450},
        }
        for i in range(12)
    ]
    return ClusterSpec(
        name="lots",
        zones=[{"name": "dc", "region": "r", "inter_node_bandwidth_gbs": 50.0}],
        node_groups=groups,
    )


def test_identical_groups_merge_and_the_plan_names_the_inventorys_machines() -> None:
    cl = make_cluster(_lots(distinct=False))
    merged, names = merge_identical(cl)
    assert len(merged.spec.node_groups) == 2 and len(cl.spec.node_groups) == 12
    assert sum(g.nodes for g in merged.spec.node_groups) == 24
    assert merge_identical(make_cluster(_lots(distinct=True)))[0].spec.node_groups == (
        make_cluster(_lots(distinct=True)).spec.node_groups
    )
    res = make_plan(cl, M, Workload(), budget=150, simulate_plan=False, baselines=False)
    machines = {f"{g.name}-{i}" for g in cl.spec.node_groups for i in range(g.nodes)}
    used: dict[str, set[int]] = {}
    slots = [i.placement for i in res.plan.rollout] + res.plan.trainer.placements
    for slot in slots:
        assert slot.node in machines, slot.node
        taken = used.setdefault(slot.node, set())
        assert not taken & set(slot.gpu_ids)  # no GPU given twice
        taken |= set(slot.gpu_ids)
    assert set(names.values()) <= machines


@pytest.mark.timeout(300)
def test_many_node_groups_plan_in_seconds() -> None:
    """512 GPUs as 32 lots of two machines, each lot its own price (nothing merges): the
    search's cost is in node groups. 4,096 GPUs is `bench plan`'s case."""
    cl = many_groups_cluster(512)
    assert merge_identical(cl)[0] is cl
    t0 = time.perf_counter()
    res = make_plan(cl, M, Workload(), budget=0.5 * _price(cl))
    took = time.perf_counter() - t0
    assert res.plan.predicted.samples_per_s > 0
    assert took < 30, took
