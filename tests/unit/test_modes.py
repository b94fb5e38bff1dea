"""Execution modes: `workflow.placement` colocated beside disaggregated, the combinations
the config accepts, and a colocated plan's shared devices."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_hex.config import ConfigError, load_config
from areal_hex.plan import Decisions, Plan, load_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/tiny_cpu.yaml"


def test_colocated_runs_synchronously() -> None:
    cfg = load_config(TINY, ["workflow.placement=colocated", "run.mode=sync"])
    assert cfg.workflow.placement == "colocated"
    assert (cfg.buffer.max_staleness, cfg.trainer.publish_every) == (0, 1)


def test_colocated_async_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"workflow.placement colocated with run.mode async"):
        load_config(TINY, ["workflow.placement=colocated"])
    with pytest.raises(ConfigError, match="expected one of|Input should be"):
        load_config(TINY, ["workflow.placement=hybridised"])
    # `run --mode async` over a colocated config: the same clear error, no traceback
    from hexctl.job.prepare import apply_mode

    colocated = load_config(TINY, ["workflow.placement=colocated", "run.mode=sync"])
    with pytest.raises(ConfigError, match=r"--mode async.*\n.*colocated with run.mode async"):
        apply_mode(colocated, "async")


def _sharing(placement: str) -> dict:
    """A plan whose first generation instance sits on the trainer's first GPU."""
    plan = load_plan(ROOT / "examples/plans/local_cpu.yaml")
    data = plan.model_dump(mode="json")
    data["rollout"][0]["placement"] = data["trainer"]["placements"][0] | {
        "gpu_ids": data["trainer"]["placements"][0]["gpu_ids"][:1]
    }
    data["decisions"]["placement"] = placement
    return data


def test_a_colocated_plan_shares_the_trainers_gpus() -> None:
    with pytest.raises(ValueError, match=r"placed for both 'rollout\[0\]"):
        Plan.model_validate(_sharing("disaggregated"))
    plan = Plan.model_validate(_sharing("colocated"))
    assert plan.decisions.placement == "colocated"
    # still one slot per GPU within a side: two instances on one GPU are refused
    data = _sharing("colocated")
    data["rollout"].append(data["rollout"][0] | {"id": "rollout-cpu-1"})
    with pytest.raises(ValueError, match=r"placed for both 'rollout\[0\].*'rollout\[1\]"):
        Plan.model_validate(data)
    assert Decisions(placement="colocated").placement == "colocated"


# ---------------------------------------------------------------- colocated switching
@pytest.mark.timeout(60)
async def test_colocated_servers_give_their_memory_back_while_the_trainer_steps(
    tmp_path: Path,
) -> None:
    """Sync, B = 2: after each batch the gate holds the controller and the servers
    release; the trainer (this test) sees them released, publishes, and they resume
    before the weights load. No request ever meets a released server."""
    import asyncio

    from fakes import TOK, FakeServer, MemoryProducer

    from areal_hex.config import DataConfig, RolloutConfig
    from areal_hex.data import build_prompts, generate_arithmetic
    from areal_hex.rewards import RewardPool
    from rollout_service.controller.colocate import Colocation
    from rollout_service.controller.rollout import RolloutController

    prompts = build_prompts(generate_arithmetic(8, "train"), TOK, DataConfig()).prompts

    servers = [FakeServer("a", delay_s=0.002), FakeServer("b", delay_s=0.002)]
    producer = MemoryProducer(groups_per_step=2, eta=0)
    pool = RewardPool(workers=1, timeout_s=10.0)
    await pool.start()
    cfg = RolloutConfig(group_size=3, max_new_tokens=16, probe_interval_s=0.05)
    ctl = RolloutController(
        servers,
        producer,
        prompts,
        lambda ids: TOK.decode(ids, skip_special_tokens=True),
        cfg,
        max_groups=6,
        rewards=pool,
        final_version=3,
        metrics_path=tmp_path / "rollout.jsonl",
        phases=Colocation,
    )
    run = asyncio.create_task(ctl.run())
    seen = []
    try:
        for v in range(1, 4):
            while len(producer.groups) < 2 * v:
                await asyncio.sleep(0.005)
            if v < 3:  # the last batch is the run's last: nothing to yield for
                while not all(s.released for s in servers):
                    await asyncio.sleep(0.005)
            seen.append([s.released for s in servers])
            await producer.publish(v, "")
        final = await asyncio.wait_for(run, 20)
    finally:
        await pool.aclose()
    assert seen == [[True, True], [True, True], [False, False]]
    assert [s.memory_calls for s in servers] == [["release", "resume"] * 2] * 2
    assert final["context_switches_total"] == 2 and final["context_switch_s_total"] > 0
    assert final["requests_retried_total"] == 0 and final["groups_failed_total"] == 0
    assert len(producer.groups) == 6 and not any(s.released for s in servers)


