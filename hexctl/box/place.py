"""`areal-hex run CONFIG --plan PLAN run.box=NAME`, the processes: each inference server,
the trainer and each planned instance of a workflow task start inside their planned node
(namespace and CPU cgroup), each server bound to its node's address with its kind's batch
limit and threads. A task the controller calls (role reference or reward_model) served by
`areal-hex serve` is such a server too. Valkey and the controller stay in the launcher's
namespace, the spine: the head node of the cluster. The addresses in the run's config are
`hexctl/box/run_config.py`'s."""

from __future__ import annotations

import math

from areal_hex.config import ExperimentConfig
from hexctl.box.emulate import NodeState, load_state, node_argv
from hexctl.job.layout import Layout
from hexctl.launch.supervisor import ProcessSpec


def place_on_box(cfg: ExperimentConfig, layout: Layout, specs: list[ProcessSpec]) -> None:
    """Start the servers and the trainer inside their planned nodes."""
    assert cfg.run.box is not None
    state = load_state(cfg.run.box)
    services = {s.name: s for s in layout.services}
    for spec in specs:
        svc = services[spec.name]
        if not svc.node_names:
            continue  # unplanned (Valkey, the controller): the head node, the launcher's
        node = state.node(svc.node_names[0])
        # more threads than the node's quota only contend for it
        spec.env["OMP_NUM_THREADS"] = str(max(1, math.ceil(node.cpu)))
        # gloo (the trainer's ranks, and the weight-update group of
        # rollout.weight_sync=network) on the node's NIC: the host name resolves to an
        # address of the launcher's namespace, not the node's
        spec.env["GLOO_SOCKET_IFNAME"] = node.iface
        command = list(spec.command)
        if svc.role == "inference" or _serves(cfg, svc.task, command):
            at = command.index("serve") + 2  # after the config path: overrides
            command[at:at] = server_overrides(node, reward_model="--reward-model" in command)
        spec.command = node_argv(node, command)


def server_overrides(node: NodeState, reward_model: bool = False) -> list[str]:
    """A server's config overrides on `node`: bound to its address, its kind's batch
    limit, as many threads as its quota."""
    threads = max(1, math.ceil(node.cpu))
    out = [
        f"inference.host={node.address}",
        f"inference.max_running_requests={node.max_running_requests}",
        f"inference.num_threads={threads}",
    ]
    if reward_model:
        out.append(f"rollout.reward_model.num_threads={threads}")
    return out


def _serves(cfg: ExperimentConfig, task: str | None, command: list[str]) -> bool:
    """Whether a worker is a server task (reference, reward model) run by `areal-hex
    serve`: bound to its node's address as an inference server is."""
    spec = next((t for t in cfg.workflow.tasks if t.name == task), None)
    return spec is not None and spec.role != "custom" and "serve" in command
