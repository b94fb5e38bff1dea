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

from dataclasses import replace

from scheduler.colocated import on_trainer_gpus, switch_s
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


def best_hybrid(
    p: PlanSpace, w: Workload, sol: Solution, prof: Profile | None = None
) -> float | None:
    """The asynchronous plan `sol` as a hybrid: its trainer's GPUs also generate while it
    waits (one instance per TP-sized slice, as a colocated plan places them), each step
    one switch; samples/s, None where the trainer's GPUs cannot generate (a trainer
    across kinds, or no rollout option tiles them)."""
    c = sol.trainer
    if c.mixed:
        return None
    g_lent, picks = on_trainer_gpus(p, c)
    if g_lent <= 0 or len(picks) < len(c.parts):
        return None
    own = LayoutRates(sol.rate, sol.gen_rate, sol.train_rate, 0.0)
    lent = lent_asynchronous(own, g_lent, w.samples_per_step, switch_s(w, prof, c.kind))
    return lent.pipeline_samples_per_s
