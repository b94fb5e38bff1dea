"""Token, weight-path and input checks of the built-in server over real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import materialize
from rollout_service.client import GenerationError, InferenceClient
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("sec")
    weights = base / "weights"
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=0), weights / "v0")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=1), base / "outside")
    (weights / "escape").symlink_to(base / "outside")  # a link out of weights_dir
    inf = InferenceConfig(weights_dir=str(weights), api_key=TOKEN, context_length=64)
    app = build_server_app(ModelConfig(path=str(weights / "v0")), inf)
    with ServerThread(app) as url:
        yield url, weights


def post(url: str, path: str, body: Any, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}


def test_token_required_except_health_and_metrics(server: Any) -> None:
    url, _ = server
    for path, body in [
        ("/generate", GEN),
        ("/update_weights_from_disk", {"model_path": "x"}),
        ("/pause_generation", {}),
        ("/continue_generation", {}),
        ("/abort_request", {"abort_all": True}),
    ]:
        assert post(url, path, body, token=None).status_code == 401, path
        assert post(url, path, body, token="wrong").status_code == 401, path
    bad = httpx.get(url + "/get_model_info", headers={"Authorization": "Basic " + TOKEN})
    assert bad.status_code == 401 and "API key" in bad.json()["error"]["message"]
    assert httpx.get(url + "/get_server_info").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    ok = post(url, "/generate", GEN)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) <= 2


def test_weight_paths_outside_weights_dir_are_refused(server: Any) -> None:
    url, weights = server
    for path in [
        str(weights.parent / "outside"),  # a sibling directory
        str(weights / "escape"),  # a symlink inside pointing out
        str(weights / "v0" / ".." / ".." / "outside"),  # .. components
        str(weights),  # the directory itself is not a version
        "/etc",
    ]:
        resp = post(url, "/update_weights_from_disk", {"model_path": path, "weight_version": "9"})
        assert resp.status_code == 403, path
        assert resp.json()["success"] is False  # SGLang's refusal body
        assert "outside the weights directory" in resp.json()["message"]
    missing = post(url, "/update_weights_from_disk", {"model_path": str(weights / "v5")})
    assert missing.status_code == 400 and "config.json" in missing.json()["message"]
    # a version directory with broken weights: 400, the old weights keep serving
    broken = weights / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text((weights / "v0" / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    resp = post(
        url, "/update_weights_from_disk", {"model_path": str(broken), "weight_version": "9"}
    )
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert "failed to load weights" in resp.json()["message"]
    info = httpx.get(url + "/get_model_info", headers={"Authorization": f"Bearer {TOKEN}"})
    assert info.json()["weight_version"] == "0"
    after = post(url, "/generate", GEN)
    assert after.status_code == 200 and after.json()["meta_info"]["weight_version"] == "0"


def test_bad_requests_name_the_field(server: Any) -> None:
    url, _ = server
    cases = [
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
        ({"input_ids": ["a"]}, "input_ids"),
        ({"sampling_params": {}}, "input_ids or text"),
    ]
    for body, field in cases:
        resp = post(url, "/generate", body)
        assert resp.status_code == 400, body
        assert field in resp.json()["error"]["message"], (field, resp.json())
    bad_mode = post(url, "/pause_generation", {"mode": "sideways"})
    assert bad_mode.status_code == 400 and "mode" in bad_mode.json()["error"]["message"]


def raw(url: str, path: str, content: bytes, token: str | bytes = TOKEN) -> httpx.Response:
    auth = token if isinstance(token, bytes) else f"Bearer {token}".encode()
    headers = {"Authorization": auth, "Content-Type": "application/json"}
    return httpx.post(url + path, content=content, headers=headers, timeout=30)


def test_hostile_input_is_a_4xx_never_a_5xx(server: Any) -> None:
    url, _ = server
    sp = b'"sampling_params": {"max_new_tokens": 2, '
    cases = [
        # NaN and infinity are not JSON, but Python's parser takes them
        (b'{"input_ids": [1], ' + sp + b'"temperature": NaN}}', 400, "temperature"),
        (b'{"input_ids": [1], ' + sp + b'"top_p": NaN}}', 400, "top_p"),
        (b'{"input_ids": [1], ' + sp + b'"min_p": Infinity}}', 400, "min_p"),
        (b'{"input_ids": [1], ' + sp + b'"frequency_penalty": -Infinity}}', 400, "penalty"),
        (b'{"text": "ab\\ud800"}', 400, "surrogate"),
        (b'{"input_ids": [1], "rid": "\\udc00"}', 400, "rid"),
        (b'{"input_ids": [1], ' + sp + b'"stop": ["\\ud83d"]}}', 400, "stop"),
        (b'{"input_ids": [1], "sampling_params": {"logit_bias": {"\\ud800": 1}}}', 400, "bias"),
        (b'{"input_ids": [1e400]}', 400, "input_ids"),
        (b'{"input_ids": [1], ' + sp + b'"top_k": 99999999999999999999}}', 400, "top_k"),
        (b'{"input_ids": [1], "top_logprobs_num": 99999999, "return_logprob": true}', 400, "top"),
        (b"\xff\xfe not utf-8", 400, ""),
        (b"[" * 100_000, 400, ""),
        (b'{"input_ids": [1], ' + sp + b'"regex": "(a"}}', 400, "regex"),
        (b'{"input_ids": [1], "sampling_params": {"logit_bias": {"3": 1e308}}}', 400, "bias"),
        (b'{"input_ids": [1], "lora_path": "x"}', 400, "lora_path"),
    ]
    for body, status, word in cases:
        resp = raw(url, "/generate", body)
        assert resp.status_code == status, (body[:80], resp.text)
        assert word in resp.json()["error"]["message"], (body[:80], resp.text)
    # a non-ASCII bearer token is a wrong token
    for token in ("Bearer s3cret-tökén".encode(), b"Bearer \xff\xfe", "Bearer ✓".encode()):
        resp = raw(url, "/generate", b'{"input_ids": [1]}', token=token)
        assert resp.status_code == 401, token
    # an oversized body: 413 from its Content-Length, without reading it
    big = raw(url, "/generate", b" " * (64 * 2**20 + 1))
    assert big.status_code == 413 and "bytes" in big.json()["error"]["message"]
    assert post(url, "/generate", GEN).status_code == 200


def test_limits_give_clear_400s(server: Any) -> None:
    url, _ = server
    over = post(
        url, "/generate", {"input_ids": [5] * 40, "sampling_params": {"max_new_tokens": 30}}
    )
    assert over.status_code == 400
    assert "exceeds the context length 64" in over.json()["error"]["message"]
    vocab = post(url, "/generate", {"input_ids": [10**6], "sampling_params": {"max_new_tokens": 1}})
    assert vocab.status_code == 400 and "vocabulary" in vocab.json()["error"]["message"]
    empty = post(url, "/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 1}})
    assert empty.status_code == 400
    mismatch = post(
        url, "/generate", {"input_ids": [[5], [6]], "sampling_params": [{"max_new_tokens": 1}]}
    )
    assert mismatch.status_code == 400 and "sampling_params" in mismatch.json()["error"]["message"]
    # the server still works
    assert post(url, "/generate", GEN).status_code == 200


async def test_duplicate_rid_in_flight_is_400(server: Any) -> None:
    url, _ = server
    async with InferenceClient(url, api_key=TOKEN) as c:
        sp = SamplingParams(max_new_tokens=60, ignore_eos=True)
        first = asyncio.create_task(c.generate([5], sp, rid="same"))
        while not (await c.server_info())["num_running_reqs"]:
            await asyncio.sleep(0.01)
        with pytest.raises(GenerationError) as err:
            await c.generate([6], sp, rid="same")
        assert err.value.status == 400 and "already in flight" in err.value.message
        assert (await first).finish_reason == "length"
        again = await c.generate([6], SamplingParams(max_new_tokens=2), rid="same")
        assert again.finish_reason in ("length", "stop")  # the rid is free again
