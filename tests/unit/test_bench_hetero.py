"""`bench hetero`'s figures from four runs' fidelity blocks, and the one-kind inventory
its plan b is made on."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.plan import Plan
from hexctl.bench.system.hetero import one_kind_cluster
from hexctl.bench.system.hetero_summary import median_round, round_order, summarise
from scheduler.cluster import load_cluster

ROOT = Path(__file__).resolve().parents[2]


def _plan(cost: float, rate: float = 1.0) -> Plan:
    slot = {"node": "n-0", "gpu_ids": [0]}
    return Plan.model_validate({
        "cluster": "c", "model": "m", "objective": "throughput", "decisions": {},
        "rollout": [{"id": "r", "gpu_kind": "n", "tp": 1, "zone": "z", "region": "z",
                     "placement": slot, "predicted_tokens_per_s": 1.0}],
        "trainer": {"gpu_kind": "n", "world_size": 1, "dp": 1, "zero_stage": 0,
                    "placements": [{"node": "n-0", "gpu_ids": [1]}],
                    "predicted_tokens_per_s": 1.0},
        "predicted": {"samples_per_s": rate, "generation_samples_per_s": 1,
                      "training_samples_per_s": 1, "weight_sync_s": 0, "cost_usd_per_h": cost},
    })  # fmt: skip


def _run(pred: float, meas: float, mode: str = "async", servers_up: int = 2) -> dict:
    block = {
        "predicted": {"pipeline_samples_per_s": pred, "weight_sync_s": 0.02},
        "measured": {"pipeline_samples_per_s": meas, "weight_sync_s": 0.03},
        "relative_error": {"pipeline_samples_per_s": (pred - meas) / meas},
        "servers": {"planned": 2, "at_start": servers_up, "fewest_in_window": servers_up,
                    "all_took_part": servers_up >= 2},
    }  # fmt: skip
    return {"block": block, "wall_s": 1.0, "mode": mode, "sync": "network"}


def test_ratios_errors_and_rankings() -> None:
    runs = {"a": _run(130, 100), "b": _run(100, 80), "c": _run(110, 105), "d": _run(60, 50, "sync")}
    plans = {"a": _plan(6, 2.0), "b": _plan(3), "c": _plan(6, 0.5)}
    out = summarise(runs, plans)
    assert out["a/b"] == {"predicted": 1.3, "measured": 1.25, "predicted_by_plans": 2.0}
    assert out["a/d"] == {"predicted": pytest.approx(130 / 60, abs=1e-4), "measured": 2.0}
    assert out["plans"]["a"]["error"] == 0.3 and out["plans"]["d"]["mode"] == "sync"
    assert out["plans"]["d"]["cost_usd_per_h"] == 6  # d is plan a, run synchronously
    assert out["plans"]["b"]["weight_sync"] == {
        "sync_mode": "network",
        "predicted_s": 0.02,
        "measured_s": 0.03,
    }
    # predicted a > c > b > d, measured c > a > b > d: not the same ranking
    assert out["ranking"] == {"predicted": ["a", "c", "b", "d"], "measured": ["c", "a", "b", "d"]}
    assert out["ranking_equal"] is False and out["ranking_holds"] is False
    assert out["a/c"]["predicted_by_plans"] == 4.0
    assert out["max_abs_error"] == 0.3


def test_the_planners_figure_beside_the_runs_prediction() -> None:
    """Each plan's own rate (the planner's figure) is held against the measured rate as
    the run's prediction is; d (plan a run synchronously) has no planner's figure. The
    counts take the runs' predictions within 15 % and the planner's within 20 %."""
    from hexctl.bench.system.hetero_summary import figure_counts, figures_table

    runs = {"a": _run(115, 100), "b": _run(100, 80), "c": _run(110, 105), "d": _run(60, 50, "sync")}
    plans = {"a": _plan(6, 118.0), "b": _plan(3, 85.0), "c": _plan(6, 150.0)}
    out = summarise(runs, plans)
    got = {k: (p["plan_samples_per_s"], p["plan_error"]) for k, p in out["plans"].items()}
    assert got == {"a": (118.0, 0.18), "b": (85.0, 0.0625), "c": (150.0, 0.4286), "d": (None, None)}
    # runs: a +0.15, b +0.25, c +0.0476, d +0.2; planner: a +0.18, b +0.0625, c +0.4286
    assert out["figures"] == {
        "predictions_within_15pct": 2,
        "predictions_counted": 4,
        "at_box_speed_within_15pct": 0,
        "at_box_speed_counted": 0,
        "planner_figures_within_20pct": 2,
        "planner_figures_counted": 3,
        "not_the_plan": [],
    }
    assert figure_counts({"x": {"error": None, "plan_error": None}})["predictions_counted"] == 0
    # at the kinds' speed around each run, where sampled, counted beside them
    sped = {k: {**p, "at_box_speed": {"error": e}} for (k, p), e in
            zip(out["plans"].items(), [0.05, 0.16, None, -0.15], strict=True)}  # fmt: skip
    counts = figure_counts(sped)
    assert (counts["at_box_speed_within_15pct"], counts["at_box_speed_counted"]) == (2, 3)
    assert figures_table({**out, "plans": sped, "figures": counts}).splitlines()[-1] == (
        "runs' predictions at the kinds' speed around each run within 15%: 2 of 3"
    )
    table = figures_table(out).splitlines()
    assert table[1].split()[:3] == ["a", "async", "100.0"]
    assert "115.0 (+15.0 %)" in table[1] and "118.0 (+18.0 %)" in table[1]
    assert table[4].split()[:3] == ["d", "sync", "50.0"] and table[4].rstrip().endswith("-")
    assert table[-1].endswith("within 15%: 2 of 4; planner's figures within 20%: 2 of 3")


def test_a_run_without_all_its_servers_is_flagged_and_not_counted() -> None:
    """Plan c generated on one of its two planned servers through its window (the other
    still starting): its figures are kept but flagged, and neither of its errors counts
    among the figures within bounds."""
    from hexctl.bench.system.hetero_summary import figures_table

    runs = {"a": _run(115, 100), "b": _run(100, 95), "c": _run(110, 105, servers_up=1),
            "d": _run(60, 50, "sync")}  # fmt: skip
    plans = {"a": _plan(6, 118.0), "b": _plan(3, 96.0), "c": _plan(6, 106.0)}
    out = summarise(runs, plans)
    assert out["plans"]["c"]["ran_plan"] is False and out["plans"]["a"]["ran_plan"] is True
    assert out["plans"]["c"]["servers"]["fewest_in_window"] == 1
    assert out["plans"]["c"]["measured_samples_per_s"] == 105  # kept, not scored
    # a +0.15, b +0.0526, d +0.2 counted (c's +0.0476 is not); planner: a, b (not c)
    assert out["figures"] == {
        "predictions_within_15pct": 2,
        "predictions_counted": 3,
        "at_box_speed_within_15pct": 0,
        "at_box_speed_counted": 0,
        "planner_figures_within_20pct": 2,
        "planner_figures_counted": 2,
        "not_the_plan": ["c"],
    }
    table = figures_table(out).splitlines()
    assert table[-1] == (
        "plan c did not run its plan (not counted): 1 of 2 planned servers up in its window"
    )


def test_plans_predicted_alike_are_tied_in_the_ranking() -> None:
    """c placed as a (one plan, one prediction) states no order between a and c: either
    measured order holds; an order between plans predicted apart still has to hold."""
    from hexctl.bench.system.hetero_summary import ranking_holds

    pred = {"a": 200.0, "b": 90.0, "c": 200.0, "d": 80.0}
    assert ranking_holds(pred, {"a": 227.0, "b": 85.0, "c": 235.0, "d": 70.0})
    assert ranking_holds(pred, {"a": 235.0, "b": 85.0, "c": 227.0, "d": 70.0})
    assert not ranking_holds(pred, {"a": 227.0, "b": 85.0, "c": 235.0, "d": 96.0})
    assert not ranking_holds(pred, {"a": 227.0, "b": 85.0, "c": 235.0, "d": None})


def test_the_one_kind_inventory_keeps_only_that_kind() -> None:
    cl = load_cluster(ROOT / "examples/clusters/racks_h800_h20.yaml")
    alone = one_kind_cluster(cl, "h20")
    assert [g.name for g in alone.spec.node_groups] == ["h20"]
    assert set(alone.rack_of) == {f"h20-{i}" for i in range(8)}
    assert all(m.group == "h20" for r in alone.spec.racks for m in r.members)


def test_each_plans_host_speed_is_held_against_the_profiles() -> None:
    """`host_moved`: the mean of a plan's head-node samples over the profile's, less 1;
    None for every plan when the bench reused a profile (no samples of it)."""
    from hexctl.bench.system.hetero import _host_gflops, host_moved

    host = {"profile": [100.0, 120.0], "a": [110.0, 110.0], "b": [55.0, 55.0], "c": [132.0]}
    assert host_moved(host) == {"a": 0.0, "b": -0.5, "c": 0.2}
    assert host_moved({"a": [1.0], "b": [2.0]}) == {"a": None, "b": None}
    assert _host_gflops() > 0  # bench host's matmul on every core, 0.5 s


def test_each_plans_prediction_at_the_speed_its_kinds_had() -> None:
    """A kind's speed around a plan's run over its speed while profiled gives the factor
    the profile is scaled by; the predictions at those speeds give their own errors,
    ratios and ranking beside the plain ones."""
    from hexctl.bench.system.hetero import speed_factors

    profiled = {"fast": 800.0, "mem": 300.0}
    assert speed_factors(
        profiled, [{"fast": 800.0, "mem": 150.0}, {"fast": 400.0, "mem": 150.0}]
    ) == {
        "fast": 0.75,
        "mem": 0.5,
    }
    assert speed_factors({}, [{"fast": 1.0}]) == {}  # a profile made before it was sampled

    runs = {"a": _run(130, 100), "b": _run(100, 80), "c": _run(110, 105), "d": _run(60, 50, "sync")}
    plans = {"a": _plan(6, 2.0), "b": _plan(3), "c": _plan(6, 0.5)}
    at = {
        "a": {"factors": {"mem": 0.8},
              "predicted": {"pipeline_samples_per_s": 104.0, "weight_sync_s": 0.025}},
        "b": {"factors": {"fast": 0.8}, "predicted": {"pipeline_samples_per_s": 80.0}},
        "c": {"factors": {"mem": 1.0}, "predicted": {"pipeline_samples_per_s": 110.0}},
        "d": {"factors": {"mem": 0.9}, "predicted": None},
    }  # fmt: skip
    out = summarise(runs, plans, at)
    assert out["plans"]["a"]["at_box_speed"] == {
        "speed": {"mem": 0.8},
        "predicted_samples_per_s": 104.0,
        "error": 0.04,
        "weight_sync_predicted_s": 0.025,
    }
    assert out["plans"]["b"]["at_box_speed"]["error"] == 0.0
    assert out["plans"]["d"]["at_box_speed"]["error"] is None  # no prediction
    speed = out["at_box_speed"]
    assert speed["a/b"] == {"predicted": 1.3} and speed["a/d"] == {"predicted": None}
    assert speed["ranking"] == ["c", "a", "b", "d"]  # d unpriced: last
    assert speed["ranking_equal"] is True  # measured c > a > b > d
    assert speed["ranking_holds"] is False  # d has no prediction to hold
    assert speed["max_abs_error"] == pytest.approx(0.0476, abs=1e-4)
    # the summary's counts take them in: a +0.04, b 0.0, c +0.0476 (d unpriced)
    got = out["figures"]
    assert (got["at_box_speed_within_15pct"], got["at_box_speed_counted"]) == (3, 3)
    assert "at_box_speed" not in summarise(runs, plans)


def test_a_kinds_profiled_speed_is_kept_with_its_measurements(tmp_path: Path) -> None:
    """`profile --box` keeps each kind's node speed before and after its profile in the
    kind's `measured.json`; the merged file gives each kind's mean, and a profile made
    before the speed was sampled gives none."""
    import json

    from hexctl.box.profile import _record_speed, profiled_speed
    from hexctl.job.predict import LocalProfileFiles

    kind = LocalProfileFiles(tmp_path / "mem")
    kind.root.mkdir()
    kind.measured.write_text(json.dumps({"generation": {"prefill_tokens_per_s": 1.0}}))
    _record_speed(kind, "mem-0", [300.0, 200.0])
    kept = json.loads(kind.measured.read_text())
    assert kept["node_speed"] == {"node": "mem-0", "samples": [300.0, 200.0]}
    assert kept["generation"] == {"prefill_tokens_per_s": 1.0}
    merged = LocalProfileFiles(tmp_path)
    merged.measured.write_text(json.dumps({"kinds": {"mem": kept, "fast": {"generation": {}}}}))
    assert profiled_speed(merged) == {"mem": 250.0}


def test_a_failed_speed_sample_is_left_out(tmp_path: Path) -> None:
    import json

    from hexctl.box.profile import profiled_speed
    from hexctl.job.predict import LocalProfileFiles

    merged = LocalProfileFiles(tmp_path)
    kinds = {"mem": {"node_speed": {"node": "mem-0", "samples": [None, 120.0]}},
             "fast": {"node_speed": {"node": "fast-0", "samples": [None, None]}}}  # fmt: skip
    merged.measured.write_text(json.dumps({"kinds": kinds}))
    assert profiled_speed(merged) == {"mem": 120.0}


def test_rounds_alternate_and_the_median_round_decides() -> None:
    assert round_order(1) == [(0, "a"), (0, "b"), (0, "c"), (0, "d")]
    assert [label for _, label in round_order(3)] == list("abcddcbaabcd")
    # a round the machine slowed (49) or sped (250) decides nothing: the median does
    rounds = [_run(170, 180), _run(170, 49), _run(170, 250)]
    assert median_round(rounds) == 0
    assert median_round([_run(1, 9), _run(1, 3)]) == 1  # even count: the lower middle
    assert median_round([_run(1, 9)]) == 0
    no_window = {**_run(1, 5), "block": {"measured": {"pipeline_samples_per_s": None}}}
    assert median_round([_run(1, 7), no_window, _run(1, 5)]) == 2
    runs = {"a": {**rounds[0], "rounds": [180, 49, 250]}, "b": _run(100, 80)}
    out = summarise(runs, {"a": _plan(6), "b": _plan(3), "c": _plan(6)})
    assert out["plans"]["a"]["measured_samples_per_s"] == 180
    assert out["plans"]["a"]["rounds_measured_samples_per_s"] == [180, 49, 250]
    assert "rounds_measured_samples_per_s" not in out["plans"]["b"]


def test_where_a_plan_misses_per_step() -> None:
    """A plan's step split into its training and the rest of its cycle, predicted and
    measured (r37's synchronous plan d: the rest, the update and the batch's generation,
    was measured twice as long as predicted, the training as predicted)."""
    from hexctl.bench.system.hetero_summary import figures_table, step_parts

    block = {
        "predicted": {"pipeline_samples_per_s": 213.6, "training_samples_per_s": 432.8},
        "measured": {"pipeline_samples_per_s": 143.6, "training_samples_per_s": 461.8},
    }
    parts = step_parts(block, 64)
    assert parts == {
        "predicted": {"training_s": pytest.approx(0.1479, abs=1e-4),
                      "rest_s": pytest.approx(0.1518, abs=1e-4)},
        "measured": {"training_s": pytest.approx(0.1386, abs=1e-4),
                     "rest_s": pytest.approx(0.3071, abs=1e-4)},
    }  # fmt: skip
    # the step's cycle is never shorter than its training: no negative rest
    rates = {"pipeline_samples_per_s": 400.0, "training_samples_per_s": 400.0}
    fast = {"predicted": {**rates, "pipeline_samples_per_s": 500.0}, "measured": rates}
    assert step_parts(fast, 64)["predicted"]["rest_s"] == 0.0
    assert step_parts(block, None) is None
    assert step_parts({"predicted": {}, "measured": block["measured"]}, 64) is None
    # through the summary and its table
    d = {**_run(213.6, 143.6, "sync"), "samples_per_step": 64}
    d["block"]["predicted"].update(training_samples_per_s=432.8)
    d["block"]["measured"].update(training_samples_per_s=461.8)
    runs = {"a": _run(115, 100), "b": _run(100, 80), "c": _run(110, 105), "d": d}
    out = summarise(runs, {"a": _plan(6, 118.0), "b": _plan(3, 85.0), "c": _plan(6, 150.0)})
    assert out["plans"]["d"]["step_s"] == parts and out["plans"]["a"]["step_s"] is None
    table = figures_table(out).splitlines()
    assert table[4].rstrip().endswith("0.148+0.152 / 0.139+0.307")
    assert table[1].rstrip().endswith("-")
