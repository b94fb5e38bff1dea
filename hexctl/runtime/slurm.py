"""What a Slurm job's batch script runs before its services: the run's config with this
job's host names, and waits until Redis and the inference servers answer.

    python3 -m hexctl.runtime.slurm config OUT --servers H0 H1 ... [--redis-host H]
        [--redis-password-file F] [--task NAME=H0,H1 ...]
    python3 -m hexctl.runtime.slurm wait redis|servers CONFIG --timeout S --pids P...

`config` reads the rendered `OUT/config.yaml`, points the controller at server i on
`H<i>` (port `inference.base_port + i`), at instance i of each server task `NAME` on its
`H<i>` (port `port + i`), and the services at Redis on the control node,
writes the run's `config.yaml` (no secrets) and the private copy every step reads,
`OUT/runtime/config.yaml` (0600, with the secrets of `OUT/secrets/`). Host names change
when a job is requeued, so this runs at every start. `wait` fails at once when one of
the given processes (the services' `srun`s) has exited.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from areal_hex.config import ConfigError, ExperimentConfig, load_config, save_config
from areal_hex.config.base import load_yaml_text
from areal_hex.net import WaitAborted, wait_until
from areal_hex.run_files import RunPaths
from hexctl.runtime.entry import write_runtime_config
from hexctl.runtime.probe import http_ok


def with_hosts(
    cfg: ExperimentConfig,
    servers: list[str],
    redis_host: str | None,
    tasks: dict[str, list[str]] | None = None,
) -> ExperimentConfig:
    """`cfg` with server i at `servers[i]`, instance i of server task `name` at
    `tasks[name][i]` (where the config does not name it) and (Redis inside the job)
    Redis on `redis_host`."""
    n = cfg.inference.num_servers
    if len(servers) != n:
        raise ConfigError(f"expected {n} server hosts (inference.num_servers), got {len(servers)}")
    cfg = cfg.model_copy(deep=True)
    base = cfg.inference.base_port
    cfg.inference.server_urls = [f"http://{h}:{base + i}" for i, h in enumerate(servers)]
    for task in cfg.workflow.tasks:
        hosts = (tasks or {}).get(task.name)
        if hosts is None or task.urls or task.port is None:
            continue
        if len(hosts) != task.instances:
            raise ConfigError(
                f"task {task.name!r}: {len(hosts)} host(s) for {task.instances} instance(s)"
            )
        task.urls = [f"http://{h}:{task.port + i}" for i, h in enumerate(hosts)]
    if redis_host is not None:
        port = cfg.redis.port or 6379
        cfg.redis.url = f"redis://{redis_host}:{port}/0"
    return cfg


def write_configs(
    out_dir: Path,
    servers: list[str],
    redis_host: str | None,
    password_file: Path | None,
    tasks: dict[str, list[str]] | None = None,
) -> Path:
    """The run's config.yaml and the private runtime copy; returns the copy's path."""
    cfg = with_hosts(load_config(out_dir / "config.yaml"), servers, redis_host, tasks)
    run_config = save_config(cfg, RunPaths.of(cfg).config)
    private = out_dir / "runtime" / "config.yaml"
    private.parent.mkdir(parents=True, exist_ok=True)
    private.parent.chmod(0o700)
    write_runtime_config(run_config, out_dir / "secrets", private)
    if password_file is not None:
        data = load_yaml_text(private.read_text(), str(private))
        data["redis"]["password"] = password_file.read_text().strip()
        private.write_text(yaml.safe_dump(data, sort_keys=False))
    return private


def _alive(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    return True


def redis_ready(cfg: ExperimentConfig) -> bool:
    import redis

    from areal_hex.buffer.embedded import RedisEndpoint

    assert cfg.redis.url is not None
    ep = RedisEndpoint(cfg.redis.url, cfg.redis.username, cfg.redis.password)
    client = ep.sync_client(socket_connect_timeout=1, socket_timeout=2)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False  # not listening yet
    finally:
        client.close()


def servers_ready(cfg: ExperimentConfig) -> bool:
    return all(http_ok(f"{url}/health") for url in cfg.inference.urls())


def wait(what: str, config: Path, timeout_s: float, pids: list[int]) -> int:
    cfg = load_config(config)
    probe = (lambda: redis_ready(cfg)) if what == "redis" else (lambda: servers_ready(cfg))
    try:
        ok = wait_until(probe, timeout_s, interval_s=1.0, alive=lambda: _alive(pids))
    except WaitAborted:
        print(f"slurm_runtime: a {what} step exited while starting", file=sys.stderr)
        return 1
    if not ok:
        print(f"slurm_runtime: {what} not ready after {timeout_s:.0f} s", file=sys.stderr)
        return 1
    print(f"slurm_runtime: {what} ready", flush=True)
    return 0


def _task_hosts(arg: str) -> tuple[str, list[str]]:
    name, sep, hosts = arg.partition("=")
    if not sep or not name or not hosts:
        raise ConfigError(f"--task {arg!r}: expected NAME=HOST0,HOST1,...")
    return name, hosts.split(",")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hexctl.runtime.slurm")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("out", type=Path)
    c.add_argument("--servers", nargs="+", required=True)
    c.add_argument("--redis-host", default=None)
    c.add_argument("--redis-password-file", type=Path, default=None)
    c.add_argument("--task", action="append", default=[], help="NAME=HOST0,HOST1,...")
    w = sub.add_parser("wait")
    w.add_argument("what", choices=("redis", "servers"))
    w.add_argument("config", type=Path)
    w.add_argument("--timeout", type=float, required=True)
    w.add_argument("--pids", type=int, nargs="+", default=[])
    args = p.parse_args(argv)
    try:
        if args.cmd == "config":
            tasks = dict(_task_hosts(t) for t in args.task)
            path = write_configs(
                args.out, args.servers, args.redis_host, args.redis_password_file, tasks
            )
            print(f"slurm_runtime: config written ({path})", flush=True)
            return 0
        return wait(args.what, args.config, args.timeout, args.pids)
    except (ConfigError, OSError) as exc:
        print(f"slurm_runtime: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
