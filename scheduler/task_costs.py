"""What a task beyond generate and train costs, by its role, and the rate it sustains.

A task of role `reference` (the initial policy scoring the sampled tokens) or
`reward_model` (a sequence classifier scoring each completion) runs one forward pass over
the prompt and completion of every sample: compute-bound, so an instance of g GPUs of a
kind sustains

    samples/s = g · peak BF16 FLOP/s · prefill_mfu / F,
    F = T · (2·N + 4·L·heads·head_dim·T/2),   T = prompt + mean completion tokens,

N, L, heads and head_dim the task model's (the reference is the actor's shape, the reward
model `workload.reward_model_shape`'s). Where the profile measured the kind, its scoring
tokens/s (a group's sequences scored whole in one request, as the controller sends them,
with as many requests in flight as the run keeps there; a profile without that: one at a
time; without either: its prefill tokens/s), measured for the actor, replaces the peak:
g · tokens/s / T · F_actor / F; a reward model whose own `/classify` rate the profile
measured on the kind scores at g · that tokens/s / T. An
instance must hold the model's bf16 weights over its GPUs and one sequence's KV cache.
The task's rate is its instances' sum; the pipeline runs no faster than it. A `custom`
task's work is not modelled: it gets its devices, unpriced. PPO's critic is no task here:
it runs in the trainer's ranks (`costmodel.train_passes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hex.config import ConfigError
from areal_hex.config.workflow import TaskSpec
from scheduler.cluster import Cluster, NodeGroup
from scheduler.costmodel import GB, kind_constants
from scheduler.model_shape import ModelShape, load_model_shape
from scheduler.profile import Profile
from scheduler.workload import Workload

PRICED_ROLES = ("reference", "reward_model")


@dataclass(frozen=True)
class TaskOption:
    """One node group a task's instances may be reserved on, and what they do there."""

    task: str
    role: str
    group: str  # node group
    kind: str
    zone: str
    samples_per_s: float  # all instances together
    usd_per_h: float  # the instances' GPUs


def task_shape(task: TaskSpec, m: ModelShape, w: Workload) -> ModelShape | None:
    """The model a priced task runs (None: a custom task, not priced)."""
    if task.role == "reference":
        return m
    if task.role != "reward_model":
        return None
    if w.reward_model_shape is None:
        return m
    try:
        return load_model_shape(w.reward_model_shape)
    except ConfigError as exc:
        raise ConfigError(
            f"workload reward_model_shape (the model of task {task.name!r}): "
            f"{str(exc).removeprefix(f'--model {w.reward_model_shape!r}: ')}"
        ) from None


def forward_flops_per_sample(shape: ModelShape, w: Workload) -> float:
    """One forward over a sample's prompt and completion (F above)."""
    toks = w.prompt_tokens + w.response_tokens
    attn = 4.0 * shape.layers * shape.heads * shape.head_dim * (toks / 2)
    return toks * (2.0 * shape.params + attn)


def instance_rate(
    cl: Cluster,
    g: NodeGroup,
    task: TaskSpec,
    shape: ModelShape,
    actor: ModelShape,
    w: Workload,
    prof: Profile | None,
) -> float | None:
    """Samples/s one instance scores on group `g`; None where the model does not fit."""
    kind = cl.kinds[g.name]
    k = kind_constants(w.constants, kind)
    usable = kind.hbm_gb * GB * k.hbm_utilization - k.runtime_reserve_gb * GB
    seq = w.prompt_tokens + w.max_response_tokens
    need = 2.0 * shape.params / task.gpus
    need += seq * shape.kv_bytes_per_token / min(task.gpus, shape.kv_heads)
    if usable < need:
        return None
    flops = forward_flops_per_sample(shape, w)
    if prof is not None and prof.has(kind.name):
        toks = w.prompt_tokens + w.response_tokens
        rates = prof.kinds[kind.name]
        if task.role == "reward_model" and rates.classify_tokens_per_s is not None:
            return task.gpus * rates.classify_tokens_per_s / toks  # its own model, measured
        per_gpu = rates.scoring_tokens_per_s() / toks
        return task.gpus * per_gpu * forward_flops_per_sample(actor, w) / flops
    return task.gpus * kind.bf16_tflops * 1e12 * k.prefill_mfu / flops


def task_options(
    cl: Cluster, task: TaskSpec, m: ModelShape, w: Workload, prof: Profile | None
) -> list[TaskOption]:
    """Every node group of an allowed kind whose machines hold the task's instances (its
    whole size, before any other task's reservation), with the rate they reach there; for a
    custom task the rate is 0 (not priced)."""
    shape = task_shape(task, m, w)
    out = []
    for g in cl.spec.node_groups:
        per_node = g.gpus_per_node // task.gpus
        if task.gpu_kinds is not None and g.gpu not in task.gpu_kinds:
            continue
        if per_node == 0 or g.nodes * per_node < task.instances:
            continue
        rate = 0.0
        if shape is not None:
            one = instance_rate(cl, g, task, shape, m, w, prof)
            if one is None:
                continue
            rate = task.instances * one
        out.append(
            TaskOption(
                task=task.name,
                role=task.role,
                group=g.name,
                kind=cl.kinds[g.name].name,
                zone=g.zone,
                samples_per_s=rate,
                usd_per_h=task.instances * task.gpus * g.usd_per_gpu_hour,
            )
        )
    if shape is not None and not out:
        kinds = "any kind" if task.gpu_kinds is None else f"kinds {', '.join(task.gpu_kinds)}"
        raise ConfigError(
            f"task {task.name!r} (role {task.role}): model {shape.name} "
            f"({shape.params / 1e9:.2f}B parameters) fits on no machine of {kinds} in "
            f"cluster {cl.spec.name!r} at {task.gpus} GPU(s) an instance: expected a kind "
            "whose memory holds its weights and one sequence's KV cache, or more gpus"
        )
    return out


def priced_gpu_tasks(w: Workload) -> list[TaskSpec]:
    """The tasks whose work the planner prices and places by cost."""
    return [t for t in w.tasks if t.gpus > 0 and t.role in PRICED_ROLES]


def placed_tasks_rate(
    cl: Cluster, m: ModelShape, w: Workload, prof: Profile | None, groups: dict[str, str]
) -> tuple[float, str] | None:
    """(samples/s, task) of the slowest priced task on the node group `groups` puts it
    on (a fixed layout: a plan's); None where no priced task is placed."""
    gmap = {g.name: g for g in cl.spec.node_groups}
    rates = []
    for task in priced_gpu_tasks(w):
        g = gmap.get(groups.get(task.name, ""))
        shape = task_shape(task, m, w)
        one = None if g is None or shape is None else instance_rate(cl, g, task, shape, m, w, prof)
        if one is not None:
            rates.append((task.instances * one, task.name))
    return min(rates, default=None)
