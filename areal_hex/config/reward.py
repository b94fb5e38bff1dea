"""Where a completion's reward comes from: the rule (math-verify against the gold answer),
a reward model (a sequence classifier served by the workflow task of role
`reward_model`), or a weighted sum of both.

    rollout.reward: rule                    # the default
    rollout.reward: model                   # the reward model's score alone
    rollout.reward: {rule: 1.0, model: 0.5} # 1.0 x rule + 0.5 x model
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from areal_hex.config.base import Section
from areal_hex.config.model import TinyModelConfig

if TYPE_CHECKING:
    from areal_hex.config.workflow import WorkflowConfig

RewardSource = Literal["rule", "model"]
REWARD_SOURCES: tuple[RewardSource, ...] = ("rule", "model")
EXPECTED = "expected 'rule', 'model', or weights such as {rule: 1.0, model: 0.5}"


def check_reward_spec(value: Any) -> Any:
    """A `rollout.reward` value as written, refused with what was wrong and what was
    expected (a `field_validator(mode="before")`)."""
    if isinstance(value, str):
        if value not in REWARD_SOURCES:
            raise ValueError(f"unknown reward source {value!r}: {EXPECTED}")
        return value
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{value!r}: {EXPECTED}")
    for key, weight in value.items():
        if key not in REWARD_SOURCES:
            raise ValueError(f"unknown reward source {key!r}: {EXPECTED}")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"weight of {key!r} is {weight!r}: expected a number")
        if not math.isfinite(weight):
            raise ValueError(f"weight of {key!r} is {weight}: expected a finite number")
        if weight == 0:
            raise ValueError(f"weight of {key!r} is 0, which does nothing: drop the key")
    return {k: float(w) for k, w in value.items()}


def reward_weights(spec: str | dict[str, float]) -> dict[RewardSource, float]:
    """The weight of each source a `rollout.reward` value uses."""
    if isinstance(spec, str):
        return {spec: 1.0}  # type: ignore[dict-item]
    return dict(spec)  # type: ignore[arg-type]


def check_reward_task(spec: str | dict[str, float], workflow: WorkflowConfig) -> None:
    """A model weight needs a reward-model task to call, and a reward-model task needs a
    model weight (otherwise it runs for nothing)."""
    uses_model = "model" in reward_weights(spec)
    task = workflow.task_with_role("reward_model")
    if uses_model and task is None:
        raise ValueError(
            f"rollout.reward {spec!r} scores with a reward model but workflow.tasks has no "
            "task with role reward_model: expected one (e.g. command [areal-hex, serve, "
            "'{config}', --reward-model, --index, '{index}'] with a port), or "
            "rollout.reward: rule"
        )
    if task is not None and not uses_model:
        raise ValueError(
            f"workflow.tasks: task {task.name!r} has role reward_model but rollout.reward "
            f"is {spec!r}: the reward model would never be called; expected rollout.reward "
            "model, or weights with a model key (e.g. {rule: 1.0, model: 0.5})"
        )


class RewardModelConfig(Section):
    """The reward model: what the reward-model server loads, and how the controller
    calls it."""

    # HF directory of a sequence-classification model with one label (its score is the
    # reward). None: the tiny one trained on this job's generated data (`areal-hex rm
    # train`), built on first use and kept in ~/.cache/areal-hex/reward_models.
    path: str | None = None
    tokenizer_path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    # Built-in server: sequences per forward pass, and torch threads (None: torch's).
    max_batch: int = Field(64, gt=0)
    num_threads: int | None = Field(None, gt=0)
    # One /classify call (a group's completions, batched).
    timeout_s: float = Field(60.0, gt=0)
    # How long one group's scoring is retried while no instance answers (a restart);
    # past it the controller stops with an error rather than drop or mis-score groups.
    wait_s: float = Field(300.0, gt=0)
    # The tiny reward model (path None): optimizer steps of its training.
    tiny_train_steps: int = Field(800, gt=0)
    # ... and its shape (None: the tiny policy's, `model.tiny`); the same tokenizer.
    tiny: TinyModelConfig | None = None
