"""`areal-hex plan CLUSTER --model M (--budget $ | --target-rate R)`: the two-phase plan, its
table, and the plan projected onto a config."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig
    from areal_hex.plan import Plan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="place rollout and training pools on a heterogeneous cluster under a budget",
        description="Phase 1 MILP (PuLP + CBC) picks GPUs and parallelism per pool, phase 2 "
        "METIS picks the concrete GPUs; writes plan.yaml for `deploy` and `run`. See "
        "docs/planner.md.",
    )
    p.add_argument("cluster", help="cluster spec YAML (see examples/clusters/)")
    p.add_argument("--model", required=True, help="preset (e.g. qwen3-8b) or HF config.json")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--budget", type=float, help="maximise throughput under this $/h")
    goal.add_argument("--target-rate", type=float, help="minimise $/h at this samples/s")
    p.add_argument("--workload", help="workload YAML (see examples/workloads/)")
    p.add_argument("--out", default="plan.yaml", help="where to write the plan")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", help="write a PNG: cluster by role (+ budget sweep)")
    p.add_argument("--sweep-budget", action="store_true", help="also plan at 8 budgets")
    p.add_argument("--profile", help="measured rates from `areal-hex profile`")
    p.add_argument(
        "--tp",
        type=int,
        help="every rollout instance at this TP degree (match inference.sglang.tp_size for deploy)",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        help="trainer ZeRO stage (match trainer.zero_stage for deploy)",
    )
    p.add_argument(
        "--one-kind-trainer",
        action="store_true",
        help="keep the trainer on one GPU kind (deploy renders no trainer across kinds)",
    )
    p.add_argument("--time-limit", type=float, default=60.0, help="CBC time limit, s")
    p.add_argument("--no-simulate", action="store_true", help="skip the simulator replay")
    p.add_argument(
        "--search-max-staleness",
        type=int,
        metavar="N",
        help="also try buffer.max_staleness from the workload's up to N (pick the best)",
    )
    p.add_argument(
        "--search-publish-every",
        type=int,
        metavar="K",
        help="also try trainer.publish_every from the workload's up to K",
    )
    # the names of an earlier version, refused with the new ones (they read as the bound
    # itself, not as the end of a search over it)
    for old in ("--max-staleness", "--max-publish-interval"):
        dest = "old_" + old[2:].replace("-", "_")
        p.add_argument(old, type=str, help=argparse.SUPPRESS, dest=dest)
    p.add_argument(
        "--print-config",
        metavar="CONFIG",
        help="also print CONFIG with every decision of the plan applied, as a deploy renders "
        "it (the same projection `run --plan` and `deploy` use); changed keys on stderr",
    )
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from areal_hex.plan import PlanSources, save_plan
    from hexctl.cli import UsageError
    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.planner import make_plan
    from scheduler.profile import load_profile
    from scheduler.report import sweep_budgets, table
    from scheduler.tuning import tune_max_staleness_and_publish_every
    from scheduler.workload import load_workload

    _check_numbers(args, UsageError)
    cl = load_cluster(args.cluster)
    m = load_model_shape(args.model)
    w = load_workload(args.workload)
    if args.tp is not None:
        if args.tp < 1:
            raise UsageError(f"--tp must be a positive integer, got {args.tp}")
        w = w.model_copy(update={"rollout_tp": args.tp})
    if args.zero_stage is not None:
        w = w.model_copy(update={"zero_stage": args.zero_stage})
    if args.one_kind_trainer:
        w = w.model_copy(update={"mixed_trainer": False})
    prof = load_profile(args.profile, m.params) if args.profile else None
    tried = None
    if args.search_max_staleness is not None or args.search_publish_every is not None:
        eta = args.search_max_staleness
        eta = eta if eta is not None else w.max_staleness
        k = args.search_publish_every if args.search_publish_every is not None else 1
        if eta < w.max_staleness or k < 1:
            raise UsageError(
                f"--search-max-staleness must be at least the workload's max_staleness "
                f"({w.max_staleness}) and --search-publish-every at least 1; got {eta} and {k}"
            )
        k = max(k, w.publish_every)
        w, tried = tune_max_staleness_and_publish_every(
            cl,
            m,
            w,
            search_max_staleness=eta,
            search_publish_every=k,
            budget=args.budget,
            target=args.target_rate,
            prof=prof,
            time_limit_s=args.time_limit,
        )
    res = make_plan(
        cl,
        m,
        w,
        budget=args.budget,
        target=args.target_rate,
        prof=prof,
        model_label=args.model,
        time_limit_s=args.time_limit,
        simulate_plan=not args.no_simulate,
    )
    sweep = sweep_budgets(cl, m, w, res, prof, args.time_limit) if args.sweep_budget else None
    res.plan.sources = PlanSources(
        cluster=str(Path(args.cluster).resolve()),
        workload=str(Path(args.workload).resolve()) if args.workload else None,
        profile=str(Path(args.profile).resolve()) if args.profile else None,
    )
    out = save_plan(res.plan, args.out)
    planned = _planned_config(args.print_config, res.plan) if args.print_config else None
    if args.plot:
        from scheduler.plot import plot

        plot(args.plot, cl, res.placement, sweep)
    if args.json:
        doc = {"plan_path": str(out), "plan": res.plan.model_dump(mode="json")}
        if res.sim is not None:
            doc["simulated"] = res.sim.__dict__ | {
                "version_lag_hist": {str(k): v for k, v in res.sim.version_lag_hist.items()}
            }
        doc["homogeneous"] = res.homogeneous
        if tried is not None:
            doc["tuned"] = tried
        if sweep is not None:
            doc["sweep"] = sweep
        if planned is not None:
            doc["config"] = planned.model_dump(mode="json")
        print(json.dumps(doc, indent=2))
    else:
        print(table(res, sweep))
        if tried is not None:
            b = res.plan.decisions
            print(
                f"tuned over {len(tried)} (staleness, publish interval) pairs: staleness "
                f"{b.max_staleness}, publish every {b.publish_every} (buffer.max_staleness="
                f"{b.max_staleness} trainer.publish_every={b.publish_every})"
            )
        print(f"\nwrote {out}" + (f" and {args.plot}" if args.plot else ""))
    if planned is not None and not args.json:
        from areal_hex.config import dump_yaml

        print(dump_yaml(planned))
    return 0


def _planned_config(path: str, plan: Plan) -> ExperimentConfig:
    """CONFIG with the plan applied as a deploy renders it; each change said on stderr."""
    from areal_hex.config import load_config
    from hexctl.job.plan_config import project_plan

    projected = project_plan(load_config(path), plan, "cluster")
    for line in projected.changes:
        print(f"areal-hex plan: {line}", file=sys.stderr)
    return projected.config


MAX_TUNED = 64  # the most staleness bounds or publish intervals the tuning plans through


def _check_numbers(args: argparse.Namespace, error: type[Exception]) -> None:
    """Every number on the command line finite and in range, named when it is not."""
    for flag, v in (
        ("--budget", args.budget),
        ("--target-rate", args.target_rate),
        ("--time-limit", args.time_limit),
    ):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise error(f"{flag} must be a positive finite number, got {v:g}")
    for old, new in (
        ("max-staleness", "--search-max-staleness"),
        ("max-publish-interval", "--search-publish-every"),
    ):
        if getattr(args, f"old_{old}".replace("-", "_"), None) is not None:
            raise error(f"--{old} is now {new} (the end of the search, not the bound itself)")
    for flag, v in (
        ("--search-max-staleness", args.search_max_staleness),
        ("--search-publish-every", args.search_publish_every),
    ):
        if v is not None and not 0 <= v <= MAX_TUNED:
            raise error(f"{flag} must be between 0 and {MAX_TUNED}, got {v}")
