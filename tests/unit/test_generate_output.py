"""`/generate`'s response objects, built as dicts on the hot path, are exactly what the
wire model (`wire.GenerateOutput(...).to_wire()`) gives for the same fields: the same
keys in the same order, the same values; and the client reads them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from areal_hex.models import build_tokenizer
from rollout_service import wire
from rollout_service.client import parse_generate
from rollout_service.server.generate_routes import _Item, _output
from rollout_service.server.requests import GenRequest, LogprobSpec

ENGINE = SimpleNamespace(tokenizer=build_tokenizer(), weight_version="5")


def finished(stop: bool) -> GenRequest:
    req = GenRequest(rid="g-1", prompt=[30, 31, 32, 33], sampling=wire.SamplingParamsIn())
    req.output_ids = [40, 41, 42, 2]
    req.logprobs = [-0.5, -1e-9, -200.0, -0.25]
    req.versions = ["4", "4", "5", "5"]
    req.output_top = [[(-0.5, 40), (-1.0, 7)] for _ in req.output_ids]
    req.input_logprobs = [None, -1.5, -2.5]
    req.input_top = [None, [(-1.5, 32)], [(-2.5, 33)]]
    req.finish = (
        wire.FinishReason(type="stop", matched=2)
        if stop
        else wire.FinishReason(type="length", length=4)
    )
    req.weight_version, req.retractions = "5", 1
    return req


@pytest.mark.parametrize(
    "item",
    [
        _Item([30, 31, 32, 33], wire.SamplingParamsIn(), False, "g-1"),
        _Item([30, 31, 32, 33], wire.SamplingParamsIn(), True, "g-1"),
        _Item([30, 31, 32, 33], wire.SamplingParamsIn(), True, "g-1", LogprobSpec(1, 2), True),
    ],
    ids=["plain", "logprobs", "prompt-and-top-logprobs-with-text"],
)
@pytest.mark.parametrize("stop", [True, False])
def test_output_is_the_wire_models_dump(item: _Item, stop: bool) -> None:
    req = finished(stop)
    for upto in (None, 2):  # final, and a streaming chunk
        out: dict[str, Any] = _output(ENGINE, item, req, upto)  # type: ignore[arg-type]
        model = wire.GenerateOutput.model_validate(out)
        assert model.to_wire() == out
        assert list(model.to_wire()["meta_info"]) == list(out["meta_info"])
        assert list(out["meta_info"]) == [
            f for f in wire.MetaInfo.model_fields if f in out["meta_info"]
        ]
    final = _output(ENGINE, item, req)  # type: ignore[arg-type]
    assert final["output_ids"] == req.output_ids and final["text"] == ENGINE.tokenizer.decode(
        req.output_ids[:-1] if stop else req.output_ids, skip_special_tokens=True
    )
    if item.logprob:
        got = parse_generate(final)
        assert got.logprobs == [-0.5, -1e-9, max(-200.0, wire.LOGPROB_FLOOR), -0.25]
        assert got.token_versions == [4, 4, 5, 5] and got.weight_version == 5
