"""One objective: what a plan reports is reachable, and no shown baseline beats it."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.cluster import load_cluster
from scheduler.model_shape import load_model_shape
from scheduler.planner import make_plan
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
