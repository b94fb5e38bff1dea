"""Phase 2: map phase 1's communication onto the interconnect with METIS (pymetis).

Phase 1 fixed how many GPUs of each node group train and which rollout instances run.
Phase 2 decides which machines. The communication graph has one vertex per task, a
trainer machine's ranks or a machine's worth of rollout instances, weighted by its GPUs,
and edges weighted by bytes per second: the gradient all-reduce ring between the
trainer's machines and each publish's weights from the trainer's first machine (which
writes them) to every rollout machine. Free GPUs become edgeless filler vertices, so that
a partition balanced against each switch domain's GPU share (METIS's target weights) is a
placement that fits. METIS then cuts as little traffic as it can between domains, which
keeps heavy traffic off rack uplinks and away from other zones. A repair step moves tasks
(fillers first) until every domain holds no more GPUs of each node group than it has; the
tasks are then packed onto the domain's machines.

`first_fit` is the naive placement the mapping is measured against: the trainer on the
first machines of its node groups, rollout instances packed in machine order.
`evaluate` prices a placement on the topology (scheduler/topology.py): the trainer's step
with its all-reduce on the machines it got, and each instance's weight-sync pause.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pymetis

from scheduler.cluster import Cluster, NodeGroup, machine_name
from scheduler.costmodel import GB, RolloutOption, TrainerOption, allreduce_s, trained_models
from scheduler.model_shape import ModelShape
from scheduler.sync_cost import busy_sender_syncs, one_update, sync_terms, update_latency_s
from scheduler.topology import Topology
from scheduler.traffic import traffic_on_topology
from scheduler.workload import Workload

SCALE = 1e6  # edge weights in MB/s, integers ≥ 1


@dataclass
class Placement:
    trainer: list[tuple[str, list[int]]]  # (node, gpu ids) in rank order
    rollout: list[tuple[RolloutOption, str, list[int]]]  # (config, node, gpu ids)
    method: str = "metis"  # "metis" | "first-fit"
    cut_gbs: float = 0.0  # traffic between switch domains, GB/s (the partition's cut)


@dataclass
class PlacementCost:
    """A placement priced on the topology."""

    train_step_s: float
    comm_s: float  # the trainer's all-reduce per step
    sync_s: list[float]  # per rollout instance (as `Placement.rollout`), per publish
    # per rollout instance: the share of its rate its links carry beside the other
    # traffic (`traffic.traffic_on_topology`); empty: all of it
    gen_factors: list[float] = field(default_factory=list)
    # per rollout instance: its pause when the trainer trains while it sends
    # (`sync_cost.busy_sender_syncs`); empty: `sync_s`
    busy_sync_s: list[float] = field(default_factory=list)
    send_s: float = 0.0  # the trainer's send while it trains (`TrainerOption.broadcast_s`)
    after_send_s: float = 0.0  # its step's work after the send (`TrainerOption.after_send_s`)


@dataclass
class _Task:
    group: str
    gpus: int
    trainer_rank: int | None = None  # machine index in the trainer's rank order
    instances: list[RolloutOption] = field(default_factory=list)


def node_names(g: NodeGroup) -> list[str]:
    return [machine_name(g.name, i) for i in range(g.nodes)]


def trainer_shape(cl: Cluster, c: TrainerOption) -> list[tuple[str, int]]:
    """(node group, GPUs) per trainer machine, in rank order."""
    return [(gname, c.per_node) for gname, n in c.parts for _ in range(n // c.per_node)]


# ---------------------------------------------------------------- packing
class _Machines:
    """Free GPUs per machine while a placement is being packed."""

    def __init__(self, cl: Cluster) -> None:
        self.gpn = {g.name: g.gpus_per_node for g in cl.spec.node_groups}
        self.order = {g.name: node_names(g) for g in cl.spec.node_groups}
        self.used: dict[str, set[int]] = defaultdict(set)

    def free(self, node: str, group: str) -> list[int]:
        return [i for i in range(self.gpn[group]) if i not in self.used[node]]

    def take(self, node: str, ids: list[int]) -> list[int]:
        self.used[node].update(ids)
        return ids

    def trainer_machine(self, group: str, gpus: int, prefer: list[str]) -> tuple[str, list[int]]:
        for node in prefer + self.order[group]:
            if node.rsplit("-", 1)[0] == group and not self.used[node]:
                return node, self.take(node, list(range(gpus)))
        raise RuntimeError(f"no free machine left in {group}")

    def instance(self, rc: RolloutOption, prefer: list[str]) -> tuple[str, list[int]]:
        for node in prefer + self.order[rc.group]:
            if node.rsplit("-", 1)[0] != rc.group:
                continue
            free = self.free(node, rc.group)
            if len(free) >= rc.tp:
                return node, self.take(node, free[: rc.tp])
        raise RuntimeError(f"no room for a TP-{rc.tp} instance in {rc.group}")


def _instances(replicas: list[tuple[RolloutOption, int]]) -> list[RolloutOption]:
    """Every rollout instance, largest TP first (power-of-two TPs then pack exactly)."""
    items = sorted(replicas, key=lambda t: (t[0].group, -t[0].tp))
    return [rc for rc, k in items for _ in range(k)]


def first_fit(
    cl: Cluster, c: TrainerOption, replicas: list[tuple[RolloutOption, int]]
) -> Placement:
    ms = _Machines(cl)
    trainer = [ms.trainer_machine(g, n, []) for g, n in trainer_shape(cl, c)]
    rollout = [(rc, *ms.instance(rc, [])) for rc in _instances(replicas)]
    return Placement(trainer, rollout, "first-fit")


# ---------------------------------------------------------------- mapping
def _tasks(cl: Cluster, c: TrainerOption, replicas: list[tuple[RolloutOption, int]]) -> list[_Task]:
    """Trainer machines, machine-sized bins of rollout instances, then idle fillers."""
    gpn = {g.name: g.gpus_per_node for g in cl.spec.node_groups}
    tasks = [_Task(g, n, trainer_rank=i) for i, (g, n) in enumerate(trainer_shape(cl, c))]
    bins: dict[str, list[_Task]] = defaultdict(list)
    for rc in _instances(replicas):
        open_bins = [b for b in bins[rc.group] if b.gpus + rc.tp <= gpn[rc.group]]
        if open_bins:
            open_bins[0].gpus += rc.tp
            open_bins[0].instances.append(rc)
        else:
            bins[rc.group].append(_Task(rc.group, rc.tp, instances=[rc]))
    tasks += [b for bs in bins.values() for b in bs]
    used: dict[str, int] = defaultdict(int)
    for t in tasks:
        used[t.group] += t.gpus
    for g in cl.spec.node_groups:
        if g.name not in used:
            continue  # groups the plan does not use take no part in the mapping
        idle = g.nodes * g.gpus_per_node - used[g.name]
        while idle > 0:
            n = min(idle, g.gpus_per_node)
            tasks.append(_Task(g.name, n))
            idle -= n
    return tasks


def _traffic(
    tasks: list[_Task], c: TrainerOption, m: ModelShape, w: Workload
) -> dict[tuple[int, int], float]:
    """Bytes per second between tasks: the trainer's ring and the weight publishes."""
    step = max(c.step_s, 1e-9)
    ranks = sorted((t.trainer_rank, i) for i, t in enumerate(tasks) if t.trainer_rank is not None)
    n = len(ranks)
    edges: dict[tuple[int, int], float] = defaultdict(float)
    if n > 1:
        factor = 1.5 if c.zero == 3 else 1.0
        ring = factor * 2 * (n - 1) / n * 2.0 * m.params * trained_models(w) / step
        for k in range(n):
            a, b = ranks[k][1], ranks[(k + 1) % n][1]
            if a != b:
                edges[tuple(sorted((a, b)))] += ring
    if ranks:
        writer = ranks[0][1]
        sync = sync_terms(m, w, 0.0)[0] / (step * w.publish_every)
        for i, t in enumerate(tasks):
            if t.instances:
                edges[tuple(sorted((writer, i)))] += sync
    return edges


