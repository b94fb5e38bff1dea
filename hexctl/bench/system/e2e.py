"""End to end: the same config run synchronously (eta = 0, the baseline) and
asynchronously, in one invocation; reports trained samples/s of both and the speedup."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hexctl.bench.system import DEFAULT_CONFIG, scratch_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: tiny)")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps for both runs")
    p.add_argument("--eta", type=int, default=None, help="buffer.max_staleness of the async run")
    p.add_argument("--output-dir", default=None, help="keep the run directories here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def run_once(
    config: str, overrides: list[str], mode: str, out_dir: str, plan_path: Path | None = None
) -> dict[str, Any]:
    from areal_hex.config import load_config
    from areal_hex.plan import load_plan
    from hexctl.bench.system import check_run
    from hexctl.job.prepare import prepare_run
    from hexctl.launch.run import execute

    # Each run is held against its prediction and placed by it: the machine is profiled
    # for the job (once; later runs reuse it), whatever the config says, unless overridden.
    first = ["run.profile_first=true"]
    cfg = load_config(config, [*first, *overrides, f"run.output_dir={out_dir}", "run.run_id=null"])
    cfg.run.run_id = f"bench-{mode}"
    fresh_run_dir(cfg.run.run_dir())
    plan = load_plan(plan_path) if plan_path is not None else None
    cfg, path = prepare_run(cfg, plan, mode)
    result = execute(cfg, path, plan, progress=False)
    check_run(result, f"the {mode} run")
    return result.summary


def fresh_run_dir(run_dir: Path) -> None:
    """A benchmark's run starts from nothing: in the directory of an earlier one it would
    resume that run (its steps already done) and report that run's figures as its own."""
    from areal_hex.config import ConfigError

    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"--output-dir: {run_dir} holds a run of an earlier benchmark, which this one "
            "would resume and report as its own; pass an empty or new --output-dir"
        )


def out_dir_of(summary: dict[str, Any], out: str) -> str:
    return str(Path(out) / str(summary["run_id"]))


def steady_rate(run_dir: Path, group_size: int, skip: int) -> float:
    """Trained samples/s between step `skip` and the last step (from metrics.jsonl)."""
    from areal_hex.run_files import RunPaths, TrainerRow, read_rows

    rows = read_rows(RunPaths.at(run_dir).metrics, TrainerRow)
    if len(rows) < 2:
        return 0.0
    first = rows[min(max(skip, 1), len(rows) - 1) - 1]
    last = rows[-1]
    dt = last.time - first.time
    groups = last.groups_trained_total - first.groups_trained_total
    return groups * group_size / dt if dt > 0 else 0.0


def initial_weights(config: str, overrides: list[str], out: Path) -> Path:
    from areal_hex.config import load_config
    from hexctl.job.prepare import materialize_v0

    cfg = load_config(config, overrides)
    return materialize_v0(cfg, out.resolve())


def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_steps={args.steps}")
    if args.eta is not None:
        overrides.append(f"buffer.max_staleness={args.eta}")
    with scratch_dir("areal-hex-bench-", args.output_dir) as out:
        # both runs start from the same initial weights, written (warm-started) once
        v0 = initial_weights(args.config, overrides, Path(out) / "initial")
        overrides.append(f"model.path={v0}")
        sync = run_once(args.config, overrides, "sync", out)
        asyn = run_once(args.config, overrides, "async", out)
        # The same window in both runs: after the first eta + 1 steps, whose batches the
        # async run could generate before the trainer started (a head start, not rate).
        skip = asyn["max_staleness"] + 1
        s = steady_rate(Path(out_dir_of(sync, out)), sync["group_size"], skip)
        a = steady_rate(Path(out_dir_of(asyn, out)), asyn["group_size"], skip)
    return {
        "config": args.config,
        "steps": asyn["steps"],
        "window_from_step": skip,
        "max_staleness": asyn["max_staleness"],
        "sync_samples_per_s": s,
        "async_samples_per_s": a,
        "speedup": a / s if s > 0 else None,
        "sync_wall_s": sync["wall_time_s"],
        "async_wall_s": asyn["wall_time_s"],
        "max_version_lag": asyn["max_version_lag"],
        "max_version_lag_sync": sync["max_version_lag"],
        "final_reward_sync": sync["final_reward"],
        "final_reward_async": asyn["final_reward"],
        "groups_lost_sync": sync.get("groups_lost"),
        "groups_lost_async": asyn.get("groups_lost"),
    }
