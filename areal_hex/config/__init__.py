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
from areal_hex.config.rollout import RolloutConfig
from areal_hex.config.run import RunConfig
from areal_hex.config.trainer import TrainerConfig

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
    "TinyModelConfig",
    "TrainerConfig",
    "load_config",
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
