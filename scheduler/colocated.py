"""The colocated synchronous plan: every GPU of the trainer also generates, in turn.

A step (η = 0, k = 1) is: generation of B·G samples by every trainer GPU, at the rate of
the best rollout option that fits the trainer's GPUs of each machine (down to the
longest answer's decode), then one context switch (the servers release their memory,
the trainer takes the devices, and back: `CostConstants.context_switch_s`), then the
training step. `best_colocated` searches the same trainer configurations as the
asynchronous plan by that estimate; `replayed` prices its pick as a run of its layout is
priced (`predict.predict_layout`, synchronous: the batch generated as a synchronous step
fills the instances, the idle weight load, the synchronous trainer step, the profile's
cycle factor; plus the switch), so the plan records what the run is held against;
`colocated_plan` writes the pick as a `Plan` whose generation instances sit on the
trainer's GPUs (`decisions.placement: colocated`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from areal_hex.plan import Decisions, DeviceSlot, InferenceInstance, Plan, TrainerPlacement
from scheduler.cluster import Cluster, machine_name
from scheduler.costmodel import RolloutOption, TrainerOption
from scheduler.milp import PlanSpace
from scheduler.model_shape import ModelShape
from scheduler.partition import trainer_shape
from scheduler.plan_record import rollout_instance
from scheduler.predict import LayoutError, LayoutNodes, TrainerLayout, predict_layout
from scheduler.profile import Profile
from scheduler.workload import Workload


@dataclass(frozen=True)
class Colocated:
    samples_per_s: float
    generation_samples_per_s: float  # every trainer GPU generating
    trainer: TrainerOption
    rollout: tuple[tuple[str, RolloutOption], ...]  # (node group, option) per trainer part
    switch_s: float  # per step
    training_samples_per_s: float  # the trainer's steps alone


def switch_s(w: Workload, prof: Profile | None, kind: str) -> float:
    """Seconds of one context switch on `kind`: as profiled, else the workload's
    documented default (`constants.context_switch_s`)."""
    measured = prof.context_switch_s(kind) if prof is not None else None
    return w.constants.context_switch_s if measured is None else measured


def on_trainer_gpus(
    p: PlanSpace, c: TrainerOption
) -> tuple[float, list[tuple[str, RolloutOption]]]:
    """(samples/s, the option per node group): generation by the trainer's GPUs, each
    node group's best rollout option per GPU that tiles its machines' trainer GPUs."""
    gen, picks = 0.0, []
    for g, n in c.parts:
        fit = [
            r for r in p.rollouts if r.group == g and r.tp <= c.per_node and c.per_node % r.tp == 0
        ]
        if fit:
            r = max(fit, key=lambda r: r.samples_per_s / r.tp)
            gen += n // r.tp * r.samples_per_s
            picks.append((g, r))
    return gen, picks


def best_colocated(
    p: PlanSpace, w: Workload, budget: float, prof: Profile | None = None
) -> Colocated | None:
    """The fastest colocated synchronous plan within `budget` ($/h); None if none
    generates. `prof`: the switch's cost per kind, where profiled."""
    best: Colocated | None = None
    longest = min(w.max_response_tokens, int(1.5 * w.response_tokens))
    for c in p.trainers:
        if c.usd_per_h > budget or c.mixed:  # a trainer across kinds: disaggregated only
            continue
        gen, picks = on_trainer_gpus(p, c)
        if gen <= 0 or len(picks) < len(c.parts):
            continue
        tail = max(longest * r.step_s for _, r in picks)
        switch = switch_s(w, prof, c.kind)
        step = max(w.samples_per_step / gen, tail) + switch + c.step_s
        rate = w.samples_per_step / step
        if best is None or rate > best.samples_per_s:
            best = Colocated(rate, gen, c, tuple(picks), switch, w.samples_per_step / c.step_s)
    return best


