"""How `areal-hex deploy` renders a job for docker-compose or Kubernetes.

Kept out of the experiment config on purpose: the same experiment runs locally
(`areal-hex run`) or on a cluster, and only the deployment knows images, namespaces and
storage. Loaded from an optional YAML (`--deploy-config`) plus a few CLI flags.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from areal_hex.config.base import Section

# RFC 1123 label: what Kubernetes accepts for namespaces; Service names also need a
# leading letter (RFC 1035), and every object name starts with `name`.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ImagesConfig(Section):
    # SGLang base image + areal-hex (deploy/docker/Dockerfile.inference).
    inference: str = "areal-hex/inference:0.1.0"
    # CUDA + DeepSpeed + areal-hex (deploy/docker/Dockerfile.trainer).
    trainer: str = "areal-hex/trainer:0.1.0"
    # The controller needs no GPU: the CPU image (deploy/docker/Dockerfile.cpu).
    controller: str = "areal-hex/cpu:0.1.0"
    redis: str = "redis:7.4-alpine"
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class Resources(Section):
    """Per-container CPU/memory (Kubernetes quantities); GPUs come from the plan."""

    cpu: str = "4"
    memory: str = "16Gi"
    cpu_limit: str | None = None  # None: no CPU limit (throttling hurts tokenizers/NCCL)
    memory_limit: str | None = None  # None: same as the request
    shm: str = "16Gi"  # /dev/shm size (NCCL, SGLang and DataLoader workers use it)


class ResourcesConfig(Section):
    inference: Resources = Resources(cpu="8", memory="64Gi", shm="32Gi")
    trainer: Resources = Resources(cpu="16", memory="200Gi", shm="64Gi")
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
        if v is not None and not v.startswith(("redis://", "rediss://")):
            raise ValueError("expected a redis:// or rediss:// URL")
        return v


class StorageConfig(Section):
    # Shared weights/run volume, mounted at `mount_path` in every pod (ReadWriteMany).
    existing_claim: str | None = None  # use this PVC instead of creating one
    storage_class: str | None = None  # None: the cluster's default class
    size: str = "500Gi"
    mount_path: str = "/data"


class DeployConfig(Section):
    namespace: str = Field("areal-hex", pattern=DNS_LABEL, max_length=63)
    # Render the Namespace (labelled for the "restricted" Pod Security Standard); off to
    # deploy into an existing namespace that someone else manages.
    create_namespace: bool = True
    # Prefix of every object name; None: derived from run.name.
    name: str | None = Field(None, pattern=DNS_1035_LABEL, max_length=40)
    images: ImagesConfig = ImagesConfig()
    resources: ResourcesConfig = ResourcesConfig()
    redis: RedisDeployConfig = RedisDeployConfig()
    storage: StorageConfig = StorageConfig()
    # Node label that tells GPU kinds apart, and its value per planned kind (merged over
    # the built-in table in areal_hex/deploy/common.py, e.g. {"H20": "NVIDIA-H20"}).
    gpu_label_key: str = "nvidia.com/gpu.product"
    gpu_labels: dict[str, str] = {}
    # Pin each service to the node named in the plan (kubernetes.io/hostname); off by
    # default because plan node names come from the cluster spec, not from Kubernetes.
    pin_nodes: bool = False
    # Use an existing Secret (keys `redis-password`, `api-token`) instead of rendering one.
    existing_secret: str | None = None
    master_port: int = Field(29500, gt=0, lt=65536)  # torch.distributed rendezvous
    uid: int = Field(1000, gt=0)  # non-root user the areal-hex images run as
    trainer_backoff_limit: int = Field(2, ge=0)
