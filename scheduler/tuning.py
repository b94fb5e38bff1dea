"""Tuning the staleness bound η (`max_staleness`) and the publish interval k
(`publish_every`) within the user's search bounds: one placed, replayed plan per pair."""

from __future__ import annotations

from areal_hex.config import ConfigError
from scheduler.cluster import Cluster
from scheduler.model_shape import ModelShape
from scheduler.planner import make_plan
from scheduler.profile import Profile
from scheduler.workload import Workload

SIM_SHORT = 0.05  # a tuning candidate whose replay falls this far short of a target loses


def tune_max_staleness_and_publish_every(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    *,
    search_max_staleness: int,
    search_publish_every: int,
    budget: float | None = None,
    target: float | None = None,
    prof: Profile | None = None,
    time_limit_s: float = 60.0,
) -> tuple[Workload, list[dict[str, float]]]:
    """The staleness bound η and publish interval k (each from the workload's value up to
    the user's bound, k ≤ η + 1 so the gate never holds the trainer before a publish)
    whose placed plan is fastest under a budget, or cheapest at a target; ties go to the
    smaller η, then the smaller k (fresher data). Each candidate is replayed through the
    buffer's simulator and ranked by the lower of its predicted and simulated rates: the
    closed form does not model the gate's publish cycle, which at k > 1 (and η = 1) can
    cost a fifth or more of the predicted rate. Returns the tuned workload and every
    candidate's figures."""
    tried: list[tuple[tuple[float, int, int], Workload, dict[str, float]]] = []
    for eta in range(w.max_staleness, max(w.max_staleness, search_max_staleness) + 1):
        for k in range(w.publish_every, max(w.publish_every, search_publish_every) + 1):
            if k > eta + 1:  # the gate would hold the trainer before its next publish
                continue
            cand = w.model_copy(update={"max_staleness": eta, "publish_every": k})
            try:
                res = make_plan(
                    cl,
                    m,
                    cand,
                    budget=budget,
                    target=target,
                    prof=prof,
                    time_limit_s=time_limit_s,
                    baselines=False,
                )
            except ConfigError:
                continue
            pred = res.plan.predicted
            sim = res.sim.samples_per_s if res.sim is not None else pred.samples_per_s
            row = {
                "max_staleness": eta,
                "publish_every": k,
                "samples_per_s": pred.samples_per_s,
                "simulated_samples_per_s": round(sim, 4),
                "cost_usd_per_h": pred.cost_usd_per_h,
            }
            if target is None:
                score = -min(sim, pred.samples_per_s)
            else:  # short of the target in the replay: after every candidate that meets it
                short = sim < target * (1 - SIM_SHORT)
                score = pred.cost_usd_per_h + (1e9 if short else 0.0)
            tried.append(((round(score, 6), eta, k), cand, row))
    if not tried:
        raise ConfigError(
            f"no feasible plan for staleness {w.max_staleness}..{search_max_staleness} and publish "
            f"interval {w.publish_every}..{search_publish_every}"
        )
    tried.sort(key=lambda t: t[0])
    return tried[0][1], [row for _, _, row in tried]
