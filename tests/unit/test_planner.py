from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config import ConfigError
from hexctl.bench.micro.plan import SMALL_WORKLOAD, random_small_cluster
from scheduler.catalogue import CATALOGUE, UnknownGpuKind, canonical_kind
from scheduler.cluster import load_cluster
from scheduler.costmodel import allreduce_s, train_memory_gb
from scheduler.exhaustive import exhaustive, exhaustive_min_cost, fits
from scheduler.milp import solve
from scheduler.model_shape import PRESETS, load_model_shape
from scheduler.planner import make_plan, problem_for
from scheduler.workload import Workload, load_workload

EX = Path(__file__).resolve().parents[2] / "examples"


def test_catalogue_datasheet_figures() -> None:
    assert CATALOGUE["A100-40GB"].hbm_gbs == 1555
    assert CATALOGUE["A100-80GB"].hbm_gbs == 2039
    assert CATALOGUE["L40S"].bf16_tflops == 362
    assert (CATALOGUE["L4"].bf16_tflops, CATALOGUE["L4"].hbm_gbs) == (121, 300)
    assert canonical_kind("a100-40") == "A100-40GB"
    assert canonical_kind("RTX 4090") == "RTX4090"
    with pytest.raises(UnknownGpuKind, match="did you mean 'H100'"):
        canonical_kind("H10O")


def test_presets_parameter_counts() -> None:
    # Published sizes: Qwen3-8B 8.19B, Llama-3-70B 70.6B, Qwen3-0.6B 0.60B.
    assert abs(PRESETS["Qwen/Qwen3-8B"].params / 1e9 - 8.19) < 0.01
    assert abs(load_model_shape("llama-3-70b").params / 1e9 - 70.55) < 0.01
    assert abs(load_model_shape("qwen3-0.6b").params / 1e9 - 0.596) < 0.005
    with pytest.raises(ConfigError, match="not a preset"):
        load_model_shape("qwen9-1b")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_shape_written_as_an_hf_config_reads_back_the_same(tmp_path: Path, name: str) -> None:
    import json

    shape = PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(shape.hf_config()))
    back = load_model_shape(str(tmp_path))
    assert back.__dict__ | {"name": name} == shape.__dict__ and back.params == shape.params


def test_zero_memory_and_allreduce_formulas() -> None:
    m, w = load_model_shape("qwen3-8b"), Workload()
    # ZeRO-3 shards all 16 bytes/param; ZeRO-0 keeps them whole.
    diff = train_memory_gb(m, w, 1, 0) - train_memory_gb(m, w, 8, 3)
    assert abs(diff - 16 * m.params * (1 - 1 / 8) / 1e9) < 1e-6
    # Ring all-reduce on one node: 2(p-1)/p * 2N bytes over the link.
    t = allreduce_s(m, 8, 1, 2, intra=100.0, inter=1.0, latency_ms=0.0)
    assert t == pytest.approx(2 * 7 / 8 * 2 * m.params / 100e9)
    assert allreduce_s(m, 8, 1, 3, 100.0, 1.0, 0.0) == pytest.approx(1.5 * t)


@pytest.mark.parametrize("seed", range(8))
def test_milp_matches_exhaustive_search(seed: int) -> None:
    cl, budget = random_small_cluster(seed)
    p = problem_for(cl, load_model_shape("qwen3-1.7b"), SMALL_WORKLOAD)
    sol = solve(p, budget=budget)
    best, _ = exhaustive(p, budget)
    assert best > 0
    assert sol is not None
    assert sol.rate == pytest.approx(best, rel=1e-6)
    assert sol.cost <= budget + 1e-6
    assert fits(p, sol.extra["trainer_index"], sol.replicas)


@pytest.mark.parametrize("seed", range(4))
def test_min_cost_matches_exhaustive_search(seed: int) -> None:
    cl, budget = random_small_cluster(seed)
    p = problem_for(cl, load_model_shape("qwen3-1.7b"), SMALL_WORKLOAD)
    best, _ = exhaustive(p, budget)
    target = 0.5 * best
    sol = solve(p, target=target)
    assert sol is not None and sol.rate >= target * (1 - 1e-6)
    assert sol.cost == pytest.approx(exhaustive_min_cost(p, target), rel=1e-9)


@pytest.mark.parametrize("name", ["hetrl_a100_l40s_l4", "h800_h20", "multi_region"])
def test_plans_respect_budget_memory_and_devices(name: str) -> None:
    cl = load_cluster(EX / "clusters" / f"{name}.yaml")
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "long_cot.yaml")
    for budget in (30.0, 90.0):
        res = make_plan(cl, m, w, budget=budget, simulate_plan=False, baselines=False)
        plan = res.plan
        assert plan.predicted.cost_usd_per_h <= budget + 1e-6
        used: set[tuple[str, int]] = set()
        slots = [(s.node, s.gpu_ids) for s in plan.trainer.placements]
        slots += [(i.placement.node, i.placement.gpu_ids) for i in plan.rollout]
        for node, ids in slots:
            for g in ids:
                assert (node, g) not in used
                used.add((node, g))
        assert res.solution.trainer.mem_gb <= CATALOGUE[plan.trainer.gpu_kind].hbm_gb
        for inst in plan.rollout:
            kind = CATALOGUE[inst.gpu_kind]
            assert 2 * m.params / inst.tp < kind.hbm_gb * 1e9 * w.constants.hbm_utilization
        assert sum(len(s.gpu_ids) for s in plan.trainer.placements) == plan.trainer.world_size


@pytest.mark.parametrize("workload", ["math_grpo", "long_cot"])
@pytest.mark.parametrize("name", sorted(p.stem for p in (EX / "clusters").glob("*.yaml")))
def test_simulator_agrees_with_milp(name: str, workload: str) -> None:
    cl = load_cluster(EX / "clusters" / f"{name}.yaml")
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / f"{workload}.yaml")
    price = sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    res = make_plan(cl, m, w, budget=0.6 * price)  # the plan a user gets
    # the simulator replays the disaggregated pools (a hybrid pick adds lent instances)
    pred = (
        res.plan.predicted.samples_per_s if res.plan.decisions.placement != "hybrid" else res.rate
    )
    assert res.sim is not None and pred > 0
    assert abs(res.sim.samples_per_s - pred) / pred <= 0.05
    assert res.sim.max_version_lag <= w.max_staleness + 1


def test_budget_below_minimum_states_it() -> None:
    cl = load_cluster(EX / "clusters" / "h800_h20.yaml")
    with pytest.raises(ConfigError, match=r"below the cheapest feasible plan, \$3\.70/h"):
        make_plan(cl, load_model_shape("qwen3-8b"), Workload(), budget=2.0)
