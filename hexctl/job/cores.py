"""Which cores the local run's processes get: the split `run.pin_cores` makes, shared by
the launcher and `areal-hex profile --local` (which measures with the same pinning)."""

from __future__ import annotations

import os


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
