"""Kubernetes rendering: one file per concern, applied in file-name order.

Objects: Secret (Redis password, service token), ConfigMap (resolved config, plan and its
prediction, no secrets), a ReadWriteMany PVC for runs and weights, Redis (StatefulSet +
Service) unless external, one inference Deployment + Service per planned instance (each
keeps its index, port and TP degree; pinned to its GPU kind by node selector), the
rollout controller, the trainer as a JobSet or an indexed Job (`k8s_trainer`),
NetworkPolicies and PodDisruptionBudgets (`k8s_policy`) and the reaper
(`k8s_lifecycle`); the Namespace only when asked (`create_namespace`), since a
namespace holds many runs.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import yaml

from areal_hex.config import dump_yaml
from areal_hex.run_files import RunPaths
from hexctl.deploy.common import (
    CONFIG_DIR,
    PREDICTION,
    Bundle,
    Deployment,
    prediction_text,
    resolved_files,
    secret_files,
)
from hexctl.deploy.k8s_lifecycle import inference_names, lifecycle_objects
from hexctl.deploy.k8s_pods import (
    claim_name,
    container_security,
    http_probes,
    labels,
    meta,
    metrics_port,
    pod_security,
    pod_spec,
    probe_exec,
    scrape_annotations,
    secret_name,
    selector,
)
from hexctl.deploy.k8s_policy import disruption_budgets, network_policies
from hexctl.deploy.k8s_trainer import (
    KUEUE_QUEUE,
    NODE_RANK_OFFSET,
    headless_service,
    indexed_job,
    jobset,
    master_addr,
    placement_affinity,
    rendezvous_env,
)
from hexctl.deploy.names import service_name, slug
from hexctl.job.layout import ServiceSpec

Obj = dict[str, Any]
SECRET_MANIFEST = "secrets/secret.yaml"  # excluded from git like the values
KUSTOMIZATION = "kustomization.yaml"


def render_k8s(d: Deployment) -> dict[str, list[Obj]]:
    """File name -> objects in it."""
    files: dict[str, list[Obj]] = {
        "00-namespace.yaml": [_namespace(d)] if d.dcfg.create_namespace else [],
        "01-config.yaml": [_configmap(d)],
        "02-storage.yaml": [] if d.dcfg.storage.existing_claim else [_pvc(d)],
        "05-prepare.yaml": [_prepare(d)],
        "20-controller.yaml": [_controller(d)],
        "30-trainer.yaml": (trainer := _trainer(d)),
        "40-networkpolicy.yaml": network_policies(d),
        "45-disruption.yaml": disruption_budgets(d),
        "50-lifecycle.yaml": lifecycle_objects(d, trainer[-1], inference_names(d)),
    }
    if d.dcfg.redis.mode == "internal":
        files["10-redis.yaml"] = _redis(d)
    for svc in d.layout.by_role("inference"):
        files[f"15-inference-{slug(svc.name)}.yaml"] = _inference(d, svc)
    for svc in d.layout.by_role("worker"):  # the workflow's tasks beyond generate, train
        files[f"25-task-{slug(svc.name)}.yaml"] = _worker(d, svc)
    return {k: files[k] for k in sorted(files) if files[k]}


def render_k8s_bundle(d: Deployment) -> Bundle:
    """The manifests, and the Secret with its values under secrets/ (0600)."""
    files = {name: dump_objects(objs) for name, objs in render_k8s(d).items()}
    files.update(resolved_files(d, "resolved/"))
    private: set[str] = set()
    if d.dcfg.existing_secret is None:
        files[SECRET_MANIFEST] = dump_objects([_secret(d)])
        files.update(secret_files(d))
        private = {SECRET_MANIFEST, *secret_files(d)}
    manifests = sorted(f for f in files if f.endswith(".yaml") and "/" not in f)
    if SECRET_MANIFEST in files:
        manifests.append(SECRET_MANIFEST)
    files[KUSTOMIZATION] = kustomization(d, manifests)
    return Bundle(
        files,
        private,
        start="kubectl apply -k {out}   (a kustomize base)",
        delete=delete_command(d),
    )


# Every kind a run renders (and the PVC its Redis StatefulSet creates), for a delete by
# the run's label: `all` would miss the JobSet (its CRD is in no category), the PVCs,
# ConfigMap, Secret, policies and RBAC objects.
DELETE_KINDS = (
    "jobsets.jobset.x-k8s.io", "jobs", "deployments", "statefulsets", "services",
    "configmaps", "secrets", "persistentvolumeclaims", "networkpolicies",
    "poddisruptionbudgets", "serviceaccounts", "roles", "rolebindings",
)  # fmt: skip


def delete_command(d: Deployment) -> str:
    """Deletes this run and nothing else: every kind it renders, by its instance label
    (one to one with the run id), never the namespace."""
    inst = labels(d, "x")["app.kubernetes.io/instance"]
    return (
        f"kubectl -n {d.dcfg.namespace} delete {','.join(DELETE_KINDS)} "
        f"-l app.kubernetes.io/instance={inst}"
    )


def kustomization(d: Deployment, resources: list[str]) -> str:
    """The folder as a kustomize base: `kubectl apply -k DIR`, or an overlay on top of it
    (another namespace, image registry, resources) without editing the rendered files."""
    head = (
        f"# areal-hex deploy: run {d.cfg.run.run_id}, plan for cluster {d.plan.cluster}\n"
        "# apply with: kubectl apply -k <this folder>\n"
    )
    refs = {d.dcfg.images.inference, d.dcfg.images.trainer, d.dcfg.images.controller}
    images = [kustomize_image(ref) for ref in sorted(refs)]
    body = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": d.dcfg.namespace,
        "resources": resources,
        "images": images,
    }
    return head + yaml.safe_dump(body, sort_keys=False)


def kustomize_image(ref: str) -> Obj:
    """`host/repo:tag` or `host/repo[:tag]@sha256:...` as a kustomize `images` entry
    (which an overlay's `kustomize edit set image` replaces)."""
    name, _, digest = ref.partition("@")
    head, sep, tag = name.rpartition(":")
    if sep and "/" not in tag:  # a tag, not a registry port
        name = head
    else:
        tag = ""
    entry = {"name": name, "newTag": tag} if tag else {"name": name}
    if digest:
        entry["digest"] = digest  # with a tag, kustomize keeps both: repo:tag@sha256:...
    return entry


def dump_objects(objs: list[Obj]) -> str:
    return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objs)


