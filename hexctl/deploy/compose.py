"""docker-compose rendering: the job on one GPU host.

Services talk over `internal`, a compose network with no route off the host, and reach
each other by service name (Redis at `redis`, server i at its instance id); nothing binds
a host port except, with `metrics.compose_prometheus`, Prometheus on 127.0.0.1. Only the
services that download (the prepare job: the model; the controller: the dataset) also
join `egress`. Every container runs non-root on a read-only root filesystem with all
capabilities dropped, no privilege escalation and Docker's default seccomp profile; /tmp
is a tmpfs. GPUs are reserved per service with `device_ids` from the plan.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from hexctl.deploy.common import (
    CONFIG_DIR,
    PREDICTION,
    Bundle,
    Deployment,
    entry_argv,
    resolved_files,
    secret_files,
)
from hexctl.deploy.config import Resources
from hexctl.deploy.quantities import pod_share
from hexctl.job.layout import ServiceSpec

COMPOSE_SECRETS_DIR = "/run/secrets"  # where compose mounts `secrets:` entries
PROMETHEUS_CONFIG = "prometheus.yml"
# What every container gets (the k8s target's securityContext, in compose terms).
HARDENING: dict[str, Any] = {
    "read_only": True,
    "tmpfs": ["/tmp"],
    "cap_drop": ["ALL"],
    "security_opt": ["no-new-privileges:true", "seccomp=builtin"],
}


def entrypoint(sglang: bool = False) -> list[str]:
    """The secret-injecting wrapper; the service's layout command follows as `command`."""
    return entry_argv(COMPOSE_SECRETS_DIR, sglang)


def docker_size(quantity: str) -> str:
    """Kubernetes quantity (`32Gi`, `512Mi`) to a docker size (`32g`, `512m`)."""
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", quantity)
    if m is None:
        raise ValueError(f"size {quantity!r}: expected a number with Ki/Mi/Gi/Ti")
    unit = (m.group(2) or "")[:1].lower()
    return f"{m.group(1)}{unit or 'b'}"


def render_compose(d: Deployment) -> Bundle:
    """docker-compose.yaml, the config and plan it mounts, and the secret files."""
    files = {
        **resolved_files(d, ""),
        "docker-compose.yaml": yaml.safe_dump(compose_file(d), sort_keys=False),
        **secret_files(d),
    }
    if d.dcfg.metrics.compose_prometheus:
        files[PROMETHEUS_CONFIG] = yaml.safe_dump(prometheus_config(d), sort_keys=False)
    # compose bind-mounts each secret file itself, so they stay readable (0644, in a 0700
    # folder) for the containers' non-root users
    return Bundle(files, start="docker compose -f {out}/docker-compose.yaml up -d")