def test_colocated_processes_use_every_core(tmp_path: Path) -> None:
    """No core split: the server's and the trainer's threads are all the usable cores."""
    import os

    from hexctl.job.cores import core_groups, usable_cores
    from hexctl.job.layout import build_layout
    from hexctl.launch.run import process_specs

    cores = usable_cores()
    if cores is None or len(cores) < 2:
        pytest.skip("fewer than 2 usable cores")
    assert core_groups(True, "colocated") == (cores, cores)
    inf, tr = core_groups(True)
    assert inf is not None and tr is not None and not inf & tr
    for pin in ("true", "false"):
        cfg = load_config(
            TINY,
            [f"run.output_dir={tmp_path}", "run.run_id=r", f"run.pin_cores={pin}"]
            + ["workflow.placement=colocated", "run.mode=sync"],
        )
        specs = {s.name: s for s in process_specs(cfg, build_layout(cfg), tmp_path / "c.yaml")}
        every = len(cores) if pin == "true" else os.cpu_count()
        assert specs["inference-0"].env["OMP_NUM_THREADS"] == str(every)
        assert {s.env.get("OMP_WAIT_POLICY") for s in specs.values()} == {"PASSIVE"}
        apart = load_config(TINY, [f"run.output_dir={tmp_path}", "run.run_id=r"])
        split = process_specs(apart, build_layout(apart), tmp_path / "c.yaml")
        assert all("OMP_WAIT_POLICY" not in s.env for s in split)
        if pin == "true":
            assert specs["trainer"].env["OMP_NUM_THREADS"] == str(every)
            assert specs["inference-0"].cpus == specs["trainer"].cpus == cores


# ---------------------------------------------------------------- the planner's pick
def _plan_on(cluster: str, budget: float):
    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.planner import make_plan
    from scheduler.workload import load_workload

    w = load_workload(ROOT / "examples/workloads/math_grpo.yaml")
    return make_plan(
        load_cluster(ROOT / cluster),
        load_model_shape("qwen3-8b"),
        w,
        budget=budget,
        time_limit_s=10,
        simulate_plan=False,
    )


def test_few_gpus_pick_colocated_and_the_config_follows(tmp_path: Path) -> None:
    """Two GPUs: split, neither side keeps up (no asynchronous plan generates); in turn,
    both generate and both train. The projection runs it colocated and synchronous."""
    from hexctl.job.plan_config import project_plan
    from scheduler.report import table

    res = _plan_on("tests/data/one_node_2gpu.yaml", 20.0)
    plan = res.plan
    b = plan.baselines
    assert plan.decisions.placement == "colocated"
    assert (plan.decisions.max_staleness, plan.decisions.publish_every) == (0, 1)
    assert plan.predicted.samples_per_s == b.synchronous_samples_per_s > 0
    assert b.disaggregated_samples_per_s == 0.0
    shared = {(s.node, g) for w, _, s in plan.device_slots() if w == "trainer" for g in s.gpu_ids}
    gen = {(i.placement.node, g) for i in plan.rollout for g in i.placement.gpu_ids}
    assert gen == shared and len(shared) == 2
    assert "picked colocated" in table(res)
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    assert cfg.run.mode == "async"
    got = project_plan(cfg, plan, "cluster")
    assert got.config.workflow.placement == "colocated" and got.config.run.mode == "sync"
    assert got.config.buffer.max_staleness == 0
    assert "run.mode: 'async' -> 'sync' (as planned)" in got.changes


