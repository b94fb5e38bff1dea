"""The reward-model server's /classify: SGLang's request shape (EmbeddingReqInput: text
or input_ids, one or a batch, rid) and response shape (`{"embedding": [score],
"meta_info": {...}}`, a list for a batch), scores equal to the model's own forward, and
clear 400s."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from areal_hex.config import TinyModelConfig
from areal_hex.models import build_tokenizer
from areal_hex.reward_model import build_tiny_reward_model
from rollout_service.classify_wire import read_answers
from rollout_service.server.app import ServerSettings
from rollout_service.server.classifier import Classifier
from rollout_service.server.classify_routes import create_reward_app

TINY = TinyModelConfig(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2)


@pytest.fixture(scope="module")
def parts() -> tuple:
    tok = build_tokenizer()
    model = build_tiny_reward_model(TINY, tok, seed=3).eval()
    with torch.no_grad():  # a score head that is not ~0 everywhere
        model.score.weight.normal_(0, 1.0)
    return model, tok


@pytest.fixture()
def client(parts: tuple) -> TestClient:
    model, tok = parts
    clf = Classifier(model, tok, "tiny-rm", weight_version="7", max_batch=2)
    app = create_reward_app(clf, ServerSettings(api_key="k", tokenizer_path="tiny-rm"))
    with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
        yield c


def own_score(parts: tuple, text: str) -> float:
    model, tok = parts
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def test_one_text_answers_one_object_in_sglang_shape(client: TestClient, parts: tuple) -> None:
    r = client.post("/classify", json={"text": "What is 2 + 3?\n#### 5", "rid": "a"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"embedding", "meta_info"}
    meta = body["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "weight_version", "e2e_latency"} <= set(meta)
    assert "completion_tokens" not in meta  # SGLang's embedding meta_info has none
    assert meta["id"] == "a" and meta["weight_version"] == "7"
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len("What is 2 + 3?\n#### 5")
    assert len(body["embedding"]) == 1
    expected = own_score(parts, "What is 2 + 3?\n#### 5")
    assert body["embedding"][0] == pytest.approx(expected, abs=1e-5)


def test_a_batch_answers_a_list_in_input_order(client: TestClient, parts: tuple) -> None:
    texts = ["1 + 1 = 2\n#### 2", "1 + 1 = 3", "x", "19 + 19 = 38\n#### 38", "#### 0"]
    r = client.post("/classify", json={"text": texts, "rid": list("abcde")})
    assert r.status_code == 200, r.text
    answers = read_answers(r.json(), len(texts))  # max_batch 2: three forwards, padded
    assert [a.meta_info.id for a in answers] == list("abcde")
    for a, t in zip(answers, texts, strict=True):
        assert a.score == pytest.approx(own_score(parts, t), abs=1e-5)
    assert len({round(a.score, 6) for a in answers}) > 1


def test_input_ids_and_the_encode_route(client: TestClient, parts: tuple) -> None:
    _, tok = parts
    ids = tok("1 + 2 = 3", add_special_tokens=False)["input_ids"]
    one = client.post("/encode", json={"input_ids": ids}).json()
    batch = client.put("/classify", json={"input_ids": [ids, ids[:3]]}).json()
    assert isinstance(one, dict) and isinstance(batch, list) and len(batch) == 2
    assert one["embedding"][0] == pytest.approx(own_score(parts, "1 + 2 = 3"), abs=1e-5)
    assert batch[0]["embedding"] == pytest.approx(one["embedding"], abs=1e-5)
    assert batch[1]["meta_info"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({}, "exactly one of text or input_ids"),
        ({"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
        ({"text": []}, "empty batch"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"input_ids": [10**6]}, "outside the vocabulary"),
        ({"input_ids": [[]]}, "empty"),
        ({"text": "a" * 600}, "exceed the context length"),
        ({"text": "a", "image_data": "x.png"}, "image_data"),
    ],
)
def test_bad_requests_are_400s_that_say_why(client: TestClient, body: dict, says: str) -> None:
    r = client.post("/classify", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_generation_refused_info_health_token(client: TestClient) -> None:
    r = client.post("/generate", json={"text": "hi"})
    assert r.status_code == 400 and "/classify" in r.json()["error"]["message"]
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is False and info["num_labels"] == 1
    assert client.get("/get_server_info").json()["is_embedding"] is True
    assert client.get("/health_generate").status_code == 200
    assert "areal_hex_classify_inputs_total" in client.get("/metrics").text
    anon = client.post("/classify", json={"text": "a"}, headers={"Authorization": ""})
    assert anon.status_code == 401


def test_the_rm_flag_reaches_sglang(tmp_path: Path) -> None:
    from areal_hex.config import InferenceConfig, ModelConfig
    from rollout_service.server.sglang_launcher import launch_command

    cmd = launch_command(ModelConfig(path=str(tmp_path)), InferenceConfig(), 31000, "py", True)
    assert "--is-embedding" in cmd
    assert "--is-embedding" not in launch_command(ModelConfig(path="m"), InferenceConfig(), 1, "py")
