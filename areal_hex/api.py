"""Contracts between the parts: what a consumer needs, not how it is implemented.

- The rollout controller is asyncio code: it uses `TrajectoryProducer` and
  `GenerationClient`.
- The trainer is a synchronous torch loop: it uses `TrajectoryConsumer` and
  `WeightPublisher`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from areal_hex.record import GroupRecord


# ---------------------------------------------------------------- trajectory buffer
@dataclass
class BufferStats:
    stream_length: int  # entries in the stream (acked entries included until deleted)
    pending: int  # delivered to a consumer, not yet acknowledged
    unconsumed: int  # never delivered
    submitted: int  # groups admitted by the staleness gate since the run began
    dropped_stale: int
    dead_letter: int
    version: int


@dataclass
class Batch:
    entry_ids: list[str]  # stream ids, to acknowledge after the optimizer step commits
    groups: list[GroupRecord]
    dropped_stale: int = 0  # groups discarded while filling this batch (older than v - eta)
    dead_lettered: int = 0  # malformed entries moved to the dead-letter stream
    staleness: list[int] = field(default_factory=list)  # v - group.version per group


class TrajectoryProducer(Protocol):
    async def admit(self, n: int = 1) -> None:
        """Wait until the staleness gate and backpressure let `n` more groups be submitted,
        then count them as submitted. Raises TimeoutError with a clear message."""

    async def put(self, group: GroupRecord) -> str:
        """Append an admitted group to the stream; returns its entry id."""

    async def version(self) -> int: ...

    def set_serving_version(self, version: int) -> None:
        """The version the servers generate with now; the gate never opens past it."""


class TrajectoryConsumer(Protocol):
    def get_batch(self, n: int, timeout_s: float | None = None) -> Batch:
        """Block until `n` fresh groups are delivered (oldest first), dropping stale ones."""

    def ack(self, entry_ids: Sequence[str]) -> None:
        """Acknowledge entries after the optimizer step that used them committed."""

    def version(self) -> int: ...

    def stats(self) -> BufferStats: ...


class WeightPublisher(Protocol):
    def set_version(self, version: int, weights_path: str) -> None:
        """Record the new policy version and notify subscribers (servers, controller)."""


# ---------------------------------------------------------------- generation
@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }


@dataclass
class GenerateResult:
    output_ids: list[int]
    logprobs: list[float]  # one behaviour log-prob per output token
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str
    prompt_tokens: int = 0
    # The version of each output token, when the server reports it (ours does; SGLang
    # reports one version per response). None: every token has `weight_version`.
    token_versions: list[str] | None = None


class GenerationClient(Protocol):
    """One inference server (ours or SGLang) seen through its native HTTP API."""

    base_url: str

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateResult: ...

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str, abort_all_requests: bool = True
    ) -> None: ...

    async def pause(self, mode: str = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def health(self) -> bool: ...
