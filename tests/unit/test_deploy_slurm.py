"""Slurm rendering of the example plans: one heterogeneous-job component per pool whose
nodes and GRES match the plan, one step per service, a script bash can parse, and the
plans a site mapping cannot place refused with the field named (exit 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError, load_config
from areal_hex.errors import UsageError
from areal_hex.plan import Plan, load_plan
from hexctl.cli import main
from hexctl.deploy.slurm import render_slurm
from hexctl.deploy.slurm_site import (
    KindPlacement,
    SiteConfig,
    SiteRedis,
    load_site,
    megabytes,
)
from hexctl.runtime.slurm import write_configs

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SITE = ROOT / "examples/slurm/site_cluster.yaml"
LOCAL_SITE = ROOT / "examples/slurm/site_local.yaml"
CASES = [
    ("examples/plans/h800_h20.yaml", "qwen3-8b.yaml"),
    ("examples/plans/a100_l40s_l4.yaml", "qwen3-1.7b.yaml"),
    # real planner output: mixed TP degrees, three GPU kinds, pools over several nodes
    ("tests/data/planner_hetrl_plan.yaml", "qwen3-1.7b.yaml"),
]


def _site(tmp_path: Path, **update) -> SiteConfig:
    site = load_site(CLUSTER_SITE)
    return site.model_copy(update={"shared_dir": str(tmp_path / "shared"), **update})


def _components(script: str) -> list[dict[str, str]]:
    """The #SBATCH options of each component (job-wide options land in the first)."""
    comps: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            comps.append({})
        elif line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            comps[-1][key] = value
    return comps


def _srun_lines(script: str) -> dict[str, str]:
    """Service name -> its `launch NAME ...` line."""
    out = {}
    for line in script.splitlines():
        words = line.split()
        if len(words) > 3 and words[1] == "launch":
            out[words[2]] = line
    return out


def _expected_pools(plan: Plan) -> dict[str, tuple[int, int]]:
    """Per rollout kind: (nodes, GPUs per node), computed from the plan directly."""
    per_node: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for inst in plan.rollout:
        per_node[inst.gpu_kind][inst.placement.node] += inst.tp
    return {k: (len(nodes), max(nodes.values())) for k, nodes in per_node.items()}


@pytest.mark.parametrize(("plan_file", "cfg_file"), CASES)
def test_components_and_steps_match_the_plan(tmp_path, plan_file, cfg_file):
    plan = load_plan(ROOT / plan_file)
    cfg = load_config(ROOT / "examples/deploy" / cfg_file)
    site = _site(tmp_path)
    render_slurm(cfg, plan, site, tmp_path / "out", "site.yaml")
    script = (tmp_path / "out/job.sbatch").read_text()
    comps = _components(script)
    pools = _expected_pools(plan)
    # control, one per rollout kind (plan order), trainer
    assert len(comps) == 1 + len(pools) + 1
    assert comps[0]["partition"] == "cpu" and comps[0]["nodes"] == "1"
    assert "gres" not in comps[0]
    assert comps[0]["requeue"] == "" and comps[0]["signal"] == "B:USR1@120"
    for comp, (kind, (nodes, gpus)) in zip(comps[1:-1], pools.items(), strict=True):
        place = site.placement(kind)
        assert comp["partition"] == place.partition
        assert comp["nodes"] == str(nodes)
        assert comp["gres"] == f"gpu:{place.gres_type}:{gpus}"
        # the share of the node's CPUs and memory that its GPUs are
        share = gpus / place.gpus_per_node
        want = (str(place.cpus), place.mem)  # a whole node: as the site file says
        if share < 1:
            want = (str(int(place.cpus * share)), f"{int(megabytes(place.mem) * share)}M")
        assert (comp["cpus-per-task"], comp["mem"]) == want
    t = plan.trainer
    trainer = comps[-1]
    assert trainer["nodes"] == str(len(t.placements))
    tplace = site.placement(t.gpu_kind)
    assert trainer["gres"] == f"gpu:{tplace.gres_type}:{len(t.placements[0].gpu_ids)}"
    if tplace.constraint:
        assert trainer["constraint"] == tplace.constraint

    steps = _srun_lines(script)
    assert set(steps) == {"redis", "controller", "trainer", *(i.id for i in plan.rollout)}
    kinds = list(pools)
    for inst in plan.rollout:
        line = steps[inst.id]
        gres = site.placement(inst.gpu_kind).gres_type
        assert f"--het-group={1 + kinds.index(inst.gpu_kind)} " in line
        assert f"--gres=gpu:{gres}:{inst.tp} " in line and "--exact" in line
    line = steps["trainer"]
    assert f"--het-group={len(comps) - 1} " in line
    assert f"--nodes={len(t.placements)} " in line and f"PET_NNODES={len(t.placements)} " in line
    assert "PET_NODE_RANK=$SLURM_NODEID" in line and "hexctl.cli train" in line
    for name in ("redis", "controller"):
        assert "--het-group=0 " in steps[name] and "--overlap" in steps[name]
    # the script parses
    r = subprocess.run(["bash", "-n", str(tmp_path / "out/job.sbatch")], capture_output=True)
    assert r.returncode == 0, r.stderr


