"""A cluster in a box: the YAML that `areal-hex box up|down` reads.

A box is a small heterogeneous cluster emulated on one Linux machine. Each machine (a
*node*) is a network namespace; the nodes of a rack hang off one bridge, and every rack
reaches the others through its uplink. Each node's NIC and each rack's uplink are shaped
to the bandwidth the YAML states. A *kind* is an emulated device class: a CPU share (a
cgroup quota) and the inference engine's batch limit (its KV-cache budget), so that two
kinds differ in comparative advantage, not only in speed.

    name: mix                         # 1-6 of [a-z0-9]: it prefixes every name the box makes
    kinds:
      fast:                           # compute-rich: a large CPU share, a small KV budget
        cpu: 0.9                      # cores (CFS quota / period)
        max_running_requests: 8       # the built-in engine's batch limit
        usd_per_hour: 3.0
        nic_mbit: 1000                # each node's NIC, per direction
      mem:                            # memory-rich: a small CPU share, a large KV budget
        cpu: 0.4
        max_running_requests: 64
        usd_per_hour: 1.0
        nic_mbit: 1000
    racks:
      - name: a
        uplink_mbit: 200              # rack <-> spine, per direction, shared by the rack
        members: [{kind: fast, count: 1}, {kind: mem, first: 1, count: 1}]
      - name: b
        uplink_mbit: 200
        members: [{kind: mem, first: 0, count: 1}]

Nodes are named `KIND-i` (as `scheduler/cluster.py` names machines `GROUP-i`); `first`
numbers them as a site's host file does, independently of the racks.
"""

from __future__ import annotations

import ipaddress
import zlib
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from areal_hex.config import ConfigError
from areal_hex.config.base import Section, build, read_yaml

NAME_PATTERN = r"^[a-z0-9]{1,6}$"


class BoxKind(Section):
    cpu: float = Field(gt=0, le=64)  # cores: the cgroup's CPU quota over its period
    max_running_requests: int = Field(gt=0)  # the built-in engine's batch (KV budget)
    usd_per_hour: float = Field(gt=0)
    nic_mbit: float = Field(gt=0)  # each node's NIC, per direction


class BoxMembers(Section):
    kind: str
    first: int | None = Field(None, ge=0)  # first node index of the kind (None: next free)
    count: int = Field(gt=0)


class BoxRack(Section):
    name: str = Field(pattern=r"^[a-z0-9-]{1,16}$")
    uplink_mbit: float = Field(gt=0)
    members: list[BoxMembers] = Field(min_length=1)


class BoxSpec(Section):
    name: str = Field(pattern=NAME_PATTERN)
    # Every node gets an address in it; None: 10.91.X.0/24 with X from the name.
    subnet: str | None = None
    kinds: dict[str, BoxKind] = Field(min_length=1)
    racks: list[BoxRack] = Field(min_length=1)


@dataclass(frozen=True)
class BoxNode:
    name: str  # KIND-i
    kind: str
    rack: int  # index into BoxSpec.racks
    index: int  # position in the box (addresses, interface names)


@dataclass(frozen=True)
class Box:
    spec: BoxSpec
    nodes: list[BoxNode]
    network: ipaddress.IPv4Network

    @property
    def name(self) -> str:
        return self.spec.name

    def node(self, name: str) -> BoxNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"box {self.name!r} has no node {name!r} (nodes: {self.node_names()})")

    def node_names(self) -> str:
        return ", ".join(n.name for n in self.nodes)

    def address(self, node: BoxNode) -> str:
        return str(self.network.network_address + node.index + 1)

    @property
    def host_address(self) -> str:
        """The root namespace's address on the spine: the launcher reaches every node
        through the node's rack uplink, as a head node outside the racks would."""
        return str(self.network.broadcast_address - 1)


def load_box(path: str | Path) -> Box:
    spec = build(BoxSpec, read_yaml(path), str(path), "box")
    return make_box(spec, str(path))


def make_box(spec: BoxSpec, source: str = "box spec") -> Box:
    errors: list[str] = []
    for name in spec.kinds:
        if not _is_kind_name(name):
            errors.append(f"kinds.{name}: a kind name is 1-12 of [a-z0-9] (it names nodes)")
    nodes = _nodes(spec, errors)
    network = _network(spec, len(nodes), errors)
    if errors:
        raise ConfigError(f"invalid box ({source}):\n  " + "\n  ".join(errors))
    assert network is not None
    return Box(spec, nodes, network)


def _is_kind_name(name: str) -> bool:
    return 1 <= len(name) <= 12 and name.isascii() and name.isalnum() and name.islower()


def _nodes(spec: BoxSpec, errors: list[str]) -> list[BoxNode]:
    nodes: list[BoxNode] = []
    taken: dict[str, set[int]] = {k: set() for k in spec.kinds}
    racks: dict[str, int] = {}
    for r, rack in enumerate(spec.racks):
        if rack.name in racks:
            errors.append(
                f"racks[{r}].name: rack {rack.name!r} is already racks[{racks[rack.name]}]'s "
                "name (expected a name of its own)"
            )
        racks.setdefault(rack.name, r)
        for j, mem in enumerate(rack.members):
            at = f"racks[{r}] ({rack.name}).members[{j}]"
            if mem.kind not in spec.kinds:
                errors.append(
                    f"{at}.kind: unknown kind {mem.kind!r} (kinds: {', '.join(spec.kinds)})"
                )
                continue
            used = taken[mem.kind]
            first = mem.first if mem.first is not None else (max(used) + 1 if used else 0)
            for i in range(first, first + mem.count):
                if i in used:
                    errors.append(f"{at}: node {mem.kind}-{i} is already in a rack")
                    continue
                used.add(i)
                nodes.append(BoxNode(f"{mem.kind}-{i}", mem.kind, r, len(nodes)))
    for kind, used in taken.items():
        if not used:
            errors.append(
                f"kinds.{kind}: no rack holds a node of this kind (expected a member "
                f"{{kind: {kind}, count: N}} in some rack, or no kind {kind!r})"
            )
        elif used != set(range(len(used))):
            errors.append(
                f"kinds.{kind}: nodes are numbered {kind}-0..{kind}-{len(used) - 1} without "
                f"gaps (got {sorted(used)})"
            )
    if not nodes and not errors:
        errors.append("racks: the box has no nodes")
    if len(nodes) > 99:
        errors.append(f"racks: {len(nodes)} nodes; a box holds at most 99")
    return nodes


def _network(spec: BoxSpec, count: int, errors: list[str]) -> ipaddress.IPv4Network | None:
    text = spec.subnet or f"10.91.{zlib.crc32(spec.name.encode()) % 250}.0/24"
    try:
        net = ipaddress.IPv4Network(text)
    except ValueError as exc:
        errors.append(f"subnet: {exc} (expected e.g. 10.91.7.0/24)")
        return None
    if net.num_addresses < count + 4:
        errors.append(f"subnet: {text} holds {net.num_addresses} addresses; {count + 4} needed")
    return net
