"""What a box must be before any long work starts (`box up`, `profile --box`, `bench
hetero`): its quotas fit this machine, and a budget buys the plans `bench hetero` makes on
it. The box's own shape (kinds, racks, node numbers, addresses) is `spec.make_box`'s.

Each refusal names what is wrong, where (the YAML key or the flag) and what was
expected, and comes before the box is built or any kind is profiled."""

from __future__ import annotations

import math
import os
from collections import Counter

from areal_hex.config import ConfigError
from hexctl.box.spec import Box

# The launcher's namespace, the box's head node, runs outside every quota: Valkey, the
# rollout controller and the launcher itself keep at least this much of the machine.
HEAD_CORES = 0.2


def machine_cores() -> int:
    return os.cpu_count() or 1


def node_room(cores: int) -> float:
    """The cores a box's nodes may hold between them on a machine of `cores` cores."""
    return round(cores - HEAD_CORES, 6)


def check_fits(box: Box, cores: int | None = None) -> None:
    """The box's CPU quotas fit a machine of `cores` cores (default: this one): no kind's
    quota over what the nodes may hold, and the quotas of all nodes together within it
    (oversubscribed quotas would make each kind as slow as its neighbours, not as its
    quota says)."""
    cores = cores or machine_cores()
    room = node_room(cores)
    errors = []
    for kind, k in box.spec.kinds.items():
        if k.cpu > room:
            errors.append(f"kinds.{kind}.cpu: {k.cpu:g} cores; expected at most {room:g}")
    counts = Counter(n.kind for n in box.nodes)
    total = sum(box.spec.kinds[kind].cpu * c for kind, c in counts.items())
    if total > room + 1e-9:
        each = ", ".join(f"{c} {kind} x {box.spec.kinds[kind].cpu:g}" for kind, c in counts.items())
        errors.append(
            f"racks: the nodes' CPU quotas add up to {total:g} cores ({each}); expected at "
            f"most {room:g}: lower kinds.*.cpu or the node counts"
        )
    if errors:
        raise ConfigError(
            f"box {box.name!r} does not fit this machine ({cores} cores, {HEAD_CORES:g} of "
            "them kept for the head node: Valkey, the controller, the launcher):\n  "
            + "\n  ".join(errors)
        )


def min_budget(box: Box) -> tuple[float, float | None]:
    """The least $/h of a plan on the box (its two cheapest nodes: one trains, one
    generates) and of a one-kind plan (two nodes of the kind cheapest so; None where no
    kind has two nodes)."""
    prices = sorted(box.spec.kinds[n.kind].usd_per_hour for n in box.nodes)
    counts = Counter(n.kind for n in box.nodes)
    pairs = [2 * box.spec.kinds[k].usd_per_hour for k, c in counts.items() if c >= 2]
    return round(sum(prices[:2]), 6), (round(min(pairs), 6) if pairs else None)


def check_budget(box: Box, budget: float) -> None:
    """`--budget` buys `bench hetero`'s plans on the box: a mixed plan (a, and c, its
    first-fit placement) and the one-kind baseline b, each a trainer node and at least
    one node that generates."""
    if not (math.isfinite(budget) and budget > 0):
        raise ConfigError(f"--budget {budget:g}: expected a positive number of $/h")
    if len(box.nodes) < 2:
        raise ConfigError(
            f"box {box.name!r} has {len(box.nodes)} node; a plan needs two (one trains, one "
            "generates): expected a rack member with count 2, or a second one"
        )
    least, one_kind = min_budget(box)
    if one_kind is None:
        raise ConfigError(
            f"box {box.name!r}: the one-kind baseline (plan b) needs two nodes of one kind; "
            "every kind has one: expected some kind's count 2 or more"
        )
    need = max(least, one_kind)
    if budget < need - 1e-9:
        raise ConfigError(
            f"--budget {budget:g}: the cheapest plan on box {box.name!r} costs {least:g} $/h "
            f"and the cheapest one-kind plan {one_kind:g} $/h; expected --budget {need:g} "
            "or more"
        )
