"""`areal-hex run CONFIG [key=value ...] [--mode sync|async] [--plan plan.yaml]`: run a whole
job as local processes (Valkey, inference servers, rollout controller, DeepSpeed trainer)
and write the report into the run directory."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import FrameType


def register(sub: argparse._SubParsersAction) -> None:
    from areal_hex.cli import add_config_args

    p = sub.add_parser("run", help="run a whole job locally (buffer, servers, controller, trainer)")
    add_config_args(p)
    p.add_argument("--mode", choices=["sync", "async"], default=None, help="default: run.mode")
    p.add_argument("--plan", default=None, help="plan.yaml from `areal-hex plan` (optional)")
    p.add_argument(
        "--profile",
        default=None,
        help="directory from `areal-hex profile --local`: predict a run without a plan",
    )
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument(
        "--timeout", type=float, default=None, help="fail the run after this many seconds"
    )
    p.set_defaults(func=_run)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    from areal_hex.cli import UsageError, config_from_args
    from areal_hex.launch.prepare import prepare_run
    from areal_hex.launch.run import execute, failure_message

    cfg = config_from_args(args)
    plan = None
    if args.plan is not None:
        from areal_hex.plan import load_plan

        plan = load_plan(args.plan)
    try:
        cfg, config_path = prepare_run(cfg, plan, args.mode)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    run_dir = cfg.run.run_dir()
    print(
        f"areal-hex run: {cfg.run.mode} run in {run_dir} (logs in {run_dir / 'logs'})",
        file=sys.stderr,
        flush=True,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # stop the services as on Ctrl-C
    result = execute(
        cfg,
        config_path,
        plan,
        progress=not args.no_progress,
        timeout_s=args.timeout,
        profile_dir=Path(args.profile) if args.profile else None,
    )
    if result.outcome.status == "interrupted":
        print("areal-hex run: interrupted; all processes stopped", file=sys.stderr)
        return 130
    if not result.ok:
        print(f"areal-hex run: error: {failure_message(result)}", file=sys.stderr)
        return 1
    keys = [
        "steps",
        "final_reward",
        "max_staleness",
        "samples_per_s",
        "wall_time_s",
        "groups_produced",
        "groups_trained",
        "groups_dropped_stale",
        "final_version",
    ]
    print(json.dumps({k: result.summary.get(k) for k in keys}))
    print(
        f"areal-hex run: report in {run_dir / 'summary.json'} and {run_dir / 'report'}",
        file=sys.stderr,
    )
    return 0
