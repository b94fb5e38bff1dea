"""Weights over the network: what the trainer and the inference servers share.

SGLang's protocol (`/init_weights_update_group`, `/update_weights_from_distributed`): a
torch.distributed group of 1 + S ranks, the trainer's rank 0 the source and server i
rank 1 + i, joined once and reused for every version; each version goes as buckets of
tensors, one broadcast per tensor, in the order of the bucket's `names`. The sequence
across processes is in rollout_service/controller/weight_sync.py.

Here: the group's address (`GroupSpec`), a version's bucket list (`Manifest`, which the
trainer leaves in Redis for the controller), bucket planning, and `WeightGroup`, a
standalone group (its own TCPStore and gloo or NCCL backend, never the default group:
a DeepSpeed trainer already has one, and a server must not touch it).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Backend = Literal["gloo", "nccl"]
GROUP_NAME = "areal-hex-weights"
MANIFEST_TTL_S = 3600  # a manifest outlives its broadcast long enough for any reader


@dataclass(frozen=True)
class GroupSpec:
    """Where the group meets (the trainer's TCPStore) and its size; SGLang's
    `/init_weights_update_group` body, less the server's own `rank_offset`."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: Backend


@dataclass(frozen=True)
class BucketSpec:
    """One `/update_weights_from_distributed` call: tensors broadcast in this order."""

    names: list[str]
    dtypes: list[str]  # torch dtype names without "torch." ("bfloat16")
    shapes: list[list[int]]

    @property
    def nbytes(self) -> int:
        return sum(_numel(s) * dtype_size(d) for s, d in zip(self.shapes, self.dtypes, strict=True))


@dataclass(frozen=True)
class Manifest:
    """Version N as the trainer broadcasts it: the group and its buckets, in order."""

    version: int
    group: GroupSpec
    buckets: list[BucketSpec]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        d = json.loads(text)
        return cls(
            version=int(d["version"]),
            group=GroupSpec(**d["group"]),
            buckets=[BucketSpec(**b) for b in d["buckets"]],
        )

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def manifest_key(run_id: str, version: int) -> str:
    return f"{run_id}:weights_manifest:{version}"


def members_key(run_id: str, group_name: str) -> str:
    """Where a group's members are recorded: the servers' URLs, in rank order."""
    return f"{run_id}:weights_members:{group_name}"


def regroup_key(run_id: str) -> str:
    """The group the controller asks the trainer to replace (a server is not in it)."""
    return f"{run_id}:weights_regroup"


def agree_members(
    get: Callable[[], str | bytes | None],
    set_if_absent: Callable[[str], object],
    timeout_s: float,
    poll_s: float = 0.1,
) -> list[str]:
    """The trainer's side of a group's membership: the member list the controller records
    (the servers healthy when it starts the update), waited for up to `timeout_s`; then
    the group is claimed empty (set only if still absent, so a controller that records it
    at the same moment is either read back or finds it taken and joins nobody to it)."""
    deadline = time.monotonic() + timeout_s
    while (raw := get()) is None and time.monotonic() < deadline:
        time.sleep(poll_s)
    if raw is None:
        set_if_absent("[]")
        raw = get()
    return [] if raw is None else list(json.loads(raw))


# ---------------------------------------------------------------- tensors
def _numel(shape: list[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` -> torch.bfloat16; ValueError for anything else."""
    import torch

    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not (dt.is_floating_point or dt == torch.int64):
        raise ValueError(f"unknown or unsupported dtype {name!r} (expected e.g. 'bfloat16')")
    return dt


def dtype_size(name: str) -> int:
    return int(parse_dtype(name).itemsize)


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def plan_buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[BucketSpec]:
    """Tensors in state-dict order, cut into buckets of at most `bucket_bytes` (a tensor
    larger than that is a bucket of its own)."""
    buckets: list[BucketSpec] = []
    cur: list[str] = []
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            buckets.append(_spec(tensors, cur))
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        buckets.append(_spec(tensors, cur))
    return buckets


def _spec(tensors: dict[str, torch.Tensor], names: list[str]) -> BucketSpec:
    return BucketSpec(
        names=list(names),
        dtypes=[dtype_name(tensors[n]) for n in names],
        shapes=[list(tensors[n].shape) for n in names],
    )


# ---------------------------------------------------------------- addresses
def address_toward(host: str, port: int = 9) -> str:
    """This machine's address on the route to `host` (no packet is sent): the address a
    peer there can reach us at, with no localhost assumption."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def free_port(host: str) -> int:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- the group
class WeightGroup:
    """One rank of a weight-update group. Rank 0 hosts the TCPStore; `join` blocks until
    all `world_size` ranks have joined (or `timeout_s` passes: RuntimeError)."""

    def __init__(
        self, spec: GroupSpec, rank: int, pg: Any, store: Any, timeout_s: float = 300.0
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.timeout_s = timeout_s  # of every broadcast: a peer gone fails it (RuntimeError)
        self._pg = pg
        self._store = store  # kept alive: rank 0's store serves the others

    @classmethod
    def join(
        cls,
        spec: GroupSpec,
        rank: int,
        timeout_s: float,
        ifname: str | None = None,
        store: Any = None,
        join_timeout_s: float | None = None,
    ) -> WeightGroup:
        """`store`: rank 0's TCPStore from `open_store`, kept across groups (a store
        made anew on the same port can leave the old listener in the way).
        `join_timeout_s`: how long the rendezvous waits for a missing rank (default
        `timeout_s`, which bounds every broadcast after it)."""
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} outside the group's world size {spec.world_size}")
        join_s = timeout_s if join_timeout_s is None else join_timeout_s
        if store is None:
            store = open_store(spec, rank, join_s)
        store.set_timeout(datetime.timedelta(seconds=join_s))
        try:
            pg = _process_group(spec, rank, store, timeout_s, join_s, ifname)
        finally:
            store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return cls(spec, rank, pg, store, timeout_s)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0 sends `tensors`, the others receive into theirs, in list order (one
        broadcast each, as SGLang's receiver expects)."""
        import torch.distributed as dist

        works = []
        for t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.timeout = datetime.timedelta(seconds=self.timeout_s)
            works.append(self._pg.broadcast([t], opts))
        for w in works:
            if not w.wait(datetime.timedelta(seconds=self.timeout_s)):
                raise RuntimeError(
                    f"weight group {self.spec.group_name!r}: broadcast not done after "
                    f"{self.timeout_s:g} s"
                )

    def close(self) -> None:
        self._pg = None
        self._store = None


def _process_group(
    spec: GroupSpec, rank: int, store: Any, timeout_s: float, join_s: float, ifname: str | None
) -> Any:
    """The group's gloo or NCCL process group over `store` (under the group's prefix).
    gloo meets every rank here, within `join_s` (its broadcasts carry their own
    `timeout_s`); NCCL meets them at its first collective: `timeout_s` bounds each
    collective, so a peer that died fails it, not hangs."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(spec.group_name, store)
    if spec.backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, nccl_opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=join_s)
    opts._devices = [_gloo_device(spec.master_address, rank, ifname)]
    return dist.ProcessGroupGloo(prefixed, rank, spec.world_size, opts)


def open_store(spec: GroupSpec, rank: int, timeout_s: float) -> Any:
    """The group's TCPStore: served by rank 0 at the master address, a client elsewhere.
    Groups of later epochs use it under their own `group_name` prefix."""
    import torch.distributed as dist

    return dist.TCPStore(
        spec.master_address,
        spec.master_port,
        spec.world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _gloo_device(master: str, rank: int, ifname: str | None) -> Any:
    """The interface gloo listens on: `ifname` (or GLOO_SOCKET_IFNAME) when given, else the
    master's address on rank 0 and the address on the route to the master elsewhere."""
    import torch.distributed as dist

    iface = ifname or os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        return dist.ProcessGroupGloo.create_device(interface=iface)
    host = master if rank == 0 else address_toward(master)
    return dist.ProcessGroupGloo.create_device(hostname=host)
