"""Before any process starts: check that the config can run (`preflight`), name the run,
pick ports, write the initial weights `v0` and the resolved `config.yaml` every service
reads (see docs/running.md)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from areal_hex.config import ExperimentConfig, save_config
from areal_hex.config.base import build
from areal_hex.config.checks import check_run
from areal_hex.errors import UsageError
from areal_hex.net import free_port, free_port_block, port_free
from areal_hex.plan import Plan
from areal_hex.run_files import RunPaths
from areal_hex.tokenizer_files import TinyChat
from hexctl.job.placement_choice import Price, resolve_placement, write_choice
from hexctl.job.plan_config import project_plan
from hexctl.job.v0_cache import warm_started_v0
from hexctl.job.warm_start import sft_texts


# ---------------------------------------------------------------- preflight
def check_redis_reachable(cfg: ExperimentConfig) -> None:
    """An external `redis.url` must answer PING now, not after the services started."""
    if cfg.redis.url is None or cfg.run.embedded_redis:
        return
    import redis

    from areal_hex.buffer.embedded import RedisEndpoint, redact

    ep = RedisEndpoint(cfg.redis.url, cfg.redis.username, cfg.redis.password)
    client = ep.sync_client(socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise UsageError(
            f"redis.url {redact(cfg.redis.url)} is unreachable ({exc}): start that server, "
            "or leave redis.url unset for an embedded one"
        ) from None
    finally:
        client.close()


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a Hugging Face hub name (`org/name`)."""
    return path.startswith(("/", ".", "~")) or path.count("/") != 1 or Path(path).exists()


def check_model_path(cfg: ExperimentConfig) -> None:
    """`model.path` must be a model directory, or a hub name (looked up in the local cache
    only when the hub is offline)."""
    path = cfg.model.path
    if path is None:
        return
    if _looks_local(path):
        p = Path(path).expanduser()
        if not (p / "config.json").is_file():
            what = "does not exist" if not p.exists() else "has no config.json"
            raise UsageError(
                f"model.path {path}: {what}; expected a Hugging Face model directory "
                "(config.json, weights, tokenizer) or a hub name such as Qwen/Qwen3-0.6B"
            )
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise UsageError(
                f"model.path {path}: not in the local Hugging Face cache and HF_HUB_OFFLINE "
                "is set; download it first or give a model directory"
            )


def check_enough_prompts(cfg: ExperimentConfig) -> None:
    """A step takes `buffer.groups_per_step` distinct prompts: the split must hold that
    many (otherwise one batch would repeat prompts)."""
    from areal_hex.data import DataError, load_problems

    try:
        n = len(load_problems(cfg.data, cfg.data.split))
    except DataError as exc:
        raise UsageError(str(exc)) from None
    if cfg.buffer.groups_per_step > n:
        raise UsageError(
            f"buffer.groups_per_step ({cfg.buffer.groups_per_step}) is more than the "
            f"{n} prompts of data.dataset={cfg.data.dataset} split {cfg.data.split}: a "
            "batch would repeat prompts; lower groups_per_step or use more data"
        )


def check_redis_port(cfg: ExperimentConfig) -> None:
    """An embedded Valkey on a port chosen in the config needs that port free."""
    port = cfg.redis.port
    if cfg.redis.url is None and port is not None and not port_free(port, cfg.redis.bind):
        raise UsageError(
            f"redis.port {port} is taken on {cfg.redis.bind}: choose another or leave it "
            "unset for a free one"
        )


def preflight(cfg: ExperimentConfig) -> None:
    """Everything that can be known wrong before a process starts: raises UsageError (or
    ConfigError) with what is wrong, where, and what was expected."""
    check_run(cfg)
    check_model_path(cfg)
    check_redis_port(cfg)
    check_redis_reachable(cfg)
    check_enough_prompts(cfg)


def apply_mode(cfg: ExperimentConfig, mode: str | None) -> ExperimentConfig:
    """`--mode sync|async` over the config's `run.mode`; the config itself resolves what
    the mode means (`areal_hex.config.resolve_mode`: sync is η = 0, k = 1)."""
    if mode is None or mode == cfg.run.mode:
        return cfg
    data = cfg.model_dump(mode="json")
    data["run"]["mode"] = mode
    return build(ExperimentConfig, data, f"--mode {mode}")


def apply_plan(
    cfg: ExperimentConfig, plan: Plan | None, say: Callable[[str], None] | None = None
) -> ExperimentConfig:
    """Size the local job as planned (`hexctl.job.plan_config.project_plan`: a planned
    local run is a single-node one); `say` hears each key the plan changed."""
    if plan is None:
        return cfg
    planned = project_plan(cfg, plan, "local")
    for line in planned.changes:
        (say or _to_stderr)(line)
    return planned.config


def default_run_id(cfg: ExperimentConfig) -> str:
    return f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{cfg.run.mode}"


