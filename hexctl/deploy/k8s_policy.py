"""Who may reach the run's pods, whom they may reach, and what a drain may evict:
NetworkPolicies (ingress by role, egress as compose has it) and PodDisruptionBudgets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from hexctl.deploy.common import Deployment
from hexctl.deploy.k8s_pods import labels, meta, metrics_port, selector

Obj = dict[str, Any]


def scrape_all(ports: list[Obj], scrape: Callable[[int], list[Obj]]) -> list[Obj]:
    return [rule for p in ports for rule in scrape(p["port"])]


def network_policies(d: Deployment) -> list[Obj]:
    inst = labels(d, "x")["app.kubernetes.io/instance"]
    job_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": inst}}}

    def policy(name: str, component: str | None, ingress: list[Obj]) -> Obj:
        sel = {"app.kubernetes.io/instance": inst}
        if component:
            sel["app.kubernetes.io/component"] = component
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(d, f"{d.prefix}-{name}", "network"),
            "spec": {
                "podSelector": {"matchLabels": sel},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }

    inf_ports = [{"protocol": "TCP", "port": s.port} for s in d.layout.by_role("inference")]

    def pods(component: str) -> Obj:
        sel = {"app.kubernetes.io/instance": inst, "app.kubernetes.io/component": component}
        return {"podSelector": {"matchLabels": sel}}

    def scrape(port: int) -> list[Obj]:
        ns = d.dcfg.metrics.prometheus_namespace
        if ns is None:
            return []
        who = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
        return [{"from": [who], "ports": [{"protocol": "TCP", "port": port}]}]

    out = [
        # Default: nothing reaches this job's pods ...
        policy("deny-ingress", None, []),
        # ... but the controller reaches the servers (generation, and the weight-update
        # calls: weights travel over the shared volume, announced over HTTP),
        policy(
            "inference",
            "inference",
            [{"from": [pods("controller")], "ports": inf_ports}, *scrape_all(inf_ports, scrape)],
        ),
        # trainer ranks reach each other (rendezvous, NCCL),
        policy(
            "trainer",
            "trainer",
            [{"from": [pods("trainer")]}, *scrape(metrics_port(d, "trainer"))],
        ),
        # and Prometheus (if named) reaches the metrics ports.
        policy("controller", "controller", scrape(metrics_port(d, "controller"))),
    ]
    if d.dcfg.redis.mode == "internal":
        port = [{"protocol": "TCP", "port": d.dcfg.redis.port}]
        out.append(policy("redis", "redis", [{"from": [job_pods], "ports": port}]))
    return out + _egress_policies(d, inst)


def _egress_policies(d: Deployment, inst: str) -> list[Obj]:
    """Egress as compose has it: the run's pods reach each other and DNS only; the
    prepare job (it downloads the model) and the controller (the dataset) reach anything;
    the reaper reaches the API server; an external Redis is reached on its port."""
    dns = [{"protocol": p, "port": 53} for p in ("UDP", "TCP")]
    rules: list[Obj] = [
        {"to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": inst}}}]},
        {"ports": dns},
    ]
    if d.dcfg.redis.mode == "external":
        port = urlsplit(d.cfg.redis.url or "").port or 6379
        rules.append({"ports": [{"protocol": "TCP", "port": port}]})

    def policy(name: str, components: list[str] | None, egress: list[Obj]) -> Obj:
        sel: Obj = {"matchLabels": {"app.kubernetes.io/instance": inst}}
        if components:
            key = "app.kubernetes.io/component"
            sel["matchExpressions"] = [{"key": key, "operator": "In", "values": components}]
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(d, f"{d.prefix}-{name}", "network"),
            "spec": {"podSelector": sel, "policyTypes": ["Egress"], "egress": egress},
        }

    # The API server's address is not known in advance (nor always a pod or a Service
    # address a policy can name): its usual ports, to any address.
    api = [{"protocol": "TCP", "port": p} for p in (443, 6443)]
    return [
        policy("egress", None, rules),
        policy("egress-downloads", ["prepare", "controller"], [{}]),
        policy("egress-api", ["lifecycle"], [{"ports": api}]),
    ]


def disruption_budgets(d: Deployment) -> list[Obj]:
    """A drain may not evict a trainer pod (it would fail the gang and redo the steps
    since the last checkpoint) nor Redis, and evicts inference servers one at a time
    (the controller sends their work to the others meanwhile)."""

    def pdb(component: str, max_unavailable: int) -> Obj:
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta(d, f"{d.prefix}-{component}-pdb", "disruption"),
            "spec": {
                "maxUnavailable": max_unavailable,
                "selector": {"matchLabels": selector(labels(d, component))},
            },
        }

    out = [pdb("trainer", 0), pdb("inference", 1)]
    if d.dcfg.redis.mode == "internal":
        out.append(pdb("redis", 0))
    return out
