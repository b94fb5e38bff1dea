"""Before any process starts: name the run, pick ports, write the initial weights `v0`
and the resolved `config.yaml` every service reads (see docs/running.md)."""

from __future__ import annotations

import time
from pathlib import Path

from areal_hex.config import ExperimentConfig, save_config
from areal_hex.net import free_port, free_port_block
from areal_hex.plan import Plan
from areal_hex.run_files import RunPaths
from areal_hex.warm_start import sft_texts


def apply_mode(cfg: ExperimentConfig, mode: str | None) -> ExperimentConfig:
    """`--mode sync`: eta = 0, so the gate admits the next batch only after the trainer
    published the version it trains now (rollout waits while the trainer trains)."""
    mode = mode or cfg.run.mode
    cfg = cfg.model_copy(deep=True)
    cfg.run.mode = mode  # type: ignore[assignment]
    if mode == "sync":
        cfg.buffer.max_staleness = 0
        cfg.trainer.publish_every = 1
    return cfg


def apply_plan(cfg: ExperimentConfig, plan: Plan | None) -> ExperimentConfig:
    """Size the local job as planned: one server per planned instance, the trainer's
    ranks and ZeRO stage (a planned local run is a single-node one)."""
    if plan is None:
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.inference.num_servers = len(plan.rollout)
    cfg.trainer.num_ranks = max(len(p.gpu_ids) for p in plan.trainer.placements)
    cfg.trainer.zero_stage = plan.trainer.zero_stage
    return cfg


def default_run_id(cfg: ExperimentConfig) -> str:
    return f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{cfg.run.mode}"


def materialize_v0(cfg: ExperimentConfig, weights_dir: Path) -> Path:
    """Write `weights_dir/v0` (kept if present: a resumed run keeps its initial model)."""
    from areal_hex.models import build_tokenizer, materialize

    texts = None
    tiny = cfg.model.tiny
    if cfg.model.path is None and tiny is not None and tiny.sft_steps > 0:
        texts = sft_texts(cfg, build_tokenizer())
    return materialize(cfg.model, weights_dir / "v0", sft_texts=texts)


def prepare_run(
    cfg: ExperimentConfig, plan: Plan | None = None, mode: str | None = None
) -> tuple[ExperimentConfig, Path]:
    """Resolve `cfg` for a local run and write the run directory. Returns the resolved
    config and the path of its `config.yaml`."""
    cfg = apply_plan(apply_mode(cfg, mode), plan)
    if cfg.run.run_id is None:
        cfg.run.run_id = default_run_id(cfg)
    run_dir = cfg.run.run_dir().resolve()
    cfg.run.output_dir = str(run_dir.parent)
    RunPaths.at(run_dir).logs.mkdir(parents=True, exist_ok=True)
    if cfg.redis.url is None:  # embedded Valkey: the `redis` service of the layout
        cfg.run.embedded_redis = True
        port = cfg.redis.port or free_port(cfg.redis.bind)
        cfg.redis.port = port
        cfg.redis.url = f"redis://127.0.0.1:{port}/0"
        cfg.redis.data_dir = cfg.redis.data_dir or str(run_dir / "valkey")
    inf = cfg.inference
    if not inf.server_urls:
        inf.base_port = free_port_block(inf.num_servers, inf.base_port)
    weights = RunPaths.at(run_dir, inf.weights_dir).weights_dir.resolve()
    weights.mkdir(parents=True, exist_ok=True)
    inf.weights_dir = str(weights)
    v0 = materialize_v0(cfg, weights)
    cfg.model.path = str(v0)
    cfg.model.tokenizer_path = None
    path = save_config(cfg, RunPaths.at(run_dir).config)
    return cfg, path
