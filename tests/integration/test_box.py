"""The box on this machine: a 2-node box comes up with its links shaped and its CPU
quotas in effect, and `down` leaves nothing of it after success, a failure of `up`
half-way, and a SIGKILLed `up`; a short plan run across two racks, with the weights
broadcast over the links, completes with nothing lost. Needs root, network namespaces
and tc (CI runs as root); skipped otherwise, with the reason."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hexctl.box import emulate as box
from hexctl.box import speed as box_speed
from hexctl.box.spec import load_box

ROOT = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the box needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "network namespaces are not available"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _spec(tmp: Path, name: str, nodes: int = 2, nic: float = 80.0, cpu: float = 0.3) -> Path:
    data = {
        "name": name,
        "kinds": {
            "slow": {"cpu": cpu, "max_running_requests": 8, "usd_per_hour": 1.0, "nic_mbit": nic}
        },
        "racks": [
            {"name": "a", "uplink_mbit": 1000, "members": [{"kind": "slow", "count": nodes}]}
        ],
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _name(tag: str) -> str:
    return f"{tag}{os.getpid() % 10000}"  # unique per test process: boxes may run side by side


def _tc_devices() -> str:
    return subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout


def test_up_shapes_links_and_quotas_then_down_leaves_nothing(tmp_path: Path) -> None:
    spec = load_box(_spec(tmp_path, _name("ok")))
    try:
        state = box.up(spec, cpu_check_s=0.3)
        a, b = state.node("slow-0"), state.node("slow-1")
        assert a.address != b.address
        # 2 MiB over an 80 Mbit/s NIC: 0.21 s if the shaping holds, far less if not
        seconds = box.transfer_s(a, b, 2)
        rate_mbit = 2 * 8 * (1 << 20) / 1e6 / seconds
        assert 0.7 * 80 < rate_mbit < 1.1 * 80, rate_mbit
        # the quota caps a busy loop at 0.3 cores (less only if the machine is busy)
        assert all(0.0 < r <= 0.3 * 1.25 + 0.05 for r in state.cpu_check.values())
        # the speed sample runs under the node's quota: well under its free speed
        speeds = box_speed.node_speed([a, b], seconds=0.5)
        # free speed: the best of three samples (another test's processes share the cores)
        free = max(
            float(
                subprocess.run(
                    [sys.executable, "-c", box_speed._WORK, "0.5"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()[0]
            )
            for _ in range(3)
        )
        assert set(speeds) == {"slow-0", "slow-1"}
        assert all(0 < v < 2 * 0.3 * free for v in speeds.values()), (speeds, free)
        assert box.prefix(spec.name) in _tc_devices()
    finally:
        box.down(spec.name)
    assert box.leftovers(spec.name) == []
    assert box.prefix(spec.name) not in _tc_devices()


def test_failed_up_removes_what_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_box(_spec(tmp_path, _name("fl")))
    made: list[int] = []

    def fail_second(path: Path, cpu: float) -> Path:
        made.append(1)
        if len(made) == 2:  # the first node is complete, the second half-made
            raise box.BoxError("injected failure")
        return real(path, cpu)

    real = box._make_cgroup
    monkeypatch.setattr(box, "_make_cgroup", fail_second)
    with pytest.raises(box.BoxError, match="injected"):
        box.up(spec)
    assert box.leftovers(spec.name) == []


def test_sigkilled_up_is_cleaned_by_the_next_down(tmp_path: Path) -> None:
    name = _name("kl")
    path = _spec(tmp_path, name, nodes=6)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hexctl.cli", "box", "up", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not box.leftover_netns(name) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert box.leftover_netns(name), "box up made no namespace in 60 s"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert box.leftovers(name) != []  # killed half-way: something is left ...
    down = subprocess.run(
        [sys.executable, "-m", "hexctl.cli", "box", "down", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert down.returncode == 0, down.stdout + down.stderr
    assert box.leftovers(name) == []  # ... and the next `down` removes it


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_sigterm_to_bench_hetero_takes_its_box_down(tmp_path: Path) -> None:
    """A scheduler's stop or a `kill` mid-profile: the bench ends as on Ctrl-C (exit
    130), its box and the servers in it gone."""
    name = _name("tm")
    path = _spec(tmp_path, name)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["bench", "hetero", "--json", "--box", str(path), "--budget", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hexctl.cli", *argv, "--output-dir", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def servers() -> list[int]:  # the profile's inference server, not `box up`'s own checks
        pids = [p for ns in box.leftover_netns(name) for p in box._netns_pids(ns)]
        return [p for p in pids if b"serve" in _cmdline(p)]

    try:
        deadline = time.monotonic() + 120
        # the box is up and the profile's first server runs in one of its namespaces
        while time.monotonic() < deadline and proc.poll() is None and not servers():
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert servers(), "no server started in 120 s"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        left = box.leftovers(name)  # what the bench itself left, before any cleanup here
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        box.down(name)
    assert proc.returncode == 130, err[-2000:]
    assert "bench: interrupted" in err and "Traceback" not in err, err[-2000:]
    assert left == []


def test_without_root_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_hex.errors import UsageError

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UsageError, match="needs root"):
        box.check_host()


# ---------------------------------------------------------------- a plan run on a box
RUN_STEPS = 3


def _box_file(tmp: Path, name: str) -> Path:
    data = {
        "name": name,
        "kinds": {
            "fast": {"cpu": 0.6, "max_running_requests": 4, "usd_per_hour": 3.0, "nic_mbit": 400},
            "mem": {"cpu": 0.4, "max_running_requests": 32, "usd_per_hour": 1.0, "nic_mbit": 400},
        },
        "racks": [
            {"name": "a", "uplink_mbit": 100, "members": [{"kind": "fast", "count": 1}]},
            {"name": "b", "uplink_mbit": 100, "members": [{"kind": "mem", "count": 1}]},
        ],
    }
    path = tmp / "box.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plan_file(tmp: Path) -> Path:
    slot = {"gpu_ids": [0]}
    plan = {
        "cluster": "box", "model": "tiny", "objective": "throughput",
        "rollout": [{"id": "rollout-mem-0", "gpu_kind": "mem", "tp": 1, "zone": "box",
                     "region": "box", "placement": {"node": "mem-0", **slot},
                     "predicted_tokens_per_s": 1.0}],
        "trainer": {"gpu_kind": "fast", "world_size": 1, "dp": 1, "zero_stage": 0,
                    "placements": [{"node": "fast-0", **slot}],
                    "predicted_tokens_per_s": 1.0},
        "decisions": {},
        "predicted": {"samples_per_s": 1, "generation_samples_per_s": 1,
                      "training_samples_per_s": 1, "weight_sync_s": 0, "cost_usd_per_h": 4},
    }  # fmt: skip
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.mark.timeout(400)
def test_a_plan_runs_across_the_box_with_weights_over_the_links(tmp_path: Path) -> None:
    spec = load_box(_box_file(tmp_path, _name("r")))
    out = tmp_path / "runs"
    try:
        state = box.up(spec, cpu_check_s=0.2)
        argv = [
            sys.executable, "-m", "hexctl.cli", "run", str(ROOT / "examples/box/tiny_box.yaml"),
            f"run.box={spec.name}", f"run.output_dir={out}", "run.run_id=boxrun",
            f"trainer.total_steps={RUN_STEPS}", f"trainer.checkpoint_every={RUN_STEPS}",
            "buffer.groups_per_step=2", "rollout.weight_sync=network",
            "--plan", str(_plan_file(tmp_path)), "--no-progress",
        ]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=360, cwd=ROOT)
        run_dir = out / "boxrun"
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == RUN_STEPS
        assert summary["groups_lost"] == 0 and summary["trained_twice"] == 0
        # the weights crossed the links: every version reached the server through the
        # weight-update group, and none was written as a file for it to load
        rows = [json.loads(line) for line in (run_dir / "rollout.jsonl").read_text().splitlines()]
        assert rows[-1]["weight_syncs_total"] == RUN_STEPS
        assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v0"]
        # each service ran inside its planned node
        logs = run_dir / "logs"
        assert box.netns_name(spec.name, "fast-0") in (logs / "trainer.log").read_text()
        assert box.netns_name(spec.name, "mem-0") in (logs / "rollout-mem-0.log").read_text()
        assert state.node("mem-0").address in (logs / "controller.log").read_text()
    finally:
        box.down(spec.name)
    assert box.leftovers(spec.name) == []
