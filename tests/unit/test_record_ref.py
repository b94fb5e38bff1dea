"""A completion's optional `ref_logprobs` (π_ref log-probs from the reference task):
through the codec and the replay file, and records without it still decode."""

from __future__ import annotations

import numpy as np
import pytest

from areal_hex.buffer.codec import DecodeError, decode_group, encode_group, frame, unframe
from areal_hex.record import Completion, GroupRecord
from trainer_service.sources import group_from_json, group_to_json


def _group(ref: bool) -> GroupRecord:
    comps = [
        Completion(np.arange(5), np.full(5, -0.5), np.full(5, 3), "stop", 1.0, "a"),
        Completion(np.arange(3), np.full(3, -0.25), np.array([2, 3, 3]), "length", 0.0),
    ]
    if ref:
        comps[0].ref_logprobs = np.linspace(-1, -0.1, 5, dtype=np.float32)
        comps[1].ref_logprobs = np.array([-2.0, -3.0, -4.5], dtype=np.float32)
    return GroupRecord("q1", [7, 8, 9], comps, temperature=0.7)


def test_ref_logprobs_round_trip_per_completion() -> None:
    g = decode_group(encode_group(_group(ref=True)))
    assert g.has_ref_logprobs
    np.testing.assert_allclose(g.completions[0].ref_logprobs, np.linspace(-1, -0.1, 5), rtol=1e-6)
    np.testing.assert_array_equal(g.completions[1].ref_logprobs, [-2.0, -3.0, -4.5])
    assert g.completions[1].ref_logprobs.dtype == np.float32


def test_a_record_without_ref_logprobs_decodes_as_before() -> None:
    payload = encode_group(_group(ref=False))
    header, _ = unframe(payload)
    assert [a[0] for a in header["arrays"]] == ["prompt", "tokens", "logprobs", "versions"]
    g = decode_group(payload)
    assert not g.has_ref_logprobs
    assert all(c.ref_logprobs is None for c in g.completions)


def test_some_completions_scored_is_refused_at_encode() -> None:
    g = _group(ref=True)
    g.completions[1].ref_logprobs = None
    with pytest.raises(ValueError, match="1 of 2 completions have ref_logprobs"):
        encode_group(g)


def test_completion_refuses_ref_logprobs_of_another_length() -> None:
    with pytest.raises(ValueError, match="ref_logprobs=2"):
        Completion(np.arange(3), np.zeros(3), np.zeros(3), "stop", 0.0, ref_logprobs=[0, 0])


def _reframed(ref: np.ndarray, name: str = "ref_logprobs") -> bytes:
    header, data = unframe(encode_group(_group(ref=False)))
    header["arrays"].append([name, "<f4", ref.nbytes])
    return frame(header, [bytes(data), ref.tobytes()])


@pytest.mark.parametrize(
    ("payload", "field", "words"),
    [
        (_reframed(np.full(8, np.nan, "<f4")), "ref_logprobs", "NaN"),
        (_reframed(np.zeros(7, "<f4")), "ref_logprobs", "sum to 8"),
        (_reframed(np.zeros(8, "<f4"), name="critic"), "arrays", "then optionally"),
    ],
)
def test_malformed_ref_logprobs_name_what_is_wrong(payload: bytes, field: str, words: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_group(payload)
    assert err.value.field == field
    assert words in str(err.value)


def test_replay_json_keeps_ref_logprobs_when_present() -> None:
    back = group_from_json(group_to_json(_group(ref=True)), "line 1")
    np.testing.assert_allclose(back.completions[1].ref_logprobs, [-2.0, -3.0, -4.5])
    plain = group_to_json(_group(ref=False))
    assert "ref_logprobs" not in plain["completions"][0]
    assert group_from_json(plain, "line 1").completions[0].ref_logprobs is None
