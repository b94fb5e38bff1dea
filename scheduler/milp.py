"""Phase 1: a PuLP MILP, solved by CBC, choosing the rollout and trainer mix.

Variables: y_ψ ∈ Z≥0 replicas of rollout configuration ψ = (node group, TP) with rate
h_ψ; x_c ∈ {0,1} for trainer configuration c with rate t_c (Σ x_c = 1); R ≥ 0.
    max R                      (or min cost with R = target)
    R ≤ Σ_c x_c t_c                                        (training)
    R ≤ Σ_z (1 - f_zc) G_z + M (1 - x_c)       for every c  (generation, with sync pauses)
    G_z = Σ_{ψ in zone z} y_ψ h_ψ
    Σ_{ψ∈g, tp_ψ ≥ t} tp_ψ y_ψ + Σ_c lost_cgt x_c ≤ GPUs_g   for every group g, TP size t
    Σ_ψ y_ψ $_ψ + Σ_c x_c $_c ≤ budget
    Σ_ψ y_ψ batch_ψ ≤ η·B·G                                  (staleness gate's in-flight cap)
f_zc is the share of time a rollout instance in zone z pauses for weight syncs when the
trainer publishes every k of its steps; lost_cgt counts the t-GPU blocks c takes from g
(whole machines or part of one), which makes the block constraints an exact packing test
for power-of-two TP sizes inside machines.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pulp

from areal_hex.config import ConfigError
from scheduler.cluster import Cluster
from scheduler.costmodel import RolloutOption, TrainerOption, inflight_cap, pipeline_rate
from scheduler.model_shape import ModelShape
from scheduler.sync_cost import weight_sync_s
from scheduler.workload import Workload


class SolveTimeout(ConfigError):
    """CBC hit its time limit before finding any integer solution (a usage error: the
    CLI prints it and exits 2)."""


@dataclass
class PlanSpace:
    """Everything the MILP (and the exhaustive check) needs, with the cluster folded in."""

    rollouts: list[RolloutOption]
    trainers: list[TrainerOption]
    pause: dict[tuple[str, int], float]  # (zone, trainer index) -> f_zc
    gpus: dict[str, int]  # node group -> GPUs
    gpn: dict[str, int]  # node group -> GPUs per node
    tps: dict[str, list[int]]  # node group -> TP sizes in use
    inflight: int  # requests the staleness gate admits at once (Σ y_ψ·batch_ψ ≤ this)
    sync_s: dict[tuple[str, int], float]  # (zone, trainer index) -> pause per publish, s
    workload: Workload  # for the staleness window (`costmodel.window_fraction`)


@dataclass
class Solution:
    rate: float
    gen_rate: float
    train_rate: float
    cost: float
    trainer: TrainerOption
    replicas: dict[int, int]  # rollout index -> count
    status: str
    gap: float
    solve_s: float
    extra: dict[str, float] = field(default_factory=dict)
    eval_rate: float = 0.0  # `evaluate`: pauses at the rate reached (≥ rate)
    eval_gen_rate: float = 0.0


def build_problem(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    rollouts: list[RolloutOption],
    trainers: list[TrainerOption],
) -> PlanSpace:
    zones = sorted({r.zone for r in rollouts})
    pause: dict[tuple[str, int], float] = {}
    sync: dict[tuple[str, int], float] = {}
    # The pause share at rate R is s·R/(kBG). Charged at an upper bound of R, the MILP's
    # rate stays a lower bound of the exact one. R is at most the trainer's rate, and at
    # most what every GPU of the inventory C could generate with the pauses of the zone
    # that pauses least, less the longest overlap of a pause with generation:
    # R ≤ C·(1 − a·R), a = s_min/(kBG), so R ≤ C/(1 + a·C). The
    # smaller bound keeps a fast trainer's publish period off slow rollouts.
    ceiling = _generation_ceiling(cl, rollouts)
    publish = w.publish_every * w.samples_per_step
    overlap = max((r.pause_overlap_s for r in rollouts), default=0.0)  # pauses least
    for i, c in enumerate(trainers):
        for z in zones:
            sync[(z, i)] = max(weight_sync_s(cl, m, w, c.zones[0], z), c.broadcast_s)
        a = min((max(0.0, sync[(z, i)] - overlap) for z in zones), default=0.0) / publish
        bound = min(c.samples_per_s, ceiling / (1 + a * ceiling))
        for z in zones:
            pause[(z, i)] = min(1.0, sync[(z, i)] * bound / publish)
    groups = cl.spec.node_groups
    tps = {g.name: sorted({r.tp for r in rollouts if r.group == g.name}) for g in groups}
    return PlanSpace(
        rollouts,
        trainers,
        pause,
        {g.name: g.nodes * g.gpus_per_node for g in groups},
        {g.name: g.gpus_per_node for g in groups},
        tps,
        inflight_cap(w),
        sync,
        w,
    )


def _generation_ceiling(cl: Cluster, rollouts: list[RolloutOption]) -> float:
    """Samples/s if every GPU generated at its group's best rate per GPU."""
    best: dict[str, float] = {}
    for r in rollouts:
        best[r.group] = max(best.get(r.group, 0.0), r.samples_per_s / r.tp)
    return sum(best.get(g.name, 0.0) * g.nodes * g.gpus_per_node for g in cl.spec.node_groups)


