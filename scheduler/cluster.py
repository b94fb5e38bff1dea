"""Cluster spec: node groups (GPU kind, GPUs per node, node count, zone, $/GPU-hour,
intra-node link, optional NIC bandwidth), zones (region, bandwidth between machines),
links between zones or regions, and optional racks (machines behind one switch with its
uplink bandwidth). Loaded from YAML and validated; every problem names its field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Literal

from pydantic import Field

from areal_hex.config import ConfigError
from areal_hex.config.base import Section, build, read_yaml
from scheduler.catalogue import GpuKind, UnknownGpuKind, resolve_kind

# The largest inventory a spec may describe. The planner's work grows with node groups,
# not machines, but placement and the plan list every machine; 4,096 GPUs plan in well
# under a minute (docs/planner.md, Bench).
MAX_GPUS_PER_NODE = 72  # an NVL72 rack is one NVLink domain
MAX_NODES_PER_GROUP = 4_096
MAX_MACHINES = 8_192
MAX_GPUS = 65_536


class IntraNode(Section):
    kind: Literal["nvlink", "pcie"] = "nvlink"
    bandwidth_gbs: float = Field(gt=0)  # per-GPU, one direction, GB/s


class NodeGroup(Section):
    name: str
    gpu: str
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE)
    nodes: int = Field(gt=0, le=MAX_NODES_PER_GROUP)
    zone: str
    usd_per_gpu_hour: float = Field(gt=0)
    intra_node: IntraNode
    # Per machine, each direction, GB/s. Unset: the zone's inter-node bandwidth, and the
    # NIC is not a shared resource (every transfer gets the zone's bandwidth).
    nic_gbs: float | None = Field(None, gt=0)


class Zone(Section):
    name: str
    region: str
    inter_node_bandwidth_gbs: float = Field(gt=0)  # between two machines in the zone
    inter_node_latency_ms: float = Field(0.02, ge=0)


class Link(Section):
    # Either two zones or two regions; a region link covers every zone pair across them.
    a: str
    b: str
    bandwidth_gbs: float = Field(gt=0)
    latency_ms: float = Field(ge=0)


class RackMembers(Section):
    group: str  # node group
    first: int = Field(0, ge=0)  # first machine index in the group (names are GROUP-i)
    count: int = Field(gt=0)


class Rack(Section):
    """Machines behind one top-of-rack switch. Traffic between racks (and out of the
    zone) crosses each rack's uplink, shared by every transfer that crosses it."""

    name: str
    uplink_gbs: float = Field(gt=0)  # rack switch <-> spine, each direction, GB/s
    members: list[RackMembers] = Field(min_length=1)


class GpuOverride(Section):
    bf16_tflops: float | None = Field(None, gt=0)
    hbm_gb: float | None = Field(None, gt=0)
    hbm_gbs: float | None = Field(None, gt=0)
    train_mfu: float | None = Field(None, gt=0, le=1)
    prefill_mfu: float | None = Field(None, gt=0, le=1)
    decode_bw_efficiency: float | None = Field(None, gt=0, le=1)


class ClusterSpec(Section):
    name: str
    zones: list[Zone] = Field(min_length=1)
    node_groups: list[NodeGroup] = Field(min_length=1)
    links: list[Link] = []
    racks: list[Rack] = []
    gpu_overrides: dict[str, GpuOverride] = {}


@dataclass(frozen=True)
class LinkInfo:
    bandwidth_gbs: float
    latency_ms: float


@dataclass
class Cluster:
    """A validated spec with GPU kinds resolved and every zone pair's link known."""

    spec: ClusterSpec
    kinds: dict[str, GpuKind]  # node-group name -> kind
    zone_of: dict[str, Zone]
    pair_links: dict[tuple[str, str], LinkInfo]
    rack_of: dict[str, str] = field(default_factory=dict)  # machine name -> rack name

    @property
    def name(self) -> str:
        return self.spec.name

    def link(self, za: str, zb: str) -> LinkInfo:
        """Bandwidth and latency between two machines in zones `za` and `zb`."""
        if za == zb:
            z = self.zone_of[za]
            return LinkInfo(z.inter_node_bandwidth_gbs, z.inter_node_latency_ms)
        return self.pair_links[tuple(sorted((za, zb)))]


