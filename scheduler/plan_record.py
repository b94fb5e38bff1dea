"""`to_plan`: a placed plan, its replay and its baselines as the `Plan` record that
`plan.yaml` holds (`areal_hex/plan.py`), in the inventory's machine names."""

from __future__ import annotations

from areal_hex.plan import (
    Baselines,
    Decisions,
    DeviceSlot,
    InferenceInstance,
    Plan,
    Prediction,
    TrainerPlacement,
)
from scheduler.assess import Assessment
from scheduler.cluster import Cluster
from scheduler.costmodel import RolloutOption, TrainerOption
from scheduler.model_shape import ModelShape
from scheduler.partition import Placement, node_names
from scheduler.placing import Placed
from scheduler.simulator import SimResult
from scheduler.workload import Workload


def _mixed_trainer(
    cl: Cluster, c: TrainerOption, pl: Placement, toks: int
) -> dict[str, list[str] | list[float]]:
    """A trainer across kinds: each placement's GPU kind and each rank's planned training
    tokens/s (the shares `trainer.rank_speeds` gives the ranks)."""
    group_of = {name: g.name for g in cl.spec.node_groups for name in node_names(g)}
    speed = dict(zip(c.part_kinds, c.part_speeds, strict=True))
    kinds = [cl.kinds[group_of[node]].name for node, _ in pl.trainer]
    ranks = [
        round(speed[kind] * toks, 2)
        for kind, (_, ids) in zip(kinds, pl.trainer, strict=True)
        for _ in ids
    ]
    return {"gpu_kinds": kinds, "rank_speeds": ranks}


def rollout_instance(
    cl: Cluster, rc: RolloutOption, n: int, node: str, ids: list[int]
) -> InferenceInstance:
    """The `n`-th generation instance of `rc`'s kind, on GPUs `ids` of machine `node`."""
    return InferenceInstance(
        id=f"rollout-{rc.kind.lower()}-{n}",
        gpu_kind=rc.kind,
        tp=rc.tp,
        zone=rc.zone,
        region=cl.zone_of[rc.zone].region,
        placement=DeviceSlot(node=node, gpu_ids=ids),
        predicted_tokens_per_s=round(rc.tokens_per_s, 2),
        batch=rc.batch,
    )


def to_plan(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    best: Placed,
    budget: float | None,
    target: float | None,
    model_label: str | None,
    sim: SimResult | None,
    homo: dict[str, float],
    sync: float,
    ff: Placed | None = None,
    ff_sim: SimResult | None = None,
    verdict: Assessment | None = None,
) -> Plan:
    sol, pl = best.solution, best.placement
    counters: dict[str, int] = {}
    rollout = []
    for rc, node, ids in pl.rollout:
        n = counters[rc.kind] = counters.get(rc.kind, -1) + 1
        rollout.append(rollout_instance(cl, rc, n, node, ids))
    c = sol.trainer
    toks = w.prompt_tokens + w.response_tokens
    trainer = TrainerPlacement(
        gpu_kind=c.kind,
        world_size=c.dp,
        dp=c.dp,
        tp=1,
        zero_stage=c.zero,
        placements=[DeviceSlot(node=n, gpu_ids=ids) for n, ids in pl.trainer],
        predicted_tokens_per_s=round(c.samples_per_s * toks, 2),
        **(_mixed_trainer(cl, c, pl, toks) if c.mixed else {}),
    )
    best_homo = max(homo.items(), key=lambda kv: kv[1], default=(None, 0.0))
    return Plan(
        cluster=cl.name,
        model=model_label or m.name,
        objective="throughput" if target is None else "cost",
        budget_usd_per_h=budget,
        target_samples_per_s=target,
        rollout=rollout,
        trainer=trainer,
        decisions=Decisions(
            max_staleness=w.max_staleness,
            publish_every=w.publish_every,
            weight_sync=w.weight_sync,
        ),
        predicted=Prediction(
            samples_per_s=round(best.rate, 4),
            generation_samples_per_s=round(best.gen_rate, 4),
            training_samples_per_s=round(w.samples_per_step / best.cost.train_step_s, 4),
            weight_sync_s=round(max(best.cost.sync_s, default=0.0), 3),
            cost_usd_per_h=round(sol.cost, 2),
        ),
        baselines=Baselines(
            homogeneous_gpu_kind=best_homo[0],
            homogeneous_samples_per_s=round(best_homo[1], 4),
            synchronous_samples_per_s=round(sync, 4),
            simulated_samples_per_s=None if sim is None else round(sim.samples_per_s, 4),
            simulated_max_version_lag=None if sim is None else sim.max_version_lag,
            mip_gap=sol.gap,
            solve_s=round(sol.solve_s, 3),
            milp_samples_per_s=round(sol.rate, 4),
            unplaced_samples_per_s=round(sol.eval_rate, 4),
            placement=pl.method,
            first_fit_samples_per_s=None if ff is None else round(ff.rate, 4),
            simulated_first_fit_samples_per_s=(
                None if ff_sim is None else round(ff_sim.samples_per_s, 4)
            ),
            **({} if verdict is None else verdict.__dict__),
        ),
    )
