"""The planner's task graph: a reference or reward-model task is priced as a forward over
every sample (compute-bound), bounds the plan's rate when it cannot keep up, and is
placed on the kind that keeps up cheapest; PPO's critic adds its passes, states and
gradients to the trainer's step (scheduler/task_costs.py, scheduler/task_graph.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config import ConfigError, TaskSpec
from areal_hex.plan import load_plan, save_plan
from scheduler.cluster import load_cluster
from scheduler.costmodel import train_flops_per_sample, train_memory_gb, train_passes
from scheduler.model_shape import load_model_shape
from scheduler.planner import make_plan
from scheduler.profile import DeviceRates, Profile
from scheduler.report import table
from scheduler.task_costs import forward_flops_per_sample, instance_rate, task_options
from scheduler.trainers import trainer_configs
from scheduler.workload import load_workload

ROOT = Path(__file__).resolve().parents[2]
CL = load_cluster(ROOT / "examples/clusters/hetrl_a100_l40s_l4.yaml")
M = load_model_shape("qwen3-8b")
W = load_workload(ROOT / "examples/workloads/math_grpo.yaml")
QUICK = {"time_limit_s": 20, "simulate_plan": False, "baselines": False}


def _rm(kinds: list[str] | None, shape: str | None = "qwen3-4b") -> tuple[TaskSpec, dict]:
    task = TaskSpec(
        name="rm", command=["x"], gpus=1, role="reward_model", port=9000, gpu_kinds=kinds
    )
    return task, {"tasks": [task], "reward_model_shape": shape}


def test_forward_rate_is_peak_compute_over_a_samples_flops() -> None:
    """L4: 121 TFLOPS at prefill_mfu 0.5 over one forward of 512 + 2,048 tokens of the
    8.19B actor (2N per token plus attention), per GPU and instance."""
    task = TaskSpec(name="ref", command=["x"], gpus=2, role="reference", port=9000)
    toks = 512 + 2048
    flops = toks * (2 * M.params + 4 * M.layers * M.heads * M.head_dim * toks / 2)
    assert forward_flops_per_sample(M, W) == pytest.approx(flops)
    l4 = next(g for g in CL.spec.node_groups if g.gpu == "L4")
    got = instance_rate(CL, l4, task, M, M, W, None)
    assert got == pytest.approx(2 * 121e12 * 0.5 / flops)
    big = load_model_shape("qwen3-32b")  # 65 GB of weights do not fit two L4s
    assert instance_rate(CL, l4, task, big, M, W, None) is None


def test_a_profiled_kind_scores_at_its_measured_prefill_rate() -> None:
    """Measured for the actor at 10,000 prefill tokens/s per GPU: the actor's forward at
    10,000 / 2,560 samples/s, a smaller reward model's in the ratio of their FLOPs."""
    rates = DeviceRates(
        device="x", decode_step_s={1: 0.01}, decode_context=128,
        prefill_tokens_per_s=10_000.0, train_tokens_per_s=1_000.0,
    )  # fmt: skip
    prof = Profile(model="qwen3-8b", params=M.params, kinds={"L4": rates})
    l4 = next(g for g in CL.spec.node_groups if g.gpu == "L4")
    task = TaskSpec(name="rm", command=["x"], gpus=1, role="reward_model", port=9000)
    assert instance_rate(CL, l4, task, M, M, W, prof) == pytest.approx(10_000 / 2560)
    small = load_model_shape("qwen3-1.7b")
    ratio = forward_flops_per_sample(M, W) / forward_flops_per_sample(small, W)
    got = instance_rate(CL, l4, task, small, M, W, prof)
    assert got == pytest.approx(10_000 / 2560 * ratio)


def test_the_critic_adds_its_passes_states_and_gradients_to_the_trainer() -> None:
    ppo = W.model_copy(update={"critic": True})
    assert (train_passes(W), train_passes(ppo)) == (4, 8)
    assert train_flops_per_sample(M, ppo) == pytest.approx(2 * train_flops_per_sample(M, W))
    assert train_memory_gb(M, ppo, 8, 2) > train_memory_gb(M, W, 8, 2) + 2 * M.params * 8 / 8 / 1e9
    # the same trainer (16 L40S GPUs at ZeRO-3) with the critic: twice the compute, and
    # its gradients double the all-reduce
    z3, z3_ppo = W.model_copy(update={"zero_stage": 3}), ppo.model_copy(update={"zero_stage": 3})
    base = next(c for c in trainer_configs(CL, M, z3) if (c.kind, c.dp) == ("L40S", 16))
    ppo_c = next(c for c in trainer_configs(CL, M, z3_ppo) if (c.kind, c.dp) == ("L40S", 16))
    assert ppo_c.compute_s == pytest.approx(2 * base.compute_s)
    assert ppo_c.comm_s == pytest.approx(2 * base.comm_s)


