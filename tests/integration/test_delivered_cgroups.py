"""`hexctl/box/delivered.py` on real cgroups: a busy loop in a 0.2-core quota, alone and
then beside busy work the machine favours over it, read by the sampler a run uses. The
measure tells the two apart, and the wait the quota alone causes is not counted as the
machine's. Needs root and cgroup v1's `cpu` controller (CI has both); skipped otherwise.
Everything runs inside one cgroup weighted as a `nice 19` process, so other work on the
machine is not disturbed, and everything made is removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hexctl.box.cgroups import V1_ACCT, empty_cgroup, make_cgroup
from hexctl.box.delivered import HELD_BACK, DeliverySampler, NodeCgroup, node_figures

CPU = Path("/sys/fs/cgroup/cpu")
QUOTA = 0.2
BUSY = "while True: pass"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "cgroups need root"
    if not (CPU / "cpu.cfs_quota_us").is_file():
        return "no cgroup v1 `cpu` controller at /sys/fs/cgroup/cpu"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


@pytest.fixture
def groups() -> Iterator[tuple[Path, Path | None]]:
    """(the parent `cpu` cgroup, its accounting twin or None), removed at the end with
    whatever they hold."""
    name = f"starve-test-{os.getpid()}"
    parent = CPU / name
    # `cpuacct` apart from `cpu` (as here), or mounted with it (its files in `parent`)
    apart = (V1_ACCT / "cpuacct.usage").is_file() and not (CPU / "cpuacct.usage").is_file()
    acct = V1_ACCT / name if apart else None
    made = [parent] + ([acct] if acct else [])
    try:
        parent.mkdir()
        (parent / "cpu.shares").write_text("15")  # a nice 19 process's weight
        if acct:
            acct.mkdir()
        yield parent, acct
    finally:
        for root in made:
            for path in [root / "node", root / "hog", root]:
                if path.is_dir():
                    empty_cgroup(path)


def _busy(*dirs: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    for d in dirs:
        (d / "cgroup.procs").write_text(str(proc.pid))
    return proc


def _measure(
    node: NodeCgroup, seconds: float = 1.5, then: Callable[[], None] | None = None
) -> dict[str, float]:
    """The node's figures over `seconds`, after a settling 0.3 s, read on for 0.5 s after
    (a run's readings go on past its window, while it stops); `then` is called as the
    window ends, within those readings. A starved thread's wait is counted only when it
    gets a CPU again: a run's work ends and lets it, so `then` ends what starved it."""
    with DeliverySampler([node], every_s=0.2) as sampler:
        t0 = time.time() + 0.3
        t1 = t0 + seconds
        time.sleep(max(0.0, t1 - time.time()))
        if then is not None:
            then()
        time.sleep(max(0.0, t1 + 0.5 - time.time()))
    return node_figures(sampler.readings[node.name], QUOTA, t0, t1)


def test_the_machine_s_wait_is_told_from_the_quota_s(groups: tuple[Path, Path | None]) -> None:
    parent, acct_parent = groups
    cpu = make_cgroup(parent / "node", QUOTA)
    (cpu / "cpu.shares").write_text("2")  # inside the parent: the busy work is favoured
    acct = None
    if acct_parent is not None:
        acct = acct_parent / "node"
        acct.mkdir()
    node = NodeCgroup("node", cpu, acct or cpu, QUOTA)
    loop = _busy(*([cpu] + ([acct] if acct else [])))
    # alone, up to two tries: a machine busy with other work may take the quota of a
    # nice 19 cgroup for a while (the measure says so: it is what it is for)
    tries = []
    while len(tries) < 2 and (not tries or tries[-1]["used_cores"] < 0.95 * QUOTA):
        tries.append(_measure(node))
    alone = max(tries, key=lambda f: f["used_cores"])

    hog = parent / "hog"
    hog.mkdir()
    (hog / "cpu.shares").write_text("1024")
    hogs = [_busy(hog) for _ in range(os.cpu_count() or 1)]

    def stop_hogs() -> None:
        for p in hogs:
            p.kill()
            p.wait()

    beside = _measure(node, then=stop_hogs)
    loop.kill()
    loop.wait()

    print("alone", tries, "\nbeside", beside)
    # alone: its quota delivered (or nearly); the loop waited most of the window,
    # throttled by its quota, and that wait is not counted as the machine's: what is
    # counted is at most what it did not get
    assert alone["used_cores"] > 0.9 * QUOTA, tries
    assert alone["throttled_share"] > 0.5 and alone["run_delay_share"] > 0.5, alone
    assert alone["withheld_share"] <= 1 - alone["used_cores"] / QUOTA + 0.05, alone
    # beside favoured work: the machine withheld most of the quota while the loop waited,
    # about as much as the loop did not get
    assert beside["used_cores"] < 0.5 * QUOTA, beside
    assert beside["withheld_share"] > max(0.5, HELD_BACK), beside
    assert beside["withheld_share"] > 1 - beside["used_cores"] / QUOTA - 0.25, beside


def test_the_profiles_receivers_get_cgroups_of_the_nodes_quota(
    groups: tuple[Path, Path | None],
) -> None:
    """`receiver_cgroups`: beside a node's cgroup, one per receiver with the node's
    quota, each gone after the block, a process still in it killed."""
    from hexctl.box.cgroups import cgroup_quota, receiver_cgroups

    parent, _ = groups
    node = make_cgroup(parent / "node", QUOTA)
    assert cgroup_quota(node) == pytest.approx(QUOTA)
    with receiver_cgroups(str(node), 2) as paths:
        made = [Path(p) for p in paths]
        assert len(made) == 2 and all(p.parent == parent for p in made)
        assert all(cgroup_quota(p) == pytest.approx(QUOTA) for p in made)
        busy = subprocess.Popen([sys.executable, "-c", BUSY])
        (made[0] / "cgroup.procs").write_text(str(busy.pid))
    assert not any(p.exists() for p in made)
    assert busy.wait(timeout=10) != 0  # killed with its cgroup
