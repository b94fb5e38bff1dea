"""Wire format of a `GroupRecord`: a small msgpack header followed by raw little-endian
numpy buffers, decoded with validation.

Layout (schema 2):

    u32 (little-endian) H | H bytes: msgpack header | array data

    header = {"schema": 2, "pid": str, "temp": float, "t0": float, "t1": float,
              "meta": {str: str}, "lens": [T_0, ..., T_{G-1}],
              "finish": [str] * G, "reward": [float] * G, "text": [str] * G,
              "server": [str] * G, "gpu_kind": [str] * G,
              "arrays": [["prompt", "<i4", nbytes],       # (P,) prompt token ids
                         ["tokens", "<i4", nbytes],       # (sum T,) all completions' tokens
                         ["logprobs", "<f4", nbytes],     # (sum T,) behaviour log-probs
                         ["versions", "<i4", nbytes],     # (sum T,) policy version per token
                         ["ref_logprobs", "<f4", nbytes]]} # optional: (sum T,) π_ref log-probs

The G completions' per-token arrays are laid end to end, so a group of any size is a fixed
number of objects, and the arrays never pass through msgpack: encoding writes each array
once into the payload, decoding slices read-only views out of it (or, asked to, out of
one writable copy). Anything that does not match (wrong schema version, truncated bytes, wrong
dtype, lengths that disagree) raises `DecodeError` naming the field and what was expected:
the consumer moves such entries to the dead-letter stream instead of stopping.

`ref_logprobs` is written only when every completion has them (scored by the workflow's
reference task); a record without it, as every record written before it existed, decodes
as before with `Completion.ref_logprobs` None.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import numpy as np

from areal_hex.record import FINISH_REASONS, SCHEMA_VERSION, Completion, GroupRecord

# Expected dtype of every array field (little-endian on the wire, whatever the host is).
DTYPES = {
    "prompt": "<i4",
    "tokens": "<i4",
    "logprobs": "<f4",
    "versions": "<i4",
    "ref_logprobs": "<f4",
}
ITEMSIZE = {name: np.dtype(dt).itemsize for name, dt in DTYPES.items()}
# The same as dtype objects: numpy parses a dtype string on every call that is given one.
_DT = {name: np.dtype(dt) for name, dt in DTYPES.items()}
# Reductions as ufunc methods: ndarray.min/max add a Python-level wrapper per call.
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce
_FINISH = frozenset(FINISH_REASONS)


class DecodeError(ValueError):
    """A payload that is not a valid group record; `field` names where it went wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


ARRAY_ORDER = ("prompt", "tokens", "logprobs", "versions")
OPTIONAL_ARRAYS = ("ref_logprobs",)  # after ARRAY_ORDER, in this order, each when present
_LEN = struct.Struct("<I")  # header length prefix


# ---------------------------------------------------------------- framing
def frame(header: dict[str, Any], data: list[Any]) -> bytes:
    """Length-prefixed msgpack header + the concatenation of `data` (bytes-like objects)."""
    return b"".join([_head(header), *data])


def _head(header: dict[str, Any]) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return _LEN.pack(len(head)) + head


def unframe(payload: bytes) -> tuple[dict[str, Any], memoryview]:
    """Split a payload into its header map and its array data section (no copy)."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError("payload", f"expected bytes, got {type(payload).__name__}")
    view = memoryview(payload)
    if len(view) < _LEN.size:
        raise DecodeError("payload", f"truncated: {len(view)} bytes, no header length")
    (hlen,) = _LEN.unpack_from(view)
    if hlen > len(view) - _LEN.size:
        raise DecodeError(
            "payload", f"truncated: header of {hlen} bytes declared, {len(view) - 4} follow"
        )
    try:
        header = msgpack.unpackb(view[_LEN.size : _LEN.size + hlen], raw=False)
    except Exception as exc:  # msgpack raises several types for corrupt input
        raise DecodeError("header", f"corrupt msgpack ({hlen} bytes): {exc}") from None
    if not isinstance(header, dict):
        raise DecodeError("header", f"expected a map, got {type(header).__name__}")
    return header, view[_LEN.size + hlen :]


# ---------------------------------------------------------------- encode
def _le(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(arr, dtype=dtype)  # no copy when already right


def encode_group(group: GroupRecord) -> bytes:
    """Serialise a group; the inverse of `decode_group`."""
    return b"".join(encode_group_parts(group)[1])


def encode_group_parts(group: GroupRecord) -> tuple[int, list[Any]]:
    """`encode_group` as buffers to write one after the other (the header, then each
    array as it is) and their total length: a writer that sends them in turn copies the
    arrays once, into its socket, instead of first into one payload."""
    comps = group.completions
    prompt = _le(group.prompt_ids, _DT["prompt"])
    tokens = [_le(c.token_ids, _DT["tokens"]) for c in comps]
    logprobs = [_le(c.logprobs, _DT["logprobs"]) for c in comps]
    versions = [_le(c.versions, _DT["versions"]) for c in comps]
    refs = _ref_arrays(group)
    lens = [len(t) for t in tokens]
    total = sum(lens)  # each per-token array holds sum T items
    per_token = list(ARRAY_ORDER[1:]) + (["ref_logprobs"] if refs else [])
    header = {
        "schema": group.schema_version,
        "pid": group.prompt_id,
        "temp": float(group.temperature),
        "t0": float(group.created_at),
        "t1": float(group.finished_at),
        "meta": dict(group.metadata),
        "lens": lens,
        "finish": [c.finish_reason for c in comps],
        "reward": [float(c.reward) for c in comps],
        "text": [c.text for c in comps],
        "server": [c.server for c in comps],
        "gpu_kind": [c.gpu_kind for c in comps],
        "arrays": [
            ["prompt", DTYPES["prompt"], prompt.nbytes],
            *([k, DTYPES[k], total * ITEMSIZE[k]] for k in per_token),
        ],
    }
    head = _head(header)
    nbytes = len(head) + prompt.nbytes + total * sum(ITEMSIZE[k] for k in per_token)
    return nbytes, [head, prompt, *tokens, *logprobs, *versions, *refs]


def _ref_arrays(group: GroupRecord) -> list[np.ndarray]:
    """Each completion's `ref_logprobs`, or [] when none has them; some but not all is a
    caller's error (a group is scored whole)."""
    have = [c.ref_logprobs is not None for c in group.completions]
    if not any(have):
        return []
    if not all(have):
        raise ValueError(
            f"group {group.prompt_id!r}: {sum(have)} of {len(have)} completions have "
            "ref_logprobs: expected all or none"
        )
    return [_le(c.ref_logprobs, _DT["ref_logprobs"]) for c in group.completions]


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


