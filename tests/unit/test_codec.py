from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hex.buffer.codec import (
    ARRAY_ORDER,
    DecodeError,
    decode_group,
    decode_group_with_versions,
    encode_group,
    frame,
    unframe,
)
from areal_hex.record import FINISH_REASONS, SCHEMA_VERSION, Completion, GroupRecord

INT32 = st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(max_size=20)
FINITE = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def completions(draw: st.DrawFn) -> Completion:
    n = draw(st.integers(0, 40))
    return Completion(
        token_ids=np.array(draw(st.lists(INT32, min_size=n, max_size=n)), dtype=np.int32),
        # -inf is a legitimate log-prob (a token outside top-k/top-p); NaN is not.
        logprobs=np.array(
            draw(st.lists(st.floats(allow_nan=False, width=32), min_size=n, max_size=n)),
            dtype=np.float32,
        ),
        versions=np.array(draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n))),
        finish_reason=draw(st.sampled_from(FINISH_REASONS)),
        reward=draw(FINITE),
        text=draw(TEXT),
        server=draw(TEXT),
        gpu_kind=draw(TEXT),
    )


@st.composite
def groups(draw: st.DrawFn) -> GroupRecord:
    return GroupRecord(
        prompt_id=draw(TEXT),
        prompt_ids=np.array(draw(st.lists(INT32, max_size=30)), dtype=np.int32),
        completions=draw(st.lists(completions(), min_size=1, max_size=6)),
        temperature=draw(st.floats(0, 5)),
        created_at=draw(st.floats(0, 2e9)),
        finished_at=draw(st.floats(0, 2e9)),
        metadata=draw(st.dictionaries(TEXT, TEXT, max_size=3)),
    )


