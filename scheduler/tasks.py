"""The tasks of a workflow beyond generate and train (`workflow.tasks`, a workload's
`tasks`): devices set aside for each before the MILP sizes the two pools on the rest.

One generic path for any task: every instance of a task needs `gpus` GPUs of one of its
`gpu_kinds` on one machine; instances are packed onto the chosen group's last machines
(a later task on the same group first fills the GPUs an earlier one left on its last
machine), which leave the inventory the MILP plans (their GPUs' price leaves the budget).
A task of 0 GPUs is a CPU task: it is started wherever the job's CPU services run and
needs no slot. Which group a priced task (reference, reward model) takes is chosen by
its cost (`scheduler/task_graph.py`) and passed in; the others take the cheapest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_hex.config import ConfigError
from areal_hex.config.workflow import TaskSpec
from areal_hex.plan import DeviceSlot, TaskPlacement
from scheduler.cluster import Cluster, ClusterSpec, NodeGroup, Rack, machine_name, make_cluster


@dataclass
class Reserved:
    cluster: Cluster  # what is left for generate and train
    placements: list[TaskPlacement] = field(default_factory=list)
    usd_per_h: float = 0.0  # the reserved GPUs' price


def reserve_tasks(
    cl: Cluster, tasks: list[TaskSpec], groups: dict[str, str] | None = None
) -> Reserved:
    """Set machines aside for every GPU task, on the node group `groups` names for it
    (else its cheapest allowed one); `cl` unchanged when there is none. A task whose
    group holds an earlier task's machine with GPUs to spare fills them first."""
    gpu_tasks = [t for t in tasks if t.gpus > 0]
    if not gpu_tasks:
        return Reserved(cl)
    left = {g.name: g.nodes for g in cl.spec.node_groups}
    spare: dict[str, tuple[int, int]] = {}  # group -> (its open machine, first free GPU)
    placements, cost = [], 0.0
    for task in gpu_tasks:
        group = _cheapest_group(cl, task, left, spare, (groups or {}).get(task.name))
        open_at, free = spare.get(group.name, (-1, group.gpus_per_node))
        on_open = (group.gpus_per_node - free) // task.gpus
        per_node = group.gpus_per_node // task.gpus
        first = left[group.name] - -(-max(0, task.instances - on_open) // per_node)
        machine, slots = open_at, []
        for _ in range(task.instances):
            if free + task.gpus > group.gpus_per_node:  # the open machine is full
                machine = first if machine == open_at else machine + 1
                free = 0
            ids = list(range(free, free + task.gpus))
            slots.append(DeviceSlot(node=machine_name(group.name, machine), gpu_ids=ids))
            free += task.gpus
        left[group.name] = min(left[group.name], first)
        spare[group.name] = (machine, free)
        cost += task.instances * task.gpus * group.usd_per_gpu_hour
        placements.append(TaskPlacement(task=task.name, gpu_kind=group.gpu, slots=slots))
    spec = _shrunk(cl.spec, left)
    return Reserved(make_cluster(spec, cl.spec.name), placements, cost)


def _cheapest_group(
    cl: Cluster,
    task: TaskSpec,
    left: dict[str, int],
    spare: dict[str, tuple[int, int]],
    only: str | None = None,
) -> NodeGroup:
    def room(g: NodeGroup) -> int:
        """Instances the group still holds: its open machine's spare GPUs, then whole
        machines."""
        free = spare.get(g.name, (-1, g.gpus_per_node))[1]
        return (g.gpus_per_node - free) // task.gpus + left[g.name] * (g.gpus_per_node // task.gpus)

    fits = [
        g
        for g in cl.spec.node_groups
        if (task.gpu_kinds is None or g.gpu in task.gpu_kinds)
        and (only is None or g.name == only)
        and g.gpus_per_node >= task.gpus
        and room(g) >= task.instances
    ]
    if not fits:
        kinds = "any kind" if task.gpu_kinds is None else f"kinds {', '.join(task.gpu_kinds)}"
        kinds += "" if only is None else f" in node group {only!r}"
        raise ConfigError(
            f"task {task.name!r}: {task.instances} instance(s) of {task.gpus} GPU(s) on "
            f"{kinds} do not fit cluster {cl.spec.name!r} beside the generation and "
            "training pools: expected a node group of that kind with enough machines left"
        )
    return min(fits, key=lambda g: (g.usd_per_gpu_hour, g.name))


def _shrunk(spec: ClusterSpec, left: dict[str, int]) -> ClusterSpec:
    """`spec` with each node group cut to its first `left[group]` machines (names kept),
    and racks cut to the machines that remain."""
    groups = [
        g.model_copy(update={"nodes": left[g.name]}) for g in spec.node_groups if left[g.name]
    ]
    if not groups:
        raise ConfigError(
            f"the tasks of the workflow take every machine of cluster {spec.name!r}: expected "
            "machines left for the generation and training pools"
        )
    racks: list[Rack] = []
    for rack in spec.racks:
        members = []
        for m in rack.members:
            count = min(m.count, left[m.group] - m.first)
            if count > 0:
                members.append(m.model_copy(update={"count": count}))
        if members:
            racks.append(rack.model_copy(update={"members": members}))
    return spec.model_copy(update={"node_groups": groups, "racks": racks})
