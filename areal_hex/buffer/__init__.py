"""The staleness-bounded trajectory buffer: a Redis stream joining rollout and training.

    with open_redis(cfg.redis) as endpoint:          # embedded Valkey unless redis.url is set
        producer = RedisTrajectoryProducer(endpoint.async_client(), run_id, cfg.buffer)
        consumer = RedisTrajectoryConsumer(endpoint.sync_client(), run_id, cfg.buffer)
        publisher = RedisWeightPublisher(endpoint.sync_client(), run_id, cfg.buffer)

See docs/buffer.md for keys, semantics and options.
"""

from __future__ import annotations

from areal_hex.buffer.codec import DecodeError, decode_group, encode_group
from areal_hex.buffer.consumer import (
    RedisTrajectoryConsumer,
    RedisWeightPublisher,
    read_stats,
)
from areal_hex.buffer.embedded import EmbeddedValkey, RedisEndpoint, open_redis
from areal_hex.buffer.keys import GROUP, BufferKeys
from areal_hex.buffer.producer import RedisTrajectoryProducer, VersionUpdate

__all__ = [
    "GROUP",
    "BufferKeys",
    "DecodeError",
    "EmbeddedValkey",
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
