"""`bench hetero`'s figures: each plan's runs summed up against the cost model.

Per plan two predictions are held against the measured rate: the run's (its layout and
mode re-priced from the plan's sources, `hexctl/job/predict.py`: `predicted_samples_per_s`,
`error`) and the planner's own figure for the plan (`plan_samples_per_s`, the plan's
`predicted.samples_per_s`, the rate it chose the plan by: `plan_error`). Plan d is plan
a run synchronously, for which the planner states no figure. `figure_counts` counts the
first within `RUN_WITHIN` and the second within `PLANNER_WITHIN`; `figures_table` prints
them side by side.

A run that did not generate on every server its plan names throughout its window (one
still starting, or out: the fidelity block's `servers`) did not run its plan: its
`ran_plan` is False, it is listed in `figures.not_the_plan`, and its errors are not
counted among the figures within bounds.
"""

from __future__ import annotations

import statistics
from typing import Any

LABELS = ("a", "b", "c", "d")
RUN_WITHIN = 0.15  # a run's re-priced prediction counts as holding within this error
PLANNER_WITHIN = 0.20  # ... and the planner's own figure for its plan


def plan_of(plans: dict[str, Any], label: str) -> Any:
    """The plan a label runs: d is plan a, run synchronously."""
    return plans["a" if label == "d" else label]


def describe(plan: Any) -> dict[str, Any]:
    return {
        "trainer": [p.node for p in plan.trainer.placements],
        "rollout": [i.placement.node for i in plan.rollout],
        "cost_usd_per_h": plan.predicted.cost_usd_per_h,
        "plan_samples_per_s": plan.predicted.samples_per_s,
    }


def pipeline_of(block: dict[str, Any], side: str) -> float | None:
    v = (block.get(side) or {}).get("pipeline_samples_per_s")
    return None if v is None else round(v, 4)


def step_parts(block: dict[str, Any], per_step: int | None) -> dict[str, Any] | None:
    """Where a plan's figure misses, per trainer step of `per_step` samples, as the run's
    prediction had it and as the run measured it: `training_s` (the step over the
    training rate: its compute and publish) and `rest_s` (the step's cycle over the
    pipeline rate, less that). In a synchronous run the rest is the update and the
    batch's generation, which the trainer waits for; in an asynchronous one, what
    generating beside the training does not hide. None without the rates."""
    if not per_step:
        return None
    out: dict[str, Any] = {}
    for side in ("predicted", "measured"):
        rates = block.get(side) or {}
        pipe, train = rates.get("pipeline_samples_per_s"), rates.get("training_samples_per_s")
        if not pipe or not train:
            return None
        cycle, step = per_step / pipe, per_step / train
        out[side] = {"training_s": round(step, 4), "rest_s": round(max(0.0, cycle - step), 4)}
    return out


def _ratio(x: float | None, y: float | None) -> float | None:
    return None if not x or not y else round(x / y, 4)


def _ranking(rates: dict[str, float | None]) -> list[str]:
    return sorted(rates, key=lambda k: -(rates[k] or 0.0))


def ranking_holds(pred: dict[str, float | None], meas: dict[str, float | None]) -> bool:
    """Whether every order the prediction states holds when measured: for each pair of
    plans predicted at different rates, the faster one measured faster. Plans predicted
    at the same rate (c when first-fit places a's mix as METIS does: the same plan) state
    no order between them, and the order their runs happen to measure is not counted."""
    labels = [k for k in pred if pred[k] is not None and meas.get(k) is not None]
    for x in labels:
        for y in labels:
            px, py = pred[x] or 0.0, pred[y] or 0.0
            if px > py * (1 + 1e-6) and not (meas[x] or 0.0) > (meas[y] or 0.0):
                return False
    return len(labels) == len(pred)


def round_order(rounds: int) -> list[tuple[int, str]]:
    """(round, plan) in the order they run: a-d, then d-a, and so on, so a drift of the
    machine over the bench falls on every plan alike."""
    order = []
    for r in range(rounds):
        labels = LABELS if r % 2 == 0 else tuple(reversed(LABELS))
        order += [(r, label) for label in labels]
    return order


