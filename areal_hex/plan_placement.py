"""A plan's placement read as one: which of its slots may share a GPU, and the decisions
that must agree with it (`decisions.placement`, `decisions.lent`, η and k).

- disaggregated: no GPU serves two slots; nothing lent.
- colocated: generation and training take turns on the same GPUs, synchronously: every
  generation instance on the trainer's GPUs, η = 0 and k = 1 (where the plan says).
- hybrid: the disaggregated split plus the lent instances (`decisions.lent`, the last
  ones in `rollout`) on the trainer's GPUs, which generate while the trainer waits; at
  least one instance of its own, k = 1 (the lent servers follow the trainer's steps by
  the version each step publishes).

A hand-written plan that breaks one of these is refused on load, the field named.
"""

from __future__ import annotations

from typing import Any, TypeVar

# areal_hex.plan.Plan, which calls these from its validator (named, not imported back)
Plan = Any

Slot = TypeVar("Slot")


def check_placement(plan: Plan) -> None:
    """Raise ValueError naming the field where the plan's decisions disagree with its
    placement."""
    d, n = plan.decisions, len(plan.rollout)
    where = f"decisions.placement {d.placement}"
    if d.placement != "hybrid" and d.lent:
        raise ValueError(
            f"decisions.lent {d.lent} with {where}: only a hybrid placement lends "
            "generation instances; expected decisions.lent [] (or decisions.placement hybrid)"
        )
    if d.placement in ("colocated", "hybrid") and d.publish_every not in (None, 1):
        raise ValueError(
            f"decisions.publish_every {d.publish_every} with {where}: expected 1 (the "
            "placement switches each step, on the version each step publishes)"
        )
    if d.placement == "colocated":
        if d.max_staleness not in (None, 0):
            raise ValueError(
                f"decisions.max_staleness {d.max_staleness} with {where}: expected 0 "
                "(generation and training take turns on the same GPUs: synchronous)"
            )
        _on_trainer_gpus(plan, range(n), "rollout", where)
    if d.placement == "hybrid":
        last = list(range(n - len(d.lent), n))
        if not d.lent or sorted(d.lent) != last or len(d.lent) >= n:
            raise ValueError(
                f"decisions.lent {d.lent} with {where} and {n} rollout instances: expected "
                "the indices of the last instances, at least one and fewer than all (the "
                "lent ones sit last on the trainer's GPUs; all lent is colocated)"
            )
        _on_trainer_gpus(plan, d.lent, "decisions.lent", where)


def _on_trainer_gpus(plan: Plan, indices: range | list[int], field: str, where: str) -> None:
    gpus = {(p.node, g) for p in plan.trainer.placements for g in p.gpu_ids}
    for i in indices:
        inst = plan.rollout[i]
        off = [g for g in inst.placement.gpu_ids if (inst.placement.node, g) not in gpus]
        if off:
            raise ValueError(
                f"{field}: rollout[{i}] ({inst.id}) on GPU {off[0]} of node "
                f"{inst.placement.node!r} with {where}: expected it on the trainer's GPUs "
                "(it generates between the trainer's steps)"
            )


def sharing_sides(plan: Plan, slots: list[Slot]) -> list[list[Slot]]:
    """`slots` (the plan's `device_slots()`: rollout first, then the trainer's and the
    other tasks') in groups within which no GPU may serve two slots: one group
    disaggregated; generation and the rest colocated; hybrid, the instances of their own
    with the rest, and the lent ones."""
    n, d = len(plan.rollout), plan.decisions
    if d.placement == "colocated":
        return [slots[:n], slots[n:]]
    if d.placement == "hybrid":
        lent = set(d.lent)
        own = [s for i, s in enumerate(slots[:n]) if i not in lent]
        return [own + slots[n:], [slots[i] for i in sorted(lent)]]
    return [slots]
