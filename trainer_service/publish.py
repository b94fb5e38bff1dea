"""Weight publication: gather the full weights, then either write an HF directory `v<N>`
atomically and announce it (disk; old versions are garbage-collected), or announce `v<N>`
and broadcast it to the inference servers in buckets (network, `NetworkSink`; the
sequence is in rollout_service/controller/weight_sync.py).

The gather is the only part on the training critical path (it is collective under
ZeRO-3); writing the files, the rename and `set_version` run on a background thread
while the next step fetches its batch and runs forward and backward; the trainer waits
for the write only before its next optimizer step, so under ZeRO 0-2 no copy of the
weights is needed. v0 (the initial model) is never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex.run_files import version_dir
from areal_hex.weight_net import (
    GROUP_NAME,
    Backend,
    GroupSpec,
    Manifest,
    WeightGroup,
    open_store,
    plan_buckets,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# files of a model directory that are weights or config; everything else (tokenizer,
# generation config, chat template) is copied from the initial model as is
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.index\.json$|^config\.json$")
_VERSION_DIR = re.compile(r"^v(\d+)$")


def full_state_dict(engine: Any, zero_stage: int, rank: int) -> dict[str, torch.Tensor] | None:
    """Every weight on rank 0 (None elsewhere): the live parameters under ZeRO 0-2 (no
    copy: they must be written before the next optimizer step changes them), a gathered
    copy under ZeRO-3 (collective). Tied parameters (lm_head = embed_tokens) appear once."""
    module = engine.module
    if zero_stage == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
    else:
        sd = module.state_dict() if rank == 0 else None
    if rank != 0 or sd is None:
        return None
    unique = {n for n, _ in module.named_parameters()}
    every = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v.detach() for k, v in sd.items() if k in unique or k not in every}


def write_model_dir(
    tensors: dict[str, torch.Tensor], src_dir: str | Path, out_dir: str | Path
) -> Path:
    """Write `out_dir` (model.safetensors + config.json + the tokenizer files of
    `src_dir`) via a temp dir next to it and one rename; replaces an existing `out_dir`."""
    from safetensors.torch import save_file

    src, out = Path(src_dir), Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    host = {k: v if v.device.type == "cpu" else v.to("cpu") for k, v in tensors.items()}
    save_file(host, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    dtype = str(next(iter(host.values())).dtype).removeprefix("torch.")
    config["torch_dtype"] = config["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and not _WEIGHT_FILES.match(f.name):
            _link_or_copy(f, tmp / f.name)
    if out.exists():
        # re-publication after a resume: the old directory is replaced as a whole
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link a read-only tokenizer file (no data copied); copy across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def collect_versions(weights_dir: str | Path, keep: int, current: int | None = None) -> list[Path]:
    """Delete version directories beyond the newest `keep` (never v0); returns removed.

    With `current` (the version just written), versions above it are deleted first: they
    were published by a trainer that died after its last checkpoint, and a resumed one
    writes its restored version below them. Left there, they would push that version out
    of the newest `keep` the moment it is written (the servers would find it gone), and a
    restarted server would load weights the buffer no longer counts."""
    root = Path(weights_dir)
    found = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _VERSION_DIR.match(p.name))
    )
    removed = []
    if current is not None:
        removed = [p for v, p in found if v > current]
        found = [(v, p) for v, p in found if v <= current]
    removed += [p for v, p in (found[:-keep] if keep < len(found) else []) if v != 0]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


@dataclass
class NetworkSink:
    """Version N over the network: rank 0 of the weight-update group, the servers ranks
    1..S. Per version: plan the buckets, leave the manifest for the controller, announce
    N (the controller then pauses the servers and asks each for every bucket in order),
    join the group if not yet joined (sized to the members the controller recorded for
    it, the servers up then: `members`; it forms once they have joined, or fails in
    `join_timeout_s`), broadcast bucket by bucket. A server that came up since asks
    for a new group (`regroup_asked`): the next version forms one. A failed broadcast
    (a server gone) drops the group: the next version forms a new one (`group_name`
    with the next epoch), which the controller sees in the manifest and has the
    servers join, and the version not delivered is kept in `undelivered` for the
    trainer to send again (Trainer.redeliver). Each trainer process names its groups
    with its own `incarnation`, so a restarted trainer never meets servers still in
    the group of the one that died."""

    master_address: str
    master_port: int
    server_ranks: int  # the servers' ranks in the group (SGLang: one per TP rank)
    backend: Backend
    bucket_bytes: int
    timeout_s: float
    put_manifest: Callable[[Manifest], None]
    ifname: str | None = None
    # the group's members as the controller records them (group name, how long to wait
    # -> the servers' URLs; None: every planned server), and the group it asks to replace
    members: Callable[[str, float], list[str]] | None = None
    regroup_asked: Callable[[], str | None] = lambda: None
    ranks_per_server: int = 1
    join_timeout_s: float | None = None  # the members' record, the rendezvous (timeout_s)
    epoch: int = 0
    last_sync_s: float = 0.0
    failures: int = 0
    undelivered: int | None = None  # the version whose broadcast failed last, if any
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _last_group: str | None = None  # of the last manifest left
    _group: WeightGroup | None = field(default=None, repr=False)
    _store: Any = field(default=None, repr=False)  # the TCPStore, kept across groups

    def group_spec(self) -> GroupSpec:
        return GroupSpec(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.server_ranks + 1,
            group_name=f"{GROUP_NAME}-{self.incarnation}-{self.epoch}",
            backend=self.backend,
        )

    def publish(
        self, version: int, tensors: dict[str, torch.Tensor], announce: Callable[[int, str], None]
    ) -> None:
        t0 = time.perf_counter()
        # gloo sends host memory; NCCL the device tensors as they are
        if self.backend == "gloo":
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        if self._group is not None and self.regroup_wanted():  # a server came up since
            log.info("weights v%d: a new group, with every server up now", version)
            self.regroup()
        manifest = Manifest(version, self.group_spec(), plan_buckets(tensors, self.bucket_bytes))
        self.put_manifest(manifest)
        self._last_group = manifest.group.group_name
        announce(version, "")  # no directory: the weights come over the group
        try:
            if self._group is None and not self._form(manifest.group):
                log.warning(
                    "weights v%d: no inference server is in group %s; a server that comes "
                    "up asks for a new one",
                    version,
                    manifest.group.group_name,
                )
                self.regroup()
                self.undelivered = None
                return
            assert self._group is not None
            for bucket in manifest.buckets:
                self._group.broadcast([tensors[n] for n in bucket.names])
        except RuntimeError as exc:  # a server left or never joined (c10d's errors)
            self.failures += 1
            self.undelivered = version
            self.regroup()
            log.warning(
                "weights v%d not delivered over the network (%s); it is sent again, or the "
                "next version, over group %s",
                version,
                exc,
                self.group_spec().group_name,
            )
            return
        self.undelivered = None
        self.last_sync_s = time.perf_counter() - t0

    def _form(self, group: GroupSpec) -> bool:
        """Join `group` as rank 0, sized to the members the controller recorded for it;
        False when it has none."""
        if self.members is not None:
            urls = self.members(group.group_name, self._join_s)
            if not urls:
                return False
            group = replace(group, world_size=1 + len(urls) * self.ranks_per_server)
        if self._store is None:
            self._store = open_store(group, 0, self.timeout_s)
        self._group = WeightGroup.join(
            group, 0, self.timeout_s, self.ifname, self._store, self._join_s
        )
        return True

    @property
    def _join_s(self) -> float:
        return self.timeout_s if self.join_timeout_s is None else self.join_timeout_s

    def regroup_wanted(self) -> bool:
        """Whether the controller asked for a group other than the last one left (a
        server that is up is not in it)."""
        return self._last_group is not None and self.regroup_asked() == self._last_group

    def regroup(self) -> None:
        """Leave the group: the next version (or this one again) forms a new one."""
        self.close()
        self.epoch += 1

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


@dataclass
class Redelivery:
    """When rank 0, waiting for a batch, sends its current version over the network
    again (a new group): at once when the last broadcast failed (`NetworkSink.undelivered`),
    at once when the controller asks for a new group (a server that came up is not in
    the last one), or when no group has arrived for `after_s` — a server that restarted
    since the last broadcast holds its initial weights, and the controller's gate holds
    its groups back
    until it has the current version. `after_s` starts at `min_s` and is at least three
    times the longest wait between groups seen so far (a slow generation is not taken
    for a lost server); each redelivery doubles it, up to `max_s`."""

    min_s: float = 30.0
    max_s: float = 600.0
    after_s: float = 30.0
    longest_gap_s: float = 0.0
    last_group: float = field(default_factory=time.monotonic)
    tries: int = 0

    def group_arrived(self, now: float) -> None:
        self.longest_gap_s = max(self.longest_gap_s, now - self.last_group)
        self.last_group = now
        self.after_s = max(self.min_s, 3 * self.longest_gap_s)

    def due(self, sink: NetworkSink, now: float) -> bool:
        if sink.regroup_wanted():
            return True
        idle = now - self.last_group
        return idle >= (self.min_s / 10 if sink.undelivered is not None else self.after_s)

    def sent(self, now: float) -> None:
        self.tries += 1
        self.last_group = now
        self.after_s = min(2 * self.after_s, self.max_s)


class AsyncPublisher:
    """Publishes versions on one background thread: to disk (`announce(version, path)`
    runs after each write: the buffer's `set_version`), or to `network`. At most one
    publication is in flight: `submit` waits for the previous one, so versions are
    announced in order."""

    def __init__(
        self,
        weights_dir: str | Path,
        src_dir: str | Path,
        keep_versions: int,
        announce: Callable[[int, str], None],
        network: NetworkSink | None = None,
    ) -> None:
        self.network = network
        self.weights_dir = Path(weights_dir)
        self.src_dir = Path(src_dir)
        self.keep = keep_versions
        self.announce = announce
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_s = 0.0
        # from the last write's hand-on (`submit`) to its start on the writing thread
        self.last_start_delay_s = 0.0
        self._handed_on = 0.0
        self.published: list[int] = []

    def submit(self, version: int, tensors: dict[str, torch.Tensor]) -> float:
        """Start writing `v<version>`; returns seconds spent waiting for the previous
        write. Live tensors must not change until `wait()` returns (the trainer waits
        right before its next optimizer step, so the write overlaps that step's
        forward and backward passes)."""
        waited = self.wait()
        self._handed_on = time.perf_counter()
        self._thread = threading.Thread(
            target=self._write, args=(version, tensors), name=f"publish-v{version}", daemon=True
        )
        self._thread.start()
        return waited

    def publish_now(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        announce: bool = True,
        via: Callable[[int, str], None] | None = None,
    ) -> None:
        """Publish on this thread; `via` announces it instead of `announce` (over the
        network, after the manifest is left: a restore of the buffer's version)."""
        self.wait()
        self._write(version, tensors, announce, via)
        self._raise()

    def wait(self) -> float:
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
        return time.perf_counter() - t0

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"weight publication failed: {err}") from err

    def _write(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        announce: bool = True,
        via: Callable[[int, str], None] | None = None,
    ) -> None:
        try:
            t0 = time.perf_counter()
            self.last_start_delay_s = max(0.0, t0 - self._handed_on) if self._handed_on else 0.0
            self._handed_on = 0.0
            if self.network is not None:
                self.network.publish(version, tensors, via or self.announce)
                self.last_write_s = time.perf_counter() - t0
                self.published.append(version)
                return
            path = write_model_dir(tensors, self.src_dir, version_dir(self.weights_dir, version))
            self.last_write_s = time.perf_counter() - t0
            if announce:
                self.announce(version, str(path.resolve()))
            self.published.append(version)
            collect_versions(self.weights_dir, self.keep, current=version)
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = exc


CLONE_NEWNET = 0x40000000  # setns(2): join a network namespace


def broadcast_versions(
    model_dir: str,
    address: str,
    port: int | None,
    bucket_mb: float,
    go: Any,
    out: Any,
    netns: str | None = None,
    epoch: int = 0,
) -> None:
    """A trainer's rank 0 on its own (the target of a spawned process): on each version
    `go` gives, the weights of `model_dir` over a `NetworkSink`, the trainer's own code;
    None ends it, "regroup" leaves the group (the next version forms a new one). `out`
    hears ("manifest", JSON, time) once the manifest is left and ("sent", seconds,
    failures) once the broadcast is done. `netns`: the network
    namespace (`ip netns` name) to join first, before any socket is made; `port`: None
    takes a free one at `address` there; `epoch`: the first group's (a new name for a
    server that joined an earlier one)."""
    if netns is not None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
        finally:
            os.close(fd)
    from areal_hex.models import load_model
    from areal_hex.weight_net import free_port

    model = load_model(model_dir, "cpu", "float32")
    # tied to the embedding: published once, as the trainer's state dict has it
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sink = NetworkSink(
        master_address=address,
        master_port=port if port is not None else free_port(address),
        server_ranks=1,
        backend="gloo",
        bucket_bytes=int(bucket_mb * 2**20),
        timeout_s=120.0,
        put_manifest=lambda m: out.put(("manifest", m.to_json(), time.time())),
        epoch=epoch,
    )
    try:
        while (version := go.get()) is not None:
            if version == "regroup":
                sink.regroup()
                continue
            sink.publish(version, tensors, lambda v, p: None)
            out.put(("sent", sink.last_sync_s, sink.failures))
    finally:
        sink.close()
