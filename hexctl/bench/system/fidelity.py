"""Plan fidelity: profile this machine, plan the job on it, run the plan asynchronously and
synchronously, and hold both runs against the plan's cost model.

One invocation: `profile --local` (the job's engines on the devices `run` uses), `plan`
(budget: every device), then `run --plan` twice from the same initial weights. Rates are
compared over the same window in both runs (from step η + 1 of the async run), with the
definitions of `hexctl/report/fidelity.py`. Also reported: the overlap limit, what a perfect
asynchronous run would reach on the synchronous run's phases, B·G / max(generation time,
training time) per step, and the async run's share of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from hexctl.bench.system import DEFAULT_CONFIG, scratch_dir
from hexctl.bench.system.e2e import initial_weights, run_once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: tiny)")
    p.add_argument(
        "--steps", type=int, default=100, help="trainer.total_steps of both runs (default: 100)"
    )
    p.add_argument("--output-dir", default=None, help="keep the profile, plan and runs here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def plan_local(files: Any, time_limit_s: float = 60.0) -> Any:
    """The plan for the local cluster `files` describes, every device in the budget."""
    from areal_hex.plan import PlanSources
    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.planner import make_plan
    from scheduler.profile import load_profile
    from scheduler.workload import load_workload

    cl = load_cluster(files.cluster)
    m = load_model_shape(str(files.model))
    w = load_workload(files.workload)
    prof = load_profile(files.profile, m.params)
    budget = sum(g.nodes * g.gpus_per_node * g.usd_per_gpu_hour for g in cl.spec.node_groups)
    res = make_plan(cl, m, w, budget=budget, prof=prof, model_label=str(files.model),
                    time_limit_s=time_limit_s, baselines=False)  # fmt: skip
    res.plan.sources = PlanSources(
        cluster=str(files.cluster.resolve()),
        workload=str(files.workload.resolve()),
        profile=str(files.profile.resolve()),
    )
    return res.plan


def phase_times(run_dir: Path, from_step: int) -> tuple[float, float]:
    """(generation, training) seconds per step of a synchronous run: the wait for the
    batch, and the rest of the step."""
    from areal_hex.run_files import RunPaths, TrainerRow, read_rows
    from hexctl.report.fidelity import window

    rows = window(read_rows(RunPaths.at(run_dir).metrics, TrainerRow), from_step)
    gen = [b.wait_s for b in rows[1:]]
    train = [(b.time - a.time) - b.wait_s for a, b in zip(rows, rows[1:], strict=False)]
    return statistics.fmean(gen), statistics.fmean(train)


def _err(block: dict[str, Any], key: str) -> float | None:
    errs = block.get("relative_error") or {}
    v = errs.get(key)
    return None if v is None else round(v, 4)


def _rounded(d: dict[str, Any] | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {k: None if v is None else round(v, 4) for k, v in d.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from areal_hex.config import load_config
    from areal_hex.plan import save_plan
    from hexctl.profile.local import profile_local
    from hexctl.report.fidelity import fidelity_block

    overrides = [*args.overrides, f"trainer.total_steps={args.steps}"]
    load_start = os.getloadavg()[0]
    with scratch_dir("areal-hex-fidelity-", args.output_dir) as scratch:
        out = Path(scratch)
        v0 = initial_weights(args.config, overrides, out / "initial")
        overrides.append(f"model.path={v0}")
        cfg = load_config(args.config, overrides)
        files = profile_local(cfg, out / "profile")
        plan = plan_local(files)
        plan_path = save_plan(plan, out / "plan.yaml")
        asyn = run_once(args.config, overrides, "async", str(out), plan_path)
        sync = run_once(args.config, overrides, "sync", str(out), plan_path)
        skip = asyn["max_staleness"] + 1  # the same window in both runs
        a_dir, s_dir = out / str(asyn["run_id"]), out / str(sync["run_id"])
        a_cfg = load_config(a_dir / "config.yaml")
        s_cfg = load_config(s_dir / "config.yaml")
        fa = fidelity_block(a_dir, a_cfg, from_step=skip)
        fs = fidelity_block(s_dir, s_cfg, from_step=skip)
        gen_t, train_t = phase_times(s_dir, skip)
    bg = a_cfg.buffer.groups_per_step * a_cfg.rollout.group_size
    limit = bg / max(gen_t, train_t)
    meas_async = fa["measured"]["pipeline_samples_per_s"]
    pred = {m: (f.get("predicted") or {}).get("pipeline_samples_per_s") for m, f in
            (("async", fa), ("sync", fs))}  # fmt: skip
    return {
        "config": args.config,
        "overrides": list(args.overrides),
        "steps": args.steps,
        "window_from_step": skip,
        "device_kind": plan.trainer.gpu_kind,
        "plan": {
            "rollout_instances": len(plan.rollout),
            "trainer_ranks": plan.trainer.world_size,
            "predicted_samples_per_s": plan.predicted.samples_per_s,
        },
        "pred_async": _round(pred["async"]),
        "meas_async": _round(meas_async),
        "err_async": _err(fa, "pipeline_samples_per_s"),
        "pred_sync": _round(pred["sync"]),
        "meas_sync": _round(fs["measured"]["pipeline_samples_per_s"]),
        "err_sync": _err(fs, "pipeline_samples_per_s"),
        "err_generation_async": _err(fa, "generation_samples_per_s"),
        "err_training_async": _err(fa, "training_samples_per_s"),
        "err_weight_sync_async": _err(fa, "weight_sync_s"),
        "err_generation_sync": _err(fs, "generation_samples_per_s"),
        "err_training_sync": _err(fs, "training_samples_per_s"),
        "err_weight_sync_sync": _err(fs, "weight_sync_s"),
        "sync_generation_s_per_step": round(gen_t, 4),
        "sync_training_s_per_step": round(train_t, 4),
        "overlap_limit": round(limit, 4),
        "async_share_of_limit": None if meas_async is None else round(meas_async / limit, 4),
        "predicted_async": _rounded(fa.get("predicted")),
        "measured_async": _rounded(fa["measured"]),
        "predicted_sync": _rounded(fs.get("predicted")),
        "measured_sync": _rounded(fs["measured"]),
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(),
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
