"""The best plan of each placement from one planning pass: the disaggregated plan, and
the colocated and hybrid plans made from it (`scheduler/colocated.py`,
`scheduler/hybrid.py`). `make_plan` picks among them; `bench modes --box` runs each."""

from __future__ import annotations

from areal_hex.plan import Plan
from scheduler.cluster import Cluster
from scheduler.colocated import Colocated, colocated_plan
from scheduler.hybrid import Hybrid, hybrid_plan
from scheduler.workload import Workload


def placement_plans(
    cl: Cluster,
    w: Workload,
    plan: Plan,
    colocated: Colocated | None,
    hybrid: Hybrid | None,
    names: dict[str, str],
    target: float | None,
) -> dict[str, Plan]:
    """By `decisions.placement`: the disaggregated `plan` and, at a budget (`target`
    None), its colocated and hybrid counterparts where they generate, each a plan of its
    own (nothing shared with `plan`). `names`: merged machine names as the inventory's
    (`cluster.merge_identical`)."""
    out = {"disaggregated": plan}
    if target is not None:
        return out
    if colocated is not None:
        out["colocated"] = colocated_plan(cl, w, colocated, names, plan).model_copy(deep=True)
    # a hybrid keeps at least one server of its own: none where the split generates nothing
    own = hybrid is not None and bool(plan.rollout)
    lent = hybrid_plan(cl, hybrid, names, plan) if own and hybrid is not None else None
    if lent is not None:
        out["hybrid"] = lent
    return out