def test_resolved_config_for_the_job(tmp_path):
    plan = load_plan(ROOT / "examples/plans/h800_h20.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    render_slurm(cfg, plan, _site(tmp_path), tmp_path / "out", "site.yaml")
    resolved = load_config(tmp_path / "out/config.yaml")
    run_dir = tmp_path / "shared/runs" / str(resolved.run.run_id)
    assert resolved.run.output_dir == str(tmp_path / "shared/runs")
    assert resolved.model.path == str(run_dir / "weights/v0")
    assert resolved.redis.data_dir == str(run_dir / "valkey")  # AOF on shared storage
    assert resolved.trainer.launcher == "torchrun" and resolved.trainer.resume == "auto"
    assert resolved.trainer.num_ranks == 8  # per node
    assert resolved.redis.password is None and resolved.inference.api_key is None
    secrets = tmp_path / "out/secrets"
    assert (secrets / "redis-password").stat().st_mode & 0o777 == 0o600
    assert (secrets / "redis-password").read_text().strip() not in (
        tmp_path / "out/job.sbatch"
    ).read_text()


def test_unmapped_kind_exits_2_with_the_field(tmp_path, capsys):
    site = load_site(CLUSTER_SITE)
    del site.kinds["A100-40GB"]
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump(site.model_dump(mode="json")))
    rc = main(
        [
            "deploy",
            str(ROOT / "tests/data/planner_hetrl_plan.yaml"),
            str(ROOT / "examples/deploy/qwen3-1.7b.yaml"),
            "--target",
            "slurm",
            "--site",
            str(site_file),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "GPU kind 'A100-40GB' has no entry under `kinds`" in err
    assert "plan.rollout[" in err and "Traceback" not in err
    assert not (tmp_path / "out/job.sbatch").exists()


def test_missing_site_is_a_usage_error(tmp_path, capsys):
    rc = main(
        [
            "deploy",
            str(ROOT / "examples/plans/h800_h20.yaml"),
            str(ROOT / "examples/deploy/qwen3-8b.yaml"),
            "--target",
            "slurm",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert rc == 2 and "--target slurm needs --site" in capsys.readouterr().err


def test_cpu_only_site_needs_cpu_devices(tmp_path):
    plan = load_plan(ROOT / "examples/plans/local_cpu.yaml")
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml", ["trainer.device=cuda"])
    site = load_site(LOCAL_SITE).model_copy(update={"shared_dir": str(tmp_path)})
    with pytest.raises(ConfigError) as exc:
        render_slurm(cfg, plan, site, tmp_path / "out", "site_local.yaml")
    assert "trainer.device is 'cuda'" in str(exc.value) and "gpus: false" in str(exc.value)


def test_one_allocation_needs_one_partition(tmp_path):
    plan = load_plan(ROOT / "examples/plans/h800_h20.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    with pytest.raises(ConfigError) as exc:
        render_slurm(cfg, plan, _site(tmp_path, hetjob=False), tmp_path / "out", "s.yaml")
    assert "hetjob is false" in str(exc.value)


def test_local_profile_is_one_shared_allocation(tmp_path):
    plan = load_plan(ROOT / "examples/plans/local_cpu.yaml")
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml")
    site = load_site(LOCAL_SITE).model_copy(update={"shared_dir": str(tmp_path)})
    result = render_slurm(cfg, plan, site, tmp_path / "out", "site_local.yaml")
    script = (tmp_path / "out/job.sbatch").read_text()
    comps = _components(script)
    assert len(comps) == 1 and "gres" not in comps[0]
    assert comps[0]["partition"] == "local" and comps[0]["nodes"] == "1"
    assert "--het-group" not in script and 'SLURM_JOB_NODELIST")' in script
    steps = _srun_lines(script)
    assert set(steps) == {"redis", "rollout-cpu-0", "controller", "trainer"}
    assert all("--overlap" in line and "--gres" not in line for line in steps.values())
    assert result.gpus_by_kind == {}  # CPU-only nodes: no GPUs asked for
    assert subprocess.run(["bash", "-n", str(tmp_path / "out/job.sbatch")]).returncode == 0


@pytest.mark.slurm
def test_sbatch_accepts_a_heterogeneous_job(tmp_path):
    """`sbatch --test-only` on the local Slurm: the workstation plan's pools (two rollout
    kinds and the trainer) as components of one job on the local CPU partition."""
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch not found: no Slurm here (scripts/local_slurm.sh starts one)")
    partition = subprocess.run(
        ["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30
    )
    if partition.returncode != 0 or not partition.stdout.strip():
        pytest.skip(f"sinfo found no Slurm controller: {partition.stderr.strip()}")
    plan = load_plan(ROOT / "examples/plans/workstation_l40s_l4.yaml")
    plan = plan.model_copy(update={"model": "tiny"})
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml", ["trainer.zero_stage=1"])
    part = partition.stdout.split()[0]
    cpu_node = KindPlacement(partition=part, gpus=False, cpus=1, mem="256M")
    site = SiteConfig(
        shared_dir=str(tmp_path),
        time="00:05:00",
        control=cpu_node,
        kinds={"L40S": cpu_node, "L4": cpu_node},
    )
    render_slurm(cfg, plan, site, tmp_path / "out", "site.yaml")
    script = tmp_path / "out/job.sbatch"
    assert script.read_text().count("#SBATCH hetjob") == 3
    r = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "to start at" in r.stderr


def test_job_start_writes_the_hosts_and_keeps_secrets_private(tmp_path):
    """What the batch script runs first (`slurm_runtime config`): the run's config with
    this job's hosts and no secrets, and the 0600 copy the steps read."""
    plan = load_plan(ROOT / "examples/plans/a100_l40s_l4.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-1.7b.yaml")
    render_slurm(cfg, plan, _site(tmp_path), tmp_path / "out", "site.yaml")
    hosts = ["l40s-a", "l40s-a", "l4-b", "l4-b", "l4-b", "l4-b"]
    private = write_configs(tmp_path / "out", hosts, "ctl-1", None)
    run_cfg = load_config(tmp_path / "out/config.yaml")
    run_config = tmp_path / "shared/runs" / str(run_cfg.run.run_id) / "config.yaml"
    public = load_config(run_config)
    base = public.inference.base_port
    assert public.inference.server_urls == [f"http://{h}:{base + i}" for i, h in enumerate(hosts)]
    assert public.redis.url == "redis://ctl-1:6379/0" and public.redis.password is None
    assert public.inference.api_key is None
    secret = load_config(private)
    assert secret.redis.password == (tmp_path / "out/secrets/redis-password").read_text().strip()
    assert secret.inference.api_key == (tmp_path / "out/secrets/api-token").read_text().strip()
    assert private.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ConfigError, match="expected 6 server hosts"):
        write_configs(tmp_path / "out", hosts[:2], "ctl-1", None)


def test_external_redis_with_a_password_file(tmp_path):
    """redis.mode external: no Valkey step; the job reads the operator's password file."""
    pw = tmp_path / "redis-pass"
    pw.write_text("s3cret-from-file\n")
    redis = {"mode": "external", "url": "redis://redis.site:6380/2", "password_file": str(pw)}
    site = _site(tmp_path).model_copy(update={"redis": SiteRedis(**redis)})
    plan = load_plan(ROOT / "examples/plans/h800_h20.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    render_slurm(cfg, plan, site, tmp_path / "out", "site.yaml")
    script = (tmp_path / "out/job.sbatch").read_text()
    assert "redis" not in _srun_lines(script) and "wait redis" not in script
    assert f"--redis-password-file {pw}" in script and "s3cret" not in script
    assert not (tmp_path / "out/secrets/redis-password").exists()
    hosts = ["h20-a"] * 8 + ["h800-c"] * 4
    private = load_config(write_configs(tmp_path / "out", hosts, None, pw))
    assert private.redis.url == "redis://redis.site:6380/2"
    assert private.redis.password == "s3cret-from-file"
    assert subprocess.run(["bash", "-n", str(tmp_path / "out/job.sbatch")]).returncode == 0


def test_a_one_gpu_pool_asks_for_its_share_of_the_node(tmp_path):
    """One L4 server on an 4-GPU L4 node gets a quarter of the node's CPUs and memory,
    not the whole node (the rest is left to other jobs)."""
    plan = load_plan(ROOT / "tests/data/planner_hetrl_plan.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-1.7b.yaml")
    site = _site(tmp_path)
    render_slurm(cfg, plan, site, tmp_path / "out", "site.yaml")
    comps = _components((tmp_path / "out/job.sbatch").read_text())
    (l4,) = [c for c in comps if c.get("partition") == "l4"]
    assert l4["gres"] == "gpu:l4:1"
    assert l4["cpus-per-task"] == "8" and l4["mem"] == f"{192 * 1024 // 4}M"
    l4_line = _srun_lines((tmp_path / "out/job.sbatch").read_text())["rollout-l4-0"]
    assert "--cpus-per-task=8 " in l4_line


def test_gpus_per_node_is_required_and_checked(tmp_path):
    with pytest.raises(ValueError, match="gpus_per_node is required"):
        KindPlacement(partition="l4", gres_type="l4", cpus=32, mem="192G")
    site = _site(tmp_path)
    site.kinds["L40S"] = site.kinds["L40S"].model_copy(update={"gpus_per_node": 2})
    plan = load_plan(ROOT / "examples/plans/a100_l40s_l4.yaml")
    with pytest.raises(ConfigError, match="plan node l40s-0 uses 4 L40S GPUs"):
        render_slurm(
            load_config(ROOT / "examples/deploy/qwen3-1.7b.yaml"), plan, site, tmp_path / "o", "s"
        )


def test_rerender_beside_the_jobs_own_output(tmp_path, capsys):
    """After a job ran, its folder holds slurm-<id>.out and runtime/: a re-render with
    --force keeps them and replaces only what the render wrote; a stranger's file is
    still refused, with a message about the job, not about manifests."""
    plan = load_plan(ROOT / "examples/plans/h800_h20.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    out = tmp_path / "out"
    render_slurm(cfg, plan, _site(tmp_path), out, "site.yaml")
    (out / "slurm-48.out").write_text("job log\n")
    (out / "runtime").mkdir()
    (out / "runtime/config.yaml").write_text("run: {}\n")
    render_slurm(cfg, plan, _site(tmp_path), out, "site.yaml", force=True)
    assert (out / "slurm-48.out").read_text() == "job log\n"
    assert (out / "runtime/config.yaml").is_file()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(UsageError, match="did not write: notes.txt") as err:
        render_slurm(cfg, plan, _site(tmp_path), out, "site.yaml", force=True)
    assert "manifests" not in str(err.value) and "the job reads" in str(err.value)


def test_the_job_installs_the_plans_prediction(tmp_path):
    plan = load_plan(ROOT / "examples/plans/h800_h20.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    out = tmp_path / "out"
    render_slurm(cfg, plan, _site(tmp_path), out, "site.yaml")
    prediction = json.loads((out / "prediction.json").read_text())
    assert prediction["asynchronous"]["pipeline_samples_per_s"] == plan.predicted.samples_per_s
    script = (out / "job.sbatch").read_text()
    assert f'hexctl.deploy.prepare "$CONFIG" --prediction {out}/prediction.json' in script
    resolved = load_config(out / "config.yaml")
    assert resolved.inference.gpu_kinds == [i.gpu_kind for i in plan.rollout]