def compose_file(d: Deployment) -> dict[str, Any]:
    """The compose file as a dict."""
    services: dict[str, Any] = {}
    # Every areal-hex service starts after v0 is written, as under `areal-hex run`.
    prepared = {"prepare": {"condition": "service_completed_successfully"}}
    depends: dict[str, Any] = dict(prepared)
    if d.dcfg.redis.mode == "internal":
        services["redis"] = _redis(d)
        depends["redis"] = {"condition": "service_healthy"}
    services["prepare"] = _prepare(d)
    for svc in d.layout.by_role("inference"):
        services[svc.name] = _inference(d, svc)
        services[svc.name]["depends_on"] = dict(prepared)
    for svc in d.layout.by_role("worker"):  # the workflow's tasks beyond generate, train
        image, res = (
            (d.dcfg.images.trainer, d.dcfg.resources.trainer)
            if svc.gpus
            else (d.dcfg.images.controller, None)
        )
        services[svc.name] = _app(d, svc, image, res)
        services[svc.name]["depends_on"] = dict(depends)
    controller = _app(d, d.layout.by_role("controller")[0], d.dcfg.images.controller, None)
    controller["depends_on"] = {
        **depends,
        **{s.name: {"condition": "service_healthy"} for s in d.layout.by_role("inference")},
    }
    run_dir = d.cfg.run.run_dir()
    controller["healthcheck"] = _health(["fresh", f"{run_dir}/rollout.jsonl", "600"], "60s")
    # It exits 0 once the run's groups are produced; only a failure restarts it.
    controller["restart"] = "on-failure"
    controller["networks"] = ["internal", "egress"]  # the dataset may come from the hub
    services["controller"] = controller
    trainer_spec = d.layout.by_role("trainer")[0]
    trainer = _app(d, trainer_spec, d.dcfg.images.trainer, d.dcfg.resources.trainer)
    trainer["restart"] = "on-failure"
    trainer["depends_on"] = dict(depends)
    services["trainer"] = trainer
    if d.dcfg.metrics.compose_prometheus:
        services["prometheus"] = _prometheus(d)
    out: dict[str, Any] = {
        "services": services,
        "networks": {"internal": {"internal": True}, "egress": {}},
        "volumes": {"data": {}},
        "configs": {
            "areal-config": {"file": "./config.yaml"},
            "areal-plan": {"file": "./plan.yaml"},
            "areal-prediction": {"file": f"./{PREDICTION}"},
        },
        "secrets": {k: {"file": f"./secrets/{k}"} for k in d.secrets.as_dict()},
        "x-areal-hex": {"run_id": d.cfg.run.run_id, "cluster": d.plan.cluster},
    }
    if "redis" in services:
        out["volumes"]["redis-data"] = {}
    if "prometheus" in services:
        out["configs"]["prometheus"] = {"file": f"./{PROMETHEUS_CONFIG}"}
        out["volumes"]["prometheus-data"] = {}
    return out


def _prepare(d: Deployment) -> dict[str, Any]:
    svc = ServiceSpec("prepare", "controller", d.prepare_command(f"{CONFIG_DIR}/{PREDICTION}"))
    out = _app(d, svc, d.dcfg.images.controller, None)
    out["configs"].append({"source": "areal-prediction", "target": f"{CONFIG_DIR}/{PREDICTION}"})
    out["restart"] = "no"
    out["networks"] = ["internal", "egress"]  # downloads the model from the hub
    return out


def _app(d: Deployment, svc: ServiceSpec, image: str, res: Resources | None) -> dict[str, Any]:
    """A service running one layout command through the entry wrapper."""
    sglang = svc.role == "inference" and d.cfg.inference.backend == "sglang"
    out: dict[str, Any] = {
        "image": image,
        "user": f"{d.dcfg.uid}:{d.dcfg.uid}",
        "entrypoint": entrypoint(sglang),
        "command": list(svc.command),
        "environment": {
            "HF_HOME": f"{d.dcfg.storage.mount_path}/hf-cache",
            "HOME": "/tmp",
            "XDG_CACHE_HOME": "/tmp/.cache",
            "PYTHONDONTWRITEBYTECODE": "1",
            **svc.env,  # what the layout asks for, as under `areal-hex run`
        },
        "configs": [
            {"source": "areal-config", "target": f"{CONFIG_DIR}/config.yaml"},
            {"source": "areal-plan", "target": f"{CONFIG_DIR}/plan.yaml"},
        ],
        "secrets": list(d.secrets.as_dict()),
        "volumes": [f"data:{d.dcfg.storage.mount_path}"],
        "networks": ["internal"],
        "restart": "unless-stopped",
        **HARDENING,
    }
    if res is not None:  # per GPU of the service, as the pods get it
        out["shm_size"] = docker_size(pod_share(res, svc.gpus).shm)
    if svc.gpus:
        devices = [str(g) for g in svc.devices]
        out["deploy"] = {
            "resources": {
                "reservations": {
                    "devices": [
                        {"driver": "nvidia", "device_ids": devices, "capabilities": ["gpu"]}
                    ]
                }
            }
        }
    return out


