"""Contracts between the parts: everything a consumer calls, not how it is implemented.

Each Protocol lists every method its user calls, so no caller has to probe an object
with `hasattr`; tests/fakes.py holds one complete fake per Protocol.

- The rollout controller is asyncio code: it uses `TrajectoryProducer` (the buffer's
  write side and the staleness gate) and one `GenerationClient` per inference server.
- The trainer is a synchronous torch loop: it uses a `TrajectorySource` (the buffer's
  read side plus `WeightPublisher`, or a replay file) on rank 0.
- Policy versions are `int` everywhere in Python; only the HTTP wire carries SGLang's
  string form, converted in rollout_service/wire.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from areal_hex.record import GroupRecord
from areal_hex.weight_net import BucketSpec, GroupSpec

# What a weight update does to the requests in flight (`rollout.update_pause`, resolved):
# end them with their partial output (SGLang's default), keep them and recompute their KV
# cache with the new weights, or keep them and their KV cache.
PauseMode = Literal["abort", "retract", "in_place"]

# Why an admission went back to the gate unput (see areal_hex/buffer/keys.py)
GiveBackReason = Literal["filtered", "failed", "abandoned", "reclaimed"]


# ---------------------------------------------------------------- trajectory buffer
@dataclass
class ProducerPosition:
    admitted: int  # admissions ever made, by every producer: the next prompt's number
    held: int  # admissions held by live producers (admitted, neither put nor given back)
    given_back: dict[str, int] = field(default_factory=dict)  # by GiveBackReason
    groups_dropped_stale: int = (
        0  # groups the trainer dropped as stale (`<run>:groups_dropped_stale`)
    )

    @property
    def not_made(self) -> int:
        """Admissions whose group was never made (abandoned at a stop, reclaimed from a
        dead producer, or failed: its generation ran out of retries): as many groups are
        owed to the run, or the trainer would wait for groups no one makes."""
        return sum(self.given_back.get(r, 0) for r in ("abandoned", "reclaimed", "failed"))

    @property
    def owed(self) -> int:
        """Groups the run still needs made in place of others: those never made and those
        made but dropped untrained (stale, or from weights a restarted trainer lost)."""
        return self.not_made + self.groups_dropped_stale


@dataclass
class BufferStats:
    stream_length: int  # entries in the stream (acked entries included until deleted)
    pending: int  # delivered to a consumer, not yet acknowledged
    unconsumed: int  # never delivered
    submitted: int  # groups admitted by the staleness gate since the run began
    groups_dropped_stale: int
    dead_letter: int
    version: int
    # admissions given back unput, by GiveBackReason ("filtered": dynamic sampling)
    given_back: dict[str, int] = field(default_factory=dict)


@dataclass
class Batch:
    entry_ids: list[str]  # stream ids, to acknowledge after the optimizer step commits
    groups: list[GroupRecord]
    groups_dropped_stale: int = 0  # groups discarded while filling this batch (older than v - eta)
    dead_lettered: int = 0  # malformed entries moved to the dead-letter stream
    version_lags: list[int] = field(default_factory=list)  # v - group.version per group


@dataclass(frozen=True)
class VersionUpdate:
    """A published policy version and its weights directory ("" when none was written)."""

    version: int
    path: str
    # Bumped by every restore (areal_hex/buffer/scripts.py RESTORE): a restore may bring
    # the version back down, and (lineage, version) still only grows.
    lineage: int = 0


class TrajectoryProducer(Protocol):
    async def admit(self, n: int = 1, on_hold: Callable[[], None] | None = None) -> None:
        """Wait until the staleness gate and backpressure let `n` more groups be submitted,
        then count them as submitted. Raises TimeoutError with a clear message.
        `on_hold` is called once if the gate refuses first (the caller has submitted all
        it may until a newer version, or until the trainer takes some of the backlog)."""

    async def put(self, group: GroupRecord) -> str:
        """Append an admitted group to the stream; returns its entry id."""

    async def version(self) -> int: ...

    def set_serving_version(self, version: int) -> None:
        """The version the servers generate with now; the gate never opens past it."""

    async def release(self, n: int = 1, reason: GiveBackReason = "failed") -> int:
        """Give back `n` admissions of groups that will never be put (filtered, failed,
        abandoned), counted under that reason; returns the submitted count after."""

    async def position(self) -> ProducerPosition:
        """Where production stands, from durable state, after giving back what dead
        producers held: a restarted controller continues the prompt order from it."""

    def watch_versions(self) -> AsyncIterator[VersionUpdate]:
        """Each newer published policy version, increasing, the current one first; never
        ends on its own (a lost connection is retried inside)."""


class TrajectoryConsumer(Protocol):
    def get_batch(
        self, n: int, timeout_s: float | None = None, *, version: int | None = None
    ) -> Batch:
        """Block until `n` fresh groups are delivered (oldest first), dropping stale ones:
        older than eta versions behind the newer of the published version and `version`
        (the weights that will train them)."""

    def ack(self, entry_ids: Sequence[str]) -> None:
        """Acknowledge entries after the optimizer step that used them committed."""

    def version(self) -> int: ...

    def stats(self) -> BufferStats: ...


class WeightPublisher(Protocol):
    def set_version(self, version: int, weights_path: str) -> None:
        """Record the new policy version and notify subscribers (servers, controller)."""

    def restore(self, version: int, weights_path: str) -> int:
        """Resume at `version`: the version key and the gate's admission count go back to
        the checkpoint's; returns the admission count."""


