"""The hybrid placement priced: the disaggregated split, plus servers lent by the trainer's
devices that generate only while the trainer waits for its batch.

What a lent server makes and what lending costs follow the run (`scheduler/lending.py`):
G_lent, the lent servers' samples/s on the trainer's devices (beside the host's work where
it runs there), and `lend` s a lend: the switch and the lent servers' weight load, paid
when they start to generate (a lent server paused for the trainer is left out of the
weight updates and loads the version served as it continues).

Asynchronous, one trainer step of T' s (T, the disaggregated step, with the trainer's
heap trim where it gives its heap back) is a cycle: while the trainer steps, the servers
of their own make G_own·T' samples. Where that is the batch B nothing is lent and the
rate is B / T'. Otherwise the trainer waits for the S = B − G_own·T' samples left: the
lent servers load and continue (`lend` s, the servers of their own generating), and
their groups count from the end of the first one they take, F s later
(`lending.first_group_s`); from then on every server makes them at G_own + G_lent:

    W = (S + G_lent·(lend + F)) / (G_own + G_lent)     (S / G_own where G_own·(lend + F) ≥ S)
    rate = B / (T' + W).

Synchronous (η = 0): every server generates the batch (the lent ones at G_lent, each
taking whole groups as the dispatcher gives them, so a slow lent server can lengthen the
batch's tail), then the trainer steps on its devices: the synchronous replay of the layout
with every server in it (`predict.predict_layout(..., lent=n)`), plus one switch a step
(the lent servers' weight load is in the replay's idle update).

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
from scheduler.lending import first_group_s, heap_trim_s, lend_s
from scheduler.milp import PlanSpace, Solution
from scheduler.predict import LayoutPrediction, LayoutRates
from scheduler.profile import Profile
from scheduler.workload import Workload


def lent_asynchronous(
    own: LayoutRates,
    g_lent: float,
    samples_per_step: int,
    lend: float,
    trim: float = 0.0,
    first_group: float = 0.0,
) -> LayoutRates:
    """The asynchronous rates with lent servers generating `g_lent` samples/s while the
    trainer waits, beside the servers of their own (`own`: the layout of those alone):
    each trainer step `trim` s longer (its heap given back), each lend `lend` s (the
    lent servers' load and continue) before they generate, and their first group ending
    `first_group` s after that (what they make counts from then on)."""
    b, g_own = samples_per_step, own.generation_samples_per_s
    if own.training_samples_per_s <= 0 or g_own <= 0:
        return own
    step = b / own.training_samples_per_s + trim  # T'
    short = b - g_own * step  # of the next batch, once the trainer has stepped
    if short <= 0:
        return replace(own, pipeline_samples_per_s=b / step, training_samples_per_s=b / step)
    late = lend + first_group  # the lent servers' first samples toward the batch
    if g_own * late >= short:
        wait = short / g_own
    else:
        wait = (short + g_lent * late) / (g_own + g_lent)
    rate = b / (step + wait)
    # every server busy while it may generate: the servers' mean over their busy time
    return replace(
        own,
        pipeline_samples_per_s=rate,
        generation_samples_per_s=rate,
        training_samples_per_s=b / step,
    )


def hybrid_rates(
    own: LayoutPrediction,
    every: LayoutPrediction,
    samples_per_step: int,
    switch: float,
) -> LayoutPrediction:
    """Both modes of a hybrid layout: `own`, the layout of the servers of their own;
    `every`, the same with the lent servers in it (`predict_layout(..., lent=n)`: their
    rate, `lent_samples_per_s`, their first group's latency, `lent_first_group_s`, and
    the idle update they load at); one switch of `switch` s a step."""
    syn = every.synchronous
    step = samples_per_step / max(syn.pipeline_samples_per_s, 1e-12)
    synchronous = replace(syn, pipeline_samples_per_s=samples_per_step / (step + switch))
    lend = lend_s(switch, syn.weight_sync_s)
    asynchronous = lent_asynchronous(
        own.asynchronous,
        every.lent_samples_per_s,
        samples_per_step,
        lend,
        first_group=every.lent_first_group_s,
    )
    return LayoutPrediction(
        asynchronous, synchronous, every.lent_samples_per_s, every.lent_first_group_s
    )


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
    one lend (the switch and, where profiled, the lent instances' idle weight load and
    the trainer's heap trim, `lending.heap_trim_s`); None where the trainer's GPUs cannot
    generate (a trainer across kinds, or no rollout option tiles them)."""
    c = sol.trainer
    if c.mixed:
        return None
    g_lent, picks = on_trainer_gpus(p, c)
    if g_lent <= 0 or len(picks) < len(c.parts):
        return None
    own = LayoutRates(sol.rate, sol.gen_rate, sol.train_rate, 0.0)
    idle = (prof.reload_idle_s(c.kind) if prof is not None else None) or 0.0
    lend = lend_s(switch_s(w, prof, c.kind), idle)
    trim = heap_trim_s(prof, c.kind, c.compute_s)
    first = max(first_group_s(w, r) for _, r in picks)
    lent = lent_asynchronous(own, g_lent, w.samples_per_step, lend, trim, first)
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
