"""End to end: the same config run synchronously (eta = 0, the baseline) and
asynchronously, in one invocation; reports trained samples/s of both and the speedup."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: tiny)")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps for both runs")
    p.add_argument("--eta", type=int, default=None, help="buffer.max_staleness of the async run")
    p.add_argument("--output-dir", default=None, help="keep the run directories here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def run_once(config: str, overrides: list[str], mode: str, out_dir: str) -> dict[str, Any]:
    from areal_hex.config import load_config
    from areal_hex.launch.prepare import prepare_run
    from areal_hex.launch.run import execute, failure_message

    cfg = load_config(config, [*overrides, f"run.output_dir={out_dir}", "run.run_id=null"])
    cfg.run.run_id = f"bench-{mode}"
    cfg, path = prepare_run(cfg, None, mode)
    result = execute(cfg, path, progress=False)
    if not result.ok:
        raise RuntimeError(f"{mode} run failed: {failure_message(result)}")
    return result.summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_steps={args.steps}")
    if args.eta is not None:
        overrides.append(f"buffer.max_staleness={args.eta}")
    with tempfile.TemporaryDirectory(prefix="areal-hex-bench-") as tmp:
        out = args.output_dir or tmp
        sync = run_once(args.config, overrides, "sync", out)
        asyn = run_once(args.config, overrides, "async", out)
    s, a = sync["samples_per_s"] or 0.0, asyn["samples_per_s"] or 0.0
    return {
        "config": args.config,
        "steps": asyn["steps"],
        "eta": asyn["eta"],
        "sync_samples_per_s": s,
        "async_samples_per_s": a,
        "speedup": a / s if s > 0 else None,
        "sync_wall_s": sync["wall_time_s"],
        "async_wall_s": asyn["wall_time_s"],
        "max_staleness": asyn["max_staleness"],
        "max_staleness_sync": sync["max_staleness"],
        "final_reward_sync": sync["final_reward"],
        "final_reward_async": asyn["final_reward"],
        "groups_lost_sync": sync.get("groups_lost"),
        "groups_lost_async": asyn.get("groups_lost"),
    }
