"""Entry point of one trainer rank: `python -m trainer_service.main CONFIG [overrides]`,
started by the deepspeed (or torchrun) launcher that `areal-hex train` execs.

This is the wiring: it reads the whole config once and hands each part its section.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig, load_config
from areal_hex.device_kind import device_kind
from areal_hex.errors import UsageError
from areal_hex.gc_freeze import defer_collection, freeze_startup
from areal_hex.heap import keep_heap
from areal_hex.lifetime import tie_to_launcher
from areal_hex.prom import (
    BufferCollector,
    MetricsServer,
    TrainerCollector,
    prediction_collectors,
    registry_with,
)
from areal_hex.run_files import STATUS_MARK, RunPaths
from areal_hex.trackers import open_run_trackers
from areal_hex.weight_net import Manifest
from trainer_service.loop import Trainer, TrainerPaths
from trainer_service.publish import NetworkSink
from trainer_service.reference import reference_model
from trainer_service.step import StepContext

log = logging.getLogger("trainer")


def resolve_paths(cfg: ExperimentConfig) -> TrainerPaths:
    run = RunPaths.of(cfg)
    model_dir = Path(cfg.model.path) if cfg.model.path else run.version_dir(0)
    return TrainerPaths(
        model_dir=model_dir,
        run_dir=run.root,
        weights_dir=run.weights_dir,
        checkpoint_dir=run.checkpoint_dir,
    )


def make_consumer(cfg: ExperimentConfig) -> Any:
    """The trajectory source of rank 0: a replay file, or the Redis buffer."""
    if cfg.trainer.replay_path:
        from trainer_service.sources import ReplayConsumer

        return ReplayConsumer(cfg.trainer.replay_path)
    from trainer_service.sources import BufferSource

    assert cfg.run.run_id is not None
    return BufferSource(cfg.redis, cfg.buffer, cfg.run.run_id, cfg.buffer.retry_s)


def init_distributed(device: str) -> tuple[int, int]:
    import deepspeed
    import torch
    import torch.distributed as dist

    if device == "cuda":  # before NCCL starts: each rank owns one device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    if device == "cpu":
        atexit.register(remove_shm_buffers)
    return dist.get_rank(), dist.get_world_size()


def remove_shm_buffers() -> None:
    """DeepSpeed's CPU all-reduce maps a ~69 MB file per rank in /dev/shm
    (`deepspeed_allreduce_buffer_<n>_<master addr>_<port>_<local rank>`) and never
    unlinks it; every run would leave its own behind in memory. Each rank removes its own."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return
    local = os.environ.get("LOCAL_RANK", "0")
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_{local}"):
        f.unlink(missing_ok=True)


def prepare_model_dir(cfg: ExperimentConfig, paths: TrainerPaths, rank: int) -> None:
    """Standalone runs without a launcher-written v0: rank 0 materialises it."""
    import torch.distributed as dist

    if rank == 0 and not (paths.model_dir / "config.json").is_file():
        from areal_hex.models import materialize

        materialize(cfg.model, paths.model_dir)
    dist.barrier()


