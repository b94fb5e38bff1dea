"""Chaos: one short job with a fault at each of several random steps, SIGKILL of every
process kind (inference server, a trainer rank, controller, Valkey) and SIGTERM of the
launcher followed by `areal-hex run --resume`; reports per fault whether the job
recovered, how long until the struck process was back (`restarted_after_s`) and until the
next step completed (`no_step_s`: a step under way may still finish, and the trainer
may train on groups already buffered), the restarts it took, and the ledger read live
after the recovery (groups lost, groups trained twice), and the final ledger.

Baseline: the same job's ledger identity holds with no fault at all before the first one
(the `before_first_fault` ledger), and every number comes from durable state
(hexctl/report/ledger.py), never from a process's own counters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from areal_hex.config.base import load_yaml_text
from areal_hex.run_files import RunPaths, TrainerRow, read_rows
from hexctl.report.ledger import read_ledger

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml")
KINDS = ("inference", "trainer", "controller", "valkey", "launcher")
RUN_ID = "chaos"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: tiny)")
    p.add_argument("--steps", type=int, default=30, help="trainer.total_steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault order and steps")
    p.add_argument(
        "--faults",
        default=",".join(KINDS),
        help=f"comma-separated fault kinds in any order and number ({', '.join(KINDS)})",
    )
    p.add_argument("--output-dir", default=None, help="keep the run directory here")
    p.add_argument("--timeout", type=float, default=1500.0, help="give up after this long")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def job_overrides(steps: int) -> list[str]:
    """A short job that checkpoints often, so a fault costs a few steps at most."""
    return [
        f"trainer.total_steps={steps}",
        "trainer.checkpoint_every=3",
        "buffer.groups_per_step=4",
        "rollout.group_size=8",
        "model.tiny.sft_steps=0",
        "redis.appendfsync=always",  # a Valkey kill loses no acknowledged write
        "buffer.lease_ttl_s=3",  # a killed controller's admissions come back in 3 s
        "rollout.metrics_interval_s=1.0",
        "run.max_restarts=3",
    ]


def fault_plan(kinds: list[str], steps: int, seed: int) -> list[tuple[int, str]]:
    """(step after which to strike, kind), in step order: random steps spread over the
    middle of the job, one per fault, in a random order of kinds, at least half a share of
    the job apart (so each fault's recovery is seen before the next)."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    lo, hi = 2, max(3, steps - 4)
    span = (hi - lo) / len(order)
    at = [int(lo + span * i + rng.random() * span * 0.5) for i in range(len(order))]
    return list(zip(at, order, strict=True))


# ---------------------------------------------------------------- the processes
def _group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes in a process group."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append((int(entry.name), cmd))
    return out


def _pids(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "pids.json").read_text())


def strike(kind: str, run_dir: Path, launcher: subprocess.Popen[bytes]) -> str:
    """Deliver one fault; returns what was hit."""
    pids = _pids(run_dir)
    if kind == "launcher":
        launcher.send_signal(signal.SIGTERM)
        return f"SIGTERM launcher {launcher.pid}"
    if kind == "trainer":  # one rank, not its launcher: the launcher must notice
        launchers = ("deepspeed.launcher", "torch.distributed.run")
        ranks = [
            p
            for p, cmd in _group_members(pids["trainer"])
            if "-m trainer_service.main" in cmd and not any(x in cmd for x in launchers)
        ]
        os.kill(ranks[0], signal.SIGKILL)
        return f"SIGKILL trainer rank {ranks[0]}"
    name = {"inference": "inference-0", "controller": "controller", "valkey": "redis"}[kind]
    os.killpg(pids[name], signal.SIGKILL)
    return f"SIGKILL {name} (process group {pids[name]})"


def start_launcher(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "hexctl.cli", "run", *args, "--no-progress"]
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


# ---------------------------------------------------------------- observing
def steps_done(run_dir: Path) -> list[TrainerRow]:
    return read_rows(RunPaths.at(run_dir).metrics, TrainerRow)


def live_ledger(run_dir: Path, timeout_s: float = 60.0) -> dict[str, Any] | None:
    """The ledger read from the running Valkey (waiting while it restarts). A commit
    landing between the checkpoint read and the counters read shows its groups as
    missing; such a read is repeated."""
    import redis

    cfg = load_yaml_text((run_dir / "config.yaml").read_text(), str(run_dir / "config.yaml"))
    client = redis.Redis.from_url(cfg["redis"]["url"], socket_timeout=5)
    deadline = time.monotonic() + timeout_s
    out = None
    try:
        while time.monotonic() < deadline:
            try:
                out = read_ledger(client, RUN_ID, RunPaths.at(run_dir))
            except redis.RedisError:
                time.sleep(0.5)
                continue
            if out.get("groups_lost") == 0:
                return out
            time.sleep(0.5)
        return out
    finally:
        client.close()


