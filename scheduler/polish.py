"""Local search from phase 1's pick, on the rate the plan reports.

The MILP charges weight-sync pauses at an upper bound of the rate and cannot see the
placement, so its optimum is optimal for a conservative rate, not for the exact placed
one the plan prints: a trainer a size larger, or one more rollout instance, can raise the
placed rate where the MILP saw none (on `examples/clusters/racks_h800_h20.yaml` with
`math_grpo`, +6 %). From the pick, single moves are tried:

- another trainer configuration (same instances), or another with one instance fewer, or
  with one more instance of a configuration in use (a faster trainer that only pays with
  more generation to feed it: neither change alone gains, so a search of single changes
  stops short of it);
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

from scheduler.costmodel import generation_at
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
    use = _Usage(p, reps)
    return all(use.room(c, g, None, None) for g in p.gpus)


class _Usage:
    """GPUs a mix's rollout instances hold in each node group's blocks of t GPUs (the
    MILP's block constraints: Σ_{ψ∈g, TP_ψ ≥ t} TP_ψ y_ψ), so that a move of one
    instance and the trainer is checked on the groups it touches only: the check costs
    O(TP sizes), not O(groups × instances), which keeps the search linear in groups."""

    def __init__(self, p: PlanSpace, reps: dict[int, int]) -> None:
        self.p = p
        self.held: dict[tuple[str, int], int] = {}
        for i, n in reps.items():
            r = p.rollouts[i]
            for t in p.tps.get(r.group) or [1]:
                if r.tp >= t:
                    self.held[(r.group, t)] = self.held.get((r.group, t), 0) + r.tp * n
        self.lost: dict[tuple[int, str, int], int] = {}
        self.batch = sum(p.rollouts[i].batch * n for i, n in reps.items())

    def _lost(self, c: int, g: str, t: int) -> int:
        key = (c, g, t)
        if key not in self.lost:
            self.lost[key] = lost_blocks(self.p.trainers[c], g, self.p.gpn[g], t)
        return self.lost[key]

    def room(self, c: int, g: str, out: int | None, add: int | None) -> bool:
        """Group g holds trainer c and the mix less instance `out` plus `add`."""
        p = self.p
        for t in p.tps.get(g) or [1]:
            used = self.held.get((g, t), 0) + self._lost(c, g, t)
            for i, sign in ((out, -1), (add, 1)):
                if i is not None and p.rollouts[i].group == g and p.rollouts[i].tp >= t:
                    used += sign * p.rollouts[i].tp
            if used > p.gpus[g]:
                return False
        return True

    def fits(self, c: int, c_now: int, out: int | None, add: int | None) -> bool:
        """The current mix (which fits with trainer `c_now`) moved to trainer `c`, less
        `out`, plus `add`: only the groups that gain GPUs can overflow."""
        p = self.p
        batch = self.batch
        batch -= p.rollouts[out].batch if out is not None else 0
        batch += p.rollouts[add].batch if add is not None else 0
        if batch > p.inflight:
            return False
        touched = {p.rollouts[add].group} if add is not None else set()
        if c != c_now:
            touched |= {g for g, _ in p.trainers[c].parts}
        return all(self.room(c, g, out, add) for g in touched)


Move = tuple[int, int | None, int | None]  # (trainer, instance taken out, instance added)


def _moves(reps: dict[int, int], c: int, ris: list[int], cis: list[int]) -> Iterator[Move]:
    for c2 in cis:
        if c2 != c:
            yield c2, None, None
            for i in reps:
                yield c2, i, None
                # a faster trainer is often worth it only with one more instance to feed
                # it (alone, neither change gains: the pair is one move)
                yield c2, None, i
    for j in ris:
        yield c, None, j
    for i in reps:
        for j in ris:
            if j != i:
                yield c, i, j


def _apply(reps: dict[int, int], out: int | None, add: int | None) -> dict[int, int]:
    r = dict(reps)
    if out is not None:
        r[out] -= 1
        if not r[out]:
            del r[out]
    if add is not None:
        r[add] = r.get(add, 0) + 1
    return r


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
        found = _round(p, c, reps, cur, cost, ris, cis, budget, target, tolerance)
        best: tuple[float, int, dict[int, int]] | None = None
        for c2, r2 in found:
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


def _round(
    p: PlanSpace,
    c: int,
    reps: dict[int, int],
    cur: float,
    cost: float,
    ris: list[int],
    cis: list[int],
    budget: float | None,
    target: float | None,
    tolerance: float,
) -> list[tuple[int, dict[int, int]]]:
    """The moves worth placing this round, best first: with a budget the `SCREEN` whose
    exact unplaced rate is highest (above `cur`), with a target the `SCREEN_COST`
    cheapest that keep it. Cheap tests first (price, the touched groups' blocks, an upper
    bound min(training, Σ h) of the rate), the exact rate (a bisection) last and only as
    far as it can change the answer."""
    use = _Usage(p, reps)
    here = cost_of(p, c, {})
    gen = sum(p.rollouts[i].samples_per_s * n for i, n in reps.items())
    # the generation function G'(R) of a move falls as R grows, and a move reaching R' ≥ x
    # has G'(x) ≥ G'(R') ≥ R': so G' at the rate to beat (summed from each instance's
    # share at that rate, computed once per instance and trainer zone) bounds the move
    at = cur if target is None else target * (1 - tolerance)
    share: dict[tuple[int, str], float] = {}
    base: dict[str, float] = {}

    def one(i: int, c2: int) -> float:
        key = (i, p.trainers[c2].zones[0])
        if key not in share:
            r = p.rollouts[i]
            share[key] = generation_at(p.workload, [(r, p.sync_s[(r.zone, c2)], 1)], at)
        return share[key]

    def gen_at(c2: int, out: int | None, add: int | None) -> float:
        zone = p.trainers[c2].zones[0]
        if zone not in base:
            base[zone] = sum(n * one(i, c2) for i, n in reps.items())
        got = base[zone] + (one(add, c2) if add is not None else 0.0)
        return got - (one(out, c2) if out is not None else 0.0)

    cands: list[tuple[float, Move]] = []
    for c2, out, add in _moves(reps, c, ris, cis):
        k2 = cost - here + p.trainers[c2].usd_per_h
        k2 += (p.rollouts[add].usd_per_h if add is not None else 0.0) - (
            p.rollouts[out].usd_per_h if out is not None else 0.0
        )
        if budget is not None and k2 > budget + 1e-9:
            continue
        if target is not None and k2 >= cost * (1 - GAIN):
            continue
        h = gen + (p.rollouts[add].samples_per_s if add is not None else 0.0)
        h -= p.rollouts[out].samples_per_s if out is not None else 0.0
        bound = min(p.trainers[c2].samples_per_s, h)
        if target is None and bound <= cur * (1 + GAIN):
            continue
        if target is not None and bound < at:
            continue
        bound = min(bound, gen_at(c2, out, add) * (1 + 1e-9))
        if target is None and bound <= cur * (1 + GAIN):
            continue
        if target is not None and bound < at:
            continue
        if (out is not None and reps[out] == 1 and len(reps) == 1 and add is None) or not (
            use.fits(c2, c, out, add)
        ):
            continue
        cands.append((bound if target is None else -k2, (c2, out, add)))
    cands.sort(key=lambda t: t[0], reverse=True)
    want = SCREEN if target is None else SCREEN_COST
    kept: list[tuple[float, int, dict[int, int]]] = []
    for key, (c2, out, add) in cands:
        if target is None and len(kept) >= want and key <= kept[-1][0]:
            break  # no bound left above the SCREEN-th exact rate
        if target is not None and len(kept) >= want:
            break
        r2 = _apply(reps, out, add)
        up = evaluate(p, c2, r2)[0]  # placed rate ≤ this
        if target is None and up > cur * (1 + GAIN):
            kept.append((up, c2, r2))
            kept.sort(key=lambda t: t[0], reverse=True)
            del kept[want:]
        elif target is not None and up >= target * (1 - tolerance):
            kept.append((key, c2, r2))
    return [(c2, r2) for _, c2, r2 in kept]
