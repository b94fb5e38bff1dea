"""One complete fake per Protocol of areal_hex/api.py, for tests that cannot use the real
part: each implements every method of its Protocol (tests/unit/test_fakes.py checks),
so the code under test takes the path it takes in production."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from areal_hex.api import (
    GenerateResult,
    GiveBackReason,
    PauseMode,
    ProducerPosition,
    SamplingParams,
    VersionUpdate,
)
from areal_hex.models import build_tokenizer
from areal_hex.record import GroupRecord
from areal_hex.weight_net import BucketSpec, GroupSpec

TOK = build_tokenizer()
ANSWER = TOK("#### 7", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]


class PlainEngine:
    """The calls `trainer_service.step` makes of a DeepSpeed engine, on a plain HF module
    held as `module` (as the engine holds it): gradients accumulate in the module, and
    `step` leaves the weights as they are so that a step's gradients can be compared
    (DeepSpeed's own path: tests/integration/test_trainer_dist.py)."""

    def __init__(self, model: Any) -> None:
        self.module = model

    def __call__(self, **kw: Any) -> Any:
        return self.module(**kw)

    def backward(self, loss: Any) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def get_global_grad_norm(self) -> None:
        return None


class ServerDown(ConnectionError):
    pass


class FakeServer:
    """`GenerationClient`: emits the tokens of "#### 7<eos>" one per `delay_s`, continuing
    where the input's tail left off. Pause `abort` ends what runs with its partial tokens
    (SGLang's way); pause `retract` holds it until resume. One version per response, as
    SGLang reports it (no per-token versions)."""

    def __init__(self, name: str, delay_s: float = 0.01, target: list[int] = ANSWER) -> None:
        self.base_url = name
        self.delay_s = delay_s
        self.target = target
        self.version = 0
        self.down = False
        self.hang = False
        self.stalled = False  # hung as a whole: not even /health answers
        self.paused = asyncio.Event()  # running requests end as aborted
        self.running = asyncio.Event()  # new tokens may be generated
        self.running.set()
        self.in_flight = 0
        self.calls: list[tuple[int, int]] = []  # (input length, max_new_tokens)
        self.batch_calls = 0
        self.updates: list[tuple[str, int]] = []
        self.aborted: set[str] = set()
        self.groups: dict[str, int] = {}  # weight-update groups joined: name -> rank
        self.world_sizes: dict[str, int] = {}  # each group's size as it was asked to join
        self.buckets: list[tuple[str, list[str]]] = []  # (group, tensor names) received
        # load from disk as the real server does: a directory without config.json fails
        self.reads_disk = False
        self.released = False  # colocated: memory given back, generation refused
        self.memory_calls: list[str] = []  # "release" / "resume", in order

    def _check_up(self) -> None:
        if self.down:
            raise ServerDown(f"{self.base_url}: connection refused")

    def _start(self, input_ids: list[int]) -> int:
        for k in range(min(len(self.target), len(input_ids)), 0, -1):
            if input_ids[-k:] == self.target[:k]:
                return k
        return 0

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateResult:
        self._check_up()
        if self.released:  # as the real server: 503 until the memory is back
            raise ServerDown(f"{self.base_url}: memory released")
        await self.running.wait()
        self.calls.append((len(input_ids), sampling.max_new_tokens))
        self.in_flight += 1
        out: list[int] = []
        try:
            pos = self._start(input_ids)
            while True:
                if self.hang:
                    await asyncio.sleep(3600)
                if self.paused.is_set() or rid in self.aborted:
                    return self._result(out, "abort")
                if len(out) >= sampling.max_new_tokens:
                    return self._result(out, "length")
                await asyncio.sleep(self.delay_s)
                if self.paused.is_set() or rid in self.aborted:
                    return self._result(out, "abort")
                await self.running.wait()  # held by a retract pause
                if self.paused.is_set() or rid in self.aborted:
                    return self._result(out, "abort")
                out.append(self.target[pos])
                pos += 1
                if out[-1] == TOK.eos_token_id:
                    return self._result(out, "stop")
        finally:
            self.in_flight -= 1

    async def generate_batch(
        self, input_ids: list[list[int]], sampling: SamplingParams, rids: list[str]
    ) -> list[GenerateResult]:
        self._check_up()
        self.batch_calls += 1
        return list(
            await asyncio.gather(
                *[self.generate(x, sampling, r) for x, r in zip(input_ids, rids, strict=True)]
            )
        )

    def _result(self, out: list[int], reason: str) -> GenerateResult:
        lp = -0.5 - self.version  # log-probs tell versions apart
        return GenerateResult(list(out), [lp] * len(out), reason, self.version)

    async def abort(self, rid: str | None = None) -> None:
        self._check_up()
        if rid is None:
            self.paused.set()
            self.paused.clear()
        else:
            self.aborted.add(rid)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, abort_all_requests: bool = True
    ) -> None:
        self._check_up()
        if self.reads_disk and not (Path(model_path) / "config.json").is_file():
            raise ServerDown(f"model_path {model_path!r}: no config.json in {model_path}")
        self.updates.append((model_path, weight_version))
        await asyncio.sleep(0.05)
        self.version = weight_version

    async def init_weights_update_group(self, group: GroupSpec, rank_offset: int) -> None:
        self._check_up()
        self.groups[group.group_name] = rank_offset
        self.world_sizes[group.group_name] = group.world_size

    async def update_weights_from_distributed(
        self,
        bucket: BucketSpec,
        group_name: str,
        weight_version: int | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        self._check_up()
        if group_name not in self.groups:
            raise ServerDown(f"{self.base_url}: group {group_name!r} not joined")
        self.buckets.append((group_name, list(bucket.names)))
        if weight_version is not None:
            self.updates.append(("", weight_version))
            self.version = weight_version

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self._check_up()
        self.groups.pop(group_name, None)

    async def pause(self, mode: PauseMode = "abort") -> None:
        self._check_up()
        self.running.clear()
        if mode == "abort":
            self.paused.set()
            while self.in_flight:
                await asyncio.sleep(0.001)

    async def resume(self) -> None:
        self.paused.clear()
        self.running.set()

    async def release_memory_occupation(self, tags: list[str] | None = None) -> str:
        self._check_up()
        if self.in_flight:
            raise ServerDown(f"{self.base_url}: {self.in_flight} requests in flight")
        self.released = True
        self.memory_calls.append("release")
        return "released"

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> str:
        self._check_up()
        self.released = False
        self.memory_calls.append("resume")
        return "resumed"

    async def health(self) -> bool:
        while self.stalled:
            await asyncio.sleep(0.01)
        return not self.down

    async def server_info(self) -> dict[str, Any]:
        self._check_up()
        return {"output_token_versions": False, "weight_version": str(self.version)}

    async def weight_version(self) -> int | None:
        self._check_up()
        return self.version


class MemoryProducer:
    """`TrajectoryProducer`: the buffer's gate rule in memory, admit while
    submitted < (min(v, serving) + eta + 1) * B."""

    def __init__(self, groups_per_step: int = 2, eta: int = 0) -> None:
        self.b, self.eta = groups_per_step, eta
        self.v = 0
        self.serving = 0
        self.submitted = 0
        self.groups: list[GroupRecord] = []
        self.released = 0
        self.admitted = 0  # every admission ever made (the data position)
        self.given_back: Counter[str] = Counter()
        self.groups_dropped_stale = 0  # groups the trainer dropped as stale (owed)
        self.max_over: int = 0  # most groups ever admitted beyond the bound (must stay 0)
        self._changed = asyncio.Condition()
        self._updates: asyncio.Queue[VersionUpdate] = asyncio.Queue()

    async def admit(self, n: int = 1, on_hold: Callable[[], None] | None = None) -> None:
        async with self._changed:
            if on_hold is not None and self.submitted + n > self.cap:
                on_hold()
            await self._changed.wait_for(lambda: self.submitted + n <= self.cap)
            self.submitted += n
            self.admitted += n
            self.max_over = max(self.max_over, self.submitted - self.cap)

    @property
    def cap(self) -> int:
        return (self.v + self.eta + 1) * self.b

    async def put(self, group: GroupRecord) -> str:
        self.groups.append(group)
        return f"{len(self.groups)}-0"

    async def version(self) -> int:
        return self.v

    def set_serving_version(self, version: int) -> None:
        self.serving = version

    async def release(self, n: int = 1, reason: GiveBackReason = "failed") -> int:
        self.released += n
        self.given_back[reason] += n
        self.submitted -= n
        return self.submitted

    async def position(self) -> ProducerPosition:
        held = self.submitted - len(self.groups)
        return ProducerPosition(
            self.admitted, held, dict(self.given_back), self.groups_dropped_stale
        )

    async def publish(self, version: int, path: str) -> None:
        """The trainer's side (`WeightPublisher.set_version`), for the tests to drive."""
        async with self._changed:
            self.v = version
            self._changed.notify_all()
        self._updates.put_nowait(VersionUpdate(version, path))

    async def watch_versions(self) -> AsyncIterator[VersionUpdate]:
        yield VersionUpdate(self.v, "")
        while True:
            yield await self._updates.get()


class RecordingPublisher:
    """`WeightPublisher`: records what was announced."""

    def __init__(self) -> None:
        self.version = 0
        self.announced: list[tuple[int, str]] = []
        self.restored: list[tuple[int, str]] = []

    def set_version(self, version: int, weights_path: str) -> None:
        self.version = version
        self.announced.append((version, weights_path))

    def restore(self, version: int, weights_path: str) -> int:
        self.version = version
        self.restored.append((version, weights_path))
        return version


def protocol_methods(proto: type) -> set[str]:
    """The public methods and attributes a Protocol declares."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return names


def missing(obj: object, proto: type) -> Sequence[str]:
    return sorted(n for n in protocol_methods(proto) if not hasattr(obj, n))