def build_trainer(cfg: ExperimentConfig, rank: int, world: int) -> Trainer:
    import torch

    from areal_hex.models import load_model, load_tokenizer
    from trainer_service.engine import build_engine, flush_denormals

    paths = resolve_paths(cfg)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    prepare_model_dir(cfg, paths, rank)
    torch.manual_seed(cfg.run.seed)
    t = cfg.trainer
    flush_denormals(t.device)
    device = "cpu" if t.device == "cpu" else f"cuda:{torch.cuda.current_device()}"
    model = load_model(paths.model_dir, "cpu", "float32").train()
    engine = build_engine(model, t, world, cfg.algo.ppo_minibatches)
    value_engine = None
    if cfg.algo.advantage == "gae":
        from trainer_service.critic import build_critic

        value_engine = build_critic(paths.model_dir, t, cfg.algo, world)
    ref, load_ref = reference_model(cfg, paths.model_dir, device)
    tok = load_tokenizer(paths.model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ctx = StepContext(
        engine=engine,
        algo=cfg.algo,
        micro_batch_tokens=t.micro_batch_tokens,
        fixed_len=cfg.algo.fixed_len or cfg.rollout.max_new_tokens,
        pad_id=int(pad),
        rank=rank,
        world=world,
        ref_model=ref,
        load_ref=load_ref,
        device=device,
        max_new_tokens=cfg.rollout.max_new_tokens,
        speeds=list(t.rank_speeds) if t.rank_speeds is not None else None,
        balance_measured=t.balance_measured,
        slowdown=t.emulate_slowdown.get(rank, 1.0),
        lockstep=t.zero_stage >= 2,
        critic=value_engine,
    )
    if ctx.speeds is not None and len(ctx.speeds) != world:
        raise UsageError(
            f"trainer.rank_speeds has {len(ctx.speeds)} values for {world} ranks: "
            "expected one speed per rank"
        )
    consumer = make_consumer(cfg) if rank == 0 else None
    network = make_network_sink(cfg) if rank == 0 else None
    shares_devices = cfg.workflow.placement_in_effect() != "disaggregated"
    if not shares_devices:
        keep_heap()  # the step's activations stay mapped from one step to the next
    return Trainer(
        t,
        cfg.algo,
        paths,
        ctx,
        cfg.buffer.groups_per_step,
        consumer,
        cfg.run.seed,
        network,
        trim_heap=shares_devices,
    )


def make_network_sink(cfg: ExperimentConfig) -> NetworkSink | None:
    """Rank 0's side of rollout.weight_sync=network: rank 0 of the weight-update group,
    its manifests left in the buffer's Redis for the controller."""
    if cfg.rollout.weight_sync != "network":
        return None
    from urllib.parse import urlparse

    from areal_hex.buffer import open_redis
    from areal_hex.buffer.errors import BUFFER_ERRORS
    from areal_hex.config.checks import weight_sync_backend, weight_sync_ranks_per_server
    from areal_hex.weight_net import (
        MANIFEST_TTL_S,
        address_toward,
        agree_members,
        free_port,
        manifest_key,
        members_key,
        regroup_key,
    )

    if cfg.redis.url is None or cfg.run.run_id is None:
        raise UsageError("rollout.weight_sync=network needs redis.url and run.run_id")
    ws, run_id = cfg.rollout, cfg.run.run_id
    first = urlparse(cfg.inference.urls()[0]).hostname or "127.0.0.1"
    address = ws.weight_sync_address or address_toward(first)
    client = open_redis(cfg.redis).sync_client()

    def put_manifest(m: Manifest) -> None:
        client.set(manifest_key(run_id, m.version), m.to_json(), ex=MANIFEST_TTL_S)

    def members(group_name: str, timeout_s: float) -> list[str]:
        key = members_key(run_id, group_name)
        return agree_members(
            lambda: client.get(key),
            lambda v: client.set(key, v, nx=True, ex=MANIFEST_TTL_S),
            timeout_s,
        )

    def regroup_asked() -> str | None:
        try:
            raw = client.get(regroup_key(run_id))
        except BUFFER_ERRORS:  # asked again once the buffer answers
            return None
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    rpp = weight_sync_ranks_per_server(cfg)
    return NetworkSink(
        master_address=address,
        master_port=ws.weight_sync_port or free_port(address),
        server_ranks=len(cfg.inference.urls()) * rpp,
        backend=weight_sync_backend(cfg),
        bucket_bytes=int(ws.weight_sync_bucket_mb * 2**20),
        timeout_s=ws.weight_sync_timeout_s,
        put_manifest=put_manifest,
        ifname=ws.weight_sync_ifname,
        members=members,
        regroup_asked=regroup_asked,
        ranks_per_server=rpp,
        join_timeout_s=ws.weight_sync_join_timeout_s,
    )


def serve_metrics(cfg: ExperimentConfig, trainer: Trainer) -> MetricsServer | None:
    """Rank 0's /metrics (`trainer.metrics_port`): its step rows and the buffer's state,
    behind the service token when one is set."""
    if cfg.trainer.metrics_port is None:
        return None
    rows = TrainerCollector(device_kind(cfg.trainer.device), cfg.rollout.group_size)
    trainer.row_observers.append(rows.observe)
    collectors: list[Any] = [rows, *prediction_collectors(RunPaths.of(cfg).root, cfg.run.mode)]
    if trainer.consumer is not None:
        collectors.append(BufferCollector(trainer.consumer.stats))
    server = MetricsServer(
        registry_with(*collectors), cfg.trainer.metrics_port, token=cfg.inference.api_key
    )
    log.info("metrics on port %d", server.port)
    return server


# Exit code of a trainer stopped by a signal before its last step (after checkpointing):
# not 0, which would mean the run is done (EX_TEMPFAIL: try again, i.e. resume).
STOPPED_EARLY = 75


def status(rank: int, what: str) -> None:
    """A `[status]` line: the launcher's progress display shows the last one until the
    first step is done."""
    if rank == 0:
        log.info("%s%s", STATUS_MARK, what)


def stop_on_signals(trainer: Trainer) -> None:
    """SIGTERM / SIGINT: finish the step under way, checkpoint it, exit."""

    def handler(signum: int, frame: object) -> None:
        trainer.request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer_service.main")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defer_collection()  # until freeze_startup, once the trainer is built
    tie_to_launcher()  # a rank of `areal-hex run`'s trainer ends with the launcher
    cfg = load_config(args.config, args.overrides)
    # stdout, line by line: the launcher's progress display reads the [status] lines, its
    # report their times (the start-up timeline)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
    rank = int(os.environ.get("RANK", "0"))
    status(rank, "starting DeepSpeed (a first run builds its communication op)")
    rank, world = init_distributed(cfg.trainer.device)
    status(rank, "loading the model")
    trainer = build_trainer(cfg, rank, world)
    freeze_startup()  # the model, DeepSpeed, the imports: out of every later collection
    stop_on_signals(trainer)
    status(rank, "waiting for the first batch")
    metrics = serve_metrics(cfg, trainer) if rank == 0 else None
    trackers = open_run_trackers(cfg, "trainer") if rank == 0 else None
    if trackers is not None:
        trainer.row_observers.append(trackers.observe)
    try:
        state = trainer.run()
    except TimeoutError as exc:  # no batch in trainer.batch_timeout_s: say what is missing
        print(f"trainer: error: {exc}", flush=True)
        return 1
    finally:
        if metrics is not None:
            metrics.stop()
        if trackers is not None:
            trackers.close()
        if trainer.consumer is not None:
            trainer.consumer.close()
    early = trainer.stopped_early
    if rank == 0:
        what = "stopped (checkpointed)" if early else "done"
        log.info("%s at step %d, version %d", what, state.step, state.version)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return STOPPED_EARLY if early else 0


if __name__ == "__main__":
    sys.exit(main())
