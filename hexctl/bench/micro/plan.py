"""Planner: solve time by cluster size, optimality gap, simulator error, phase 2's gain.

solve_s: phase 1 + phase 2 wall time for generated clusters (six GPU kinds, four regions,
two zones each); plan_s: the whole plan (baselines and simulation included) on them.
max_gap_vs_exhaustive: relative gap between the MILP and an exhaustive search under the
same cost model on small random clusters. max_sim_error: |simulated - predicted| /
predicted over every shipped inventory x workload; max_sim_error_eta_k (signed errors in
sim_error_eta_k): the same with the workloads' staleness and publish interval set to each
of ETA_K, the choices `plan --search-max-staleness/--search-publish-every` weighs.
speedup_vs_homogeneous (and its minimum, min_hetero_vs_homo): the plan's rate over the
best one-kind plan at the same budget. metis_gain: simulated rate of phase 2's METIS
mapping over first-fit placement of the same phase-1 decision on the rack inventory.
target_rate_ok: share of --target-rate requests at 0.5/0.9/0.99/1.0 x a budget plan's
disaggregated rate that succeed (a target is planned disaggregated: `by_placement`; the
budget plan may report a faster hybrid or colocated placement beside it).
plan_s_many_groups (and its largest, max_plan_s_many_groups_4096 at the default size): the
whole plan on an inventory of many small node groups (two 8-GPU machines each, every group
a price of its own, so no two merge), budget = half its price.
applied_to_run: 1.0 when every key a plan decides (`hexctl.job.plan_config`: pools, GPU
kinds, ZeRO, ranks, rank speeds, and the staleness bound and publish interval the planner
tuned, on the rack inventory with --search-max-staleness 8 --search-publish-every 2 --zero-stage
3) has the plan's value in the resolved config of a local run and of the k8s and Slurm
renders; applied_mismatches lists any that does not.
workflow_plans: one job planned as each of `plan_tasks.WORKFLOWS` (GRPO, with the KL
reference in the trainer or as a task, with a reward-model task, PPO with its critic, PPO
with both tasks): rate, pools, tasks, binding; slow_reward_model_ok: 1.0 when a reward
model pinned to L4 bounds the plan at its own rate and the planner, allowed any kind,
moves it to one that keeps up (`hexctl/bench/micro/plan_tasks.py`).
min_budget_used: the least share of the budget a plan spends where the inventory does
not bind (budget_used lists those plans); max_unspent_machines: the most any of those
plans leaves unspent, in prices of the inventory's cheapest machine.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path

from areal_hex.config import ConfigError
from hexctl.bench.micro.plan_tasks import WORKFLOWS, workflow_names, workflows
from scheduler.cluster import Cluster, ClusterSpec, load_cluster, make_cluster
from scheduler.exhaustive import exhaustive
from scheduler.milp import solve
from scheduler.model_shape import ModelShape, load_model_shape
from scheduler.partition import place
from scheduler.placing import TARGET_TOLERANCE
from scheduler.planner import make_plan, problem_for
from scheduler.workload import Workload, load_workload

KINDS = [
    ("H100", 2.99),
    ("H200", 3.79),
    ("H20", 1.85),
    ("A100-80GB", 1.79),
    ("L40S", 1.04),
    ("L4", 0.52),
]
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="64,256,1024,4096", help="GPU counts to time")
    p.add_argument("--random-clusters", type=int, default=12, help="clusters for the gap")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--time-limit", type=float, default=60.0, help="CBC limit per solve, s")
    p.add_argument("--plan-sizes", default="1024,4096", help="GPU counts to time the whole plan at")
    p.add_argument(
        "--many-groups-sizes",
        default="4096",
        help="GPU counts to time the whole plan at on many small node groups",
    )
    p.add_argument(
        "--inventories",
        default="",
        help="comma-separated shipped inventories (examples/clusters stems) to plan; all if empty",
    )
    p.add_argument(
        "--workloads", default="long_cot,math_grpo", help="shipped workloads to plan them with"
    )
    p.add_argument(
        "--workflows",
        default=",".join(WORKFLOWS),
        help="workflows (critic, reference, reward model) to plan one job as; none if empty",
    )


# 4 regions x 2 zones: (zone, region)
ZONES = [(f"r{r}-z{z}", f"r{r}") for r in range(4) for z in range(2)]


def generated_cluster(gpus: int, seed: int = 0, gpn: int = 8):
    """`gpus` GPUs in nodes of `gpn`, spread over six kinds in 4 regions x 2 zones."""
    rng = random.Random(seed)
    nodes = gpus // gpn
    slots = [(k, z) for k in range(len(KINDS)) for z in range(len(ZONES))]
    rng.shuffle(slots)
    slots = slots[: max(6, min(len(slots), nodes))]
    counts = [nodes // len(slots)] * len(slots)
    for i in range(nodes - sum(counts)):
        counts[i % len(slots)] += 1
    groups = [
        _group(f"g{i}", KINDS[k][0], gpn, n, ZONES[z][0], KINDS[k][1])
        for i, ((k, z), n) in enumerate(zip(slots, counts, strict=True))
        if n > 0
    ]
    return _generated(f"generated-{gpus}", groups)


def many_groups_cluster(gpus: int, seed: int = 0, gpn: int = 8, machines: int = 2):
    """`gpus` GPUs as node groups of `machines` machines each, kinds and zones drawn at
    random over six kinds in 4 regions x 2 zones, every group's price its kind's plus a
    per-group step (lots bought at different times): no two groups are alike, so the
    planner cannot merge them and its work is in node groups."""
    rng = random.Random(seed)
    groups = []
    for i in range(gpus // (gpn * machines)):
        kind, price = KINDS[rng.randrange(len(KINDS))]
        zone = ZONES[rng.randrange(len(ZONES))][0]
        groups.append(
            _group(f"lot{i}", kind, gpn, machines, zone, round(price * (1 + 0.0005 * i), 5))
        )
    return _generated(f"many-groups-{gpus}", groups)


def _group(name: str, gpu: str, gpn: int, nodes: int, zone: str, usd: float) -> dict:
    """One node group of the generated clusters (NVLink inside each machine)."""
    return {
        "name": name,
        "gpu": gpu,
        "gpus_per_node": gpn,
        "nodes": nodes,
        "zone": zone,
        "usd_per_gpu_hour": usd,
        "intra_node": {"kind": "nvlink", "bandwidth_gbs": 300},
    }


def _generated(name: str, groups: list[dict]):
    """`groups` in the 4 regions x 2 zones, joined by `_generated_links`."""
    spec = ClusterSpec(
        name=name,
        zones=[{"name": z, "region": r, "inter_node_bandwidth_gbs": 50.0} for z, r in ZONES],
        node_groups=groups,
        links=_generated_links(),
    )
    return make_cluster(spec)


def _generated_links() -> list[dict]:
    links = [
        {"a": f"r{r}-z0", "b": f"r{r}-z1", "bandwidth_gbs": 25.0, "latency_ms": 1.0}
        for r in range(4)
    ]
    return links + [
        {"a": f"r{a}", "b": f"r{b}", "bandwidth_gbs": 3.0, "latency_ms": 60.0}
        for a in range(4)
        for b in range(a + 1, 4)
    ]


def random_small_cluster(seed: int):
    """Two node groups of 1-2 machines with 1-2 GPUs: small enough to enumerate."""
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, 2)
    groups = [
        {
            "name": f"g{i}",
            "gpu": k,
            "gpus_per_node": rng.choice([1, 2]),
            "nodes": rng.choice([1, 2]),
            "zone": "za" if i % 2 == 0 else "zb",
            "usd_per_gpu_hour": round(p * rng.uniform(0.7, 1.3), 2),
            "intra_node": {"kind": "pcie", "bandwidth_gbs": 32},
        }
        for i, (k, p) in enumerate(kinds)
    ]
    spec = ClusterSpec(
        name=f"random-{seed}",
        zones=[
            {"name": "za", "region": "r", "inter_node_bandwidth_gbs": 12.5},
            {"name": "zb", "region": "r", "inter_node_bandwidth_gbs": 12.5},
        ],
        node_groups=groups,
        links=[{"a": "za", "b": "zb", "bandwidth_gbs": rng.choice([1.5, 6.0]), "latency_ms": 0.5}],
    )
    total = sum(g["nodes"] * g["gpus_per_node"] * g["usd_per_gpu_hour"] for g in groups)
    return make_cluster(spec), total * rng.uniform(0.3, 0.9)


SMALL_WORKLOAD = Workload(
    groups_per_step=8,
    group_size=4,
    prompt_tokens=256,
    response_tokens=1024,
    max_response_tokens=2048,
    max_staleness=2,
)


def _plan_seconds(
    sizes: str, build: Callable[[int], Cluster], m: ModelShape, w: Workload, time_limit_s: float
) -> dict[str, float]:
    """Seconds of a whole `make_plan` at half the price of each cluster `build(size)`
    makes, one per size of the comma-separated `sizes`."""
    out = {}
    for size in [int(s) for s in sizes.split(",") if s]:
        cl = build(size)
        t0 = time.perf_counter()
        make_plan(cl, m, w, budget=0.5 * _price(cl), time_limit_s=time_limit_s)
        out[str(size)] = round(time.perf_counter() - t0, 3)
    return out


def gap_vs_exhaustive(seeds: int, model: str = "qwen3-1.7b") -> tuple[float, int]:
    m, worst, n = load_model_shape(model), 0.0, 0
    for s in range(seeds):
        cl, budget = random_small_cluster(s)
        p = problem_for(cl, m, SMALL_WORKLOAD)
        sol = solve(p, budget=budget)
        exh, _ = exhaustive(p, budget)
        got = sol.rate if sol else 0.0
        if exh > 0:
            worst = max(worst, (exh - got) / exh)
            n += 1
    return worst, n


def run(args: argparse.Namespace) -> dict:
    planned = inventories(args.inventories)
    names = workflow_names(args.workflows)
    m = load_model_shape(args.model)
    w = Workload()
    solve_s, gaps = {}, {}
    for size in [int(s) for s in args.sizes.split(",") if s]:
        cl = generated_cluster(size)
        t0 = time.perf_counter()
        p = problem_for(cl, m, w)
        sol = solve(p, budget=0.5 * _price(cl), time_limit_s=args.time_limit)
        place(cl, m, w, sol.trainer, [(p.rollouts[i], k) for i, k in sol.replicas.items()])
        solve_s[str(size)] = round(time.perf_counter() - t0, 3)
        gaps[str(size)] = sol.gap
    plan_s = _plan_seconds(args.plan_sizes, generated_cluster, m, w, args.time_limit)
    many = _plan_seconds(args.many_groups_sizes, many_groups_cluster, m, w, args.time_limit)
    gap, compared = gap_vs_exhaustive(args.random_clusters)
    sim_err, speedup, used, targets, unspent, sim_eta_k = {}, {}, {}, [], {}, {}
    for wname in [x for x in args.workloads.split(",") if x]:
        wl = load_workload(EXAMPLES / "workloads" / f"{wname}.yaml")
        for f in planned:
            cl = load_cluster(f)
            budget = 0.6 * _price(cl)
            res = make_plan(cl, m, wl, budget=budget, time_limit_s=args.time_limit)
            pred = res.plan.predicted.samples_per_s
            key = f"{f.stem}/{wname}"
            sim_err[key] = round(abs(res.sim.samples_per_s - pred) / pred, 4)
            homo = max(res.homogeneous.values())
            speedup[key] = round(pred / homo, 3) if homo > 0 else None
            if "inventory" not in res.plan.baselines.limits:  # capacity does not bind
                used[key] = round(res.plan.predicted.cost_usd_per_h / budget, 3)
                machine = min(g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
                unspent[key] = round((budget - res.plan.predicted.cost_usd_per_h) / machine, 3)
            reach = res.plan.baselines.disaggregated_samples_per_s or pred
            targets += [_target_ok(cl, m, wl, share * reach, args) for share in SHARES]
            for eta, k in ETA_K:
                wv = wl.model_copy(update={"max_staleness": eta, "publish_every": k})
                rv = make_plan(
                    cl, m, wv, budget=budget, time_limit_s=args.time_limit, baselines=False
                )
                pv = rv.plan.predicted.samples_per_s
                sim_eta_k[f"{key}/eta{eta}k{k}"] = round((rv.sim.samples_per_s - pv) / pv, 4)
    gain = metis_gain(m, args.time_limit)
    applied, mismatches = applied_to_run(args.time_limit)
    return {
        **(workflows(EXAMPLES, m, args.time_limit, names) if names else {}),
        "applied_to_run": applied,
        "applied_mismatches": mismatches,
        "solve_s": solve_s,
        "plan_s": plan_s,
        "plan_s_many_groups": many,
        **({"max_plan_s_many_groups_4096": many["4096"]} if "4096" in many else {}),
        "mip_gap_by_size": gaps,
        "max_gap_vs_exhaustive": round(gap, 6),
        "exhaustive_clusters_compared": compared,
        "max_sim_error": max(sim_err.values()),
        "sim_error": sim_err,
        "max_sim_error_eta_k": max(abs(v) for v in sim_eta_k.values()),
        "sim_error_eta_k": sim_eta_k,
        "speedup_vs_homogeneous": speedup,
        "min_hetero_vs_homo": min(v for v in speedup.values() if v is not None),
        "metis_gain": gain,
        "target_rate_ok": round(sum(targets) / len(targets), 3),
        "budget_used": used,
        "min_budget_used": min(used.values()),
        "max_unspent_machines": max(unspent.values()),
        "model": args.model,
        "examples": "each planned inventory x workload at 60% of the inventory's price",
    }


def inventories(names: str) -> list[Path]:
    """The shipped inventories named (all of them when none is)."""
    found = sorted((EXAMPLES / "clusters").glob("*.yaml"))
    wanted = {x for x in names.split(",") if x}
    unknown = wanted - {f.stem for f in found}
    if unknown:
        known = ", ".join(f.stem for f in found)
        raise ConfigError(f"--inventories: no shipped inventory {sorted(unknown)} (known: {known})")
    return [f for f in found if not wanted or f.stem in wanted]


SHARES = (0.5, 0.9, 0.99, 1.0)
ETA_K = ((1, 1), (2, 1), (3, 2), (8, 4))  # staleness and publish interval the tuning may choose


def _price(cl) -> float:
    return sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)


def _target_ok(cl, m, w, target: float, args: argparse.Namespace) -> bool:
    try:
        res = make_plan(
            cl,
            m,
            w,
            target=target,
            time_limit_s=args.time_limit,
            baselines=False,
            simulate_plan=False,
        )
    except ConfigError:
        return False
    return res.plan.predicted.samples_per_s >= target * (1 - TARGET_TOLERANCE)


def metis_gain(m, time_limit_s: float) -> float:
    """Simulated rate of the METIS mapping over first-fit, same decision, on the racks."""
    cl = load_cluster(EXAMPLES / "clusters" / "racks_h800_h20.yaml")
    wl = load_workload(EXAMPLES / "workloads" / "math_grpo.yaml")
    res = make_plan(cl, m, wl, budget=0.7 * _price(cl), time_limit_s=time_limit_s, baselines=False)
    return round(res.sim.samples_per_s / res.first_fit_sim.samples_per_s, 3)


def applied_to_run(time_limit_s: float) -> tuple[float, list[str]]:
    """Plan with tuned η and k, then read back what the local run and the k8s and Slurm
    renders would start with: (1.0 if every planned key is there as planned, else 0.0;
    the keys that are not, as "target key: got != planned")."""
    import tempfile

    from areal_hex.config import load_config
    from areal_hex.config.base import load_yaml_text
    from hexctl.deploy import prepare_deployment
    from hexctl.deploy.config import DeployConfig
    from hexctl.deploy.slurm import render_slurm
    from hexctl.deploy.slurm_site import load_site
    from hexctl.job.plan_config import planned_values
    from hexctl.job.prepare import apply_plan
    from scheduler.tuning import tune_max_staleness_and_publish_every

    cl = load_cluster(EXAMPLES / "clusters" / "racks_h800_h20.yaml")
    m = load_model_shape("qwen3-8b")
    w = load_workload(EXAMPLES / "workloads" / "math_grpo.yaml")
    w = w.model_copy(update={"zero_stage": 3})
    budget = 150.0
    w, _ = tune_max_staleness_and_publish_every(
        cl,
        m,
        w,
        search_max_staleness=8,
        search_publish_every=2,
        budget=budget,
        time_limit_s=time_limit_s,
    )
    plan = make_plan(cl, m, w, budget=budget, time_limit_s=time_limit_s, simulate_plan=False).plan
    cfg = load_config(EXAMPLES / "deploy" / "qwen3-8b.yaml")
    resolved = {"run": (apply_plan(load_config(EXAMPLES / "tiny_cpu.yaml"), plan, _quiet), "local")}
    with tempfile.TemporaryDirectory() as tmp:
        d = prepare_deployment(cfg, plan, DeployConfig(), "k8s", Path(tmp) / "k8s")
        resolved["k8s"] = (d.cfg, "cluster")
        site = load_site(EXAMPLES / "slurm" / "site_cluster.yaml")
        site = site.model_copy(update={"shared_dir": str(Path(tmp) / "shared")})
        render_slurm(cfg, plan, site, Path(tmp) / "slurm", "site.yaml")
        data = load_yaml_text((Path(tmp) / "slurm" / "config.yaml").read_text(), "config.yaml")
        resolved["slurm"] = (type(cfg).model_validate(data), "cluster")
    bad = []
    for target, (rcfg, nodes) in resolved.items():
        for key, want in planned_values(plan, nodes).items():
            section, name = key.split(".")
            got = getattr(getattr(rcfg, section), name)
            if got != want:
                bad.append(f"{target} {key}: {got!r} != {want!r}")
    return (0.0 if bad else 1.0), bad


def _quiet(line: str) -> None:
    pass