def test_many_gpus_keep_disaggregated_async() -> None:
    res = _plan_on("examples/clusters/h800_h20.yaml", 60.0)
    b = res.plan.baselines
    assert res.plan.decisions.placement == "disaggregated"
    assert b.disaggregated_samples_per_s == res.plan.predicted.samples_per_s
    assert b.disaggregated_samples_per_s > b.synchronous_samples_per_s > 0


def test_the_switch_cost_is_priced() -> None:
    from scheduler.cluster import load_cluster
    from scheduler.colocated import best_colocated
    from scheduler.model_shape import load_model_shape
    from scheduler.planner import problem_for
    from scheduler.workload import load_workload

    w = load_workload(ROOT / "examples/workloads/math_grpo.yaml")
    cl = load_cluster(ROOT / "tests/data/one_node_2gpu.yaml")
    p = problem_for(cl, load_model_shape("qwen3-8b"), w)
    free = best_colocated(p, w.model_copy(update={"constants": w.constants.model_copy(
        update={"context_switch_s": 0.0})}), 20.0)  # fmt: skip
    slow = best_colocated(p, w.model_copy(update={"constants": w.constants.model_copy(
        update={"context_switch_s": 30.0})}), 20.0)  # fmt: skip
    assert free is not None and slow is not None and slow.switch_s == 30.0
    step = w.samples_per_step / free.samples_per_s
    assert w.samples_per_step / slow.samples_per_s == pytest.approx(step + 30.0)


# ---------------------------------------------------------------- bench modes
def test_bench_modes_json_ranks_and_picks() -> None:
    from hexctl.bench.system.modes import report

    runs = {
        "disaggregated-async": {"predicted": 110.0, "measured": 100.0, "wall_time_s": 30.0},
        "disaggregated-sync": {"predicted": 60.0, "measured": 80.0},
        "colocated-sync": {"predicted": 120.0, "measured": 96.0},
    }
    out = report(runs)
    assert set(out["modes"]) == set(runs)
    m = out["modes"]["disaggregated-async"]
    assert m["predicted_samples_per_s"] == 110.0 and m["measured_samples_per_s"] == 100.0
    assert m["error"] == pytest.approx(0.1) and m["wall_time_s"] == 30.0
    assert out["modes"]["disaggregated-sync"]["error"] == pytest.approx(-0.25)
    assert out["measured_ranking"] == [
        "disaggregated-async",
        "colocated-sync",
        "disaggregated-sync",
    ]
    assert out["planner_pick"] == "colocated-sync"
    assert out["pick_vs_fastest"] == pytest.approx(0.96)
    # no prediction (no profile for the job): no pick, no error, the ranking stands
    bare = report({k: {**v, "predicted": None} for k, v in runs.items()})
    assert bare["planner_pick"] is None and bare["pick_vs_fastest"] is None
    assert all(v["error"] is None for v in bare["modes"].values())
    assert bare["measured_ranking"] == out["measured_ranking"]
    assert out["unpredicted"] == [] and bare["unpredicted"] == list(runs)


def test_bench_modes_is_registered_and_refuses_unknown_modes() -> None:
    import argparse

    from hexctl.bench.system.modes import chosen_modes
    from hexctl.cli.bench_cmd import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["bench", "modes"]).steps is None  # the config's: the README's
    args = parser.parse_args(["bench", "modes", "--json", "--steps", "5"])
    assert args.steps == 5 and chosen_modes(args.modes) == list(
        ("disaggregated-async", "disaggregated-sync", "colocated-sync")
        + ("hybrid-async", "hybrid-sync")
    )
    assert chosen_modes("colocated-sync") == ["colocated-sync"]
    with pytest.raises(ConfigError, match="unknown hybrid-eager"):
        chosen_modes("colocated-sync,hybrid-eager")