def median_round(rounds: list[dict[str, Any]]) -> int:
    """The index of the round whose measured pipeline rate is the median (the lower of
    the middle two for an even count; a round that measured nothing counts lowest): a
    run the machine slowed or sped does not decide a plan's figures."""
    rates = [pipeline_of(r["block"], "measured") or 0.0 for r in rounds]
    order = sorted(range(len(rates)), key=lambda i: rates[i])
    return order[(len(order) - 1) // 2]


def summarise(
    runs: dict[str, dict[str, Any]],
    plans: dict[str, Any],
    at_speed: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"plans": {}}
    pred, meas = {}, {}
    for label, r in runs.items():
        block = r["block"]
        pred[label], meas[label] = pipeline_of(block, "predicted"), pipeline_of(block, "measured")
        err = (block.get("relative_error") or {}).get("pipeline_samples_per_s")
        ws_p = (block.get("predicted") or {}).get("weight_sync_s")
        ws_m = block["measured"].get("weight_sync_s")
        plan = plan_of(plans, label)
        own = planner_figure(label, plan)
        out["plans"][label] = {
            **describe(plan),
            "mode": r["mode"],
            "plan_samples_per_s": own,
            "plan_error": relative_error(own, meas[label]),
            "predicted_samples_per_s": pred[label],
            "measured_samples_per_s": meas[label],
            "error": None if err is None else round(err, 4),
            "weight_sync": {
                "sync_mode": r["sync"],
                "predicted_s": None if ws_p is None else round(ws_p, 4),
                "measured_s": None if ws_m is None else round(ws_m, 4),
            },
            "step_s": step_parts(block, r.get("samples_per_step")),
            "unavailable": block.get("unavailable"),
            "wall_s": r["wall_s"],
            "servers": block.get("servers"),
            "ran_plan": ran_plan(block),
        }
        if "rounds" in r:  # every round's measure, the median one's figures above
            out["plans"][label]["rounds_measured_samples_per_s"] = r["rounds"]
        out["plans"][label].update(delivered_of(r))
    placed = {k: p.predicted.samples_per_s for k, p in plans.items()}
    for other in ("b", "c", "d"):
        out[f"a/{other}"] = {
            "predicted": _ratio(pred.get("a"), pred.get(other)),
            "measured": _ratio(meas.get("a"), meas.get(other)),
        }
    # the plans' own rates (the planner's claim, from the MILP's decision placed on the
    # racks), beside the runs' predictions (each run's layout and mode, its machines)
    out["a/b"]["predicted_by_plans"] = _ratio(placed["a"], placed["b"])
    out["a/c"]["predicted_by_plans"] = _ratio(placed["a"], placed["c"])
    out["ranking"] = {"predicted": _ranking(pred), "measured": _ranking(meas)}
    out["ranking_equal"] = out["ranking"]["predicted"] == out["ranking"]["measured"]
    out["ranking_holds"] = ranking_holds(pred, meas)  # the same, plans predicted alike tied
    errors = [abs(p["error"]) for p in out["plans"].values() if p["error"] is not None]
    out["max_abs_error"] = round(max(errors), 4) if errors else None
    if at_speed:  # each plan's `at_box_speed` first: the counts take it in
        out["at_box_speed"] = _at_box_speed(out, at_speed, meas)
    out["figures"] = figure_counts(out["plans"])
    return out


def _at_box_speed(
    out: dict[str, Any], at_speed: dict[str, dict[str, Any]], meas: dict[str, float | None]
) -> dict[str, Any]:
    """Each plan's prediction at the speed its kinds were sampled at around its run
    (`predict_at_speed`), with its error, and the ratios and ranking from them."""
    pred: dict[str, float | None] = {}
    for label, got in at_speed.items():
        rates = got.get("predicted") or {}
        p = rates.get("pipeline_samples_per_s")
        pred[label] = None if p is None else round(p, 4)
        m = meas.get(label)
        ws = rates.get("weight_sync_s")
        out["plans"][label]["at_box_speed"] = {
            "speed": got["factors"],
            "predicted_samples_per_s": pred[label],
            "error": None if p is None or not m else round((p - m) / m, 4),
            "weight_sync_predicted_s": None if ws is None else round(ws, 4),
        }
    block: dict[str, Any] = {
        f"a/{o}": {"predicted": _ratio(pred.get("a"), pred.get(o))} for o in ("b", "c", "d")
    }
    block["ranking"] = _ranking(pred)
    block["ranking_equal"] = block["ranking"] == out["ranking"]["measured"]
    block["ranking_holds"] = ranking_holds(pred, meas)
    errors = [
        abs(p["at_box_speed"]["error"])
        for p in out["plans"].values()
        if (p.get("at_box_speed") or {}).get("error") is not None
    ]
    block["max_abs_error"] = round(max(errors), 4) if errors else None
    return block


def delivered_of(run: dict[str, Any]) -> dict[str, Any]:
    """A plan's `cpu_delivered` (its figures' round), every round's where it ran more
    than one (`rounds_cpu_delivered`), and over them all `cpu_delivered_summary`
    (`delivered_summary`); nothing for a run without."""
    if "cpu_delivered" not in run:
        return {}
    every = run.get("rounds_cpu_delivered") or [run["cpu_delivered"]]
    out = {"cpu_delivered": run["cpu_delivered"]}
    if len(every) > 1:
        out["rounds_cpu_delivered"] = every
    out["cpu_delivered_summary"] = delivered_summary(every)
    return out


def delivered_summary(blocks: list[dict[str, Any] | None]) -> dict[str, Any]:
    """A plan's runs (its rounds, in order) summed up: per node, the median CPU used and
    the median and largest share of its quota withheld; the rounds (from 1) in which
    the machine held a node back."""
    per: dict[str, list[dict[str, Any]]] = {}
    for b in blocks:
        for name, f in ((b or {}).get("nodes") or {}).items():
            if "withheld_share" in f:
                per.setdefault(name, []).append(f)
    nodes = {
        name: {
            "quota_cores": got[0]["quota_cores"],
            "used_cores_median": round(statistics.median(f["used_cores"] for f in got), 4),
            "withheld_share_median": round(statistics.median(f["withheld_share"] for f in got), 4),
            "withheld_share_max": max(f["withheld_share"] for f in got),
            "runs": len(got),
        }
        for name, got in per.items()
    }
    held = [i + 1 for i, b in enumerate(blocks) if (b or {}).get("held_back")]
    return {"nodes": nodes, "held_back_in_rounds": held, "rounds": len(blocks)}


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, None where either is missing or nothing ran."""
    if predicted is None or not measured:
        return None
    return round((predicted - measured) / measured, 4)


def planner_figure(label: str, plan: Any) -> float | None:
    """The planner's figure for the run `label`: the plan's rate; None for d (plan a run
    synchronously, a mode the plan's figure does not describe)."""
    return None if label == "d" else plan.predicted.samples_per_s


def ran_plan(block: dict[str, Any]) -> bool | None:
    """Whether every server the run planned took part in its window (the fidelity
    block's `servers.all_took_part`); None where the run's rows cannot tell."""
    return (block.get("servers") or {}).get("all_took_part")


def figure_counts(plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How many runs' re-priced predictions are within `RUN_WITHIN` of the measured rate
    (also at the kinds' speed around the run, where sampled) and how many of the
    planner's figures within `PLANNER_WITHIN`, each of those with an error to count, from
    runs that ran their plan; the others in `not_the_plan`."""
    ran = [p for p in plans.values() if p.get("ran_plan") is not False]
    runs = [p["error"] for p in ran if p.get("error") is not None]
    own = [p["plan_error"] for p in ran if p.get("plan_error") is not None]
    speeds = [(p.get("at_box_speed") or {}).get("error") for p in ran]
    at_speed = [e for e in speeds if e is not None]
    return {
        "predictions_within_15pct": sum(abs(e) <= RUN_WITHIN for e in runs),
        "predictions_counted": len(runs),
        # the same predictions at the kinds' speed sampled around each run
        # (`at_box_speed`): what the model gives once the machine's drift since the
        # profile is taken out
        "at_box_speed_within_15pct": sum(abs(e) <= RUN_WITHIN for e in at_speed),
        "at_box_speed_counted": len(at_speed),
        "planner_figures_within_20pct": sum(abs(e) <= PLANNER_WITHIN for e in own),
        "planner_figures_counted": len(own),
        "not_the_plan": [k for k, p in plans.items() if p.get("ran_plan") is False],
    }


def _cell(rate: float | None, err: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.1f}" + ("" if err is None else f" ({err * 100:+.1f} %)")


def _step_cell(parts: dict[str, Any] | None) -> str:
    """`step_parts` as "training + rest" predicted / measured."""
    if not parts:
        return "-"
    p, m = parts["predicted"], parts["measured"]
    return f"{p['training_s']:.3f}+{p['rest_s']:.3f} / {m['training_s']:.3f}+{m['rest_s']:.3f}"


def figures_table(summary: dict[str, Any]) -> str:
    """Each plan's measured rate beside the run's prediction and the planner's figure,
    each with its error, and the counts (`figure_counts`), as printed lines."""
    rows = [
        ("plan", "mode", "measured", "run's prediction", "planner's figure", "step s pred / meas")
    ]
    for label, p in summary["plans"].items():
        meas = p.get("measured_samples_per_s")
        rows.append((
            label,
            str(p.get("mode", "")),
            "-" if meas is None else f"{meas:.1f}",
            _cell(p.get("predicted_samples_per_s"), p.get("error")),
            _cell(p.get("plan_samples_per_s") if label != "d" else None, p.get("plan_error")),
            _step_cell(p.get("step_s")),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    c = summary.get("figures") or figure_counts(summary["plans"])
    lines.append(
        f"runs' predictions within {RUN_WITHIN:.0%}: {c['predictions_within_15pct']} of "
        f"{c['predictions_counted']}; planner's figures within {PLANNER_WITHIN:.0%}: "
        f"{c['planner_figures_within_20pct']} of {c['planner_figures_counted']}"
    )
    if c.get("at_box_speed_counted"):
        lines.append(
            f"runs' predictions at the kinds' speed around each run within {RUN_WITHIN:.0%}: "
            f"{c['at_box_speed_within_15pct']} of {c['at_box_speed_counted']}"
        )
    for label, p in summary["plans"].items():
        held = (p.get("cpu_delivered_summary") or {}).get("held_back_in_rounds")
        if held:
            lines.append(
                f"plan {label}: the machine held a node back in round(s) "
                f"{', '.join(map(str, held))} (cpu_delivered)"
            )
    for label in c.get("not_the_plan", []):
        sv = summary["plans"][label].get("servers") or {}
        lines.append(
            f"plan {label} did not run its plan (not counted): {sv.get('fewest_in_window')} "
            f"of {sv.get('planned')} planned servers up in its window"
        )
    return "\n".join(lines)
