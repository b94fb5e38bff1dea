"""Local search from phase 1's pick, on the rate the plan reports.

The MILP charges weight-sync pauses at an upper bound of the rate and cannot see the
placement, so its optimum is optimal for a conservative rate, not for the exact placed
one the plan prints: a trainer a size larger, or one more rollout instance, can raise the
placed rate where the MILP saw none (on `examples/clusters/racks_h800_h20.yaml` with
`math_grpo`, +6 %). From the pick, single moves are tried:

- another trainer configuration (same instances), or another with one instance fewer;
- one more instance of any configuration;
- one instance swapped for one of another configuration.

Each candidate that fits (inventory blocks, in-flight cap, budget) is screened by phase
1's exact rate (`milp.evaluate`, an upper bound of the placed rate), the best `SCREEN`
are placed, and the best placed improvement is taken; rounds repeat until none is left.
With a target rate (min-cost mode) a move must keep the target and cost less.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from scheduler.milp import PlanSpace, evaluate, lost_blocks

SCREEN = 4  # candidates placed per round (max rate: the highest bounds)
SCREEN_COST = 16  # min cost: the cheapest candidates, placed until one keeps the target
ROUNDS = 16
GAIN = 1e-4  # the least relative rate gain (or cost saving) a move must bring

Mix = tuple[int, dict[int, int]]  # (trainer index, rollout index -> count)


@dataclass
class Polished:
    trainer: int
    replicas: dict[int, int]
    rate: float  # placed rate
    moves: int


def cost_of(p: PlanSpace, c: int, reps: dict[int, int]) -> float:
    return p.trainers[c].usd_per_h + sum(p.rollouts[i].usd_per_h * n for i, n in reps.items())


def fits(p: PlanSpace, c: int, reps: dict[int, int]) -> bool:
    """The MILP's inventory and in-flight constraints for a fixed mix."""
    if not reps or sum(p.rollouts[i].batch * n for i, n in reps.items()) > p.inflight:
        return False
    tr = p.trainers[c]
    for g, total in p.gpus.items():
        for t in p.tps.get(g) or [1]:
            used = sum(
                p.rollouts[i].tp * n
                for i, n in reps.items()
                if p.rollouts[i].group == g and p.rollouts[i].tp >= t
            )
            if used + lost_blocks(tr, g, p.gpn[g], t) > total:
                return False
    return True


def _neighbours(
    p: PlanSpace, c: int, reps: dict[int, int], ris: list[int], cis: list[int]
) -> Iterator[Mix]:
    def less(i: int) -> dict[int, int]:
        r = dict(reps)
        r[i] -= 1
        if not r[i]:
            del r[i]
        return r

    for c2 in cis:
        if c2 != c:
            yield c2, reps
            for i in reps:
                yield c2, less(i)
    for j in ris:
        yield c, {**reps, j: reps.get(j, 0) + 1}
    for i in reps:
        base = less(i)
        for j in ris:
            if j != i:
                yield c, {**base, j: base.get(j, 0) + 1}


def polish(
    p: PlanSpace,
    start: Mix,
    placed_rate: Callable[[int, dict[int, int]], float],
    *,
    budget: float | None = None,
    target: float | None = None,
    allowed_kinds: set[str] | None = None,
    tolerance: float = 1e-4,
) -> Polished:
    """Best mix reachable from `start` by single moves. `placed_rate(c, reps)` places
    a mix and returns its exact rate (the expensive step; memoised here)."""
    ris = [i for i, r in enumerate(p.rollouts) if allowed_kinds is None or r.kind in allowed_kinds]
    cis = [
        i
        for i, t in enumerate(p.trainers)
        if allowed_kinds is None or set(t.kinds) <= allowed_kinds
    ]
    memo: dict[tuple, float] = {}

    def rate(c: int, reps: dict[int, int]) -> float:
        key = (c, tuple(sorted(reps.items())))
        if key not in memo:
            memo[key] = placed_rate(c, reps)
        return memo[key]

    c, reps = start
    cur, cost, moves = rate(c, reps), cost_of(p, c, reps), 0
    for _ in range(ROUNDS):
        screened: list[tuple[float, int, dict[int, int]]] = []
        for c2, r2 in _neighbours(p, c, reps, ris, cis):
            k2 = cost_of(p, c2, r2)
            if budget is not None and k2 > budget + 1e-9:
                continue
            if target is not None and k2 >= cost * (1 - GAIN):
                continue
            if not fits(p, c2, r2):
                continue
            up = evaluate(p, c2, r2)[0]  # placed rate ≤ this
            if target is None and up <= cur * (1 + GAIN):
                continue
            if target is not None and up < target * (1 - tolerance):
                continue
            # max rate: the highest bound first; min cost: the cheapest first
            screened.append((up if target is None else -k2, c2, r2))
        screened.sort(key=lambda s: s[0], reverse=True)
        best: tuple[float, int, dict[int, int]] | None = None
        for _, c2, r2 in screened[: SCREEN if target is None else SCREEN_COST]:
            got = rate(c2, r2)
            if target is None:
                if got > cur * (1 + GAIN) and (best is None or got > best[0]):
                    best = (got, c2, r2)
            elif got >= target * (1 - tolerance):
                best = (got, c2, r2)
                break  # the cheapest that keeps the target
        if best is None:
            break
        cur, c, reps = best
        cost, moves = cost_of(p, c, reps), moves + 1
    return Polished(c, reps, cur, moves)
