"""The tiny CPU example as a real Slurm job: `areal-hex deploy --target slurm --submit`
on the local single-node Slurm (scripts/local_slurm.sh), then the run's summary.

Skips, saying why, where `sbatch` is missing or no controller answers. The local profile
is one shared allocation (`hetjob: false`): heterogeneous components cannot share the
one node (see docs/slurm.md).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from areal_hex.net import port_free

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
READY = {"idle", "mix", "alloc"}  # sinfo states a job can start on (cores are shared)
STEPS = 40  # of the requeued run: long enough that the signal lands before its end
END_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _partition() -> str:
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch not found: no Slurm here (scripts/local_slurm.sh starts one)")
    r = subprocess.run(["sinfo", "-h", "-o", "%R %t"], capture_output=True, text=True, timeout=30)
    up = [ln.split()[0] for ln in r.stdout.splitlines() if ln.split()[-1] in READY]
    if r.returncode != 0 or not up:
        pytest.skip(f"no idle Slurm node (sinfo: {r.stdout.strip() or r.stderr.strip()})")
    return up[0]


def _job_port() -> int:
    """A free port below the kernel's ephemeral range: the job binds it a minute later,
    and a port the OS hands out (`free_port`) can meanwhile be taken by any outgoing
    connection or by another test's `free_port`."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(low, 20001))
        if port_free(port) and port_free(port, "0.0.0.0"):
            return port
    raise RuntimeError(f"no free port in 20000-{low}")


def _site(tmp_path: Path, partition: str) -> Path:
    node = {"partition": partition, "gpus": False, "cpus": 1, "mem": "2G"}
    site = {
        "shared_dir": str(tmp_path / "shared"),
        "python": sys.executable,
        "setup": [f"export PYTHONPATH={ROOT}"],
        "hetjob": False,
        "time": "00:20:00",
        "start_timeout_s": 300,
        "master_port": _job_port(),
        "control": {"partition": partition, "cpus": 1, "mem": "1G"},
        "redis": {"port": _job_port()},
        "kinds": {"cpu": node},
    }
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


def _submit(tmp_path: Path, run_id: str, steps: int) -> str:
    r = subprocess.run(
        [
            sys.executable, "-m", "hexctl.cli", "deploy",
            "examples/plans/local_cpu.yaml", "examples/tiny_cpu.yaml",
            f"run.run_id={run_id}", f"trainer.total_steps={steps}",
            "trainer.checkpoint_every=2", "model.tiny.sft_steps=10",
            "buffer.groups_per_step=4", "rollout.group_size=4",
            f"inference.base_port={_job_port()}",
            "--target", "slurm", "--site", str(_site(tmp_path, _partition())),
            "--out", str(tmp_path / "job"), "--submit",
        ],
        env=ENV, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = re.search(r"submitted job (\d+)", r.stdout)
    assert m is not None, r.stdout
    assert f"tail -f {tmp_path}/shared/runs/{run_id}/metrics.jsonl" in r.stdout
    return m.group(1)


def _state(job: str) -> str:
    r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    m = re.search(r"JobState=(\S+)", r.stdout)
    return m.group(1) if m else "GONE"


def _wait_end(job: str, out: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _state(job)
        if state in END_STATES or state == "GONE":
            return state
        time.sleep(3)
    subprocess.run(["scancel", job])
    pytest.fail(f"job {job} not done after {timeout_s:.0f} s; its output:\n{_read(out)}")


REQUEUE_START_S = 5  # after the requeue, the second start (the credential's whole second)


def _start_when_requeued(job: str, timeout_s: float) -> None:
    """Slurm holds a requeued job about two minutes before it may start again (here the
    second start came 156 s after the requeue); what is tested is the requeue and the
    resume, not that wait, so the requeued job is made eligible 5 s later. Not at once:
    slurmd revokes the first start's credential at the requeue, with a time in whole
    seconds, and kills a start whose new credential falls in that same second ("Job
    credential revoked"; the job then ends FAILED)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _state(job)
        if state == "PENDING":
            cmd = ["scontrol", "update", f"JobId={job}", f"StartTime=now+{REQUEUE_START_S}"]
            subprocess.run(cmd, check=False)
            return
        if state in END_STATES or state == "GONE":
            return
        time.sleep(0.5)


def _read(path: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(path.glob("slurm-*.out")))


def _wait_rows(metrics: Path, n: int, job: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _state(job) not in END_STATES:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(1)
    pytest.fail(f"job {job}: fewer than {n} trainer steps after {timeout_s:.0f} s")


def _summary(tmp_path: Path, run_id: str) -> dict:
    return json.loads((tmp_path / "shared/runs" / run_id / "summary.json").read_text())


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(720)
def test_tiny_run_as_a_slurm_job(tmp_path):
    job = _submit(tmp_path, "slurm-e2e", steps=4)
    state = _wait_end(job, tmp_path / "job", 600)
    out = _read(tmp_path / "job")
    assert state == "COMPLETED", out
    summary = _summary(tmp_path, "slurm-e2e")
    assert summary["outcome"] == "finished", out
    assert summary["steps"] == 4
    assert summary["groups_lost"] == 0
    assert summary["groups_trained"] == 4 * 4
    logs = tmp_path / "shared/runs/slurm-e2e/logs"
    for name in ("prepare", "redis", "rollout-cpu-0", "trainer", "controller"):
        assert (logs / f"{name}.log").stat().st_size > 0
    assert "areal-hex: finished" in out
    # the Valkey append-only file lives in the run directory on shared storage
    assert any((tmp_path / "shared/runs/slurm-e2e/valkey").rglob("*.aof"))


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_signal_before_the_time_limit_requeues_and_resumes(tmp_path):
    """SIGUSR1 to the batch script (what `--signal=B:USR1@N` sends before the limit):
    services stop in order, the job requeues itself, and the second start resumes the
    run from its newest checkpoint and finishes it with no group lost."""
    job = _submit(tmp_path, "slurm-requeue", steps=STEPS)
    metrics = tmp_path / "shared/runs/slurm-requeue/metrics.jsonl"
    # past the checkpoint at step 2; the trainer cannot finish while the services stop
    # (once the controller stops, at most eta + 1 batches are left to train)
    _wait_rows(metrics, 3, job, 480)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    _start_when_requeued(job, 300)
    state = _wait_end(job, tmp_path / "job", 720)
    out = _read(tmp_path / "job")
    assert state == "COMPLETED", out
    assert "requeueing job" in out and "(restart 1)" in out
    summary = _summary(tmp_path, "slurm-requeue")
    assert summary["outcome"] == "finished", out
    assert summary["steps"] == STEPS
    assert summary["groups_lost"] == 0
    trainer_log = (tmp_path / "shared/runs/slurm-requeue/logs/trainer.log").read_text()
    assert trainer_log.count("=== start trainer") == 2