def assert_same(a: GroupRecord, b: GroupRecord) -> None:
    assert (a.prompt_id, a.temperature, a.created_at, a.finished_at, a.metadata) == (
        b.prompt_id,
        b.temperature,
        b.created_at,
        b.finished_at,
        b.metadata,
    )
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert len(a.completions) == len(b.completions)
    for x, y in zip(a.completions, b.completions, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
        np.testing.assert_array_equal(x.versions, y.versions)
        assert (x.finish_reason, x.reward, x.text) == (y.finish_reason, y.reward, y.text)
        assert (x.server, x.gpu_kind) == (y.server, y.gpu_kind)
        assert y.token_ids.dtype == np.int32 and y.logprobs.dtype == np.float32
    assert a.version == b.version
    _, oldest, newest = decode_group_with_versions(encode_group(a))
    assert oldest == a.version
    tokens = [int(c.versions.max()) for c in a.completions if len(c.versions)]
    assert newest == max(tokens, default=-1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_round_trip(group: GroupRecord) -> None:
    back = decode_group(encode_group(group))
    assert_same(group, back)
    # Zero-copy views by default; `copy=True` gives writable arrays with the same values.
    assert not any(c.logprobs.flags.writeable for c in back.completions)
    copied = decode_group(encode_group(group), copy=True)
    assert all(c.logprobs.flags.writeable for c in copied.completions)
    assert_same(group, copied)


@settings(max_examples=100, deadline=None)
@given(groups(), st.data())
def test_any_truncation_is_a_decode_error(group: GroupRecord, data: st.DataObject) -> None:
    payload = encode_group(group)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(DecodeError):
        decode_group(payload[:cut])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_raises_anything_but_decode_error(blob: bytes) -> None:
    try:
        decode_group(blob)
    except DecodeError:
        pass


def _group() -> GroupRecord:
    comp = [
        Completion(
            np.arange(5), np.full(5, -0.5), np.full(5, 3), "stop", 1.0, "a", "http://a", "H20"
        ),
        Completion(np.arange(3), np.full(3, -0.25), np.array([2, 3, 3]), "length", 0.0),
    ]
    return GroupRecord("q1", [7, 8, 9], comp, temperature=0.7, metadata={"src": "test"})


def _tamper(arrays: dict[str, tuple[str, np.ndarray]] | None = None, **changes: object) -> bytes:
    """Re-frame `_group()` with header fields changed and/or arrays replaced."""
    header, data = unframe(encode_group(_group()))
    header.update(changes)
    # Current arrays, cut from the data section by the table.
    current, off = {}, 0
    for name, dtype, nbytes in header["arrays"]:
        current[name] = (dtype, bytes(data[off : off + nbytes]))
        off += nbytes
    for name, (dtype, arr) in (arrays or {}).items():
        current[name] = (dtype, arr.tobytes())
    header["arrays"] = [[k, current[k][0], len(current[k][1])] for k in ARRAY_ORDER]
    return frame(header, [current[k][1] for k in ARRAY_ORDER])


def test_group_version_is_oldest_token_and_survives() -> None:
    assert decode_group(encode_group(_group())).version == 2


F4, I4 = "<f4", "<i4"


@pytest.mark.parametrize(
    ("arrays", "changes", "field", "words"),
    [
        (None, {"schema": SCHEMA_VERSION + 1}, "schema", "not supported"),
        (None, {"schema": None}, "schema", "not supported"),
        (None, {"schema": 1}, "schema", "written by an older areal-hex"),
        (None, {"server": ["http://a"]}, "server", "one per completion (2)"),
        (None, {"gpu_kind": ["H20", 3]}, "gpu_kind[1]", "unexpected type int"),
        ({"tokens": (F4, np.zeros(8, F4))}, {}, "tokens", "dtype '<f4', expected '<i4'"),
        ({"logprobs": ("<f8", np.zeros(8, "<f8"))}, {}, "logprobs", "expected '<f4'"),
        ({"tokens": (I4, np.zeros(30, "u1"))}, {}, "tokens", "not a whole number"),
        ({"versions": (I4, np.zeros(7, I4))}, {}, "versions", "sum to 8"),
        (None, {"lens": [5, 4]}, "tokens", "sum to 9"),
        (None, {"finish": ["stop"]}, "finish", "one per completion (2)"),
        (None, {"finish": ["stop", "eos"]}, "finish[1]", "'eos' not in"),
        (None, {"reward": [1.0, float("nan")]}, "reward", "non-finite"),
        (None, {"lens": []}, "lens", "no completions"),
        (None, {"pid": 3}, "pid", "expected str"),
        ({"logprobs": (F4, np.full(8, np.nan, F4))}, {}, "logprobs", "NaN"),
        (None, {"arrays": [["tokens", I4, 32]]}, "arrays", "expected [name, dtype, nbytes]"),
    ],
)
def test_malformed_fields_name_what_is_wrong(
    arrays: dict | None, changes: dict, field: str, words: str
) -> None:
    if "arrays" in changes:  # a broken table cannot be re-framed by _tamper
        header, data = unframe(encode_group(_group()))
        payload = frame({**header, **changes}, [bytes(data)])
    else:
        payload = _tamper(arrays, **changes)
    with pytest.raises(DecodeError) as err:
        decode_group(payload)
    assert err.value.field == field
    assert words in str(err.value)


def test_missing_field_truncation_and_trailing_bytes() -> None:
    header, data = unframe(encode_group(_group()))
    del header["pid"]
    with pytest.raises(DecodeError, match="pid: missing"):
        decode_group(frame(header, [bytes(data)]))
    with pytest.raises(DecodeError, match="header: expected a map"):
        decode_group(frame([1, 2, 3], []))  # type: ignore[arg-type]
    good = encode_group(_group())
    with pytest.raises(DecodeError, match="truncated: arrays declare"):
        decode_group(good[:-7])
    with pytest.raises(DecodeError, match="truncated: header of"):
        decode_group(good[:10])
    with pytest.raises(DecodeError, match="no header length"):
        decode_group(good[:3])
    with pytest.raises(DecodeError, match="trailing bytes"):
        decode_group(good + b"\0\0\0\0")
    with pytest.raises(DecodeError, match="header: corrupt msgpack"):
        decode_group(b"\x02\0\0\0\xc1\xc1")