def _capacity(topo: Topology, groups: set[str]) -> dict[str, dict[str, int]]:
    """Switch domain -> node group -> GPUs, for the groups in `groups`."""
    cap: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for mach in topo.machines.values():
        if mach.group in groups:
            cap[mach.domain][mach.group] += mach.gpus
    return cap


def _metis(
    tasks: list[_Task],
    edges: dict[tuple[int, int], float],
    parts: list[str],
    cap: dict[str, dict[str, int]],
) -> list[int]:
    """METIS k-way partition of the tasks, balanced against each domain's GPU share."""
    if len(parts) == 1:
        return [0] * len(tasks)
    nbrs: list[dict[int, int]] = [{} for _ in tasks]
    for (a, b), bps in edges.items():
        wgt = max(1, int(round(bps / SCALE)))
        nbrs[a][b] = nbrs[b][a] = wgt
    xadj, adjncy, ew = [0], [], []
    for d in nbrs:
        for b, wgt in sorted(d.items()):
            adjncy.append(b)
            ew.append(wgt)
        xadj.append(len(adjncy))
    total = sum(sum(cap[p].values()) for p in parts)
    tpwgts = [sum(cap[p].values()) / total for p in parts]
    if not adjncy:
        return [0] * len(tasks)
    opts = pymetis.Options(seed=0)
    _, assign = pymetis.part_graph(
        len(parts),
        pymetis.CSRAdjacency(xadj, adjncy),
        vweights=[t.gpus for t in tasks],
        eweights=ew,
        tpwgts=tpwgts,
        options=opts,
    )
    return list(assign)


