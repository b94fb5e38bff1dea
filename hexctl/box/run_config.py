"""`areal-hex run CONFIG --plan PLAN run.box=NAME`, the config: a plan run across the
nodes of a box (`hexctl/box/emulate.py`), written into the run's config.yaml.

Valkey binds the box's spine address and every service reaches it there, over its
node's NIC and rack uplink; the controller reaches inference server i, and instance i
of each server task the plan placed (a reference, a reward model), at its node's
address. The plan must place the trainer on one node (a multi-node DeepSpeed launch is
not emulated) and name only nodes the box has. Where the processes start is
`hexctl/box/place.py`'s.
"""

from __future__ import annotations

from areal_hex.config import ExperimentConfig
from areal_hex.errors import UsageError
from areal_hex.plan import Plan
from hexctl.box.emulate import BoxState, load_state


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
    tasks = [s.node for t in plan.decisions.tasks for s in t.slots]
    nodes = [i.placement.node for i in plan.rollout] + [plan.trainer.placements[0].node]
    for node in nodes + tasks:
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
    for task in cfg.workflow.tasks:
        placed = plan.decisions.task(task.name)
        if placed is None or task.port is None or task.urls:
            continue  # on the head node (CPU), or addressed by the config
        task.urls = [
            f"http://{state.node(slot.node).address}:{task.port + i}"
            for i, slot in enumerate(placed.slots)
        ]