def load_cluster(path: str | Path) -> Cluster:
    spec = build(ClusterSpec, read_yaml(path), str(path), "cluster")
    return make_cluster(spec, str(path))


def make_cluster(spec: ClusterSpec, source: str = "cluster spec") -> Cluster:
    errors: list[str] = []
    machines = sum(g.nodes for g in spec.node_groups)
    gpus = sum(g.nodes * g.gpus_per_node for g in spec.node_groups)
    if machines > MAX_MACHINES or gpus > MAX_GPUS:
        raise ConfigError(
            f"invalid cluster spec ({source}): node_groups: {machines:,} machines with "
            f"{gpus:,} GPUs; a spec holds at most {MAX_MACHINES:,} machines and "
            f"{MAX_GPUS:,} GPUs"
        )
    zone_of: dict[str, Zone] = {}
    for i, z in enumerate(spec.zones):
        if z.name in zone_of:
            errors.append(f"zones[{i}].name: zone {z.name!r} is defined twice")
        zone_of[z.name] = z
    overrides = {k: v.model_dump(exclude_none=True) for k, v in spec.gpu_overrides.items()}
    kinds: dict[str, GpuKind] = {}
    seen: set[str] = set()
    for i, g in enumerate(spec.node_groups):
        where = f"node_groups[{i}] ({g.name})"
        if g.name in seen:
            errors.append(f"{where}.name: node group {g.name!r} is defined twice")
        seen.add(g.name)
        if g.zone not in zone_of:
            errors.append(f"{where}.zone: unknown zone {g.zone!r} (zones: {', '.join(zone_of)})")
        try:
            kinds[g.name] = resolve_kind(g.gpu, overrides)
        except UnknownGpuKind as exc:
            errors.append(f"{where}.gpu: {exc}")
    pair_links = _pair_links(spec, zone_of, errors)
    rack_of = _racks(spec, errors)
    if errors:
        raise ConfigError(f"invalid cluster spec ({source}):\n  " + "\n  ".join(errors))
    return Cluster(spec, kinds, zone_of, pair_links, rack_of)


def one_kind(cl: Cluster, kind: str) -> Cluster:
    """The inventory's machines of one GPU kind, in their zones and racks (the one-kind
    inventory a baseline plans on); machine names are unchanged."""
    groups = [g for g in cl.spec.node_groups if cl.kinds[g.name].name == kind]
    names = {g.name for g in groups}
    racks = []
    for r in cl.spec.racks:
        members = [mb for mb in r.members if mb.group in names]
        if members:
            racks.append(r.model_copy(update={"members": members}))
    spec = cl.spec.model_copy(
        update={"name": f"{cl.spec.name} ({kind} only)", "node_groups": groups, "racks": racks}
    )
    return make_cluster(spec, spec.name)


def merge_identical(cl: Cluster) -> tuple[Cluster, dict[str, str]]:
    """Node groups whose machines are interchangeable (same GPU, GPUs per node, zone,
    price, intra-node link and NIC, none in a rack) as one group, so that the planner's
    work grows with the kinds of machine, not with how they were bought. Returns the
    merged cluster and the merged machine names that differ from the inventory's (machine
    i of a merged group is the i-th machine of its members, in spec order)."""
    racked = {mb.group for r in cl.spec.racks for mb in r.members}
    members: dict[tuple, list[NodeGroup]] = {}
    for g in cl.spec.node_groups:
        key = (
            (g.name,)
            if g.name in racked
            else (
                g.gpu,
                g.gpus_per_node,
                g.zone,
                g.usd_per_gpu_hour,
                g.intra_node.kind,
                g.intra_node.bandwidth_gbs,
                g.nic_gbs,
            )
        )
        members.setdefault(key, []).append(g)
    if len(members) == len(cl.spec.node_groups):
        return cl, {}
    groups: list[NodeGroup] = []
    names: dict[str, str] = {}
    for same in members.values():
        head = same[0]
        groups.append(head.model_copy(update={"nodes": sum(g.nodes for g in same)}))
        offset = 0
        for g in same:
            for i in range(g.nodes):
                if g is not head:
                    names[machine_name(head.name, offset + i)] = machine_name(g.name, i)
            offset += g.nodes
    spec = cl.spec.model_copy(update={"node_groups": groups})
    return make_cluster(spec, cl.spec.name), names


