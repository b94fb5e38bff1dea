"""The hybrid placement priced: the disaggregated split, plus servers lent by the trainer's
devices that generate only while the trainer waits for its batch.

Asynchronous, one trainer step of T s (training rate B/T) is a cycle: while the trainer
steps, the servers of their own make G_d·T samples; while it waits, every server makes
them, at G_d + G_l (G_l: the lent servers, priced as one more instance of the same kind
each); each step pauses and continues the lent servers once (`switch` s). When the servers
of their own keep up alone (G_d·T ≥ B) nothing is lent and the rate is the disaggregated
pipeline's; otherwise the trainer waits W = (B − G_d·T) / (G_d + G_l) a step, and

    rate = B / (T + W + switch).

Synchronous (η = 0): every server generates the batch, then the trainer steps on its
devices: the synchronous replay of the layout with every server in it, plus the switch.

`hybrid_rates` composes both from `predict.predict_layout`'s figures for the servers of
their own (asynchronous) and for all of them (synchronous), so a hybrid is held against
the same cost model as every other layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from areal_hex.plan import Plan
from scheduler.cluster import Cluster, machine_name
from scheduler.colocated import instances_on, on_trainer_gpus, switch_s
from scheduler.costmodel import RolloutOption
from scheduler.milp import PlanSpace, Solution
from scheduler.predict import LayoutPrediction, LayoutRates
from scheduler.profile import Profile
from scheduler.workload import Workload


def lent_asynchronous(
    own: LayoutRates, g_lent: float, samples_per_step: int, switch: float
) -> LayoutRates:
    """The asynchronous rates with lent servers generating `g_lent` samples/s beside the
    servers of their own (`own`: the layout of those alone), each step's lend costing
    `switch` s."""
    b, g_own = samples_per_step, own.generation_samples_per_s
    if own.training_samples_per_s <= 0 or g_own <= 0:
        return own
    step = b / own.training_samples_per_s  # T
    made = g_own * step  # of the next batch, while the trainer steps
    if made >= b:  # the servers of their own keep up: nothing to lend
        return own
    g_every = g_own + g_lent
    wait = (b - made) / g_every
    rate = b / (step + wait + switch)
    return replace(own, pipeline_samples_per_s=rate, generation_samples_per_s=g_every)


def hybrid_rates(
    own: LayoutPrediction,
    every: LayoutPrediction,
    own_servers: int,
    lent: int,
    samples_per_step: int,
    switch: float,
) -> LayoutPrediction:
    """Both modes of a hybrid layout: `own`, the layout of the servers of their own;
    `every`, the same with the lent servers in it; one switch of `switch` s a step."""
    syn = every.synchronous
    step = samples_per_step / max(syn.pipeline_samples_per_s, 1e-12)
    synchronous = replace(syn, pipeline_samples_per_s=samples_per_step / (step + switch))
    g_lent = own.asynchronous.generation_samples_per_s / max(1, own_servers) * lent
    asynchronous = lent_asynchronous(own.asynchronous, g_lent, samples_per_step, switch)
    return LayoutPrediction(asynchronous, synchronous)


@dataclass(frozen=True)
class Hybrid:
    samples_per_s: float
    generation_samples_per_s: float  # the instances of their own and the lent ones
    rollout: tuple[tuple[str, RolloutOption], ...]  # the lent ones' option per node group


def hybrid_pick(
    p: PlanSpace, w: Workload, sol: Solution, prof: Profile | None = None
) -> Hybrid | None:
    """The asynchronous plan `sol` as a hybrid: its trainer's GPUs also generate while it
    waits (one instance per TP-sized slice, as a colocated plan places them), each step
    one switch; None where the trainer's GPUs cannot generate (a trainer across kinds,
    or no rollout option tiles them)."""
    c = sol.trainer
    if c.mixed:
        return None
    g_lent, picks = on_trainer_gpus(p, c)
    if g_lent <= 0 or len(picks) < len(c.parts):
        return None
    own = LayoutRates(sol.rate, sol.gen_rate, sol.train_rate, 0.0)
    lent = lent_asynchronous(own, g_lent, w.samples_per_step, switch_s(w, prof, c.kind))
    return Hybrid(lent.pipeline_samples_per_s, lent.generation_samples_per_s, tuple(picks))


def best_hybrid(
    p: PlanSpace, w: Workload, sol: Solution, prof: Profile | None = None
) -> float | None:
    """`hybrid_pick`'s samples/s."""
    pick = hybrid_pick(p, w, sol, prof)
    return None if pick is None else pick.samples_per_s


def hybrid_plan(cl: Cluster, pick: Hybrid, names: dict[str, str], base: Plan) -> Plan | None:
    """`base` (the asynchronous plan) with the lent instances: one per TP-sized slice of
    each of its trainer's slots, after its own (`decisions.lent`), k = 1 (`names`:
    merged machine names as the inventory's, `cluster.merge_identical`); None where
    `base` tuned k above 1 (a hybrid follows the trainer's steps by each version) or a
    trainer machine is not the cluster's."""
    if base.decisions.publish_every not in (None, 1):
        return None
    machines = [
        (machine_name(g.name, i), g.name) for g in cl.spec.node_groups for i in range(g.nodes)
    ]
    group_of = {names.get(m, m): g for m, g in machines}
    if any(s.node not in group_of for s in base.trainer.placements):
        return None
    slots = [(group_of[s.node], s.node, list(s.gpu_ids)) for s in base.trainer.placements]
    n = len(base.rollout)
    lent = instances_on(cl, slots, pick.rollout, n)
    decisions = base.decisions.model_copy(
        update={"placement": "hybrid", "lent": list(range(n, n + len(lent))), "publish_every": 1}
    )
    predicted = base.predicted.model_copy(
        update={
            "samples_per_s": round(pick.samples_per_s, 4),
            "generation_samples_per_s": round(pick.generation_samples_per_s, 4),
        }
    )
    plan = base.model_copy(
        update={"rollout": [*base.rollout, *lent], "decisions": decisions, "predicted": predicted}
    )
    return Plan.model_validate(plan.model_dump())  # the whole plan checked again
