"""Checks of a whole config that no single section can make, run before any process
starts (by `areal-hex run`, `train` and `deploy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_hex.config.base import ConfigError

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig


def check_pending_groups(cfg: ExperimentConfig) -> None:
    """Groups stay pending in the buffer until the checkpoint that holds their update
    commits, and the producers' backpressure counts them: with room for fewer than
    (trainer.checkpoint_every + 1) x buffer.groups_per_step the pipeline would stall.
    Raises ConfigError naming both settings. A trainer fed from a replay file holds
    nothing in the buffer and always passes."""
    if cfg.trainer.replay_path is not None:
        return
    every, b = cfg.trainer.checkpoint_every, cfg.buffer.groups_per_step
    held = (every + 1) * b
    if held > cfg.buffer.max_pending:
        raise ConfigError(
            f"trainer.checkpoint_every ({every}) x buffer.groups_per_step ({b}) keeps up "
            f"to {held} groups pending, more than buffer.max_pending "
            f"({cfg.buffer.max_pending}): lower checkpoint_every or raise max_pending"
        )
