"""The servers' side of the training profile's weight updates: processes that join
each weight-update group the trainer's `NetworkSink` forms and take every version, so
that the profile's steps publish over the network as a run's trainer does."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_hex.weight_net import Manifest
    from trainer_service.publish import NetworkSink

RECEIVE_TIMEOUT_S = 60.0  # a version's broadcast not taken in this long fails the profile


class WeightReceiver:
    """The servers' side of the weight-update group on its own: a spawned process per
    server rank that joins each group a manifest names (ranks 1, 2, ...) and takes every
    bucket of each version, so that the profile's steps publish over the network as the
    run's trainer does. The bytes go over this machine's loopback: the sender's work is
    the subject, not a link. `cgroups`: one per rank, the cgroup its process joins (None:
    one rank, in none)."""

    def __init__(self, cgroups: list[str | None] | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.cgroups = cgroups or [None]
        self.inboxes = [ctx.Queue() for _ in self.cgroups]
        self.done = ctx.Queue()
        ranks = enumerate(zip(self.inboxes, self.cgroups, strict=True), start=1)
        self.procs = [
            ctx.Process(
                target=receive_versions,
                args=(inbox, self.done, os.getpid(), rank, cgroup),
                daemon=True,
            )
            for rank, (inbox, cgroup) in ranks
        ]
        self._taken: dict[int, int] = {}  # version -> ranks that took it whole

    @property
    def proc(self) -> Any:
        """The first rank's process."""
        return self.procs[0]

    def __enter__(self) -> WeightReceiver:
        for proc in self.procs:
            proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():  # stuck in a broadcast nobody sends
                proc.kill()
                proc.join(5)

    def sink(self, bucket_mb: float) -> NetworkSink:
        """The trainer's `NetworkSink` toward this receiver."""
        from areal_hex.weight_net import free_port
        from trainer_service.publish import NetworkSink

        return NetworkSink(
            master_address=LOOPBACK,
            master_port=free_port(LOOPBACK),
            server_ranks=len(self.procs),
            backend="gloo",
            bucket_bytes=int(bucket_mb * 2**20),
            timeout_s=RECEIVE_TIMEOUT_S,
            put_manifest=self._put,
        )

    def _put(self, manifest: Manifest) -> None:
        text = manifest.to_json()
        for inbox in self.inboxes:
            inbox.put(text)

    def received(self) -> list[int]:
        """The versions every rank has taken whole since the last call."""
        import queue

        got = []
        with contextlib.suppress(queue.Empty):
            while True:
                version = self.done.get_nowait()
                self._taken[version] = self._taken.get(version, 0) + 1
                if self._taken[version] == len(self.procs):
                    got.append(version)
        return got


LOOPBACK = "127.0.0.1"


def receive_versions(
    inbox: Any, done: Any, parent: int, rank: int = 1, cgroup: str | None = None
) -> None:
    """`WeightReceiver`'s process for server rank `rank`, in `cgroup` where given: each
    manifest's buckets received (None ends it), the version put on `done` once whole. It
    ends by itself once `parent` (the process that started it) is gone, a profile killed
    outright: outside a cgroup it is in nothing `box down` kills (a receiver cgroup, under
    the box's, is emptied by `box down` too)."""
    import queue

    import torch

    from areal_hex.weight_net import Manifest, WeightGroup, parse_dtype

    if cgroup is not None:
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    group = None
    try:
        while True:
            try:
                text = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the profile was killed: nobody will send
                    return
                continue
            if text is None:
                return
            m = Manifest.from_json(text)
            if group is None or group.spec.group_name != m.group.group_name:
                if group is not None:
                    group.close()
                group = WeightGroup.join(m.group, rank, RECEIVE_TIMEOUT_S)
            for b in m.buckets:
                kinds = zip(b.shapes, b.dtypes, strict=True)
                group.broadcast([torch.empty(shape, dtype=parse_dtype(d)) for shape, d in kinds])
            done.put(m.version)
    finally:
        if group is not None:
            group.close()
