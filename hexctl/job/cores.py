"""Which cores the local run's processes get: the split `run.pin_cores` makes, shared by
the launcher and `areal-hex profile --local` (which measures with the same pinning)."""

from __future__ import annotations

import os


def core_groups(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(inference cores, trainer cores): the first half of the usable cores run the
    inference servers, the rest the trainer, with Valkey and the controller beside it
    (light CPU work that would otherwise take cycles from generation). None: no
    pinning."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])