async def test_a_release_ends_leftover_requests_and_a_refusal_keeps_the_server_generating() -> None:
    """Whatever a server still runs when the controller yields (no group of its is in
    flight: a leftover) is aborted by the pause before the release; a server that
    refuses to release keeps its memory and is continued, not taken out."""
    import asyncio

    from fakes import FakeServer, MemoryProducer, ServerDown

    from areal_hex.api import SamplingParams
    from rollout_service.controller.colocate import Colocation
    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.weight_sync import UpdateGate, WeightSync

    server = FakeServer("a", delay_s=0.02)
    dispatcher = Dispatcher([server], 0.05)
    await dispatcher.probe_all()
    col = Colocation(WeightSync(dispatcher, MemoryProducer(), UpdateGate()), set)
    stray = asyncio.create_task(server.generate([5], SamplingParams(max_new_tokens=100)))
    while not server.in_flight:
        await asyncio.sleep(0.005)
    await col.release()
    assert server.released and (await stray).finish_reason == "abort"
    await col.resume()
    assert not server.released and server.running.is_set()
    assert col.switches_total == 1 and col.switch_s_total > 0

    async def refuse(tags: list[str] | None = None) -> str:
        raise ServerDown("a: 1 requests in flight")

    server.release_memory_occupation = refuse  # type: ignore[method-assign]
    await col.release()
    assert not col.released and dispatcher.servers[0].healthy and server.running.is_set()
    out = await server.generate([5], SamplingParams(max_new_tokens=2))
    assert out.finish_reason == "length"


def test_a_colocated_runs_prediction_prices_one_switch_a_step() -> None:
    """`prediction.json` of a colocated run: the synchronous layout's step plus the
    workload's context switch; the same layout run disaggregated has no switch."""
    from areal_hex.plan import PlanSources
    from hexctl.job.predict import predict_run
    from scheduler.workload import load_workload

    workload = ROOT / "examples/workloads/math_grpo.yaml"
    plan = _plan_on("tests/data/one_node_2gpu.yaml", 20.0).plan
    src = PlanSources(cluster=str(ROOT / "tests/data/one_node_2gpu.yaml"), workload=str(workload))
    plan = plan.model_copy(update={"sources": src})
    w = load_workload(workload)
    base = [
        f"buffer.groups_per_step={w.groups_per_step}",
        f"rollout.group_size={w.group_size}",
        f"rollout.max_new_tokens={w.max_response_tokens}",
        f"inference.context_length={w.prompt_tokens + w.max_response_tokens}",
        "run.mode=sync",
    ]
    deploy = ROOT / "examples/deploy/qwen3-8b.yaml"
    apart = predict_run(load_config(deploy, base), plan)["synchronous"]
    together = predict_run(load_config(deploy, [*base, "workflow.placement=colocated"]), plan)
    syn = together["synchronous"]
    assert "context_switch_s" not in apart and syn["context_switch_s"] == 0.05
    step = w.samples_per_step / apart["pipeline_samples_per_s"]
    assert w.samples_per_step / syn["pipeline_samples_per_s"] == pytest.approx(step + 0.05)


def test_a_colocated_plan_renders_for_compose(tmp_path: Path, capsys) -> None:
    """The deploy checks let generation and training share the planned GPUs, the
    rendered config runs colocated and synchronous, and the GPUs are counted once."""
    import yaml

    from areal_hex.plan import save_plan
    from hexctl.cli import main

    plan = save_plan(_plan_on("tests/data/one_node_2gpu.yaml", 20.0).plan, tmp_path / "p.yaml")
    out = tmp_path / "out"
    cfg = ROOT / "examples/deploy/qwen3-8b.yaml"
    code = main(["deploy", str(plan), str(cfg), "--target", "compose", "--out", str(out)])
    said = capsys.readouterr()
    assert code == 0, said.err
    assert "GPUs: 2 x H800" in said.out + said.err
    rendered = yaml.safe_load((out / "config.yaml").read_text())
    assert rendered["workflow"]["placement"] == "colocated"
    assert rendered["run"]["mode"] == "sync" and rendered["buffer"]["max_staleness"] == 0


