"""The interconnect as shared resources, and how long concurrent transfers take on it.

A transfer between two machines runs alone at its path's bandwidth: the zone's
inter-node link inside a zone, the zone link across zones (the cost model's figures),
capped by a declared NIC or rack uplink on the way. Declared shared resources, a
machine's NIC (out and in, when its node group gives `nic_gbs`) and a rack's uplink (up
and down, for traffic leaving or entering the rack), divide their bandwidth among every
transfer crossing them at once. A transfer finishes when its own path and the most loaded
shared resource it crosses have both drained:

    t_f = max(bytes_f / path_f, max over shared resources r on f's path of load_r / bw_r)

With neither racks nor NICs in the spec this is exactly the cost model's time for every
transfer, so the planner's phase 1 and this evaluation agree on such clusters.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from scheduler.cluster import Cluster, machine_name

GB = 1e9

HEAD = "head"  # the head node's name in `Topology.add_head`
Resource = tuple[str, str]  # ("out" | "in", machine) or ("up" | "down", rack)


@dataclass(frozen=True)
class Machine:
    name: str
    group: str
    zone: str
    domain: str  # its rack, or the zone's rack-less machines ("zone:<name>")
    gpus: int
    nic_gbs: float | None
    intra_gbs: float


@dataclass(frozen=True)
class Transfer:
    src: str
    dst: str
    bytes: float


class Topology:
    """Machines of a cluster with their switch domains and the shared resources."""

    def __init__(self, cl: Cluster) -> None:
        self.cl = cl
        self.uplink = {r.name: r.uplink_gbs for r in cl.spec.racks}
        self.machines: dict[str, Machine] = {}
        for g in cl.spec.node_groups:
            for i in range(g.nodes):
                name = machine_name(g.name, i)
                self.machines[name] = Machine(
                    name=name,
                    group=g.name,
                    zone=g.zone,
                    domain=cl.rack_of.get(name, f"zone:{g.zone}"),
                    gpus=g.gpus_per_node,
                    nic_gbs=g.nic_gbs,
                    intra_gbs=g.intra_node.bandwidth_gbs,
                )

    def add_head(self, zone: str) -> str:
        """The head node (Valkey, the rollout controller) on the spine of `zone`: outside
        every rack, so that its traffic with a machine in a rack crosses that rack's
        uplink; no NIC of its own. Returns its name."""
        name = f"{HEAD}:{zone}"
        z = self.cl.zone_of[zone]
        self.machines.setdefault(
            name, Machine(name, "", zone, f"spine:{zone}", 0, None, z.inter_node_bandwidth_gbs)
        )
        return name

    @property
    def declared(self) -> bool:
        """True when the spec gives racks or NICs, i.e. placement inside a zone matters."""
        return bool(self.uplink) or any(m.nic_gbs for m in self.machines.values())

    def path(self, a: str, b: str) -> tuple[float, list[tuple[Resource, float]]]:
        """A lone transfer's bandwidth (GB/s) from `a` to `b` and the shared resources
        it crosses with their bandwidths."""
        ma, mb = self.machines[a], self.machines[b]
        if a == b:
            return ma.intra_gbs, []
        bw = self.cl.link(ma.zone, mb.zone).bandwidth_gbs
        res: list[tuple[Resource, float]] = []
        if ma.nic_gbs:
            res.append((("out", a), ma.nic_gbs))
        if mb.nic_gbs:
            res.append((("in", b), mb.nic_gbs))
        if ma.domain != mb.domain:
            if ma.domain in self.uplink:
                res.append((("up", ma.domain), self.uplink[ma.domain]))
            if mb.domain in self.uplink:
                res.append((("down", mb.domain), self.uplink[mb.domain]))
        return min([bw] + [r[1] for r in res]), res

    def finish_s(self, transfers: list[Transfer]) -> list[float]:
        """Seconds until each of `transfers`, all started together, has arrived."""
        paths = [self.path(t.src, t.dst) for t in transfers]
        load: dict[Resource, float] = defaultdict(float)
        for t, (_, res) in zip(transfers, paths, strict=True):
            for r, _ in res:
                load[r] += t.bytes
        out = []
        for t, (bw, res) in zip(transfers, paths, strict=True):
            worst = max((load[r] / rbw for r, rbw in res), default=0.0)
            out.append(max(t.bytes / bw, worst) / GB)
        return out

    def copies_s(self, writer: str, nodes: list[str], nbytes: float, tree: bool) -> list[float]:
        """Seconds until each of `nodes` (one per receiver, in rank order) holds a copy of
        `nbytes` from `writer`. Without `tree`, the writer sends every machine its copy at
        once. With `tree`, the copies go as gloo's broadcast sends them (`gloo::broadcast`,
        which torch's gloo process group runs): a binomial tree over the ranks, the writer
        rank 0 and `nodes[i]` rank 1 + i. In round r, every rank below 2^r that holds the
        copy sends it to the rank 2^r above it; rank 0 queues all its sends at once (its
        ceil(log2(ranks)) copies share its links), and any other rank forwards once its own
        copy has arrived. A round's forwards start together when the last of their senders
        has the copy."""
        if not tree:
            machines = sorted(set(nodes))
            done = self.finish_s([Transfer(writer, node, nbytes) for node in machines])
            arrive = dict(zip(machines, done, strict=True))
            return [arrive[node] for node in nodes]
        ranks = [writer, *nodes]
        pairs = broadcast_tree(len(ranks))
        have = {0: 0.0}
        root = [(src, dst) for _, src, dst in pairs if src == 0]
        done = self.finish_s([Transfer(writer, ranks[dst], nbytes) for _, dst in root])
        have.update({dst: t for (_, dst), t in zip(root, done, strict=True)})
        for r in sorted({r for r, src, _ in pairs if src != 0}):
            hops = [(src, dst) for rr, src, dst in pairs if rr == r and src != 0]
            start = max(have[src] for src, _ in hops)
            done = self.finish_s([Transfer(ranks[src], ranks[dst], nbytes) for src, dst in hops])
            have.update({dst: start + t for (_, dst), t in zip(hops, done, strict=True)})
        return [have[i] for i in range(1, len(ranks))]

    def tree_order(self, writer: str, nodes: list[str]) -> list[int]:
        """An order of `nodes` (indices) as broadcast ranks 1, 2, ... for `copies_s`'
        tree: grouped by switch domain, the writer's own first, the others as they first
        appear. A binomial tree's subtrees are runs of consecutive ranks, so grouped
        ranks forward inside their rack and each other rack's copy crosses its uplink
        about once."""
        first: dict[str, int] = {self.machines[writer].domain: -1}
        for i, node in enumerate(nodes):
            first.setdefault(self.machines[node].domain, i)
        return sorted(range(len(nodes)), key=lambda i: (first[self.machines[nodes[i]].domain], i))

    def ring_s(self, machines: list[str], bytes_per_machine: float) -> float:
        """One pass of a ring over `machines` (in ring order), each sending
        `bytes_per_machine` to the next: the slowest hop, with shared links counted."""
        if len(machines) < 2:
            return 0.0
        hops = [
            Transfer(a, machines[(i + 1) % len(machines)], bytes_per_machine)
            for i, a in enumerate(machines)
        ]
        return max(self.finish_s(hops))

    def ring_order(self, machines: list[str]) -> list[str]:
        """Machines grouped by switch domain, so that a ring leaves each domain once."""
        first: dict[str, int] = {}
        for i, m in enumerate(machines):
            first.setdefault(self.machines[m].domain, i)
        return sorted(machines, key=lambda m: (first[self.machines[m].domain], machines.index(m)))


def broadcast_tree(ranks: int) -> list[tuple[int, int, int]]:
    """(round, sender, receiver) of a binomial-tree broadcast from rank 0 over `ranks`
    ranks, as gloo runs it: in round r, rank v < 2^r sends to v + 2^r where that rank
    exists."""
    out = []
    r = 0
    while (1 << r) < ranks:
        out += [(r, v, v + (1 << r)) for v in range(1 << r) if v + (1 << r) < ranks]
        r += 1
    return out
