"""The root `ExperimentConfig`, composed of one small model per component.

Each component receives only its own section; the root exists to load, override,
validate and save the whole tree.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from areal_hex.config.algo import AlgoConfig
from areal_hex.config.base import (
    ConfigError,
    Section,
    apply_overrides,
    build,
    dump_yaml,
    read_yaml,
)
from areal_hex.config.buffer import BufferConfig
from areal_hex.config.data import DataConfig
from areal_hex.config.inference import InferenceConfig, SGLangConfig
from areal_hex.config.model import ModelConfig, TinyModelConfig
from areal_hex.config.redis import RedisConfig
from areal_hex.config.reward import check_reward_task
from areal_hex.config.rollout import RolloutConfig
from areal_hex.config.run import RunConfig
from areal_hex.config.trainer import TrainerConfig
from areal_hex.config.workflow import TaskSpec, WorkflowConfig, check_hybrid

__all__ = [
    "AlgoConfig",
    "BufferConfig",
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "InferenceConfig",
    "ModelConfig",
    "RedisConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangConfig",
    "Section",
    "TaskSpec",
    "TinyModelConfig",
    "TrainerConfig",
    "WorkflowConfig",
    "load_config",
    "resolve_mode",
    "save_config",
]


class ExperimentConfig(Section):
    run: RunConfig = RunConfig()
    redis: RedisConfig = RedisConfig()
    buffer: BufferConfig = BufferConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inference: InferenceConfig = InferenceConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    trainer: TrainerConfig = TrainerConfig()
    workflow: WorkflowConfig = WorkflowConfig()

    @model_validator(mode="before")
    @classmethod
    def _resolve_mode(cls, data: object) -> object:
        return resolve_mode(data)

    @model_validator(mode="after")
    def _prompt_and_answer_fit_the_context(self) -> ExperimentConfig:
        # A request of prompt + max_new_tokens over the context is refused by the server
        # (HTTP 400) at run or eval time; say so when the config is read instead.
        need = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        limits = {"inference.context_length": self.inference.context_length}
        if self.model.tiny is not None and self.model.path is None:
            limits["model.tiny.max_position_embeddings"] = self.model.tiny.max_position_embeddings
        for name, limit in limits.items():
            if need > limit:
                raise ValueError(
                    f"data.max_prompt_tokens {self.data.max_prompt_tokens} + "
                    f"rollout.max_new_tokens {self.rollout.max_new_tokens} = {need} exceeds "
                    f"{name} {limit}: expected prompt + answer to fit the context"
                )
        return self

    @model_validator(mode="after")
    def _colocated_is_synchronous(self) -> ExperimentConfig:
        if self.workflow.placement == "colocated" and self.run.mode != "sync":
            raise ValueError(
                f"workflow.placement colocated with run.mode {self.run.mode}: colocated "
                "phases alternate (generate one batch, then train on it), which is "
                "synchronous RL; expected run.mode=sync, or workflow.placement=disaggregated "
                "for an asynchronous run"
            )
        if self.workflow.placement == "hybrid":
            check_hybrid(self.workflow, self.inference.num_servers, self.trainer.publish_every)
        return self

    @model_validator(mode="after")
    def _overlong_within_budget(self) -> ExperimentConfig:
        buf, budget = self.algo.overlong_buffer, self.rollout.max_new_tokens
        if buf is not None and buf > budget:
            raise ValueError(
                f"algo.overlong_buffer {buf} exceeds rollout.max_new_tokens {budget}: "
                "expected a buffer inside the generation budget"
            )
        return self

    @model_validator(mode="after")
    def _policy_trains_after_critic_warmup(self) -> ExperimentConfig:
        warm, total = self.algo.critic_warmup_steps, self.trainer.total_steps
        if warm >= total and self.algo.advantage == "gae":
            raise ValueError(
                f"algo.critic_warmup_steps {warm} leaves no step of trainer.total_steps "
                f"{total} to the policy: expected fewer warm-up steps than steps"
            )
        return self

    @model_validator(mode="after")
    def _reference_task_has_a_kl_term(self) -> ExperimentConfig:
        task = self.workflow.task_with_role("reference")
        if task is not None and self.algo.kl_coef <= 0:
            raise ValueError(
                f"workflow.tasks: task {task.name!r} (role reference) scores π_ref for the KL "
                "term, but algo.kl_coef is 0: expected algo.kl_coef > 0, or no reference task"
            )
        return self

    @model_validator(mode="after")
    def _reward_model_task(self) -> ExperimentConfig:
        check_reward_task(self.rollout.reward, self.workflow)
        return self


# What `run.mode: sync` means, whatever else the config or a plan says: the gate admits
# a batch only after the trainer published the version it trains (η = 0), and it
# publishes after every step (k = 1). Every entry point (run, deploy, box, a bench)
# builds its config through ExperimentConfig, so all of them run what the mode says.
SYNC_MODE_KEYS = {("buffer", "max_staleness"): 0, ("trainer", "publish_every"): 1}


def resolve_mode(data: object) -> object:
    """The raw config with `run.mode` applied: in sync mode, η = 0 and k = 1."""
    if not isinstance(data, dict):
        return data
    run = data.get("run")
    mode = run.mode if isinstance(run, RunConfig) else (run or {}).get("mode")
    if mode != "sync":
        return data
    data = dict(data)
    for (section, key), value in SYNC_MODE_KEYS.items():
        sub = data.get(section)
        if isinstance(sub, Section):
            data[section] = sub.model_copy(update={key: value})
        elif isinstance(sub, dict) or sub is None:
            data[section] = {**(sub or {}), key: value}
    return data


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> ExperimentConfig:
    """Load YAML (or defaults when `path` is None), apply overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    return build(ExperimentConfig, data, str(path) if path else "defaults")


def save_config(cfg: ExperimentConfig, path: str | Path) -> Path:
    """Write the resolved config (every default filled in) atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(p)
    return p
