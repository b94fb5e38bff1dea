"""AReaL's staleness table in miniature: the same config, seed and steps at several
staleness bounds eta, naive PPO vs decoupled PPO (+ GSPO at one eta); held-out pass@1
after training, next to the initial model's (every run starts from it)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hexctl.bench.system import DEFAULT_CONFIG, scratch_dir
from hexctl.bench.system.e2e import initial_weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: tiny)")
    p.add_argument("--steps", type=int, default=20, help="trainer.total_steps of every run")
    p.add_argument("--etas", default="0,1,2,4,8", help="comma-separated staleness bounds")
    p.add_argument("--gspo-eta", type=int, default=4, help="eta of the GSPO run (-1: none)")
    p.add_argument("--eval-n", type=int, default=None, help="held-out problems (default all)")
    p.add_argument("--output-dir", default=None, help="keep the run directories here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def variants(etas: list[int], gspo_eta: int) -> list[tuple[str, int, list[str]]]:
    """(name, eta, algo overrides) of every run, in table order."""
    out = []
    for eta in etas:
        out.append(("naive", eta, ["algo.decoupled=false"]))
        out.append(("decoupled", eta, ["algo.decoupled=true"]))
    if gspo_eta >= 0:
        gspo = ["algo.decoupled=true", "algo.objective=gspo", "algo.clip_low=0.0003",
                "algo.clip_high=0.0004", "algo.aggregation=seq_mean_token_mean"]  # fmt: skip
        out.append(("gspo", gspo_eta, gspo))
    return out


def _one(config: str, overrides: list[str], run_id: str, out: str, eval_n: int | None) -> dict:
    from areal_hex.config import load_config
    from hexctl.bench.system import check_run
    from hexctl.bench.system.e2e import fresh_run_dir
    from hexctl.job.prepare import prepare_run
    from hexctl.launch.run import execute
    from hexctl.report.evaluate import EvalOptions, evaluate

    cfg = load_config(config, [*overrides, f"run.output_dir={out}", f"run.run_id={run_id}"])
    fresh_run_dir(cfg.run.run_dir())
    cfg, path = prepare_run(cfg, None, "async")
    result = execute(cfg, path, progress=False)
    check_run(result, f"run {run_id}")
    s = result.summary
    held_out = evaluate(cfg, EvalOptions("latest", n=eval_n))
    return {
        "held_out_pass@1": held_out["pass@1"],
        "held_out_problems": held_out["problems"],
        "samples_per_s": s.get("samples_per_s"),
        "groups_dropped_stale": s.get("groups_dropped_stale"),
        "final_reward": s.get("final_reward"),
        "max_version_lag": s.get("max_version_lag"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    etas = [int(e) for e in args.etas.split(",") if e.strip()]
    base = [*args.overrides, f"trainer.total_steps={args.steps}"]
    rows = []
    with scratch_dir("areal-hex-bench-algos-", args.output_dir) as out:
        # every run starts from the same initial weights, written (warm-started) once
        v0 = initial_weights(args.config, base, Path(out) / "initial")
        base.append(f"model.path={v0}")
        initial = _held_out(args.config, base, str(v0), args.eval_n)  # the baseline
        print(json.dumps({"initial_held_out_pass@1": initial}), file=sys.stderr, flush=True)
        for name, eta, algo in variants(etas, args.gspo_eta):
            ov = [*base, f"buffer.max_staleness={eta}", *algo]
            res = _one(args.config, ov, f"algos-{name}-eta{eta}", out, args.eval_n)
            rows.append({"objective": name, "max_staleness": eta, **res})
            # each run as it ends (the grid takes long): one JSON line on stderr
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {
        "config": args.config,
        "steps": args.steps,
        "initial_held_out_pass@1": initial,
        "runs": rows,
    }


def _held_out(config: str, overrides: list[str], weights: str, eval_n: int | None) -> float:
    """Held-out pass@1 of `weights` (the initial model: what every run starts from)."""
    from areal_hex.config import load_config
    from hexctl.report.evaluate import EvalOptions, evaluate

    return evaluate(load_config(config, overrides), EvalOptions(weights, n=eval_n))["pass@1"]
