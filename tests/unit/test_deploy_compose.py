"""docker-compose rendering: valid against the Compose Specification schema (vendored in
tests/data), GPUs reserved as planned, secrets only as files."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from areal_hex.config import ConfigError, ExperimentConfig, load_config
from areal_hex.config.deploy import DeployConfig
from areal_hex.deploy import render
from areal_hex.deploy.compose import docker_size
from areal_hex.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "tests/data/compose_spec.json").read_text())


@pytest.fixture
def rendered(tmp_path):
    plan = load_plan(ROOT / "examples/plans/workstation_l40s_l4.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-0.6b.yaml")
    render("compose", cfg, plan, DeployConfig(), tmp_path)
    doc = yaml.safe_load((tmp_path / "docker-compose.yaml").read_text())
    return plan, cfg, tmp_path, doc


def _schema_errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft201909Validator(SCHEMA)
    return [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]


def test_compose_file_matches_the_compose_spec(rendered):
    _, _, _, doc = rendered
    assert _schema_errors(doc) == []
    doc["services"]["trainer"]["restart_policy"] = "always"  # not a service key
    assert _schema_errors(doc)


def test_gpus_are_reserved_as_planned(rendered):
    plan, _, _, doc = rendered
    services = doc["services"]

    def device_ids(name: str) -> list[str]:
        (dev,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
        return dev["device_ids"]

    for inst in plan.rollout:
        assert device_ids(inst.id) == [str(g) for g in inst.placement.gpu_ids]
    trainer_ids = device_ids("trainer")
    assert trainer_ids == [str(g) for g in plan.trainer.placements[0].gpu_ids]
    everything = [g for i in plan.rollout for g in device_ids(i.id)] + trainer_ids
    assert len(everything) == len(set(everything)) == 6
    for name in ("controller", "redis", "prepare"):
        assert "deploy" not in services[name]


def test_services_run_the_layout_commands_with_health_checks(rendered):
    plan, cfg, _, doc = rendered
    s = doc["services"]
    for i, inst in enumerate(plan.rollout):
        svc = s[inst.id]
        assert svc["command"] == ["areal-hex", "serve", "{config}", "--index", str(i)]
        assert svc["entrypoint"][:3] == ["python3", "-m", "areal_hex.deploy.entry"]
        port = cfg.inference.base_port + i
        assert svc["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
        assert svc["restart"] == "unless-stopped"
        assert svc["network_mode"] == "host"
    assert s["controller"]["command"] == ["areal-hex", "rollout", "{config}"]
    assert s["controller"]["restart"] == "on-failure"
    assert set(s["controller"]["depends_on"]) == {"prepare", "redis", *(i.id for i in plan.rollout)}
    assert s["trainer"]["command"] == ["areal-hex", "train", "{config}"]
    assert s["trainer"]["restart"] == "on-failure"
    done = {"condition": "service_completed_successfully"}
    assert s["trainer"]["depends_on"] == {
        "prepare": done,
        "redis": {"condition": "service_healthy"},
    }
    for inst in plan.rollout:
        assert s[inst.id]["depends_on"] == {"prepare": done}
    assert s["prepare"]["command"] == [
        "python3",
        "-m",
        "areal_hex.deploy.prepare",
        "{config}",
        "--source",
        plan.model,
    ]
    assert s["prepare"]["restart"] == "no"
    assert "--appendonly yes" in s["redis"]["command"][0]
    assert s["redis"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert doc["volumes"] == {"data": {}, "redis-data": {}}


def test_secrets_only_as_files(rendered):
    _, _, out, doc = rendered
    secret_values = {f.name: f.read_text().strip() for f in (out / "secrets").iterdir()}
    assert set(secret_values) == {"redis-password", "api-token"}
    assert doc["secrets"] == {k: {"file": f"./secrets/{k}"} for k in secret_values}
    assert (out / "secrets").stat().st_mode & 0o077 == 0
    text = (out / "docker-compose.yaml").read_text() + (out / "config.yaml").read_text()
    for value in secret_values.values():
        assert value not in text
    for svc in doc["services"].values():
        for value in svc.get("environment", {}).values():
            assert value not in secret_values.values()
    cfg = ExperimentConfig.model_validate(yaml.safe_load((out / "config.yaml").read_text()))
    assert cfg.trainer.num_ranks == 2  # the deepspeed launcher starts the planned ranks
    ports = [30000 + i for i in range(4)]
    assert cfg.inference.urls() == [f"http://127.0.0.1:{p}" for p in ports]
    assert cfg.redis.url == "redis://127.0.0.1:6379/0"
    assert cfg.redis.password is None and cfg.inference.api_key is None
    assert cfg.inference.weights_dir == f"/data/runs/{cfg.run.run_id}/weights"


def test_compose_refuses_a_plan_across_nodes(tmp_path):
    plan = load_plan(ROOT / "examples/plans/h800_h20.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-8b.yaml")
    with pytest.raises(ConfigError, match=r"one host.*4 nodes \(h20-0, h800-0, h800-1, h800-2\)"):
        render("compose", cfg, plan, DeployConfig(), tmp_path)
    assert not (tmp_path / "docker-compose.yaml").exists()


@pytest.mark.parametrize(("q", "want"), [("32Gi", "32g"), ("512Mi", "512m"), ("7", "7b")])
def test_docker_size(q, want):
    assert docker_size(q) == want


@pytest.mark.parametrize("kind", ["inference", "trainer"])
def test_image_entrypoint_is_the_rendered_wrapper(kind):
    """The images' default ENTRYPOINT is the same secret wrapper the manifests set."""
    from areal_hex.deploy.k8s_pods import entry_command

    text = (ROOT / f"deploy/docker/Dockerfile.{kind}").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT")]
    argv = json.loads(line.removeprefix("ENTRYPOINT"))
    assert argv == entry_command()
    assert "\nUSER 1000\n" in text and "chown 1000:1000 /data" in text


def test_cpu_image_runs_the_tiny_example():
    text = (ROOT / "deploy/docker/Dockerfile.cpu").read_text()
    assert 'CMD ["areal-hex", "run", "examples/tiny_cpu.yaml"' in text
    assert "DS_ACCELERATOR=cpu" in text and "\nUSER 1000\n" in text


def test_layout_environment_is_rendered(tmp_path, monkeypatch):
    """Services carry the layout's env (the same system as `areal-hex run`)."""
    import areal_hex.deploy.common as common
    from areal_hex.layout import build_layout

    def with_env(cfg, plan=None):
        layout = build_layout(cfg, plan)
        for svc in layout.services:
            svc.env = {"AREAL_HEX_ROLE": svc.role}
        return layout

    monkeypatch.setattr(common, "build_layout", with_env)
    plan = load_plan(ROOT / "examples/plans/workstation_l40s_l4.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-0.6b.yaml")
    render("compose", cfg, plan, DeployConfig(), tmp_path / "c")
    doc = yaml.safe_load((tmp_path / "c/docker-compose.yaml").read_text())
    assert doc["services"]["trainer"]["environment"]["AREAL_HEX_ROLE"] == "trainer"
    assert doc["services"]["rollout-l4-0"]["environment"]["AREAL_HEX_ROLE"] == "inference"
    render("k8s", cfg, plan, DeployConfig(), tmp_path / "k")
    text = (tmp_path / "k/20-controller.yaml").read_text()
    assert "name: AREAL_HEX_ROLE\n          value: controller" in text
