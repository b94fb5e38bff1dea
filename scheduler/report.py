"""The readable table of a plan, and the budget sweep."""

from __future__ import annotations

from collections import Counter

from areal_hex.config import ConfigError
from scheduler.cluster import Cluster
from scheduler.costmodel import TrainerOption
from scheduler.model_shape import ModelShape
from scheduler.planner import PlanResult, cheapest_cost, make_plan, synchronous_rate
from scheduler.profile import Profile
from scheduler.workload import Workload

SIM_GAP_WARN = 0.05  # |simulated - predicted| / predicted the table calls out


def _mixed_ranks(c: TrainerOption) -> str:
    """'16 H800 at 0.113 + 8 H20 at 0.022 samples/s each' for a trainer across kinds."""
    ranks: dict[str, tuple[int, float]] = {}
    for (_, n), kind, speed in zip(c.parts, c.part_kinds, c.part_speeds, strict=True):
        ranks[kind] = (ranks.get(kind, (0, speed))[0] + n, speed)
    each = " + ".join(f"{n} {kind} at {speed:.3g}" for kind, (n, speed) in ranks.items())
    return f"{each} samples/s each"


def table(res: PlanResult, sweep: list[dict[str, float]] | None = None) -> str:
    plan, sol = res.plan, res.solution
    lines = [f"plan for {plan.model} on {plan.cluster} ({plan.objective})", ""]
    if plan.decisions.placement == "colocated":
        t = plan.trainer
        lines += [
            f"colocated synchronous: {len(plan.rollout)} generation instance(s) on the "
            f"trainer's {t.world_size} {t.gpu_kind} GPU(s), ZeRO-{t.zero_stage}, in turn; "
            "the pools below are the best disaggregated plan's",
            "",
        ]
    if plan.decisions.placement == "hybrid":
        lines += [
            f"hybrid: {len(plan.decisions.lent)} generation instance(s) lent by the "
            "trainer's GPUs (generating while it waits for its batch) beside the pools below",
            "",
        ]
    hdr = f"{'pool':<9}{'GPU':<11}{'zone':<11}{'count':>6}{'GPUs':>6}  {'parallelism':<22}"
    hdr += f"{'samples/s':>10}{'$/h':>9}"
    lines += [hdr, "-" * len(hdr)]
    c = sol.trainer
    zones = "+".join(c.zones)
    lines.append(
        f"{'train':<9}{c.kind:<11}{zones:<11}{1:>6}{c.dp:>6}  "
        f"{f'DP {c.dp}, ZeRO-{c.zero}':<22}{c.samples_per_s:>10.3f}{c.usd_per_h:>9.2f}"
    )
    if c.mixed:
        lines.append(f"{'':<9}ranks: {_mixed_ranks(c)}, shares by speed")
    counts = Counter(sol.replicas)
    for i, n in sorted(counts.items(), key=lambda kv: -res.problem.rollouts[kv[0]].tp):
        r = res.problem.rollouts[i]
        par = f"TP {r.tp}, batch {r.batch}"
        lines.append(
            f"{'rollout':<9}{r.kind:<11}{r.zone:<11}{n:>6}{n * r.tp:>6}  {par:<22}"
            f"{n * r.samples_per_s:>10.3f}{n * r.usd_per_h:>9.2f}"
        )
    lines += _task_rows(res)
    p = plan.predicted
    colocated = plan.decisions.placement == "colocated"
    scored = "".join(
        f", task {t.task} {t.samples_per_s:.3f}"
        for t in res.tasks
        if t.role != "critic" and t.samples_per_s is not None
    )
    how = (
        f"one batch at generation {p.generation_samples_per_s:.3f}, a context switch, a step "
        f"at training {p.training_samples_per_s:.3f}, in turn"
        + (f"; tasks bound it: min(that{scored})" if scored else "")
        if colocated
        else f"min(generation {p.generation_samples_per_s:.3f} incl. weight-sync pauses, "
        f"training {p.training_samples_per_s:.3f}{scored})"
    )
    lines += [
        "",
        f"predicted: {p.samples_per_s:.3f} samples/s = {how}; ${p.cost_usd_per_h:.2f}/h; "
        f"weight sync up to {p.weight_sync_s:.1f} s",
    ]
    b = plan.baselines
    if b is not None:
        homo = f"{b.homogeneous_samples_per_s:.3f} ({b.homogeneous_gpu_kind})"
        lines.append(
            f"baselines at the same budget: best homogeneous {homo}, best "
            f"synchronous {b.synchronous_samples_per_s:.3f}"
        )
        if b.simulated_samples_per_s is not None:
            sim = res.sim
            idle = (
                f", {sim.groups_dropped_stale} groups dropped as stale, trainer idle "
                f"{sim.trainer_idle_frac:.0%}, rollout busy {sim.rollout_busy_frac:.0%}"
                if sim is not None
                else ""
            )
            # the simulation replays the disaggregated plan (the pools above)
            pred = b.disaggregated_samples_per_s if colocated else plan.predicted.samples_per_s
            pred = pred or 0.0
            off = (b.simulated_samples_per_s - pred) / pred if pred > 0 else 0.0
            gap = (
                f" ({off:+.0%} against the prediction: expect the simulated rate; the "
                "closed form does not model the gate's publish cycle at this staleness "
                "and publish interval)"
                if abs(off) > SIM_GAP_WARN
                else ""
            )
            lines.append(
                ("disaggregated plan " if colocated else "")
                + f"simulated: {b.simulated_samples_per_s:.3f} samples/s, max staleness "
                f"{b.simulated_max_version_lag}{idle}{gap}"
            )
        if b.first_fit_samples_per_s is not None:
            sim_ff = b.simulated_first_fit_samples_per_s
            lines.append(
                f"placement on the racks: METIS {p.samples_per_s:.3f} samples/s vs first-fit "
                f"{b.first_fit_samples_per_s:.3f}"
                + (
                    f" (simulated {b.simulated_samples_per_s:.3f} vs {sim_ff:.3f})"
                    if sim_ff
                    else ""
                )
                + f"; unplaced {b.unplaced_samples_per_s:.3f}"
            )
        if b.binding is not None:
            lines.append(_verdict(b, plan.decisions.placement))
        search, n = "", b.local_search_moves
        if n and b.milp_pick_samples_per_s:
            faster = plan.predicted.samples_per_s > b.milp_pick_samples_per_s * (1 + 1e-4)
            what = (
                f"{b.milp_pick_samples_per_s:.3f} -> {plan.predicted.samples_per_s:.3f} samples/s"
                if plan.target_samples_per_s is None and faster
                else "a cheaper mix at the rate"
            )
            search = f"; local search from its pick: {n} move{'s' * (n > 1)}, {what}"
        lines.append(f"MILP: {b.solve_s:.2f} s, gap {b.mip_gap:g}{search}")
    if sweep:
        lines += ["", f"{'budget $/h':>11}{'hetero':>9}{'homog.':>9}{'sync':>9}{'cost':>9}"]
        for s in sweep:
            lines.append(
                f"{s['budget_usd_per_h']:>11.2f}{s['samples_per_s']:>9.3f}"
                f"{s['homogeneous_samples_per_s']:>9.3f}{s['synchronous_samples_per_s']:>9.3f}"
                f"{s['cost_usd_per_h']:>9.2f}"
            )
    return "\n".join(lines)


