"""Heterogeneity measured: a box planned, run and held against its prediction.

One invocation, one budget, on a box (`areal-hex box`, brought up here and down at the
end): the box's kinds profiled inside their nodes (`profile --box`), then four plans run
for the same steps from the same initial weights and each held against the cost model:

- a: the planner's plan;
- b: its best one-kind plan (the planner on the box restricted to each kind in turn, the
  fastest predicted);
- c: plan a's mix and trainer placed first-fit (the trainer on the first nodes of its
  kind, instances in node order) instead of mapped onto the racks by METIS;
- d: plan a run synchronously (η = 0, the trainer waits for each batch: the baseline every
  asynchronous speed-up is measured against).

Per plan: predicted and measured pipeline samples/s (the same window and definitions as
`bench fidelity`, `hexctl/report/fidelity.py`) and the error, and the planner's own figure
for the plan with its error (`hetero_summary`, which sums the runs up); the ratios a/b, a/c, a/d
measured beside predicted; the weight-sync pause measured against predicted for each
plan, with the mode that moved the weights; and whether the measured ranking of a-d is
the predicted one (`ranking_equal`), and whether every order the prediction states holds
(`ranking_holds`: plans predicted at the same rate, such as a and a first-fit placement
identical to it, are tied, and the order their runs measure is not counted).

The head node's own speed is sampled before and after the profile and each plan's run
(`host_gflops`: `bench host`'s matmul on every core, 0.5 s, outside every quota), and
`host_moved` gives each plan's samples against the profile's: a plan whose machine ran
slower or faster than when its kinds were profiled is priced at rates it did not have.

A node's speed under its quota moves where the head node's does not (a kind profiled at
a fifth of its usual rate while every-core matmul read as before), so each kind's is
sampled too: `box_speed.node_speed`, a fixed torch block in one node of the kind, before and
after the kind's profile (kept in its `measured.json`) and before and after each plan's
run (`kind_speed`). Each plan is then priced again from the profile at those speeds
(`Profile.at_speed`: the kind's rates times its speed over its profiled speed, its times
over it), with the error, ratios and ranking of those predictions (`at_box_speed`) beside
the plain ones: the cost model held against the machine the run had.

With `--rounds R` every plan runs R times, a-d, then d-a, and so on, from the one profile;
a plan's figures are its median round's (`rounds_measured_samples_per_s` lists every
round's). The machine is shared: a run it slowed by half for minutes decides nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hexctl.bench.system.hetero_summary import (
    LABELS,
    figures_table,
    median_round,
    pipeline_of,
    plan_of,
    round_order,
    summarise,
)

DEFAULT_BOX_CONFIG = "examples/box/tiny_box.yaml"
# each plan's steps: a window (from step η + 1) of 95 steps of the box job's 8 groups.
# On a shared machine one 5-s sample moves by a third and an 80-s mean by a few per cent
# (`bench host`); 40 steps left the fastest plans a window of 9-13 s
STEPS = 100


HOST_PROBE_S = 0.5  # seconds of `bench host`'s matmul per sample of the head node


def _host_gflops() -> float:
    """The head node's matmul GFLOP/s now on every core (`bench host`'s sample): a core
    the host's other tenants take shows here, where one thread would still find one."""
    from hexctl.bench.system.host import sample

    return round(sample(HOST_PROBE_S, os.cpu_count() or 1)[0], 2)


def host_moved(host: dict[str, list[float]]) -> dict[str, float | None]:
    """Each plan's host samples (mean) against the profile's: + ran faster, − slower;
    None without a profile's (`--profile-dir`)."""
    base = host.get("profile")
    out: dict[str, float | None] = {}
    for label, got in host.items():
        if label == "profile":
            continue
        out[label] = round(sum(got) / len(got) / (sum(base) / len(base)) - 1, 4) if base else None
    return out


def speed_nodes(spec: Any, files: Any) -> list[str]:
    """The node each kind's speed is sampled on: the one its profile sampled, else the
    kind's first."""
    kinds = json.loads(files.measured.read_text()).get("kinds", {})
    nodes = []
    for kind in spec.spec.kinds:
        named = ((kinds.get(kind) or {}).get("node_speed") or {}).get("node")
        first = next((n.name for n in spec.nodes if n.kind == kind), None)
        if named or first:
            nodes.append(named or first)
    return nodes


