"""The staleness-bounded trajectory buffer: a Redis stream joining rollout and training.

    with open_redis(cfg.redis) as endpoint:          # embedded Valkey unless redis.url is set
        producer = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg.buffer)
        consumer = RedisTrajectoryConsumer(endpoint.sync_client(), run_id, cfg.buffer)
        publisher = RedisWeightPublisher(endpoint.sync_client(), run_id, cfg.buffer)

See docs/buffer.md for keys, semantics and options. Names are imported on first use, so
importing a submodule (e.g. the benchmark, for the CLI's parser) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BUFFER_ERRORS": "errors",
    "is_connection_error": "errors",
    "DecodeError": "codec",
    "decode_group": "codec",
    "encode_group": "codec",
    "RedisTrajectoryConsumer": "consumer",
    "RedisWeightPublisher": "consumer",
    "read_stats": "consumer",
    "EmbeddedValkey": "embedded",
    "RedisEndpoint": "embedded",
    "open_redis": "embedded",
    "GROUP": "keys",
    "BufferKeys": "keys",
    "RedisTrajectoryProducer": "producer",
    "VersionUpdate": "producer",
}

__all__ = [
    "BUFFER_ERRORS",
    "is_connection_error",
    "BufferKeys",
    "DecodeError",
    "EmbeddedValkey",
    "GROUP",
    "RedisEndpoint",
    "RedisTrajectoryConsumer",
    "RedisTrajectoryProducer",
    "RedisWeightPublisher",
    "VersionUpdate",
    "decode_group",
    "encode_group",
    "open_redis",
    "read_stats",
]

if TYPE_CHECKING:
    from areal_hex.buffer.codec import DecodeError, decode_group, encode_group
    from areal_hex.buffer.consumer import (
        RedisTrajectoryConsumer,
        RedisWeightPublisher,
        read_stats,
    )
    from areal_hex.buffer.embedded import EmbeddedValkey, RedisEndpoint, open_redis
    from areal_hex.buffer.errors import BUFFER_ERRORS, is_connection_error
    from areal_hex.buffer.keys import GROUP, BufferKeys
    from areal_hex.buffer.producer import RedisTrajectoryProducer, VersionUpdate


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_hex.buffer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"areal_hex.buffer.{module}"), name)
