"""Where the trainer's groups come from: the Redis buffer, or a replay file.

The replay source implements the same `TrajectoryConsumer` Protocol as the buffer, so a
recorded run (or a fixed test batch) trains through exactly the same loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from areal_hex.api import Batch, BufferStats, WeightPublisher
from areal_hex.record import Completion, GroupRecord


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

    def get_batch(self, n: int, timeout_s: float | None = None) -> Batch:
        ids, groups = [], []
        for _ in range(n):
            k = self._position % len(self.groups)
            ids.append(f"{self._position // len(self.groups)}-{k}")
            groups.append(self.groups[k])
            self._position += 1
        stal = [max(self._version - g.version, 0) for g in groups]
        return Batch(entry_ids=ids, groups=groups, staleness=stal)

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
            dropped_stale=0,
            dead_letter=0,
            version=self._version,
        )


class BufferSource:
    """The Redis buffer seen by rank 0: the trajectory consumer plus the weight publisher
    (separate clients: publication runs on a background thread)."""

    def __init__(self, redis_cfg: Any, buffer_cfg: Any, run_id: str) -> None:
        from areal_hex.buffer import RedisTrajectoryConsumer, RedisWeightPublisher, open_redis

        if redis_cfg.url is None:
            raise ValueError(
                "redis.url is not set: the trainer joins a running buffer, it never starts one"
            )
        self.endpoint = open_redis(redis_cfg)
        self.consumer = RedisTrajectoryConsumer(self.endpoint.sync_client(), run_id, buffer_cfg)
        self.publisher: WeightPublisher = RedisWeightPublisher(
            self.endpoint.sync_client(), run_id, buffer_cfg
        )

    def get_batch(self, n: int, timeout_s: float | None = None) -> Batch:
        return self.consumer.get_batch(n, timeout_s)

    def ack(self, entry_ids: Sequence[str]) -> None:
        self.consumer.ack(entry_ids)

    def version(self) -> int:
        return self.consumer.version()

    def stats(self) -> BufferStats:
        return self.consumer.stats()

    def set_version(self, version: int, weights_path: str) -> None:
        self.publisher.set_version(version, weights_path)

    def restore(self, version: int, weights_path: str) -> None:
        """Resume: version and admission count back to the checkpoint's (the gate then
        admits no more than (v + eta + 1) * B), then tell servers to load these weights."""
        self.publisher.restore(version, weights_path)
        self.publisher.set_version(version, weights_path)

    def position(self) -> int | None:
        return None  # the buffer's position is what it has acknowledged

    def seek(self, position: int) -> None:
        pass

    def close(self) -> None:
        self.consumer.close()
