"""`areal-hex report RUN_CONFIG [--outcome finished|stopped|failed]`: write a run's
`summary.json` and plots from its run directory and its buffer's counters, for runs whose
services another launcher started (a Slurm job); `areal-hex run` writes it by itself."""

from __future__ import annotations

import argparse
import json

SUMMARY_KEYS = (
    "steps",
    "final_reward",
    "max_version_lag",
    "groups_produced",
    "groups_trained",
    "groups_dropped_stale",
    "groups_lost",
    "final_version",
)


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("report", help="write a run's summary.json and plots")
    add_config_args(p)
    p.add_argument(
        "--outcome",
        choices=("finished", "stopped", "failed"),
        default="finished",
        help="how the run ended (recorded in the summary)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hexctl.cli import UsageError, config_from_args, require_run
    from hexctl.launch.run import buffer_stats
    from hexctl.report.summary import write_report

    cfg = config_from_args(args)
    require_run(cfg, "areal-hex report", need_redis=False)
    run_dir = cfg.run.run_dir()
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist (run.output_dir/run.run_id)")
    # The buffer's counters complete the group accounting; None if Redis is gone.
    stats = buffer_stats(cfg)
    summary = write_report(run_dir, cfg, buffer=stats, outcome=args.outcome)
    print(json.dumps({k: summary.get(k) for k in SUMMARY_KEYS}), flush=True)
    return 0
