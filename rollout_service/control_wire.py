"""Request and response shapes of the inference server's control endpoints: weight
updates (from disk and over a weight-update group), pause, abort, memory occupation,
model info and load. The SGLang native subset, as in wire.py (generation shapes, the
error body and the version conversion), whose `Lenient` base and `Text` type they share:
the server (rollout_service/server/app.py) reads requests and writes responses with
them, the client reads what the server answers.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from areal_hex.api import PauseMode
from rollout_service.wire import Lenient, Text


class UpdateWeightsFromDiskReq(Lenient):
    model_path: Text = Field(min_length=1)
    load_format: Text | None = None
    abort_all_requests: bool = False
    weight_version: Text | None = None
    flush_cache: bool = True


class UpdateWeightsResp(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class UpdateWeightVersionReq(Lenient):
    new_version: Text
    abort_all_requests: bool = False


class InitWeightsUpdateGroupReq(Lenient):
    """SGLang's body: join the group at `master_address:master_port` as rank
    `rank_offset` (the trainer is rank 0) of `world_size`."""

    master_address: Text = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: Text = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "nccl"

    @model_validator(mode="after")
    def _rank_in_group(self) -> InitWeightsUpdateGroupReq:
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset ({self.rank_offset}) must be below world_size ({self.world_size})"
            )
        return self


class UpdateWeightsFromDistributedReq(Lenient):
    """SGLang's body: receive one bucket, tensor i broadcast from rank 0 with
    `dtypes[i]` and `shapes[i]`, loaded as `names[i]`."""

    names: list[Text] = Field(min_length=1)
    dtypes: list[Text]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: Text = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Text | None = None
    load_format: Text | None = None

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedReq:
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ValueError(
                f"names, dtypes and shapes must have the same length, got {n}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        if len(set(self.names)) != n:
            raise ValueError("names: a tensor name is repeated")
        if self.load_format is not None:
            raise ValueError(
                f"load_format {self.load_format!r}: the built-in engine receives one "
                "broadcast per tensor (load_format null)"
            )
        return self


class DestroyWeightsUpdateGroupReq(Lenient):
    group_name: Text = "weight_update_group"


class PauseReq(Lenient):
    mode: PauseMode = "abort"


class MemoryOccupationReq(Lenient):
    """`/release_memory_occupation`, `/resume_memory_occupation`: which memory (SGLang's
    tags); null: all of it."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None

    def chosen(self) -> frozenset[str]:
        return frozenset(self.tags if self.tags is not None else MEMORY_TAGS)


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class AbortReq(Lenient):
    rid: Text | None = None
    abort_all: bool = False


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: str | None = None
    architectures: list[str] = []
    context_length: int = 0


class LoadInfo(BaseModel):
    """One entry of `GET /get_load` (SGLang answers one per data-parallel rank)."""

    dp_rank: int = 0
    num_reqs: int  # running + queued
    num_waiting_reqs: int
    num_tokens: int  # prompt + output tokens of the running requests
    ts_tic: float = Field(default_factory=time.time)  # when this snapshot was taken