def _namespace(d: Deployment) -> Obj:
    # Not labelled with the run: a delete by the run's label never takes the namespace.
    # Every pod below satisfies the "restricted" Pod Security Standard.
    ns_labels = {
        "app.kubernetes.io/name": "areal-hex",
        "pod-security.kubernetes.io/enforce": "restricted",
    }
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": d.dcfg.namespace, "labels": ns_labels},
    }


def _secret(d: Deployment) -> Obj:
    data = {k: base64.b64encode(v.encode()).decode() for k, v in d.secrets.as_dict().items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(d, secret_name(d), "secrets"),
        "type": "Opaque",
        "data": data,
    }


def _configmap(d: Deployment) -> Obj:
    plan_yaml = yaml.safe_dump(d.plan.model_dump(mode="json"), sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(d, f"{d.prefix}-config", "config"),
        "data": {
            "config.yaml": dump_yaml(d.cfg),
            "plan.yaml": plan_yaml,
            PREDICTION: prediction_text(d.prediction),
        },
    }


def _pvc(d: Deployment) -> Obj:
    st = d.dcfg.storage
    spec: Obj = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": st.size}},
    }
    if st.storage_class:
        spec["storageClassName"] = st.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta(d, claim_name(d), "storage"),
        "spec": spec,
    }


def _prepare(d: Deployment) -> Obj:
    """One-shot Job writing v0; every other areal-hex pod waits for it (init container)."""
    svc = ServiceSpec("prepare", "controller", d.prepare_command(f"{CONFIG_DIR}/{PREDICTION}"))
    res = d.dcfg.resources.prepare
    spec = pod_spec(d, svc, d.dcfg.images.controller, res, svc.command, wait_weights=False)
    spec["containers"][0]["name"] = "prepare"
    spec["restartPolicy"] = "OnFailure"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(d, f"{d.prefix}-prepare", "prepare"),
        "spec": {
            "backoffLimit": 3,
            "template": {"metadata": {"labels": labels(d, "prepare")}, "spec": spec},
        },
    }


def _service(d: Deployment, name: str, component: str, port: int, selector: dict) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(d, name, component),
        "spec": {
            "selector": selector,
            "ports": [{"name": "tcp", "port": port, "targetPort": port}],
        },
    }


def _deployment(d: Deployment, name: str, sel: dict, pod_labels: dict, spec: Obj) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(d, name, pod_labels["app.kubernetes.io/component"]),
        "spec": {
            "replicas": 1,
            # GPUs cannot be shared by an old and a new pod: stop first, then start.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": sel},
            "template": {"metadata": {"labels": pod_labels}, "spec": spec},
        },
    }