def _repair(
    tasks: list[_Task],
    assign: list[int],
    parts: list[str],
    cap: dict[str, dict[str, int]],
    edges: dict[tuple[int, int], float],
) -> None:
    """Move tasks until no domain holds more GPUs of a node group than it has: fillers
    first, then the task whose move cuts the least traffic."""
    nbrs: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (a, b), bps in edges.items():
        nbrs[a].append((b, bps))
        nbrs[b].append((a, bps))

    def load(p: int, g: str) -> int:
        return sum(t.gpus for t, q in zip(tasks, assign, strict=True) if q == p and t.group == g)

    def loss(i: int, dest: int) -> float:
        return sum(bps for j, bps in nbrs[i] if assign[j] == assign[i]) - sum(
            bps for j, bps in nbrs[i] if assign[j] == dest
        )

    for g in sorted({t.group for t in tasks}):
        for _ in range(len(tasks) + 1):
            over = [p for p in range(len(parts)) if load(p, g) > cap[parts[p]].get(g, 0)]
            if not over:
                break
            p = over[0]
            room = [q for q in range(len(parts)) if load(q, g) < cap[parts[q]].get(g, 0)]
            movable = [i for i, t in enumerate(tasks) if assign[i] == p and t.group == g]
            best = None
            for i in movable:
                for q in room:
                    if tasks[i].gpus <= cap[parts[q]].get(g, 0) - load(q, g):
                        key = (not _is_filler(tasks[i]), loss(i, q), -tasks[i].gpus)
                        if best is None or key < best[0]:
                            best = (key, i, q)
            if best is None:
                break  # fragmentation: packing falls back to any machine of the group
            assign[best[1]] = best[2]


def _is_filler(t: _Task) -> bool:
    return t.trainer_rank is None and not t.instances


def mapped(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    c: TrainerOption,
    replicas: list[tuple[RolloutOption, int]],
    topo: Topology | None = None,
) -> Placement:
    topo = topo or Topology(cl)
    tasks = _tasks(cl, c, replicas)
    edges = _traffic(tasks, c, m, w)
    cap = _capacity(topo, {t.group for t in tasks})
    parts = sorted(cap)
    assign = _metis(tasks, edges, parts, cap)
    _repair(tasks, assign, parts, cap, edges)
    in_domain: dict[str, list[str]] = defaultdict(list)
    for name, mach in topo.machines.items():
        in_domain[mach.domain].append(name)
    ms = _Machines(cl)
    trainer: list[tuple[int, tuple[str, list[int]]]] = []
    rollout: list[tuple[RolloutOption, str, list[int]]] = []
    for t, p in sorted(zip(tasks, assign, strict=True), key=lambda tp: -tp[0].gpus):
        prefer = in_domain[parts[p]]
        if t.trainer_rank is not None:
            trainer.append((t.trainer_rank, ms.trainer_machine(t.group, t.gpus, prefer)))
    for t, p in zip(tasks, assign, strict=True):
        prefer = in_domain[parts[p]]
        for rc in t.instances:
            rollout.append((rc, *ms.instance(rc, prefer)))
    cut = sum(bps for (a, b), bps in edges.items() if assign[a] != assign[b]) / GB
    order = [slot for _, slot in sorted(trainer, key=lambda r: r[0])]
    if w.weight_sync == "network":  # the servers' ranks in the broadcast: the plan's order
        ranked = topo.tree_order(order[0][0], [node for _, node, _ in rollout])
        rollout = [rollout[i] for i in ranked]
    return Placement(order, rollout, "metis", cut)


