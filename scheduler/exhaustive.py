"""Exhaustive search under the same cost model as the MILP (for tests and the bench's
optimality gap). Packing is checked by placing instances on concrete machines, not by the
MILP's block constraints, so it also checks that formulation."""

from __future__ import annotations

import itertools

from scheduler.milp import PlanSpace, gen_rate


def fits(p: PlanSpace, c_idx: int, reps: dict[int, int]) -> bool:
    """Place the trainer, then instances largest-TP first (first fit) on real machines."""
    c = p.trainers[c_idx]
    free: dict[str, list[int]] = {g: [p.gpn[g]] * (n // p.gpn[g]) for g, n in p.gpus.items()}
    for g, n in c.parts:
        if n % p.gpn[g] == 0:
            if n // p.gpn[g] > len(free[g]):
                return False
            free[g] = free[g][n // p.gpn[g] :]
        else:
            free[g][0] -= n
    items = sorted(
        ((p.rollouts[i].tp, p.rollouts[i].group) for i, k in reps.items() for _ in range(k)),
        reverse=True,
    )
    for tp, g in items:
        slot = next((j for j, f in enumerate(free[g]) if f >= tp), None)
        if slot is None:
            return False
        free[g][slot] -= tp
    return True


def _group_vectors(p: PlanSpace, idx: list[int], cap: int) -> list[dict[int, int]]:
    """Every replica vector over configs `idx` (one node group) using at most `cap` GPUs."""
    if not idx:
        return [{}]
    head, rest = idx[0], idx[1:]
    out = []
    for k in range(cap // p.rollouts[head].tp + 1):
        for tail in _group_vectors(p, rest, cap - k * p.rollouts[head].tp):
            out.append({head: k, **tail} if k else tail)
    return out


def exhaustive(p: PlanSpace, budget: float) -> tuple[float, float]:
    """(best rate, its cheapest cost) over every trainer and replica vector."""
    best = (0.0, float("inf"))
    per_group = [
        _group_vectors(p, [i for i, r in enumerate(p.rollouts) if r.group == g], n)
        for g, n in p.gpus.items()
    ]
    for c_idx, c in enumerate(p.trainers):
        if c.usd_per_h > budget:
            continue
        for parts in itertools.product(*per_group):
            reps = {i: k for part in parts for i, k in part.items()}
            cost = c.usd_per_h + sum(k * p.rollouts[i].usd_per_h for i, k in reps.items())
            slots = sum(k * p.rollouts[i].batch for i, k in reps.items())
            if cost > budget + 1e-9 or slots > p.inflight or not fits(p, c_idx, reps):
                continue
            rate = min(c.samples_per_s, gen_rate(p, c_idx, reps))
            if rate > best[0] * (1 + 1e-9) or (rate >= best[0] * (1 - 1e-9) and cost < best[1]):
                best = (rate, cost)
    return best


def exhaustive_min_cost(p: PlanSpace, target: float) -> float:
    """Cheapest cost over every trainer and replica vector whose rate reaches `target`."""
    best = float("inf")
    per_group = [
        _group_vectors(p, [i for i, r in enumerate(p.rollouts) if r.group == g], n)
        for g, n in p.gpus.items()
    ]
    for c_idx, c in enumerate(p.trainers):
        if c.samples_per_s < target * (1 - 1e-9) or c.usd_per_h >= best:
            continue
        for parts in itertools.product(*per_group):
            reps = {i: k for part in parts for i, k in part.items()}
            cost = c.usd_per_h + sum(k * p.rollouts[i].usd_per_h for i, k in reps.items())
            slots = sum(k * p.rollouts[i].batch for i, k in reps.items())
            if cost >= best or slots > p.inflight or not fits(p, c_idx, reps):
                continue
            if gen_rate(p, c_idx, reps) >= target * (1 - 1e-9):
                best = cost
    return best
