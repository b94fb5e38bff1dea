"""`bench plan`'s workflows: one job (the HetRL inventory, math_grpo, 60 % of the
inventory's price) planned as GRPO, GRPO with the KL reference in the trainer or as a
task, GRPO with a reward-model task, PPO (the critic in the trainer's ranks) and PPO with
both tasks; each workflow's plan (pools, tasks, binding) and predicted rate. And the
slow reward model: pinned to L4 it must bound the plan at its own rate, and allowed on
any kind the planner must move it to one that keeps up (`slow_reward_model_ok`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from areal_hex.config import ConfigError
from areal_hex.config.workflow import TaskSpec
from scheduler.cluster import load_cluster
from scheduler.model_shape import ModelShape
from scheduler.planner import PlanResult, make_plan
from scheduler.workload import Workload, load_workload

INVENTORY = "hetrl_a100_l40s_l4"
WORKLOAD = "math_grpo"
BUDGET_SHARE = 0.6
RM_SHAPE = "qwen3-4b"  # a reward model too slow for one L4 at this budget's rate


def _task(name: str, role: str, kinds: list[str] | None = None, instances: int = 1) -> TaskSpec:
    cmd = ["areal-hex", "serve", "{config}", "--index", "{index}"]
    return TaskSpec(
        name=name, role=role, command=cmd, instances=instances, gpus=1, port=31000,
        gpu_kinds=kinds,
    )  # fmt: skip


# the reference: two 1-GPU instances (one L40S scores 4.1 samples/s of Qwen3-8B)
REF, RM = _task("ref", "reference", instances=2), _task("rm", "reward_model")
WORKFLOWS: dict[str, dict] = {
    "grpo": {},
    "grpo_kl_in_trainer": {"reference_model": True},
    "grpo_ref_task": {"reference_model": True, "tasks": [REF]},
    "grpo_rm_task": {"tasks": [RM], "reward_model_shape": RM_SHAPE},
    "ppo": {"critic": True},
    "ppo_ref_rm_tasks": {
        "critic": True,
        "reference_model": True,
        "tasks": [REF, RM],
        "reward_model_shape": RM_SHAPE,
    },  # fmt: skip
}


def _summary(res: PlanResult) -> dict:
    plan = res.plan
    t = plan.trainer
    return {
        "samples_per_s": plan.predicted.samples_per_s,
        "pools_samples_per_s": round(res.pool_rate, 4),
        "training_samples_per_s": plan.predicted.training_samples_per_s,
        "cost_usd_per_h": plan.predicted.cost_usd_per_h,
        "binding": plan.baselines.binding,
        "train": f"{t.world_size} {t.gpu_kind}, ZeRO-{t.zero_stage}",
        "rollout_gpus": dict(Counter(i.gpu_kind for i in plan.rollout for _ in range(i.tp))),
        "tasks": {c.task: {"kind": c.kind, "samples_per_s": c.samples_per_s} for c in res.tasks},
    }


def workflow_names(arg: str) -> list[str]:
    """`--workflows` as names, each checked (before the bench's minutes of work)."""
    names = [x for x in arg.split(",") if x]
    unknown = sorted(set(names) - set(WORKFLOWS))
    if unknown:
        raise ConfigError(f"--workflows: no workflow {unknown} (known: {', '.join(WORKFLOWS)})")
    return names


def workflows(examples: Path, m: ModelShape, time_limit_s: float, names: list[str]) -> dict:
    """The plans of the `names` workflows; the slow reward model's check where both
    grpo and grpo_rm_task are among them."""
    cl = load_cluster(examples / "clusters" / f"{INVENTORY}.yaml")
    w = load_workload(examples / "workloads" / f"{WORKLOAD}.yaml")
    price = sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    budget = round(BUDGET_SHARE * price, 2)

    def plan(upd: dict) -> PlanResult:
        wv = Workload.model_validate(w.model_dump() | upd)
        return make_plan(cl, m, wv, budget=budget, time_limit_s=time_limit_s, baselines=False)

    out = {name: _summary(plan(WORKFLOWS[name])) for name in names}
    done = {"workflow_plans": out, "workflow_setting": f"{INVENTORY}, {WORKLOAD}, {m.name}, "
            f"${budget}/h, RM {RM_SHAPE}"}  # fmt: skip
    if not {"grpo", "grpo_rm_task"} <= set(names):
        return done
    pinned = plan({"tasks": [_task("rm", "reward_model", ["L4"])], "reward_model_shape": RM_SHAPE})
    moved = out["grpo_rm_task"]
    rm_rate = pinned.tasks[0].samples_per_s or 0.0
    ok = (
        pinned.plan.predicted.samples_per_s <= rm_rate + 1e-3
        and rm_rate < out["grpo"]["samples_per_s"]
        and moved["tasks"]["rm"]["kind"] != "L4"
        and moved["samples_per_s"] > pinned.plan.predicted.samples_per_s
    )
    return done | {
        "slow_reward_model": {"pinned_to_L4": _summary(pinned), "any_kind": moved},
        "slow_reward_model_ok": 1.0 if ok else 0.0,
    }
