"""Phase 2 on a topology: the rack/NIC schema, shared-link pricing, METIS vs first-fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError
from scheduler.cluster import ClusterSpec, load_cluster, make_cluster
from scheduler.model_shape import load_model_shape
from scheduler.partition import evaluate, first_fit, place
from scheduler.planner import make_plan
from scheduler.sync_cost import weight_sync_s
from scheduler.topology import Topology, Transfer
from scheduler.workload import load_workload

EX = Path(__file__).resolve().parents[2] / "examples"
RACKS = EX / "clusters" / "racks_h800_h20.yaml"


def _spec(**edit: object) -> dict:
    data = yaml.safe_load(RACKS.read_text())
    data.update(edit)
    return data


def _refused(data: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        make_cluster(ClusterSpec.model_validate(data), "spec")
    return str(exc.value)


@pytest.mark.parametrize(
    ("rack", "field", "words"),
    [
        ({"group": "h999", "count": 1}, "racks[0] (r).members[0].group", "unknown node group"),
        ({"group": "h800", "first": 3, "count": 2}, "racks[0] (r).members[0]", "do not exist"),
    ],
)
def test_bad_rack_members_are_named(rack: dict, field: str, words: str) -> None:
    msg = _refused(_spec(racks=[{"name": "r", "uplink_gbs": 10, "members": [rack]}]))
    assert field in msg and words in msg


def test_machine_in_two_racks_and_rack_across_zones_are_refused() -> None:
    twice = [
        {"name": "a", "uplink_gbs": 10, "members": [{"group": "h800", "count": 2}]},
        {"name": "b", "uplink_gbs": 10, "members": [{"group": "h800", "first": 1, "count": 1}]},
    ]
    assert "machine 'h800-1' is already in rack 'a'" in _refused(_spec(racks=twice))
    data = _spec(racks=[])
    data["zones"].append({"name": "dc2", "region": "region-1", "inter_node_bandwidth_gbs": 50})
    data["links"] = [{"a": "dc1", "b": "dc2", "bandwidth_gbs": 5, "latency_ms": 1}]
    data["node_groups"][1]["zone"] = "dc2"
    data["racks"] = [
        {
            "name": "x",
            "uplink_gbs": 10,
            "members": [{"group": "h800", "count": 1}, {"group": "h20", "count": 1}],
        }
    ]
    assert "a rack sits in one zone" in _refused(data)


def test_negative_bandwidth_and_link_to_nowhere_exit_2(tmp_path: Path) -> None:
    from tests.integration.test_plan_cli import cli

    bad = _spec()
    bad["racks"][0]["uplink_gbs"] = -5
    p = tmp_path / "neg.yaml"
    p.write_text(yaml.safe_dump(bad))
    r = cli("plan", str(p), "--model", "qwen3-8b", "--budget", "100")
    assert r.returncode == 2 and "uplink_gbs" in r.stderr and "Traceback" not in r.stderr
    nowhere = _spec(links=[{"a": "dc1", "b": "dc9", "bandwidth_gbs": 5, "latency_ms": 1}])
    p.write_text(yaml.safe_dump(nowhere))
    r = cli("plan", str(p), "--model", "qwen3-8b", "--budget", "100")
    assert r.returncode == 2 and "links[0]" in r.stderr and "'dc9'" in r.stderr


def test_shared_uplink_divides_its_bandwidth() -> None:
    topo = Topology(load_cluster(RACKS))
    gb = 1e9
    # h800-0 is in rack-a, h20-0 and h20-1 in rack-b: both cross rack-a's 25 GB/s uplink
    one = topo.finish_s([Transfer("h800-0", "h20-0", 10 * gb)])
    two = topo.finish_s(
        [Transfer("h800-0", "h20-0", 10 * gb), Transfer("h800-0", "h20-1", 10 * gb)]
    )
    assert one == [pytest.approx(10 / 25)]
    assert two == [pytest.approx(20 / 25)] * 2
    # inside rack-a only the 50 GB/s NICs count
    assert topo.finish_s([Transfer("h800-0", "h20-4", 10 * gb)]) == [pytest.approx(10 / 50)]


def test_without_racks_or_nics_pricing_is_the_cost_model() -> None:
    cl = load_cluster(EX / "clusters" / "h800_h20.yaml")
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    assert not Topology(cl).declared
    res = make_plan(cl, m, w, budget=100, simulate_plan=False, baselines=False)
    assert res.placement.method == "first-fit"
    writer = res.placement.trainer[0][0]
    crossing = [
        weight_sync_s(cl, m, w, res.solution.trainer.zones[0], rc.zone)
        for rc, node, _ in res.placement.rollout
        if node != writer  # on the writer's own machine the weights do not cross a NIC
    ]
    assert crossing
    # one controller updates its servers as one: each pauses as long as the slowest copy
    assert res.cost.sync_s == pytest.approx([max(crossing)] * len(res.cost.sync_s), rel=1e-9)
    assert res.cost.train_step_s == pytest.approx(res.solution.trainer.step_s, rel=1e-9)
    # placement can only help here, never cost rate
    assert res.plan.predicted.samples_per_s >= round(res.solution.eval_rate, 4)


def test_metis_mapping_beats_first_fit_on_racks() -> None:
    cl = load_cluster(RACKS)
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    res = make_plan(cl, m, w, budget=200, baselines=False)
    b = res.plan.baselines
    assert b.placement == "metis"
    topo = Topology(cl)
    writer = topo.machines[res.placement.trainer[0][0]].domain
    # every rollout machine sits in the rack of the trainer's writer
    assert {topo.machines[n].domain for _, n, _ in res.placement.rollout} == {writer}
    assert b.simulated_samples_per_s >= 1.1 * b.simulated_first_fit_samples_per_s
    assert b.first_fit_samples_per_s < res.plan.predicted.samples_per_s
    # the same phase-1 decision, same GPUs, both placements
    ff = first_fit(
        cl,
        res.solution.trainer,
        [(res.problem.rollouts[i], n) for i, n in res.solution.replicas.items()],
    )
    assert sorted(len(ids) for _, ids in ff.trainer) == sorted(
        len(ids) for _, ids in res.placement.trainer
    )
    assert len(ff.rollout) == len(res.placement.rollout)
    assert max(evaluate(cl, m, w, res.solution.trainer, ff).sync_s) > max(res.cost.sync_s)
    from scheduler.report import table

    assert "placement on the racks: METIS" in table(res) and "first-fit" in table(res)


def test_two_machine_trainer_stays_in_one_rack() -> None:
    cl = load_cluster(RACKS)
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    res = make_plan(cl, m, w, budget=0.4 * 287.36, simulate_plan=False, baselines=False)
    assert len(res.placement.trainer) == 2
    topo = Topology(cl)
    assert len({topo.machines[n].domain for n, _ in res.placement.trainer}) == 1
    pl = place(
        cl,
        m,
        w,
        res.solution.trainer,
        [(res.problem.rollouts[i], n) for i, n in res.solution.replicas.items()],
    )
    assert pl.method == "metis"


def test_catalogue_board_variants_and_kind_efficiency_override() -> None:
    from scheduler.catalogue import CATALOGUE, canonical_kind

    for name in ("H800-PCIe", "H100-PCIe", "H100-NVL", "H200", "B200", "H20", "L20", "MI300X"):
        assert CATALOGUE[name].source  # every figure names its document
    assert canonical_kind("h800-sxm") == "H800"
    assert CATALOGUE["H800"].bf16_tflops == CATALOGUE["H100"].bf16_tflops == 989
    assert CATALOGUE["H800-PCIe"].hbm_gbs == 2000
    data = yaml.safe_load((EX / "clusters" / "h800_h20.yaml").read_text())
    cl = make_cluster(ClusterSpec.model_validate(data))
    assert cl.kinds["h800"].bf16_tflops == 756  # the paper's figures, by override
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    from scheduler.trainers import cost_trainer

    base = cost_trainer(cl, m, w, (("h800", 8),), 8, None)
    data["gpu_overrides"]["H800"]["train_mfu"] = 0.7  # twice the default 0.35
    fast = cost_trainer(
        make_cluster(ClusterSpec.model_validate(data)), m, w, (("h800", 8),), 8, None
    )
    assert fast.compute_s == pytest.approx(base.compute_s / 2)


def test_plan_names_binding_resource_and_ratios() -> None:
    cl = load_cluster(EX / "clusters" / "hetrl_a100_l40s_l4.yaml")
    m = load_model_shape("qwen3-14b")
    w = load_workload(EX / "workloads" / "long_cot.yaml")
    res = make_plan(cl, m, w, budget=20, simulate_plan=False)
    b = res.plan.baselines
    pred = res.plan.predicted
    # the assessment is of the best disaggregated plan (here beaten by the colocated one)
    apart = res.plan.decisions.placement == "disaggregated"
    assert b.disaggregated_samples_per_s is not None
    side = "training" if pred.training_samples_per_s <= pred.generation_samples_per_s else None
    assert b.binding in {"training", "generation", "weight sync", "staleness gate"}
    if side and apart:
        assert b.binding == "training" and b.training_utilisation == pytest.approx(1.0)
    assert b.homogeneous_ratio == pytest.approx(
        b.disaggregated_samples_per_s / b.homogeneous_samples_per_s, rel=1e-3
    )
    assert b.homogeneous_ratio >= 1.0  # one-kind plans are candidates of the same search
    assert b.unspent_usd_per_h == pytest.approx(20 - res.solution.cost, abs=0.01)
    assert b.cost_ratio is None or b.cost_ratio >= 1.0 - 1e-6


def test_the_fastest_placement_is_picked() -> None:
    cl = load_cluster(EX / "clusters" / "hetrl_a100_l40s_l4.yaml")
    m = load_model_shape("qwen3-14b")
    # η = 1 and long answers on a small budget: the colocated synchronous plan, which
    # also generates on the trainer's GPUs, beats every asynchronous split; the split
    # with the trainer's GPUs generating while it waits (hybrid) beats both
    w = load_workload(EX / "workloads" / "long_cot.yaml").model_copy(update={"max_staleness": 1})
    res = make_plan(cl, m, w, budget=20, simulate_plan=False)
    b = res.plan.baselines
    assert b.disaggregated_samples_per_s is not None and b.hybrid_samples_per_s is not None
    assert b.synchronous_samples_per_s > b.disaggregated_samples_per_s
    assert b.hybrid_samples_per_s > b.synchronous_samples_per_s
    assert res.plan.predicted.samples_per_s == b.hybrid_samples_per_s
    assert b.recommended_mode == "synchronous"
    d = res.plan.decisions
    assert d.placement == "hybrid" and d.publish_every == 1 and d.lent
    trainer = {(s.node, g) for s in res.plan.trainer.placements for g in s.gpu_ids}
    lent = [res.plan.rollout[i].placement for i in d.lent]
    assert all((s.node, g) in trainer for s in lent for g in s.gpu_ids)
    assert len(res.plan.rollout) == len(res.solution.replicas) + len(d.lent)
    from scheduler.report import table

    assert "picked hybrid" in table(res) and "lent by the trainer's GPUs" in table(res)
    loose = make_plan(cl, m, w, budget=60, simulate_plan=False)
    assert loose.plan.baselines.recommended_mode == "async"
    assert loose.plan.decisions.placement == "disaggregated"


def test_tuning_staleness_and_interval_picks_the_fastest_within_bounds() -> None:
    from scheduler.tuning import tune_max_staleness_and_publish_every

    cl = load_cluster(RACKS)
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    tuned, rows = tune_max_staleness_and_publish_every(
        cl, m, w, search_max_staleness=6, search_publish_every=2, budget=200, time_limit_s=30
    )
    assert len(rows) == (6 - w.max_staleness + 1) * 2
    best = max(min(r["samples_per_s"], r["simulated_samples_per_s"]) for r in rows)
    assert min(rows[0]["samples_per_s"], rows[0]["simulated_samples_per_s"]) == best
    assert (tuned.max_staleness, tuned.publish_every) == (
        rows[0]["max_staleness"],
        rows[0]["publish_every"],
    )
    assert w.max_staleness <= tuned.max_staleness <= 6 and 1 <= tuned.publish_every <= 2
    base = make_plan(cl, m, w, budget=200, baselines=False)
    assert best >= min(base.plan.predicted.samples_per_s, base.sim.samples_per_s)


def test_tuning_ranks_by_what_the_buffer_replay_sustains() -> None:
    # math_grpo on the AReaL-Hex setting: publishing every 4 steps at eta = 4 is predicted
    # fastest by the closed form, but the gate opens 4 B groups at a publish and none
    # until the next, so the replay sustains far less; the tuning must not pick it.
    from scheduler.report import table
    from scheduler.tuning import tune_max_staleness_and_publish_every

    cl = load_cluster(EX / "clusters" / "arealhex_setting.yaml")
    m, w = load_model_shape("qwen3-8b"), load_workload(EX / "workloads" / "math_grpo.yaml")
    budget = 102.67
    tuned, rows = tune_max_staleness_and_publish_every(
        cl, m, w, search_max_staleness=4, search_publish_every=4, budget=budget, time_limit_s=30
    )
    top_pred = max(rows, key=lambda r: r["samples_per_s"])
    assert top_pred["simulated_samples_per_s"] < 0.9 * top_pred["samples_per_s"]
    chosen = rows[0]
    assert chosen["simulated_samples_per_s"] > top_pred["simulated_samples_per_s"]
    assert (tuned.max_staleness, tuned.publish_every) == (
        chosen["max_staleness"],
        chosen["publish_every"],
    )
    # the table says when the replay and the prediction part
    k4 = w.model_copy(update={"publish_every": 4})
    text = table(make_plan(cl, m, k4, budget=budget, baselines=True))
    assert "against the prediction: expect the simulated rate" in text


def test_a_publish_interval_beyond_staleness_plus_one_is_refused(tmp_path: Path) -> None:
    from hexctl.cli import main

    wl = tmp_path / "w.yaml"
    wl.write_text("max_staleness: 1\npublish_every: 3\n")
    with pytest.raises(ConfigError, match=r"publish_every \(3\) is more than max_staleness \+ 1"):
        load_workload(wl)
    assert (
        main(["plan", str(RACKS), "--model", "qwen3-8b", "--workload", str(wl), "--budget", "100"])
        == 2
    )


@pytest.mark.parametrize(
    ("old", "new"), [("staleness", "max_staleness"), ("publish_interval", "publish_every")]
)
def test_a_workload_with_an_old_key_is_refused_with_the_new_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str
) -> None:
    from hexctl.cli import main

    wl = tmp_path / "w.yaml"
    wl.write_text(f"{old}: 2\n")
    with pytest.raises(ConfigError, match=f"key '{old}' is now '{new}'"):
        load_workload(wl)
    argv = ["plan", str(RACKS), "--model", "qwen3-8b", "--workload", str(wl), "--budget", "100"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"key '{old}' is now '{new}'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("old", "new"), [("staleness", "max_staleness"), ("publish_interval", "publish_every")]
)
def test_a_plan_with_an_old_baselines_key_is_refused_with_the_new_name(
    tmp_path: Path, old: str, new: str
) -> None:
    from areal_hex.plan import load_plan

    data = yaml.safe_load((EX / "plans" / "local_cpu.yaml").read_text())
    data.setdefault("baselines", {})[old] = 2
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"baselines: .*key '{old}' is now '{new}'"):
        load_plan(path)
