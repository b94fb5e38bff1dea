"""What a placed plan is worth and what holds it back, in the terms a user acts on.

binding: the resource the rate is stuck on: "training" (the trainer is the slower side),
"generation" (rollout instances are), refined to "weight sync" when publish pauses take
more than a sixth of the rollout instances' time, or "staleness gate" when the gate's
in-flight cap, not the GPUs, limits generation, or groups miss the staleness window
(`costmodel.window_fraction`) and are dropped. limits: further reasons the plan stops
where it does: "budget" (one more machine's price would buy a faster plan),
"inventory" (the GPUs of the binding pool's kinds are all in use).
homogeneous_ratio: the plan's rate over the best one-kind plan at the same budget.
cost_ratio: the cheapest one-kind plan that reaches the same rate, over this plan's cost
(None when no one-kind plan reaches it). recommended_mode: "synchronous" when the best
colocated synchronous plan at the same budget beats the asynchronous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.cluster import Cluster
from scheduler.costmodel import generation_at
from scheduler.milp import PlanSpace, solve
from scheduler.model_shape import ModelShape
from scheduler.placing import Placed, paused_items, placed

SYNC_SHARE_BINDS = 1 / 6  # pause share above which weight sync is named as the binding
WINDOW_LOSS_BINDS = 0.02  # share of generation lost to the staleness window that binds


@dataclass
class Assessment:
    binding: str
    limits: list[str] = field(default_factory=list)
    generation_utilisation: float = 0.0  # rate / generation capacity (pauses included)
    training_utilisation: float = 0.0  # rate / training rate
    homogeneous_ratio: float | None = None
    cost_ratio: float | None = None
    recommended_mode: str = "async"
    unspent_usd_per_h: float = 0.0
    one_kind_reason: str | None = None


def assess(
    cl: Cluster,
    m: ModelShape,
    p: PlanSpace,
    got: Placed,
    train_rate: float,
    budget: float | None,
    homo: dict[str, float],
    sync_rate: float,
    time_limit_s: float,
    cost_ratio: float | None = None,
) -> Assessment:
    sol, rate = got.solution, got.rate
    in_flight = sum(p.rollouts[i].batch * n for i, n in sol.replicas.items())
    # at the rates their links carry, with the pauses in effect at the placed rate
    items = paused_items(p.workload, got.placement, got.cost)
    capacity = sum(rc.samples_per_s for rc, _, _ in items)
    paused = generation_at(p.workload, items, rate, window=False)  # pauses, no window
    pause_share = 1 - paused / capacity if capacity > 0 else 0.0
    late = paused > 0 and got.gen_rate < paused * (1 - WINDOW_LOSS_BINDS)
    if train_rate <= got.gen_rate * (1 + 1e-6):
        binding = "training"
    elif late:
        binding = "staleness gate"
    elif pause_share > SYNC_SHARE_BINDS:
        binding = "weight sync"
    elif in_flight >= 0.98 * p.inflight:
        binding = "staleness gate"
    else:
        binding = "generation"
    out = Assessment(binding)
    out.generation_utilisation = round(rate / got.gen_rate, 4) if got.gen_rate else 0.0
    out.training_utilisation = round(rate / train_rate, 4) if train_rate else 0.0
    if budget is not None:
        out.unspent_usd_per_h = round(max(0.0, budget - sol.cost), 2)
        if _budget_binds(cl, m, p, got, budget, time_limit_s):
            out.limits.append("budget")
    if _pool_full(cl, p, got, binding):
        out.limits.append("inventory")
    best_homo = max(homo.values(), default=0.0)
    if best_homo > 0:
        out.homogeneous_ratio = round(rate / best_homo, 4)
    out.cost_ratio = cost_ratio
    out.one_kind_reason = one_kind_reason(cl, m, p, got)
    if sync_rate > rate:
        out.recommended_mode = "synchronous"
    return out


def one_kind_reason(cl: Cluster, m: ModelShape, p: PlanSpace, got: Placed) -> str | None:
    """Why a plan on one GPU kind leaves the inventory's other kinds out, in what a mix
    would need. Per kind left out, its best rollout instance's useful samples/s per $/h at
    the plan's rate (weight-sync pauses over its link and the staleness window included)
    against the plan's own instances': where the pauses take all its time, the link
    bandwidth or publish interval that would make it pay; where it is simply dearer per
    sample, the price that would; and, when training binds, the training it buys per $/h."""
    sol, rate = got.solution, got.rate
    used = set(sol.trainer.kinds) | {p.rollouts[i].kind for i in sol.replicas}
    if len(used) > 1 or rate <= 0 or not sol.replicas:
        return None
    w, c_idx = p.workload, sol.extra["trainer_index"]
    period = w.publish_every * w.samples_per_step / rate  # seconds between publishes

    def useful(r) -> float:  # samples/s per $/h at the plan's rate
        s = p.sync_s[(r.zone, c_idx)]
        return generation_at(w, [(r, s, 1)], rate) / r.usd_per_h

    mine = max(useful(p.rollouts[i]) for i in sol.replicas)
    mine_kind = next(iter(used))
    notes = []
    for kind in sorted({r.kind for r in p.rollouts} - used):
        r = max((r for r in p.rollouts if r.kind == kind), key=useful)
        s = p.sync_s[(r.zone, c_idx)]
        alone = r.samples_per_s / r.usd_per_h  # without pauses
        if alone <= mine:
            gpu = r.usd_per_h / r.tp
            notes.append(
                f"{kind} generates {alone:.3f} samples/s per $/h even without pauses, "
                f"against {mine:.3f} on {mine_kind} (it would pay below "
                f"${gpu * alone / mine:.2f}/GPU-h)"
            )
            continue
        need = 1 - mine / alone  # the pause share at which it would pay
        link = cl.link(sol.trainer.zones[0], r.zone)
        weights = 2.0 * m.params / 1e9  # bf16 GB
        bytes_ = w.constants.weight_sync_factor * weights  # the sync's calibrated cost
        room = need * period - link.latency_ms / 1e3  # seconds of pause it could afford
        want = f"a link of {bytes_ / room:.1f} GB/s" if room > 0 else "no pause at all"
        k = int(s * rate / (w.samples_per_step * need)) + 1 if need > 0 else None
        notes.append(
            f"{kind} instances would pause {s:.1f} s per weight publish ({weights:.1f} GB over "
            f"{link.bandwidth_gbs:g} GB/s, x{w.constants.weight_sync_factor:g} as measured) every "
            f"{period:.1f} s: {useful(r):.3f} samples/s "
            f"per $/h against {mine:.3f} on {mine_kind}; a mix would need at least {want}"
            + (f" or trainer.publish_every >= {k}" if k else "")
        )
    return "; ".join(notes) or None


def _budget_binds(
    cl: Cluster, m: ModelShape, p: PlanSpace, got: Placed, budget: float, time_limit_s: float
) -> bool:
    """One more machine's price buys a faster placed plan. Never while the budget left
    over buys a machine: the search tried spending it (any more instance, any trainer)."""
    machines = [g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups]
    if budget - got.solution.cost >= min(machines):
        return False
    more = solve(p, budget=budget + max(machines), time_limit_s=time_limit_s, cheapest=False)
    return more is not None and placed(cl, m, p.workload, p, more).rate > got.rate * 1.001


def _free_gpus(cl: Cluster, p: PlanSpace, got: Placed) -> dict[str, int]:
    used: dict[str, int] = {}
    for g, n in got.solution.trainer.parts:
        used[g] = used.get(g, 0) + n
    for i, n in got.solution.replicas.items():
        r = p.rollouts[i]
        used[r.group] = used.get(r.group, 0) + n * r.tp
    return {g.name: g.nodes * g.gpus_per_node - used.get(g.name, 0) for g in cl.spec.node_groups}


def _pool_full(cl: Cluster, p: PlanSpace, got: Placed, binding: str) -> bool:
    """No free GPU of a kind that could serve the binding side."""
    free = _free_gpus(cl, p, got)
    if binding == "training":
        kinds = set(got.solution.trainer.kinds)  # a trainer across kinds grows by any
        return all(free[g.name] == 0 for g in cl.spec.node_groups if cl.kinds[g.name].name in kinds)
    groups = {r.group for r in p.rollouts}
    return all(free[g] == 0 for g in groups)