def wait_for(cond: Any, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return False


PROCESS = {"inference": "inference-0", "trainer": "trainer", "controller": "controller"}
PROCESS["valkey"] = "redis"


def restarts_of(run_dir: Path, kind: str, t: float) -> tuple[int, float | None]:
    """How often the struck process was started again after the fault at `t`, and how
    many seconds after it the first time (the launcher: the attempts started after it)."""
    events = json.loads(RunPaths.at(run_dir).events.read_text())
    attempts = events.get("attempts", [events])
    if kind == "launcher":
        times = [a["t_start"] for a in attempts if a["t_start"] > t]
    else:
        times = [
            e["time"]
            for a in attempts
            for e in a.get("events", [])
            if e["process"] == PROCESS[kind] and e["event"] == "restart" and e["time"] > t
        ]
    return len(times), (min(times) - t if times else None)


# ---------------------------------------------------------------- the job
class Job:
    """The job under test: its launcher (restarted with --resume after a SIGTERM) and
    what its run directory says."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.run_dir = out / RUN_ID
        self.log = out / "launcher.log"
        self.deadline = time.monotonic() + args.timeout
        overrides = [*job_overrides(args.steps), *args.overrides]
        first = [args.config, *overrides, f"run.output_dir={out}", f"run.run_id={RUN_ID}"]
        self.launcher = start_launcher(first, self.log)

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def reach(self, step: int) -> int:
        """Wait until step `step` is done; returns the step done now."""
        if not wait_for(lambda: self.step() >= step, self.left_s()):
            raise RuntimeError(f"the job did not reach step {step}; see {self.log}")
        return self.step()

    def step(self) -> int:
        rows = steps_done(self.run_dir)
        return rows[-1].step if rows else 0

    def fault(self, kind: str) -> dict[str, Any]:
        """Strike, wait for the next step completed after it (after the resume, for the
        launcher: the step under way still completes before the launcher exits)."""
        at_step, t = self.step(), time.time()
        fault: dict[str, Any] = {"kind": kind, "at_step": at_step}
        fault["what"] = strike(kind, self.run_dir, self.launcher)
        since = t
        if kind == "launcher":
            fault["launcher_exit"] = self.launcher.wait(timeout=180)
            since = time.time()
            self.launcher = start_launcher(["--resume", str(self.run_dir)], self.log)
        fault["recovered"] = wait_for(
            lambda: any(r.time > since for r in steps_done(self.run_dir)), self.left_s()
        )
        later = [r for r in steps_done(self.run_dir) if r.time > since]
        fault["no_step_s"] = (later[0].time - t) if later else None
        fault["next_step"] = later[0].step if later else None
        led = live_ledger(self.run_dir)
        fault["lost"] = led.get("groups_lost") if led else None
        fault["trained_twice"] = led.get("trained_twice") if led else None
        fault["t"] = t
        return fault

    def finish(self) -> int:
        try:
            return self.launcher.wait(timeout=max(1.0, self.left_s()))
        finally:
            if self.launcher.poll() is None:
                self.launcher.send_signal(signal.SIGTERM)
                self.launcher.wait(timeout=180)


def run_job(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    job = Job(args, out)
    faults: list[dict[str, Any]] = []
    baseline: dict[str, Any] | None = None
    try:
        for at_step, kind in fault_plan(kinds, args.steps, args.seed):
            job.reach(at_step)
            if baseline is None:
                baseline = live_ledger(job.run_dir)
            faults.append(job.fault(kind))
    finally:
        rc = job.finish()
    summary = json.loads(RunPaths.at(job.run_dir).summary.read_text())
    completed = rc == 0 and summary.get("steps") == args.steps
    for f in faults:
        f["restarts"], f["restarted_after_s"] = restarts_of(job.run_dir, f["kind"], f.pop("t"))
        f["completed"] = completed
    keys = ["groups_admitted", "groups_produced", "groups_trained", "groups_dropped_stale"]
    keys += ["groups_filtered", "groups_pending", "groups_in_flight", "groups_lost"]
    keys += ["trained_twice", "attempts", "restarts", "wall_time_s", "active_time_s"]
    keys += ["samples_per_s", "samples_per_s_wall"]
    before = {k: (baseline or {}).get(k) for k in ("groups_lost", "trained_twice")}
    return {
        "faults": faults,
        "completed": completed,
        "exit_code": rc,
        "before_first_fault": before,
        "final": {k: summary.get(k) for k in keys},
        "run_dir": str(job.run_dir),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="areal-hex-chaos-") as tmp:
        out = Path(args.output_dir or tmp).resolve()
        out.mkdir(parents=True, exist_ok=True)
        result = run_job(args, out)
    ok = [f for f in result["faults"] if f["completed"] and f["lost"] == 0]
    ok = [f for f in ok if f["trained_twice"] == 0]
    return {
        "config": args.config,
        "steps": args.steps,
        "seed": args.seed,
        "faults_total": len(result["faults"]),
        "faults_ok": len(ok),
        **result,
    }