def replayed(
    cl: Cluster, m: ModelShape, w: Workload, prof: Profile | None, pick: Colocated
) -> Colocated | None:
    """`pick` at the rates its run is predicted at (`hexctl/job/predict.py`): its layout
    (one instance per TP-sized slice of each trainer machine's GPUs, the trainer's ranks
    there) priced by `predict.predict_layout` in the synchronous mode, with each phase's
    rates on every core where profiled, plus one switch a step. None where the layout
    does not fit."""
    c, option = pick.trainer, dict(pick.rollout)
    slots = trainer_slots(cl, c, {})
    instances: list[tuple[str, int]] = []
    machines: list[str] = []
    for group, node, ids in slots:
        for _ in range(0, len(ids), option[group].tp):
            instances.append((group, option[group].tp))
            machines.append(node)
    every = prof.on_every_core() if prof is not None else None
    run_w = w.model_copy(update={"max_staleness": 0, "publish_every": 1})  # as it runs
    try:
        syn = predict_layout(
            cl, m, run_w, every, instances, TrainerLayout(c.parts, c.per_node),
            nodes=LayoutNodes(slots[0][1], tuple(machines)),
        ).synchronous  # fmt: skip
    except LayoutError:
        return None
    step = w.samples_per_step / max(syn.pipeline_samples_per_s, 1e-12) + pick.switch_s
    return replace(
        pick,
        samples_per_s=w.samples_per_step / step,
        generation_samples_per_s=syn.generation_samples_per_s,
        training_samples_per_s=syn.training_samples_per_s,
    )


def trainer_slots(
    cl: Cluster, c: TrainerOption, names: dict[str, str]
) -> list[tuple[str, str, list[int]]]:
    """(node group, machine, GPU ids) of the trainer's ranks, first-fit on its node
    groups' machines (`names`: merged machine names as the inventory's)."""
    used: dict[str, int] = {}
    slots: list[tuple[str, str, list[int]]] = []
    for group, k in trainer_shape(cl, c):
        i = used[group] = used.get(group, -1) + 1
        node = machine_name(group, i)
        slots.append((group, names.get(node, node), list(range(k))))
    return slots


def instances_on(
    cl: Cluster,
    slots: list[tuple[str, str, list[int]]],
    options: tuple[tuple[str, RolloutOption], ...],
    first: int,
) -> list[InferenceInstance]:
    """One generation instance per TP-sized slice of every slot's GPUs, of its node
    group's option; numbered from `first`."""
    option = dict(options)
    out: list[InferenceInstance] = []
    for group, node, ids in slots:
        r = option[group]
        for lo in range(0, len(ids), r.tp):
            out.append(rollout_instance(cl, r, first + len(out), node, ids[lo : lo + r.tp]))
    return out


def colocated_plan(
    cl: Cluster, w: Workload, pick: Colocated, names: dict[str, str], base: Plan
) -> Plan:
    """`base` (the asynchronous plan, for its identity and baselines) with the colocated
    pick's pools: the trainer's ranks first-fit on its node groups' machines, and one
    generation instance per TP-sized slice of every trainer machine's GPUs. `names`:
    merged machine names as the inventory's (`cluster.merge_identical`)."""
    c = pick.trainer
    slots = trainer_slots(cl, c, names)
    toks = w.prompt_tokens + w.response_tokens
    rollout = instances_on(cl, slots, pick.rollout, 0)
    trainer = TrainerPlacement(
        gpu_kind=c.kind,
        world_size=c.dp,
        dp=c.dp,
        zero_stage=c.zero,
        placements=[DeviceSlot(node=node, gpu_ids=ids) for _, node, ids in slots],
        predicted_tokens_per_s=round(c.samples_per_s * toks, 2),
    )
    predicted = base.predicted.model_copy(
        update={
            "samples_per_s": round(pick.samples_per_s, 4),
            "generation_samples_per_s": round(pick.generation_samples_per_s, 4),
            "training_samples_per_s": round(pick.training_samples_per_s, 4),
            "cost_usd_per_h": round(c.usd_per_h, 2),
        }
    )
    decisions = Decisions(
        placement="colocated",
        max_staleness=0,
        publish_every=1,
        weight_sync=base.decisions.weight_sync,
        tasks=base.decisions.tasks,
    )
    return base.model_copy(
        update={
            "rollout": rollout,
            "trainer": trainer,
            "decisions": decisions,
            "predicted": predicted,
        }
    )