def _task_rows(res: PlanResult) -> list[str]:
    """One row per task beyond generate and train (the critic: inside the train pool),
    each with the reason for its kind underneath."""
    out = []
    for t in res.tasks:
        count = "-" if t.role == "critic" else str(t.instances)
        gpus = t.gpus if t.role == "critic" else t.instances * t.gpus
        rate = "-" if t.samples_per_s is None else f"{t.samples_per_s:.3f}"
        what = f"{t.task} ({t.role})" if t.role != t.task else f"{t.task} (in train)"
        out.append(
            f"{'task':<9}{t.kind or 'CPU':<11}{t.zone or '-':<11}{count:>6}{gpus:>6}  "
            f"{what:<22}{rate:>10}{t.usd_per_h:>9.2f}"
        )
        out.append(f"{'':<9}{t.task}: {t.reason}")
    return out


def _verdict(b, placement: str) -> str:
    parts = [f"binding: {b.binding}" + (f" (also {', '.join(b.limits)})" if b.limits else "")]
    parts.append(
        f"utilisation: generation {b.generation_utilisation:.0%}, "
        f"training {b.training_utilisation:.0%}"
    )
    if b.homogeneous_ratio is not None:
        parts.append(f"{b.homogeneous_ratio:.2f}x the best one-kind plan")
    if b.cost_ratio is not None:
        parts.append(f"a one-kind plan at this rate costs {b.cost_ratio:.2f}x")
    elif b.homogeneous_ratio is not None:
        parts.append("no one-kind plan reaches this rate")
    if b.unspent_usd_per_h:
        parts.append(
            f"${b.unspent_usd_per_h:.2f}/h unspent (no instance or trainer change it buys "
            "raises the rate)"
        )
    line = "; ".join(parts)
    if b.one_kind_reason:
        line += f"\none kind only: {b.one_kind_reason}"
    dis = b.disaggregated_samples_per_s
    if dis is not None:
        hyb = (
            "" if b.hybrid_samples_per_s is None else f", hybrid async {b.hybrid_samples_per_s:.3f}"
        )
        line += (
            f"\nbest of each placement: colocated sync {b.synchronous_samples_per_s:.3f}, "
            f"disaggregated async {dis:.3f}{hyb} samples/s; picked "
            f"{placement} (`areal-hex run --plan` and `deploy` carry it out)"
        )
    elif b.recommended_mode == "synchronous":
        line += (
            f"\nrecommended: synchronous colocated training ({b.synchronous_samples_per_s:.3f} "
            f"samples/s beats this asynchronous plan; `areal-hex run --mode sync`)"
        )
    return line


def sweep_budgets(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    res: PlanResult,
    prof: Profile | None,
    time_limit_s: float,
    points: int = 8,
) -> list[dict[str, float]]:
    """The plan's rate from the cheapest feasible plan to the whole cluster's price: at
    each budget the plan `make_plan` makes (searched and placed, the homogeneous plans
    its candidates), so a row never shows the mix below its one-kind baseline."""
    p = res.problem
    low = cheapest_cost(p, time_limit_s) or 0.0
    high = sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    out = []
    for k in range(points):
        budget = low + (high - low) * k / max(1, points - 1)
        row = {"budget_usd_per_h": round(budget, 2)}
        try:
            got = make_plan(
                cl, m, w, budget=budget, prof=prof, time_limit_s=time_limit_s, simulate_plan=False
            )
        except ConfigError:  # nothing asynchronous generates at this budget
            row |= {"samples_per_s": 0.0, "cost_usd_per_h": 0.0}
            row |= {"homogeneous_samples_per_s": 0.0}
            row["synchronous_samples_per_s"] = round(synchronous_rate(p, w, budget), 4)
        else:
            pl = got.plan
            row |= {
                "samples_per_s": pl.predicted.samples_per_s,
                "cost_usd_per_h": pl.predicted.cost_usd_per_h,
                "homogeneous_samples_per_s": pl.baselines.homogeneous_samples_per_s,
                "synchronous_samples_per_s": pl.baselines.synchronous_samples_per_s,
            }
        out.append(row)
    return out
