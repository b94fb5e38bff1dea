"""A box's CPU cgroups: each node's quota, its weight against the machine, where its CPU
use is counted, and their removal by name.

Every cgroup of box `<box>` lies under `areal-hex-box/<box>` in the `cpu` hierarchy (v1)
or the unified one (v2). Where cgroup v1 mounts `cpuacct` apart from `cpu` (the `cpu`
controller's own `cpu.stat` then counts throttling, not use), each node also gets a
`cpuacct` group of the same path, so that the CPU its processes used is counted by the
kernel, exited processes included (`hexctl/box/delivered.py` reads it).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from areal_hex.errors import UsageError

CGROUP_NAME = "areal-hex-box"
# A node's CPU quota is enforced per period: at the kernel's default 100 ms a fifth of a
# core runs 20 ms, then waits 80, longer than a decode step or a short request, so short
# timings swing with where they fall in the period. 10 ms keeps the share even at the
# scale of a step; a quota is at least the kernel's 1 ms, so tiny shares get longer periods.
CFS_PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
V1_ACCT = Path("/sys/fs/cgroup/cpuacct")


class BoxError(RuntimeError):
    """A command that builds or removes the box failed; the message holds its stderr."""


def cgroup_layout() -> tuple[str, Path]:
    """("v1" | "v2", the directory under which the box's cgroups go)."""
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return "v2", v2 / CGROUP_NAME
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").is_file():
        return "v1", v1 / CGROUP_NAME
    raise UsageError(
        "no cgroup CPU controller: neither cgroup v2 with `cpu` in "
        "/sys/fs/cgroup/cgroup.controllers nor v1 /sys/fs/cgroup/cpu/cpu.cfs_quota_us"
    )


def acct_root() -> Path | None:
    """Where the box's `cpuacct` groups go: a v1 `cpuacct` hierarchy mounted apart from
    `cpu`; None where the `cpu` cgroup counts its own use (v2, or v1 `cpu,cpuacct`)."""
    version, root = cgroup_layout()
    if version == "v2" or (root.parent / "cpuacct.usage").is_file():
        return None
    return V1_ACCT / CGROUP_NAME if (V1_ACCT / "cpuacct.usage").is_file() else None


def make_cgroup(path: Path, cpu: float) -> Path:
    """The `cpu` cgroup at `path` with a quota of `cpu` cores."""
    version, root = cgroup_layout()
    period = max(CFS_PERIOD_US, math.ceil(MIN_QUOTA_US / cpu))
    quota = max(MIN_QUOTA_US, int(cpu * period))
    if version == "v2":
        for d in (root.parent, root, path.parent):
            d.mkdir(exist_ok=True)
            # children of `d` may only use the controllers its subtree_control enables
            (d / "cgroup.subtree_control").write_text("+cpu")
        path.mkdir(exist_ok=True)
        (path / "cpu.max").write_text(f"{quota} {period}")
    else:
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(period))
        (path / "cpu.cfs_quota_us").write_text(str(quota))
    return path


def cgroup_quota(path: Path) -> float:
    """The cores `path`'s quota gives (`make_cgroup`'s `cpu`); a cgroup without a quota
    raises UsageError."""
    if (path / "cpu.max").is_file():  # v2: "<quota> <period>" or "max <period>"
        quota, period = (path / "cpu.max").read_text().split()
    else:
        quota = (path / "cpu.cfs_quota_us").read_text().strip()
        period = (path / "cpu.cfs_period_us").read_text().strip()
    if quota in ("max", "-1"):
        raise UsageError(f"cgroup {path} has no CPU quota")
    return int(quota) / int(period)


@contextlib.contextmanager
def receiver_cgroups(node_cgroup: str, n: int) -> Iterator[tuple[str, ...]]:
    """`n` cgroups beside a node's, each with its quota: where the profile's receivers
    take a version at the pace of a server on a node of the kind. Removed after the
    block, with anything left in them (`box down` removes any a killed profile left:
    they lie under the box's cgroup)."""
    cpu = cgroup_quota(Path(node_cgroup))
    made = [make_cgroup(Path(f"{node_cgroup}-receiver{i}"), cpu) for i in range(1, n + 1)]
    try:
        yield tuple(str(p) for p in made)
    finally:
        for path in made:
            empty_cgroup(path)


def make_acct(box_name: str, node: str) -> str:
    """The node's `cpuacct` group (made), or "" where its `cpu` cgroup counts its use."""
    root = acct_root()
    if root is None:
        return ""
    path = root / box_name / node
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def weigh(root: Path, box_dir: Path, nodes: int) -> None:
    """CPU weights: under contention the scheduler treats a cgroup as one task of its
    weight against the tasks beside it, so a box at the default weight would get what
    one process gets, all its nodes together. Weighted as one process per node, each
    node competes for the machine as a process of its own would (its quota still caps
    it). The shared parent is weighted for the largest box (99 nodes)."""
    version, _ = cgroup_layout()
    name, unit = ("cpu.weight", 100) if version == "v2" else ("cpu.shares", 1024)
    (root / name).write_text(str(unit * 99))
    (box_dir / name).write_text(str(unit * nodes))


def _roots() -> list[Path]:
    try:
        _, root = cgroup_layout()
    except UsageError:
        return []
    acct = acct_root()
    return [root] + ([acct] if acct is not None else [])


def leftover_cgroups(box_name: str) -> list[str]:
    """The box's cgroups still on the machine, in every hierarchy it uses."""
    found: list[str] = []
    for root in _roots():
        base = root / box_name
        found += [str(p) for p in sorted(base.rglob("*")) if p.is_dir()] if base.is_dir() else []
        found += [str(base)] if base.is_dir() else []
        # the parent all boxes share, empty: left by this box's `down`
        if root.is_dir() and not any(p.is_dir() for p in root.iterdir()):
            found.append(str(root))
    return found


def remove_cgroups(box_name: str) -> list[str]:
    """Remove the box's cgroups, killing what is left in them; what was removed."""
    removed: list[str] = []
    for root in _roots():
        base = root / box_name
        if base.is_dir():
            # deepest first: a cgroup with children or processes cannot be removed
            subdirs = [p for p in base.rglob("*") if p.is_dir()]
            for path in sorted(subdirs, key=lambda p: -len(p.parts)) + [base]:
                empty_cgroup(path)
                removed.append(f"cgroup {path}")
        if root.is_dir() and not any(p.is_dir() for p in root.iterdir()):
            remove_if_empty(root)
    return removed


def remove_if_empty(path: Path) -> None:
    """A parent every box shares goes with the last box (another may still be up)."""
    try:
        path.rmdir()
    except OSError:
        pass


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def empty_cgroup(path: Path) -> None:
    """Kill what `path` holds and remove it."""
    for _ in range(50):
        procs = path / "cgroup.procs"
        pids = [int(p) for p in procs.read_text().split()] if procs.is_file() else []
        kill_pids(pids)
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.05)  # killed processes leave the cgroup once reaped
    raise BoxError(f"cgroup {path} still holds processes after SIGKILL")
