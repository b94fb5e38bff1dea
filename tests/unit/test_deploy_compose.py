"""docker-compose rendering: valid against the Compose Specification schema (vendored in
tests/data), GPUs reserved as planned, secrets only as files."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from areal_hex.config import ConfigError, ExperimentConfig, load_config
from areal_hex.plan import load_plan
from hexctl.deploy import render
from hexctl.deploy.compose import docker_size
from hexctl.deploy.config import DeployConfig

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
        assert svc["entrypoint"][:3] == ["python3", "-m", "hexctl.runtime.entry"]
        port = cfg.inference.base_port + i
        assert svc["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
        assert svc["restart"] == "unless-stopped"
        assert svc["networks"] == ["internal"]
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
        "hexctl.deploy.prepare",
        "{config}",
        "--prediction",
        "/etc/areal-hex/prediction.json",
        "--source",
        plan.model,
    ]
    assert s["prepare"]["restart"] == "no"
    assert "--appendonly yes" in s["redis"]["command"][0]
    assert s["redis"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert doc["volumes"] == {"data": {}, "redis-data": {}}


def test_secrets_only_as_files(rendered):
    plan, _, out, doc = rendered
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
    names = [i.id for i in plan.rollout]
    assert cfg.inference.urls() == [f"http://{n}:{p}" for n, p in zip(names, ports, strict=True)]
    assert cfg.redis.url == "redis://redis:6379/0"
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
    from hexctl.deploy.k8s_pods import entry_command

    text = (ROOT / f"deploy/docker/Dockerfile.{kind}").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT")]
    argv = json.loads(line.removeprefix("ENTRYPOINT"))
    assert argv == entry_command(sglang=kind == "inference")
    assert "\nUSER 1000\n" in text and "chown 1000:1000 /data" in text
    # dependency layers come from pyproject.toml before any source is copied
    assert text.index("COPY pyproject.toml") < text.index("COPY areal_hex")
    assert "COPY . ." not in text and "\nHEALTHCHECK " in text


def test_cpu_image_runs_the_tiny_example():
    text = (ROOT / "deploy/docker/Dockerfile.cpu").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("CMD")]
    cmd = json.loads(line.removeprefix("CMD"))
    assert cmd[:3] == ["areal-hex", "run", "examples/tiny_cpu.yaml"]
    cfg = load_config(ROOT / cmd[2], cmd[3:])  # the example and overrides load as given
    assert cfg.run.output_dir == "/data/runs" and cfg.trainer.device == "cpu"
    assert "DS_ACCELERATOR=cpu" in text and "\nUSER 1000\n" in text


def test_layout_environment_is_rendered(tmp_path, monkeypatch):
    """Services carry the layout's env (the same system as `areal-hex run`)."""
    import hexctl.deploy.common as common
    from hexctl.job.layout import build_layout

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


def test_every_container_is_hardened_and_nothing_binds_a_host_port(rendered):
    _, _, _, doc = rendered
    assert doc["networks"]["internal"] == {"internal": True}
    for name, svc in doc["services"].items():
        assert svc["read_only"] is True and "/tmp" in svc["tmpfs"], name
        assert svc["cap_drop"] == ["ALL"], name
        assert set(svc["security_opt"]) == {"no-new-privileges:true", "seccomp=builtin"}, name
        assert svc["user"].split(":")[0] != "0", name
        assert "network_mode" not in svc and "ports" not in svc, name
        assert "internal" in svc["networks"], name
    egress = {n for n, s in doc["services"].items() if "egress" in s["networks"]}
    assert egress == {"prepare", "controller"}  # they download the model and the dataset


def test_optional_prometheus_scrapes_every_service_on_loopback(tmp_path):
    plan = load_plan(ROOT / "examples/plans/workstation_l40s_l4.yaml")
    cfg = load_config(ROOT / "examples/deploy/qwen3-0.6b.yaml")
    dcfg = DeployConfig.model_validate({"metrics": {"compose_prometheus": True}})
    render("compose", cfg, plan, dcfg, tmp_path)
    doc = yaml.safe_load((tmp_path / "docker-compose.yaml").read_text())
    assert _schema_errors(doc) == []
    prom = doc["services"]["prometheus"]
    assert prom["ports"] == ["127.0.0.1:9090:9090"]
    assert prom["image"].startswith("docker.io/prom/prometheus:v")
    scrape = yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"]
    jobs = {j["job_name"]: j for j in scrape}
    deployed = ExperimentConfig.model_validate(
        yaml.safe_load((tmp_path / "config.yaml").read_text())
    )
    assert jobs["trainer"]["static_configs"][0]["targets"] == [
        f"trainer:{deployed.trainer.metrics_port}"
    ]
    assert jobs["controller"]["static_configs"][0]["targets"] == [
        f"controller:{deployed.rollout.metrics_port}"
    ]
    servers = jobs["inference"]["static_configs"][0]["targets"]
    assert servers == [u.removeprefix("http://") for u in deployed.inference.urls()]
    # the trainer's and controller's /metrics sit behind the service token
    assert jobs["trainer"]["authorization"]["credentials_file"] == "/run/secrets/api-token"
    assert "authorization" not in jobs["inference"]
    # every series carries the run (the dashboard's run filter)
    for job in jobs.values():
        assert job["static_configs"][0]["labels"] == {"run": deployed.run.run_id}
