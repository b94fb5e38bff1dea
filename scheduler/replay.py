"""The discrete-event replay of a placed plan (`scheduler/simulator.py`) with each
rollout instance's decode step from the cost model, as `make_plan` checks its estimate."""

from __future__ import annotations

from scheduler.cluster import Cluster
from scheduler.costmodel import RolloutOption, decode_step_s, kind_constants
from scheduler.milp import Solution
from scheduler.model_shape import ModelShape
from scheduler.partition import Placement, PlacementCost, evaluate
from scheduler.simulator import SimInstance, SimResult, simulate
from scheduler.workload import Workload


def simulate_solution(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    sol: Solution,
    placement: Placement,
    cost: PlacementCost | None = None,
    steps: int = 14,
    seed: int = 0,
) -> SimResult:
    gmap = {g.name: g for g in cl.spec.node_groups}
    ctx = w.prompt_tokens + w.response_tokens / 2
    if cost is None:
        cost = evaluate(cl, m, w, sol.trainer, placement)
    insts = []
    for (rc, node, _), sync in zip(placement.rollout, cost.sync_s, strict=True):
        g, kind = gmap[rc.group], cl.kinds[rc.group]

        def step_fn(n: int, rc: RolloutOption = rc, g=g, kind=kind) -> float:
            def at(b: int) -> float:
                return decode_step_s(
                    m,
                    kind.hbm_gbs,
                    kind.bf16_tflops,
                    rc.tp,
                    b,
                    ctx,
                    g.intra_node.bandwidth_gbs,
                    kind_constants(w.constants, kind),
                )

            return at(n) * rc.step_s / at(rc.batch)  # keeps a profile's calibration

        insts.append(SimInstance(node, rc.batch, rc.prefill_s, sync, step_fn))
    return simulate(
        insts,
        groups_per_step=w.groups_per_step,
        group_size=w.group_size,
        max_staleness=w.max_staleness,
        publish_every=w.publish_every,
        train_step_s=cost.train_step_s,
        mean_len=w.response_tokens,
        max_len=w.max_response_tokens,
        steps=steps,
        seed=seed,
    )