def initial_model_dir(cfg: ExperimentConfig, out: Path) -> Path:
    """The job's initial model: `model.path` if set, else written (warm start included)
    under `out`."""
    if cfg.model.path is not None and (Path(cfg.model.path) / "config.json").is_file():
        return Path(cfg.model.path)
    return materialize_v0(cfg, out)


def materialize_v0(cfg: ExperimentConfig, weights_dir: Path) -> Path:
    """Write `weights_dir/v0` (kept if present: a resumed run keeps its initial model)."""
    from areal_hex.models import materialize

    tiny = cfg.model.tiny
    if cfg.model.path is None and tiny is not None and tiny.sft_steps > 0:
        texts = sft_texts(cfg, TinyChat())
        return warm_started_v0(cfg.model, texts, weights_dir / "v0")  # cached across runs
    return materialize(cfg.model, weights_dir / "v0")


def choose_ports(cfg: ExperimentConfig, say: Callable[[str], None]) -> None:
    """Ports for the embedded Valkey, the servers and the workflow's tasks; a taken one is
    replaced, and `say` tells which port is used instead (a resumed run's ports may have
    been taken since, or another job on this machine holds them)."""
    bind = cfg.redis.bind
    if cfg.run.embedded_redis:
        port = cfg.redis.port
        if port is None or not port_free(port, bind):
            new = free_port(bind)
            if port is not None:
                say(f"redis.port {port} is taken; the embedded Valkey uses {new} instead")
            port = new
        cfg.redis.port = port
        cfg.redis.url = f"redis://127.0.0.1:{port}/0"
    inf = cfg.inference
    if not inf.server_urls:
        base = free_port_block(inf.num_servers, inf.base_port)
        if base != inf.base_port:
            last = inf.base_port + inf.num_servers - 1
            taken = f"{inf.base_port}" if last == inf.base_port else f"{inf.base_port}-{last}"
            say(
                f"inference.base_port: port(s) {taken} taken; the servers use "
                f"{base}-{base + inf.num_servers - 1} instead"
            )
        inf.base_port = base
    for task in cfg.workflow.tasks:  # a task whose address is its port (no urls given)
        if task.port is None or task.urls:
            continue
        base = free_port_block(task.instances, task.port)
        if base != task.port:
            say(
                f"workflow.tasks: task {task.name!r}'s port(s) from {task.port} taken; its "
                f"instances use {base}-{base + task.instances - 1} instead"
            )
            task.port = base


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)  # stdout may carry a bench's JSON


def prepare_run(
    cfg: ExperimentConfig,
    plan: Plan | None = None,
    mode: str | None = None,
    say: Callable[[str], None] | None = None,
    place: Callable[[ExperimentConfig, Plan | None], None] | None = None,
    price: Price | None = None,
) -> tuple[ExperimentConfig, Path]:
    """Resolve `cfg` for a local run and write the run directory. Returns the resolved
    config and the path of its `config.yaml`. A config that already names its run (a
    resume) keeps its run directory, weights v0, checkpoints and Valkey data. `place`
    rewrites the services' addresses for where they run, once the ports are chosen (a
    box's: `hexctl.box.run_config.apply_box`); `run.box` needs one. `workflow.placement:
    auto` becomes the fastest placement by `price` (`placement_choice.py`; None: the
    default), kept in the run directory."""
    if cfg.run.box is not None and place is None:
        raise UsageError(
            f"run.box={cfg.run.box}: only `areal-hex run`, `bench hetero`, `bench tasks` "
            "and `bench modes --box` run on a box"
        )
    cfg = apply_plan(apply_mode(cfg, mode), plan, say)
    cfg, choice = resolve_placement(cfg, price, say or _to_stderr)
    if cfg.run.run_id is None:
        cfg.run.run_id = default_run_id(cfg)
    run_dir = cfg.run.run_dir().resolve()
    cfg.run.output_dir = str(run_dir.parent)
    new = not run_dir.exists()
    try:
        RunPaths.at(run_dir).logs.mkdir(parents=True, exist_ok=True)
        if choice is not None:
            write_choice(RunPaths.at(run_dir).placement_choice, choice)
        if cfg.redis.url is None:  # embedded Valkey: the `redis` service of the layout
            cfg.run.embedded_redis = True
        if cfg.run.embedded_redis:
            cfg.redis.data_dir = cfg.redis.data_dir or str(run_dir / "valkey")
        choose_ports(cfg, say or _to_stderr)
        if place is not None:
            place(cfg, plan)
        inf = cfg.inference
        weights = RunPaths.at(run_dir, inf.weights_dir).weights_dir.resolve()
        weights.mkdir(parents=True, exist_ok=True)
        inf.weights_dir = str(weights)
        v0 = materialize_v0(cfg, weights)
        cfg.model.path = str(v0)
        cfg.model.tokenizer_path = None
        path = save_config(cfg, RunPaths.at(run_dir).config)
    except BaseException:  # a failure or an interrupt: no half-made run directory
        if new:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return cfg, path
