"""Which cores the local run's processes get: the split `run.pin_cores` makes, shared by
the launcher and `areal-hex profile --local` (which measures with the same pinning)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig
    from hexctl.job.layout import Layout


def usable_cores() -> set[int] | None:
    """The cores this process may run on; None where the platform does not say."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return set(os.sched_getaffinity(0))


def core_groups(
    pin: bool, placement: str = "disaggregated"
) -> tuple[set[int] | None, set[int] | None]:
    """(inference cores, trainer cores). Disaggregated: the first half of the usable
    cores run the inference servers, the rest the trainer, with Valkey and the controller
    beside it (light CPU work that would otherwise take cycles from generation).
    Colocated: both sides get every usable core (generation and training take turns, each
    phase with all of them). None: no pinning."""
    cores = sorted(usable_cores() or ()) if pin else []
    if len(cores) < 2:
        return None, None
    if placement == "colocated":
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def lent_services(cfg: ExperimentConfig, layout: Layout) -> set[str]:
    """Hybrid placement: the names of the inference services the trainer's devices lend
    (the last `workflow.lent_servers`); empty in any other placement."""
    if cfg.workflow.placement != "hybrid":
        return set()
    servers = layout.by_role("inference")
    return {s.name for s in servers[len(servers) - cfg.workflow.lent_servers :]}