def test_run_mode_sync_on_the_command_line_runs_a_colocated_config() -> None:
    """`areal-hex run examples/tiny_cpu.yaml workflow.placement=colocated --mode sync`:
    the flag is validated with the overrides, so the async config may be run colocated."""
    import argparse

    from hexctl.cli import config_from_args

    args = argparse.Namespace(
        config=str(TINY), overrides=["workflow.placement=colocated"], mode="sync"
    )
    cfg = config_from_args(args)
    assert (cfg.workflow.placement, cfg.run.mode, cfg.buffer.max_staleness) == (
        "colocated",
        "sync",
        0,
    )
    with pytest.raises(ConfigError, match="colocated with run.mode async"):
        config_from_args(argparse.Namespace(config=str(TINY), overrides=args.overrides))


def test_bench_modes_measures_a_window_as_the_runs_summary_does(tmp_path: Path) -> None:
    """A mode's measured figure is its run's fidelity measure over the same window (the
    README run's `summary.json` rule), from step η + 1 to the last, components too."""
    from test_fidelity import rows, written_rows

    from hexctl.bench.system.modes import window_rates
    from hexctl.report.fidelity import measured_rates

    metrics, rollout = rows()
    written_rows(tmp_path)
    got = window_rates(tmp_path, 4, 3)
    # rows without sequences: no answer length to tell
    assert got == {**measured_rates(metrics, rollout, 4, 3).__dict__, "answer_tokens": None}
    assert got["pipeline_samples_per_s"] == pytest.approx(24 / 1.5)  # steps 3 -> 6
    assert window_rates(tmp_path, 4, 1)["pipeline_samples_per_s"] == pytest.approx(40 / 2.5)


def test_bench_modes_gives_the_answer_length_trained_over_the_window() -> None:
    """The mean answer length the window's steps trained on (completion tokens over
    sequences, steps before the window left out), beside the length the price took."""
    from areal_hex.run_files import TrainerRow
    from hexctl.bench.system.modes import trained_answer_tokens

    steps = [TrainerRow(step=s, sequences=8, completion_tokens=8 * (14 + s)) for s in range(1, 7)]
    assert trained_answer_tokens(steps, 3) == pytest.approx((17 + 18 + 19 + 20) / 4)
    assert trained_answer_tokens(steps, 7) is None


def test_profile_fresh_keeps_its_profile_to_the_invocation(tmp_path: Path, monkeypatch) -> None:
    """`bench modes --profile-fresh`: the modes look profiles up under the invocation's
    own cache (the first measures one, the rest reuse it); the machine's is untouched."""
    from hexctl.bench.system.modes import invocation_cache
    from hexctl.job.v0_cache import cache_root

    monkeypatch.setenv("AREAL_HEX_CACHE_DIR", str(tmp_path / "machine"))
    with invocation_cache(tmp_path / "scratch" / "cache"):
        assert cache_root() == tmp_path / "scratch" / "cache"
    assert cache_root() == tmp_path / "machine"
    with invocation_cache(None):
        assert cache_root() == tmp_path / "machine"
    monkeypatch.delenv("AREAL_HEX_CACHE_DIR")
    with invocation_cache(tmp_path / "c"):
        assert cache_root() == tmp_path / "c"
    assert "AREAL_HEX_CACHE_DIR" not in os.environ


def test_bench_modes_says_where_each_run_put_the_hosts_work(tmp_path: Path) -> None:
    """Each mode's JSON keeps the side its run put Valkey, the controller and its
    rewards on, and the candidates `host_cores: auto` weighed, from `prediction.json`."""
    import json

    from hexctl.bench.system.modes import host_side_of

    assert host_side_of(tmp_path) == {}
    pred = {
        "host_cores": "inference",
        "host_cores_candidates": {"trainer": 900.0, "inference": 950.0},
        "asynchronous": {},
    }
    (tmp_path / "prediction.json").write_text(json.dumps(pred))
    got = host_side_of(tmp_path)
    assert got == {k: pred[k] for k in ("host_cores", "host_cores_candidates")}
    (tmp_path / "prediction.json").write_text(json.dumps({"unavailable": "no profile"}))
    assert host_side_of(tmp_path) == {}