def _inference(d: Deployment, svc: ServiceSpec) -> list[Obj]:
    name = service_name(d.prefix, svc)
    assert svc.port is not None and svc.gpu_kind is not None
    pod_labels = labels(
        d, "inference", **{"areal-hex/instance": name, "areal-hex/gpu-kind": slug(svc.gpu_kind, 63)}
    )
    spec = pod_spec(d, svc, d.dcfg.images.inference, d.dcfg.resources.inference, svc.command)
    spec["containers"][0].update(http_probes(svc.port))
    affinity = placement_affinity(d, svc, pod_labels)
    if affinity is not None:
        spec["affinity"] = affinity
    sel = {"areal-hex/instance": name}
    dep = _deployment(d, name, sel, pod_labels, spec)
    dep["spec"]["template"]["metadata"]["annotations"] = scrape_annotations(svc.port)
    return [_service(d, name, "inference", svc.port, sel), dep]


def _worker(d: Deployment, svc: ServiceSpec) -> list[Obj]:
    """One instance of a workflow task: a Deployment on its planned GPU kind (and a
    Service where it listens), its command run as every service's is."""
    name = service_name(d.prefix, svc)
    image, res = (
        (d.dcfg.images.trainer, d.dcfg.resources.trainer)
        if svc.gpus
        else (d.dcfg.images.controller, d.dcfg.resources.controller)
    )
    pod_labels = labels(d, "task", **{"areal-hex/instance": name})
    sel = {"areal-hex/instance": name}
    dep = _deployment(d, name, sel, pod_labels, pod_spec(d, svc, image, res, svc.command))
    if svc.port is None:
        return [dep]
    return [_service(d, name, "task", svc.port, sel), dep]


def _controller(d: Deployment) -> Obj:
    """A Job, not a Deployment: the controller exits 0 once it has produced the run's
    groups (`rollout.max_groups`), and must then not start over."""
    svc = d.layout.by_role("controller")[0]
    # It finds server i at inference.server_urls[i] (each server's Service) in the config.
    spec = pod_spec(d, svc, d.dcfg.images.controller, d.dcfg.resources.controller, svc.command)
    # The controller appends to rollout.jsonl every few seconds; silence means it hangs.
    fresh = ["fresh", f"{d.cfg.run.run_dir()}/rollout.jsonl", "600"]
    spec["containers"][0]["livenessProbe"] = probe_exec(fresh, 60, 3, delay=120)
    port = metrics_port(d, "controller")
    spec["containers"][0]["ports"] = [{"name": "metrics", "containerPort": port}]
    spec["restartPolicy"] = "OnFailure"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(d, service_name(d.prefix, svc), "controller"),
        "spec": {
            "backoffLimit": 6,
            "template": {
                "metadata": {
                    "labels": labels(d, "controller"),
                    "annotations": scrape_annotations(port),
                },
                "spec": spec,
            },
        },
    }


def _trainer(d: Deployment) -> list[Obj]:
    """The trainer as a JobSet (gang restarts) or an Indexed Job; see k8s_trainer. A
    trainer across GPU kinds gets one replicated job per kind, each pinned to its kind's
    machines, its pods' node ranks offset by the nodes before it."""
    svc = d.layout.by_role("trainer")[0]
    name = service_name(d.prefix, svc)
    pod_labels = labels(d, "trainer")
    templates = []
    for kind, first, nodes in svc.kind_segments():
        part = replace(
            svc, gpu_kind=kind, nodes=nodes, node_names=svc.node_names[first : first + nodes]
        )
        templates.append((part, _trainer_template(d, svc, part, first, pod_labels)))
    job_meta = meta(d, name, "trainer")
    if d.dcfg.kueue_queue:
        job_meta["labels"][KUEUE_QUEUE] = d.dcfg.kueue_queue
    if d.dcfg.trainer.gang == "jobset":
        return [jobset(d, job_meta, templates)]
    [(part, template)] = templates  # refuse_mixed_trainer: across kinds it is a JobSet
    template["spec"]["subdomain"] = name
    headless = headless_service(d, meta(d, name, "trainer"), selector(pod_labels))
    return [headless, indexed_job(d, part, job_meta, template)]