def kind_speed(spec: Any, probes: list[Any]) -> dict[str, float]:
    """Each kind's node speed now (`box_speed.node_speed`), by kind; a kind whose sample failed
    is left out."""
    from hexctl.box.speed import node_speed

    kind_of = {n.name: n.kind for n in spec.nodes}
    return {kind_of[n]: v for n, v in node_speed(probes).items() if v is not None}


def _say(text: str) -> None:
    """Progress on stderr; the JSON result alone goes to stdout."""
    print(f"bench hetero: {text}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--box", required=True, help="box YAML (examples/box/)")
    p.add_argument("--budget", type=float, required=True, help="$/h every plan is made at")
    p.add_argument("--config", default=DEFAULT_BOX_CONFIG, help="experiment YAML")
    p.add_argument("--steps", type=int, default=STEPS, help="trainer.total_steps of every run")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every plan this many times, a-d then d-a in turn; each plan's figures "
        "are its median round's (default: 1)",
    )
    p.add_argument("--output-dir", default=None, help="keep the profile, plans and runs here")
    p.add_argument(
        "--profile-dir", default=None, help="a `profile --box` of this box to reuse (no profile)"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


# ---------------------------------------------------------------- the plans
def plan_inputs(files: Any) -> tuple[Any, Any, Any, Any]:
    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.profile import load_profile
    from scheduler.workload import load_workload

    cl = load_cluster(files.cluster)
    m = load_model_shape(str(files.model))
    return cl, m, load_workload(files.workload), load_profile(files.profile, m.params)


def one_kind_cluster(cl: Any, group: str) -> Any:
    """The inventory with only node group `group`'s kind; a rack without it is left out."""
    from scheduler.cluster import one_kind

    return one_kind(cl, cl.kinds[group].name)


def make_plans(files: Any, budget: float, time_limit_s: float = 60.0) -> dict[str, Any]:
    """Plans a, b, c (d is a, run synchronously), each with the sources the run prices
    it from."""
    from areal_hex.config import ConfigError
    from scheduler.planner import make_plan, to_plan

    cl, m, w, prof = plan_inputs(files)
    label = str(files.model)
    res = make_plan(cl, m, w, budget=budget, prof=prof, model_label=label,
                    time_limit_s=time_limit_s, baselines=False)  # fmt: skip
    plans = {"a": res.plan}
    if res.first_fit is None:
        raise ConfigError("the box declares no NICs or racks: first-fit is METIS's placement")
    plans["c"] = to_plan(cl, m, w, res.first_fit, budget, None, label, None, {}, 0.0)
    one_kind = []
    for g in cl.spec.node_groups:
        try:
            alone = one_kind_cluster(cl, g.name)
            r = make_plan(alone, m, w, budget=budget, prof=prof, model_label=label,
                          time_limit_s=time_limit_s, baselines=False)  # fmt: skip
        except ConfigError:
            continue  # the kind alone cannot make a plan at this budget
        one_kind.append(r.plan)
    if not one_kind:
        raise ConfigError(f"no one-kind plan fits ${budget:g}/h on this box")
    plans["b"] = max(one_kind, key=lambda p: p.predicted.samples_per_s)
    return with_sources(plans, files)


def with_sources(plans: dict[str, Any], files: Any) -> dict[str, Any]:
    """`plans`, each naming the profile's files a run prices it from."""
    from areal_hex.plan import PlanSources

    sources = PlanSources(
        cluster=str(files.cluster.resolve()),
        workload=str(files.workload.resolve()),
        profile=str(files.profile.resolve()),
    )
    for p in plans.values():
        p.sources = sources
    return plans


# ---------------------------------------------------------------- the runs
def run_plan(
    config: str,
    overrides: list[str],
    out: Path,
    label: str,
    plan: Any,
    mode: str,
    run_id: str | None = None,
) -> dict[str, Any]:
    """One run of `plan` on the box; its fidelity block over the window after the
    config's η + 1 steps, the same window in either mode (as `bench fidelity`). The
    controller makes no group before every planned server is up and holds the current
    weights (`rollout.wait_for_servers=all`: a server on a small share of a core starts
    for a minute), so the window is the plan's; the block's `servers` says whether it was."""
    from areal_hex.config import load_config
    from areal_hex.run_files import RunPaths
    from hexctl.bench.system import check_run
    from hexctl.bench.system.e2e import fresh_run_dir
    from hexctl.box.delivered import DeliverySampler, held_back_lines
    from hexctl.box.place import place_on_box
    from hexctl.box.run_config import apply_box
    from hexctl.job.prepare import prepare_run
    from hexctl.launch.run import execute
    from hexctl.report.fidelity import fidelity_block

    given = ["rollout.wait_for_servers=all", *overrides]
    cfg = load_config(config, [*given, f"run.output_dir={out}", "run.run_id=null"])
    skip = cfg.buffer.max_staleness + 1
    cfg.run.run_id = run_id or f"plan-{label}"
    fresh_run_dir(cfg.run.run_dir())
    cfg, path = prepare_run(cfg, plan, mode, place=apply_box)
    t0 = time.monotonic()
    nodes = box_nodes(cfg.run.box)
    with DeliverySampler(nodes) as sampler:
        result = execute(cfg, path, plan, progress=False, place=place_on_box)
    # interrupted (Ctrl-C, SIGTERM): through the bench's `finally` that takes the box down
    check_run(result, f"plan {label} ({mode})")
    ran = load_config(path)
    block = fidelity_block(result.run_dir, ran, from_step=skip)
    wall = round(time.monotonic() - t0, 1)
    delivered = cpu_delivered(sampler, nodes, result.run_dir, skip)
    for line in held_back_lines(f"plan {label} ({mode})", delivered):
        print(line, file=sys.stderr, flush=True)
    launched = json.loads(RunPaths.at(result.run_dir).prediction.read_text())
    return {
        "block": block,
        "wall_s": wall,
        "mode": mode,
        "sync": ran.rollout.weight_sync,
        "cfg": ran,
        "samples_per_step": ran.buffer.groups_per_step * ran.rollout.group_size,
        "host_cores": launched.get("host_cores", "trainer"),
        "cpu_delivered": delivered,
    }


def box_nodes(box_name: str | None) -> list[Any]:
    """The counters of every node of the box the run is on (`delivered.NodeCgroup`)."""
    from hexctl.box.delivered import NodeCgroup
    from hexctl.box.emulate import load_state

    return (
        [] if box_name is None else [NodeCgroup.of(n) for n in load_state(box_name).nodes.values()]
    )


def cpu_delivered(sampler: Any, nodes: list[Any], run_dir: Path, from_step: int) -> dict[str, Any]:
    """What the machine delivered to each node that ran in the run's measured window (the
    fidelity block's: from step `from_step`'s row to the last, by the rows' wall clock)."""
    from areal_hex.run_files import RunPaths, TrainerRow, read_rows
    from hexctl.box.delivered import delivered_block
    from hexctl.report.fidelity import window

    rows = window(read_rows(RunPaths.at(run_dir).metrics, TrainerRow), from_step)
    if len(rows) < 2:
        return {"unavailable": "the run has fewer than two trainer steps"}
    quotas = {n.name: n.quota_cores for n in nodes}
    return delivered_block(sampler.readings, quotas, rows[0].time, rows[-1].time)


# ---------------------------------------------------------------- the box's speed
def speed_factors(profiled: dict[str, float], samples: list[dict[str, float]]) -> dict[str, float]:
    """Each kind's speed around a plan's run over its speed while it was profiled: the
    mean of the run's samples (`box_speed.node_speed`, kind -> speed) over the profile's."""
    out = {}
    for kind, base in profiled.items():
        got = [s[kind] for s in samples if kind in s]
        if got and base > 0:
            out[kind] = round(sum(got) / len(got) / base, 4)
    return out


def predict_at_speed(
    run: dict[str, Any], plan: Any, factors: dict[str, float], out: Path
) -> dict[str, Any] | None:
    """The launcher's prediction for `run` again, from the profile with each kind at the
    speed it was sampled at around the run (`Profile.at_speed`): the cost model held
    against the machine the run had, not the one the profile had. The scaled profile is
    kept as `out`; None where the plan names no profile."""
    from hexctl.job.predict import predict_run
    from scheduler.profile import load_profile, save_profile

    if plan.sources is None or plan.sources.profile is None:
        return None
    save_profile(load_profile(plan.sources.profile).at_speed(factors), out)
    moved = plan.model_copy(deep=True)
    moved.sources.profile = str(out.resolve())
    pred = predict_run(run["cfg"], moved, None, run["host_cores"])
    if "unavailable" in pred:
        return None
    return pred["synchronous" if run["mode"] == "sync" else "asynchronous"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from areal_hex.errors import UsageError
    from areal_hex.plan import save_plan
    from hexctl.bench.system.emulated import box_session
    from hexctl.box import emulate as box
    from hexctl.box.checks import check_budget, check_fits
    from hexctl.box.profile import profiled_speed
    from hexctl.box.spec import load_box

    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: expected a whole number of rounds, 1 or more")
    spec = load_box(args.box)
    check_fits(spec)  # every refusal before the box is built and profiled
    check_budget(spec, args.budget)
    box.check_host()
    with box_session(args, spec, "areal-hex-hetero-") as session:
        out, overrides, state = session.out, session.overrides, session.state
        host: dict[str, list[float]] = {} if args.profile_dir else {"profile": [_host_gflops()]}
        files = session.profile(args, _say)
        if "profile" in host:
            host["profile"].append(_host_gflops())
        plans = make_plans(files, args.budget)
        for label, plan in plans.items():
            save_plan(plan, out / f"plan-{label}.yaml")
        profiled = profiled_speed(files)
        # one node of each kind, the one its profile ran on where it says so
        probes = [state.node(n) for n in speed_nodes(spec, files)]
        rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in LABELS}
        for r, label in round_order(args.rounds):
            mode = "sync" if label == "d" else "async"
            of = f", round {r + 1}/{args.rounds}" if args.rounds > 1 else ""
            _say(f"running plan {label} ({mode}, {args.steps} steps{of})")
            plan = plan_of(plans, label)
            run_id = f"plan-{label}" + (f"-r{r + 1}" if r else "")
            host.setdefault(label, []).append(_host_gflops())
            before = kind_speed(spec, probes)
            got = run_plan(args.config, overrides, out, label, plan, mode, run_id)
            got["speed"] = [before, kind_speed(spec, probes)]
            host[label].append(_host_gflops())
            rounds[label].append(got)
        runs, at_speed, speed = {}, {}, {}
        for label in LABELS:
            runs[label] = rounds[label][median_round(rounds[label])]
            if args.rounds > 1:
                runs[label]["rounds"] = [pipeline_of(r["block"], "measured") for r in rounds[label]]
            runs[label]["rounds_cpu_delivered"] = [r.get("cpu_delivered") for r in rounds[label]]
            speed[label] = runs[label]["speed"]
            plan = plan_of(plans, label)
            factors = speed_factors(profiled, speed[label])
            if factors:
                at = out / "at-speed" / f"profile-{label}.yaml"
                at.parent.mkdir(parents=True, exist_ok=True)
                got = predict_at_speed(runs[label], plan, factors, at)
                at_speed[label] = {"factors": factors, "predicted": got}
        result = summarise(runs, plans, at_speed)
        result["host_gflops"], result["host_moved"] = host, host_moved(host)
        result["kind_speed"] = {"profile": profiled, **speed}
        _say("each plan's rate, samples/s:\n" + figures_table(result))
    return box_result(args, spec.name, state.cpu_check, session.load_start, result)


def box_result(
    args: argparse.Namespace,
    box_name: str,
    cpu_check: dict[str, float],
    load_start: float,
    result: dict[str, Any],
) -> dict[str, Any]:
    """A box bench's JSON object: its arguments, `result`, and what the box left."""
    from hexctl.box import emulate as box

    return {
        "box": box_name,
        "budget_usd_per_h": args.budget,
        "steps": args.steps,
        "rounds": getattr(args, "rounds", 1),  # `bench modes --box`: one round
        "config": args.config,
        **result,
        "cpu_check": cpu_check,
        "left_behind": box.leftovers(box_name),
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }
