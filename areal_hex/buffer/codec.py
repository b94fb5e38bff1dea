"""Wire format of a `GroupRecord`: one msgpack map whose arrays are raw little-endian numpy
buffers, decoded with validation.

Layout (schema 1). The G completions' per-token arrays are concatenated into one buffer per
kind, so a group of any size costs a fixed number of msgpack objects:

    {"schema": 1, "pid": str, "prompt": [dtype, bytes],          # (P,) int32
     "temp": float, "t0": float, "t1": float, "meta": {str: str},
     "lens": [T_0, ..., T_{G-1}],
     "tokens": [dtype, bytes], "logprobs": [dtype, bytes],        # (sum T,) int32 / float32
     "versions": [dtype, bytes],                                  # (sum T,) int32
     "finish": [str] * G, "reward": [float] * G, "text": [str] * G}

Anything that does not match (wrong schema version, truncated bytes, wrong dtype, lengths
that disagree) raises `DecodeError` naming the field and what was expected: the consumer
moves such entries to the dead-letter stream instead of stopping.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from areal_hex.record import FINISH_REASONS, SCHEMA_VERSION, Completion, GroupRecord

# Expected dtype of every array field (little-endian on the wire, whatever the host is).
DTYPES = {"prompt": "<i4", "tokens": "<i4", "logprobs": "<f4", "versions": "<i4"}


class DecodeError(ValueError):
    """A payload that is not a valid group record; `field` names where it went wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# ---------------------------------------------------------------- encode
def _raw(arr: np.ndarray, dtype: str) -> list[Any]:
    return [dtype, np.ascontiguousarray(arr, dtype=dtype).tobytes()]


def encode_group(group: GroupRecord) -> bytes:
    """Serialise a group; the inverse of `decode_group`."""
    comps = group.completions
    cat = np.concatenate  # completions' token arrays laid end to end: (sum T,)
    body = {
        "schema": group.schema_version,
        "pid": group.prompt_id,
        "prompt": _raw(group.prompt_ids, DTYPES["prompt"]),
        "temp": float(group.temperature),
        "t0": float(group.created_at),
        "t1": float(group.finished_at),
        "meta": dict(group.metadata),
        "lens": [len(c.token_ids) for c in comps],
        "tokens": _raw(cat([c.token_ids for c in comps]), DTYPES["tokens"]),
        "logprobs": _raw(cat([c.logprobs for c in comps]), DTYPES["logprobs"]),
        "versions": _raw(cat([c.versions for c in comps]), DTYPES["versions"]),
        "finish": [c.finish_reason for c in comps],
        "reward": [float(c.reward) for c in comps],
        "text": [c.text for c in comps],
    }
    return msgpack.packb(body, use_bin_type=True)


# ---------------------------------------------------------------- decode
def _get(body: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    if key not in body:
        raise DecodeError(key, "missing")
    value = body[key]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        names = "/".join(t.__name__ for t in _as_tuple(types))
        raise DecodeError(key, f"expected {names}, got {type(value).__name__}")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _array(body: dict[str, Any], key: str) -> np.ndarray:
    """A `[dtype, bytes]` pair → a writable 1-D array, after checking dtype and size."""
    pair = _get(body, key, list)
    if len(pair) != 2 or not isinstance(pair[0], str) or not isinstance(pair[1], bytes):
        raise DecodeError(key, "expected [dtype, bytes]")
    dtype, raw = pair
    if dtype != DTYPES[key]:
        raise DecodeError(key, f"dtype {dtype!r}, expected {DTYPES[key]!r}")
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise DecodeError(key, f"{len(raw)} bytes is not a whole number of {dtype!r} items")
    # Copy once so the arrays are writable (torch.from_numpy warns on read-only buffers).
    return np.frombuffer(raw, dtype=dtype).astype(dtype.lstrip("<"), copy=True)


def _list_of(body: dict[str, Any], key: str, types: type | tuple[type, ...], n: int) -> list:
    items = _get(body, key, list)
    if len(items) != n:
        raise DecodeError(key, f"{len(items)} entries, expected one per completion ({n})")
    for i, item in enumerate(items):
        if not isinstance(item, types) or isinstance(item, bool):
            raise DecodeError(f"{key}[{i}]", f"unexpected type {type(item).__name__}")
    return items


def _unpack(payload: bytes) -> dict[str, Any]:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError("payload", f"expected bytes, got {type(payload).__name__}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for truncated/corrupt input
        raise DecodeError(
            "payload", f"truncated or corrupt msgpack ({len(payload)} bytes): {exc}"
        ) from None
    if not isinstance(body, dict):
        raise DecodeError("payload", f"expected a map, got {type(body).__name__}")
    return body


def _check_schema(body: dict[str, Any]) -> None:
    schema = body.get("schema")
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        raise DecodeError("schema", f"version {schema!r} not supported (expected {SCHEMA_VERSION})")


def decode_group(payload: bytes) -> GroupRecord:
    """Parse and validate one payload; raises `DecodeError` on any mismatch."""
    return decode_group_with_version(payload)[0]


def decode_group_with_version(payload: bytes) -> tuple[GroupRecord, int]:
    """`decode_group` plus the group's version (oldest token version, -1 without tokens),
    taken in one reduction over the concatenated (sum T,) versions."""
    body = _unpack(payload)
    _check_schema(body)
    lens = _get(body, "lens", list)
    if not lens:
        raise DecodeError("lens", "group has no completions")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in lens):
        raise DecodeError("lens", "expected non-negative integers")
    total, g = sum(lens), len(lens)
    arrays = {k: _array(body, k) for k in ("tokens", "logprobs", "versions")}
    for key, arr in arrays.items():
        if len(arr) != total:
            raise DecodeError(key, f"{len(arr)} items, but completion lengths sum to {total}")
    if np.isnan(arrays["logprobs"]).any():
        raise DecodeError("logprobs", "contains NaN")
    finish = _list_of(body, "finish", str, g)
    for i, reason in enumerate(finish):
        if reason not in FINISH_REASONS:
            raise DecodeError(f"finish[{i}]", f"{reason!r} not in {FINISH_REASONS}")
    rewards = _list_of(body, "reward", (int, float), g)
    if not all(math.isfinite(r) for r in rewards):
        raise DecodeError("reward", "contains a non-finite reward")
    texts = _list_of(body, "text", str, g)
    meta = _get(body, "meta", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise DecodeError("meta", "expected a map of str to str")
    # Split the concatenated (sum T,) buffers back into per-completion (T_i,) views.
    tokens, logprobs, versions = arrays["tokens"], arrays["logprobs"], arrays["versions"]
    comps, lo = [], 0
    for i, t in enumerate(lens):
        hi = lo + t
        comps.append(
            Completion(
                token_ids=tokens[lo:hi],
                logprobs=logprobs[lo:hi],
                versions=versions[lo:hi],
                finish_reason=finish[i],
                reward=float(rewards[i]),
                text=texts[i],
            )
        )
        lo = hi
    group = GroupRecord(
        prompt_id=_get(body, "pid", str),
        prompt_ids=_array(body, "prompt"),
        completions=comps,
        temperature=float(_get(body, "temp", (int, float))),
        created_at=float(_get(body, "t0", (int, float))),
        finished_at=float(_get(body, "t1", (int, float))),
        metadata=meta,
        schema_version=SCHEMA_VERSION,
    )
    return group, int(versions.min()) if len(versions) else -1
