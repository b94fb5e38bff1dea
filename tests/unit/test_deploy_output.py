"""`--out` safety: bad folders exit 2 and nothing is written; secrets stay out of git."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hexctl.cli import main

ROOT = Path(__file__).resolve().parents[2]
PLAN = str(ROOT / "examples/plans/workstation_l40s_l4.yaml")
CONFIG = str(ROOT / "examples/deploy/qwen3-0.6b.yaml")


def _deploy(out: Path, target: str = "compose", *extra: str) -> int:
    return main(["deploy", PLAN, CONFIG, "--target", target, "--out", str(out), *extra])


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_folder_with_other_files_is_refused_untouched(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "99-x.yaml").write_text("kind: ConfigMap\n")
    (out / "docker-compose.yaml").write_text("services: {mine: {image: x}}\n")
    before = _snapshot(out)
    assert _deploy(out) == 2
    err = capsys.readouterr().err
    assert "is not empty and was not written by areal-hex deploy" in err
    assert "99-x.yaml" in err and "Traceback" not in err
    assert _snapshot(out) == before


@pytest.mark.parametrize("under", [False, True])
def test_a_file_path_is_refused(tmp_path, capsys, under):
    f = tmp_path / "plan-notes.txt"
    f.write_text("mine\n")
    out = f / "sub" if under else f
    assert _deploy(out, "k8s") == 2
    assert "is a file; expected a folder" in capsys.readouterr().err
    assert f.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [f]


def test_rerender_needs_force_keeps_secrets_and_refuses_strangers(tmp_path, capsys):
    out = tmp_path / "out"
    assert _deploy(out, "k8s") == 0
    first = _snapshot(out)
    assert _deploy(out, "k8s") == 2
    assert "pass --force" in capsys.readouterr().err
    assert _snapshot(out) == first
    assert _deploy(out, "k8s", "--force") == 0
    assert (out / "secrets/api-token").read_bytes() == first["secrets/api-token"]
    (out / "99-x.yaml").write_text("kind: ConfigMap\n")
    assert _deploy(out, "k8s", "--force") == 2
    assert "did not write: 99-x.yaml" in capsys.readouterr().err


def test_an_empty_folder_is_accepted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert _deploy(out) == 0
    assert (out / "docker-compose.yaml").is_file() and (out / ".areal-hex-deploy").is_file()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("target", ["compose", "k8s"])
def test_git_sees_no_secret(tmp_path, target):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    assert _deploy(repo / "deploy-out", target) == 0
    listed = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "deploy-out/.gitignore" in listed  # the folder is seen ...
    assert "secrets" not in listed  # ... but no secret value or Secret manifest
    secrets = sorted(p.name for p in (repo / "deploy-out/secrets").iterdir())
    want = ["api-token", "redis-password"] + (["secret.yaml"] if target == "k8s" else [])
    assert secrets == want
    assert "secrets/" in (repo / "deploy-out/.dockerignore").read_text().split()


def test_an_existing_secret_is_referenced_and_no_value_written(tmp_path):
    import yaml

    out = tmp_path / "out"
    assert _deploy(out, "k8s", "--existing-secret", "rl-secrets") == 0
    assert not (out / "secrets").exists()
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert not any(r.startswith("secrets/") for r in kust["resources"])
    assert "secretName: rl-secrets" in (out / "30-trainer.yaml").read_text()


def test_sglang_gets_its_api_key_from_a_file_not_its_command_line(tmp_path):
    """The entry wrapper of an SGLang server moves the token into SGLang's --config file;
    the launch command `areal-hex serve` builds then carries only that file's path."""
    import yaml

    from areal_hex.config import load_config
    from hexctl.runtime.entry import write_runtime_config
    from rollout_service.server.sglang_launcher import launch_command

    out = tmp_path / "out"
    assert _deploy(out, "k8s") == 0
    secrets = out / "secrets"
    token = (secrets / "api-token").read_text().strip()
    rt = tmp_path / "rt"
    sglang_file = rt / "sglang.yaml"
    runtime = write_runtime_config(
        out / "resolved/config.yaml", secrets, rt / "config.yaml", sglang_file
    )
    cfg = load_config(runtime)
    assert cfg.inference.backend == "sglang" and cfg.inference.api_key is None
    cmd = launch_command(cfg.model, cfg.inference, 30000)
    assert token not in " ".join(cmd) and "--api-key" not in cmd
    assert cmd[cmd.index("--config") + 1] == str(sglang_file)
    assert yaml.safe_load(sglang_file.read_text()) == {"api-key": token}
    assert sglang_file.stat().st_mode & 0o077 == 0 and runtime.stat().st_mode & 0o077 == 0
    assert cfg.redis.password == (secrets / "redis-password").read_text().strip()
    # the controller's copy (no --sglang-config) keeps the token: it must send it
    ctl = load_config(write_runtime_config(out / "resolved/config.yaml", secrets, rt / "c.yaml"))
    assert ctl.inference.api_key == token
    # and only inference containers get the flag
    pods = {p.name: p.read_text() for p in out.glob("*.yaml")}
    assert all("--sglang-config" in t for n, t in pods.items() if n.startswith("15-inference"))
    assert not any("--sglang-config" in t for n, t in pods.items() if "inference" not in n)


def test_kustomization_lists_every_manifest(tmp_path):
    import yaml

    out = tmp_path / "out"
    assert _deploy(out, "k8s") == 0
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    top = sorted(p.name for p in out.glob("*.yaml") if p.name != "kustomization.yaml")
    assert kust["resources"] == [*top, "secrets/secret.yaml"]
    namespaces = {
        o["metadata"].get("namespace")
        for f in kust["resources"]
        for o in yaml.safe_load_all((out / f).read_text())
        if o["kind"] != "Namespace"
    }
    assert namespaces == {kust["namespace"]}
    images = {
        c["image"]
        for f in kust["resources"]
        for o in yaml.safe_load_all((out / f).read_text())
        for c in _containers(o)
    }
    for entry in kust["images"]:  # each names an image the manifests use, at its tag
        assert f"{entry['name']}:{entry['newTag']}" in images


def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {})
    if obj["kind"] == "JobSet":
        spec = spec["replicatedJobs"][0]["template"]["spec"]
    pod = spec.get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("target", ["k8s", "compose"])
@pytest.mark.parametrize("where", ["file", "secrets-folder"])
def test_force_never_writes_through_a_symlink(tmp_path, capsys, target, where):
    """A link in the output folder (to a file, or `secrets/` itself to a folder) that
    leads outside it: --force exits 2 and the file outside is unchanged."""
    out = tmp_path / "out"
    assert _deploy(out, target) == 0
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = outside / "api-token"
    victim.write_text("precious\n")
    before = _sha256(victim)
    if where == "file":
        name = "kustomization.yaml" if target == "k8s" else "docker-compose.yaml"
        (out / name).unlink()
        (out / name).symlink_to(victim)
    else:
        shutil.rmtree(out / "secrets")
        (out / "secrets").symlink_to(outside, target_is_directory=True)
    capsys.readouterr()
    assert _deploy(out, target, "--force") == 2
    err = capsys.readouterr().err
    assert "symbolic links" in err and "Traceback" not in err
    assert _sha256(victim) == before and sorted(p.name for p in outside.iterdir()) == ["api-token"]
