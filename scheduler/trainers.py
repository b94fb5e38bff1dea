"""Enumerate and cost the candidate trainer configurations c = (kind, node groups, DP
size, ZeRO stage) that the MILP chooses among (exactly one).

DeepSpeed runs pure data parallel with the same number of ranks on every node, so a
trainer is p GPUs (any p up to the machine's) on each of m machines of one node group,
or whole machines spanning several groups of one region (its all-reduce then crosses
the slowest link). GPU granularity keeps budget from being stranded between sizes.
"""

from __future__ import annotations

import math

from scheduler.cluster import Cluster, NodeGroup
from scheduler.costmodel import (
    GB,
    TrainerOption,
    allreduce_s,
    kind_constants,
    train_flops_per_sample,
    train_memory_gb,
)
from scheduler.model_shape import ModelShape
from scheduler.profile import Profile
from scheduler.workload import Workload

FINE_MACHINES = 2


def _layouts(groups: list[NodeGroup], max_dp: int) -> list[tuple[tuple[tuple[str, int], ...], int]]:
    """(parts, per_node) layouts of one group: p ranks on each of m machines, every p on
    up to `FINE_MACHINES` machines, whole machines beyond (the steps between sizes are
    then one machine, what a budget may strand anyway); for each data-parallel size up to
    `max_dp`, the fewest machines that hold it evenly."""
    out: list[tuple[tuple[tuple[str, int], ...], int]] = []
    for g in groups:
        seen: set[int] = set()
        for m in range(1, g.nodes + 1):
            sizes = range(1, g.gpus_per_node + 1) if m <= FINE_MACHINES else [g.gpus_per_node]
            for p in sizes:
                dp = p * m
                if dp <= max_dp and dp not in seen:
                    seen.add(dp)
                    out.append((((g.name, dp),), p))
    return out


def _multi_group_layouts(
    cl: Cluster, groups: list[NodeGroup]
) -> list[tuple[tuple[tuple[str, int], ...], int]]:
    out: list[tuple[tuple[tuple[str, int], ...], int]] = []
    regions: dict[tuple[str, int], list[NodeGroup]] = {}
    for g in groups:
        regions.setdefault((cl.zone_of[g.zone].region, g.gpus_per_node), []).append(g)
    for (_, gpn), gs in regions.items():
        gs = sorted(gs, key=lambda g: (-g.nodes, g.name))
        for j in range(1, len(gs)):
            head = tuple((g.name, g.nodes * gpn) for g in gs[:j])
            for m in range(1, gs[j].nodes + 1):
                out.append((head + ((gs[j].name, m * gpn),), gpn))
    return out


def _links(cl: Cluster, groups: list[NodeGroup]) -> tuple[float, float]:
    """Slowest bandwidth and largest latency between any two machines of the groups."""
    zones = sorted({g.zone for g in groups})
    bw, lat = math.inf, 0.0
    for i, za in enumerate(zones):
        for zb in zones[i:]:
            ln = cl.link(za, zb)
            bw, lat = min(bw, ln.bandwidth_gbs), max(lat, ln.latency_ms)
    return bw, lat


def cost_trainer(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    parts: tuple[tuple[str, int], ...],
    per_node: int,
    prof: Profile | None,
) -> TrainerOption | None:
    gmap = {g.name: g for g in cl.spec.node_groups}
    groups = [gmap[p[0]] for p in parts]
    kind = cl.kinds[groups[0].name]
    k = kind_constants(w.constants, kind)
    dp = sum(n for _, n in parts)
    if dp > w.samples_per_step:
        return None  # a rank without a sample does nothing
    nodes = dp // per_node
    intra = min(g.intra_node.bandwidth_gbs for g in groups)
    inter, lat = _links(cl, groups)
    per_rank = math.ceil(w.samples_per_step / dp)
    if prof is not None and prof.has(kind.name):
        toks = per_rank * (w.prompt_tokens + w.response_tokens)
        compute = toks / prof.train_tokens_per_s(kind.name)
    else:
        compute = per_rank * train_flops_per_sample(m, w) / (kind.bf16_tflops * 1e12 * k.train_mfu)
    publish = 2.0 * m.params / (k.storage_write_gbs * GB) / w.publish_interval
    best: TrainerOption | None = None
    stages = (0, 1, 2, 3) if dp > 1 else (0,)
    if w.zero_stage is not None:
        stages = (w.zero_stage,)  # pinned: DeepSpeed runs any stage on one rank too
    for zero in stages:
        mem = train_memory_gb(m, w, dp, zero)
        if mem > kind.hbm_gb:
            continue
        comm = allreduce_s(m, dp, nodes, zero, intra, inter, lat)
        step = compute + (1 - k.comm_overlap) * comm + publish
        cand = TrainerOption(
            kind=kind.name,
            parts=parts,
            per_node=per_node,
            dp=dp,
            zero=zero,
            step_s=step,
            compute_s=compute,
            comm_s=comm,
            publish_s=publish,
            mem_gb=mem,
            samples_per_s=w.samples_per_step / step,
            usd_per_h=sum(n * gmap[g].usd_per_gpu_hour for g, n in parts),
            zones=tuple(dict.fromkeys(g.zone for g in groups)),
        )
        # Same GPUs, same price: keep the fastest stage, and among equals the leanest.
        if best is None or cand.step_s <= best.step_s * (1 + 1e-9):
            best = cand
    return best


def trainer_configs(
    cl: Cluster, m: ModelShape, w: Workload, prof: Profile | None = None
) -> list[TrainerOption]:
    by_kind: dict[str, list[NodeGroup]] = {}
    for g in cl.spec.node_groups:
        by_kind.setdefault(cl.kinds[g.name].name, []).append(g)
    out: list[TrainerOption] = []
    for groups in by_kind.values():
        layouts = _layouts(groups, w.samples_per_step) + _multi_group_layouts(cl, groups)
        for parts, per_node in layouts:
            c = cost_trainer(cl, m, w, parts, per_node, prof)
            if c is not None:
                out.append(c)
    return out