class TrajectorySource(Protocol):
    """What the trainer's rank 0 reads batches from and announces versions to: the buffer
    (consumer + publisher) or a replay file."""

    def get_batch(
        self, n: int, timeout_s: float | None = None, *, version: int | None = None
    ) -> Batch: ...

    def ack(self, entry_ids: Sequence[str]) -> None: ...

    def set_version(self, version: int, weights_path: str) -> None:
        """A new version was published: tell the servers and the controller."""

    def restore(self, version: int, weights_path: str) -> None:
        """Resume from a checkpoint at `version` (the gate's count follows), then announce."""

    def position(self) -> int | None:
        """The data position, saved in checkpoints: where a replay source stands, or the
        buffer's admissions ever made (the controller's next prompt number)."""

    def seek(self, position: int) -> None:
        """Back to a checkpointed `position()`: a replay source goes there; the buffer
        raises its data position to at least it when `restore` runs (a Valkey that lost
        its data continues the prompt order from the checkpoint's)."""

    def close(self) -> None: ...


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
    # The policy version of the response; None when the server's version is not an
    # integer (SGLang's "default" before the first update): the caller's current one.
    weight_version: int | None
    prompt_tokens: int = 0
    # The version of each output token, when the server reports it (ours does; SGLang
    # reports one version per response). None: every token has `weight_version`.
    token_versions: list[int | None] | None = None


class GenerationClient(Protocol):
    """One inference server (ours or SGLang) seen through its native HTTP API."""

    base_url: str

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateResult:
        """One request; an aborted one returns normally with finish_reason "abort"."""

    async def generate_batch(
        self, input_ids: list[list[int]], sampling: SamplingParams, rids: list[str]
    ) -> list[GenerateResult]:
        """Several requests in one call (SGLang's batch form), each as `generate`."""

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid, or every request when `rid` is None."""

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = True
    ) -> None: ...

    async def init_weights_update_group(self, group: GroupSpec, rank_offset: int) -> None:
        """Join the trainer's weight-update group as rank `rank_offset`."""

    async def update_weights_from_distributed(
        self,
        bucket: BucketSpec,
        group_name: str,
        weight_version: int | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Receive one bucket broadcast by the trainer and load it."""

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def release_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Colocated: give the device memory back while the trainer steps (SGLang's
        weights / kv_cache / cuda_graph; all when None); refused while requests run."""

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> str:
        """Take the memory back; generation is refused until then."""

    async def health(self) -> bool: ...

    async def server_info(self) -> dict[str, Any]:
        """The server's `/get_server_info`; ours says `output_token_versions: true`."""

    async def weight_version(self) -> int | None:
        """The version the server holds now (None: not an integer, e.g. SGLang's
        "default")."""