def test_a_reference_task_takes_the_reference_forward_out_of_the_trainer() -> None:
    kl = W.model_copy(update={"reference_model": True})
    ref = TaskSpec(name="ref", command=["x"], gpus=1, role="reference", port=9000)
    as_task = kl.model_copy(update={"tasks": [ref]})
    assert (train_passes(kl), train_passes(as_task)) == (5, 4)
    assert train_memory_gb(M, as_task, 8, 0) < train_memory_gb(M, kl, 8, 0)


def test_a_slow_reward_model_on_a_weak_kind_bounds_the_plan_and_moves_when_allowed() -> None:
    """The Qwen3-4B reward model on one L4 GPU scores 2.69 samples/s, below what the pools
    reach at $40/h (7.25): pinned to L4 it binds the plan; allowed on L40S too, the
    planner puts it there (8.04 samples/s, keeps up) and the plan is the pools' rate."""
    free = make_plan(CL, M, W, budget=40, **QUICK)
    task, upd = _rm(["L4"])
    l4_rate = task_options(CL, task, M, W.model_copy(update=upd), None)[0].samples_per_s
    pinned = make_plan(CL, M, W.model_copy(update=upd), budget=40, **QUICK)
    rate = pinned.plan.predicted.samples_per_s
    assert (
        rate == pytest.approx(l4_rate, rel=1e-3) and rate < 0.5 * free.plan.predicted.samples_per_s
    )
    assert pinned.plan.baselines.binding == "task rm"
    # 7.25 / 2.69: three instances on L4 would keep up
    assert "3 instances on L4 would keep up" in pinned.plan.decisions.task("rm").reason
    # the pools are planned no bigger than the task lets them run
    assert pinned.plan.predicted.cost_usd_per_h < 0.6 * free.plan.predicted.cost_usd_per_h
    _, upd = _rm(["L4", "L40S"])
    moved = make_plan(CL, M, W.model_copy(update=upd), budget=40, **QUICK)
    placed = moved.plan.decisions.task("rm")
    assert placed.gpu_kind == "L40S"
    assert placed.predicted_samples_per_s > moved.plan.predicted.samples_per_s
    assert moved.plan.predicted.samples_per_s > 2 * rate
    assert moved.plan.baselines.binding != "task rm"
    assert "keeps up" in placed.reason and "L4 " in placed.reason


def test_on_a_small_budget_the_cheap_kind_keeps_up_and_stays() -> None:
    """At $6/h the pools reach less than the L4 reward model scores: L4 is enough."""
    _, upd = _rm(["L4", "L40S"])
    res = make_plan(CL, M, W.model_copy(update=upd), budget=6, **QUICK)
    placed = res.plan.decisions.task("rm")
    assert placed.gpu_kind == "L4"
    assert placed.predicted_samples_per_s >= res.plan.predicted.samples_per_s
    assert placed.reason.startswith("the cheapest allowed kind")


def test_a_target_the_task_cannot_reach_is_refused_and_one_it_can_is_met() -> None:
    _, upd = _rm(["L4"])
    w = W.model_copy(update=upd)
    with pytest.raises(ConfigError, match=r"task 'rm' \(reward_model\) reaches at most 2\.686 "):
        make_plan(CL, M, w, target=4.0, **QUICK)
    _, upd = _rm(["L4", "A100-40GB"])
    res = make_plan(CL, M, W.model_copy(update=upd), target=4.0, **QUICK)
    assert res.plan.decisions.task("rm").gpu_kind == "A100-40GB"
    assert res.plan.predicted.samples_per_s >= 4.0 * 0.99


