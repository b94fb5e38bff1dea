"""Tasks placed by kind: a box's reference/reward-model tasks where the planner puts them,
against the same job with them kept on the actor's kind.

One invocation, one budget, on a box (`areal-hex box`, brought up here and down at the
end), with a job whose `workflow.tasks` has a priced task (a reference,
`examples/box/tiny_box_ref.yaml`, the default; a reward model,
`examples/box/tiny_box_rm.yaml`): the box's kinds profiled inside their nodes
(`profile --box`, which measures the rates such a task is priced at: each kind's scoring
rate with as many requests in flight as the run keeps there, and the job's reward model's
own `/classify` rate) or a profile reused (`--profile-dir`), then two plans run for the
same steps from the same initial weights and each held against the cost model:

- a: the planner's plan, each priced task on the kind its cost chooses
  (`scheduler/task_graph.py`);
- b: the planner's plan with every priced task restricted to the actor's kind, the pools
  planned again on what that leaves: plan a's train pool's kind (where verl and OpenRLHF
  keep the reference, beside the actor's training), or where plan a already scores there,
  its rollout's kind (beside the actor's generation).

Per plan: predicted and measured pipeline samples/s (`bench fidelity`'s window and
definitions) and the error, the planner's own figure, where each task ran and its
predicted rate; then a/b measured beside predicted. Each kind's node speed is sampled
around each run and each plan priced again at it (`at_box_speed`, as `bench hetero`).
With `--rounds R` the plans run R times (a, b, then b, a, ...), each plan's figures its
median round's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = "examples/box/tiny_box_ref.yaml"
STEPS = 60
LABELS = ("a", "b")


def _say(text: str) -> None:
    print(f"bench tasks: {text}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--box", required=True, help="box YAML (examples/box/)")
    p.add_argument("--budget", type=float, required=True, help="$/h both plans are made at")
    p.add_argument(
        "--config", default=DEFAULT_CONFIG, help="experiment YAML with a reference or RM task"
    )
    p.add_argument("--steps", type=int, default=STEPS, help="trainer.total_steps of every run")
    p.add_argument(
        "--rounds", type=int, default=1, help="run each plan this many times (a, b; b, a; ...)"
    )
    p.add_argument("--output-dir", default=None, help="keep the profile, plans and runs here")
    p.add_argument(
        "--profile-dir", default=None, help="a `profile --box` of this box to reuse (no profile)"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


# ---------------------------------------------------------------- the plans
def on_kind(w: Any, kind: str) -> Any:
    """The workload with every priced task allowed on `kind` only."""
    from scheduler.task_costs import PRICED_ROLES

    tasks = [
        t.model_copy(update={"gpu_kinds": [kind]}) if t.gpus > 0 and t.role in PRICED_ROLES else t
        for t in w.tasks
    ]
    return w.model_copy(update={"tasks": tasks})


def task_kinds(plan: Any) -> dict[str, str | None]:
    """Each placed task's kind in `plan`."""
    return {t.task: t.gpu_kind for t in plan.decisions.tasks}


def actor_kinds(plan: Any) -> list[str]:
    """The kinds the actor runs on in `plan`: its train pool's, then its rollout's."""
    kinds = [plan.trainer.gpu_kind, *(i.gpu_kind for i in plan.rollout)]
    return list(dict.fromkeys(k for k in kinds if k is not None))


def plan_pair(
    cl: Any, m: Any, w: Any, prof: Any, budget: float, label: str, time_limit_s: float = 60.0
) -> dict[str, Any]:
    """Plans a and b of the module docstring. Refused where the workload has no priced
    task, or where the actor runs on one kind and plan a already scores there (nothing
    to compare on this box at this budget)."""
    from areal_hex.errors import UsageError
    from scheduler.planner import make_plan
    from scheduler.task_costs import priced_gpu_tasks

    if not priced_gpu_tasks(w):
        raise UsageError(
            "bench tasks: the job's workflow.tasks has no reference or reward_model task on "
            "devices (gpus > 0): expected one (examples/box/tiny_box_ref.yaml)"
        )
    a = make_plan(cl, m, w, budget=budget, prof=prof, model_label=label,
                  time_limit_s=time_limit_s, baselines=False).plan  # fmt: skip
    priced = {t.name for t in priced_gpu_tasks(w)}
    chosen = {kind for name, kind in task_kinds(a).items() if name in priced}
    actor = next((k for k in actor_kinds(a) if {k} != chosen), None)
    if actor is None:
        raise UsageError(
            f"bench tasks: at ${budget:g}/h the planner already keeps every priced task on "
            f"the actor's kind ({', '.join(actor_kinds(a))}): plans a and b would be one "
            "plan; expected a box or budget where the tasks' kind is a choice"
        )
    b = make_plan(cl, m, on_kind(w, actor), budget=budget, prof=prof, model_label=label,
                  time_limit_s=time_limit_s, baselines=False).plan  # fmt: skip
    return {"a": a, "b": b}


def make_task_plans(files: Any, budget: float) -> dict[str, Any]:
    """Plans a and b from a box profile's files, each with the sources a run prices it
    from."""
    from hexctl.bench.system.hetero import plan_inputs, with_sources

    cl, m, w, prof = plan_inputs(files)
    plans = plan_pair(cl, m, w, prof, budget, str(files.model))
    return with_sources(plans, files)


# ---------------------------------------------------------------- the figures
def describe_plan(plan: Any) -> dict[str, Any]:
    """Where plan's services and tasks run, its cost and its own rate."""
    from hexctl.bench.system.hetero_summary import describe

    return {
        **describe(plan),
        "trainer_kind": plan.trainer.gpu_kind,
        "rollout_kinds": [i.gpu_kind for i in plan.rollout],
        "tasks": {
            t.task: {
                "kind": t.gpu_kind,
                "nodes": [s.node for s in t.slots],
                "predicted_samples_per_s": t.predicted_samples_per_s,
            }
            for t in plan.decisions.tasks
        },
    }


