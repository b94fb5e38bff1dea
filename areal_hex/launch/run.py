"""Orchestrate a local run: run directory, initial weights, embedded Valkey, inference
servers, trainer and controller as processes from `build_layout`, progress, report."""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig, save_config
from areal_hex.launch.supervisor import ProcessSpec, Supervisor
from areal_hex.layout import CONFIG_PLACEHOLDER, ServiceSpec, build_layout
from areal_hex.plan import Plan


@dataclass
class Prepared:
    cfg: ExperimentConfig  # resolved: run id, weights, redis.url all set
    config_path: Path  # <run_dir>/config.yaml
    embedded_redis: bool  # the run starts (and stops) its own Valkey


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare(cfg: ExperimentConfig, mode: str | None = None) -> Prepared:
    """Resolve a config for a run (run id, mode, weights v0, Redis address), create the run
    directory and write `config.yaml` there."""
    cfg = cfg.model_copy(deep=True)
    if mode is not None:
        cfg.run.mode = mode
    if cfg.run.mode == "sync":
        cfg.buffer.max_staleness = 0  # a step's rollout waits for the previous step's weights
    if cfg.run.run_id is None:
        cfg.run.run_id = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = cfg.run.run_dir()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    weights = (run_dir / "weights").resolve()
    v0 = materialize_initial(cfg, weights / "v0")
    cfg.model.path = str(v0)
    cfg.model.tokenizer_path = None
    cfg.inference.weights_dir = str(weights)
    embedded = cfg.redis.url is None
    if embedded:
        cfg.redis.url = f"redis://127.0.0.1:{_free_port()}"
        cfg.redis.data_dir = str((run_dir / "redis").resolve())
    path = save_config(cfg, run_dir / "config.yaml")
    return Prepared(cfg, path.resolve(), embedded)


def materialize_initial(cfg: ExperimentConfig, out: Path) -> Path:
    """Write v0; a tiny model with `sft_steps` is warm-started on worked training answers."""
    from areal_hex.models import materialize

    tiny = cfg.model.tiny
    texts = None
    if cfg.model.path is None and tiny is not None and tiny.sft_steps > 0:
        texts = warm_start_texts(cfg)
    return materialize(cfg.model, out, sft_texts=texts)


def warm_start_texts(cfg: ExperimentConfig) -> list[str]:
    """Prompt + reference solution + end of turn, for the first `run.warm_start_fraction`
    of the training split (the rest is left for RL to learn)."""
    from areal_hex.data import DEFAULT_INSTRUCTIONS, load_problems, render_prompt
    from areal_hex.models import build_tokenizer

    tok = build_tokenizer()
    problems = load_problems(cfg.data, cfg.data.split)
    n = max(1, int(len(problems) * cfg.run.warm_start_fraction))
    instruction = cfg.data.instruction
    if instruction is None:
        instruction = DEFAULT_INSTRUCTIONS[cfg.data.dataset]
    return [
        render_prompt(p.question, tok, cfg.data.use_chat_template, instruction)
        + p.solution
        + str(tok.eos_token)
        for p in problems[:n]
    ]


def _cores(role: str, pin: bool) -> list[int] | None:
    """With pinning: the rollout side on the first half of the cores, the trainer on the
    rest, so generation and training really run apart even on two cores."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None
    half = len(cores) // 2
    return cores[half:] if role == "trainer" else cores[:half]


def process_specs(prep: Prepared, plan: Plan | None = None) -> list[ProcessSpec]:
    """The layout's services as local processes, the embedded Valkey first."""
    services = build_layout(prep.cfg, plan).services
    if prep.embedded_redis:
        redis = ServiceSpec("redis", "redis", ["areal-hex", "buffer", "serve", CONFIG_PLACEHOLDER])
        services = [redis, *services]
    return [_process(prep, svc) for svc in services]


