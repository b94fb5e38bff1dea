"""A batch `/generate` response read from its bytes gives what reading each result from
its decoded JSON gives, whatever types its per-token values come in."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from rollout_service import wire
from rollout_service.client import _OUTPUTS, generate_result, parse_generate


def result(logprobs: list[Any], versions: list[Any] | None, ids: list[int] | None) -> dict:
    meta: dict[str, Any] = {
        "finish_reason": {"type": "stop", "matched": 2},
        "weight_version": "3",
        "output_token_logprobs": [[lp, 40 + i, None] for i, lp in enumerate(logprobs)],
    }
    if versions is not None:
        meta["output_token_versions"] = versions
    return {"text": "ab", "output_ids": ids, "meta_info": meta}


BODY = [
    result([-0.5, -1e-9, -200.0], ["2", "3", "3"], [40, 41, 42]),  # our server's
    result([-0.5, 0, -1], [2, 3, 3], [40, 41, 42]),  # int versions, int log-probs
    result([-0.5, -0.25, -0.125], ["2", 3, "default"], None),  # mixed; ids from tuples
    result([-0.5, -0.25, -0.125], ["default", "default", "default"], []),
    result([-0.5, -0.25, -0.125], [True, 3, 3], [40, 41, 42]),  # the model reads true as 1
    result([-0.5], None, [40]),  # SGLang's: one version per response
]


def test_a_batch_read_from_bytes_is_each_result_read_from_json() -> None:
    raw = json.dumps(BODY).encode()
    got = [generate_result(o) for o in _OUTPUTS.validate_json(raw)]
    want = [parse_generate(b) for b in json.loads(raw)]
    assert got == want
    assert got[0].token_versions == [2, 3, 3] and got[0].logprobs == [-0.5, -1e-9, -200.0]
    assert got[1].logprobs == [-0.5, 0.0, -1.0]
    assert all(isinstance(x, float) for x in got[1].logprobs)
    assert got[2].token_versions == [2, 3, None] and got[2].output_ids == [40, 41, 42]
    assert got[3].token_versions == [None, None, None]
    assert got[4].token_versions == [1, 3, 3]
    assert got[5].token_versions is None and got[5].weight_version == 3


@pytest.mark.parametrize(
    "body",
    [
        [result([None, -1.0], ["1", "1"], [40, 41])],  # a log-prob that is no number
        [result([-1.0, -1.0], ["1"], [40, 41])],  # versions short of the tokens
        [{"output_ids": [1], "meta_info": {}}],  # no log-probs asked for
        {"error": {"message": "no"}},  # not a list
        "not json",
    ],
)
def test_a_bad_batch_is_refused_either_way(body: Any) -> None:
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    errors = (ValueError, TypeError, pydantic.ValidationError)
    with pytest.raises(errors):
        [generate_result(o) for o in _OUTPUTS.validate_json(raw)]
    if isinstance(body, list):
        with pytest.raises(errors):
            [parse_generate(b) for b in body]


def test_one_result_read_from_bytes() -> None:
    raw = json.dumps(BODY[0]).encode()
    assert generate_result(wire.GenerateOutput.model_validate_json(raw)) == parse_generate(BODY[0])
