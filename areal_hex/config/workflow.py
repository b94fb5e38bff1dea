"""The RL workflow as data: its tasks and how they share devices.

Every workflow has two built-in tasks, `generate` (the inference servers and the rollout
controller that feeds them) and `train` (the trainer's ranks). `workflow.tasks` adds
others (a reference worker, a reward model, a critic, or anything that runs beside the
job): each is a `TaskSpec`, and the planner, the launcher, the deploy renderers and the
box read it through one generic path (`areal_hex/workflow.py`), never a branch of its
own. `placement` is the other axis beside `run.mode` (staleness): where tasks run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from areal_hex.config.base import Section

# The tasks every workflow has; their pools are the plan's `rollout` and `trainer`.
BUILTIN_TASKS = ("generate", "train")
# disaggregated: every task on devices of its own, all running at once.
# colocated: every task on every device, in turn: generation and training alternate, each
# phase with all of them (the servers release their memory while the trainer steps, and
# take it back before the next weights load). Only synchronous (run.mode sync): with
# η > 0 generation would run ahead on the devices the trainer is stepping on, which is
# disaggregation without the split, not a phase.
# hybrid: the disaggregated split, plus `lent_servers` generation servers on the trainer's
# devices that generate only while the trainer waits for its batch (paused in place while
# it steps): the devices the trainer leaves idle between its steps generate too.
PlacementMode = Literal["disaggregated", "colocated", "hybrid"]
PLACEMENT_MODES: tuple[PlacementMode, ...] = ("disaggregated", "colocated", "hybrid")
# auto: `areal-hex run` prices every placement valid for the run (colocated only with
# run.mode sync; hybrid with the config's servers of their own plus `lent_servers` on the
# trainer's devices, and a version every step) from this machine's cached profile of the
# job, and runs the fastest (hexctl/job/placement_choice.py); without a profile, the
# default. A run's resolved config.yaml holds the placement it ran.
PlacementSetting = Literal["auto", "disaggregated", "colocated", "hybrid"]
AUTO_PLACEMENT = "auto"
DEFAULT_PLACEMENT: PlacementMode = "disaggregated"
# What a task does, so that the rollout controller can call it and the planner can price
# it. custom: anything beside the job (started, stopped and restarted; its work is not
# priced). reference: a server holding the initial policy (v0) that scores the sampled
# tokens, giving the trainer π_ref's log-probs for the KL term. reward_model: a server
# that scores each completion (rollout.reward chooses how its score is used).
TaskRole = Literal["custom", "reference", "reward_model"]
TASK_ROLES: tuple[TaskRole, ...] = ("custom", "reference", "reward_model")
CONFIG_PLACEHOLDER = "{config}"  # the resolved config file, wherever the job is realised
INDEX_PLACEHOLDER = "{index}"  # the instance's index within its task (0, 1, ...)
PORT_PLACEHOLDER = "{port}"  # the instance's port (the task's port + index)


class TaskSpec(Section):
    """A task beyond `generate` and `train`: what it runs, how many instances, and what
    each needs. The planner gives every instance a device slot of `gpus` GPUs (on one of
    `gpu_kinds`, or any kind); the launcher and every deploy target start its command."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")
    # argv of one instance; "{config}" is the resolved config file, "{index}" the
    # instance's index and "{port}" its port (port + index; a local run moves a task
    # whose ports are taken to free ones); "areal-hex ..." runs the project's CLI
    command: list[str] = Field(min_length=1)
    instances: int = Field(1, ge=1, le=1024)
    gpus: int = Field(0, ge=0, le=64)  # per instance; 0: CPU only
    gpu_kinds: list[str] | None = None  # kinds an instance may run on; None: any
    port: int | None = Field(None, gt=0, lt=65536)  # instance i listens on port + i
    role: TaskRole = "custom"
    # Where the rollout controller reaches instance i (a server task); empty:
    # http://127.0.0.1:<port + i>. Deploy renderers fill it with the service's address.
    urls: list[str] = []

    @model_validator(mode="after")
    def _not_builtin(self) -> TaskSpec:
        if self.name in BUILTIN_TASKS:
            raise ValueError(
                f"task name {self.name!r} is a built-in task: expected a name other than "
                f"{', '.join(BUILTIN_TASKS)}"
            )
        if self.gpu_kinds is not None and self.gpus == 0:
            raise ValueError(
                f"task {self.name!r}: gpu_kinds {self.gpu_kinds} with gpus 0 does nothing: "
                "expected gpus > 0, or no gpu_kinds for a CPU task"
            )
        if self.port is None and any(PORT_PLACEHOLDER in a for a in self.command):
            raise ValueError(
                f"task {self.name!r}: its command uses {PORT_PLACEHOLDER} but it has no "
                "port: expected a port (instance i listens on port + i)"
            )
        if self.role != "custom" and self.port is None and not self.urls:
            raise ValueError(
                f"task {self.name!r} (role {self.role}) is a server the rollout controller "
                "calls: expected a port (instance i listens on port + i) or urls"
            )
        if self.urls and len(self.urls) != self.instances:
            raise ValueError(
                f"task {self.name!r}: {len(self.urls)} url(s) for {self.instances} "
                "instance(s): expected one url per instance"
            )
        return self

    def instance_urls(self) -> list[str]:
        """Base URL of each instance, in index order."""
        if self.urls:
            return list(self.urls)
        return [f"http://127.0.0.1:{self.port + i}" for i in range(self.instances)]


