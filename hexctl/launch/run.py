"""`areal-hex run`: the whole job as local processes, from the layout `deploy` renders.

Order: run directory and resolved config (prepare.py), v0 weights, the inference servers,
the trainer and Valkey together, then (Valkey answering) the controller (the launcher
waits for the servers' /health; the controller for one healthy server, or for every one
with `rollout.wait_for_servers=all`). The run ends
when the trainer finishes its last step (then the controller, servers and Valkey are
stopped, in that order, and the report is written), on Ctrl-C / SIGTERM, or when a
process fails for good (its last log lines are printed and the exit code is 1), or when
the disk fills (launch/disk.py). Any process that dies is
restarted, up to `run.max_restarts` times each: an inference server or Valkey (on its
append-only file) whatever its exit code, the trainer (from its newest complete
checkpoint) and the controller (at its data position) when they fail. An inference
server that stops answering its health probe for `run.hung_after_s` is killed and
restarted the same way (`HungServers`). No process outlives the launcher, even one
killed with SIGKILL (areal_hex/lifetime.py).

Each start of a run directory is an attempt: `attempts/<n>/` keeps its events (written
as it goes, so a killed launcher's attempt counts too) and summary; `events.json` lists
every attempt and `summary.json` holds the ledger over all of them
(hexctl/report/ledger.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from areal_hex.config import ExperimentConfig
from areal_hex.net import WaitAborted, http_ok, wait_until
from areal_hex.plan import Plan
from areal_hex.run_files import RunPaths, remove_stale_tmp
from hexctl.job.cores import core_groups, lent_services
from hexctl.job.layout import CONFIG_PLACEHOLDER, Layout, ServiceSpec, build_layout
from hexctl.launch.attempts import AttemptLog, begin_attempt, end_attempt
from hexctl.launch.disk import NO_SPACE, DiskFull, DiskWatch, disk_full_message, is_disk_full
from hexctl.launch.fork_services import attach_fork_server, forkable
from hexctl.launch.forkserver import ForkServer
from hexctl.launch.hung import HungServers
from hexctl.launch.stall import Stalled, StallWatch
from hexctl.launch.startup_cores import StartupCores, run_cores
from hexctl.launch.storage import (
    aof_damage,
    aof_refused,
    forget_weight_groups,
    say_before_start,
    valkey_dir,
)
from hexctl.launch.supervisor import OnExit, Outcome, ProcessSpec, Supervisor, tail_lines


class LaunchError(RuntimeError):
    """A service did not come up; the message says which and shows its log."""


@dataclass
class RunResult:
    run_dir: Path
    outcome: Outcome
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome.status == "finished"


# ---------------------------------------------------------------- process placement
def assign_local_gpus(layout: Layout) -> None:
    """Without a plan, GPU services get consecutive local GPUs in layout order
    (inference servers first, then the trainer's ranks)."""
    if any(s.devices for s in layout.services):
        return  # planned placement
    nxt = 0
    for svc in layout.services:
        if svc.gpus > 0:
            svc.devices = list(range(nxt, nxt + svc.gpus))
            nxt += svc.gpus


def _command(svc: ServiceSpec, config_path: Path) -> list[str]:
    """The layout's command with this tree's interpreter (`python -m hexctl.cli`), so
    the services run the same code as the launcher."""
    argv = [str(config_path) if a == CONFIG_PLACEHOLDER else a for a in svc.command]
    if argv and argv[0] == "areal-hex":
        argv = [sys.executable, "-m", "hexctl.cli", *argv[1:]]
    return argv


# What a service exiting means (supervisor.OnExit); any of them failing is restarted.
ON_EXIT: dict[str, OnExit] = {
    "inference": "restart", "redis": "restart", "worker": "restart", "trainer": "finish",
}  # fmt: skip


def process_specs(
    cfg: ExperimentConfig, layout: Layout, config_path: Path, host: str = "trainer"
) -> list[ProcessSpec]:
    """The processes of the run; with `run.pin_cores`, the servers on the inference cores,
    the trainer on the others, and Valkey and the controller on the `host` side's
    (colocated: every process on every core, each side's threads as many as the cores)."""
    run_dir = cfg.run.run_dir()
    placement = cfg.workflow.placement_in_effect()
    inference_cores, trainer_cores = core_groups(cfg.run.pin_cores, placement)
    host_cores = inference_cores if host == "inference" else trainer_cores
    lent = lent_services(cfg, layout)  # hybrid: servers on the trainer's cores
    n_servers = len(layout.by_role("inference")) - len(lent)
    assign_local_gpus(layout)
    specs = []
    for svc in layout.services:
        side = "lent" if svc.name in lent else svc.role
        cores = {"inference": inference_cores, "trainer": trainer_cores, "lent": trainer_cores}
        cores = cores.get(side, host_cores)
        env = dict(svc.env)
        env["PYTHONUNBUFFERED"] = "1"
        if cores is not None:
            share = {
                "inference": max(1, len(cores) // max(1, n_servers)),
                "lent": max(1, len(cores) // max(1, len(lent))),
                "trainer": len(cores),
            }.get(side, 1)
            env["OMP_NUM_THREADS"] = str(share)
        elif cfg.inference.device == "cpu" and svc.role == "inference":
            every = os.cpu_count() or 2
            own = every if placement == "colocated" else every // 2
            env["OMP_NUM_THREADS"] = str(max(1, own // max(1, n_servers)))
        if placement != "disaggregated":
            # the phases share cores: a thread that waits at an OpenMP barrier
            # sleeps instead of spinning on a core the other phase needs (twice the
            # steady rate of spinning threads on this 2-core machine: docs/modes.md)
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        if svc.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in svc.devices)
        pythonpath = os.environ.get("PYTHONPATH")
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root if not pythonpath else f"{root}{os.pathsep}{pythonpath}"
        specs.append(
            ProcessSpec(
                name=svc.name,
                command=_command(svc, config_path),
                log_path=RunPaths.at(run_dir).log(svc.name),
                env=env,
                on_exit=ON_EXIT.get(svc.role, "fail"),
                restart_on_failure=True,
                max_restarts=cfg.run.max_restarts,
                cpus=cores,
                fork=cfg.run.fork_services and forkable(svc),
            )
        )
    return specs


# ---------------------------------------------------------------- readiness
def wait_ready(sup: Supervisor, name: str, probe: Any, timeout_s: float) -> None:
    """Poll `probe()` until True; fail early (with the log) if the process dies."""
    try:
        # Any error from a probe means "not listening yet"; the process's own death is
        # what ends the wait early.
        if wait_until(probe, timeout_s, alive=lambda: sup.running(name), retry_on=(Exception,)):
            return
    except WaitAborted:
        raise LaunchError(
            f"{name} exited while starting; last log lines:\n{sup.tail(name)}"
        ) from None
    raise LaunchError(
        f"{name} not ready after {timeout_s:.0f} s; last log lines:\n{sup.tail(name)}"
    )


def redis_probe(cfg: ExperimentConfig) -> Any:
    def probe() -> bool:
        from areal_hex.buffer.embedded import RedisEndpoint

        assert cfg.redis.url is not None
        ep = RedisEndpoint(cfg.redis.url, cfg.redis.username, cfg.redis.password)
        client = ep.sync_client(socket_connect_timeout=1, socket_timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()

    return probe


def http_probe(url: str) -> Any:
    return lambda: http_ok(url)


def buffer_stats(cfg: ExperimentConfig) -> dict[str, Any] | None:
    """The buffer's counters (read before Valkey stops), or None if unreachable."""
    import dataclasses

    from areal_hex.buffer import BufferKeys, read_stats

    client = _client(cfg)
    if client is None:
        return None
    try:
        return dataclasses.asdict(read_stats(client, BufferKeys(str(cfg.run.run_id))))
    except Exception:
        return None
    finally:
        client.close()


def _client(cfg: ExperimentConfig) -> Any:
    from areal_hex.buffer.embedded import RedisEndpoint

    if cfg.redis.url is None or cfg.run.run_id is None:
        return None
    ep = RedisEndpoint(cfg.redis.url, cfg.redis.username, cfg.redis.password)
    return ep.sync_client(socket_connect_timeout=2, socket_timeout=5)


def run_ledger(cfg: ExperimentConfig) -> dict[str, Any]:
    """The ledger from the running Valkey, else from a copy of its append-only file."""
    import redis

    from hexctl.report.ledger import ledger_from_aof, read_ledger

    paths = RunPaths.of(cfg)
    run_id = str(cfg.run.run_id)
    client = _client(cfg)
    if client is not None:
        try:
            return read_ledger(client, run_id, paths)
        except redis.RedisError:
            pass
        finally:
            client.close()
    valkey_dir = Path(cfg.redis.data_dir) if cfg.redis.data_dir else paths.valkey
    return ledger_from_aof(valkey_dir, run_id, paths)


# ---------------------------------------------------------------- the run
def start_services(
    sup: Supervisor, cfg: ExperimentConfig, layout: Layout, specs: list[ProcessSpec],
    forked_hook: Callable[[], object] = lambda: None,
) -> None:  # fmt: skip
    """Start `specs` in order (`forked_hook`: called as each forked one is started)."""
    roles = {s.name: s.role for s in layout.services}
    # a forked service starts once the fork server has imported (seconds): the plain ones
    # (Valkey and its wait, the controller) go first, beside those imports
    forked: list[ProcessSpec] = []

    def start(spec: ProcessSpec) -> None:
        if spec.fork and sup.forker is not None:
            forked.append(spec)
        else:
            sup.start(spec)

    by_role: dict[str, list[ProcessSpec]] = {}
    for spec in specs:
        by_role.setdefault(roles[spec.name], []).append(spec)
    servers, trainers = by_role.get("inference", []), by_role.get("trainer", [])
    # the servers and the trainer first, beside Valkey: their starts (imports, the model)
    # are the longest, and neither uses the buffer before it answers (the trainer retries
    # its connection); with network weight sync the trainer waits for the old manifests
    # to be forgotten
    early = servers + (trainers if cfg.rollout.weight_sync != "network" else [])
    for spec in early + by_role.get("redis", []):
        start(spec)
    for spec in by_role.get("redis", []):
        wait_ready(sup, spec.name, redis_probe(cfg), cfg.run.start_timeout_s)
        sup.events.append((time.time(), spec.name, "ready"))
    for spec in by_role.get("worker", []):  # the workflow's other tasks
        start(spec)
    if cfg.rollout.weight_sync == "network" and (client := _client(cfg)) is not None:
        with contextlib.closing(client):
            forget_weight_groups(client, str(cfg.run.run_id))
    # the controller waits for a healthy server itself
    for spec in [t for t in trainers if t not in early] + by_role.get("controller", []):
        start(spec)
    for spec in forked:
        sup.start(spec)
        forked_hook()
    urls = cfg.inference.urls()
    for i, spec in enumerate(servers):
        timeout = cfg.run.start_timeout_s
        if cfg.inference.backend == "sglang":
            timeout = max(timeout, cfg.inference.startup_timeout_s)
        wait_ready(sup, spec.name, http_probe(urls[i]), timeout)
        sup.events.append((time.time(), spec.name, "ready"))


def stop_services(
    sup: Supervisor, cfg: ExperimentConfig, layout: Layout
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Controller first (it puts or gives back what is in flight), then the trainer (it
    checkpoints its last completed step and acknowledges it), then read the buffer and
    the ledger, then servers and Valkey. Returns (buffer counters, ledger)."""

    def names(role: str) -> list[str]:
        return [s.name for s in layout.by_role(role)]  # type: ignore[arg-type]

    sup.stop(names("controller"), timeout_s=cfg.rollout.stop_grace_s + 15)
    sup.stop(names("trainer"), timeout_s=60)
    stats = buffer_stats(cfg)
    ledger = run_ledger(cfg) if cfg.run.run_id is not None else None
    sup.stop(names("inference") + names("worker"), timeout_s=15)
    sup.stop(names("redis"), timeout_s=15)
    return stats, ledger


def execute(
    cfg: ExperimentConfig,
    config_path: Path,
    plan: Plan | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
    timeout_s: float | None = None,
    profile_dir: Path | None = None,
    place: Callable[[ExperimentConfig, Layout, list[ProcessSpec]], None] | None = None,
    milestones: Sequence[tuple[float, str]] = (),
    forker: ForkServer | None = None,
) -> RunResult:
    """Start, watch and stop the services of a prepared run; write the report. The cost
    model's prediction for the layout (`prediction.json`) comes from the plan, else from a
    local profile (`profile_dir`), for the report to hold the run against. `place` starts
    each process where it runs (a box's node: `hexctl.box.place.place_on_box`);
    `milestones`, (time, what) of the launcher before this call, join the events (the
    start-up timeline); `forker`, a fork server started before (`early_fork_server`)."""
    from hexctl.job.predict import host_side, write_prediction

    stream = stream or sys.stderr
    run_dir = cfg.run.run_dir()
    failed = None
    if plan is None and profile_dir is None and cfg.run.profile_first:
        from hexctl.launch.first_profile import profile_first

        profile_dir, failed = profile_first(cfg, run_dir, stream)
    host, prediction = host_side(cfg, plan, profile_dir, failed)
    write_prediction(RunPaths.at(run_dir).prediction, prediction)
    layout = build_layout(cfg, plan)
    specs = process_specs(cfg, layout, config_path, host)
    if place is not None:
        place(cfg, layout, specs)
    paths = RunPaths.of(cfg)
    for stale in remove_stale_tmp(paths.weights_dir):
        stream.write(f"removed {stale}: the unfinished publication of a process now gone\n")
    say_before_start(cfg, lambda text: print(text, file=stream, flush=True))
    disk = DiskWatch(run_dir, paths.weights_dir, paths.checkpoint_dir)
    aof = valkey_dir(cfg)
    stats: dict[str, Any] | None = None
    ledger: dict[str, Any] | None = None
    # a local run starts on every core, pinned from its first step (startup_cores.py)
    cores = run_cores(cfg, specs, host) if place is None else StartupCores([])
    with Supervisor(pid_file=run_dir / "pids.json") as sup:
        sup.events.extend((t, "launcher", what) for t, what in milestones)
        if place is None:  # a box's nodes start their processes as before
            attach_fork_server(sup, cfg, specs, forker)
        attempt = AttemptLog(run_dir, sup, time.time(), begin_attempt(run_dir))
        try:
            attempt.tick()
            starting = cores.unpinned(specs, forking=sup.forker is not None)
            start_services(sup, cfg, layout, starting, lambda: cores.release(sup))
        except (LaunchError, KeyboardInterrupt, OSError) as exc:
            return _start_failed(sup, cfg, layout, attempt, exc)
        attempt.t_ready = time.time()
        if aof is not None and (cut := aof_damage(aof)) is not None:
            print(f"areal-hex run: {cut}", file=stream, flush=True)
            sup.events.append((time.time(), "redis", f"damaged storage: {cut}"))
        outcome = _watch(sup, cfg, layout, attempt, disk, stream, progress, timeout_s, cores)
        try:
            stats, ledger = stop_services(sup, cfg, layout)
        except KeyboardInterrupt:
            sup.stop(timeout_s=2)
        outcome.log_tail += end_attempt(attempt)
    return _report(cfg, run_dir, attempt.n, outcome, stats, ledger)


def _start_failed(
    sup: Supervisor,
    cfg: ExperimentConfig,
    layout: Layout,
    attempt: AttemptLog,
    exc: LaunchError | KeyboardInterrupt | OSError,
) -> RunResult:
    """A start cut short (a service that did not come up, Ctrl-C, a full disk): what
    started is stopped; an append-only file Valkey refused is named (exit 2)."""
    run_dir = cfg.run.run_dir()
    if isinstance(exc, OSError) and not is_disk_full(exc):
        raise exc
    stop_services(sup, cfg, layout)
    if isinstance(exc, KeyboardInterrupt):
        end_attempt(attempt)
        return RunResult(run_dir, Outcome("interrupted"))
    aof = valkey_dir(cfg)
    refused = aof_refused(aof) if aof is not None else None
    if refused is not None:
        end_attempt(attempt)
        raise refused from None
    why = str(exc) if isinstance(exc, LaunchError) else _disk_text(run_dir, exc)
    return RunResult(run_dir, Outcome("failed", None, None, why + end_attempt(attempt)))


def _watch(
    sup: Supervisor,
    cfg: ExperimentConfig,
    layout: Layout,
    attempt: AttemptLog,
    disk: DiskWatch,
    stream: TextIO,
    progress: bool,
    timeout_s: float | None,
    cores: StartupCores,
) -> Outcome:
    """Watch the started services until the run ends, showing progress: hung servers
    are replaced, a stall (run.stall_after_s) or a full disk stops the run."""
    from hexctl.launch.progress import Progress

    run_dir = cfg.run.run_dir()
    servers = [s.name for s in layout.by_role("inference")]  # type: ignore[arg-type]
    urls = dict(zip(servers, cfg.inference.urls(), strict=False))
    hung = HungServers(sup, urls, cfg.run.hung_after_s)
    view = Progress(
        run_dir,
        cfg.trainer.total_steps,
        stream,
        enabled=progress,
        mode=cfg.run.progress,
        services=[s.name for s in layout.services if s.role in ("trainer", "controller")],
    )
    stall = StallWatch(
        sup,
        run_dir,
        cfg.run.stall_after_s,
        cfg.run.stop_on_stall,
        lambda: buffer_stats(cfg),
        lambda text: print(text, file=stream, flush=True),
    )

    def tick() -> None:
        view.stalled = hung.check()
        idle = stall.check(int(view.state.get("step", 0)))
        view.state["no_step_s"] = idle if idle >= cfg.run.stall_after_s / 2 else None
        view.tick()
        if cores.check(sup, int(view.state.get("step", 0))):
            sup.events.append((time.time(), "launcher", "pinned to the planned cores"))
        disk.check()
        attempt.tick()

    try:
        outcome = sup.watch(on_tick=tick, timeout_s=timeout_s)
    except Stalled as exc:
        outcome = Outcome("failed", None, None, f"stalled: {exc}")
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        outcome = Outcome("failed", None, None, _disk_text(run_dir, exc))
    hung.close()
    view.close()
    return outcome


def _disk_text(run_dir: Path, exc: OSError) -> str:
    return str(exc) if isinstance(exc, DiskFull) else disk_full_message(run_dir)


def _report(
    cfg: ExperimentConfig,
    run_dir: Path,
    n: int,
    outcome: Outcome,
    stats: dict[str, Any] | None,
    ledger: dict[str, Any] | None,
) -> RunResult:
    """The report of the attempt; a disk too full for it is said, and the run's
    `--resume` writes it once space is free."""
    from hexctl.report.summary import write_report

    if outcome.name is not None and NO_SPACE in (
        outcome.log_tail or tail_lines(RunPaths.at(run_dir).log(outcome.name))
    ):
        outcome.log_tail = f"{outcome.log_tail}\n{disk_full_message(run_dir)}"
    try:
        summary = write_report(run_dir, cfg, buffer=stats, outcome=outcome.status, ledger=ledger)
        attempt_dir = RunPaths.at(run_dir).attempt(n)
        shutil.copyfile(RunPaths.at(run_dir).summary, attempt_dir / "summary.json")
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        why = f"summary.json not written ({exc.strerror}): --resume writes it"
        return RunResult(run_dir, Outcome("failed", None, None, f"{outcome.log_tail}\n{why}"))
    return RunResult(run_dir, outcome, summary)


def failure_message(result: RunResult) -> str:
    o = result.outcome
    if o.name is None:
        return o.log_tail
    log = RunPaths.at(result.run_dir).log(o.name)
    tail = o.log_tail or tail_lines(log)
    return f"{o.name} exited with code {o.returncode}; last lines of {log}:\n{tail}"
