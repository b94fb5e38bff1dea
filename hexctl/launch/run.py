"""`areal-hex run`: the whole job as local processes, from the layout `deploy` renders.

Order: run directory and resolved config (prepare.py), v0 weights, Valkey, inference
servers (wait for /health), then trainer and controller. The run ends when the trainer
finishes its last step (then the controller, servers and Valkey are stopped, in that
order, and the report is written), on Ctrl-C / SIGTERM, or when a process fails for good
(its last log lines are printed and the exit code is 1). Any process that dies is
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
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from areal_hex.config import ExperimentConfig
from areal_hex.net import WaitAborted, wait_until
from areal_hex.plan import Plan
from areal_hex.run_files import RunPaths
from hexctl.job.cores import core_groups
from hexctl.job.layout import CONFIG_PLACEHOLDER, Layout, ServiceSpec, build_layout
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
    "inference": "restart",
    "redis": "restart",
    "worker": "restart",
    "trainer": "finish",
}


def process_specs(
    cfg: ExperimentConfig, layout: Layout, config_path: Path, host: str = "trainer"
) -> list[ProcessSpec]:
    """The processes of the run; with `run.pin_cores`, the servers on the inference cores,
    the trainer on the others, and Valkey and the controller on the `host` side's."""
    run_dir = cfg.run.run_dir()
    inference_cores, trainer_cores = core_groups(cfg.run.pin_cores)
    host_cores = inference_cores if host == "inference" else trainer_cores
    n_servers = len(layout.by_role("inference"))
    assign_local_gpus(layout)
    specs = []
    for svc in layout.services:
        cores = {"inference": inference_cores, "trainer": trainer_cores}.get(svc.role, host_cores)
        env = dict(svc.env)
        env["PYTHONUNBUFFERED"] = "1"
        if cores is not None:
            share = {
                "inference": max(1, len(cores) // max(1, n_servers)),
                "trainer": len(cores),
            }.get(svc.role, 1)
            env["OMP_NUM_THREADS"] = str(share)
        elif cfg.inference.device == "cpu" and svc.role == "inference":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
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
    def probe() -> bool:
        import httpx

        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200

    return probe


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


class HungServers:
    """Inference servers that stopped answering without dying (e.g. SIGSTOPped): a thread
    probes each one's /health every `every_s` (with a timeout); one that answered since
    its start and then stays silent for `run.hung_after_s` is killed, and the supervisor
    starts it again as it would a dead one."""

    def __init__(self, sup: Supervisor, urls: dict[str, str], limit_s: float) -> None:
        """`urls`: {process name: base URL} of the servers; `limit_s`: run.hung_after_s."""
        self.urls = urls
        self.sup = sup
        self.limit_s = limit_s
        self.every_s = min(2.0, self.limit_s / 3)
        self.last_ok: dict[tuple[str, int], float] = {}  # (name, pid) -> last answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, daemon=True)
        if self.urls:
            self._thread.start()

    def _probe_loop(self) -> None:
        import httpx

        while not self._stop.wait(self.every_s):
            for name, url in self.urls.items():
                pid = self.sup.pid(name)
                try:
                    ok = httpx.get(f"{url}/health", timeout=self.every_s).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok and pid is not None:
                    self.last_ok[(name, pid)] = time.monotonic()

    def check(self) -> dict[str, float]:
        """{server: seconds without an answer} of the running servers silent for longer
        than two probes; kills those silent for `hung_after_s`."""
        stalled = {}
        now = time.monotonic()
        for name in self.urls:
            pid = self.sup.pid(name)
            last = self.last_ok.get((name, pid)) if pid is not None else None
            if last is None or not self.sup.running(name):
                continue  # starting (or dead: the supervisor's business)
            silent = now - last
            if silent > 2 * self.every_s + 1.0:
                stalled[name] = silent
            if silent > self.limit_s:
                self.sup.kill(name, f"no answer to /health for {silent:.0f} s (hung)")
        return stalled

    def close(self) -> None:
        self._stop.set()


# ---------------------------------------------------------------- the run
def start_services(
    sup: Supervisor, cfg: ExperimentConfig, layout: Layout, specs: list[ProcessSpec]
) -> None:
    roles = {s.name: s.role for s in layout.services}
    by_role: dict[str, list[ProcessSpec]] = {}
    for spec in specs:
        by_role.setdefault(roles[spec.name], []).append(spec)
    for spec in by_role.get("redis", []):
        sup.start(spec)
        wait_ready(sup, spec.name, redis_probe(cfg), cfg.run.start_timeout_s)
    for spec in by_role.get("worker", []):  # the workflow's other tasks
        sup.start(spec)
    servers = by_role.get("inference", [])
    for spec in servers:
        sup.start(spec)
    urls = cfg.inference.urls()
    for i, spec in enumerate(servers):
        timeout = cfg.run.start_timeout_s
        if cfg.inference.backend == "sglang":
            timeout = max(timeout, cfg.inference.startup_timeout_s)
        wait_ready(sup, spec.name, http_probe(urls[i]), timeout)
    for spec in by_role.get("trainer", []) + by_role.get("controller", []):
        sup.start(spec)


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


def begin_attempt(run_dir: Path) -> int:
    """Number this start of the run directory (`attempts/<n>/`) before anything runs, so
    that an attempt whose launcher is killed still counts."""
    paths = RunPaths.at(run_dir)
    done = paths.attempts()
    n = (done[-1] + 1) if done else 1
    paths.attempt(n).mkdir(parents=True, exist_ok=True)
    return n


def write_events(
    run_dir: Path, sup: Supervisor, t_start: float, t_ready: float, n: int, ended: bool = True
) -> None:
    """Attempt n's events into `attempts/<n>/events.json`, and every attempt's into
    `events.json` (its top level: this attempt's). Written as the attempt goes (`ended`
    false: `t_end` is the time of the write), so a killed launcher leaves its attempt's
    events up to its last write."""
    paths = RunPaths.at(run_dir)
    data = {
        "t_start": t_start,
        "t_services_ready": t_ready,
        "t_end": time.time(),
        "ended": ended,
        "events": [{"time": t, "process": name, "event": e} for t, name, e in sup.events],
        "restarts": {name: m.restarts for name, m in sup.procs.items()},
    }
    _write_json(paths.attempt(n) / "events.json", data)
    every = []
    for k in paths.attempts():
        f = paths.attempt(k) / "events.json"
        with contextlib.suppress(OSError, json.JSONDecodeError):
            every.append(json.loads(f.read_text()))
    _write_json(paths.events, {**data, "attempt": n, "attempts": every})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # a launcher killed mid-write leaves the previous version


class AttemptLog:
    """Keeps the attempt's events file current while the run is watched (on each new
    event, and every `every_s`)."""

    def __init__(self, run_dir: Path, sup: Supervisor, t_start: float, n: int) -> None:
        self.run_dir, self.sup, self.t_start, self.n = run_dir, sup, t_start, n
        self.t_ready = t_start
        self._seen = -1
        self._last = 0.0

    def tick(self, every_s: float = 5.0) -> None:
        now = time.monotonic()
        if len(self.sup.events) == self._seen and now - self._last < every_s:
            return
        self._seen, self._last = len(self.sup.events), now
        write_events(self.run_dir, self.sup, self.t_start, self.t_ready, self.n, ended=False)

    def end(self) -> None:
        write_events(self.run_dir, self.sup, self.t_start, self.t_ready, self.n)


def execute(
    cfg: ExperimentConfig,
    config_path: Path,
    plan: Plan | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
    timeout_s: float | None = None,
    profile_dir: Path | None = None,
    place: Callable[[ExperimentConfig, Layout, list[ProcessSpec]], None] | None = None,
) -> RunResult:
    """Start, watch and stop the services of a prepared run; write the report. The cost
    model's prediction for the layout (`prediction.json`) comes from the plan, else from a
    local profile (`profile_dir`), for the report to hold the run against. `place` starts
    each process where it runs (a box's node: `hexctl.box.place.place_on_box`)."""
    from hexctl.job.predict import host_side, write_prediction
    from hexctl.launch.progress import Progress
    from hexctl.report.summary import write_report

    stream = stream or sys.stderr
    run_dir = cfg.run.run_dir()
    failed = None
    if plan is None and profile_dir is None and cfg.run.profile_first:
        from hexctl.launch.first_profile import profile_first

        profile_dir, failed = profile_first(cfg, run_dir, stream)
    host, prediction = ("trainer", failed) if failed else host_side(cfg, plan, profile_dir)
    write_prediction(RunPaths.at(run_dir).prediction, prediction)
    layout = build_layout(cfg, plan)
    specs = process_specs(cfg, layout, config_path, host)
    if place is not None:
        place(cfg, layout, specs)
    stats: dict[str, Any] | None = None
    ledger: dict[str, Any] | None = None
    with Supervisor(pid_file=run_dir / "pids.json") as sup:
        attempt = AttemptLog(run_dir, sup, time.time(), begin_attempt(run_dir))
        attempt.tick()
        try:
            start_services(sup, cfg, layout, specs)
        except LaunchError as exc:
            stop_services(sup, cfg, layout)
            attempt.end()
            return RunResult(run_dir, Outcome("failed", None, None, str(exc)))
        except KeyboardInterrupt:
            stop_services(sup, cfg, layout)
            attempt.end()
            return RunResult(run_dir, Outcome("interrupted"))
        attempt.t_ready = time.time()
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

        def tick() -> None:
            view.stalled = hung.check()
            view.tick()
            attempt.tick()

        outcome = sup.watch(on_tick=tick, timeout_s=timeout_s)
        hung.close()
        view.close()
        try:
            stats, ledger = stop_services(sup, cfg, layout)
        except KeyboardInterrupt:
            sup.stop(timeout_s=2)
        attempt.end()
    summary = write_report(run_dir, cfg, buffer=stats, outcome=outcome.status, ledger=ledger)
    attempt_dir = RunPaths.at(run_dir).attempt(attempt.n)
    shutil.copyfile(RunPaths.at(run_dir).summary, attempt_dir / "summary.json")
    return RunResult(run_dir, outcome, summary)


def failure_message(result: RunResult) -> str:
    o = result.outcome
    if o.name is None:
        return o.log_tail
    log = RunPaths.at(result.run_dir).log(o.name)
    tail = o.log_tail or tail_lines(log)
    return f"{o.name} exited with code {o.returncode}; last lines of {log}:\n{tail}"
