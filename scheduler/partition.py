"""Phase 2: concrete GPUs for each instance, with METIS (pymetis) on the device graph.

The graph is coarsened by machine: one vertex per node (weight = its GPUs), edges
weighted by the bandwidth between machines (in a zone: the zone's inter-node link; across
zones: the zone link), so TP groups stay inside machines by construction. METIS splits the
machines of the trainer's kind into the trainer's island and the rest with target weights
equal to the trainer's share (tpwgts); a repair step then takes exactly the machines the
MILP asked for from each node group, preferring METIS's island. Rollout instances are
packed largest-TP first into the remaining GPUs of their node group.
"""

from __future__ import annotations

from dataclasses import dataclass

import pymetis

from scheduler.cluster import Cluster, NodeGroup
from scheduler.costmodel import RolloutOption, TrainerOption

MAX_CLIQUE = 48  # machines per zone beyond which the zone is a ring of k neighbours
RING_K = 8


@dataclass
class Placement:
    trainer: list[tuple[str, list[int]]]  # (node, gpu ids) in rank order
    rollout: list[tuple[RolloutOption, str, list[int]]]  # (config, node, gpu ids)
    cut_gbs: float  # bandwidth METIS cut between the trainer's island and the rest


def node_names(g: NodeGroup) -> list[str]:
    return [f"{g.name}-{i}" for i in range(g.nodes)]


def _graph(cl: Cluster, groups: list[NodeGroup]):
    """CSR graph of the machines of `groups`; edge weight = bandwidth in 0.1 GB/s units."""
    verts = [(g, n) for g in groups for n in node_names(g)]
    nbrs: list[dict[int, int]] = [{} for _ in verts]
    by_zone: dict[str, list[int]] = {}
    for i, (g, _) in enumerate(verts):
        by_zone.setdefault(g.zone, []).append(i)

    def add(a: int, b: int, gbs: float) -> None:
        w = max(1, int(round(gbs * 10)))
        nbrs[a][b] = max(nbrs[a].get(b, 0), w)
        nbrs[b][a] = nbrs[a][b]

    for z, idx in by_zone.items():
        bw = cl.link(z, z).bandwidth_gbs
        for pos, a in enumerate(idx):
            others = (
                idx[pos + 1 :]
                if len(idx) <= MAX_CLIQUE
                else [idx[(pos + d) % len(idx)] for d in range(1, RING_K // 2 + 1)]
            )
            for b in others:
                if a != b:
                    add(a, b, bw)
    zones = sorted(by_zone)
    for i, za in enumerate(zones):
        for zb in zones[i + 1 :]:
            bw = cl.link(za, zb).bandwidth_gbs
            for a, b in zip(by_zone[za], by_zone[zb], strict=False):
                add(a, b, bw)
    xadj, adjncy, ew = [0], [], []
    for d in nbrs:
        for b, w in sorted(d.items()):
            adjncy.append(b)
            ew.append(w)
        xadj.append(len(adjncy))
    return verts, xadj, adjncy, ew


def _trainer_nodes(cl: Cluster, c: TrainerOption) -> tuple[list[tuple[str, list[int]]], float]:
    gmap = {g.name: g for g in cl.spec.node_groups}
    kind_groups = [g for g in cl.spec.node_groups if cl.kinds[g.name].name == c.kind]
    verts, xadj, adjncy, ew = _graph(cl, kind_groups)
    total = sum(g.nodes * g.gpus_per_node for g in kind_groups)
    share = min(0.99, max(0.01, c.dp / total))
    island: set[str] = set()
    cut = 0.0
    if len(verts) > 1 and adjncy:
        vw = [g.gpus_per_node for g, _ in verts]
        cutcount, parts = pymetis.part_graph(
            2,
            pymetis.CSRAdjacency(xadj, adjncy),
            vweights=vw,
            eweights=ew,
            tpwgts=[share, 1 - share],
        )
        island = {n for (_, n), p in zip(verts, parts, strict=True) if p == 0}
        cut = cutcount / 10
    out: list[tuple[str, list[int]]] = []
    for gname, n in c.parts:
        g = gmap[gname]
        names = sorted(node_names(g), key=lambda s: (s not in island, int(s.rsplit("-", 1)[1])))
        if n < g.gpus_per_node:
            out.append((names[0], list(range(n))))
        else:
            out += [(nm, list(range(g.gpus_per_node))) for nm in names[: n // g.gpus_per_node]]
    return out, cut


def place(cl: Cluster, c: TrainerOption, replicas: list[tuple[RolloutOption, int]]) -> Placement:
    trainer, cut = _trainer_nodes(cl, c)
    used = {node: set(ids) for node, ids in trainer}
    rollout: list[tuple[RolloutOption, str, list[int]]] = []
    gmap = {g.name: g for g in cl.spec.node_groups}
    items = sorted(((rc, k) for rc, k in replicas), key=lambda t: (t[0].group, -t[0].tp))
    for rc, k in items:
        g = gmap[rc.group]
        for _ in range(k):
            for node in node_names(g):
                free = [i for i in range(g.gpus_per_node) if i not in used.get(node, set())]
                if len(free) >= rc.tp:
                    ids = free[: rc.tp]
                    used.setdefault(node, set()).update(ids)
                    rollout.append((rc, node, ids))
                    break
            else:
                raise RuntimeError(f"no room for a TP-{rc.tp} instance in {g.name}")
    return Placement(trainer, rollout, cut)
