"""The run's end on Kubernetes: when the trainer finishes, a reaper Job scales the
inference Deployments to zero (`hexctl.runtime.reaper`), so their GPUs go back to the
cluster. Its ServiceAccount may read the trainer and scale only this run's servers."""

from __future__ import annotations

from typing import Any

from hexctl.deploy.common import Deployment
from hexctl.deploy.k8s_pods import container_security, labels, pod_security
from hexctl.deploy.k8s_trainer import JOBSET_API
from hexctl.deploy.names import service_name

Obj = dict[str, Any]
# The reaper's namespace: its own pod's (downward API), which `hexctl.runtime.reaper`
# reads from this variable.
NAMESPACE_ENV = "POD_NAMESPACE"


def lifecycle_objects(d: Deployment, trainer: Obj, servers: list[str]) -> list[Obj]:
    """ServiceAccount, Role, RoleBinding and the reaper Job for the `trainer` object
    (JobSet or Job) and the inference Deployments named `servers`."""
    name = f"{d.prefix}-reaper"

    def meta(obj_name: str) -> Obj:
        return {"name": obj_name, "namespace": d.dcfg.namespace, "labels": labels(d, "lifecycle")}

    kind, trainer_name = trainer["kind"], trainer["metadata"]["name"]
    group, plural = ("jobset.x-k8s.io", "jobsets") if kind == "JobSet" else ("batch", "jobs")
    assert kind != "JobSet" or trainer["apiVersion"] == JOBSET_API
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta(name),
        "rules": [
            {"apiGroups": [group], "resources": [plural], "verbs": ["get"],
             "resourceNames": [trainer_name]},
            {"apiGroups": ["apps"], "resources": ["deployments/scale"],
             "verbs": ["get", "patch"], "resourceNames": servers},
        ],
    }  # fmt: skip
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": d.dcfg.namespace}],
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name)}
    return [account, role, binding, _reaper_job(d, name, kind, trainer_name, servers)]


def _reaper_job(d: Deployment, name: str, kind: str, trainer: str, servers: list[str]) -> Obj:
    # The namespace comes from the pod itself (downward API), not from an argument: an
    # overlay that moves the base to another namespace moves the reaper's target with it.
    args = ["--trainer-kind", kind, "--trainer", trainer]
    for s in servers:
        args += ["--deployment", s]
    container = {
        "name": "reaper",
        "image": d.dcfg.images.controller,
        "imagePullPolicy": d.dcfg.images.pull_policy,
        "command": ["python3", "-m", "hexctl.runtime.reaper"],
        "args": args,
        "env": [
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
            {"name": NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "resources": {
            "requests": {"cpu": "10m", "memory": "128Mi"},
            "limits": {"memory": "128Mi"},
        },
        "securityContext": container_security(),
    }
    spec = {
        "serviceAccountName": name,
        "automountServiceAccountToken": True,  # the one pod that talks to the API server
        "enableServiceLinks": False,
        "securityContext": pod_security(d.dcfg.uid),
        "restartPolicy": "OnFailure",
        "containers": [container],
        **({"priorityClassName": d.dcfg.priority_class} if d.dcfg.priority_class else {}),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": d.dcfg.namespace, "labels": labels(d, "lifecycle")},
        "spec": {
            "backoffLimit": 20,
            "template": {"metadata": {"labels": labels(d, "lifecycle")}, "spec": spec},
        },
    }


def inference_names(d: Deployment) -> list[str]:
    return [service_name(d.prefix, s) for s in d.layout.by_role("inference")]
