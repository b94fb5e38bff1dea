"""A server task (the reference worker) is reached at its service's address in a
deployment: the rendered config names each instance's URL, so the controller finds it
on the compose network or through the cluster's DNS."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config import load_config
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


@pytest.mark.parametrize("target", ["compose", "k8s"])
def test_rendered_config_names_each_task_instance_by_its_service(
    tmp_path: Path, target: str
) -> None:
    cfg = load_config(ROOT / CONFIG, [])
    cfg = cfg.model_validate({**cfg.model_dump(), "workflow": {"tasks": [REF]}})
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
    cfg = load_config(ROOT / CONFIG, [])
    own = {**REF, "urls": ["http://ref.example:1", "http://ref.example:2"]}
    cfg = cfg.model_validate({**cfg.model_dump(), "workflow": {"tasks": [own]}})
    render("compose", cfg, load_plan(ROOT / PLAN), DeployConfig(), tmp_path, check=check_services)
    task = load_config(tmp_path / "config.yaml").workflow.task_with_role("reference")
    assert task is not None and task.urls == own["urls"]