def _process(prep: Prepared, svc: ServiceSpec) -> ProcessSpec:
    cfg = prep.cfg
    argv = [str(prep.config_path) if a == CONFIG_PLACEHOLDER else a for a in svc.command]
    argv = [sys.executable, "-m", "areal_hex.cli", *argv[1:]]  # the interpreter running us
    if svc.role == "redis":
        port = str(cfg.redis.url).rsplit(":", 1)[1]
        argv += ["--port", port, "--dir", str(cfg.redis.data_dir)]
    cores = _cores(svc.role, cfg.run.pin_cores)
    env = {"PYTHONUNBUFFERED": "1", **svc.env}
    if cores:
        share = 1 if svc.role == "trainer" else max(1, cfg.inference.num_servers)
        env["OMP_NUM_THREADS"] = str(max(1, len(cores) // share))
    return ProcessSpec(
        name=svc.name,
        argv=argv,
        log=cfg.run.run_dir() / "logs" / f"{svc.name}.log",
        env=env,
        cores=cores,
        max_restarts=cfg.run.max_restarts if svc.role == "inference" else 0,
        final=svc.role == "trainer",
    )


def wait_ready(sup: Supervisor, name: str, url: str, timeout_s: float) -> None:
    """Poll `url` until it answers 200, failing early if the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.check()
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{name} did not become healthy at {url} within {timeout_s:.0f} s")


def wait_redis(sup: Supervisor, url: str, timeout_s: float) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.check()
        try:
            redis.Redis.from_url(url, socket_timeout=2).ping()
            return
        except redis.RedisError:
            time.sleep(0.2)
    raise TimeoutError(f"embedded Valkey did not answer at {url} within {timeout_s:.0f} s")


def start_services(sup: Supervisor, prep: Prepared, plan: Plan | None = None) -> None:
    """Start in dependency order: Valkey, servers (wait for /health), trainer, controller."""
    cfg = prep.cfg
    specs = {s.name: s for s in process_specs(prep, plan)}
    layout = build_layout(cfg, plan)
    if prep.embedded_redis:
        sup.start(specs["redis"])
        wait_redis(sup, str(cfg.redis.url), cfg.run.start_timeout_s)
    for svc in layout.by_role("inference"):
        sup.start(specs[svc.name])
    for svc in layout.by_role("inference"):
        url = f"http://{cfg.inference.host}:{svc.port}/health"
        wait_ready(sup, svc.name, url, cfg.run.start_timeout_s)
    for role in ("trainer", "controller"):
        for svc in layout.by_role(role):
            sup.start(specs[svc.name])


def buffer_stats(cfg: ExperimentConfig) -> dict[str, Any]:
    from dataclasses import asdict

    import redis

    from areal_hex.buffer.consumer import read_stats
    from areal_hex.buffer.keys import BufferKeys

    r = redis.Redis.from_url(str(cfg.redis.url), socket_timeout=5)
    try:
        return asdict(read_stats(r, BufferKeys(str(cfg.run.run_id))))
    finally:
        r.close()


def run_job(prep: Prepared, plan: Plan | None = None) -> dict[str, Any]:
    """Start everything, show progress until the trainer's last step, stop cleanly, write
    the report. Raises ProcessFailed (with the process's last log lines) on a crash that a
    restart cannot fix."""
    from areal_hex.launch.progress import Progress
    from areal_hex.launch.report import summarize, write_report

    cfg = prep.cfg
    run_dir = cfg.run.run_dir()
    t0 = time.time()
    progress = Progress(run_dir, cfg.trainer.total_steps, cfg.run.progress)
    stats: dict[str, Any] | None = None
    with Supervisor() as sup:
        start_services(sup, prep, plan)
        try:
            while not sup.check():
                progress.update()
                time.sleep(1.0)
        finally:
            progress.update()
            progress.close()
            # The controller first (it records what is in flight), then read the buffer
            # while Valkey still runs, then the rest.
            sup.stop(["controller"])
            try:
                stats = buffer_stats(cfg)
            except Exception:  # noqa: BLE001 - the report says the count is unknown
                stats = None
    summary = summarize(run_dir, time.time() - t0, stats)
    summary["mode"] = cfg.run.mode
    summary["max_staleness_allowed"] = cfg.buffer.max_staleness
    summary["restarts"] = sup.events
    write_report(run_dir, summary)
    return summary
