"""Where the trainer's groups come from: the Redis buffer, or a replay file.

The replay source implements the same `TrajectoryConsumer` Protocol as the buffer, so a
recorded run (or a fixed test batch) trains through exactly the same loop.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from areal_hex.api import Batch, BufferStats
from areal_hex.record import Completion, GroupRecord

log = logging.getLogger(__name__)

T = TypeVar("T")


# ---------------------------------------------------------------- JSONL records
def group_to_json(g: GroupRecord) -> dict[str, Any]:
    return {
        "prompt_id": g.prompt_id,
        "prompt_ids": g.prompt_ids.tolist(),
        "temperature": g.temperature,
        "completions": [
            {
                "token_ids": c.token_ids.tolist(),
                "logprobs": c.logprobs.tolist(),
                "versions": c.versions.tolist(),
                "finish_reason": c.finish_reason,
                "reward": c.reward,
                "server": c.server,
                "gpu_kind": c.gpu_kind,
                **({} if c.ref_logprobs is None else {"ref_logprobs": c.ref_logprobs.tolist()}),
            }
            for c in g.completions
        ],
    }


def group_from_json(d: dict[str, Any], where: str) -> GroupRecord:
    try:
        comps = [
            Completion(
                token_ids=np.asarray(c["token_ids"]),
                logprobs=np.asarray(c["logprobs"]),
                versions=np.asarray(c["versions"]),
                finish_reason=c["finish_reason"],
                reward=float(c["reward"]),
                server=_text(c.get("server", "")),
                gpu_kind=_text(c.get("gpu_kind", "")),
                ref_logprobs=None
                if c.get("ref_logprobs") is None
                else np.asarray(c["ref_logprobs"]),
            )
            for c in d["completions"]
        ]
        return GroupRecord(
            prompt_id=str(d["prompt_id"]),
            prompt_ids=np.asarray(d["prompt_ids"]),
            completions=comps,
            temperature=float(d.get("temperature", 1.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a group record ({exc})") from exc


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string for server/gpu_kind, got {type(value).__name__}")
    return value


def write_replay(path: str | Path, groups: Iterable[GroupRecord]) -> Path:
    p = Path(path)
    p.write_text("".join(json.dumps(group_to_json(g)) + "\n" for g in groups))
    return p


class ReplayConsumer:
    """Serves the groups of a JSONL file in order (wrapping around), as the buffer would.

    Entry ids are `"<pass>-<line>"`; acks are recorded so tests can check them.
    """

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"trainer.replay_path: no such file {p}")
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        self.groups = [
            group_from_json(json.loads(ln), f"{p}:{i + 1}") for i, ln in enumerate(lines)
        ]
        if not self.groups:
            raise ValueError(f"trainer.replay_path: {p} holds no group records")
        self._position = 0
        self.acked: list[str] = []
        self._version = 0
        self.published: list[tuple[int, str]] = []

    def get_batch(
        self, n: int, timeout_s: float | None = None, *, version: int | None = None
    ) -> Batch:
        ids, groups = [], []
        for _ in range(n):
            k = self._position % len(self.groups)
            ids.append(f"{self._position // len(self.groups)}-{k}")
            groups.append(self.groups[k])
            self._position += 1
        v = self._version if version is None else max(self._version, version)
        stal = [max(v - g.version, 0) for g in groups]
        return Batch(entry_ids=ids, groups=groups, version_lags=stal)

    def ack(self, entry_ids: Sequence[str]) -> None:
        self.acked.extend(entry_ids)

    def version(self) -> int:
        return self._version

    def set_version(self, version: int, weights_path: str) -> None:
        self._version = version
        self.published.append((version, weights_path))

    def restore(self, version: int, weights_path: str) -> None:
        self.set_version(version, weights_path)  # no gate to restore

    def position(self) -> int | None:
        return self._position

    def seek(self, position: int) -> None:
        self._position = position

    def close(self) -> None:
        pass

    def stats(self) -> BufferStats:
        return BufferStats(
            stream_length=len(self.groups),
            pending=0,
            unconsumed=0,
            submitted=self._position,
            groups_dropped_stale=0,
            dead_letter=0,
            version=self._version,
        )


class BufferSource:
    """The Redis buffer seen by rank 0: the trajectory consumer plus the weight publisher
    (separate clients: publication runs on a background thread).

    Every call is retried with doubling delays while Redis is unreachable (a Valkey
    restart), for up to `retry_s`; the buffer's operations are idempotent or atomic, so a
    call cut off by the restart is safe to repeat."""

    def __init__(self, redis_cfg: Any, buffer_cfg: Any, run_id: str, retry_s: float = 60.0) -> None:
        from areal_hex.buffer import RedisTrajectoryConsumer, RedisWeightPublisher, open_redis

        if redis_cfg.url is None:
            raise ValueError(
                "redis.url is not set: the trainer joins a running buffer, it never starts one"
            )
        self.retry_s = retry_s
        self.endpoint = open_redis(redis_cfg)
        self.consumer = self._retry(
            lambda: RedisTrajectoryConsumer(self.endpoint.sync_client(), run_id, buffer_cfg),
            "connect",
        )
        self.publisher = RedisWeightPublisher(self.endpoint.sync_client(), run_id, buffer_cfg)
        self._position_floor = 0

    def _retry(self, call: Callable[[], T], what: str) -> T:
        from areal_hex.buffer.errors import BUFFER_ERRORS, is_connection_error

        deadline = time.monotonic() + self.retry_s
        delay = 0.2
        while True:
            try:
                return call()
            except BUFFER_ERRORS as exc:
                if not is_connection_error(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("buffer %s failed (%s); retrying in %.1f s", what, exc, delay)
                time.sleep(delay)
                delay = min(2 * delay, 5.0)

    def get_batch(
        self, n: int, timeout_s: float | None = None, *, version: int | None = None
    ) -> Batch:
        return self._retry(lambda: self.consumer.get_batch(n, timeout_s, version=version), "read")

    def ack(self, entry_ids: Sequence[str]) -> None:
        self._retry(lambda: self.consumer.ack(entry_ids), "ack")

    def version(self) -> int:
        return self._retry(self.consumer.version, "version")

    def stats(self) -> BufferStats:
        return self._retry(self.consumer.stats, "stats")

    def set_version(self, version: int, weights_path: str) -> None:
        self._retry(lambda: self.publisher.set_version(version, weights_path), "publish")

    def restore(self, version: int, weights_path: str) -> None:
        """Resume: version back to the checkpoint's and the admission count recomputed from
        durable state (the gate then admits no more than (v + eta + 1) * B), then tell
        servers to load these weights."""
        floor = self._position_floor
        self._retry(lambda: self.publisher.restore(version, weights_path, floor), "restore")
        self.set_version(version, weights_path)

    def position(self) -> int | None:
        """The controller's data position (admissions ever made), kept in checkpoints: a
        buffer that lost its data resumes the prompt order from it."""
        return self._retry(self.publisher.position, "position")

    def seek(self, position: int) -> None:
        self._position_floor = int(position)  # applied by `restore`

    def close(self) -> None:
        self.consumer.close()
