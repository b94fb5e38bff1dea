"""Every error of a box before the long work: a box, its quotas and its budget are refused
in seconds, naming what, where and what was expected, before a box is built or a kind is
profiled; any box that passes can be planned on (a rack without some kind included)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError
from hexctl.box.checks import check_budget, check_fits, min_budget
from hexctl.box.random_box import random_box, write_random_box
from hexctl.box.spec import BoxSpec, load_box, make_box

ROOT = Path(__file__).resolve().parents[2]

# the box: three kinds, three racks, nodes numbered across racks, rack c only mid
TRI = yaml.safe_load(
    """
name: tri
kinds:
  big: {cpu: 0.4, max_running_requests: 4, usd_per_hour: 3.0, nic_mbit: 400}
  mid: {cpu: 0.2, max_running_requests: 16, usd_per_hour: 1.5, nic_mbit: 200}
  kv: {cpu: 0.1, max_running_requests: 64, usd_per_hour: 1.0, nic_mbit: 100}
racks:
  - {name: a, uplink_mbit: 4, members: [{kind: big, count: 1}, {kind: kv, first: 1, count: 1}]}
  - name: b
    uplink_mbit: 6
    members: [{kind: kv, first: 0, count: 1}, {kind: mid, first: 1, count: 1},
              {kind: big, first: 1, count: 1}]
  - {name: c, uplink_mbit: 12, members: [{kind: mid, first: 0, count: 1}]}
"""
)


def _write(tmp: Path, data: dict) -> Path:
    p = tmp / "box.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _tri(**change) -> dict:
    data = yaml.safe_load(yaml.safe_dump(TRI))  # a deep copy
    data.update(change)
    return data


def test_a_kind_with_no_nodes_is_refused_where_it_is_declared(tmp_path: Path) -> None:
    data = _tri()
    data["kinds"]["spare"] = dict(data["kinds"]["kv"])
    with pytest.raises(ConfigError, match=r"kinds\.spare: no rack holds a node of this kind"):
        load_box(_write(tmp_path, data))


def test_duplicate_rack_names_are_refused_at_load(tmp_path: Path) -> None:
    data = _tri()
    data["racks"][2]["name"] = "a"
    with pytest.raises(ConfigError, match=r"racks\[2\]\.name: rack 'a' is already racks\[0\]"):
        load_box(_write(tmp_path, data))


def test_quotas_over_this_machine_are_refused() -> None:
    box = make_box(BoxSpec.model_validate(_tri()))
    check_fits(box, cores=2)  # 0.4·2 + 0.2·2 + 0.1·2 = 1.4 of 1.8
    heavy = _tri()
    heavy["kinds"]["big"]["cpu"] = 0.8  # 1.6 + 0.4 + 0.2 = 2.2 cores
    with pytest.raises(ConfigError, match=r"add up to 2\.2 cores .*expected at most 1\.8"):
        check_fits(make_box(BoxSpec.model_validate(heavy)), cores=2)
    heavy["kinds"]["big"]["cpu"] = 1.9  # one node over what the nodes may hold at all
    with pytest.raises(ConfigError, match=r"kinds\.big\.cpu: 1\.9 cores; expected at most 1\.8"):
        check_fits(make_box(BoxSpec.model_validate(heavy)), cores=2)
    for name in ("mix", "thin", "solo", "many"):  # the shipped boxes fit a 2-core machine
        check_fits(load_box(ROOT / f"examples/box/{name}.yaml"), cores=2)


def test_a_budget_that_buys_no_plan_is_refused() -> None:
    box = make_box(BoxSpec.model_validate(_tri()))
    assert min_budget(box) == (2.0, 2.0)  # two kv nodes; both a and b
    check_budget(box, 2.0)
    with pytest.raises(ConfigError, match=r"--budget 1\.5: .*expected --budget 2 or more"):
        check_budget(box, 1.5)
    for bad in (float("nan"), 0.0, -3.0):
        with pytest.raises(ConfigError, match="expected a positive number"):
            check_budget(box, bad)
    single = _tri()
    single["racks"] = [
        {"name": "a", "uplink_mbit": 4, "members": [{"kind": k, "count": 1}]} for k in ("big",)
    ]
    single["kinds"] = {"big": TRI["kinds"]["big"]}
    with pytest.raises(ConfigError, match="has 1 node; a plan needs two"):
        check_budget(make_box(BoxSpec.model_validate(single)), 100.0)
    apart = _tri()
    apart["kinds"].pop("kv")
    apart["racks"] = [
        {"name": "a", "uplink_mbit": 4, "members": [{"kind": "big", "count": 1}]},
        {"name": "b", "uplink_mbit": 4, "members": [{"kind": "mid", "count": 1}]},
    ]
    with pytest.raises(ConfigError, match=r"one-kind baseline \(plan b\) needs two nodes"):
        check_budget(make_box(BoxSpec.model_validate(apart)), 100.0)


def test_the_one_kind_baseline_leaves_out_racks_without_that_kind() -> None:
    """Rack c holds only mid: big's and kv's one-kind inventories have no rack c."""
    from hexctl.bench.system.hetero import one_kind_cluster
    from hexctl.box.profile import inventory
    from scheduler.cluster import ClusterSpec, make_cluster

    box = make_box(BoxSpec.model_validate(_tri()))
    figures = {"bf16_tflops": 0.01, "hbm_gb": 2.5, "hbm_gbs": 0.04}
    spec = inventory(box, {k: figures for k in box.spec.kinds}, reload_ms=5.0)
    cl = make_cluster(ClusterSpec.model_validate(spec), "tri")
    for kind, racks in (("big", ["a", "b"]), ("kv", ["a", "b"]), ("mid", ["b", "c"])):
        alone = one_kind_cluster(cl, kind)
        assert [g.name for g in alone.spec.node_groups] == [kind]
        assert [r.name for r in alone.spec.racks] == racks
        assert set(alone.rack_of) == {f"{kind}-0", f"{kind}-1"}


@pytest.fixture
def unbuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine of 2 cores on which reaching the box (root check, build) fails the test."""
    from hexctl.box import emulate

    def built(*_args: object) -> None:
        raise AssertionError("the box was reached (check_host, up) before the refusal")

    for name in ("check_host", "_build"):
        monkeypatch.setattr(emulate, name, built)
    monkeypatch.setattr("os.cpu_count", lambda: 2)


