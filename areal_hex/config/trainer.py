"""The DeepSpeed trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from areal_hex.config.base import Section, refuse_renamed

# The weight-sync settings moved beside their mode (`rollout.weight_sync`).
RENAMED_KEYS = {
    f"weight_sync_{k}": f"rollout.weight_sync_{k}"
    for k in ("address", "port", "ifname", "bucket_mb", "timeout_s")
}


class TrainerConfig(Section):
    # Ranks (one per device; CPU: processes) the launcher starts on this node.
    num_ranks: int = Field(1, gt=0)
    launcher: Literal["deepspeed", "torchrun"] = "deepspeed"
    # Rendezvous port for the launcher (None: a free port).
    master_port: int | None = Field(None, gt=0, lt=65536)
    # Prometheus /metrics port of rank 0 (trainer and buffer metrics; None: off, 0: free).
    metrics_port: int | None = Field(None, ge=0, lt=65536)
    zero_stage: int = Field(0, ge=0, le=3)
    # cpu: fp32 with gloo (DS_ACCELERATOR=cpu); cuda: bf16 with NCCL.
    device: Literal["cpu", "cuda"] = "cpu"
    lr: float = Field(1e-4, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    # Linear warm-up from 0 over this many optimizer steps.
    warmup_steps: int = Field(0, ge=0)
    # Final LR of a linear/cosine decay, as a fraction of `lr`.
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, gt=0)
    # Per-rank token budget of one micro-batch (padded tokens: rows x longest row).
    micro_batch_tokens: int = Field(4096, gt=0)
    # Recompute activations in backward (saves memory on big models).
    gradient_checkpointing: bool = False
    total_steps: int = Field(20, gt=0)
    # Publish weights v<N> every this many optimizer steps (N = step count).
    publish_every: int = Field(1, gt=0)
    # Published versions kept on disk besides v0 (the initial model is never deleted).
    keep_versions: int = Field(3, gt=0)
    checkpoint_every: int = Field(10, gt=0)
    # Complete checkpoints kept on disk.
    keep_checkpoints: int = Field(2, gt=0)
    # Checkpoint directory (None: <run_dir>/checkpoints).
    checkpoint_dir: str | None = None
    # "auto": continue from the newest complete checkpoint if any; "none": start fresh;
    # otherwise a checkpoint directory (…/checkpoints/step<N>).
    resume: str = "auto"
    # Seconds to wait for a batch from the buffer before failing with what is missing
    # (None: forever; a run whose controller stopped short would then hang).
    batch_timeout_s: float | None = Field(600.0, gt=0)
    # Train from a JSONL file of group records instead of the buffer (replay, tests).
    replay_path: str | None = None
    # Heterogeneous data parallelism: the relative speed of each rank, one value per rank
    # of the trainer (e.g. the planned tokens/s of its GPU kind). A step's sequences are
    # shared out in proportion, so ranks of different speed finish together; the loss
    # keeps the step's global token counts, so the update does not change. None: equal.
    rank_speeds: list[float] | None = None
    # Share by the speed each rank measured over its previous steps (tokens per second
    # of its forward + backward), starting from `rank_speeds` (or equal shares).
    balance_measured: bool = False
    # Emulate a slower device for some ranks on identical hardware ({rank: factor}, factor
    # >= 1): the rank sleeps factor - 1 times the compute of each micro-batch's forward and
    # backward, so it takes factor times as long. For heterogeneous-trainer experiments on
    # one kind of device (the box emulates whole nodes by CPU quota instead). ZeRO 0-1 only:
    # under ZeRO-2/3 a micro-batch's passes hold collectives, whose waits would stretch too.
    emulate_slowdown: dict[int, float] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_old_names(cls, data: object) -> object:
        return refuse_renamed(data, RENAMED_KEYS)

    @field_validator("emulate_slowdown")
    @classmethod
    def _slowdown_factors(cls, v: dict[int, float]) -> dict[int, float]:
        bad = {r: f for r, f in v.items() if r < 0 or not f >= 1.0}
        if bad:
            raise ValueError(f"expected {{rank >= 0: factor >= 1}}, got {bad}")
        return v

    @model_validator(mode="after")
    def _slowdown_without_collectives(self) -> TrainerConfig:
        if self.emulate_slowdown and self.zero_stage >= 2:
            raise ValueError(
                f"emulate_slowdown with zero_stage {self.zero_stage}: a ZeRO-2/3 micro-batch's "
                "passes hold collectives, so the waits would stretch too; expected zero_stage "
                "0 or 1"
            )
        return self

    @field_validator("rank_speeds")
    @classmethod
    def _speeds_positive(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or min(v) <= 0):
            raise ValueError(f"expected one positive speed per rank, got {v}")
        return v
