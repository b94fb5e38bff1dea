"""`areal-hex plan CLUSTER --model M (--budget $ | --target-rate R)` and `areal-hex profile`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from areal_hex.config.base import load_yaml_text

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

    q = sub.add_parser(
        "profile",
        help="measure generation and training rates of a model on the devices present",
        description="Times transformers prefill/decode and a torch training step of a model "
        "(default: a tiny Qwen3) on CPU or CUDA and writes a profile for `plan --profile`.",
    )
    q.add_argument("--out", default="profile.yaml", help="profile file to write")
    q.add_argument("--model-config", help="HF config.json to profile (default: tiny Qwen3)")
    q.add_argument(
        "--kind",
        help="GPU kind name to file the rates under (default: CPU or "
        "the CUDA device's catalogue name)",
    )
    q.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    q.add_argument("--batches", default="1,4,16", help="decode batch sizes to time")
    q.add_argument("--context", type=int, default=128, help="context length for decode")
    q.add_argument("--json", action="store_true", help="print the profile as JSON")
    q.add_argument(
        "--local",
        action="store_true",
        help="this machine as a cluster: time the job's own engines on the devices `run` "
        "uses (CPU core groups of run.pin_cores, or the GPUs) and write cluster.yaml, "
        "profile.yaml, workload.yaml and model/ into --out-dir",
    )
    q.add_argument(
        "--box",
        help="a box that is up (`areal-hex box up BOX.yaml`): time each of its kinds inside "
        "one of its nodes and write the box as the inventory (cluster.yaml) into --out-dir",
    )
    q.add_argument("--config", help="--local: the experiment YAML (default: the tiny example)")
    q.add_argument("--out-dir", default="local-profile", help="--local: where to write")
    q.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="--local: config overrides")
    q.set_defaults(func=_profile)


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
            b = res.plan.baselines
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


def _profile(args: argparse.Namespace) -> int:
    from hexctl.cli import UsageError
    from scheduler.measure import measure_profile
    from scheduler.profile import save_profile

    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        raise UsageError(f"--batches {args.batches!r}: expected integers like 1,4,16") from None
    if not batches or min(batches) < 1:
        raise UsageError(f"--batches {args.batches!r}: expected positive integers")
    from hexctl.profile.controller import ProfileFailed

    try:
        if args.box:
            return _profile_box(args, batches)
        if args.local:
            return _profile_local(args, batches)
    except ProfileFailed as exc:
        print(f"areal-hex profile: error: {exc}", file=sys.stderr)
        return 1
    if args.overrides or args.config:
        raise UsageError("--config and KEY=VALUE overrides apply to --local only")
    prof = measure_profile(
        Path(args.model_config) if args.model_config else None,
        args.device,
        args.kind,
        batches,
        args.context,
    )
    path = save_profile(prof, args.out)
    if args.json:
        print(json.dumps(prof.model_dump(mode="json"), indent=2))
    else:
        for kind, r in prof.kinds.items():
            steps = ", ".join(f"b={b}: {s * 1e3:.1f} ms" for b, s in r.decode_step_s.items())
            print(
                f"{kind} ({r.device}): decode step {steps}; prefill "
                f"{r.prefill_tokens_per_s:,.0f} tok/s; train {r.train_tokens_per_s:,.0f} tok/s"
            )
        print(f"wrote {path}")
    return 0


def _progress(text: str) -> None:
    """A profile's stage as it begins, on stderr (stdout carries the result)."""
    print(f"areal-hex profile: {text}", file=sys.stderr, flush=True)


def _trainer_extras(measured: dict) -> str:
    pub, ckpt = measured.get("train_publish_s"), measured.get("train_checkpoint_s")
    out = "" if pub is None else f", a weight publish {pub * 1e3:.1f} ms of a step"
    return out + ("" if ckpt is None else f", a checkpoint {ckpt * 1e3:.0f} ms")


def _profile_local(args: argparse.Namespace, batches: list[int]) -> int:
    from areal_hex.config import load_config
    from hexctl.bench.e2e import DEFAULT_CONFIG
    from hexctl.profile.local import profile_local

    cfg = load_config(args.config or DEFAULT_CONFIG, list(args.overrides))
    given = args.batches != "1,4,16"  # the default is for the tiny HF profile
    files = profile_local(cfg, Path(args.out_dir), batches if given else None, say=_progress)
    measured = json.loads(files.measured.read_text())
    if args.json:
        print(json.dumps(measured, indent=2))
        return 0
    gen = measured["generation"]
    steps = ", ".join(f"b={b}: {s * 1e3:.2f} ms" for b, s in gen["decode_step_s"].items())
    dev = measured["devices"]
    reload = f"reload {gen['reload_s'] * 1e3:.1f} ms (idle {gen['reload_idle_s'] * 1e3:.1f})"
    print(
        f"{dev['kind']} x {dev['count']} ({dev['device']}): decode step {steps}; prefill "
        f"{gen['prefill_tokens_per_s']:,.0f} tok/s; train {measured['train_tokens_per_s']:,.0f} "
        f"tok/s{_trainer_extras(measured)}; {reload}; prompt {gen['prompt_tokens']:.0f} and answer "
        f"{gen['response_tokens']:.1f} tokens on average; the run's controller keeping the "
        f"server full: {gen['continuous_samples_per_s']:,.1f} samples/s (efficiency "
        f"{measured['generation_efficiency']:.2f}), {gen['host_cpu_s_per_sample'] * 1e3:.2f} "
        f"ms of controller CPU per sample; a synchronous step's batch "
        f"{gen['sync_cycle_s'] * 1e3:.0f} ms after its publish ("
        f"{measured['sync_cycle_factor']:.2f} x the replay)"
    )
    print(
        f"wrote {files.root}/: cluster.yaml profile.yaml workload.yaml model/\nnext: areal-hex "
        f"plan {files.cluster} --model {files.model} --workload {files.workload} --profile "
        f"{files.profile} --budget {dev['count']} --out plan.yaml"
    )
    return 0


def _profile_box(args: argparse.Namespace, batches: list[int]) -> int:

    from areal_hex.config import load_config
    from hexctl.bench.e2e import DEFAULT_CONFIG
    from hexctl.job import box
    from hexctl.job.box_spec import load_box
    from hexctl.profile.box import profile_box

    spec = load_box(args.box)
    box.check_host()
    state = box.load_state(spec.name)
    cfg = load_config(args.config or DEFAULT_CONFIG, list(args.overrides))
    given = args.batches != "1,4,16"
    files = profile_box(
        cfg, spec, state, Path(args.out_dir), batches if given else None, say=_progress
    )
    prof = load_yaml_text(files.profile.read_text(), str(files.profile))
    for kind, r in prof["kinds"].items():
        steps = ", ".join(f"b={b}: {s * 1e3:.2f} ms" for b, s in r["decode_step_s"].items())
        print(
            f"{kind}: decode step {steps}; prefill {r['prefill_tokens_per_s']:,.0f} tok/s; "
            f"train {r['train_tokens_per_s']:,.0f} tok/s; generation efficiency "
            f"{r['generation_efficiency']:.2f}"
        )
    print(
        f"wrote {files.root}/: cluster.yaml profile.yaml workload.yaml model/\nnext: areal-hex "
        f"plan {files.cluster} --model {files.model} --workload {files.workload} --profile "
        f"{files.profile} --budget USD_PER_H --out plan.yaml"
    )
    return 0