def _arrays(header: dict[str, Any], data: memoryview, copy: bool) -> dict[str, np.ndarray]:
    """Check the array table against the data section, then cut 1-D arrays from it: views
    of the payload (read-only, no copy) or, with `copy`, of one writable copy."""
    table = _get(header, "arrays", list)
    names = [e[0] if isinstance(e, list) and e else None for e in table]
    required, optional = len(ARRAY_ORDER), list(OPTIONAL_ARRAYS)
    known = (
        names[:required] == list(ARRAY_ORDER)
        and names[required:] == optional[: len(names) - required]
    )
    if not known or not all(len(e) == 3 for e in table):
        raise DecodeError(
            "arrays",
            f"expected [name, dtype, nbytes] for {list(ARRAY_ORDER)}, then optionally {optional}",
        )
    declared = 0
    for name, dtype, nbytes in table:
        if dtype != DTYPES[name]:
            raise DecodeError(name, f"dtype {dtype!r}, expected {DTYPES[name]!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise DecodeError(name, f"byte count {nbytes!r} is not a non-negative integer")
        if nbytes % ITEMSIZE[name]:
            raise DecodeError(name, f"{nbytes} bytes is not a whole number of {dtype!r} items")
        declared += nbytes
    if declared != len(data):
        what = "truncated" if declared > len(data) else "trailing bytes"
        raise DecodeError("payload", f"{what}: arrays declare {declared} bytes, got {len(data)}")
    buf, out, off = (bytearray(data) if copy else data), {}, 0
    for name, _dtype, nbytes in table:
        count = nbytes // ITEMSIZE[name]
        out[name] = np.frombuffer(buf, dtype=_DT[name], count=count, offset=off)
        off += nbytes
    return out


def _list_of(body: dict[str, Any], key: str, types: tuple[type, ...], n: int) -> list:
    items = _get(body, key, list)
    if len(items) != n:
        raise DecodeError(key, f"{len(items)} entries, expected one per completion ({n})")
    # `type(x) in types` (not isinstance): rejects bools where numbers are expected.
    if not all(type(item) in types for item in items):
        i, item = next((i, x) for i, x in enumerate(items) if type(x) not in types)
        raise DecodeError(f"{key}[{i}]", f"unexpected type {type(item).__name__}")
    return items


def _check_schema(body: dict[str, Any]) -> None:
    schema = body.get("schema")
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        older = type(schema) is int and 0 < schema < SCHEMA_VERSION
        hint = " (written by an older areal-hex: drain or reset its buffer)" if older else ""
        raise DecodeError(
            "schema", f"version {schema!r} not supported (expected {SCHEMA_VERSION}){hint}"
        )


def decode_group(payload: bytes, copy: bool = False) -> GroupRecord:
    """Parse and validate one payload; raises `DecodeError` on any mismatch.

    The arrays are read-only views of `payload` (zero copy) unless `copy` is set; batching
    code that concatenates or pads them copies anyway (`np.concatenate`, `torch.tensor`)."""
    return decode_group_with_versions(payload, copy)[0]


def decode_group_with_versions(payload: bytes, copy: bool = False) -> tuple[GroupRecord, int, int]:
    """`decode_group` plus the group's oldest and newest token versions (-1 and -1 without
    tokens), each one reduction over the concatenated (sum T,) versions: the consumer's
    staleness checks need both, and per-completion reductions would cost G of each."""
    body, data = unframe(payload)
    _check_schema(body)
    lens = _get(body, "lens", list)
    if not lens:
        raise DecodeError("lens", "group has no completions")
    if not all(type(t) is int and t >= 0 for t in lens):
        raise DecodeError("lens", "expected non-negative integers")
    total, g = sum(lens), len(lens)
    arrays = _arrays(body, data, copy)
    for key in ("tokens", "logprobs", "versions", *(k for k in OPTIONAL_ARRAYS if k in arrays)):
        if len(arrays[key]) != total:
            n = len(arrays[key])
            raise DecodeError(key, f"{n} items, but completion lengths sum to {total}")
    # One reduction finds any NaN: the minimum of an array holding a NaN is NaN (and
    # infinite log-probs, allowed, never make one).
    for key in ("logprobs", "ref_logprobs"):
        if total and key in arrays and np.isnan(_MIN(arrays[key])):
            raise DecodeError(key, "contains NaN")
    finish = _list_of(body, "finish", (str,), g)
    if not _FINISH.issuperset(finish):
        i, reason = next((i, r) for i, r in enumerate(finish) if r not in _FINISH)
        raise DecodeError(f"finish[{i}]", f"{reason!r} not in {FINISH_REASONS}")
    rewards = _list_of(body, "reward", (int, float), g)
    if not all(map(math.isfinite, rewards)):
        raise DecodeError("reward", "contains a non-finite reward")
    texts = _list_of(body, "text", (str,), g)
    servers = _list_of(body, "server", (str,), g)
    kinds = _list_of(body, "gpu_kind", (str,), g)
    meta = _get(body, "meta", dict)
    if not all(type(k) is str and type(v) is str for k, v in meta.items()):
        raise DecodeError("meta", "expected a map of str to str")
    # Split the concatenated (sum T,) buffers back into per-completion (T_i,) views.
    tokens, logprobs, versions = arrays["tokens"], arrays["logprobs"], arrays["versions"]
    refs = arrays.get("ref_logprobs")
    comps, lo = [], 0
    checked = Completion.from_checked
    for t, reason, reward, text, server, kind in zip(
        lens, finish, rewards, texts, servers, kinds, strict=True
    ):
        hi = lo + t
        arrays_i = tokens[lo:hi], logprobs[lo:hi], versions[lo:hi]
        ref = None if refs is None else refs[lo:hi]
        comps.append(checked(*arrays_i, reason, float(reward), text, server, kind, ref))
        lo = hi
    group = GroupRecord.from_checked(
        prompt_id=_get(body, "pid", str),
        prompt_ids=arrays["prompt"],
        completions=comps,
        temperature=float(_get(body, "temp", (int, float))),
        created_at=float(_get(body, "t0", (int, float))),
        finished_at=float(_get(body, "t1", (int, float))),
        metadata=meta,
    )
    if not total:
        return group, -1, -1
    return group, int(_MIN(versions)), int(_MAX(versions))