def place(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    c: TrainerOption,
    replicas: list[tuple[RolloutOption, int]],
) -> Placement:
    """Phase 2's placement: METIS's mapping where the spec describes racks or NICs (the
    only case where machines of one node group differ), else first-fit, which is then
    the same machines up to renaming."""
    topo = Topology(cl)
    if not topo.declared:
        return first_fit(cl, c, replicas)
    return mapped(cl, m, w, c, replicas, topo)


# ---------------------------------------------------------------- pricing
def evaluate(
    cl: Cluster, m: ModelShape, w: Workload, c: TrainerOption, pl: Placement
) -> PlacementCost:
    """The trainer's step and each instance's weight-sync pause on the machines `pl`
    gives them, contention on shared links included, with the traffic to and from the
    head node (`traffic.traffic_on_topology`): the step's read of its records, a step no
    shorter than a network send of the weights, each instance's rate its links carry."""
    topo = Topology(cl)
    gmap = {g.name: g for g in cl.spec.node_groups}
    machines = [node for node, _ in pl.trainer]
    n = len(machines)
    intra = min(gmap[g].intra_node.bandwidth_gbs for g, _ in c.parts)
    comm = allreduce_s(m, c.per_node, 1, c.zero, intra, 1.0, 0.0) if c.per_node > 1 else 0.0
    if n > 1:
        factor = 1.5 if c.zero == 3 else 1.0
        ring = factor * 2 * (n - 1) / n * 2.0 * m.params
        zones = {topo.machines[x].zone for x in machines}
        lat = max(cl.link(a, b).latency_ms for a in zones for b in zones)
        comm += topo.ring_s(topo.ring_order(machines), ring) + 2 * (n - 1) * lat / 1e3
    comm *= trained_models(w)  # the critic's gradients ride the same ring
    step = c.compute_s + (1 - w.constants.comm_overlap) * comm + c.publish_s
    nodes = [node for _, node, _ in pl.rollout]
    pauses = [opt.update_pause_s for opt, _, _ in pl.rollout]
    sync = sync_on_topology(cl, m, w, machines[0], nodes, topo, pauses)
    rates = [opt.samples_per_s for opt, _, _ in pl.rollout]
    tc = traffic_on_topology(cl, m, w, machines[0], nodes, rates, w.samples_per_step / step, topo)
    step = tc.step_s(step, w.publish_every)
    arrive = copies_arrive_s(topo, m, w, machines[0], nodes)
    busy = one_update(busy_sender_syncs(w, sync, arrive, c.broadcast_s))
    sync = one_update([max(s, c.broadcast_s) for s in sync])
    return PlacementCost(step, comm, sync, tc.gen_factors, busy, c.broadcast_s, c.after_send_s)


def sync_on_topology(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    writer: str,
    rollout_nodes: list[str],
    topo: Topology | None = None,
    pauses: list[float | None] | None = None,
) -> list[float]:
    """Each rollout instance's weight-sync pause (as `rollout_nodes`, one machine per
    instance) when the trainer's machine `writer` sends every rollout machine its copy at
    once (`sync_cost.sync_terms` for the mode), NICs and rack uplinks shared. `pauses`:
    each instance's own update pause where its kind's profile measured one
    (`RolloutOption.update_pause_s`), the latency of a link within the writer's zone in
    place of the zone's (a link across zones keeps its own)."""
    topo = topo or Topology(cl)
    machines = sorted(set(rollout_nodes))
    wz = topo.machines[writer].zone
    own = dict(zip(rollout_nodes, pauses or [None] * len(rollout_nodes), strict=True))
    out = {}
    for node in machines:
        latency = update_latency_s(cl, wz, topo.machines[node].zone, own[node])
        out[node] = sync_terms(m, w, latency)
    arrive = copies_arrive_s(topo, m, w, writer, rollout_nodes)
    return [out[node][1] + a for node, a in zip(rollout_nodes, arrive, strict=True)]


def copies_arrive_s(
    topo: Topology, m: ModelShape, w: Workload, writer: str, nodes: list[str]
) -> list[float]:
    """Seconds until each rollout instance's copy of the weights (`sync_terms`' bytes)
    has arrived from `writer` over shared NICs and uplinks (`Topology.copies_s`): every
    copy sent at once, or over the network as the trainer's broadcast sends them. The
    bytes part of `sync_on_topology`'s pauses."""
    nbytes = sync_terms(m, w, 0.0)[0]
    return topo.copies_s(writer, nodes, nbytes, tree=w.weight_sync == "network")
