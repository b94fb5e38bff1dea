"""The devices `areal-hex run` uses on this machine, as `profile --local` times them: on a
CUDA host its GPUs (one kind); on a CPU-only host the two core groups `run.pin_cores`
makes (the inference servers' cores and the trainer's), each with the thread count the
run gives it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from areal_hex.config import ExperimentConfig

REPEATS = 3  # median of: the machine may be shared, and the run will see the same load

Say = Callable[[str], None]  # hears each stage of a profile as it begins


def quiet(_text: str) -> None:
    pass


@dataclass
class LocalDevices:
    kind: str  # "CPU" or the GPU's catalogue name
    device: str  # "cpu" | "cuda"
    count: int  # devices the planner may place services on
    inference_cores: set[int] | None  # pinning while timing generation (CPU)
    trainer_cores: set[int] | None
    inference_threads: int
    trainer_threads: int
    memory_gb: float  # per device
    # A box node (`areal-hex box`): the command prefix that starts a process inside it
    # (its namespace and cgroup), the address its server binds, the cgroup the trainer's
    # timing process joins. Empty / loopback / None on this machine's own devices.
    node_prefix: list[str] = field(default_factory=list)
    address: str = "127.0.0.1"
    cgroup: str | None = None
    netns: str | None = None  # its network namespace (`ip netns` name)
    # cgroups of the node's quota beside it, one per receiver of the training profile's
    # send to two servers (`profile.training`: `broadcast_pair_s`); empty: none made
    receiver_cgroups: tuple[str, ...] = ()
    # Timings repeated (medians of), and the shortest measured window of a continuous
    # load, s: a box node's quota throttles every 10 ms, so its figures need more and
    # longer samples than a machine's own cores to repeat from one profile to the next.
    repeats: int = REPEATS
    min_window_s: float = 1.0
    # Decode steps, s, that a batch's pairs of waves must add up to (0: REPEATS pairs
    # and their median): a few steps of a quota-throttled node swing with the period.
    min_decode_s: float = 0.0


def local_devices(cfg: ExperimentConfig) -> LocalDevices:
    import torch

    from hexctl.job.cores import core_groups

    if cfg.inference.device.startswith("cuda") and torch.cuda.is_available():
        from areal_hex.device_kind import device_kind

        return LocalDevices(
            kind=device_kind("cuda"),
            device="cuda",
            count=torch.cuda.device_count(),
            inference_cores=None,
            trainer_cores=None,
            inference_threads=1,
            trainer_threads=1,
            memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9,
        )
    inf, tr = core_groups(cfg.run.pin_cores, cfg.workflow.placement)
    total = os.cpu_count() or 1
    mem = _host_memory_gb()
    if inf is None or tr is None:  # no pinning: both sides share every core
        return LocalDevices("CPU", "cpu", 2, None, None, max(1, total // 2), total, mem / 2)
    per_server = max(1, len(inf) // max(1, cfg.inference.num_servers))
    return LocalDevices("CPU", "cpu", 2, inf, tr, per_server, len(tr), mem / 2)


def _host_memory_gb() -> float:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size / 1e9
    except (ValueError, OSError):
        return 8.0


@contextlib.contextmanager
def pinned(cores: set[int] | None, threads: int) -> Iterator[None]:
    """Run the block on `cores` with `threads` torch threads, as `run` starts a service."""
    import torch

    before_threads = torch.get_num_threads()
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cores is not None and before is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before_threads)
        if cores is not None and before is not None:
            os.sched_setaffinity(0, before)


@contextlib.contextmanager
def passive_waits(dev: LocalDevices) -> Iterator[None]:
    """Where the server and the trainer share cores (colocated), the processes the
    profile starts wait asleep at their OpenMP barriers, as `run` starts them
    (`OMP_WAIT_POLICY=PASSIVE`): spinning, they take the cores from the controller and
    from each other."""
    shared = dev.inference_cores and dev.trainer_cores and dev.inference_cores & dev.trainer_cores
    before = os.environ.get("OMP_WAIT_POLICY")
    if shared:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        if shared and before is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        elif shared and before is not None:
            os.environ["OMP_WAIT_POLICY"] = before
