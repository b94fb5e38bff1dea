"""Which of this machine's CPUs each busy box node runs on.

A node stands for a machine of its own, whose process keeps its core and that core's
caches. Emulated, a node is a CPU quota; left to float, its threads move to whichever
CPU is free each time the quota lets them run again, and once other nodes are busy that
is often another CPU than the last. Measured on a 2-vCPU host (docs/fidelity.md, "A
node's CPU, pinned"), a floating trainer node did a quarter to a third less work per CPU
second beside two busy servers than it did pinned, while the profile, which times each
kind alone, sees it on one CPU. So the nodes a run uses, and the node a profile times,
are each pinned to their share of the CPUs (`pack`): the quotas spread over the CPUs,
heaviest first, each node on the least-loaded ones. Valkey, the controller and the
launcher (the head node) are not pinned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

from hexctl.box.emulate import NodeState

# Above this much quota on one CPU the nodes there would wait for each other, where
# floating they could use the CPUs' spare: then nothing is pinned.
MAX_CPU_LOAD = 1.0


def machine_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pack(nodes: Iterable[NodeState], cpus: Sequence[int] | None = None) -> dict[str, list[int]]:
    """Node name -> the CPUs it runs on: heaviest quota first, each node on the
    ceil(quota) least-loaded CPUs (the lowest number on a tie), its quota spread over
    them. {} (every node floats) where there is one CPU, or where a CPU would carry more
    than `MAX_CPU_LOAD` cores of quota."""
    cpus = list(machine_cpus() if cpus is None else cpus)
    unique = {n.name: n for n in nodes}
    if len(cpus) < 2 or not unique:
        return {}
    load = dict.fromkeys(cpus, 0.0)
    out: dict[str, list[int]] = {}
    for node in sorted(unique.values(), key=lambda n: (-n.cpu, n.name)):
        k = min(len(cpus), max(1, math.ceil(node.cpu - 1e-9)))
        chosen = sorted(cpus, key=lambda c: (load[c], c))[:k]
        for c in chosen:
            load[c] += node.cpu / k
        out[node.name] = sorted(chosen)
    if max(load.values()) > MAX_CPU_LOAD + 1e-9:
        return {}
    return out


def cpu_list(cpus: Sequence[int]) -> str:
    """`taskset -c`'s form: "0,1"; "" for none (the node floats)."""
    return ",".join(str(c) for c in cpus)
