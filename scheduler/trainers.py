"""Enumerate and cost the candidate trainer configurations c = (kind, node groups, DP
size, ZeRO stage) that the MILP chooses among (exactly one).

DeepSpeed runs pure data parallel with the same number of ranks on every node, so a
trainer is p GPUs (any p up to the machine's) on each of m machines of one node group,
or whole machines spanning several groups of one region (its all-reduce then crosses
the slowest link). GPU granularity keeps budget from being stranded between sizes.

A trainer may also span GPU kinds of one region with the same GPUs per node
(heterogeneous data parallelism): every machine of the faster kinds plus m machines of
the next. Its ranks take shares of a step in proportion to their speed
(`trainer.rank_speeds`), so the step's compute is B·G over the sum of the rank speeds,
in whole samples per rank; each kind must hold the ZeRO stage's memory in its own HBM.
"""

from __future__ import annotations

import math

from scheduler.catalogue import GpuKind
from scheduler.cluster import Cluster, NodeGroup
from scheduler.costmodel import (
    GB,
    TrainerOption,
    allreduce_s,
    kind_constants,
    train_flops_per_sample,
    train_memory_gb,
    trained_models,
)
from scheduler.model_shape import ModelShape
from scheduler.profile import Profile
from scheduler.workload import Workload

FINE_MACHINES = 2
Layout = tuple[tuple[tuple[str, int], ...], int]  # (node group, GPUs) parts, ranks per node


def _layouts(groups: list[NodeGroup], max_dp: int) -> list[Layout]:
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


def rank_speed(
    m: ModelShape, w: Workload, kind: GpuKind, prof: Profile | None, sync: bool = False
) -> float:
    """Samples per second one rank of `kind` trains: the profile's tokens/s where it
    measured the kind (`sync`: a synchronous run's step), else the kind's peak at its
    `train_mfu` over a sample's FLOPs."""
    if prof is not None and prof.has(kind.name):
        tokens = prof.train_tokens_per_s(kind.name, sync)
        return tokens / (w.prompt_tokens + w.response_tokens)
    k = kind_constants(w.constants, kind)
    return kind.bf16_tflops * 1e12 * k.train_mfu / train_flops_per_sample(m, w)


def shared_compute_s(samples: int, ranks: list[tuple[int, float]]) -> float:
    """Compute time of a step whose `samples` are shared among ranks ((count, samples/s
    per rank) per kind) in proportion to speed, in whole samples: the least T with
    Σ count·⌊T·speed⌋ ≥ samples. One speed gives ⌈samples / count⌉ / speed."""
    t = samples / sum(n * s for n, s in ranks)
    while True:
        held = [math.floor(t * s * (1 + 1e-12)) for _, s in ranks]
        if sum(n * h for (n, _), h in zip(ranks, held, strict=True)) >= samples:
            return t
        # the next time at which some kind's ranks finish one more sample each
        t = min((h + 1) / s for (_, s), h in zip(ranks, held, strict=True))


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
    kinds = [cl.kinds[g.name] for g in groups]
    k = kind_constants(w.constants, kinds[0])
    dp = sum(n for _, n in parts)
    if dp > w.samples_per_step:
        return None  # a rank without a sample does nothing
    nodes = dp // per_node
    intra = min(g.intra_node.bandwidth_gbs for g in groups)
    inter, lat = _links(cl, groups)
    speeds = tuple(rank_speed(m, w, kd, prof) for kd in kinds)
    compute = shared_compute_s(
        w.samples_per_step, [(n, s) for (_, n), s in zip(parts, speeds, strict=True)]
    )
    sync_speeds = tuple(rank_speed(m, w, kd, prof, sync=True) for kd in kinds)
    sync_compute = None  # a synchronous step's rate: only where the profile timed it
    if sync_speeds != speeds:
        sync_compute = shared_compute_s(
            w.samples_per_step, [(n, s) for (_, n), s in zip(parts, sync_speeds, strict=True)]
        )
    publish = 2.0 * m.params / (k.storage_write_gbs * GB) / w.publish_every
    if prof is not None:  # rank 0 publishes; what its kind measured doing it replaces that
        extra = prof.train_extra_s(kinds[0].name, w.publish_every, w.checkpoint_every)
        publish = publish if extra is None else extra
    broadcast = 0.0  # rank 0 sends the weights: no server's pause ends before it has
    after_send = 0.0  # ... and its update waits for the send, then goes on
    if prof is not None and w.weight_sync == "network":
        broadcast = prof.train_broadcast_s(kinds[0].name) or 0.0
        after_send = prof.train_after_send_s(kinds[0].name) or 0.0
    host = 0.0
    if prof is not None and w.host_work == "trainer":
        host = w.samples_per_step * prof.host_cpu_s_per_sample(kinds[0].name)
    hbm = min(kd.hbm_gb for kd in kinds)  # every kind holds the same per-rank states
    best: TrainerOption | None = None
    stages = (0, 1, 2, 3) if dp > 1 else (0,)
    if w.zero_stage is not None:
        stages = (w.zero_stage,)  # pinned: DeepSpeed runs any stage on one rank too
    for zero in stages:
        mem = train_memory_gb(m, w, dp, zero)
        if mem > hbm:
            continue
        comm = allreduce_s(m, dp, nodes, zero, intra, inter, lat) * trained_models(w)
        step = compute + (1 - k.comm_overlap) * comm + publish + host
        cand = TrainerOption(
            kind="+".join(dict.fromkeys(kd.name for kd in kinds)),
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
            part_kinds=tuple(kd.name for kd in kinds),
            part_speeds=speeds,
            host_s=host,
            sync_compute_s=sync_compute,
            broadcast_s=broadcast,
            after_send_s=after_send,
        )
        # Same GPUs, same price: keep the fastest stage, and among equals the leanest.
        if best is None or cand.step_s <= best.step_s * (1 + 1e-9):
            best = cand
    return best


