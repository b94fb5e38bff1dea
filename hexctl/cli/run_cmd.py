"""`areal-hex run CONFIG [key=value ...] [--mode sync|async] [--plan plan.yaml]`: run a whole
job as local processes (Valkey, inference servers, rollout controller, DeepSpeed trainer)
and write the report into the run directory. `areal-hex run --resume RUN_DIR` continues an
interrupted or failed run where its durable state (checkpoints, Valkey's append-only
file) left it."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("run", help="run a whole job locally (buffer, servers, controller, trainer)")
    add_config_args(p, required=False)  # not with --resume
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
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue the run in RUN_DIR (its config.yaml; overrides still apply)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --resume: stop processes of the run still alive (e.g. left by a killed "
        "launcher) instead of refusing",
    )
    p.set_defaults(func=_run)


def _resume_args(args: argparse.Namespace) -> None:
    """`--resume RUN_DIR`: the run's own config.yaml is the config (a CONFIG that looks
    like an override is one)."""
    from hexctl.cli import UsageError

    if args.resume is None:
        if args.config is None:
            raise UsageError("areal-hex run: give a CONFIG, or --resume RUN_DIR")
        return
    config = Path(args.resume) / "config.yaml"
    if not config.is_file():
        raise UsageError(
            f"--resume {args.resume}: no config.yaml there; expected the directory of a run "
            "started by areal-hex run (runs/<run_id>)"
        )
    if args.config is not None and "=" in args.config and not args.config.endswith(".yaml"):
        args.overrides = [args.config, *args.overrides]
    elif args.config is not None:
        raise UsageError("--resume RUN_DIR takes the run's own config: give no CONFIG")
    args.config = str(config)


def _check_alone(run_dir: Path, force: bool) -> None:
    """A run directory is served by one launcher at a time: processes of an earlier one
    still alive (a launcher killed with SIGKILL, whose services have not ended yet) are
    refused, naming them, or with `--force` stopped first."""
    from hexctl.cli import UsageError
    from hexctl.launch.supervisor import live_processes, stop_processes

    # services name their config, `<run_id>/config.yaml`, on their command lines
    live = live_processes(run_dir / "pids.json", f"{run_dir.name}/")
    if not live:
        return
    named = ", ".join(f"{n} (pid {' '.join(map(str, p))})" for n, p in sorted(live.items()))
    if not force:
        raise UsageError(
            f"{run_dir} is still in use by {named}: wait for them to end, stop them, or "
            "add --force to stop them first"
        )
    _say(f"--force: stopping {named}")
    stop_processes(live)


def _say(text: str) -> None:
    print(f"areal-hex run: {text}", file=sys.stderr, flush=True)


def _on_box(cfg: Any) -> tuple[Any, Any]:  # cfg: ExperimentConfig
    """`run.box=NAME`: the box's addresses in the run's config and its processes started
    inside their nodes; (None, None) for a run on this machine as it is."""
    if cfg.run.box is None:
        return None, None
    from hexctl.box.place import place_on_box
    from hexctl.box.run_config import apply_box

    return apply_box, place_on_box


def _prices(cfg: Any, plan: Any, profile: str | None) -> Any:  # -> Price | None
    """`workflow.placement: auto` without a plan: the candidates priced from `--profile
    DIR`, else from this machine's cached profile of the job (a plan's placement is the
    plan's)."""
    from areal_hex.config.workflow import AUTO_PLACEMENT

    if plan is not None or cfg.workflow.placement != AUTO_PLACEMENT:
        return None
    from hexctl.launch.placement_prices import profile_prices

    return profile_prices(_say, Path(profile) if profile else None)


def _run(args: argparse.Namespace) -> int:
    args.t_command = time.time()  # the start-up timeline's first milestone
    from hexctl.cli import UsageError, config_from_args
    from hexctl.job.prepare import apply_mode, default_run_id, preflight
    from hexctl.launch.run_lock import RunLock

    _resume_args(args)
    cfg = config_from_args(args)
    plan = None
    if args.plan is not None:
        from areal_hex.plan import load_plan

        plan = load_plan(args.plan)
    preflight(cfg)  # exit 2 before anything is created
    if cfg.run.run_id is None:
        cfg.run.run_id = default_run_id(apply_mode(cfg, args.mode))
    existed = cfg.run.run_dir().exists()
    if not existed and args.force:
        raise UsageError("--force goes with --resume RUN_DIR (a run directory in use)")
    with RunLock(cfg.run.run_dir()):  # before anything is written; held to the end
        return _launch(args, cfg, plan, existed)


def _launch(args: argparse.Namespace, cfg: Any, plan: Any, existed: bool) -> int:
    """The run, its directory locked by this launcher."""
    from hexctl.cli import UsageError
    from hexctl.job.prepare import prepare_run
    from hexctl.job.processes import sigterm_as_ctrl_c
    from hexctl.launch.disk import DiskFull, disk_full_message, is_disk_full
    from hexctl.launch.early_fork import early_fork_server
    from hexctl.launch.run import execute, failure_message

    if existed:
        _check_alone(cfg.run.run_dir(), args.force)
    # from here SIGTERM stops the run as Ctrl-C does: a half-prepared run directory is
    # removed, a started run's services are stopped
    addresses, place = _on_box(cfg)
    sigterm_as_ctrl_c()
    # its imports, the start's longest part, from now on beside the preparation
    forker = early_fork_server(cfg, plan)
    try:
        cfg, config_path = prepare_run(
            cfg, plan, args.mode, say=_say, place=addresses, price=_prices(cfg, plan, args.profile)
        )
    except BaseException as exc:
        if forker is not None:
            forker.close()
        if not existed:  # a new run's half-made directory (made for its lock) goes
            shutil.rmtree(cfg.run.run_dir(), ignore_errors=True)
        if isinstance(exc, (ValueError, OSError)):
            raise UsageError(str(exc)) from None
        raise
    run_dir = cfg.run.run_dir()
    milestones = [(args.t_command, "command"), (time.time(), "prepared (config, v0 weights)")]
    verb = "resuming" if existed else "starting"
    _say(f"{verb} {cfg.run.mode} run in {run_dir} (logs in {run_dir / 'logs'})")
    try:
        result = execute(
            cfg,
            config_path,
            plan,
            progress=not args.no_progress,
            timeout_s=args.timeout,
            profile_dir=Path(args.profile) if args.profile else None,
            place=place,
            milestones=milestones,
            forker=forker,
        )
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        _say(f"error: {exc if isinstance(exc, DiskFull) else disk_full_message(run_dir)}")
        _say(f"continue with: areal-hex run --resume {run_dir}")
        return 1
    finally:
        if forker is not None:  # closed with the run's supervisor, unless never attached
            forker.close()
    if result.outcome.status == "interrupted":
        _say(f"interrupted; all processes stopped (continue with --resume {run_dir})")
        return 130
    if not result.ok:
        _say(f"error: {failure_message(result)}")
        _say(f"continue with: areal-hex run --resume {run_dir}")
        return 1
    keys = [
        "steps",
        "final_reward",
        "max_version_lag",
        "samples_per_s",
        "wall_time_s",
        "groups_produced",
        "groups_trained",
        "groups_dropped_stale",
        "groups_lost",
        "final_version",
    ]
    print(json.dumps({k: result.summary.get(k) for k in keys}))
    if result.summary.get("startup"):
        from hexctl.report.startup import format_timeline

        _say(format_timeline(result.summary["startup"]))
    _say(f"report in {run_dir / 'summary.json'} and {run_dir / 'report'}")
    return 0
