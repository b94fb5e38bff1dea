"""`areal-hex run CONFIG [overrides] [--mode sync|async] [--plan plan.yaml]`: a whole job
(embedded Valkey, inference servers, rollout controller, DeepSpeed trainer) as local
processes, with live progress and a report at the end."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from areal_hex.cli import add_config_args

    p = sub.add_parser("run", help="run a whole job locally (servers, controller, trainer)")
    add_config_args(p)
    p.add_argument(
        "--mode",
        choices=["async", "sync"],
        default=None,
        help="sync: staleness 0, the baseline (default: run.mode)",
    )
    p.add_argument("--plan", default=None, help="plan.yaml from `areal-hex plan` (optional)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from areal_hex.cli import config_from_args
    from areal_hex.launch.run import prepare, run_job
    from areal_hex.launch.supervisor import ProcessFailed
    from areal_hex.plan import load_plan

    cfg = config_from_args(args)
    plan = load_plan(args.plan) if args.plan else None
    prep = prepare(cfg, args.mode)
    run_dir = prep.cfg.run.run_dir()
    print(f"run {prep.cfg.run.run_id}: {run_dir} ({prep.cfg.run.mode})", file=sys.stderr)
    try:
        summary = run_job(prep, plan)
    except ProcessFailed as exc:
        print(f"areal-hex run: error: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "steps",
                    "final_version",
                    "final_reward",
                    "max_staleness",
                    "samples_per_s",
                    "wall_s",
                    "groups",
                )
            },
            indent=2,
        )
    )
    print(f"report: {run_dir / 'report'}  summary: {run_dir / 'summary.json'}", file=sys.stderr)
    return 0