class WorkflowConfig(Section):
    placement: PlacementSetting = DEFAULT_PLACEMENT
    # hybrid: how many of the inference servers (the last ones, by index) are lent by the
    # trainer's devices; the others generate on devices of their own
    lent_servers: int = Field(1, ge=1, le=1024)
    tasks: list[TaskSpec] = []  # tasks beyond generate and train

    @model_validator(mode="after")
    def _unique_names(self) -> WorkflowConfig:
        names = [t.name for t in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tasks named twice: {', '.join(twice)}: expected unique names")
        for role in TASK_ROLES[1:]:
            having = [t.name for t in self.tasks if t.role == role]
            if len(having) > 1:
                raise ValueError(
                    f"tasks {', '.join(having)} all have role {role}: expected at most one "
                    "(give it more instances instead)"
                )
        return self

    def placement_in_effect(self) -> PlacementMode:
        """The placement the job's processes run in: `auto` is made concrete by `areal-hex
        run` before they start (their config.yaml names what it chose); a config left at
        `auto` elsewhere (a service started by hand) runs in the default."""
        if self.placement == AUTO_PLACEMENT:
            return DEFAULT_PLACEMENT
        return self.placement

    def task_with_role(self, role: TaskRole) -> TaskSpec | None:
        """The task that plays `role`, if the workflow has one."""
        return next((t for t in self.tasks if t.role == role), None)


def check_hybrid(workflow: WorkflowConfig, num_servers: int, publish_every: int) -> None:
    """A hybrid placement that can run: at least one server of its own beside the lent
    ones, and a version every step (the controller follows the trainer's steps by its
    versions, to lend it the devices exactly while it steps)."""
    lent = workflow.lent_servers
    if num_servers <= lent:
        raise ValueError(
            f"workflow.placement hybrid with inference.num_servers {num_servers} and "
            f"workflow.lent_servers {lent}: hybrid lends the last {lent} server(s) the "
            "trainer's devices and keeps the others on devices of their own; expected "
            f"inference.num_servers >= {lent + 1} (or workflow.placement=colocated to "
            "share every device)"
        )
    if publish_every != 1:
        raise ValueError(
            f"workflow.placement hybrid with trainer.publish_every {publish_every}: the "
            "lent servers pause while the trainer steps, which the controller sees from "
            "the version each step publishes; expected trainer.publish_every=1"
        )