def _heavy(tmp: Path) -> Path:
    """TRI with big at 0.8 cores: 1.6 + 0.4 + 0.2 = 2.2 cores of nodes."""
    heavy = _tri()
    heavy["kinds"]["big"]["cpu"] = 0.8
    (tmp / "heavy").mkdir()
    return _write(tmp / "heavy", heavy)


@pytest.mark.usefixtures("unbuilt")
def test_bench_hetero_refuses_before_the_box_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hexctl.cli import main

    (tmp_path / "poor").mkdir()
    cases = [
        (_heavy(tmp_path), "6", "add up to 2.2 cores"),
        (_write(tmp_path / "poor", _tri()), "1.5", "expected --budget 2 or more"),
    ]
    for path, budget, message in cases:
        t0 = time.monotonic()
        assert main(["bench", "hetero", "--box", str(path), "--budget", budget]) == 2
        assert message in capsys.readouterr().err
        assert time.monotonic() - t0 < 10


@pytest.mark.usefixtures("unbuilt")
def test_box_up_refuses_a_box_over_this_machine_in_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hexctl.cli import main

    t0 = time.monotonic()
    assert main(["box", "up", str(_heavy(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "does not fit this machine (2 cores" in err and "racks: the nodes' CPU" in err
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("seed", range(40))
def test_random_boxes_are_feasible(seed: int) -> None:
    data = random_box(seed)
    box = make_box(BoxSpec.model_validate(data), f"seed {seed}")
    check_fits(box, cores=2)
    least, one_kind = min_budget(box)
    assert one_kind is not None
    check_budget(box, max(least, one_kind))
    kinds = box.spec.kinds
    assert 2 <= len(kinds) <= 4 and 1 <= len(box.spec.racks) <= 3
    assert all(2 <= r.uplink_mbit <= 50 and r.members for r in box.spec.racks)
    # a comparative advantage: the most CPU comes with the smallest batch, and the reverse
    most_cpu = max(kinds, key=lambda k: kinds[k].cpu)
    most_kv = max(kinds, key=lambda k: kinds[k].max_running_requests)
    assert most_cpu != most_kv
    assert kinds[most_cpu].max_running_requests == min(
        k.max_running_requests for k in kinds.values()
    )


def test_random_boxes_differ_by_seed_and_number_nodes_across_racks() -> None:
    boxes = [make_box(BoxSpec.model_validate(random_box(s))) for s in range(40)]
    assert len({yaml.safe_dump(b.spec.model_dump()) for b in boxes}) == 40
    assert {len(b.spec.kinds) for b in boxes} == {2, 3, 4}
    assert {len(b.spec.racks) for b in boxes} == {1, 2, 3}
    # a kind's nodes split over racks, not in number order: some rack starts a kind past 0
    # while a later rack holds its node 0
    across = 0
    for b in boxes:
        rack_of = {n.name: n.rack for n in b.nodes}
        across += any(rack_of[f"{k}-0"] > rack_of.get(f"{k}-1", -1) >= 0 for k in b.spec.kinds)
    assert across >= 5


def test_box_random_writes_the_same_file_for_a_seed(tmp_path: Path) -> None:
    from hexctl.cli import main

    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    assert main(["box", "random", "--seed", "11", "--out", str(a)]) == 0
    assert main(["box", "random", "--seed", "11", "--out", str(b)]) == 0
    assert main(["box", "random", "--seed", "12", "--out", str(c)]) == 0
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    box = load_box(a)
    check_fits(box, cores=2)
    got = write_random_box(11, tmp_path / "d.yaml")
    assert got["box"] == box.name and got["nodes"] == len(box.nodes)


def _profiled(box, out: Path):  # -> LocalProfileFiles
    """What `profile --box` writes for `box`, with rates that follow each kind's CPU share
    (qwen3-0.6b, the math workload with a small batch): the planner's inputs."""
    import json

    from hexctl.box.profile import inventory
    from hexctl.job.predict import LocalProfileFiles
    from scheduler.model_shape import load_model_shape
    from scheduler.profile import DeviceRates, Profile, save_profile

    files = LocalProfileFiles(out)
    m = load_model_shape("qwen3-0.6b")
    files.model.mkdir(parents=True)
    (files.model / "config.json").write_text(json.dumps(m.hf_config()))
    w = yaml.safe_load((ROOT / "examples/workloads/math_grpo.yaml").read_text())
    w.update({"groups_per_step": 4, "group_size": 8, "max_trainer_nodes": 1})
    files.workload.write_text(yaml.safe_dump(w))
    gpu = {"bf16_tflops": 100.0, "hbm_gb": 80.0, "hbm_gbs": 2000.0}
    files.cluster.write_text(
        yaml.safe_dump(inventory(box, dict.fromkeys(box.spec.kinds, gpu), 5.0))
    )
    rates = {
        k: DeviceRates(
            device="box",
            decode_step_s={1: 0.01 / s.cpu, s.max_running_requests: 0.05 / s.cpu},
            decode_context=256,
            prefill_tokens_per_s=2000 * s.cpu,
            train_tokens_per_s=500 * s.cpu,
        )
        for k, s in box.spec.kinds.items()
    }
    save_profile(Profile(model=str(files.model), params=m.params, kinds=rates), files.profile)
    return files


@pytest.mark.parametrize("seed", range(0, 30, 5))
def test_every_random_box_is_planned(tmp_path: Path, seed: int) -> None:
    """bench hetero's plans a, b and c are made on any box the checks pass, at the least
    budget they allow and at the price of every node: a rack without some kind, a kind
    on one rack only or with one node, up to four kinds and three racks."""
    from hexctl.bench.system.hetero import make_plans

    box = make_box(BoxSpec.model_validate(random_box(seed)))
    files = _profiled(box, tmp_path)
    every = sum(box.spec.kinds[n.kind].usd_per_hour for n in box.nodes)
    least, one_kind = min_budget(box)
    assert one_kind is not None
    for budget in (max(least, one_kind), every):
        check_budget(box, budget)
        plans = make_plans(files, budget, time_limit_s=20)
        assert set(plans) == {"a", "b", "c"}
        for plan in plans.values():
            assert plan.predicted.cost_usd_per_h <= budget + 1e-6
            nodes = [i.placement.node for i in plan.rollout] + [plan.trainer.placements[0].node]
            assert all(box.node(n).name == n for n in nodes)  # the box's own nodes
            assert len(plan.trainer.placements) == 1
        assert len({i.gpu_kind for i in plans["b"].rollout} | {plans["b"].trainer.gpu_kind}) == 1
