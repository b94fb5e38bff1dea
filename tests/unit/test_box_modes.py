"""`bench modes --box`: what a box cannot run is refused before it is built or profiled,
and one box profile prices every mode from the planner's plan of each placement. The
profiles are synthetic: the thin box's measured `mem` kind (0.2 of a core) scaled to each
kind's quota (`DeviceRates.at_speed`), so no box runs here."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import yaml

from areal_hex.errors import UsageError
from hexctl.bench.system.modes import MODES
from hexctl.bench.system.modes_cluster import mode_plans, mode_predictions, runnable_modes
from hexctl.box.spec import load_box
from hexctl.job.predict import LocalProfileFiles

ROOT = Path(__file__).resolve().parents[2]
THIN = ROOT / "tests/data/box_thin_profile"
TINY_BOX = str(ROOT / "examples/box/tiny_box.yaml")
MEM_CPU = 0.2  # the thin box's mem kind, whose rates every synthetic kind scales


def _profile(box_path: Path, out: Path) -> LocalProfileFiles:
    """A `profile --box` of the box at `box_path` as its kinds' quotas imply: the thin
    profile's mem rates and device figures times each kind's cpu over 0.2."""
    from hexctl.box.profile import inventory
    from scheduler.profile import Profile, load_profile, save_profile

    box = load_box(box_path)
    shutil.copytree(THIN / "model", out / "model")
    thin = load_profile(THIN / "profile.yaml")
    figures = yaml.safe_load((THIN / "cluster.yaml").read_text())["gpu_overrides"]["mem"]
    kinds, overrides = {}, {}
    for name, kind in box.spec.kinds.items():
        f = kind.cpu / MEM_CPU
        kinds[name] = thin.kinds["mem"].at_speed(f)
        overrides[name] = {
            "bf16_tflops": figures["bf16_tflops"] * f,
            "hbm_gb": figures["hbm_gb"],
            "hbm_gbs": figures["hbm_gbs"] * f,
        }
    model = str(out / "model")
    save_profile(Profile(model=model, params=thin.params, kinds=kinds), out / "profile.yaml")
    spec = inventory(box, overrides, reload_ms=86.0)
    (out / "cluster.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    w = yaml.safe_load((THIN / "workload.yaml").read_text())
    w.update(weight_sync="disk", groups_per_step=8)  # tiny_box.yaml's
    (out / "workload.yaml").write_text(yaml.safe_dump(w, sort_keys=False))
    return LocalProfileFiles(out)


def _priced(name: str, budget: float, tmp: Path) -> tuple[dict, dict, str]:
    box = ROOT / f"examples/box/{name}.yaml"
    files = _profile(box, tmp / name)
    plans, missing, pick = mode_plans(files, budget, list(MODES), time_limit_s=20.0)
    assert missing == {}
    return plans, mode_predictions(TINY_BOX, [f"run.box={name}"], plans), pick


def test_few_devices_colocated_is_priced_fastest(tmp_path: Path) -> None:
    """solo at $2/h: the big node alone (colocated) or the two small ones (split)."""
    plans, rates, pick = _priced("solo", 2.0, tmp_path)
    colocated = plans["colocated-sync"]
    assert colocated.decisions.placement == "colocated"
    assert {i.placement.node for i in colocated.rollout} == {"big-0"}
    assert [p.node for p in colocated.trainer.placements] == ["big-0"]
    split = plans["disaggregated-async"]
    assert {i.placement.node for i in split.rollout} | {split.trainer.placements[0].node} == {
        "small-0",
        "small-1",
    }
    assert plans["disaggregated-sync"] is split and plans["hybrid-sync"] is plans["hybrid-async"]
    lent = plans["hybrid-async"]
    assert lent.rollout[lent.decisions.lent[0]].placement.node == lent.trainer.placements[0].node
    assert all(r is not None and r > 0 for r in rates.values()), rates
    best = max(rates, key=lambda n: rates[n] or 0.0)
    assert best == "colocated-sync" == pick
    assert rates["colocated-sync"] > 1.3 * rates["disaggregated-async"]
    # the plan records the price its run is held against: the layout's synchronous replay
    # and one switch a step, not the planner's estimate of the step
    assert colocated.predicted.samples_per_s == pytest.approx(rates["colocated-sync"], abs=1e-3)
    assert rates["disaggregated-async"] > rates["disaggregated-sync"]


def test_many_devices_a_split_is_priced_fastest(tmp_path: Path) -> None:
    """many at $7/h: every node bought; colocated still runs on one."""
    plans, rates, pick = _priced("many", 7.0, tmp_path)
    split = plans["disaggregated-async"]
    assert split.trainer.placements[0].node == "fast-0" and len(split.rollout) == 4
    assert len(plans["colocated-sync"].rollout) == 1
    best = max(rates.values(), key=lambda r: r or 0.0)
    # a hybrid whose own servers keep up lends nothing: priced as the split, a tie
    assert pick in ("disaggregated-async", "hybrid-async") and rates[pick] == best
    assert max(rates, key=lambda n: rates[n] or 0.0) in ("disaggregated-async", "hybrid-async")
    # one node of five, synchronous (0.63 of the split: no cycle factor on a box kind)
    assert rates["colocated-sync"] is not None and rates["colocated-sync"] < 0.7 * best
    # the hybrid's servers of their own are priced on their own nodes (not all of them)
    assert rates["hybrid-async"] is not None and rates["hybrid-sync"] is not None


def _one_node(tmp: Path) -> Path:
    box = {
        "name": "one",
        "kinds": {"k": {"cpu": 0.5, "max_running_requests": 8, "usd_per_hour": 1.0,
                        "nic_mbit": 100}},
        "racks": [{"name": "a", "uplink_mbit": 100, "members": [{"kind": "k", "count": 1}]}],
    }  # fmt: skip
    path = tmp / "one.yaml"
    path.write_text(yaml.safe_dump(box))
    return path


def test_a_box_skips_the_modes_it_cannot_run_and_refuses_them_by_name(tmp_path: Path) -> None:
    one = load_box(_one_node(tmp_path))
    left, skipped = runnable_modes(one, 5.0, list(MODES), named=False)
    assert left == ["colocated-sync"]
    assert set(skipped) == set(MODES) - {"colocated-sync"}
    assert "has 1 node; a hybrid plan needs 2" in skipped["hybrid-async"]
    with pytest.raises(UsageError, match=r"disaggregated-sync: box 'one' has 1 node"):
        runnable_modes(one, 5.0, ["colocated-sync", "disaggregated-sync"], named=True)
    with pytest.raises(UsageError, match=r"colocated-sync: --budget 0.5 buys no colocated"):
        runnable_modes(one, 0.5, list(MODES), named=False)  # nothing left to run
    solo = load_box(ROOT / "examples/box/solo.yaml")
    assert runnable_modes(solo, 2.0, list(MODES), named=True) == (list(MODES), {})


@pytest.fixture
def unbuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-core machine on which reaching the box or its profile fails the test."""
    from hexctl.box import emulate
    from hexctl.box import profile as box_profile

    def reached(*_args: object, **_kw: object) -> None:
        raise AssertionError("the box was reached (check_host, up, profile) before the refusal")

    for name in ("check_host", "_build"):
        monkeypatch.setattr(emulate, name, reached)
    monkeypatch.setattr(box_profile, "profile_box", reached)
    monkeypatch.setattr("os.cpu_count", lambda: 2)