def _inference(d: Deployment, svc: ServiceSpec) -> dict[str, Any]:
    out = _app(d, svc, d.dcfg.images.inference, d.dcfg.resources.inference)
    # Model loading (and SGLang's CUDA graph capture) can take many minutes.
    out["healthcheck"] = _health(["http", f"http://127.0.0.1:{svc.port}/health"], "900s")
    return out


def _health(probe_args: list[str], start_period: str) -> dict[str, Any]:
    return {
        "test": ["CMD", "python3", "-m", "hexctl.runtime.probe", *probe_args],
        "interval": "15s",
        "timeout": "10s",
        "retries": 5,
        "start_period": start_period,
    }


def _redis(d: Deployment) -> dict[str, Any]:
    port = d.dcfg.redis.port
    # The password goes to redis-server on stdin (config file `-`, a here-document): never
    # on a command line or in the environment; `exec` makes the server PID 1 (clean stop on
    # SIGTERM). `$$` is compose's escape for a literal `$`. It listens on the internal
    # network only, and needs the password there.
    start = (
        f"exec redis-server - --port {port} --appendonly yes "
        "--appendfsync everysec --dir /data <<EOF\n"
        "requirepass $$(cat /run/secrets/redis-password)\nEOF\n"
    )
    ping = (
        'REDISCLI_AUTH="$$(cat /run/secrets/redis-password)" '
        f"redis-cli -p {port} ping | grep -q PONG"
    )
    return {
        "image": d.dcfg.images.redis,
        "user": "999:999",  # the redis user of the official image; owns /data
        "entrypoint": ["sh", "-c"],
        "command": [start],
        "secrets": ["redis-password"],
        "volumes": ["redis-data:/data"],
        "networks": ["internal"],
        "healthcheck": {
            "test": ["CMD-SHELL", ping],
            "interval": "5s",
            "timeout": "5s",
            "retries": 10,
        },
        "restart": "unless-stopped",
        **HARDENING,  # the here-document needs a writable /tmp: the tmpfs
    }


def scrape_targets(d: Deployment) -> dict[str, list[str]]:
    """Prometheus job -> `host:port` of every /metrics (docs/observability.md)."""
    return {
        "inference": [f"{s.name}:{s.port}" for s in d.layout.by_role("inference")],
        "trainer": [f"trainer:{d.cfg.trainer.metrics_port}"],
        "controller": [f"controller:{d.cfg.rollout.metrics_port}"],
    }


def prometheus_config(d: Deployment) -> dict[str, Any]:
    """Scrape every service; the trainer's and controller's /metrics need the service
    token (the `api-token` secret), the servers' do not. Every series is labelled `run`
    with the run id (the dashboard's run filter)."""
    jobs = []
    run = {"run": d.cfg.run.run_id or ""}
    for job, targets in scrape_targets(d).items():
        static = [{"targets": targets, "labels": run}]
        entry: dict[str, Any] = {"job_name": job, "static_configs": static}
        if job != "inference":
            token = f"{COMPOSE_SECRETS_DIR}/api-token"
            entry["authorization"] = {"type": "Bearer", "credentials_file": token}
        jobs.append(entry)
    return {"global": {"scrape_interval": "15s"}, "scrape_configs": jobs}


def _prometheus(d: Deployment) -> dict[str, Any]:
    port = d.dcfg.metrics.prometheus_port
    return {
        "image": d.dcfg.images.prometheus,
        "user": "65534:65534",  # nobody, as the official image runs
        "command": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            f"--web.listen-address=:{port}",
        ],
        "configs": [{"source": "prometheus", "target": "/etc/prometheus/prometheus.yml"}],
        "secrets": ["api-token"],
        "volumes": ["prometheus-data:/prometheus"],
        # the only published port, on the host's loopback
        "ports": [f"127.0.0.1:{port}:{port}"],
        "networks": ["internal", "egress"],
        "restart": "unless-stopped",
        **HARDENING,
    }