def _mixed_layouts(cl: Cluster, speed: dict[str, float], max_dp: int) -> list[list[Layout]]:
    """Whole machines of several kinds in one region with equal GPUs per node, kinds by
    training speed k1 > k2 > …: all of k1 plus m = 1, 2, … machines of k2, all of k1 and
    k2 plus m of k3, …, and all of k_i plus m of k_i+1 for each later pair of neighbours.
    One sequence per head (the head itself first), at most two layouts per machine."""
    pools: dict[tuple[str, int], dict[str, list[NodeGroup]]] = {}
    for g in cl.spec.node_groups:
        key = (cl.zone_of[g.zone].region, g.gpus_per_node)
        pools.setdefault(key, {}).setdefault(cl.kinds[g.name].name, []).append(g)
    out: list[list[Layout]] = []
    for (_, gpn), by_kind in sorted(pools.items()):
        order = sorted(by_kind, key=lambda kd: (-speed[kd], kd))
        ranked = [sorted(by_kind[kd], key=lambda g: (-g.nodes, g.name)) for kd in order]
        for i in range(len(order) - 1):
            head = tuple((g.name, g.nodes * gpn) for g in ranked[i])
            for j in range(i + 1, len(order) if i == 0 else i + 2):
                out.append([(head, gpn), *_fill(head, ranked[j], gpn, max_dp)])
                head += tuple((g.name, g.nodes * gpn) for g in ranked[j])
    return out


def _fill(
    head: tuple[tuple[str, int], ...], groups: list[NodeGroup], gpn: int, max_dp: int
) -> list[Layout]:
    """`head` plus 1, 2, … machines of `groups`, filled group by group, up to `max_dp`."""
    out: list[Layout] = []
    dp = sum(n for _, n in head)
    full: tuple[tuple[str, int], ...] = ()
    for g in groups:
        for m in range(1, g.nodes + 1):
            if dp + m * gpn > max_dp:
                return out
            out.append((head + full + ((g.name, m * gpn),), gpn))
        full += ((g.name, g.nodes * gpn),)
        dp += g.nodes * gpn
    return out


def _growing(
    cl: Cluster, m: ModelShape, w: Workload, seq: list[Layout], prof: Profile | None
) -> list[TrainerOption]:
    """The layouts of a sequence (the head, then each the last plus one machine) that
    train faster than every smaller one: a larger trainer that is not faster costs more
    and takes more GPUs than a smaller one, which is a candidate (the head: a one-kind
    layout, or the end of the previous sequence) or is itself beaten by a smaller one."""
    head = cost_trainer(cl, m, w, *seq[0], prof)
    best = head.samples_per_s if head is not None else 0.0
    out: list[TrainerOption] = []
    for parts, per_node in seq[1:]:
        c = cost_trainer(cl, m, w, parts, per_node, prof)
        if c is not None and c.samples_per_s > best:
            best = c.samples_per_s
            out.append(c)
    return out


def trainer_configs(
    cl: Cluster, m: ModelShape, w: Workload, prof: Profile | None = None
) -> list[TrainerOption]:
    by_kind: dict[str, list[NodeGroup]] = {}
    for g in cl.spec.node_groups:
        by_kind.setdefault(cl.kinds[g.name].name, []).append(g)
    layouts: list[Layout] = []
    for groups in by_kind.values():
        layouts += _layouts(groups, w.samples_per_step) + _multi_group_layouts(cl, groups)
    out: list[TrainerOption] = []
    for parts, per_node in layouts:
        c = cost_trainer(cl, m, w, parts, per_node, prof)
        if c is not None:
            out.append(c)
    if w.mixed_trainer:
        speed = {kd: rank_speed(m, w, cl.kinds[gs[0].name], prof) for kd, gs in by_kind.items()}
        for seq in _mixed_layouts(cl, speed, w.samples_per_step):
            out += _growing(cl, m, w, seq, prof)
    if w.max_trainer_nodes is not None:
        out = [c for c in out if trainer_nodes(c) <= w.max_trainer_nodes]
    return out


def trainer_nodes(c: TrainerOption) -> int:
    """Machines the trainer spans (the same ranks on each)."""
    return sum(n for _, n in c.parts) // c.per_node