def test_a_model_that_fits_no_allowed_kind_is_a_clear_error() -> None:
    _, upd = _rm(["L4"], shape="qwen3-32b")
    with pytest.raises(ConfigError, match=r"task 'rm' \(role reward_model\): model .* fits on no"):
        make_plan(CL, M, W.model_copy(update=upd), budget=40, **QUICK)


def test_a_custom_task_is_placed_unpriced_and_the_plan_carries_every_task(tmp_path) -> None:
    noop = TaskSpec(name="noop", command=["x"], gpus=1)
    ref = TaskSpec(name="ref", command=["x"], gpus=1, role="reference", port=9000)
    w = W.model_copy(update={"tasks": [noop, ref], "reference_model": True, "critic": True})
    res = make_plan(CL, M, w, budget=40, **QUICK)
    plan = load_plan(save_plan(res.plan, tmp_path / "plan.yaml"))
    custom = plan.decisions.task("noop")
    assert custom.predicted_samples_per_s is None and "not priced" in custom.reason
    assert plan.decisions.task("ref").predicted_samples_per_s > 0
    text = table(res)
    assert "noop (custom)" in text and "ref (reference)" in text and "critic (in train)" in text
    assert f"task ref {plan.decisions.task('ref').predicted_samples_per_s:.3f}" in text


def test_bench_plan_refuses_an_unknown_workflow_before_any_work() -> None:
    from hexctl.bench.micro.plan_tasks import workflow_names

    assert workflow_names("grpo,ppo") == ["grpo", "ppo"] and workflow_names("") == []
    with pytest.raises(ConfigError, match=r"no workflow \['nope'\] \(known: grpo, "):
        workflow_names("grpo,nope")


def test_a_task_leaves_the_kind_the_trainer_needs_when_another_keeps_up() -> None:
    """PPO on the HetRL inventory trains on L40S; the reference's two instances keep up
    on L40S (the cheapest that does) and on A100-40GB. On L40S they take a machine the
    trainer would use: the planner puts them on A100-40GB and the plan is faster."""
    w = load_workload(ROOT / "examples/workloads/math_ppo_tasks.yaml")
    res = make_plan(CL, M, w, budget=40, **QUICK)
    ref = res.plan.decisions.task("ref")
    assert ref.gpu_kind == "A100-40GB" and res.plan.trainer.gpu_kind == "L40S"
    assert "the cheaper L40S would too" in ref.reason
    tasks = [
        t.model_copy(update={"gpu_kinds": ["L40S"]}) if t.name == "ref" else t for t in w.tasks
    ]
    on_l40s = make_plan(CL, M, w.model_copy(update={"tasks": tasks}), budget=40, **QUICK)
    assert on_l40s.plan.decisions.task("ref").gpu_kind == "L40S"
    assert res.plan.predicted.samples_per_s > 1.03 * on_l40s.plan.predicted.samples_per_s


def test_a_runs_prediction_is_bounded_by_its_placed_task() -> None:
    """`predict_layout` (what every run is held against) with the reward model where a
    plan put it: on L4 the pipeline is its 2.686 samples/s in both modes; on L40S
    (8.035) the pools' rate stands."""
    from scheduler.predict import TrainerLayout, predict_layout

    _, upd = _rm(None)
    w = W.model_copy(update=upd)
    args = (CL, M, w, None, [("a100", 4), ("a100", 4)], TrainerLayout((("l40s", 16),), 4))
    free = predict_layout(*args)
    on_l4 = predict_layout(*args, task_groups={"rm": "l4"})
    on_l40s = predict_layout(*args, task_groups={"rm": "l40s"})
    assert free.asynchronous.pipeline_samples_per_s > 4.0
    for mode in ("async", "sync"):
        assert on_l4.for_mode(mode).pipeline_samples_per_s == pytest.approx(2.686, abs=1e-3)
        assert on_l40s.for_mode(mode) == free.for_mode(mode)


def test_a_reward_model_shape_is_checked(tmp_path) -> None:
    lone = tmp_path / "lone.yaml"
    lone.write_text("reward_model_shape: qwen3-4b\n")
    with pytest.raises(ConfigError, match="without a task of role reward_model does nothing"):
        load_workload(lone)
    _, upd = _rm(None, shape="qwen9-1b")
    with pytest.raises(
        ConfigError, match=r"workload reward_model_shape \(the model of task 'rm'\)"
    ):
        make_plan(CL, M, W.model_copy(update=upd), budget=40, **QUICK)
