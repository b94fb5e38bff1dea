"""Checks of a whole config that no single section can make, run before any process
starts (by `areal-hex run`, `train` and `deploy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from areal_hex.config.base import ConfigError

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig


def check_run(cfg: ExperimentConfig) -> None:
    """Every whole-config check below."""
    check_pending_groups(cfg)
    check_publish_within_staleness(cfg)
    check_weight_sync(cfg)


def weight_sync_backend(cfg: ExperimentConfig) -> Literal["gloo", "nccl"]:
    """The weight-update group's backend: NCCL when the trainer and the servers both run
    on CUDA, gloo otherwise (host memory on at least one side)."""
    servers_on_gpu = cfg.inference.backend == "sglang" or cfg.inference.device.startswith("cuda")
    return "nccl" if cfg.trainer.device == "cuda" and servers_on_gpu else "gloo"


def weight_sync_ranks_per_server(cfg: ExperimentConfig) -> int:
    """Ranks one server takes in the weight-update group (SGLang: one per TP rank)."""
    return cfg.inference.sglang.tp_size if cfg.inference.backend == "sglang" else 1


def check_weight_sync(cfg: ExperimentConfig) -> None:
    """rollout.weight_sync=network needs a controller to drive the servers (so the buffer,
    not a replay file), and the network mode's address, port and interface only mean
    something with it."""
    if cfg.rollout.weight_sync == "network":
        if cfg.trainer.replay_path is not None:
            raise ConfigError(
                "rollout.weight_sync=network needs the buffer: with trainer.replay_path no "
                "controller asks the servers for the weights the trainer broadcasts; "
                "use rollout.weight_sync=disk"
            )
        return
    r = cfg.rollout
    set_ = [
        name
        for name, value in (
            ("weight_sync_address", r.weight_sync_address),
            ("weight_sync_port", r.weight_sync_port),
            ("weight_sync_ifname", r.weight_sync_ifname),
        )
        if value is not None
    ]
    if set_:
        raise ConfigError(
            f"rollout.{set_[0]} is set but rollout.weight_sync is 'disk': it only applies "
            "to rollout.weight_sync=network"
        )


def check_publish_within_staleness(cfg: ExperimentConfig) -> None:
    """`check_publish_every` on the run's settings. A trainer fed from a replay file has
    no gate and always passes."""
    if cfg.trainer.replay_path is not None:
        return
    check_publish_every(cfg.trainer.publish_every, cfg.buffer.max_staleness)


def check_publish_every(
    publish_every: int,
    max_staleness: int,
    *,
    keys: tuple[str, str] = ("trainer.publish_every", "buffer.max_staleness"),
    source: str | None = None,
) -> None:
    """The staleness gate admits (v + max_staleness + 1) x groups_per_step groups, v the
    last published version: the trainer can take max_staleness + 1 steps past a publish
    and no more until the next one. Publishing every more steps than that would wait
    forever for groups the gate holds back. Raises ConfigError naming both settings by
    `keys` (the config's, or the planner workload's) and `source`, the file, if given.
    The one check of this rule: the run's config and the planner's workload both call it."""
    k, eta = publish_every, max_staleness
    if k > eta + 1:
        where = f"{source}: " if source else ""
        raise ConfigError(
            f"{where}{keys[0]} ({k}) is more than {keys[1]} + 1 "
            f"({eta + 1}): the staleness gate lets the trainer run {eta + 1} steps past a "
            f"publish, so it would wait forever for its next batch; raise max_staleness to "
            f"at least {k - 1} or publish more often"
        )


def check_pending_groups(cfg: ExperimentConfig) -> None:
    """Groups stay pending in the buffer until the checkpoint after the one that holds
    their update commits (a corrupt newest checkpoint can then fall back to the one
    before), and the producers' backpressure counts them: with room for fewer than
    (2 x trainer.checkpoint_every + 1) x buffer.groups_per_step the pipeline would stall.
    Raises ConfigError naming both settings. A trainer fed from a replay file holds
    nothing in the buffer and always passes."""
    if cfg.trainer.replay_path is not None:
        return
    every, b = cfg.trainer.checkpoint_every, cfg.buffer.groups_per_step
    held = (2 * every + 1) * b
    if held > cfg.buffer.max_pending:
        raise ConfigError(
            f"trainer.checkpoint_every ({every}) x buffer.groups_per_step ({b}) keeps up "
            f"to (2 x {every} + 1) x {b} = {held} groups pending, more than buffer.max_pending "
            f"({cfg.buffer.max_pending}): lower checkpoint_every or raise max_pending"
        )
