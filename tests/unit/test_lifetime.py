"""No process of a run outlives its launcher, even one killed with SIGKILL; a run directory
with live processes is refused by `--resume` (naming them) or cleared with `--force`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_hex import lifetime
from areal_hex.errors import UsageError
from hexctl.cli.run_cmd import _check_alone
from hexctl.launch.supervisor import live_processes

# A service of the run: tied to its launcher, with a child of its own (as the DeepSpeed
# launcher has ranks and `buffer serve` a valkey-server).
SERVICE = (
    "import subprocess, sys, time; from areal_hex.lifetime import tie_to_launcher; "
    "tie_to_launcher(0.1); subprocess.Popen(['sleep', '61']); time.sleep(60)"
)
LAUNCHER = f"""
import sys, time
from pathlib import Path
from hexctl.launch.supervisor import ProcessSpec, Supervisor
run = Path(sys.argv[1])
sup = Supervisor(pid_file=run / "pids.json")
cmd = [sys.executable, "-c", {SERVICE!r}, str(run / "config.yaml")]
sup.start(ProcessSpec("svc", cmd, run / "logs" / "svc.log"))
sup.start(ProcessSpec("bare", ["sleep", "62"], run / "logs" / "bare.log"))  # no tie
sup.start(ProcessSpec("frozen", cmd, run / "logs" / "frozen.log"))  # to be SIGSTOPped
time.sleep(60)
"""


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes], dict[str, int]]]:
    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(run_dir)], start_new_session=True
    )

    def started() -> bool:
        try:
            pids = json.loads((run_dir / "pids.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        groups = [lifetime.group_members(pids.get(n, -1)) for n in ("svc", "frozen")]
        return len(pids) == 4 and all(len(g) == 2 for g in groups)

    try:
        assert _wait(started, 20), "the services did not start"
        yield run_dir, launcher, json.loads((run_dir / "pids.json").read_text())
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        pids = json.loads((run_dir / "pids.json").read_text())
        for name in ("svc", "bare", "frozen"):
            try:
                os.killpg(pids[name], signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_every_process_dies_with_a_sigkilled_launcher(run) -> None:
    """A stopped service cannot act on its launcher's death: the others end it."""
    run_dir, launcher, pids = run
    svc = [p for p, _ in lifetime.group_members(pids["svc"])]
    frozen = [p for p, _ in lifetime.group_members(pids["frozen"])]
    assert len(svc) == 2 and lifetime.command(pids["bare"]) is not None
    os.killpg(pids["frozen"], signal.SIGSTOP)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    everyone = [*svc, *frozen, pids["bare"]]
    assert _wait(lambda: all(lifetime.command(p) is None for p in everyone), 10), [
        (p, lifetime.command(p)) for p in everyone
    ]
    assert live_processes(run_dir / "pids.json", f"{run_dir.name}/") == {}
    _check_alone(run_dir, force=False)  # nothing left: a resume may go on


def test_resume_refuses_while_processes_of_the_run_live(run) -> None:
    run_dir, launcher, pids = run
    live = live_processes(run_dir / "pids.json", f"{run_dir.name}/")
    assert live["launcher"] == [launcher.pid]
    assert sorted(live["svc"]) == sorted(p for p, _ in lifetime.group_members(pids["svc"]))
    assert "bare" not in live  # its command line does not name the run: not taken for it
    assert len(live["frozen"]) == 2
    with pytest.raises(UsageError) as err:
        _check_alone(run_dir, force=False)
    msg = str(err.value)
    assert f"launcher (pid {launcher.pid})" in msg and "svc (pid " in msg and "--force" in msg
    for pid in live["svc"]:
        assert str(pid) in msg


def test_resume_force_stops_them_first(run) -> None:
    run_dir, launcher, pids = run
    svc = [p for p, _ in lifetime.group_members(pids["svc"])]
    _check_alone(run_dir, force=True)
    assert launcher.wait(timeout=10) is not None
    assert _wait(lambda: all(lifetime.command(p) is None for p in svc), 10)
    assert live_processes(run_dir / "pids.json", f"{run_dir.name}/") == {}


def test_a_token_names_one_process_and_a_zombie_is_gone() -> None:
    me = lifetime.token()
    assert lifetime.alive(me)
    pid, _, started = me.partition(":")
    assert not lifetime.alive(f"{pid}:{int(started) + 1}")  # the same pid, reused later
    child = subprocess.Popen(["true"])
    assert _wait(lambda: lifetime.command(child.pid) is None, 5)  # exited, not yet reaped
    assert not lifetime.alive(lifetime.token(child.pid))
    child.wait()


def test_no_launcher_named_no_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lifetime.ENV, raising=False)
    assert lifetime.tie_to_launcher() is None
