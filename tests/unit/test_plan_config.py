"""The one projection from a plan to the config (`hexctl.job.plan_config`): every decision
the plan made, tuned η and k included, reaches the local run's and each deploy target's
resolved config, and each key the plan changed is said."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_hex.config import load_config
from areal_hex.plan import Decisions, load_plan
from hexctl.deploy import prepare_deployment
from hexctl.deploy.config import DeployConfig
from hexctl.deploy.slurm import render_slurm
from hexctl.deploy.slurm_site import load_site
from hexctl.job.plan_config import planned_values, project_plan
from hexctl.job.prepare import apply_plan

ROOT = Path(__file__).resolve().parents[2]
ETA, K = 6, 2  # tuned by the planner; the configs below ask for other values


def _tuned(plan_file: str):
    plan = load_plan(ROOT / plan_file)
    return plan.model_copy(update={"decisions": Decisions(max_staleness=ETA, publish_every=K)})


def _assert_planned(cfg, plan) -> None:
    assert cfg.buffer.max_staleness == ETA
    assert cfg.trainer.publish_every == K
    assert cfg.inference.num_servers == len(plan.rollout)
    assert cfg.inference.gpu_kinds == [i.gpu_kind for i in plan.rollout]
    assert cfg.trainer.zero_stage == plan.trainer.zero_stage


def test_local_run_carries_the_tuned_values() -> None:
    plan = _tuned("examples/plans/local_cpu.yaml")
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml")
    assert (cfg.buffer.max_staleness, cfg.trainer.publish_every) != (ETA, K)
    said: list[str] = []
    run = apply_plan(cfg, plan, said.append)
    _assert_planned(run, plan)
    assert any(s.startswith("buffer.max_staleness:") for s in said)
    k_line = f"trainer.publish_every: {cfg.trainer.publish_every} -> {K}"
    assert any(s.startswith(k_line) for s in said)


def test_a_synchronous_run_of_a_tuned_plan_stays_synchronous() -> None:
    """`run --mode sync --plan PLAN` (and bench hetero's plan d): the plan's pools apply,
    its η and k (tuned for the asynchronous run) do not, and the run says so."""
    from hexctl.job.prepare import apply_mode

    plan = _tuned("examples/plans/local_cpu.yaml")
    said: list[str] = []
    run = apply_plan(
        apply_mode(load_config(ROOT / "examples/tiny_cpu.yaml"), "sync"), plan, said.append
    )
    assert (run.buffer.max_staleness, run.trainer.publish_every) == (0, 1)
    assert run.inference.num_servers == len(plan.rollout)
    assert f"buffer.max_staleness: 0 kept (run.mode=sync; planned {ETA})" in said


@pytest.mark.parametrize(
    ("target", "cfg_file", "plan_file"),
    [
        ("k8s", "examples/deploy/qwen3-8b.yaml", "examples/plans/h800_h20.yaml"),
        ("compose", "examples/gsm8k_gpu.yaml", "examples/plans/one_node_8gpu.yaml"),
    ],
)
def test_deploy_targets_carry_the_tuned_values(tmp_path, target, cfg_file, plan_file) -> None:
    plan = _tuned(plan_file)
    cfg = load_config(ROOT / cfg_file).model_copy(deep=True)
    cfg.buffer.max_staleness, cfg.trainer.publish_every = 8, 1
    d = prepare_deployment(cfg, plan, DeployConfig(), target, tmp_path / "out")
    _assert_planned(d.cfg, plan)


def test_slurm_config_carries_the_tuned_values(tmp_path) -> None:
    plan = _tuned("examples/plans/h800_h20.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    site = load_site(ROOT / "examples/slurm/site_cluster.yaml")
    site = site.model_copy(update={"shared_dir": str(tmp_path / "shared")})
    render_slurm(cfg, plan, site, tmp_path / "out", "site.yaml")
    written = yaml.safe_load((tmp_path / "out/config.yaml").read_text())
    assert written["buffer"]["max_staleness"] == ETA
    assert written["trainer"]["publish_every"] == K
    assert written["inference"]["gpu_kinds"] == [i.gpu_kind for i in plan.rollout]


def test_a_plan_without_tuning_keeps_the_config_values() -> None:
    plan = load_plan(ROOT / "examples/plans/local_cpu.yaml").model_copy(
        update={"decisions": Decisions()}
    )
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml")
    assert "buffer.max_staleness" not in planned_values(plan, "local")
    out = project_plan(cfg, plan, "local").config
    assert out.buffer.max_staleness == cfg.buffer.max_staleness
    assert out.trainer.publish_every == cfg.trainer.publish_every


def test_plan_print_config_carries_the_tuned_values(tmp_path, capsys) -> None:
    from hexctl.cli import main

    out = tmp_path / "plan.yaml"
    rc = main([
        "plan", str(ROOT / "examples/clusters/h800_h20.yaml"), "--model", "qwen3-8b",
        "--workload", str(ROOT / "examples/workloads/math_grpo.yaml"), "--budget", "60",
        "--search-max-staleness", "6", "--search-publish-every", "2", "--no-simulate",
        "--out", str(out), "--json", "--print-config", str(ROOT / "examples/deploy/qwen3-8b.yaml"),
    ])  # fmt: skip
    assert rc == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    b = doc["plan"]["decisions"]
    assert doc["config"]["buffer"]["max_staleness"] == b["max_staleness"]
    assert doc["config"]["trainer"]["publish_every"] == b["publish_every"]
    assert doc["config"]["inference"]["num_servers"] == len(doc["plan"]["rollout"])


def test_the_controller_holds_the_groups_that_fill_every_planned_instance() -> None:
    """The controller's groups in flight are shared by all servers: the plan raises
    `rollout.max_concurrent_groups` to the groups that fill every instance's planned batch,
    says so, and never lowers it (a larger cap keeps a small batch's queue full); a plan
    written without the batches leaves it."""
    from hexctl.job.plan_config import groups_to_fill

    base = load_plan(ROOT / "examples/plans/local_cpu.yaml")
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml", ["rollout.max_concurrent_groups=2"])
    g = cfg.rollout.group_size
    one = base.rollout[0]
    three = [one.model_copy(update={"id": f"rollout-cpu-{i}", "batch": 64}) for i in range(3)]
    plan = base.model_copy(update={"rollout": three})
    assert groups_to_fill(plan, g) == -(-192 // g)
    got = project_plan(cfg, plan, "local")
    assert got.config.rollout.max_concurrent_groups == -(-192 // g) > 2
    assert f"rollout.max_concurrent_groups: 2 -> {-(-192 // g)} (as planned: fills the " \
        "batches of its 3 instances)" in got.changes  # fmt: skip
    # a cap above the batches' is kept, and so is any cap where the plan has no batches
    big = load_config(ROOT / "examples/tiny_cpu.yaml", ["rollout.max_concurrent_groups=500"])
    assert project_plan(big, plan, "local").config.rollout.max_concurrent_groups == 500
    bare = base.model_copy(update={"rollout": [one.model_copy(update={"batch": None})]})
    assert groups_to_fill(bare, g) is None
    assert project_plan(cfg, bare, "local").config.rollout.max_concurrent_groups == 2


def test_a_plan_records_each_instances_batch(tmp_path) -> None:
    from hexctl.cli import main

    out = tmp_path / "plan.yaml"
    rc = main([
        "plan", str(ROOT / "examples/clusters/h800_h20.yaml"), "--model", "qwen3-8b",
        "--workload", str(ROOT / "examples/workloads/math_grpo.yaml"), "--budget", "60",
        "--no-simulate", "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    plan = load_plan(out)
    assert plan.rollout and all(i.batch is not None and i.batch >= 1 for i in plan.rollout)
