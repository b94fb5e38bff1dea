"""`areal-hex run CONFIG --plan PLAN run.box=NAME`: a plan run across the nodes of a box.

Two steps, one on each side of the run's config.yaml:

1. `apply_box` (before the config is written): Valkey binds the box's spine address and
   every service reaches it there, over its node's NIC and rack uplink; the controller
   reaches inference server i at its node's address. The plan must place the trainer on
   one node (a multi-node DeepSpeed launch is not emulated) and name only nodes the box
   has.
2. `place_on_box` (on the process list): each inference server and the trainer start
   inside their planned node (namespace and CPU cgroup), each server bound to its node's
   address with its kind's batch limit. Valkey and the controller stay in the launcher's
   namespace, the spine: the head node of the cluster.
"""

from __future__ import annotations

import math

from areal_hex.config import ExperimentConfig
from areal_hex.errors import UsageError
from areal_hex.launch.box import BoxState, load_state, node_argv
from areal_hex.launch.supervisor import ProcessSpec
from areal_hex.layout import Layout
from areal_hex.plan import Plan


def box_state(cfg: ExperimentConfig, plan: Plan | None) -> BoxState:
    """The box `run.box` names, checked against the plan that is to run on it."""
    assert cfg.run.box is not None
    if plan is None:
        raise UsageError("run.box needs --plan: the plan says which node runs each service")
    if cfg.run.pin_cores:
        raise UsageError(
            "run.box gives each service its node's CPU quota; run.pin_cores=true would pin "
            "them to cores as well: set run.pin_cores=false"
        )
    state = load_state(cfg.run.box)
    if len(plan.trainer.placements) != 1:
        nodes = ", ".join(p.node for p in plan.trainer.placements)
        raise UsageError(f"the plan's trainer spans nodes {nodes}; on a box it must use one node")
    for node in [i.placement.node for i in plan.rollout] + [plan.trainer.placements[0].node]:
        state.node(node)  # UsageError naming the box's nodes
    return state


def apply_box(cfg: ExperimentConfig, plan: Plan | None) -> None:
    """Addresses for a run on the box (before config.yaml is written)."""
    state = box_state(cfg, plan)
    assert plan is not None
    if cfg.run.embedded_redis:
        cfg.redis.bind = state.host_address
        cfg.redis.url = f"redis://{state.host_address}:{cfg.redis.port}/0"
    port = cfg.inference.base_port
    cfg.inference.server_urls = [
        f"http://{state.node(inst.placement.node).address}:{port + i}"
        for i, inst in enumerate(plan.rollout)
    ]
    cfg.inference.gpu_kinds = [inst.gpu_kind for inst in plan.rollout]


def place_on_box(cfg: ExperimentConfig, layout: Layout, specs: list[ProcessSpec]) -> None:
    """Start the servers and the trainer inside their planned nodes."""
    assert cfg.run.box is not None
    state = load_state(cfg.run.box)
    services = {s.name: s for s in layout.services}
    for spec in specs:
        svc = services[spec.name]
        if svc.role not in ("inference", "trainer"):
            continue  # the head node: the launcher's namespace
        node = state.node(svc.node_names[0])
        # more threads than the node's quota only contend for it
        spec.env["OMP_NUM_THREADS"] = str(max(1, math.ceil(node.cpu)))
        command = list(spec.command)
        if svc.role == "inference":
            at = command.index("serve") + 2  # after the config path: overrides
            command[at:at] = [
                f"inference.host={node.address}",
                f"inference.max_running_requests={node.max_running_requests}",
                f"inference.num_threads={max(1, math.ceil(node.cpu))}",
            ]
        spec.command = node_argv(node, command)
