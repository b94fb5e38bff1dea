"""The OpenAI-compatible routes of the built-in server, driven by the real `openai`
Python client: models list, completions and chat (plain, n, logprobs, streaming,
stop), usage, errors and auth."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import load_model, load_tokenizer, materialize
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(180)
TOKEN = "oai-token"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("oai")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=5), root / "v0")
    return root


@pytest.fixture(scope="module")
def server(weights: Path) -> Any:
    inf = InferenceConfig(weights_dir=str(weights), api_key=TOKEN, context_length=256)
    with ServerThread(build_server_app(ModelConfig(path=str(weights / "v0")), inf)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(weights: Path) -> Any:
    return load_tokenizer(weights / "v0")


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_list(client: openai.OpenAI, weights: Path) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == str(weights / "v0")
    assert models[0].object == "model"


def test_completions(client: openai.OpenAI, weights: Path, tok: Any) -> None:
    name = model_id(client)
    res = client.completions.create(model=name, prompt="3+4=", max_tokens=5, temperature=0)
    choice = res.choices[0]
    assert res.object == "text_completion" and choice.index == 0
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = tok.encode("3+4=", add_special_tokens=False)
    assert res.usage is not None and res.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= res.usage.completion_tokens <= 5
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens

    # logprobs against one plain forward of the same weights (greedy: T = 1)
    many = client.completions.create(
        model=name,
        prompt=["3+4=", "ab"],
        max_tokens=6,
        temperature=0,
        n=2,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy twice
    model = load_model(weights / "v0", "cpu", "float32")
    for c, prompt in zip(many.choices, ["3+4=", "3+4=", "ab", "ab"], strict=True):
        lp = c.logprobs
        assert lp is not None and len(lp.tokens) == 6 and "".join(lp.tokens) == c.text
        ids = tok.encode(prompt + c.text, add_special_tokens=False)
        n = len(tok.encode(prompt, add_special_tokens=False))
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, n - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[n:])[:, None]).squeeze(1)
        assert lp.token_logprobs == pytest.approx(ref.tolist(), abs=1e-4)
        assert all(len(t) == 2 for t in lp.top_logprobs)
        assert lp.text_offset[0] == 0

    # stop strings are trimmed from the text, as SGLang does
    free = client.completions.create(
        model=name, prompt="x", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    word = free.choices[0].text[2:4]
    stopped = client.completions.create(
        model=name, prompt="x", max_tokens=8, temperature=0, stop=[word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free.choices[0].text[: free.choices[0].text.index(word)]

    # echo + logprobs + max_tokens 0: prompt scoring (what lm-eval's loglikelihood does)
    scored = client.completions.create(
        model=name, prompt="hello", max_tokens=0, echo=True, logprobs=0
    )
    c = scored.choices[0]
    assert c.text == "hello" and c.logprobs is not None
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == 5


def test_completion_streaming(client: openai.OpenAI) -> None:
    name = model_id(client)
    whole = client.completions.create(
        model=name, prompt="q", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=name,
            prompt="q",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat(client: openai.OpenAI, tok: Any) -> None:
    name = model_id(client)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
    ]
    res = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
    msg = res.choices[0].message
    assert res.object == "chat.completion" and msg.role == "assistant"
    assert isinstance(msg.content, str)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert res.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))

    group = client.chat.completions.create(
        model=name,
        messages=messages,
        max_tokens=5,
        n=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in group.choices] == [0, 1, 2]
    assert group.usage.completion_tokens == 15
    for c in group.choices:
        content = c.logprobs.content
        text = "".join(t.token for t in content if t.token not in tok.all_special_tokens)
        assert len(content) == 5 and text == c.message.content  # content skips specials
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert bytes(t.bytes).decode() == t.token


def test_chat_streaming(client: openai.OpenAI) -> None:
    name = model_id(client)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    whole = client.chat.completions.create(
        model=name, messages=messages, max_tokens=8, temperature=0, n=2
    )
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=8,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content
        assert mine[-1].finish_reason == whole.choices[i].finish_reason
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_structured_output(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 30]}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    res = client.chat.completions.create(
        model=model_id(client),
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=100,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    )
    for c in res.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)
    digits = client.completions.create(
        model=model_id(client), prompt="id:", max_tokens=10, extra_body={"regex": "[0-9]{4}"}
    )
    assert re.fullmatch("[0-9]{4}", digits.choices[0].text)


def test_errors_and_auth(server: str, client: openai.OpenAI) -> None:
    name = model_id(client)
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
    cases = [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"extra_body": {"regex": "("}}, "regex"),
        ({"n": 0}, "n"),
        ({"max_tokens": 10_000}, "context length"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"json_schema": "{}"}},
            "not both",
        ),
    ]
    for kwargs, word in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "x"}],
                **kwargs,  # type: ignore[arg-type]
            )
        assert word in str(err.value), (kwargs, str(err.value))
        # OpenAI's error object: the SDK reads type, param and code from it
        assert err.value.type == "invalid_request_error" and err.value.code is None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], n=0)
    assert err.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=name, prompt="a", suffix="b")
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=name, messages=[])
