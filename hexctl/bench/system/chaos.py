"""Chaos: one short job with a fault at each of several random steps, and a report per
fault of whether the job recovered, how long until the struck process was back
(`restarted_after_s`) and until the next step completed (`no_step_s`: a step under way
may still finish, and the trainer may train on groups already buffered), the restarts it
took, and the ledger read live after the recovery (groups lost, groups trained twice),
and the final ledger.

The faults (`KINDS`): SIGKILL of every process kind (an inference server, a trainer rank,
the controller, Valkey); a trainer rank SIGKILLed before the first checkpoint exists
(`trainer_early`, struck after step 1); SIGTERM of the launcher followed by
`areal-hex run --resume`, and SIGKILL of it (`launcher_kill`: no process of the run may
survive it by 10 s, then `--resume`); the newest checkpoint truncated, then a trainer
rank SIGKILLed so that the restart must set it aside (`corrupt`); SIGSTOP of an
inference server, which must be found hung and replaced (`sigstop`); two faults
overlapping (`overlap`: Valkey, then the controller 3 s later); every process SIGKILLed
at once (`power_loss`), then `--resume`, also with the end of Valkey's append-only file
cut off (`aof_truncate`: the cut named, its losses counted); two `--resume` at once
(`race_resume`: the second exits 2); SIGKILL of an instance of a workflow task
(`task_kill`, chaos_task.py: a job with no task gets a harmless one); the run
directory's filesystem full to the last byte (`disk_full`, chaos_disk.py: the job then
runs on a tmpfs of its own; a clean stop, exit 1, then `--resume` once the filesystem
has grown back). Overrides (`rollout.weight_sync=network`) apply.

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
import time
from pathlib import Path
from typing import Any

from areal_hex.run_files import RunPaths
from hexctl.bench import BenchFailed
from hexctl.bench.system import DEFAULT_CONFIG, scratch_dir
from hexctl.bench.system.chaos_disk import SmallDisk, disk_full_ok, stale_publications, stop_checks
from hexctl.bench.system.chaos_procs import (
    RUN_ID,
    corrupt_newest,
    cut_aof,
    kill_rank,
    live_ledger,
    pids_of,
    power_loss,
    racing_resumes,
    rank_pids,
    start_launcher,
    steps_done,
    survivors,
    wait_for,
)
from hexctl.bench.system.chaos_task import task_overrides, task_target
from trainer_service.checkpoint import complete_checkpoints

KINDS = (
    "inference",
    "trainer",
    "controller",
    "valkey",
    "launcher",
    "trainer_early",
    "launcher_kill",
    "corrupt",
    "sigstop",
    "overlap",
    "power_loss",
    "aof_truncate",
    "race_resume",
    "task_kill",
    "disk_full",
)
# faults that end the launcher: the job goes on with `--resume`
RESUMED = ("launcher", "launcher_kill", "power_loss", "aof_truncate", "race_resume")
RESUMED += ("disk_full",)
EARLY = "trainer_early"  # struck after step 1, before the first checkpoint (step 3)
OVERLAP_GAP_S = 3.0  # between the two faults of `overlap`
SURVIVAL_S = 10.0  # no process of the run may outlive a SIGKILLed launcher longer


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
        "run.hung_after_s=10",  # a SIGSTOPped server is replaced within seconds
        "run.profile_first=false",  # the job's recovery is timed, not this machine
    ]


def fault_plan(kinds: list[str], steps: int, seed: int) -> list[tuple[int, str]]:
    """(step after which to strike, kind), in step order: random steps spread over the
    middle of the job, one per fault, in a random order of kinds, at least half a share of
    the job apart (so each fault's recovery is seen before the next)."""
    rng = random.Random(seed)
    early = [(1, k) for k in kinds if k == EARLY]  # before the first checkpoint
    order = [k for k in kinds if k != EARLY]
    rng.shuffle(order)
    lo, hi = 2 + 2 * len(early), max(3, steps - 4)
    span = (hi - lo) / max(1, len(order))
    at: list[int] = []
    for i in range(len(order)):  # distinct steps, even when faults outnumber them
        at.append(max(int(lo + span * i + rng.random() * span * 0.5), at[-1] + 1 if at else lo))
    return early + list(zip(at, order, strict=True))


def strike(
    kind: str,
    run_dir: Path,
    launcher: subprocess.Popen[bytes],
    rank: int | None = None,
    target: str | None = None,
) -> str:
    """Deliver one fault; returns what was hit."""
    pids = pids_of(run_dir)
    if kind == "launcher":
        launcher.send_signal(signal.SIGTERM)
        return f"SIGTERM launcher {launcher.pid}"
    if kind == "launcher_kill":
        launcher.send_signal(signal.SIGKILL)
        return f"SIGKILL launcher {launcher.pid}"
    if kind in ("power_loss", "aof_truncate"):
        return power_loss(run_dir, launcher)
    if kind == "race_resume":
        launcher.send_signal(signal.SIGTERM)
        return f"SIGTERM launcher {launcher.pid}, then two --resume at once"
    if kind in ("trainer", EARLY):
        return kill_rank(pids, rank if kind == EARLY else None)
    if kind == "corrupt":  # the restart that follows must find it
        return f"{corrupt_newest(run_dir)}; {kill_rank(pids)}"
    if kind == "sigstop":
        os.killpg(pids["inference-0"], signal.SIGSTOP)
        return f"SIGSTOP inference-0 (process group {pids['inference-0']})"
    if kind == "task_kill":
        name = target or task_target(run_dir, 0)
        os.killpg(pids[name], signal.SIGKILL)
        return f"SIGKILL task instance {name} (process group {pids[name]})"
    if kind == "overlap":
        os.killpg(pids["redis"], signal.SIGKILL)
        time.sleep(OVERLAP_GAP_S)
        os.killpg(pids_of(run_dir)["controller"], signal.SIGKILL)
        return f"SIGKILL redis, then controller {OVERLAP_GAP_S:g} s later"
    name = {"inference": "inference-0", "controller": "controller", "valkey": "redis"}[kind]
    os.killpg(pids[name], signal.SIGKILL)
    return f"SIGKILL {name} (process group {pids[name]})"


PROCESS: dict[str, tuple[str, ...]] = {
    "inference": ("inference-0",),
    "sigstop": ("inference-0",),
    "trainer": ("trainer",),
    EARLY: ("trainer",),
    "corrupt": ("trainer",),
    "controller": ("controller",),
    "valkey": ("redis",),
    "overlap": ("redis", "controller"),
}


def struck_processes(kind: str, run_dir: Path, nth: int = 0) -> tuple[str, ...]:
    """The services a fault strikes (none for the launcher's faults); `nth`: how many
    `task_kill` faults came before this one."""
    if kind == "task_kill":
        return (task_target(run_dir, nth),)
    return PROCESS.get(kind, ())


def restarts_of(
    run_dir: Path, kind: str, t: float, names: tuple[str, ...] = ()
) -> tuple[int, float | None]:
    """How often the struck process (`names`, else the kind's) was started again after
    the fault at `t`, and how many seconds after it the first time (the launcher: the
    attempts started after it; two processes struck: the fewer restarts, and the later of
    their first ones)."""
    events = json.loads(RunPaths.at(run_dir).events.read_text())
    attempts = events.get("attempts", [events])
    if kind in RESUMED:
        times = [a["t_start"] for a in attempts if a["t_start"] > t]
        return len(times), (min(times) - t if times else None)
    counts, firsts = [], []
    for name in names or PROCESS[kind]:
        times = [
            e["time"]
            for a in attempts
            for e in a.get("events", [])
            if e["process"] == name and e["event"] == "restart" and e["time"] > t
        ]
        counts.append(len(times))
        firsts.append(min(times) - t if times else None)
    late = None if None in firsts else max(f for f in firsts if f is not None)
    return min(counts), late


# ---------------------------------------------------------------- the job
class Job:
    """The job under test: its launcher (restarted with --resume after a SIGTERM) and
    what its run directory says."""

    def __init__(
        self, args: argparse.Namespace, out: Path, disk: SmallDisk, kinds: list[str]
    ) -> None:
        root = disk.mount if disk.mounted else out  # the run directory's parent
        self.run_dir = root / RUN_ID
        self.log = out / "launcher.log"
        self.disk = disk
        self.deadline = time.monotonic() + args.timeout
        overrides = [*job_overrides(args.steps), *args.overrides]
        if "task_kill" in kinds:
            overrides += task_overrides(args.config, overrides)
        first = [args.config, *overrides, f"run.output_dir={root}", f"run.run_id={RUN_ID}"]
        self.launcher = start_launcher(first, self.log)
        self.rank: int | None = None  # the trainer rank to strike, when found ahead
        self.task_kills = 0  # task_kill faults struck so far: the next takes the next task

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def reach(self, step: int, poll_s: float = 0.2) -> int:
        """Wait until step `step` is done; returns the step done now."""
        if not wait_for(lambda: self.step() >= step, self.left_s(), poll_s):
            raise BenchFailed(f"the job did not reach step {step}; see {self.log}")
        return self.step()

    def step(self) -> int:
        rows = steps_done(self.run_dir)
        return rows[-1].step if rows else 0

    def fault(self, kind: str) -> dict[str, Any]:
        """Strike, wait for the next step completed after it (after the resume, for the
        launcher: the step under way still completes before the launcher exits)."""
        at_step, t = self.step(), time.time()
        fault: dict[str, Any] = {"kind": kind, "at_step": at_step, "t": t}
        fault["processes"] = struck_processes(kind, self.run_dir, self.task_kills)
        self.task_kills += kind == "task_kill"
        fault["log_at"] = self.log.stat().st_size
        if kind == "disk_full":
            filled = self.disk.fill()
            fault["what"] = f"filled {self.disk.mount} ({filled['size_mib']:.1f} MiB)"
            fault.update(filled)
        else:
            target = fault["processes"][0] if kind == "task_kill" else None
            fault["what"] = strike(kind, self.run_dir, self.launcher, self.rank, target)
        done = complete_checkpoints(RunPaths.at(self.run_dir).checkpoint_dir)
        fault["checkpoint_at_strike"] = done[-1][0] if done else None
        since = t
        if kind in RESUMED:
            self.resume(kind, fault)
            since = time.time()

        def recovered() -> bool:  # the struck process back, and a step done since
            struck = self.restarted(kind, t, fault["processes"])
            return struck and any(r.time > since for r in steps_done(self.run_dir))

        fault["recovered"] = wait_for(recovered, self.left_s())
        later = [r for r in steps_done(self.run_dir) if r.time > since]
        fault["no_step_s"] = (later[0].time - t) if later else None
        fault["next_step"] = later[0].step if later else None
        if kind == "aof_truncate":
            fault["named"] = "append-only file was cut short" in self.log.read_text()
        if kind == "disk_full":  # the resume removed what the stop left half-written
            left = set(stale_publications(self.run_dir))
            fault["tmp_left"] = [n for n in fault["tmp_at_stop"] if n in left]
        if kind == "corrupt":
            root = RunPaths.at(self.run_dir).checkpoint_dir
            fault["set_aside"] = sorted(p.name for p in root.glob("step*.corrupt*"))
        led = live_ledger(self.run_dir)
        fault["lost"] = led.get("groups_lost") if led else None
        fault["trained_twice"] = led.get("trained_twice") if led else None
        fault["produced_twice"] = led.get("prompts_produced_twice") if led else None
        fault.pop("log_at", None)
        return fault

    def resume(self, kind: str, fault: dict[str, Any]) -> None:
        """After a fault that ended the launcher: check that no process is left, damage
        what the fault damages, and `--resume` (twice at once for `race_resume`)."""
        fault["launcher_exit"] = self.launcher.wait(timeout=180)
        if kind == "disk_full":
            self.after_disk_full(fault)
        if kind in ("launcher_kill", "power_loss", "aof_truncate", "disk_full"):
            left = survivors(self.run_dir, SURVIVAL_S)
            fault["survivors_after_10s"] = sum(len(p) for p in left.values())
            fault["survivors"] = left
        if kind == "aof_truncate":
            fault["what"] += f"; {cut_aof(self.run_dir)}"
            fault["named"] = False
        if kind == "race_resume":
            self.launcher, raced = racing_resumes(self.run_dir, self.log)
            fault.update(raced)
            return
        self.launcher = start_launcher(["--resume", str(self.run_dir)], self.log)

    def after_disk_full(self, fault: dict[str, Any]) -> None:
        """What the stopped launcher said and left; then the filesystem grows back."""
        with open(self.log, "rb") as f:
            f.seek(fault.pop("log_at"))
            said = f.read().decode(errors="replace")
        fault.update(stop_checks(self.run_dir, said, fault["t"]))
        fault["tmp_at_stop"] = stale_publications(self.run_dir)
        fault["grown"] = self.disk.grow()

    def wait_rank(self) -> int:
        """The trainer rank's pid, once it runs (found ahead, so a kill is instant)."""
        found: list[int] = []

        def rank() -> bool:
            try:
                found[:] = rank_pids(pids_of(self.run_dir))
            except (OSError, ValueError, KeyError):
                return False
            return bool(found)

        if not wait_for(rank, self.left_s()):
            raise BenchFailed(f"no trainer rank started; see {self.log}")
        return found[0]

    def restarted(self, kind: str, t: float, names: tuple[str, ...]) -> bool:
        """Was the struck process started again (a hung server: replaced) since `t`? (the
        launcher's faults: the resumed attempt is started by this bench)"""
        if kind in RESUMED:
            return True
        try:
            return restarts_of(self.run_dir, kind, t, names)[0] >= 1
        except (OSError, ValueError, KeyError):  # events.json being replaced
            return False

    def finish(self, wait: bool = True) -> int:
        """The launcher's exit code: once the job ends (`wait`), or at once (the bench
        was interrupted or failed: the launcher is stopped as Ctrl-C stops it)."""
        try:
            return self.launcher.wait(timeout=max(1.0, self.left_s()) if wait else 0.1)
        except subprocess.TimeoutExpired:
            if wait:
                raise
            self.launcher.send_signal(signal.SIGTERM)
            return self.launcher.wait(timeout=180)
        finally:
            if self.launcher.poll() is None:
                self.launcher.send_signal(signal.SIGTERM)
                self.launcher.wait(timeout=180)


def run_job(args: argparse.Namespace, out: Path, disk: SmallDisk) -> dict[str, Any]:
    kinds = fault_kinds(args.faults)
    job = Job(args, out, disk, kinds)
    faults: list[dict[str, Any]] = []
    baseline: dict[str, Any] | None = None
    ended = False  # every fault struck: the job is waited for to its end
    try:
        for at_step, kind in fault_plan(kinds, args.steps, args.seed):
            if kind == EARLY:  # steps take ~0.1 s here, the first checkpoint is 2 away
                job.rank = job.wait_rank()
                if baseline is None:  # nothing trained, nothing committed yet
                    baseline = live_ledger(job.run_dir)
                job.reach(at_step, poll_s=0.005)
            else:
                job.reach(at_step)
            if baseline is None:
                baseline = live_ledger(job.run_dir)
            if job.step() >= args.steps:  # the job ran past the fault's step to its end
                faults.append({"kind": kind, "at_step": job.step(), "struck": False})
                continue
            if kind == "disk_full" and disk.skipped:
                faults.append({"kind": kind, "struck": False, "skipped": disk.skipped})
                continue
            faults.append(job.fault(kind))
        ended = True
    finally:
        rc = job.finish(wait=ended)
    summary = json.loads(RunPaths.at(job.run_dir).summary.read_text())
    completed = rc == 0 and summary.get("steps") == args.steps
    for f in faults:
        if f.get("struck") is False:
            f.update(completed=completed, lost=None, trained_twice=None, produced_twice=None)
            continue
        names = tuple(f.pop("processes"))
        f["restarts"], f["restarted_after_s"] = restarts_of(
            job.run_dir, f["kind"], f.pop("t"), names
        )
        f["completed"] = completed
    keys = ["groups_admitted", "groups_produced", "groups_trained", "groups_dropped_stale"]
    keys += ["groups_filtered", "groups_pending", "groups_in_flight", "groups_lost"]
    keys += ["trained_twice", "prompts_produced_twice", "attempts", "restarts"]
    keys += ["wall_time_s", "active_time_s", "samples_per_s", "samples_per_s_wall"]
    before = {k: (baseline or {}).get(k) for k in ("groups_lost", "trained_twice")}
    return {
        "faults": faults,
        "completed": completed,
        "exit_code": rc,
        "before_first_fault": before,
        "final": {k: summary.get(k) for k in keys},
        "run_dir": str(job.run_dir),
    }


def fault_kinds(faults: str) -> list[str]:
    """The kinds of `--faults`, each checked against KINDS."""
    kinds = [k.strip() for k in faults.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise BenchFailed(
            f"--faults: unknown fault kind(s) {', '.join(unknown)}: expected some of "
            f"{', '.join(KINDS)}"
        )
    return kinds


def fault_ok(f: dict[str, Any]) -> bool:
    """A fault the job came through: completed with nothing lost (a cut append-only file
    loses what was after the cut: named, and counted), trained or produced twice, no
    survivor of a killed launcher, and what the kind itself must show."""
    if not f["completed"] or not (f["lost"] == 0 or f.get("named")):
        return False
    if f["trained_twice"] != 0 or f.get("survivors_after_10s") or f.get("produced_twice"):
        return False
    checks = {
        "corrupt": lambda: bool(f.get("set_aside")),
        EARLY: lambda: f["checkpoint_at_strike"] is None,
        "race_resume": lambda: f.get("loser_exit") == 2,
        "disk_full": lambda: disk_full_ok(f),
    }
    return checks.get(f["kind"], lambda: True)()


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = fault_kinds(args.faults)
    with scratch_dir("areal-hex-chaos-", args.output_dir) as scratch:
        out = Path(scratch).resolve()
        out.mkdir(parents=True, exist_ok=True)
        with SmallDisk(out / "disk", "disk_full" in kinds, out / RUN_ID) as disk:
            result = run_job(args, out, disk)
            if disk.mounted:
                result["run_dir"] = str(out / RUN_ID)  # copied there from the tmpfs
    ok = [f for f in result["faults"] if fault_ok(f)]
    return {
        "config": args.config,
        "steps": args.steps,
        "seed": args.seed,
        "faults_total": len(result["faults"]),
        "faults_ok": len(ok),
        "faults_skipped": sum(1 for f in result["faults"] if f.get("skipped")),
        **result,
    }
