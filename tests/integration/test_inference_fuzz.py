"""Property test: random JSON (and random values under the real field names) thrown at
every route of the built-in server gets a 2xx or a 4xx, never a 5xx or a dropped
connection, and the server still serves afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import materialize
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(300)
TOKEN = "fuzz"

texts = st.text(max_size=10) | st.sampled_from(["\ud800", "a\udfff", "", "abort", "✓", "0"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(texts, kids, max_size=4),
    max_leaves=10,
)
small = st.integers(min_value=-3, max_value=24)
numbers = small | st.floats(min_value=-3, max_value=3) | st.sampled_from([float("nan"), 1e-7])
plausible = numbers | st.booleans() | texts | st.lists(small, max_size=5) | json_values

SAMPLING_KEYS = [
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim", "n",
    "stream_interval", "regex", "json_schema",
]  # fmt: skip
sampling = st.dictionaries(st.sampled_from(SAMPLING_KEYS), plausible, max_size=6)
ids = st.lists(small, min_size=0, max_size=6)
generate = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": ids | st.lists(ids, max_size=3) | json_values,
        "text": texts | st.lists(texts, max_size=3),
        "sampling_params": sampling | st.lists(sampling, max_size=3) | json_values,
        "return_logprob": st.booleans() | json_values,
        "logprob_start_len": small | st.lists(small, max_size=3),
        "top_logprobs_num": small,
        "return_text_in_logprobs": st.booleans(),
        "rid": texts | st.lists(texts, max_size=3),
        "stream": st.booleans(),
        "image_data": json_values,
    },
)
oai_common = {
    "model": texts,
    "max_tokens": small | st.none(),
    "n": small,
    "temperature": numbers,
    "top_p": numbers,
    "stop": texts | st.lists(texts, max_size=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "logit_bias": st.dictionaries(texts | st.sampled_from(["5", "99999"]), numbers, max_size=2),
    "seed": json_values,
}
completions = st.fixed_dictionaries(
    {},
    optional={
        **oai_common,
        "prompt": texts | ids | st.lists(texts, max_size=2) | st.lists(ids, max_size=2),
        "logprobs": small | st.none(),
        "echo": st.booleans(),
    },
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]) | texts},
    optional={"content": texts | st.lists(st.fixed_dictionaries({"type": texts, "text": texts}))},
)
chat = st.fixed_dictionaries(
    {},
    optional={
        **oai_common,
        "messages": st.lists(message, max_size=3) | json_values,
        "logprobs": st.booleans(),
        "top_logprobs": small,
        "response_format": json_values,
        "chat_template_kwargs": st.dictionaries(texts, json_values, max_size=2),
    },
)
# bodies that are mostly valid, so that generation itself runs with random settings
safe_text = st.text("ab=+1 ", max_size=4)
GOOD_SAMPLING = {
    "max_new_tokens": st.integers(2, 8),
    "min_new_tokens": st.integers(0, 2),
    "temperature": st.sampled_from([0, 1e-7, 0.5, 1.0, 2.0]),
    "top_p": st.sampled_from([0.1, 0.9, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5]),
    "min_p": st.sampled_from([0.0, 0.2]),
    "frequency_penalty": st.sampled_from([-1.0, 0.0, 1.5]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 0.5]),
    "repetition_penalty": st.sampled_from([0.5, 1.0, 1.7]),
    "logit_bias": st.dictionaries(st.sampled_from(["3", "7", "60"]), st.floats(-5, 5), max_size=2),
    "stop": safe_text | st.lists(safe_text, max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 30), max_size=3),
    "ignore_eos": st.booleans(),
    "no_stop_trim": st.booleans(),
    "n": st.integers(1, 3),
    "stream_interval": st.integers(1, 3),
    "regex": st.sampled_from(["[ab]{1,3}", "(", "x*", "[0-9]+"]),
    "ebnf": st.sampled_from(['root ::= "a" | "b"', "root ::="]),
}
good_ids = st.lists(st.integers(1, 60), min_size=1, max_size=8)
good_generate = st.fixed_dictionaries(
    {
        "input_ids": good_ids | st.lists(good_ids, min_size=1, max_size=3),
        "sampling_params": st.fixed_dictionaries(
            {"max_new_tokens": st.integers(2, 8)},
            optional={k: v for k, v in GOOD_SAMPLING.items() if k != "max_new_tokens"},
        ),
    },
    optional={
        "return_logprob": st.booleans(),
        "logprob_start_len": st.sampled_from([-1, 0, 1]),
        "top_logprobs_num": st.sampled_from([0, 2]),
        "return_text_in_logprobs": st.booleans(),
        "stream": st.booleans(),
    },
)
good_oai = {
    "max_tokens": st.integers(2, 8),
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0, 0.7, 1.0]),
    "stop": safe_text,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.sampled_from([0.0, 1.0]),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
}
good_completions = st.fixed_dictionaries(
    {"prompt": st.text("ab=+1 ", min_size=1, max_size=6) | good_ids},
    optional={**good_oai, "logprobs": st.sampled_from([None, 0, 2]), "echo": st.booleans()},
)
good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": safe_text}
)
good_chat = st.fixed_dictionaries(
    {"messages": st.lists(good_message, min_size=1, max_size=2)},
    optional={**good_oai, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 2)},
)
ROUTES: dict[str, Any] = {
    "/generate": st.one_of(generate, good_generate, good_generate, json_values),
    "/v1/completions": st.one_of(completions, good_completions, good_completions, json_values),
    "/v1/chat/completions": st.one_of(chat, good_chat, good_chat, json_values),
    "/update_weights_from_disk": st.fixed_dictionaries(
        {}, optional={"model_path": texts, "weight_version": plausible}
    )
    | json_values,
    "/update_weight_version": st.fixed_dictionaries({}, optional={"new_version": plausible})
    | json_values,
    "/pause_generation": st.fixed_dictionaries({}, optional={"mode": plausible}) | json_values,
    "/continue_generation": json_values,
    "/abort_request": st.fixed_dictionaries({}, optional={"rid": plausible, "abort_all": plausible})
    | json_values,
    "/flush_cache": json_values,
    "/init_weights_update_group": json_values,
    "/update_weights_from_distributed": json_values,
}
GETS = ["/health", "/get_model_info", "/model_info", "/get_server_info", "/get_load", "/v1/models"]
calls = st.one_of(
    *(st.tuples(st.just(path), body) for path, body in ROUTES.items()),
    st.tuples(st.sampled_from(GETS), st.none()),
)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("fuzz")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=0), root / "v0")
    inf = InferenceConfig(
        weights_dir=str(root), api_key=TOKEN, context_length=48, max_running_requests=8
    )
    with ServerThread(build_server_app(ModelConfig(path=str(root / "v0")), inf)) as u:
        yield u


def test_random_json_never_gets_a_5xx(url: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:

        @settings(
            max_examples=120,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(call=calls)
        def check(call: tuple[str, Any]) -> None:
            path, body = call
            if body is None:
                resp = http.get(path)
            else:  # json.dumps writes NaN, Infinity and \ud800 escapes as they are
                resp = http.post(path, content=json.dumps(body).encode())
            assert resp.status_code < 500, (path, body, resp.text[:500])
            if path == "/pause_generation":
                assert http.post("/continue_generation", json={}).status_code == 200

        check()
        # still serving
        assert http.get("/health").status_code == 200
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        ok = http.post("/generate", json=body)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
