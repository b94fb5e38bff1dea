"""The trainer on Kubernetes: one pod per planned node, `trainer.num_ranks` ranks each,
joined by torch.distributed's static rendezvous; and where the plan put every pod.

Two forms (`trainer.gang` of the deploy config):
- `jobset` (default): a JobSet (jobset.x-k8s.io/v1alpha2) around one Indexed Job. Any
  failed pod fails the Job (backoffLimit 0) and the JobSet restarts the whole group, up
  to `max_restarts` times; the ranks come back with `trainer.resume=auto` and continue
  from the newest checkpoint on the shared volume, and unacknowledged groups are
  redelivered by the buffer. The JobSet gives pods stable DNS names (its headless
  Service) for the rendezvous.
- `indexed-job`: the same pods as a plain Indexed Job with our own headless Service, for
  clusters without the JobSet controller; a failed pod is retried alone up to
  `backoff_limit` times, which a static rendezvous does not survive.

A trainer across GPU kinds (heterogeneous data parallelism) is a JobSet with one
replicated job per kind, in rank order: each pinned to its kind's machines, its pods'
node rank their completion index plus the nodes of the jobs before it
(`AREAL_HEX_NODE_RANK_OFFSET`, added by `areal-hex train`), so every rank's
`trainer.rank_speeds` entry is the speed of the GPU it runs on.
"""

from __future__ import annotations

from typing import Any

from hexctl.deploy.common import Deployment, node_match
from hexctl.deploy.config import NodeMatch
from hexctl.deploy.names import service_name
from hexctl.job.layout import ServiceSpec

Obj = dict[str, Any]
HOSTNAME = "kubernetes.io/hostname"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "ranks"  # the JobSet's first replicated job (the only one for one kind)
NODE_RANK_OFFSET = "AREAL_HEX_NODE_RANK_OFFSET"  # nodes of the replicated jobs before this
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"


def rendezvous_env(master_addr: str, port: int, nodes: int, per_node: int) -> list[Obj]:
    """torch.distributed static rendezvous for `areal-hex train` on every trainer pod.

    The pod's index in its Indexed Job is its node rank; rank 0's pod has a DNS name known
    before it starts (`master_addr`). The `PET_*` names are torchrun's own environment
    form of --nnodes/--node-rank/--master-addr/--master-port, so the launcher
    `areal-hex train` starts picks them up.
    """
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    rank = {"valueFrom": {"fieldRef": {"fieldPath": index}}}
    env: list[Obj] = []
    for prefix in ("", "PET_"):
        env += [
            {"name": f"{prefix}MASTER_ADDR", "value": master_addr},
            {"name": f"{prefix}MASTER_PORT", "value": str(port)},
            {"name": f"{prefix}NNODES", "value": str(nodes)},
            {"name": f"{prefix}NODE_RANK", **rank},
        ]
    env.append({"name": "NPROC_PER_NODE", "value": str(per_node)})
    return env


def master_addr(d: Deployment, svc: ServiceSpec) -> str:
    """DNS name of the pod with index 0: `<job>-0.<service>` for an Indexed Job with a
    subdomain; `<jobset>-<replicated job>-0-0.<jobset>` for a JobSet."""
    name = service_name(d.prefix, svc)
    if d.dcfg.trainer.gang == "jobset":
        return f"{name}-{REPLICATED_JOB}-0-0.{name}"
    return f"{name}-0.{name}"


def node_term(match: NodeMatch) -> Obj:
    """One nodeSelectorTerm: the hostname and every label must match."""
    exprs = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(match.labels.items())]
    if match.hostname is not None:
        exprs.insert(0, {"key": HOSTNAME, "operator": "In", "values": [match.hostname]})
    return {"matchExpressions": exprs}


def placement_affinity(
    d: Deployment, svc: ServiceSpec, pod_labels: dict[str, str], one_per_node: bool = False
) -> Obj | None:
    """Node affinity to the machines the plan put `svc` on (any of them, for a trainer
    spanning several); with `one_per_node` (a multi-node trainer), also one pod of
    `pod_labels` per machine. None when the deploy config maps no plan node."""
    matches = [m for n in svc.node_names if (m := node_match(d.dcfg, n)) is not None]
    if not matches:
        return None
    terms = [node_term(m) for m in matches]
    unique = [t for i, t in enumerate(terms) if t not in terms[:i]]
    out: Obj = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": unique}
        }
    }
    if one_per_node:
        same = {"labelSelector": {"matchLabels": pod_labels}, "topologyKey": HOSTNAME}
        out["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [same]}
    return out


def indexed_job(d: Deployment, svc: ServiceSpec, meta: Obj, pod_template: Obj) -> Obj:
    nodes = svc.nodes
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": d.dcfg.trainer.backoff_limit,
            "template": pod_template,
        },
    }


def jobset(d: Deployment, meta: Obj, parts: list[tuple[ServiceSpec, Obj]]) -> Obj:
    """One replicated job per (nodes of one kind, pod template), in rank order."""
    name = meta["name"]
    jobs = []
    for i, (part, template) in enumerate(parts):
        job_spec = {
            "completionMode": "Indexed",
            "completions": part.nodes,
            "parallelism": part.nodes,
            "backoffLimit": 0,  # one failed rank fails the Job: the JobSet restarts them all
            "template": template,
        }
        rjob = REPLICATED_JOB if i == 0 else f"{REPLICATED_JOB}-{i}"
        jobs.append({"name": rjob, "replicas": 1, "template": {"spec": job_spec}})
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "failurePolicy": {"maxRestarts": d.dcfg.trainer.max_restarts},
            # stable pod DNS names under a headless Service the JobSet creates
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "replicatedJobs": jobs,
        },
    }


def headless_service(d: Deployment, meta: Obj, selector: dict[str, str]) -> Obj:
    """Pod DNS names for the Indexed Job (the JobSet makes its own)."""
    port = d.dcfg.master_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "rendezvous", "port": port, "targetPort": port}],
        },
    }