def machine_name(group: str, index: int) -> str:
    return f"{group}-{index}"


def _racks(spec: ClusterSpec, errors: list[str]) -> dict[str, str]:
    """Machine -> rack; a rack's machines exist, sit in one zone, and in no other rack."""
    gmap = {g.name: g for g in spec.node_groups}
    rack_of: dict[str, str] = {}
    names: set[str] = set()
    for i, rack in enumerate(spec.racks):
        where = f"racks[{i}] ({rack.name})"
        if rack.name in names:
            errors.append(f"{where}.name: rack {rack.name!r} is defined twice")
        names.add(rack.name)
        zones: set[str] = set()
        for j, mem in enumerate(rack.members):
            at = f"{where}.members[{j}]"
            g = gmap.get(mem.group)
            if g is None:
                errors.append(
                    f"{at}.group: unknown node group {mem.group!r} (node groups: {', '.join(gmap)})"
                )
                continue
            if mem.first + mem.count > g.nodes:
                errors.append(
                    f"{at}: machines {mem.first}..{mem.first + mem.count - 1} of {g.name!r} "
                    f"do not exist (the group has {g.nodes}: 0..{g.nodes - 1})"
                )
                continue
            zones.add(g.zone)
            for n in range(mem.first, mem.first + mem.count):
                m = machine_name(g.name, n)
                if m in rack_of:
                    errors.append(f"{at}: machine {m!r} is already in rack {rack_of[m]!r}")
                rack_of[m] = rack.name
        if len(zones) > 1:
            errors.append(
                f"{where}.members: a rack sits in one zone; its machines are in "
                f"{', '.join(sorted(zones))}"
            )
    return rack_of


def _pair_links(
    spec: ClusterSpec, zone_of: dict[str, Zone], errors: list[str]
) -> dict[tuple[str, str], LinkInfo]:
    """Zone-pair links: a zone link wins over a region link; every pair must have one."""
    regions = {z.region for z in zone_of.values()}
    zone_links: dict[tuple[str, str], LinkInfo] = {}
    region_links: dict[tuple[str, str], LinkInfo] = {}
    for i, ln in enumerate(spec.links):
        info = LinkInfo(ln.bandwidth_gbs, ln.latency_ms)
        if ln.a in zone_of and ln.b in zone_of and ln.a != ln.b:
            zone_links[tuple(sorted((ln.a, ln.b)))] = info
        elif ln.a in regions and ln.b in regions and ln.a != ln.b:
            region_links[tuple(sorted((ln.a, ln.b)))] = info
        else:
            errors.append(
                f"links[{i}]: {ln.a!r} - {ln.b!r} must name two different zones "
                f"({', '.join(zone_of)}) or two different regions ({', '.join(sorted(regions))})"
            )
    used = {g.zone for g in spec.node_groups if g.zone in zone_of}
    out: dict[tuple[str, str], LinkInfo] = {}
    for za, zb in combinations(sorted(zone_of), 2):
        key = (za, zb)
        rkey = tuple(sorted((zone_of[za].region, zone_of[zb].region)))
        info = zone_links.get(key) or region_links.get(rkey)
        if info is None:
            if za in used and zb in used:
                errors.append(
                    f"links: zones {za!r} and {zb!r} have no link (add one between the zones "
                    f"or, across regions, between regions {rkey[0]!r} and {rkey[1]!r})"
                )
            continue
        out[key] = info
    return out