def summarise_pair(runs: dict[str, dict[str, Any]], plans: dict[str, Any]) -> dict[str, Any]:
    """Each plan's figures and a/b, measured beside predicted (run's and plan's)."""
    from hexctl.bench.system.hetero_summary import delivered_of, pipeline_of, relative_error

    out: dict[str, Any] = {"plans": {}}
    pred, meas, at = {}, {}, {}
    for label, r in runs.items():
        pred[label] = pipeline_of(r["block"], "predicted")
        meas[label] = pipeline_of(r["block"], "measured")
        own = plans[label].predicted.samples_per_s
        at[label] = (r.get("at_speed") or {}).get("pipeline_samples_per_s")
        out["plans"][label] = {
            **describe_plan(plans[label]),
            "predicted_samples_per_s": pred[label],
            "measured_samples_per_s": meas[label],
            "error": relative_error(pred[label], meas[label]),
            "plan_error": relative_error(own, meas[label]),
            "at_box_speed": {
                "speed": r.get("factors"),
                "predicted_samples_per_s": None if at[label] is None else round(at[label], 4),
                "error": relative_error(at[label], meas[label]),
            },
            "rounds_measured_samples_per_s": r.get("rounds"),
            "wall_s": r["wall_s"],
            **delivered_of(r),
        }

    def ratio(x: dict[str, float | None]) -> float | None:
        return None if not x.get("a") or not x.get("b") else round(x["a"] / x["b"], 4)

    placed = {k: p.predicted.samples_per_s for k, p in plans.items()}
    out["a/b"] = {
        "predicted": ratio(pred),
        "measured": ratio(meas),
        "predicted_by_plans": ratio(placed),
        "predicted_at_box_speed": ratio(at),
    }
    errors = [abs(p["error"]) for p in out["plans"].values() if p["error"] is not None]
    out["max_abs_error"] = round(max(errors), 4) if errors else None
    out["within_15pct"] = bool(errors) and len(errors) == len(runs) and max(errors) <= 0.15
    return out


# ---------------------------------------------------------------- the runs
def _one_run(
    args: argparse.Namespace, overrides: list[str], out: Path, plans: dict[str, Any],
    label: str, run_id: str, ctx: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Plan `label` run once, with its kinds' speed around it and its prediction at it."""
    from hexctl.bench.system.hetero import kind_speed, predict_at_speed, run_plan, speed_factors

    spec, probes = ctx["spec"], ctx["probes"]
    before = kind_speed(spec, probes)
    got = run_plan(args.config, overrides, out, label, plans[label], "async", run_id)
    got["factors"] = speed_factors(ctx["profiled"], [before, kind_speed(spec, probes)])
    if got["factors"]:
        at = out / "at-speed" / f"profile-{run_id}.yaml"
        at.parent.mkdir(parents=True, exist_ok=True)
        got["at_speed"] = predict_at_speed(got, plans[label], got["factors"], at)
    return got


def _median_runs(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    from hexctl.bench.system.hetero_summary import median_round, pipeline_of

    runs = {}
    for label, got in rounds.items():
        runs[label] = got[median_round(got)]
        if len(got) > 1:
            runs[label]["rounds"] = [pipeline_of(r["block"], "measured") for r in got]
        runs[label]["rounds_cpu_delivered"] = [r.get("cpu_delivered") for r in got]
    return runs


def _build_reward_model(cfg: Any) -> None:
    """The job's tiny reward model into the cache before any server needs it (a server
    in a node's quota would train it at that node's speed, and a reused profile did not
    build it here)."""
    from hexctl.profile.scoring import rm_config

    if cfg.workflow.task_with_role("reward_model") is not None:
        _say("the job's reward model (trained once, then taken from the cache)")
        rm_config(cfg)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from areal_hex.config import load_config
    from areal_hex.errors import UsageError
    from areal_hex.plan import save_plan
    from hexctl.bench.system.emulated import box_session
    from hexctl.bench.system.hetero import box_result, speed_nodes
    from hexctl.box import emulate as box
    from hexctl.box.checks import check_budget, check_fits
    from hexctl.box.profile import profiled_speed
    from hexctl.box.spec import load_box

    if args.rounds < 1 or args.steps < 1:
        raise UsageError(f"--rounds {args.rounds} --steps {args.steps}: expected 1 or more each")
    spec = load_box(args.box)
    check_fits(spec)
    check_budget(spec, args.budget)
    box.check_host()
    with box_session(args, spec, "areal-hex-tasks-") as session:
        out, overrides, state = session.out, session.overrides, session.state
        _build_reward_model(load_config(args.config, overrides))
        files = session.profile(args, _say)
        plans = make_task_plans(files, args.budget)
        for label, plan in plans.items():
            save_plan(plan, out / f"plan-{label}.yaml")
        ctx = {
            "spec": spec,
            "probes": [state.node(n) for n in speed_nodes(spec, files)],
            "profiled": profiled_speed(files),
        }
        rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in LABELS}
        for r in range(args.rounds):
            for label in LABELS if r % 2 == 0 else LABELS[::-1]:
                _say(f"running plan {label} ({args.steps} steps, round {r + 1})")
                run_id = f"plan-{label}" + (f"-r{r + 1}" if r else "")
                got = _one_run(args, overrides, out, plans, label, run_id, ctx)
                rounds[label].append(got)
        result = summarise_pair(_median_runs(rounds), plans)
        result["kind_speed_profiled"] = ctx["profiled"]
    return box_result(args, spec.name, state.cpu_check, session.load_start, result)