def lost_blocks(c: TrainerOption, group: str, gpn: int, t: int) -> int:
    """GPUs' worth of t-sized blocks trainer c makes unusable in `group`: whole machines,
    or on each of its m machines the blocks its p ranks break."""
    n = sum(k for g, k in c.parts if g == group)
    if n == 0 or c.per_node == gpn:
        return n
    machines = n // c.per_node
    return machines * t * (gpn // t - (gpn - c.per_node) // t)


def _paused(p: PlanSpace, zone: str, overlap_s: float, c_idx: int) -> float:
    """The share of time an instance in `zone` that generates through `overlap_s` of
    each pause loses to trainer c's weight syncs (the pause share, charged at the
    MILP's bound of the rate, for the part of the pause that does not generate)."""
    sync = p.sync_s[(zone, c_idx)]
    if sync <= 0:
        return 0.0
    return p.pause[(zone, c_idx)] * max(0.0, sync - overlap_s) / sync


def gen_rate(p: PlanSpace, c_idx: int, y: dict[int, int]) -> float:
    return sum(
        n
        * p.rollouts[i].samples_per_s
        * (1 - _paused(p, p.rollouts[i].zone, p.rollouts[i].pause_overlap_s, c_idx))
        for i, n in y.items()
    )


def evaluate(p: PlanSpace, c_idx: int, y: dict[int, int]) -> tuple[float, float]:
    """(rate, useful generation rate) of a fixed plan: `costmodel.pipeline_rate`, with the
    pauses charged at the rate reached and the groups that miss the staleness window left
    out. The MILP charges the pauses at an upper bound of the rate and does not see the
    window; this is the exact figure.
    """
    c = p.trainers[c_idx]
    items = [(p.rollouts[i], p.sync_s[(p.rollouts[i].zone, c_idx)], n) for i, n in y.items()]
    return pipeline_rate(p.workload, c.samples_per_s, items)


def solve(
    p: PlanSpace,
    budget: float | None = None,
    target: float | None = None,
    time_limit_s: float = 60.0,
    allowed_kinds: set[str] | None = None,
    cheapest: bool = True,
    max_nodes: int | None = None,
) -> Solution | None:
    """max R under `budget`, or min cost with R ≥ `target`. None when infeasible. With
    `cheapest` (max R only), a second solve picks the cheapest plan at that rate;
    `max_nodes` caps a max-R solve's branch and bound (a seed, not a proof)."""
    t0 = time.perf_counter()
    ris = [i for i, r in enumerate(p.rollouts) if allowed_kinds is None or r.kind in allowed_kinds]
    cis = [
        i
        for i, c in enumerate(p.trainers)
        if allowed_kinds is None or set(c.kinds) <= allowed_kinds  # every kind it spans
    ]
    if not ris or not cis:
        return None
    prob, y, x, R, cost = _model(p, ris, cis, budget, target)
    prob.sense = pulp.LpMaximize if target is None else pulp.LpMinimize
    prob.setObjective(R if target is None else cost)
    status, gap = _run_cbc(prob, time_limit_s, COST_NODES if target is not None else max_nodes)
    if status == "timeout":
        raise SolveTimeout(
            f"CBC found no feasible plan within the {time_limit_s:g} s time limit "
            f"({len(ris)} rollout and {len(cis)} trainer configurations); raise --time-limit"
        )
    if status != "ok":
        return None
    best = solution_for(p, *_read(x, y, cis, ris), status, gap, 0.0)
    if target is None and cheapest:
        # Lexicographic: the cheapest plan among those reaching the best rate (within
        # 1e-6, CBC's integrality tolerance); keep the first answer if CBC finds none,
        # or if the cheaper one's exact rate is lower (R is a conservative bound, and
        # plans equal in R can differ in what they reach).
        prob += R >= R.value() * (1 - 1e-6)
        prob.sense = pulp.LpMinimize
        prob.setObjective(cost)
        if _run_cbc(prob, time_limit_s, COST_NODES)[0] == "ok":
            cheaper = solution_for(p, *_read(x, y, cis, ris), status, gap, 0.0)
            if cheaper.eval_rate >= best.eval_rate * (1 - 1e-6):
                best = cheaper
    best.solve_s = time.perf_counter() - t0
    return best


def solve_per_kind(p: PlanSpace, **kw: object) -> dict[str, Solution | None]:
    """`solve` restricted to each GPU kind of the rollout options, the kinds in parallel
    (each solve is a CBC subprocess)."""
    kinds = sorted({r.kind for r in p.rollouts})
    with ThreadPoolExecutor(max_workers=min(len(kinds), os.cpu_count() or 1)) as pool:
        sols = pool.map(lambda k: solve(p, allowed_kinds={k}, **kw), kinds)  # type: ignore[arg-type]
        return dict(zip(kinds, sols, strict=True))


def _model(
    p: PlanSpace, ris: list[int], cis: list[int], budget: float | None, target: float | None
):
    prob = pulp.LpProblem("areal_hex_phase1")
    y = {i: prob.add_variable(f"y{i}", lowBound=0, cat="Integer") for i in ris}
    x = {i: prob.add_variable(f"x{i}", lowBound=0, upBound=1, cat="Integer") for i in cis}
    R = prob.add_variable("R", lowBound=target or 0.0)
    # index the options once: every per-group or per-zone sum below is then linear in
    # the options, not options × groups (thousands of each at 4,096 GPUs)
    # generation is summed per zone and seconds of a pause that still generate (per kind)
    in_group: dict[str, list[int]] = {}
    in_zs: dict[tuple[str, float], list[int]] = {}
    for i in ris:
        in_group.setdefault(p.rollouts[i].group, []).append(i)
        in_zs.setdefault((p.rollouts[i].zone, p.rollouts[i].pause_overlap_s), []).append(i)
    keys = sorted(in_zs)
    G = {zs: prob.add_variable(f"G_{k}", lowBound=0) for k, zs in enumerate(keys)}
    for zs in keys:
        prob += G[zs] == pulp.lpSum(p.rollouts[i].samples_per_s * y[i] for i in in_zs[zs])
    big_m = sum(
        max(
            (p.rollouts[i].samples_per_s / p.rollouts[i].tp for i in in_group.get(g, [])),
            default=0.0,
        )
        * n
        for g, n in p.gpus.items()
    )
    prob += pulp.lpSum(x.values()) == 1
    prob += R <= pulp.lpSum(p.trainers[c].samples_per_s * x[c] for c in cis)
    prob += R <= pulp.lpSum(G.values())
    for c in cis:
        kept = pulp.lpSum((1 - _paused(p, z, ov, c)) * G[(z, ov)] for z, ov in keys)
        prob += R <= kept + big_m * (1 - x[c])
    users: dict[str, list[int]] = {}  # node group -> trainers taking GPUs of it
    for c in cis:
        for g in dict.fromkeys(g for g, _ in p.trainers[c].parts):
            users.setdefault(g, []).append(c)
    for g, total in p.gpus.items():
        for t in p.tps.get(g) or [1]:
            lhs = pulp.lpSum(
                p.rollouts[i].tp * y[i] for i in in_group.get(g, []) if p.rollouts[i].tp >= t
            )
            lost = [(lost_blocks(p.trainers[c], g, p.gpn[g], t), c) for c in users.get(g, [])]
            prob += lhs + pulp.lpSum(v * x[c] for v, c in lost if v) <= total
    cost = pulp.lpSum(p.rollouts[i].usd_per_h * y[i] for i in ris) + pulp.lpSum(
        p.trainers[c].usd_per_h * x[c] for c in cis
    )
    prob += pulp.lpSum(p.rollouts[i].batch * y[i] for i in ris) <= p.inflight
    if budget is not None:
        prob += cost <= budget
    return prob, y, x, R, cost


# Branch-and-bound nodes a cost-minimising solve may take: at thousands of GPUs in
# hundreds of node groups (thousands of trainer candidates, each a big-M row) CBC finds
# a near-cheapest plan early and spends tens of seconds improving it by cents; the local
# search on the placed plan lowers the cost further anyway. A node count, not a time, so
# a plan does not depend on the machine's load. Rate-maximising solves run to the end.
COST_NODES = 50


def _run_cbc(
    prob: pulp.LpProblem, time_limit_s: float, max_nodes: int | None = None
) -> tuple[str, float]:
    """Solve; return ("ok" | "infeasible", relative gap parsed from CBC's log)."""
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "cbc.log"
        # The CBC binary bundled with PuLP (PuLP 4 moves it to COIN_CMD + pulp[cbc]).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(
                msg=False,
                timeLimit=time_limit_s,
                threads=1,
                logPath=str(log),
                maxNodes=max_nodes,
            )
        prob.solve(solver)
        text = log.read_text() if log.exists() else ""
    if prob.sol_status not in (1, 2):  # neither optimal nor an integer incumbent
        return ("timeout" if pulp.LpStatus[prob.status] == "Not Solved" else "infeasible"), (
            math.inf
        )
    m = re.search(r"Gap:\s*([0-9.eE+-]+)", text)
    gap = float(m.group(1)) if m else 0.0
    return "ok", gap


def _read(x: dict, y: dict, cis: list[int], ris: list[int]) -> tuple[int, dict[int, int]]:
    c_idx = next(i for i in cis if (x[i].value() or 0) > 0.5)
    reps = {i: int(round(y[i].value() or 0)) for i in ris if round(y[i].value() or 0) > 0}
    return c_idx, reps


def solution_for(
    p: PlanSpace, c_idx: int, reps: dict[int, int], status: str, gap: float, solve_s: float
) -> Solution:
    c = p.trainers[c_idx]
    gen = gen_rate(p, c_idx, reps)
    cost = c.usd_per_h + sum(n * p.rollouts[i].usd_per_h for i, n in reps.items())
    return Solution(
        min(gen, c.samples_per_s),
        gen,
        c.samples_per_s,
        cost,
        c,
        reps,
        status,
        gap,
        solve_s,
        {"trainer_index": c_idx},
        *evaluate(p, c_idx, reps),
    )
