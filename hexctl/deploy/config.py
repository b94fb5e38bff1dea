"""How `areal-hex deploy` renders a job for docker-compose or Kubernetes.

Kept out of the experiment config on purpose: the same experiment runs locally
(`areal-hex run`) or on a cluster, and only the deployment knows images, namespaces and
storage. Loaded from an optional YAML (`--deploy-config`) plus a few CLI flags.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from areal_hex.config.base import Section
from areal_hex.config.redis import check_redis_url

# RFC 1123 label: what Kubernetes accepts for namespaces; Service names also need a
# leading letter (RFC 1035), and every object name starts with `name`.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def check_image(ref: str) -> str:
    """An image reference with its registry and a fixed version: `host/repo:tag` (not
    `latest`) or `host/repo@sha256:...`. A bare `redis:7` depends on each node's registry
    search order, and a moving tag on when a node last pulled."""
    name, _, digest = ref.partition("@")
    head = name.split("/", 1)[0]
    if "/" not in name or not ("." in head or ":" in head or head == "localhost"):
        hub = f"docker.io/{ref}" if "/" in name else f"docker.io/library/{ref}"
        raise ValueError(
            f"image {ref!r} names no registry: expected e.g. {hub} or registry.example.com/{ref}"
        )
    last = name.rsplit("/", 1)[1]
    tag = last.partition(":")[2]
    if digest:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ValueError(f"image {ref!r}: expected a digest sha256:<64 hex digits>")
    elif not tag or tag == "latest":
        raise ValueError(f"image {ref!r}: expected a fixed tag (not 'latest') or a digest")
    return ref


Image = Annotated[str, AfterValidator(check_image)]


class ImagesConfig(Section):
    # Images built from deploy/docker/ (README there); `localhost/` is what a local build
    # is tagged as: push them to the cluster's registry and name that here (or
    # `kustomize edit set image` on the rendered base).
    # SGLang base image + areal-hex (Dockerfile.inference).
    inference: Image = "localhost/areal-hex/inference:0.1.0"
    # CUDA + DeepSpeed + areal-hex (Dockerfile.trainer).
    trainer: Image = "localhost/areal-hex/trainer:0.1.0"
    # The controller needs no GPU: the CPU image (Dockerfile.cpu).
    controller: Image = "localhost/areal-hex/cpu:0.1.0"
    redis: Image = "docker.io/library/redis:7.4.2-alpine"
    # compose only, with metrics.compose_prometheus
    prometheus: Image = "docker.io/prom/prometheus:v2.53.2"
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class MetricsDeployConfig(Section):
    """Prometheus scraping of every service (docs/observability.md)."""

    # /metrics ports of trainer rank 0 and the controller when the config leaves
    # trainer.metrics_port / rollout.metrics_port unset (or 0: a free port cannot be
    # scraped); inference servers serve /metrics on their own port.
    trainer_port: int = Field(9400, gt=0, lt=65536)
    controller_port: int = Field(9401, gt=0, lt=65536)
    # k8s: the namespace Prometheus runs in; the NetworkPolicy admits it to the metrics
    # ports (pods carry prometheus.io/scrape annotations). None: no such rule.
    prometheus_namespace: str | None = Field("monitoring", pattern=DNS_LABEL)
    # compose: add a Prometheus service scraping every service, on 127.0.0.1:<port>.
    compose_prometheus: bool = False
    prometheus_port: int = Field(9090, gt=0, lt=65536)


CPU_QUANTITY = r"^[0-9]+(\.[0-9]+)?m?$"  # 4, 0.5, 500m
MEMORY_QUANTITY = r"^[0-9]+([KMGT]i?)?$"  # 16Gi, 512Mi, 1G, 1073741824


class Resources(Section):
    """Per-container CPU/memory (Kubernetes quantities); GPUs come from the plan.

    For inference servers and trainer pods every quantity is *per GPU* of the pod, so a
    TP-8 server gets 8 times what a TP-1 server gets. The memory-backed `/dev/shm` is
    added on top of `memory` in the request and the limit: what a process writes there
    counts against the container's memory, so it must not eat the processes' share."""

    cpu: str = Field("4", pattern=CPU_QUANTITY)
    memory: str = Field("16Gi", pattern=MEMORY_QUANTITY)
    # None: no CPU limit (throttling hurts tokenizers/NCCL)
    cpu_limit: str | None = Field(None, pattern=CPU_QUANTITY)
    memory_limit: str | None = Field(None, pattern=MEMORY_QUANTITY)  # None: = memory
    # /dev/shm size (NCCL, SGLang and DataLoader workers use it)
    shm: str = Field("16Gi", pattern=MEMORY_QUANTITY)


class ResourcesConfig(Section):
    # per GPU: a TP-1 server 4 CPUs and 32 + 8 GiB, a TP-8 one 32 CPUs and 320 GiB
    inference: Resources = Resources(cpu="4", memory="32Gi", shm="8Gi")
    # per GPU: an 8-GPU trainer pod 48 CPUs and 8 x (32 + 8) GiB
    trainer: Resources = Resources(cpu="6", memory="32Gi", shm="8Gi")
    controller: Resources = Resources(cpu="4", memory="8Gi", shm="1Gi")
    redis: Resources = Resources(cpu="2", memory="8Gi", shm="64Mi")
    # The one-shot job that writes v0 (loads the model on CPU: memory ~ 2-4x its size).
    prepare: Resources = Resources(cpu="4", memory="64Gi", shm="1Gi")


class RedisDeployConfig(Section):
    # internal: a Redis StatefulSet (k8s) / service (compose) with append-only persistence;
    # external: `url` (credentials stay out of it: the password goes to the Secret).
    mode: Literal["internal", "external"] = "internal"
    url: str | None = None
    port: int = Field(6379, gt=0, lt=65536)
    storage: str = "20Gi"

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        return check_redis_url(v)


class StorageConfig(Section):
    # Shared weights/run volume, mounted at `mount_path` in every pod (ReadWriteMany).
    existing_claim: str | None = None  # use this PVC instead of creating one
    storage_class: str | None = None  # None: the cluster's default class
    size: str = "500Gi"
    mount_path: str = "/data"


class NodeMatch(Section):
    """The Kubernetes node(s) a plan node stands for: its hostname, and/or labels it
    carries (a rack, a block, a zone: `topology.kubernetes.io/zone`)."""

    hostname: str | None = None  # value of kubernetes.io/hostname
    labels: dict[str, str] = {}

    @model_validator(mode="after")
    def _something(self) -> NodeMatch:
        if self.hostname is None and not self.labels:
            raise ValueError("expected a hostname or labels")
        return self


class TrainerDeployConfig(Section):
    # jobset: a JobSet (jobset.x-k8s.io/v1alpha2; needs the JobSet controller) restarts
    # every rank together when one fails, resuming from the newest checkpoint on the
    # shared volume; indexed-job: a plain Indexed Job (any cluster), which fails after
    # `backoff_limit` pod failures and is not restarted as a group.
    gang: Literal["jobset", "indexed-job"] = "jobset"
    max_restarts: int = Field(3, ge=0)  # jobset: whole-group restarts before it fails
    backoff_limit: int = Field(2, ge=0)  # indexed-job: pod failures before the Job fails
    # Liveness: the trainer appends a row to `<run_dir>/metrics.jsonl` after every step;
    # a pod is restarted (with JobSet: the whole gang) when the file is older than this
    # many seconds, or counted from the pod's start while the first step is still to
    # come. Above the longest step plus a checkpoint; None: no liveness probe.
    liveness_s: int | None = Field(1800, ge=60)


class DeployConfig(Section):
    namespace: str = Field("areal-hex", pattern=DNS_LABEL, max_length=63)
    # Render the Namespace (labelled for the "restricted" Pod Security Standard). Off by
    # default: a namespace holds many runs, and `kubectl delete -k` of one run's folder
    # would delete a namespace it rendered with every other run in it.
    create_namespace: bool = False
    # Readable part of every object name (a hash of the run id follows it); None: the
    # run id itself.
    name: str | None = Field(None, pattern=DNS_1035_LABEL, max_length=20)
    images: ImagesConfig = ImagesConfig()
    metrics: MetricsDeployConfig = MetricsDeployConfig()
    resources: ResourcesConfig = ResourcesConfig()
    redis: RedisDeployConfig = RedisDeployConfig()
    storage: StorageConfig = StorageConfig()
    # Node label that tells GPU kinds apart, and its value per planned kind (merged over
    # the built-in table in hexctl/deploy/names.py, e.g. {"H20": "NVIDIA-H20"}).
    gpu_label_key: str = "nvidia.com/gpu.product"
    gpu_labels: dict[str, str] = {}
    # Plan node name -> the Kubernetes node(s) it stands for. Each inference pod then runs
    # where the plan put it, and the trainer's pods only on its planned machines, one
    # pod per machine (node affinity + pod anti-affinity). Empty: GPU kind only.
    placement: dict[str, NodeMatch] = {}
    # Shorthand for a placement where plan node names are the nodes' hostnames.
    pin_nodes: bool = False
    trainer: TrainerDeployConfig = TrainerDeployConfig()
    # Kueue LocalQueue for the trainer (label kueue.x-k8s.io/queue-name); None: no Kueue.
    kueue_queue: str | None = Field(None, pattern=DNS_LABEL, max_length=63)
    # PriorityClass of every pod of the run (it must exist in the cluster); None: the
    # cluster's default.
    priority_class: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    # Use an existing Secret (keys `redis-password`, `api-token`) instead of rendering one.
    existing_secret: str | None = None
    master_port: int = Field(29500, gt=0, lt=65536)  # torch.distributed rendezvous
    uid: int = Field(1000, gt=0)  # non-root user the areal-hex images run as
