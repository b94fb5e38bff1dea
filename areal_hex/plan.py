"""`plan.yaml`: the planner's output, consumed by `areal-hex deploy` and `areal-hex run`.

What the planner decided is in `decisions` (the placement of every task, η, k, the
weight-sync mode) and in the two built-in tasks' pools (`rollout`: the generation
instances and their TP; `trainer`: the training ranks and their parallelism); what it
compared the pick against is in `baselines`, which nothing downstream reads to run the
job. How a job trains lives in the experiment config. Validated on load like the config.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, model_validator

from areal_hex.config.base import Section, build, read_yaml, refuse_renamed
from areal_hex.config.rollout import WeightSyncMode
from areal_hex.config.workflow import PlacementMode
from areal_hex.plan_placement import check_placement, sharing_sides

# 2: a trainer across GPU kinds (`trainer.gpu_kinds`, `trainer.rank_speeds`); version 1
# files load unchanged (the new fields are optional).
# 3: the decisions in their own section (`decisions`: placement, η, k, weight sync, the
# tasks beyond generate and train); a version 1 or 2 file's `baselines.max_staleness` and
# `baselines.publish_every` are read as its decisions.
PLAN_SCHEMA_VERSION = 3

# Keys the planner wrote under other names before it took the config's (a plan's
# `baselines` and a workload YAML): refused with the new name.
RENAMED_KEYS = {"staleness": "max_staleness", "publish_interval": "publish_every"}
# A version 3 plan's decisions are no longer comparisons.
MOVED_TO_DECISIONS = {
    "max_staleness": "decisions.max_staleness",
    "publish_every": "decisions.publish_every",
}


class DeviceSlot(Section):
    node: str  # node name from the cluster spec, e.g. "h20-3"
    gpu_ids: list[int]  # local GPU indices on that node


class InferenceInstance(Section):
    id: str  # e.g. "rollout-h20-0"
    gpu_kind: str
    tp: int = Field(gt=0)
    zone: str
    region: str
    placement: DeviceSlot
    predicted_tokens_per_s: float = Field(ge=0)
    # requests the plan has it decode at once (the cost model's batch); None in plans
    # written before it was recorded
    batch: int | None = Field(None, gt=0)


class TrainerPlacement(Section):
    gpu_kind: str
    world_size: int = Field(gt=0)
    dp: int = Field(gt=0)
    tp: int = Field(1, gt=0)
    zero_stage: int = Field(ge=0, le=3)
    placements: list[DeviceSlot]  # one per node the trainer spans, in rank order
    predicted_tokens_per_s: float = Field(ge=0)
    # A trainer across GPU kinds (heterogeneous data parallelism): `gpu_kind` is then a
    # label ("H800+H20"), `gpu_kinds` the kind of each placement, and `rank_speeds` the
    # planned training tokens/s of each rank in rank order (`trainer.rank_speeds`: shares
    # of a step in proportion). None for a trainer of one kind.
    gpu_kinds: list[str] | None = None
    rank_speeds: list[float] | None = None

    @model_validator(mode="after")
    def _per_node_and_rank(self) -> TrainerPlacement:
        if self.gpu_kinds is not None and len(self.gpu_kinds) != len(self.placements):
            raise ValueError(
                f"gpu_kinds has {len(self.gpu_kinds)} entries for {len(self.placements)} "
                "placements: expected one GPU kind per placement"
            )
        speeds = self.rank_speeds
        if speeds is not None and (len(speeds) != self.world_size or min(speeds) <= 0):
            raise ValueError(
                f"rank_speeds has {len(speeds)} values for world_size {self.world_size}: "
                "expected one positive speed per rank"
            )
        return self

    @property
    def kinds(self) -> list[str]:
        """The GPU kinds the trainer runs on, in rank order of first use."""
        return list(dict.fromkeys(self.gpu_kinds)) if self.gpu_kinds else [self.gpu_kind]

    @property
    def mixed(self) -> bool:
        return len(self.kinds) > 1


class Prediction(Section):
    samples_per_s: float
    generation_samples_per_s: float
    training_samples_per_s: float
    weight_sync_s: float
    cost_usd_per_h: float


class Baselines(Section):
    """Optional: what the planner compared against and how sure it is (same budget)."""

    homogeneous_gpu_kind: str | None = None
    homogeneous_samples_per_s: float = 0.0
    # the best colocated synchronous plan (scheduler/colocated.py) and the best
    # disaggregated asynchronous one; `decisions.placement` names the faster
    synchronous_samples_per_s: float = 0.0
    disaggregated_samples_per_s: float | None = None
    # the disaggregated plan as a hybrid (its trainer's GPUs also generate while it waits:
    # scheduler/hybrid.py); the plan where it is the fastest (`decisions.lent`)
    hybrid_samples_per_s: float | None = None
    simulated_samples_per_s: float | None = None
    simulated_max_version_lag: int | None = None
    mip_gap: float = 0.0
    milp_samples_per_s: float | None = None  # the MILP's objective (pauses at t_c's period)
    # phase 1's exact rate before placement: above `predicted` only where racks or NICs
    # make the machines' links differ
    unplaced_samples_per_s: float | None = None
    placement: str = "first-fit"  # phase 2: "metis" (mapped on the topology) | "first-fit"
    first_fit_samples_per_s: float | None = None  # the same decision placed naively
    simulated_first_fit_samples_per_s: float | None = None
    # what holds the plan back and what it is worth (scheduler/assess.py)
    binding: str | None = None  # training | generation | weight sync | staleness gate
    limits: list[str] = []  # budget | inventory
    generation_utilisation: float | None = None
    training_utilisation: float | None = None
    homogeneous_ratio: float | None = None  # rate / best one-kind rate, same budget
    cost_ratio: float | None = None  # cheapest one-kind cost at this rate / this cost
    recommended_mode: str = "async"  # "synchronous" when the colocated sync plan is faster
    unspent_usd_per_h: float | None = None
    # why the plan keeps one kind where the inventory has others (`scheduler/assess.py`)
    one_kind_reason: str | None = None
    solve_s: float = 0.0
    # local search from the MILP's pick (scheduler/polish.py): moves taken and the
    # placed rate of the pick it started from
    local_search_moves: int = 0
    milp_pick_samples_per_s: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_old_names(cls, data: object) -> object:
        return refuse_renamed(data, {**RENAMED_KEYS, **MOVED_TO_DECISIONS})


class TaskPlacement(Section):
    """Where the instances of one task beyond generate and train run (its `TaskSpec` in
    the config's `workflow.tasks`): one slot per instance."""

    task: str
    gpu_kind: str | None = None  # None: a CPU task
    slots: list[DeviceSlot] = Field(min_length=1)
    # the samples/s its instances score together (None: its work is not priced) and why
    # the planner put it on this kind (scheduler/task_graph.py)
    predicted_samples_per_s: float | None = None
    reason: str | None = None


class Decisions(Section):
    """What the planner decided, and all that a run, a deploy render or a box reads of
    the plan besides the two pools (`rollout`, `trainer`)."""

    placement: PlacementMode = "disaggregated"
    # the staleness bound η and publish interval k, under the config's names
    # (buffer.max_staleness, trainer.publish_every); tuned within --search-max-staleness /
    # --search-publish-every. None: the config's (a plan that did not decide them)
    max_staleness: int | None = Field(None, ge=0)
    publish_every: int | None = Field(None, ge=1)
    weight_sync: WeightSyncMode | None = None  # None: the config's rollout.weight_sync
    tasks: list[TaskPlacement] = []  # the tasks beyond generate and train
    # hybrid: the indices in `rollout` of the generation instances on the trainer's GPUs,
    # which generate only while the trainer waits for its batch; the last ones (a run
    # lends its last `workflow.lent_servers` servers). Empty in every other placement.
    lent: list[int] = []

    @model_validator(mode="before")
    @classmethod
    def _refuse_old_names(cls, data: object) -> object:
        return refuse_renamed(data, RENAMED_KEYS)

    def task(self, name: str) -> TaskPlacement | None:
        return next((t for t in self.tasks if t.task == name), None)


class PlanSources(Section):
    """The files a plan was made from, so a run can price its layout with the same inputs
    (absolute paths; `profile` is None for the analytic cost model)."""

    cluster: str
    workload: str | None = None
    profile: str | None = None


class Plan(Section):
    # a plan written by a newer areal-hex may hold fields this one does not know
    schema_version: int = Field(PLAN_SCHEMA_VERSION, ge=1, le=PLAN_SCHEMA_VERSION)
    cluster: str
    model: str  # preset name or HF config path the plan was made for
    objective: str  # "throughput" | "cost"
    budget_usd_per_h: float | None = None
    target_samples_per_s: float | None = None
    rollout: list[InferenceInstance]
    trainer: TrainerPlacement
    decisions: Decisions
    predicted: Prediction
    baselines: Baselines | None = None  # optional; written by `areal-hex plan`
    sources: PlanSources | None = None  # optional; written by `areal-hex plan`

    @model_validator(mode="before")
    @classmethod
    def _decisions_of_an_older_plan(cls, data: object) -> object:
        """A version 1 or 2 plan kept η and k among its baselines: read them as its
        decisions (the file is valid as it was written)."""
        if not isinstance(data, dict) or "decisions" in data:
            return data
        version = data.get("schema_version", PLAN_SCHEMA_VERSION)
        if not isinstance(version, int) or version >= 3:
            return data  # a version 3 plan without decisions: refused as missing
        data = dict(data)
        base = data.get("baselines")
        decisions: dict[str, object] = {}
        if isinstance(base, dict):
            base = dict(base)
            for key in MOVED_TO_DECISIONS:
                if key in base:
                    decisions[key] = base.pop(key)
            data["baselines"] = base
        data["decisions"] = decisions
        return data

    @model_validator(mode="after")
    def _devices_used_once(self) -> Plan:
        """No GPU serves two instances of one task; disaggregated, no GPU serves two
        tasks either. Colocated, the generation instances take turns with the trainer
        (and the other tasks) on the same GPUs, so only those two sides may share one;
        hybrid, only the lent instances share (`plan_placement.py`, which also refuses
        decisions that disagree with the placement)."""
        check_placement(self)
        sides = sharing_sides(self, self.device_slots())
        for side in sides:
            seen: dict[tuple[str, int], str] = {}
            for who, _, slot in side:
                for gpu in slot.gpu_ids:
                    other = seen.get((slot.node, gpu))
                    if other is not None:
                        raise ValueError(
                            f"GPU {gpu} of node {slot.node!r} is placed for both {other!r} "
                            f"and {who!r}: expected each GPU in one slot "
                            f"(decisions.placement {self.decisions.placement})"
                        )
                    seen[(slot.node, gpu)] = who
        return self

    def device_slots(self) -> list[tuple[str, str | None, DeviceSlot]]:
        """Every slot of every task as (where in the plan, GPU kind, slot): the generation
        instances, the trainer's nodes, then each other task's instances."""
        out: list[tuple[str, str | None, DeviceSlot]] = [
            (f"rollout[{i}] ({r.id})", r.gpu_kind, r.placement) for i, r in enumerate(self.rollout)
        ]
        t = self.trainer
        kinds = t.gpu_kinds or [t.gpu_kind] * len(t.placements)
        out += [("trainer", k, p) for k, p in zip(kinds, t.placements, strict=True)]
        out += [
            (f"decisions.tasks[{i}] ({task.task})", task.gpu_kind, slot)
            for i, task in enumerate(self.decisions.tasks)
            for slot in task.slots
        ]
        return out


def load_plan(path: str | Path) -> Plan:
    return build(Plan, read_yaml(path), str(path), "plan")


def save_plan(plan: Plan, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False))
    return p
