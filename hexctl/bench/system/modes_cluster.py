"""Execution modes, here or on a box (--box): every mode from one v0, in one invocation.

On this machine: `modes.py`, the same job in every placement and staleness mode.

`bench modes --box BOX --budget B`: every execution mode run on a box (`areal-hex box`,
brought up here and down at the end).

The box's kinds are profiled inside their nodes once (`profile --box`), or a profile is
reused (`--profile-dir`); the planner then makes its best plan of each placement at the
budget from that profile (`PlanResult.by_placement`: the disaggregated plan, its
colocated counterpart, generation and training in turn on the trainer's node, and its
hybrid one, the trainer's node lent to generation while the trainer waits), and each
mode runs its placement's plan in its staleness mode (`modes.MODES`):

- disaggregated async and sync: the disaggregated plan, η as planned, or η = 0;
- colocated sync: the colocated plan (the servers and the trainer in one node's quota,
  taking turns: `rollout_service/controller/colocate.py`);
- hybrid async and sync: the hybrid plan (its lent servers in the trainer's node).

Each run goes through `bench hetero`'s runner (`hetero.run_plan`: the plan's services in
their nodes, the same window from step η + 1 as `bench fidelity`); its prediction is the
cost model's for the run's layout in its mode (`prediction.json`, the figure the run is
held against), priced before any run as the launcher prices it (`mode_predictions`),
so the planner's pick is known before the first run. The JSON is `bench modes`' own
(`modes.report`: each mode's predicted and measured samples/s and error, `planner_pick`,
`measured_ranking`, `predicted_ranking`), with each mode's plan (nodes, cost, the plan's
own rate), `plan_pick` (the placement `areal-hex plan` recommends at this budget) and
`skipped`: each mode the box cannot run, and why.

What a box cannot run is refused before it is built or profiled: a mode named in
`--modes` that needs more nodes than the box has or the budget buys (disaggregated and
hybrid: a trainer node and one that generates; colocated: one node). Without `--modes`
such modes are skipped and named."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from areal_hex.errors import UsageError
from hexctl.bench.system.hetero import DEFAULT_BOX_CONFIG
from hexctl.bench.system.modes import MODES

STEPS = 60  # `bench tasks`' window: a box's node runs at a fraction of a core
# why the planner makes no plan of a placement (`scheduler/by_placement.py`)
NO_PLAN = {
    "disaggregated": "no split of the box's nodes within the budget generates",
    "colocated": "no trainer node within the budget also generates (no rollout option fits it)",
    "hybrid": "its split has no server of its own, its trainer's node fits no rollout "
    "option, or its publish interval k is above 1",
}
# nodes a placement needs on a box (one device each): a trainer node and one that
# generates, or one node both take turns on
NODES_NEEDED = {"disaggregated": 2, "hybrid": 2, "colocated": 1}


def _say(text: str) -> None:
    print(f"bench modes: {text}", file=sys.stderr, flush=True)


def add_box_arguments(p: argparse.ArgumentParser) -> None:
    """`bench modes`' options for a box run."""
    p.add_argument(
        "--box",
        default=None,
        help="run every mode on this box (examples/box/); default: on this machine",
    )
    p.add_argument("--budget", type=float, default=None, help="$/h the box's plans are made at")
    p.add_argument(
        "--profile-dir", default=None, help="a `profile --box` of this box to reuse (no profile)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hexctl.bench.system.modes import add_arguments as add_mode_arguments

    add_mode_arguments(p)
    add_box_arguments(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`bench modes`: on the box `--box` names, else on this machine (`modes.run`)."""
    from hexctl.bench.system.modes import run as run_here

    check_box_arguments(args)
    return run_on_box(args) if args.box is not None else run_here(args)


# ---------------------------------------------------------------- refusals, in seconds
def check_box_arguments(args: argparse.Namespace) -> None:
    """The options a box run needs and those it cannot take, named (`--budget` and
    `--profile-dir` without `--box` are refused the same way)."""
    if args.box is None:
        given = [f for f, v in (("--budget", args.budget), ("--profile-dir", args.profile_dir))
                 if v is not None]  # fmt: skip
        if given:
            raise UsageError(
                f"bench modes: {' and '.join(given)} without --box: expected --box BOX.yaml "
                "(on this machine the modes use its own profile)"
            )
        return
    if args.budget is None:
        raise UsageError("bench modes --box: expected --budget B ($/h every plan is made at)")
    if not (math.isfinite(args.budget) and args.budget > 0):
        raise UsageError(f"--budget {args.budget:g}: expected a positive number of $/h")
    for flag, given in (
        ("--profile-first", args.profile_first),
        ("--profile-fresh", args.profile_fresh),
    ):
        if given:
            raise UsageError(
                f"bench modes --box: {flag} is for this machine; a box is profiled by "
                "the bench itself (or reused with --profile-dir)"
            )
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: expected 1 or more")
    if args.profile_dir is not None and not (Path(args.profile_dir) / "profile.yaml").is_file():
        raise UsageError(
            f"--profile-dir {args.profile_dir}: no profile.yaml there; expected the output "
            "directory of `areal-hex profile --box` for this box"
        )


def why_not(box: Any, budget: float, name: str) -> str | None:
    """Why `box` cannot run mode `name` at `budget` $/h; None where it can."""
    placement = MODES[name].placement
    need = NODES_NEEDED[placement]
    if len(box.nodes) < need:
        return (
            f"box {box.name!r} has {len(box.nodes)} node; a {placement} plan needs {need} "
            "(one trains, one generates)"
        )
    cheapest = round(sum(sorted(box.spec.kinds[n.kind].usd_per_hour for n in box.nodes)[:need]), 6)
    if cheapest > budget + 1e-9:
        nodes = "node costs" if need == 1 else f"{need} nodes cost"
        return (
            f"--budget {budget:g} buys no {placement} plan: its cheapest {nodes} {cheapest:g} $/h"
        )
    return None


def runnable_modes(
    box: Any, budget: float, names: list[str], named: bool
) -> tuple[list[str], dict[str, str]]:
    """(the modes to run, {mode: why} of those skipped). A mode the box cannot run is
    refused where `--modes` named it (`named`), else skipped; refused too where none is
    left."""
    skipped = {n: why for n in names if (why := why_not(box, budget, n)) is not None}
    left = [n for n in names if n not in skipped]
    if skipped and (named or not left):
        lines = "\n  ".join(f"{n}: {why}" for n, why in skipped.items())
        raise UsageError(
            f"bench modes --box {box.name}: the box cannot run "
            f"{'these modes' if len(skipped) > 1 else 'this mode'}:\n  {lines}\n"
            "expected a box with more nodes, a larger --budget, or --modes without them"
        )
    return left, skipped


# ---------------------------------------------------------------- the plans and prices
def mode_plans(
    files: Any, budget: float, names: list[str], time_limit_s: float = 60.0
) -> tuple[dict[str, Any], dict[str, str], str]:
    """(each mode's plan, {mode: why} of the modes the planner made no plan for, the
    mode of the plan `areal-hex plan` picks) from a box profile's files at `budget`."""
    from hexctl.bench.system.hetero import plan_inputs, with_sources
    from scheduler.planner import make_plan

    cl, m, w, prof = plan_inputs(files)
    res = make_plan(cl, m, w, budget=budget, prof=prof, model_label=str(files.model),
                    time_limit_s=time_limit_s)  # fmt: skip
    by_placement = with_sources(dict(res.by_placement), files)
    plans, missing = {}, {}
    for name in names:
        placement = MODES[name].placement
        if placement in by_placement and by_placement[placement].rollout:
            plans[name] = by_placement[placement]
        else:
            missing[name] = (
                f"the planner made no {placement} plan at ${budget:g}/h: " + NO_PLAN[placement]
            )
    picked = res.plan.decisions.placement
    return plans, missing, f"{picked}-{'sync' if picked == 'colocated' else 'async'}"


def mode_config(config: str, overrides: list[str], name: str, plan: Any) -> Any:
    """The config a run of mode `name` starts from: `config` with `overrides`, the
    mode's staleness and the plan projected on it, as `prepare_run` makes it."""
    from areal_hex.config import load_config
    from hexctl.job.prepare import apply_mode, apply_plan

    cfg = apply_mode(load_config(config, overrides), MODES[name].run_mode)
    return apply_plan(cfg, plan, say=lambda _: None)


def mode_predictions(
    config: str, overrides: list[str], plans: dict[str, Any]
) -> dict[str, float | None]:
    """Each mode's predicted pipeline samples/s as its run's launcher prices it
    (`host_side`, from the plan's profile), in the mode's staleness; None where the
    cost model lacks an input."""
    from hexctl.job.predict import host_side

    out: dict[str, float | None] = {}
    for name, plan in plans.items():
        cfg = mode_config(config, overrides, name, plan)
        _, pred = host_side(cfg, plan)
        side = "synchronous" if cfg.run.mode == "sync" else "asynchronous"
        out[name] = None if "unavailable" in pred else pred[side]["pipeline_samples_per_s"]
    return out


# ---------------------------------------------------------------- the runs
def run_modes(
    config: str, overrides: list[str], out: Path, plans: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each mode's plan run on the box, in order; each run's figures."""
    from hexctl.bench.system.hetero import run_plan
    from hexctl.bench.system.hetero_summary import describe, pipeline_of

    runs = {}
    for name, plan in plans.items():
        mode = MODES[name]
        _say(f"running {name} ({mode.placement} plan, run.mode={mode.run_mode})")
        got = run_plan(config, overrides, out, name, plan, mode.run_mode, f"mode-{name}")
        runs[name] = {
            "predicted": pipeline_of(got["block"], "predicted"),
            "measured": pipeline_of(got["block"], "measured"),
            "placement": mode.placement,
            "run_mode": mode.run_mode,
            **describe(plan),
            "wall_s": got["wall_s"],
            "cpu_delivered": got.get("cpu_delivered"),
        }
    return runs


def run_on_box(args: argparse.Namespace) -> dict[str, Any]:
    from areal_hex.plan import save_plan
    from hexctl.bench.system.emulated import box_session
    from hexctl.bench.system.hetero import box_result
    from hexctl.bench.system.modes import chosen_modes, report
    from hexctl.box import emulate as box
    from hexctl.box.checks import check_fits
    from hexctl.box.spec import load_box

    check_box_arguments(args)
    spec = load_box(args.box)
    check_fits(spec)
    names, skipped = runnable_modes(
        spec, args.budget, chosen_modes(args.modes), named=args.modes is not None
    )
    box.check_host()
    args.config = args.config or DEFAULT_BOX_CONFIG
    args.steps = STEPS if args.steps is None else args.steps
    with box_session(args, spec, "areal-hex-modes-") as session:
        out, overrides = session.out, session.overrides
        files = session.profile(args, _say)
        plans, missing, plan_pick = mode_plans(files, args.budget, names)
        for name, plan in plans.items():
            save_plan(plan, out / f"plan-{name}.yaml")
        priced = mode_predictions(args.config, overrides, plans)
        _say("predicted samples/s: " + ", ".join(f"{n} {r}" for n, r in priced.items()))
        runs = run_modes(args.config, overrides, out, plans)
        for name, r in runs.items():
            r["predicted"] = r["predicted"] if r["predicted"] is not None else priced[name]
        result = report(runs)
        result.update({"plan_pick": plan_pick, "skipped": {**skipped, **missing}})
    return box_result(args, spec.name, session.state.cpu_check, session.load_start, result)
