"""The process layout of a job: which services run, how many, on which devices, with which
command. `areal-hex run` starts it as local processes; `areal-hex deploy` renders the same
layout as docker-compose services or Kubernetes objects.

Commands are the project's real CLI entry points; `{config}` stands for the resolved
config file wherever the layout is realised (a run directory, a ConfigMap mount).

The workflow's tasks beyond generate and train (`workflow.tasks`) become `worker`
services, one per instance, through one generic path (`task_services`): the launcher,
every deploy target and the box start them as they start any service, from the
`ServiceSpec` alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from areal_hex.config import ConfigError, ExperimentConfig, TaskSpec
from areal_hex.config.workflow import CONFIG_PLACEHOLDER, INDEX_PLACEHOLDER, PORT_PLACEHOLDER
from areal_hex.plan import Plan

# `worker`: an instance of a workflow task beyond generate and train (`workflow.tasks`)
Role = Literal["redis", "inference", "controller", "trainer", "worker"]
TP_KEY = "inference.sglang.tp_size"


@dataclass
class ServiceSpec:
    name: str
    role: Role
    command: list[str]
    gpu_kind: str | None = None  # None: CPU (or any GPU, for a local run)
    gpus: int = 0  # GPUs this service needs (inference: TP degree; trainer: per node)
    nodes: int = 1  # trainer only: nodes it spans
    port: int | None = None
    devices: list[int] = field(default_factory=list)  # local GPU ids, when planned
    env: dict[str, str] = field(default_factory=dict)
    # Planned node names (cluster-spec names) the service spans, in rank order; empty when
    # there is no plan. Deploy uses them to pin services and to check single-host targets.
    node_names: list[str] = field(default_factory=list)
    # Trainer across GPU kinds only: the kind of each node, in rank order (`gpu_kind` is
    # then the plan's label, "H800+H20"). Empty for a service of one kind.
    node_kinds: list[str] = field(default_factory=list)
    task: str | None = None  # a worker: its task's name (`workflow.tasks`)

    def kind_segments(self) -> list[tuple[str | None, int, int]]:
        """(GPU kind, first node, nodes) for each run of nodes of one kind, in rank order;
        one segment of `gpu_kind` for a service of one kind."""
        if not self.node_kinds:
            return [(self.gpu_kind, 0, self.nodes)]
        out: list[tuple[str | None, int, int]] = []
        for i, kind in enumerate(self.node_kinds):
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1], out[-1][2] + 1)
            else:
                out.append((kind, i, 1))
        return out


@dataclass
class Layout:
    services: list[ServiceSpec]

    def by_role(self, role: Role) -> list[ServiceSpec]:
        return [s for s in self.services if s.role == role]


def build_layout(cfg: ExperimentConfig, plan: Plan | None = None) -> Layout:
    """Services for `cfg`; with a plan, one inference service per planned instance and the
    trainer sized as planned, otherwise `cfg.inference.num_servers` local servers."""
    c = CONFIG_PLACEHOLDER
    services: list[ServiceSpec] = []
    if cfg.redis.url is None or cfg.run.embedded_redis:
        services.append(ServiceSpec("redis", "redis", ["areal-hex", "buffer", "serve", c]))
    if plan is None:
        for i in range(cfg.inference.num_servers):
            services.append(
                ServiceSpec(
                    name=f"inference-{i}",
                    role="inference",
                    command=["areal-hex", "serve", c, "--index", str(i)],
                    gpus=0 if cfg.inference.device == "cpu" else cfg.inference.sglang.tp_size,
                    port=cfg.inference.base_port + i,
                )
            )
        trainer_gpus = 0 if cfg.trainer.device == "cpu" else cfg.trainer.num_ranks
        trainer = ServiceSpec("trainer", "trainer", ["areal-hex", "train", c], gpus=trainer_gpus)
    else:
        for i, inst in enumerate(plan.rollout):
            # The planner picks TP per instance; the config holds one degree, so an
            # instance planned otherwise gets it as an override (before --index: argparse).
            tp = [] if inst.tp == cfg.inference.sglang.tp_size else [f"{TP_KEY}={inst.tp}"]
            services.append(
                ServiceSpec(
                    name=inst.id,
                    role="inference",
                    command=["areal-hex", "serve", c, *tp, "--index", str(i)],
                    gpu_kind=inst.gpu_kind,
                    gpus=inst.tp,
                    port=cfg.inference.base_port + i,
                    devices=list(inst.placement.gpu_ids),
                    node_names=[inst.placement.node],
                )
            )
        t = plan.trainer
        per_node = max(len(p.gpu_ids) for p in t.placements)
        trainer = ServiceSpec(
            "trainer",
            "trainer",
            ["areal-hex", "train", c],
            gpu_kind=t.gpu_kind,
            gpus=per_node,
            nodes=len(t.placements),
            devices=list(t.placements[0].gpu_ids),
            node_names=[p.node for p in t.placements],
            node_kinds=list(t.gpu_kinds) if t.mixed and t.gpu_kinds else [],
        )
    for task in cfg.workflow.tasks:
        services += task_services(task, plan)
    services.append(ServiceSpec("controller", "controller", ["areal-hex", "rollout", c]))
    services.append(trainer)
    return Layout(services)


def task_services(task: TaskSpec, plan: Plan | None) -> list[ServiceSpec]:
    """One `worker` service per instance of `task`; with a plan, each on its planned slot
    (`plan.decisions.tasks`), which a GPU task must have."""
    placed = None if plan is None else plan.decisions.task(task.name)
    if plan is not None and task.gpus > 0 and placed is None:
        planned = ", ".join(t.task for t in plan.decisions.tasks) or "none"
        raise ConfigError(
            f"workflow.tasks: task {task.name!r} needs {task.gpus} GPU(s) an instance but "
            f"the plan places no such task (its tasks: {planned}): expected a plan made "
            "with this task in its workload (`tasks:`)"
        )
    if placed is not None and len(placed.slots) != task.instances:
        raise ConfigError(
            f"workflow.tasks: task {task.name!r} has {task.instances} instance(s) but the "
            f"plan placed {len(placed.slots)}: expected the counts to agree"
        )
    out = []
    for i in range(task.instances):
        port = None if task.port is None else task.port + i
        argv = [
            a.replace(INDEX_PLACEHOLDER, str(i)).replace(PORT_PLACEHOLDER, str(port))
            for a in task.command
        ]
        slot = None if placed is None else placed.slots[i]
        out.append(
            ServiceSpec(
                name=f"{task.name}-{i}",
                role="worker",
                command=argv,
                gpu_kind=None if placed is None else placed.gpu_kind,
                gpus=task.gpus,
                port=port,
                devices=[] if slot is None else list(slot.gpu_ids),
                node_names=[] if slot is None else [slot.node],
                task=task.name,
            )
        )
    return out
