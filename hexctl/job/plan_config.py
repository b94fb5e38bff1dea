"""The one projection from a plan to the config a run starts with.

`areal-hex run --plan`, every deploy target and `areal-hex plan --print-config` call
`project_plan`, so a decision the planner made reaches the run the same way everywhere:

| plan                                         | config key                                   |
|----------------------------------------------|----------------------------------------------|
| rollout instances                            | `inference.num_servers`                      |
| each instance's GPU kind                     | `inference.gpu_kinds` (metrics' `gpu_kind`)  |
| trainer ZeRO stage                           | `trainer.zero_stage`                         |
| trainer ranks per node                       | `trainer.num_ranks`                          |
| ranks' speeds across GPU kinds               | `trainer.rank_speeds`                        |
| tuned staleness bound η, `decisions.max_staleness` | `buffer.max_staleness`                 |
| tuned publish interval k, `decisions.publish_every` | `trainer.publish_every`               |
| weight-sync mode, `decisions.weight_sync`    | `rollout.weight_sync`                        |
| placement, `decisions.placement`             | `workflow.placement` (colocated: `run.mode` sync) |
| lent instances, `decisions.lent` (hybrid)    | `workflow.lent_servers` (the last servers)   |
| each instance's decode batch                 | `rollout.max_concurrent_groups` (raised only) |

Policy: the plan wins. Where the config asked for another value, the plan's is applied
and `PlannedConfig.changes` says which key moved from what to what (the CLI prints each
line), so a config written for one plan runs any other plan unchanged. The predicted
rates travel beside the config as `prediction.json` (`hexctl.job.predict`), computed
from the projected config, hence at the plan's η and k.

One key is only ever raised. The controller's groups in flight are shared by every
instance (each request goes to the least loaded server), so a cap that fills one
server's batch leaves each of three servers a third of it, and the cost model prices
each instance at its planned batch. The plan raises `rollout.max_concurrent_groups` to
the groups that fill every instance's batch (`groups_to_fill`); a larger cap, which
keeps a small batch's queue full, is kept (docs/fidelity.md, "The controller's groups
in flight and the planned batches").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from areal_hex.config import ExperimentConfig
from areal_hex.config.base import build
from areal_hex.plan import Plan

# "local": `areal-hex run` starts every service on this one machine, so the trainer gets
# the ranks of its largest node; "cluster": one launcher per planned node.
Nodes = Literal["local", "cluster"]


@dataclass
class PlannedConfig:
    config: ExperimentConfig
    changes: list[str] = field(default_factory=list)  # "key: old -> new (the plan's ...)"


def subsample_rank_speeds(planned: list[float], ranks: int) -> list[float]:
    """Speeds for the `ranks` ranks a run starts out of the plan's: the middle rank of
    each of `ranks` equal slices of the planned ranks, so that fewer ranks keep the plan's
    mix of GPU kinds; all of them, in order, when the counts agree."""
    n = len(planned)
    return [planned[(2 * r + 1) * n // (2 * ranks)] for r in range(ranks)]


def planned_values(plan: Plan, nodes: Nodes) -> dict[str, Any]:
    """Every config key the plan decides, by dotted path, for a run on `nodes`."""
    t = plan.trainer
    if nodes == "local":
        ranks_per_node = max(len(p.gpu_ids) for p in t.placements)
        ranks_started = ranks_per_node
    else:
        ranks_per_node = t.world_size // max(1, len(t.placements))
        ranks_started = ranks_per_node * max(1, len(t.placements))
    values: dict[str, Any] = {
        "inference.num_servers": len(plan.rollout),
        "inference.gpu_kinds": [i.gpu_kind for i in plan.rollout],
        "trainer.zero_stage": t.zero_stage,
        "trainer.num_ranks": ranks_per_node,
    }
    if t.rank_speeds is not None:
        values["trainer.rank_speeds"] = subsample_rank_speeds(list(t.rank_speeds), ranks_started)
    d = plan.decisions
    values["workflow.placement"] = d.placement
    if d.placement == "colocated":  # phases alternate: synchronous (η = 0, k = 1)
        values["run.mode"] = "sync"
    if d.placement == "hybrid":  # the last instances, on the trainer's GPUs
        values["workflow.lent_servers"] = len(d.lent)
    if d.max_staleness is not None:
        values["buffer.max_staleness"] = d.max_staleness
    if d.publish_every is not None:
        values["trainer.publish_every"] = d.publish_every
    if d.weight_sync is not None:
        values["rollout.weight_sync"] = d.weight_sync
    return values


SYNC_KEEPS = ("buffer.max_staleness", "trainer.publish_every")


def project_plan(cfg: ExperimentConfig, plan: Plan, nodes: Nodes) -> PlannedConfig:
    """`cfg` with every decision of `plan` applied (validated again as a whole), and the
    keys whose value the plan changed."""
    data = cfg.model_dump(mode="json")
    changes = []
    for key, value in planned_values(plan, nodes).items():
        section, name = key.split(".")
        old = data[section].get(name)
        if key in SYNC_KEEPS and cfg.run.mode == "sync":
            # a synchronous run is η = 0, k = 1 whatever the plan tuned for its async run
            if old != value:
                changes.append(f"{key}: {_short(old)} kept (run.mode=sync; planned {value})")
            continue
        if old != value:
            changes.append(f"{key}: {_short(old)} -> {_short(value)} (as planned)")
        data[section][name] = value
    fill = groups_to_fill(plan, cfg.rollout.group_size)
    old = data["rollout"]["max_concurrent_groups"]
    if fill is not None and fill > old:
        n = len(plan.rollout)
        changes.append(
            f"rollout.max_concurrent_groups: {old} -> {fill} "
            f"(as planned: fills the batches of its {n} instance{'s' * (n != 1)})"
        )
        data["rollout"]["max_concurrent_groups"] = fill
    return PlannedConfig(build(ExperimentConfig, data, "the config with the plan applied"), changes)


def groups_to_fill(plan: Plan, group_size: int) -> int | None:
    """Groups of `group_size` that keep every planned instance's decode batch full at
    once; None where the plan did not record the batches."""
    batches = [i.batch for i in plan.rollout if i.batch is not None]
    if not batches or len(batches) < len(plan.rollout):
        return None
    return -(-sum(batches) // group_size)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
