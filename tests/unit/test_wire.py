"""Wire models of the inference server and the client's response parsing."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from areal_hex.config import InferenceConfig
from rollout_service.client import parse_generate
from rollout_service.control_wire import PauseReq, UpdateWeightsFromDiskReq
from rollout_service.wire import UNION_TAGS, FinishReason, GenerateReqInput, SamplingParamsIn


def locs(exc: ValidationError) -> list[str]:
    return [".".join(str(p) for p in e["loc"] if p not in UNION_TAGS) for e in exc.errors()]


def test_single_and_batch_requests() -> None:
    one = GenerateReqInput.model_validate({"input_ids": [1, 2], "rid": "x"})
    assert not one.is_batch and one.batch_size() == 1
    prompt, params, logprob, rid = one.item(0)
    assert prompt == [1, 2] and params.max_new_tokens == 128 and not logprob and rid == "x"

    batch = GenerateReqInput.model_validate(
        {
            "input_ids": [[1], [2, 3]],
            "sampling_params": [{"max_new_tokens": 4}, {"temperature": 0}],
            "return_logprob": True,
            "rid": ["a", "b"],
        }
    )
    assert batch.is_batch and batch.batch_size() == 2
    assert batch.item(1)[0] == [2, 3] and batch.item(1)[1].temperature == 0
    assert batch.item(0)[1].max_new_tokens == 4 and batch.item(1)[2] is True
    assert batch.item(1)[3] == "b"

    texts = GenerateReqInput.model_validate({"text": ["a", "b", "c"]})
    assert texts.is_batch and texts.batch_size() == 3

    short = GenerateReqInput.model_validate({"input_ids": [[1], [2]], "rid": ["only-one"]})
    with pytest.raises(ValueError, match="rid: a list of 1 for a batch of 2"):
        short.item(0)


def test_lenient_about_unknown_keys() -> None:
    req = GenerateReqInput.model_validate(
        {
            "input_ids": [1],
            "sampling_params": {"max_new_tokens": 3, "frequency_penalty": 0.5, "json_schema": None},
            "priority": 3,
            "lora_path": None,
            "custom_logit_processor": None,
        }
    )
    assert req.item(0)[1].max_new_tokens == 3
    assert SamplingParamsIn.model_validate({"stop": "\n"}).stop_strings() == ["\n"]
    assert PauseReq.model_validate({}).mode == "abort"
    nulls = SamplingParamsIn.model_validate({"max_new_tokens": None, "temperature": None})
    assert nulls.max_new_tokens == 128 and nulls.temperature == 1.0


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (
            {"input_ids": [1], "sampling_params": {"temperature": -0.1}},
            "sampling_params.temperature",
        ),
        ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": float("inf")}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"min_p": float("nan")}}, "sampling_params.min_p"),
        ({"input_ids": [1], "sampling_params": {"foo": 1}}, "sampling_params.foo"),
        ({"input_ids": [1], "sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
        ({"input_ids": [1], "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": "x"}}, "sampling_seed"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"input_ids": [1], "sampling_params": {"presence_penalty": 3}}, "presence_penalty"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias"),
        (
            {"input_ids": [1], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 4}},
            "sampling_params",
        ),
        ({"input_ids": [1], "image_data": "http://x/y.png"}, "image_data"),
        ({"input_ids": [1], "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "a\ud800"}, "text"),
        ({"input_ids": [1], "rid": "\udfff"}, "rid"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{}, {"min_p": 2}]},
            "sampling_params.1.min_p",
        ),
        ({"input_ids": [1, "x"]}, "input_ids.1"),
    ],
)
def test_bad_values_name_their_field(body: dict, where: str) -> None:
    with pytest.raises(ValidationError) as err:
        GenerateReqInput.model_validate(body)
    assert any(loc.startswith(where) or loc.endswith(where) for loc in locs(err.value))


def test_exactly_one_input() -> None:
    for body in ({}, {"text": "a", "input_ids": [1]}):
        with pytest.raises(ValidationError, match="exactly one of input_ids or text"):
            GenerateReqInput.model_validate(body)
    with pytest.raises(ValidationError):
        UpdateWeightsFromDiskReq.model_validate({"model_path": ""})


def test_finish_reason_wire_shapes() -> None:
    assert FinishReason(type="stop", matched=7).to_wire() == {"type": "stop", "matched": 7}
    assert FinishReason(type="length", length=5).to_wire() == {"type": "length", "length": 5}
    assert FinishReason(type="abort", message="m").to_wire() == {"type": "abort", "message": "m"}


def test_parse_generate_reads_sglang_responses() -> None:
    body = {
        "text": "ab",
        "output_ids": [4, 5],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "abort", "message": "weights updated"},
            "prompt_tokens": 3,
            "weight_version": "2",
            "output_token_logprobs": [[-0.5, 4, None], [-1.25, 5, None]],
        },
    }
    res = parse_generate(body)
    assert res.output_ids == [4, 5] and res.logprobs == [-0.5, -1.25]
    assert res.finish_reason == "abort" and res.weight_version == 2 and res.prompt_tokens == 3
    # a server that omits output_ids: the ids come from the log-prob tuples
    no_ids = {**body, "output_ids": []}
    assert parse_generate(no_ids).output_ids == [4, 5]
    with pytest.raises(ValueError, match="output_token_logprobs"):
        parse_generate({"output_ids": [1], "meta_info": {}})
    bad = {**body, "output_ids": [4]}
    with pytest.raises(ValueError, match="2 log-probs for 1 output tokens"):
        parse_generate(bad)
    assert res.token_versions is None  # SGLang: one version per response


def test_parse_generate_reads_per_token_versions() -> None:
    meta = {
        "finish_reason": {"type": "stop", "matched": 5},
        "weight_version": "3",
        "output_token_logprobs": [[-0.5, 4, None], [-1.0, 5, None]],
        "output_token_versions": ["2", 3],
    }
    res = parse_generate({"output_ids": [4, 5], "meta_info": meta})
    assert res.token_versions == [2, 3] and res.weight_version == 3
    short = {**meta, "output_token_versions": ["3"]}
    with pytest.raises(ValueError, match="1 token versions for 2 output tokens"):
        parse_generate({"output_ids": [4, 5], "meta_info": short})


def test_inference_config_urls() -> None:
    inf = InferenceConfig(host="0.0.0.0", base_port=31000, num_servers=2)
    assert inf.urls() == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    given = InferenceConfig(server_urls=["http://a:1"])
    assert given.urls() == ["http://a:1"]


def test_versions_are_ints_in_python_and_strings_on_the_wire() -> None:
    from rollout_service import wire

    assert wire.version_from_wire("12") == 12 and wire.version_from_wire(3) == 3
    assert wire.version_from_wire("default") is None  # SGLang before any update
    assert wire.version_from_wire(None) is None and wire.version_from_wire(True) is None
    assert wire.version_to_wire(7) == "7"
    body = {
        "output_ids": [4],
        "meta_info": {"weight_version": "default", "output_token_logprobs": [[-0.1, 4, None]]},
    }
    assert parse_generate(body).weight_version is None
