"""Pod templates for the Kubernetes target: containers running layout commands through the
secret-injecting entry wrapper, with volumes, probes, resources and non-root security.
"""

from __future__ import annotations

from typing import Any

from hexctl.deploy.common import (
    CONFIG_DIR,
    SECRETS_DIR,
    Deployment,
    entry_argv,
    instance_label,
)
from hexctl.deploy.config import Resources
from hexctl.deploy.names import gpu_label_value
from hexctl.deploy.quantities import memory_bytes, memory_quantity, pod_share
from hexctl.job.layout import ServiceSpec

Obj = dict[str, Any]


def labels(d: Deployment, component: str, **extra: str) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "areal-hex",
        "app.kubernetes.io/instance": instance_label(d.cfg.run.run_id or d.prefix),
        "app.kubernetes.io/component": component,
    }
    out.update(extra)
    return out


def secret_name(d: Deployment) -> str:
    return d.dcfg.existing_secret or f"{d.prefix}-secrets"


def claim_name(d: Deployment) -> str:
    return d.dcfg.storage.existing_claim or f"{d.prefix}-data"


def entry_command(sglang: bool = False) -> list[str]:
    return entry_argv(SECRETS_DIR, sglang)


def scrape_annotations(port: int) -> dict[str, str]:
    """Where Prometheus' usual `kubernetes-pods` job finds the pod's /metrics."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def resources(res: Resources, gpus: int) -> Obj:
    """Requests and limits of a container whose pod has a memory-backed /dev/shm of
    `res.shm`: its pages are charged to the container's memory, so the shm size is added
    to the request and the limit rather than taken out of the processes' memory."""
    shm = memory_bytes(res.shm)
    memory = memory_quantity(memory_bytes(res.memory) + shm)
    limit = memory_quantity(memory_bytes(res.memory_limit or res.memory) + shm)
    requests: dict[str, str] = {"cpu": res.cpu, "memory": memory}
    limits: dict[str, str] = {"memory": limit}
    if res.cpu_limit:
        limits["cpu"] = res.cpu_limit
    if gpus:
        # Extended resources: request must equal limit.
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": requests, "limits": limits}


def container_security() -> Obj:
    """Non-root, no capabilities, the runtime's seccomp profile, and a read-only root
    filesystem: what a process writes goes to the /tmp and /dev/shm emptyDirs or the
    shared volume."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security(uid: int) -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def probe_exec(args: list[str], period: int, failures: int, delay: int = 0) -> Obj:
    return {
        "exec": {"command": ["python3", "-m", "hexctl.runtime.probe", *args]},
        "initialDelaySeconds": delay,
        "periodSeconds": period,
        "timeoutSeconds": 10,
        "failureThreshold": failures,
    }


def http_probes(port: int) -> Obj:
    """Startup allows long model loads (up to 30 min); then liveness/readiness on /health."""

    def get(period: int, failures: int) -> Obj:
        return {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": period,
            "timeoutSeconds": 10,
            "failureThreshold": failures,
        }

    return {
        "startupProbe": get(10, 180),
        "readinessProbe": get(10, 3),
        "livenessProbe": get(20, 6),
    }


def volumes(d: Deployment, shm: str) -> tuple[list[Obj], list[Obj]]:
    """(pod volumes, container mounts): config, secrets, shared data, /dev/shm, /tmp."""
    vols: list[Obj] = [
        {"name": "config", "configMap": {"name": f"{d.prefix}-config"}},
        # 0440 + fsGroup: readable by the non-root user, by nobody else.
        {"name": "secrets", "secret": {"secretName": secret_name(d), "defaultMode": 0o440}},
        {"name": "data", "persistentVolumeClaim": {"claimName": claim_name(d)}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[Obj] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True},
        {"name": "data", "mountPath": d.dcfg.storage.mount_path},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    return vols, mounts


def node_selector(d: Deployment, svc: ServiceSpec) -> dict[str, str]:
    sel: dict[str, str] = {}
    if svc.gpu_kind is not None:
        value = gpu_label_value(svc.gpu_kind, d.dcfg)
        assert value is not None  # check_plan refused unknown kinds
        sel[d.dcfg.gpu_label_key] = value
    return sel


def wait_for_weights(d: Deployment, image: str) -> Obj:
    """Init container: hold the pod until the prepare job has written v0."""
    return {
        "name": "wait-initial-weights",
        "image": image,
        "imagePullPolicy": d.dcfg.images.pull_policy,
        "command": ["python3", "-m", "hexctl.runtime.probe", "wait"],
        "args": [d.initial_weights_marker(), "86400"],
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "256Mi"},
        },
        "volumeMounts": [
            {"name": "data", "mountPath": d.dcfg.storage.mount_path},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": container_security(),
    }


def pod_spec(
    d: Deployment,
    svc: ServiceSpec,
    image: str,
    res: Resources,
    args: list[str],
    env: list[Obj] | None = None,
    wait_weights: bool = True,
) -> Obj:
    """A pod running `args` (a layout command) on `svc`'s GPU kind, with `res` per GPU
    (`pod_share`); with `wait_weights`, it starts once the initial weights exist."""
    res = pod_share(res, svc.gpus)
    vols, mounts = volumes(d, res.shm)
    base_env: list[Obj] = [
        {"name": "HF_HOME", "value": f"{d.dcfg.storage.mount_path}/hf-cache"},
        # the root filesystem is read-only: caches (Triton, FlashInfer, torch extensions)
        # and bytecode go to /tmp or nowhere
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # what the layout asks for, as under `areal-hex run`
        *({"name": k, "value": v} for k, v in svc.env.items()),
    ]
    container: Obj = {
        "name": svc.role,
        "image": image,
        "imagePullPolicy": d.dcfg.images.pull_policy,
        "command": entry_command(svc.role == "inference" and d.cfg.inference.backend == "sglang"),
        "args": args,
        "env": base_env + (env or []),
        "resources": resources(res, svc.gpus),
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    if svc.port is not None:
        container["ports"] = [{"name": "http", "containerPort": svc.port}]
    spec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(d.dcfg.uid),
        "containers": [container],
        "volumes": vols,
    }
    if d.dcfg.priority_class:
        spec["priorityClassName"] = d.dcfg.priority_class
    if wait_weights:
        spec["initContainers"] = [wait_for_weights(d, image)]
    sel = node_selector(d, svc)
    if sel:
        spec["nodeSelector"] = sel
    if svc.gpus:
        spec["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    return spec


def meta(d: Deployment, name: str, component: str, **extra: str) -> Obj:
    return {"name": name, "namespace": d.dcfg.namespace, "labels": labels(d, component, **extra)}


def metrics_port(d: Deployment, component: str) -> int:
    """The /metrics port of the trainer's rank 0 or of the controller (set by
    `resolve_config`)."""
    port = d.cfg.trainer.metrics_port if component == "trainer" else d.cfg.rollout.metrics_port
    assert port, "resolve_config sets a fixed metrics port"
    return port


def selector(pod_labels: dict[str, str]) -> dict[str, str]:
    keys = ("app.kubernetes.io/instance", "app.kubernetes.io/component")
    return {k: pod_labels[k] for k in keys}
