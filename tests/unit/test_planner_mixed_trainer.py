"""A trainer across GPU kinds (heterogeneous data parallelism): chosen where it pays, priced
as the simulator replays it, carried by plan.yaml to `run`, rendered by `deploy --target
k8s` as a JobSet with a job per kind, and refused by the other targets with the field
named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError, load_config
from areal_hex.plan import PlanSources, load_plan, save_plan
from hexctl.cli import main
from hexctl.job.plan_config import subsample_rank_speeds
from hexctl.job.predict import predict_run
from hexctl.job.prepare import apply_plan
from scheduler.cluster import ClusterSpec, load_cluster, make_cluster
from scheduler.milp import solve, solve_per_kind
from scheduler.model_shape import load_model_shape
from scheduler.planner import make_plan
from scheduler.trainers import cost_trainer, rank_speed, shared_compute_s, trainer_configs
from scheduler.workload import load_workload

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"
MIXED = EX / "clusters" / "mixed_trainer_h800_h20.yaml"
LONG = EX / "workloads" / "long_cot.yaml"
BUDGET = 180.0  # 89 % of the inventory's price


@pytest.fixture(scope="module")
def planned():
    cl, m, w = load_cluster(MIXED), load_model_shape("qwen3-8b"), load_workload(LONG)
    return cl, m, w, make_plan(cl, m, w, budget=BUDGET)


def _spec(groups: list[dict], zones: list[dict] | None = None, links: list[dict] | None = None):
    zones = zones or [{"name": "dc1", "region": "r1", "inter_node_bandwidth_gbs": 25.0}]
    base = {"usd_per_gpu_hour": 2.0, "intra_node": {"kind": "nvlink", "bandwidth_gbs": 300}}
    spec = {"name": "t", "zones": zones, "node_groups": [{**base, **g} for g in groups]}
    return make_cluster(ClusterSpec.model_validate({**spec, "links": links or []}))


def test_shares_in_proportion_to_speed_in_whole_samples() -> None:
    # one speed: ⌈B / ranks⌉ samples per rank, as a one-kind trainer is priced
    assert shared_compute_s(100, [(8, 2.0)]) == pytest.approx(math.ceil(100 / 8) / 2.0)
    # 3:1 speeds, 10 samples: 7 + 2 leaves one over, so the fast rank takes 8 (T = 8/3)
    assert shared_compute_s(10, [(1, 3.0), (1, 1.0)]) == pytest.approx(8 / 3)
    # divisible shares take exactly B / Σ speeds
    assert shared_compute_s(64, [(4, 3.0), (4, 1.0)]) == pytest.approx(64 / 16)


def test_mixed_trainer_is_picked_where_it_pays(planned) -> None:
    cl, m, w, res = planned
    c = res.solution.trainer
    assert c.mixed and c.kind == "H800+H20" and c.kinds == ("H800", "H20")
    assert c.parts[0] == ("h800", 16)  # every H800 machine, rank 0 on the fastest kind
    # compute = B·G over the ranks' summed speeds (whole samples), each kind at its speed
    s800, s20 = (rank_speed(m, w, cl.kinds[g], None) for g in ("h800", "h20"))
    h20 = sum(n for g, n in c.parts if g == "h20")
    assert c.part_speeds == tuple(s800 if k == "H800" else s20 for k in c.part_kinds)
    assert c.compute_s == pytest.approx(
        shared_compute_s(w.samples_per_step, [(16, s800), (h20, s20)])
    )
    assert c.compute_s < math.ceil(w.samples_per_step / 16) / s800  # the H20s add speed
    assert c.usd_per_h == pytest.approx(16 * 5.28 + h20 * 1.85)
    # faster than the best plan whose trainer keeps to one kind, and than every baseline
    one_kind = make_plan(
        cl,
        m,
        w.model_copy(update={"mixed_trainer": False}),
        budget=BUDGET,
        simulate_plan=False,
        baselines=False,
    )
    assert not one_kind.solution.trainer.mixed
    rate = res.plan.predicted.samples_per_s
    assert rate > 1.1 * one_kind.plan.predicted.samples_per_s
    assert rate > max(res.homogeneous.values())
    # the simulator replays it within 5 %
    assert res.sim is not None
    assert abs(res.sim.samples_per_s - res.rate) / res.rate <= 0.05


def test_homogeneous_baselines_stay_one_kind(planned) -> None:
    _, _, _, res = planned
    sols = solve_per_kind(res.problem, budget=BUDGET, cheapest=False)
    assert set(sols) == {"H800", "H20"}
    for kind, sol in sols.items():
        assert sol is not None and not sol.trainer.mixed and sol.trainer.kind == kind
    both = solve(res.problem, budget=BUDGET, allowed_kinds={"H800", "H20"})
    assert both is not None and both.trainer.mixed  # allowed when every kind it spans is


def test_each_kind_must_hold_the_stage_in_its_own_hbm() -> None:
    cl = _spec(
        [
            {"name": "h800", "gpu": "H800", "gpus_per_node": 8, "nodes": 2, "zone": "dc1"},
            {"name": "l4", "gpu": "L4", "gpus_per_node": 8, "nodes": 2, "zone": "dc1"},
        ]
    )
    m = load_model_shape("qwen3-8b")
    w = load_workload(EX / "workloads" / "math_grpo.yaml").model_copy(update={"zero_stage": 2})
    alone = cost_trainer(cl, m, w, (("h800", 16),), 8, None)
    assert alone is not None and 24 < alone.mem_gb <= 80  # fits an H800, not a 24 GB L4
    assert cost_trainer(cl, m, w, (("h800", 16), ("l4", 8)), 8, None) is None
    assert not any(c.mixed and c.zero == 2 for c in trainer_configs(cl, m, w))


def _zones(region_b: str) -> list[dict]:
    """Zone a in region r1, zone b in `region_b`."""
    return [
        {"name": "a", "region": "r1", "inter_node_bandwidth_gbs": 25.0},
        {"name": "b", "region": region_b, "inter_node_bandwidth_gbs": 25.0},
    ]


def test_only_kinds_of_one_region_with_equal_gpus_per_node_mix() -> None:
    zones = _zones("r2")
    cl = _spec(
        [
            {"name": "h800", "gpu": "H800", "gpus_per_node": 8, "nodes": 2, "zone": "a"},
            {"name": "h20", "gpu": "H20", "gpus_per_node": 8, "nodes": 3, "zone": "a"},
            {"name": "l40s", "gpu": "L40S", "gpus_per_node": 4, "nodes": 2, "zone": "a"},
            {"name": "a100", "gpu": "A100-80GB", "gpus_per_node": 8, "nodes": 2, "zone": "b"},
        ],
        zones,
        [{"a": "r1", "b": "r2", "bandwidth_gbs": 1.0, "latency_ms": 20}],
    )
    m, w = load_model_shape("qwen3-8b"), load_workload(LONG)
    mixed = [c for c in trainer_configs(cl, m, w) if c.mixed]
    # H800 and H20 only (L40S has 4 GPUs per node, the A100s are in another region):
    # all H800 machines plus 1, 2, 3 H20 machines
    assert sorted(c.parts for c in mixed) == [(("h800", 16), ("h20", 8 * k)) for k in (1, 2, 3)]
    assert {c.kind for c in mixed} == {"H800+H20"}


def test_one_kind_inventory_never_yields_a_mixed_trainer() -> None:
    zones = _zones("r1")
    cl = _spec(
        [
            {"name": "x", "gpu": "H800", "gpus_per_node": 8, "nodes": 2, "zone": "a"},
            {"name": "y", "gpu": "H800", "gpus_per_node": 8, "nodes": 3, "zone": "b"},
        ],
        zones,
        [{"a": "a", "b": "b", "bandwidth_gbs": 5.0, "latency_ms": 0.1}],
    )
    m, w = load_model_shape("qwen3-8b"), load_workload(LONG)
    opts = trainer_configs(cl, m, w)
    assert any(len(c.parts) == 2 for c in opts)  # groups of one kind still combine
    assert all(c.kind == "H800" and not c.mixed for c in opts)
    res = make_plan(cl, m, w, budget=200, simulate_plan=False, baselines=False)
    assert res.plan.trainer.gpu_kind == "H800" and res.plan.trainer.rank_speeds is None


def test_plan_yaml_round_trips_and_carries_rank_speeds(planned, tmp_path) -> None:
    _, _, w, res = planned
    c, t = res.solution.trainer, res.plan.trainer
    assert t.gpu_kind == "H800+H20" and t.mixed and t.kinds == ["H800", "H20"]
    assert t.gpu_kinds == ["H800"] * 2 + ["H20"] * (len(t.placements) - 2)
    assert [p.node for p in t.placements[:2]] == ["h800-0", "h800-1"]
    toks = w.prompt_tokens + w.response_tokens
    assert t.rank_speeds is not None and len(t.rank_speeds) == t.world_size == c.dp
    assert t.rank_speeds[0] == pytest.approx(c.part_speeds[0] * toks, abs=0.01)
    assert t.rank_speeds[-1] == pytest.approx(c.part_speeds[-1] * toks, abs=0.01)
    path = save_plan(res.plan, tmp_path / "plan.yaml")
    again = load_plan(path)
    assert again == res.plan and again.schema_version == 3
    raw = yaml.safe_load(path.read_text())
    assert raw["trainer"]["rank_speeds"] == t.rank_speeds


def test_old_and_bad_plans(planned, tmp_path) -> None:
    old = load_plan(ROOT / "tests" / "data" / "planner_hetrl_plan.yaml")  # schema 1
    assert old.trainer.rank_speeds is None and old.trainer.gpu_kinds is None
    assert not old.trainer.mixed and old.trainer.kinds == [old.trainer.gpu_kind]
    raw = yaml.safe_load(save_plan(planned[3].plan, tmp_path / "p.yaml").read_text())
    bad = tmp_path / "bad.yaml"
    for key, value, expect in [
        ("rank_speeds", [1.0, 2.0], "rank_speeds has 2 values for world_size"),
        ("rank_speeds", [0.0] * raw["trainer"]["world_size"], "one positive speed per rank"),
        ("gpu_kinds", ["H800"], "expected one GPU kind per placement"),
    ]:
        bad.write_text(yaml.safe_dump({**raw, "trainer": {**raw["trainer"], key: value}}))
        with pytest.raises(ConfigError, match=expect):
            load_plan(bad)
    bad.write_text(yaml.safe_dump({**raw, "schema_version": 4}))
    with pytest.raises(ConfigError, match="schema_version"):
        load_plan(bad)
    # a version 3 plan holds its decisions in `decisions`, not among the comparisons
    moved = {**raw["baselines"], "max_staleness": 4}
    bad.write_text(yaml.safe_dump({**raw, "baselines": moved}))
    with pytest.raises(ConfigError, match="'max_staleness' is now 'decisions.max_staleness'"):
        load_plan(bad)
    no_decisions = {k: v for k, v in raw.items() if k != "decisions"}
    bad.write_text(yaml.safe_dump(no_decisions))
    with pytest.raises(ConfigError, match="decisions"):
        load_plan(bad)
    # a version 2 plan's η and k, written among its baselines, are its decisions
    old_raw = {**no_decisions, "schema_version": 2, "baselines": moved}
    bad.write_text(yaml.safe_dump(old_raw))
    assert load_plan(bad).decisions.max_staleness == 4


def test_run_sets_rank_speeds_from_the_plan(planned, tmp_path) -> None:
    plan = planned[3].plan
    cfg = load_config(EX / "tiny_cpu.yaml")
    run = apply_plan(cfg, plan)
    speeds = plan.trainer.rank_speeds
    assert speeds is not None and run.trainer.num_ranks == 8
    assert run.trainer.rank_speeds == subsample_rank_speeds(speeds, 8)
    # one node's worth of ranks keeps the plan's mix of kinds (16 H800 of the ranks)
    fast, slow = max(speeds), min(speeds)
    assert speeds.count(fast) == 16 and set(run.trainer.rank_speeds) == {fast, slow}
    assert abs(run.trainer.rank_speeds.count(fast) - 8 * 16 / len(speeds)) <= 0.5
    assert subsample_rank_speeds(speeds, len(speeds)) == speeds
    # the run's prediction prices the same trainer across kinds
    w = planned[2]
    plan = plan.model_copy(update={"sources": PlanSources(cluster=str(MIXED), workload=str(LONG))})
    cfg = load_config(
        EX / "deploy" / "qwen3-8b.yaml",
        [
            f"buffer.groups_per_step={w.groups_per_step}",
            f"rollout.group_size={w.group_size}",
            f"buffer.max_staleness={w.max_staleness}",
            f"rollout.max_new_tokens={w.max_response_tokens}",
            f"inference.context_length={w.prompt_tokens + w.max_response_tokens}",
        ],
    )
    pred = predict_run(cfg, plan)
    assert "unavailable" not in pred, pred
    train = pred["asynchronous"]["training_samples_per_s"]
    assert train == pytest.approx(plan.predicted.training_samples_per_s, rel=1e-3)


def test_compose_refuses_a_trainer_across_kinds(planned, tmp_path, capsys) -> None:
    plan = save_plan(planned[3].plan, tmp_path / "plan.yaml")
    out = tmp_path / "out"
    argv = ["deploy", str(plan), str(EX / "deploy" / "qwen3-8b.yaml"), "--target", "compose"]
    code = main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "Traceback" not in err
    assert "plan.trainer.gpu_kinds: the trainer spans GPU kinds H800 + H20" in err
    assert "--target compose renders a trainer of one GPU kind only" in err
    assert "areal-hex plan --one-kind-trainer" in err and "--target k8s" in err


def test_slurm_renders_a_trainer_across_kinds_one_component_per_kind(
    planned, tmp_path, capsys
) -> None:
    """Each kind's machines are a component of the heterogeneous job with that kind's
    partition and GRES; their torchrun steps share one rendezvous (the first component's
    node 0) and one node count, and the second kind's step starts at node rank 2."""
    import subprocess

    from hexctl.deploy.slurm_site import load_site

    plan_file = save_plan(planned[3].plan, tmp_path / "plan.yaml")
    t = planned[3].plan.trainer
    site = load_site(EX / "slurm" / "site_cluster.yaml")
    site = site.model_copy(update={"shared_dir": str(tmp_path / "shared")})
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump(site.model_dump(mode="json")))
    out = tmp_path / "out"
    argv = ["deploy", str(plan_file), str(EX / "deploy" / "qwen3-8b.yaml"), "trainer.zero_stage=2"]
    argv += ["--target", "slurm", "--site", str(site_file)]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    script = (out / "job.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(out / "job.sbatch")]).returncode == 0
    comps: list[dict[str, str]] = [{}]
    names: list[str] = []
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            comps.append({})
        elif line.startswith("# component "):
            names.append(line.split(": ", 1)[1].split(" ")[0])
        elif line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            comps[-1][key] = value
    by_name = dict(zip(names, comps, strict=True))
    h800, h20 = by_name["trainer"], by_name["trainer-1"]
    assert (h800["partition"], h800["nodes"], h800["gres"]) == ("h800", "2", "gpu:h800:8")
    assert (h20["partition"], h20["nodes"], h20["gres"]) == ("h20", "3", "gpu:h20:8")
    launches = {
        ln.split()[0]: ln
        for ln in script.splitlines()
        if ln.strip().startswith(("trainer) launch", "trainer-1) launch"))
    }
    k0 = names.index("trainer")
    for name in ("trainer", "trainer-1"):
        line = launches[name + ")"]
        assert "PET_NNODES=5" in line and f'PET_MASTER_ADDR="${{C{k0}[0]}}"' in line
        assert f"--het-group={names.index(name)}" in line
    assert "AREAL_HEX_NODE_RANK_OFFSET" not in launches["trainer)"]
    assert "AREAL_HEX_NODE_RANK_OFFSET=2" in launches["trainer-1)"]
    assert "TRAINERS=(trainer trainer-1)" in script
    resolved = yaml.safe_load((out / "config.yaml").read_text())["trainer"]
    assert resolved["rank_speeds"] == t.rank_speeds
    # a site without heterogeneous jobs cannot give one allocation two kinds of machine
    site_file.write_text(yaml.safe_dump({**site.model_dump(mode="json"), "hetjob": False}))
    code = main([*argv, "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "sets `hetjob: false`" in err and "H800 + H20" in err


def test_k8s_renders_a_trainer_across_kinds_one_job_per_kind(planned, tmp_path, capsys) -> None:
    from tests.k8s_schema import validate

    plan_file = save_plan(planned[3].plan, tmp_path / "plan.yaml")
    t = planned[3].plan.trainer
    out = tmp_path / "out"
    cfg = str(EX / "deploy" / "qwen3-8b.yaml")
    argv = ["deploy", str(plan_file), cfg, "trainer.zero_stage=2", "--target", "k8s"]
    assert main([*argv, "--out", str(out)]) == 0
    objs = [o for o in yaml.safe_load_all((out / "30-trainer.yaml").read_text()) if o]
    (js,) = objs
    assert validate(js, "1.30.0") == "1.30"
    jobs = js["spec"]["replicatedJobs"]
    # rank order: 2 H800 machines (node ranks 0-1), then 3 H20 machines (2-4)
    assert [j["name"] for j in jobs] == ["ranks", "ranks-1"]
    assert [j["template"]["spec"]["completions"] for j in jobs] == [2, 3]
    pods = [j["template"]["spec"]["template"]["spec"] for j in jobs]
    assert [p["nodeSelector"]["nvidia.com/gpu.product"] for p in pods] == [
        "NVIDIA-H800",
        "NVIDIA-H20",
    ]
    envs = [{e["name"]: e.get("value") for e in p["containers"][0]["env"]} for p in pods]
    assert all(e["PET_NNODES"] == "5" for e in envs)
    assert "AREAL_HEX_NODE_RANK_OFFSET" not in envs[0]
    assert envs[1]["AREAL_HEX_NODE_RANK_OFFSET"] == "2"
    assert envs[0]["PET_MASTER_ADDR"] == envs[1]["PET_MASTER_ADDR"]
    assert envs[0]["PET_MASTER_ADDR"].startswith(js["metadata"]["name"] + "-ranks-0-0.")
    resolved = yaml.safe_load((out / "resolved" / "config.yaml").read_text())["trainer"]
    assert resolved["num_ranks"] == 8 and resolved["rank_speeds"] == t.rank_speeds
    # the launcher on an H20 pod with completion index 1 is node rank 3
    from hexctl.cli.train_cmd import launcher_env

    env = {"AREAL_HEX_NODE_RANK_OFFSET": "2", "PET_NODE_RANK": "1", "NODE_RANK": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        got = launcher_env(load_config(None, ["trainer.device=cuda"]))
    assert got["PET_NODE_RANK"] == "3" and got["NODE_RANK"] == "3"
    assert "AREAL_HEX_NODE_RANK_OFFSET" not in got
    # an Indexed Job holds one pod template: refused for a trainer across kinds
    again = [*argv, "--trainer-gang", "indexed-job", "--out", str(tmp_path / "o2")]
    assert main(again) == 2
    assert "trainer.gang: the plan's trainer spans GPU kinds" in capsys.readouterr().err


def test_plan_cli_one_kind_trainer(tmp_path, capsys) -> None:
    out = tmp_path / "plan.yaml"
    argv = ["plan", str(MIXED), "--model", "qwen3-8b", "--budget", str(BUDGET)]
    argv += ["--workload", str(LONG), "--no-simulate", "--out", str(out)]
    assert main([*argv, "--one-kind-trainer"]) == 0
    plan = load_plan(out)
    assert not plan.trainer.mixed and "+" not in plan.trainer.gpu_kind
    assert main(argv) == 0
    assert "ranks: 16 H800 at" in capsys.readouterr().out
    assert load_plan(out).trainer.mixed