def _trainer_template(
    d: Deployment, svc: ServiceSpec, part: ServiceSpec, first: int, pod_labels: dict[str, str]
) -> Obj:
    """The pod template of `part`, the nodes of one GPU kind of trainer `svc` starting at
    node rank `first`."""
    port = d.dcfg.master_port
    env = rendezvous_env(master_addr(d, svc), port, svc.nodes, svc.gpus)
    if first:
        env.append({"name": NODE_RANK_OFFSET, "value": str(first)})
    spec = pod_spec(d, part, d.dcfg.images.trainer, d.dcfg.resources.trainer, svc.command, env)
    metrics = metrics_port(d, "trainer")
    spec["containers"][0]["ports"] = [
        {"name": "rendezvous", "containerPort": port},
        {"name": "metrics", "containerPort": metrics},  # rank 0 (pod index 0) serves it
    ]
    spec["restartPolicy"] = "Never"
    if d.dcfg.trainer.liveness_s is not None:
        # a row in metrics.jsonl after every step (rank 0 writes it to the shared volume,
        # so every pod of the gang sees a hung step); a killed pod fails the gang, which
        # the JobSet restarts from the newest checkpoint
        alive = ["alive", str(RunPaths.of(d.cfg).metrics), str(d.dcfg.trainer.liveness_s)]
        spec["containers"][0]["livenessProbe"] = probe_exec(alive, 60, 3, delay=60)
    affinity = placement_affinity(d, part, selector(pod_labels), one_per_node=svc.nodes > 1)
    if affinity is not None:
        spec["affinity"] = affinity
    return {
        "metadata": {"labels": pod_labels, "annotations": scrape_annotations(metrics)},
        "spec": spec,
    }


def _redis(d: Deployment) -> list[Obj]:
    name, port = f"{d.prefix}-redis", d.dcfg.redis.port
    pod_labels = labels(d, "redis")
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(d, name, "redis"),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": selector(pod_labels)},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    **_priority(d),
                    # 999: the official image's redis user
                    "securityContext": pod_security(999),
                    "containers": [_redis_container(d)],
                    "volumes": [
                        {
                            "name": "secrets",
                            "secret": {
                                "secretName": secret_name(d),
                                "defaultMode": 0o440,
                                "items": [{"key": "redis-password", "path": "redis-password"}],
                            },
                        }
                    ],
                },
            },
            "volumeClaimTemplates": [_redis_claim(d)],
        },
    }
    return [_service(d, name, "redis", port, selector(pod_labels)), sts]


def _priority(d: Deployment) -> Obj:
    return {"priorityClassName": d.dcfg.priority_class} if d.dcfg.priority_class else {}


def _redis_container(d: Deployment) -> Obj:
    port, res = d.dcfg.redis.port, d.dcfg.resources.redis
    # The password reaches redis-server on stdin (config file `-`, a here-document), not
    # its command line; `exec` makes the server PID 1, so SIGTERM shuts it down cleanly.
    start = (
        f"exec redis-server - --port {port} --appendonly yes --appendfsync everysec "
        "--dir /data <<EOF\nrequirepass $(cat /run/secrets/redis/redis-password)\nEOF\n"
    )
    ping = (
        'REDISCLI_AUTH="$(cat /run/secrets/redis/redis-password)" '
        f"redis-cli -p {port} ping | grep -q PONG"
    )
    probe = {"exec": {"command": ["sh", "-c", ping]}, "periodSeconds": 10, "timeoutSeconds": 5}
    return {
        "name": "redis",
        "image": d.dcfg.images.redis,
        "imagePullPolicy": d.dcfg.images.pull_policy,
        "command": ["sh", "-c", start],
        "ports": [{"name": "redis", "containerPort": port}],
        "resources": {
            "requests": {"cpu": res.cpu, "memory": res.memory},
            "limits": {"memory": res.memory_limit or res.memory},
        },
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6, "initialDelaySeconds": 30},
        "volumeMounts": [
            {"name": "redis-data", "mountPath": "/data"},
            {"name": "secrets", "mountPath": "/run/secrets/redis", "readOnly": True},
        ],
        "securityContext": {**container_security(), "readOnlyRootFilesystem": True},
    }


def _redis_claim(d: Deployment) -> Obj:
    spec: Obj = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": d.dcfg.redis.storage}},
    }
    if d.dcfg.storage.storage_class:
        spec["storageClassName"] = d.dcfg.storage.storage_class
    # labelled: the PVC the StatefulSet creates from it goes with a delete by the run's label
    return {"metadata": {"name": "redis-data", "labels": labels(d, "redis")}, "spec": spec}