@pytest.mark.usefixtures("unbuilt")
def test_bench_modes_box_refuses_in_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hexctl.cli import main

    solo = str(ROOT / "examples/box/solo.yaml")
    one = str(_one_node(tmp_path))
    heavy = yaml.safe_load(Path(solo).read_text())
    heavy["kinds"]["big"]["cpu"] = 1.5  # 1.5 + 2 x 0.3 = 2.1 cores of 1.8
    (tmp_path / "heavy.yaml").write_text(yaml.safe_dump(heavy))
    cases = [
        (["--box", solo], "expected --budget B"),
        (["--budget", "2"], "--budget without --box"),
        (["--profile-dir", str(tmp_path)], "--profile-dir without --box"),
        (["--box", solo, "--budget", "-1"], "--budget -1: expected a positive"),
        (["--box", solo, "--budget", "2", "--profile-first"], "--profile-first is for this"),
        (["--box", solo, "--budget", "2", "--profile-fresh"], "--profile-fresh is for this"),
        (["--box", solo, "--budget", "2", "--profile-dir", str(tmp_path)], "no profile.yaml"),
        (["--box", solo, "--budget", "2", "--steps", "0"], "--steps 0: expected 1 or more"),
        (["--box", solo, "--budget", "2", "--modes", "colocated-eager"], "unknown colocated-eager"),
        (["--box", str(tmp_path / "heavy.yaml"), "--budget", "2"], "add up to 2.1 cores"),
        (
            ["--box", solo, "--budget", "1", "--modes", "disaggregated-async,colocated-sync"],
            "disaggregated-async: --budget 1 buys no disaggregated plan: its cheapest 2 nodes "
            "cost 2 $/h",
        ),
        (["--box", one, "--budget", "3", "--modes", "hybrid-sync"], "a hybrid plan needs 2"),
    ]
    for flags, message in cases:
        t0 = time.monotonic()
        assert main(["bench", "modes", "--json", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)
        assert time.monotonic() - t0 < 10


def test_a_placement_the_planner_cannot_make_is_named_not_run(tmp_path: Path) -> None:
    """solo at $1/h buys one small node: colocated runs there; the split generates
    nothing (its plan has no server), so neither it nor a hybrid of it is run."""
    files = _profile(ROOT / "examples/box/solo.yaml", tmp_path / "solo")
    plans, missing, pick = mode_plans(files, 1.0, list(MODES), time_limit_s=20.0)
    assert list(plans) == ["colocated-sync"] and pick == "colocated-sync"
    assert [i.placement.node for i in plans["colocated-sync"].rollout] == ["small-0"]
    assert set(missing) == set(MODES) - {"colocated-sync"}
    assert "no disaggregated plan at $1/h: no split" in missing["disaggregated-sync"]
    assert "no hybrid plan at $1/h" in missing["hybrid-async"]


def _solo_up(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """The state file `box up` writes for solo, without bringing it up."""
    import json
    from dataclasses import asdict

    from hexctl.box import emulate

    monkeypatch.setattr(emulate, "STATE_ROOT", tmp / "run")
    box = load_box(ROOT / "examples/box/solo.yaml")
    kinds = box.spec.kinds
    nodes = {
        n.name: emulate.NodeState(
            n.name, n.kind, "a", emulate.netns_name("solo", n.name), box.address(n), "eth0",
            f"/cg/{n.name}", kinds[n.kind].cpu, kinds[n.kind].max_running_requests,
        )
        for n in box.nodes
    }  # fmt: skip
    state = emulate.BoxState("solo", box.host_address, 24, nodes, {})
    emulate.state_dir("solo").mkdir(parents=True)
    (emulate.state_dir("solo") / "state.json").write_text(json.dumps(asdict(state)))
    return state


def _placed(name: str, plan: object, tmp: Path) -> tuple[object, dict]:
    """Mode `name` of `plan` as the box's launcher starts it: (config, process by name)."""
    from hexctl.bench.system.modes_cluster import mode_config
    from hexctl.box.place import place_on_box
    from hexctl.box.run_config import apply_box
    from hexctl.job.layout import build_layout
    from hexctl.launch.run import process_specs

    extra = ["run.box=solo", "run.run_id=r", f"run.output_dir={tmp}"]
    cfg = mode_config(TINY_BOX, extra, name, plan)
    cfg.run.embedded_redis, cfg.redis.port = True, 6399
    apply_box(cfg, plan)  # type: ignore[arg-type]
    layout = build_layout(cfg, plan)  # type: ignore[arg-type]
    specs = process_specs(cfg, layout, tmp / "config.yaml")
    place_on_box(cfg, layout, specs)
    return cfg, {s.name: s for s in specs}


def test_colocated_and_hybrid_runs_share_the_trainers_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Colocated: the server and the trainer start in the big node (one cgroup, one
    quota, taken in turn); hybrid: the lent server in the trainer's node, its own server
    in the other node."""
    state = _solo_up(tmp_path, monkeypatch)
    files = _profile(ROOT / "examples/box/solo.yaml", tmp_path / "solo")
    plans, _, _ = mode_plans(files, 2.0, ["colocated-sync", "hybrid-async"], time_limit_s=20.0)
    big = state.node("big-0")  # type: ignore[attr-defined]
    cfg, procs = _placed("colocated-sync", plans["colocated-sync"], tmp_path)
    assert (cfg.workflow.placement, cfg.run.mode) == ("colocated", "sync")
    servers = [p for n, p in procs.items() if n.startswith("rollout-")]
    assert len(servers) == 1 and cfg.inference.server_urls[0].startswith(f"http://{big.address}:")
    for proc in (servers[0], procs["trainer"]):
        assert proc.command[4:6] == [big.cgroup, big.netns]
        assert proc.env["OMP_WAIT_POLICY"] == "PASSIVE" and proc.env["OMP_NUM_THREADS"] == "2"
    assert f"inference.host={big.address}" in servers[0].command

    plan = plans["hybrid-async"]
    cfg, procs = _placed("hybrid-async", plan, tmp_path / "h")
    assert (cfg.workflow.placement, cfg.workflow.lent_servers) == ("hybrid", 1)
    trainer = state.node(plan.trainer.placements[0].node)  # type: ignore[attr-defined]
    servers = [p for n, p in sorted(procs.items()) if n.startswith("rollout-")]
    netns = {p.command[5] for p in servers}
    assert trainer.netns in netns and len(netns) == 2
    assert procs["trainer"].command[5] == trainer.netns
