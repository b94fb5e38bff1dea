"""The README's run, shortened: `areal-hex run examples/tiny_cpu.yaml` with a real
embedded Valkey, a real inference server, the rollout controller and DeepSpeed (gloo).

Asserts the run's invariants on what it wrote: staleness never above eta, no group lost
(produced = trained + dropped as stale + left in the buffer at stop), weight versions
advance, the report is written and every process is gone afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from areal_hex.net import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
ETA = 1
STEPS = 6
# A workflow task beyond generate and train that does nothing useful: it proves the
# launcher starts and stops any task through its generic path (`workflow.tasks`).
NOOP_TASK = (
    "workflow.tasks=[{name: noop, instances: 2, command: ["
    f"'{sys.executable}', '-c', "
    "'import pathlib, sys, time; p = pathlib.Path(sys.argv[1]).parent; "
    '(p / ("noop-" + sys.argv[2])).write_text("up"); time.sleep(3600)\', '
    "'{config}', '{index}']}]"
)


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "hexctl.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def kill_server_after_first_steps(run_dir: Path, proc: subprocess.Popen[str]) -> bool:
    """SIGKILL inference-0 (its whole process group) once the trainer logged 2 steps."""
    deadline = time.monotonic() + 480
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            pid = json.loads((run_dir / "pids.json").read_text())["inference-0"]
            os.killpg(pid, signal.SIGKILL)
            return True
        time.sleep(0.2)
    return False


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def port_open(url: str) -> bool:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.run_id=e2e",
        f"trainer.total_steps={STEPS}",
        f"buffer.max_staleness={ETA}",
        "buffer.groups_per_step=4",
        "rollout.group_size=4",
        "model.tiny.sft_steps=10",
        "trainer.checkpoint_every=3",
        # a step is 16 samples: the profile the run takes first times batches 1, 8 and 16
        "inference.max_running_requests=16",
        f"inference.base_port={free_port()}",
        "run.profile_first=true",  # the example reuses a profile only; this run takes one
        NOOP_TASK,
    ]
    run_dir = tmp_path / "e2e"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hexctl.cli", "run", str(EXAMPLE), *overrides, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    try:
        killed = kill_server_after_first_steps(run_dir, proc)
        stdout, stderr = proc.communicate(timeout=620)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert killed, "the run ended before the server could be killed"
    assert proc.returncode == 0, stderr[-4000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS

    metrics = jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["max_version_lag"] <= ETA
        assert all(int(lag) <= ETA for lag in m["version_lag_hist"])
        # every token, counted from the weights that trained it
        assert all(int(lag) <= ETA for lag in m["drift_by_lag"])
    versions = [m["version"] for m in metrics]
    assert versions == sorted(versions) and versions[-1] > versions[0]
    assert (run_dir / "weights" / f"v{versions[-1]}" / "config.json").is_file()
    assert (run_dir / "weights" / "v0" / "model.safetensors").is_file()

    full = json.loads((run_dir / "summary.json").read_text())
    assert full["groups_lost"] == 0 and full["trained_twice"] == 0
    assert full["prompts_produced_twice"] == 0
    assert full["attempts"] == 1 and (run_dir / "attempts" / "1" / "summary.json").is_file()
    assert full["groups_produced"] == (
        full["groups_trained"]
        + full["groups_dropped_stale"]
        + full["groups_pending"]
        + full["groups_in_flight"]
    )
    assert full["groups_trained"] == STEPS * 4
    assert full["max_version_lag"] <= ETA
    assert full["restarts"]["inference-0"] == 1  # the killed server was restarted
    assert full["samples_per_s"] > 0
    for name in ("reward", "version_lag", "throughput", "timeline", "fidelity"):
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 1000
    # run.profile_first: this machine measured first, the run held against the prediction
    fid = full["fidelity"]
    assert fid["source"] == "local profile" and (run_dir / "profile" / "profile.yaml").is_file()
    assert fid["predicted"]["pipeline_samples_per_s"] > 0
    assert set(fid["relative_error"]) == set(fid["predicted"])
    rollout = jsonl(run_dir / "rollout.jsonl")
    assert rollout[-1].get("final") is True
    for name in ("redis", "inference-0", "controller", "trainer", "noop-0", "noop-1"):
        assert (run_dir / "logs" / f"{name}.log").is_file()
    # the workflow's extra task ran, one process an instance, and was stopped at the end
    assert (run_dir / "noop-0").read_text() == (run_dir / "noop-1").read_text() == "up"
    pids = json.loads((run_dir / "pids.json").read_text())
    for name in ("noop-0", "noop-1"):
        with pytest.raises(ProcessLookupError):
            os.kill(pids[name], 0)

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["model"]["path"] == str(run_dir / "weights" / "v0")
    # workflow.placement auto: priced from the profile taken first, the fastest run
    choice = full["placement_choice"]
    assert choice["source"] == "profile" and set(choice["candidates"]) == {
        "disaggregated",
        "hybrid",
    }
    # the fastest, or the default within the choice's tie (hybrid priced as disaggregated
    # where its trainer binds: equal but for the sum's rounding)
    best = max(choice["candidates"].values())
    assert choice["candidates"][choice["chosen"]] == pytest.approx(best, rel=1e-6)
    assert cfg["workflow"]["placement"] == choice["chosen"]
    assert not port_open(cfg["redis"]["url"])  # Valkey stopped
    assert not port_open(f"http://127.0.0.1:{cfg['inference']['base_port']}")  # server stopped


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_unrecoverable_server_fails_the_run_with_its_log(tmp_path: Path) -> None:
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.run_id=bad",
        "run.profile_first=false",  # the failure to start is the subject, not this machine
        "model.tiny.sft_steps=0",
        "inference.backend=sglang",
        "inference.sglang.python=/nonexistent/python",
        f"inference.base_port={free_port()}",
    ]
    res = cli("run", str(EXAMPLE), *overrides, "--no-progress", timeout=170)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "inference-0 exited while starting" in res.stderr, res.stderr[-3000:]
    assert "last log lines" in res.stderr
    cfg = yaml.safe_load((tmp_path / "bad" / "config.yaml").read_text())
    assert not port_open(cfg["redis"]["url"])
