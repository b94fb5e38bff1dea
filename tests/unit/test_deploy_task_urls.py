"""A server task (the reference worker) is reached at its service's address in a
deployment: the rendered config names each instance's URL, so the controller finds it
on the compose network or through the cluster's DNS."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_hex.config import ExperimentConfig, load_config
from areal_hex.plan import load_plan
from hexctl.cli.deploy_cmd import check_services
from hexctl.deploy import render
from hexctl.deploy.config import DeployConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG, PLAN = "examples/deploy/qwen3-0.6b.yaml", "examples/plans/workstation_l40s_l4.yaml"
REF = {
    "name": "ref",
    "role": "reference",
    "instances": 2,
    "command": ["areal-hex", "serve", "{config}", "--port", "31100"],
    "port": 31100,
}


def _with_task(tmp_path: Path, example: str, task: dict) -> ExperimentConfig:
    """The example config as written, plus the task (the plan's checks see only what the
    file sets)."""
    data = yaml.safe_load((ROOT / example).read_text())
    data["workflow"] = {"tasks": [task]}
    data.setdefault("algo", {})["kl_coef"] = 0.01
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


@pytest.mark.parametrize("target", ["compose", "k8s"])
def test_rendered_config_names_each_task_instance_by_its_service(
    tmp_path: Path, target: str
) -> None:
    cfg = _with_task(tmp_path, CONFIG, REF)
    out = tmp_path / "out"
    render(target, cfg, load_plan(ROOT / PLAN), DeployConfig(), out, check=check_services)
    rendered = out / ("config.yaml" if target == "compose" else "resolved/config.yaml")
    task = load_config(rendered).workflow.task_with_role("reference")
    assert task is not None
    urls = task.instance_urls()
    if target == "compose":  # the compose service is the instance's name
        assert urls == ["http://ref-0:31100", "http://ref-1:31101"]
        compose = (out / "docker-compose.yaml").read_text()
        assert "  ref-0:" in compose and "  ref-1:" in compose
    else:  # the instance's Service, in the job's namespace
        assert [u.rsplit("-", 1)[-1] for u in urls] == ["0:31100", "1:31101"]
        services = "".join(p.read_text() for p in out.glob("25-task-*.yaml"))
        for url in urls:
            name = url.removeprefix("http://").split(":")[0]
            assert f"name: {name}\n" in services


def test_urls_the_config_gives_are_kept(tmp_path: Path) -> None:
    own = {**REF, "urls": ["http://ref.example:1", "http://ref.example:2"]}
    cfg = _with_task(tmp_path, CONFIG, own)
    out = tmp_path / "out"
    render("compose", cfg, load_plan(ROOT / PLAN), DeployConfig(), out, check=check_services)
    task = load_config(out / "config.yaml").workflow.task_with_role("reference")
    assert task is not None and task.urls == own["urls"]


def test_slurm_job_writes_each_task_instance_host_at_start(tmp_path: Path) -> None:
    """Slurm knows the hosts only when the job runs: the batch script passes the node of
    each instance's step to `slurm_runtime config`, which writes the task's URLs."""
    from hexctl.deploy.slurm import render_slurm
    from hexctl.deploy.slurm_site import load_site
    from hexctl.runtime.slurm import main as runtime_main

    plan = load_plan(ROOT / "examples/plans/a100_l40s_l4.yaml")
    cfg = _with_task(tmp_path, "examples/deploy/qwen3-1.7b.yaml", REF)
    site = load_site(ROOT / "examples/slurm/site_cluster.yaml")
    site = site.model_copy(update={"shared_dir": str(tmp_path / "shared")})
    out = tmp_path / "out"
    render_slurm(cfg, plan, site, out, "site.yaml")
    script = (out / "job.sbatch").read_text()
    assert ' --task ref="${C0[0]}","${C0[0]}"' in script  # a CPU task: on the control node
    servers = ["l40s-a", "l40s-a", "l4-b", "l4-b", "l4-b", "l4-b"]
    argv = ["config", str(out), "--servers", *servers, "--task", "ref=ctl-1,ctl-1"]
    assert runtime_main(argv) == 0
    task = load_config(out / "runtime/config.yaml").workflow.task_with_role("reference")
    assert task is not None and task.urls == ["http://ctl-1:31100", "http://ctl-1:31101"]
    assert runtime_main([*argv[:-1], "ref=ctl-1"]) == 2  # one host for two instances
