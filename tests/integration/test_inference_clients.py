"""What real clients need of the built-in server beyond the basics (test_openai_api.py):
seeds on both APIs, streaming log-probs equal to the whole response's, a huge text prompt
refused at once without stalling anyone, the colocated-mode memory routes, and the
smaller SGLang/OpenAI details (PUT /generate, batch rid naming, /v1/models/{id},
text_offset). One server for the module."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import load_tokenizer, materialize
from areal_hex.net import free_port
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(300)
CONTEXT = 256
UNK = 2  # a special token: it has no text once special tokens are skipped


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clients")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=11), root / "v0")
    return root


# The server runs in its own process, as in production: timings of one request while
# another is refused are the server's, not the GIL shared with this test's clients.
SERVE = """
import sys
from areal_hex.config import InferenceConfig, ModelConfig
from rollout_service.server.main import serve
weights, context, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
inf = InferenceConfig(
    weights_dir=weights, context_length=context, max_prompt_chars=1000, num_threads=1
)
serve(ModelConfig(path=weights + "/v0"), inf, port)
"""


@pytest.fixture(scope="module")
def url(weights: Path) -> Any:
    port = free_port()
    cmd = [sys.executable, "-c", SERVE, str(weights), str(CONTEXT), str(port)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    u = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(u):
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            time.sleep(0.2)
        yield u
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def gen(url: str, body: dict[str, Any], status: int = 200, method: str = "POST") -> Any:
    r = httpx.request(method, url + "/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def output_ids(url: str, body: dict[str, Any]) -> list[int]:
    return list(gen(url, body)["output_ids"])


# ---------------------------------------------------------------------- seeds
def test_sampling_seed_repeats_the_tokens(url: str) -> None:
    def body(seed: int | None) -> dict[str, Any]:
        sp = {"max_new_tokens": 12, "temperature": 1.5, "ignore_eos": True}
        return {"input_ids": [30, 31, 32], "sampling_params": {**sp, "sampling_seed": seed}}

    first = output_ids(url, body(7))
    assert output_ids(url, body(7)) == first
    others = {tuple(output_ids(url, body(s))) for s in (8, 9, 10)}
    assert others - {tuple(first)}, "other seeds drew the same tokens"

    # a seeded row draws from its own generator: busy neighbours change nothing
    busy = {"input_ids": [50, 51], "sampling_params": {"max_new_tokens": 12, "temperature": 1.5}}
    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: output_ids(url, busy)) for _ in range(3)]
    for t in threads:
        t.start()
    results.append(output_ids(url, body(7)))
    for t in threads:
        t.join()
    assert results == [first]

    # n > 1: sample j uses seed + j, so the samples differ and repeat
    group = {**body(7), "sampling_params": {**body(7)["sampling_params"], "n": 3}}
    outs = [o["output_ids"] for o in gen(url, group)]
    assert outs[0] == first and len({tuple(o) for o in outs}) > 1
    assert [o["output_ids"] for o in gen(url, group)] == outs


def test_openai_seed(client: openai.OpenAI, name: str) -> None:
    def texts(seed: int, n: int = 1) -> list[str]:
        res = client.completions.create(
            model=name, prompt="ab", max_tokens=12, temperature=1.5, seed=seed, n=n
        )
        return [c.text for c in res.choices]

    assert texts(1234) == texts(1234)
    assert texts(1234, n=2)[0] == texts(1234)[0]
    chat = [
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            temperature=1.2,
            seed=5,
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert chat[0] == chat[1]


# ---------------------------------------------------------------------- streaming
def _streamed_completion(client: openai.OpenAI, **kw: Any) -> tuple[list[str], list[Any], str]:
    tokens: list[str] = []
    lps: list[Any] = []
    text = ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                lps += c.logprobs.token_logprobs or []
    return tokens, lps, text


def _streamed_chat(client: openai.OpenAI, **kw: Any) -> tuple[list[str], list[float], str]:
    tokens: list[str] = []
    lps: list[float] = []
    text = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                tokens += [t.token for t in c.logprobs.content]
                lps += [t.logprob for t in c.logprobs.content]
    return tokens, lps, text


def test_streaming_logprobs_equal_the_whole_response(client: openai.OpenAI, name: str) -> None:
    """50 random seeded requests, half completions, half chat; some biased toward a
    token with no text (the case that lost entries)."""
    rng = random.Random(0)
    for i in range(50):
        kw: dict[str, Any] = {
            "model": name,
            "max_tokens": rng.randint(1, 8),
            "temperature": rng.choice([0.0, 0.8, 1.5]),
            "seed": rng.randint(0, 10**6),
        }
        if i % 5 == 0:
            kw["logit_bias"] = {str(UNK): rng.choice([5, 100])}
        if rng.random() < 0.3:
            kw["stop"] = [rng.choice("aeiou ")]
        word = "".join(rng.choice("abcdefgh 0123") for _ in range(rng.randint(1, 8)))
        if i % 2 == 0:
            whole = client.completions.create(prompt=word, logprobs=1, **kw).choices[0]
            assert whole.logprobs is not None
            tokens, lps, text = _streamed_completion(client, prompt=word, logprobs=1, **kw)
            assert tokens == whole.logprobs.tokens, (kw, word)
            assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
            assert text == whole.text
        else:
            msgs = [{"role": "user", "content": word}]
            res = client.chat.completions.create(messages=msgs, logprobs=True, **kw).choices[0]
            assert res.logprobs is not None and res.logprobs.content is not None
            tokens, lps, text = _streamed_chat(client, messages=msgs, logprobs=True, **kw)
            assert tokens == [t.token for t in res.logprobs.content], (kw, word)
            assert lps == pytest.approx([t.logprob for t in res.logprobs.content], abs=1e-5)
            assert text == res.message.content


def test_text_offset_skips_hidden_special_tokens(client: openai.OpenAI, name: str) -> None:
    res = client.completions.create(
        model=name,
        prompt="xy",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        logprobs=0,
        echo=True,
        logit_bias={str(UNK): 4},
        extra_body={"ignore_eos": True},
    )
    c = res.choices[0]
    assert c.logprobs is not None
    offsets, tokens = c.logprobs.text_offset, c.logprobs.tokens
    assert "<|unk|>" in tokens, "the bias drew no special token: the check means nothing"
    for k, (at, tok) in enumerate(zip(offsets, tokens, strict=True)):
        if tok != "<|unk|>":  # a visible token sits at its offset in `text`
            assert c.text[at : at + len(tok)] == tok, (k, offsets, tokens, c.text)
    assert offsets[-1] <= len(c.text)


# ---------------------------------------------------------------------- huge prompts
def _timed_post(url: str, body: bytes, answers: dict[str, Any]) -> None:
    """POST a body encoded beforehand (the client and the server share this process:
    encoding 10 MiB of JSON in the timed window would time the client)."""
    headers = {"content-type": "application/json"}
    t0 = time.monotonic()
    answers["resp"] = httpx.post(url, content=body, headers=headers, timeout=60)
    answers["s"] = time.monotonic() - t0


def test_a_huge_prompt_is_refused_at_once_and_stalls_nobody(url: str) -> None:
    huge = "ab" * (5 * 2**20)  # 10 MiB of text
    bodies = [
        ("/generate", {"text": huge, "sampling_params": {"max_new_tokens": 1}}),
        ("/v1/completions", {"model": "m", "prompt": huge, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": huge}]}),
    ]
    for path, body in bodies:
        answers: dict[str, Any] = {}
        raw = json.dumps(body).encode()
        sender = threading.Thread(target=_timed_post, args=(url + path, raw, answers))
        sender.start()
        health = []
        while sender.is_alive():
            t0 = time.monotonic()
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            health.append(time.monotonic() - t0)
        sender.join()
        resp = answers["resp"]
        assert resp.status_code == 400, resp.text
        assert "characters" in resp.json()["error"]["message"]
        assert answers["s"] < 1.0 and max(health, default=0.0) < 1.0, (path, answers, health)

    # inference.max_prompt_chars (1000 here) is the bound; under it but over the context,
    # a prompt is refused by its token count
    over = {"text": "a" * 1001, "sampling_params": {"max_new_tokens": 1}}
    assert "limit of 1000" in gen(url, over, 400)["error"]["message"]
    long = {"text": "a" * 1000, "sampling_params": {"max_new_tokens": 1}}
    assert "context length" in gen(url, long, 400)["error"]["message"]
    with pytest.raises(ValueError, match="max_prompt_chars"):
        InferenceConfig(backend="sglang", max_prompt_chars=1000)


# ---------------------------------------------------------------------- colocated mode
def test_release_and_resume_memory(url: str) -> None:
    small = {"input_ids": [20, 21], "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(url + "/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json()["success"] is True
    refused = gen(url, small, 503)
    assert "/resume_memory_occupation" in refused["error"]["message"]
    assert httpx.get(url + "/health_generate", timeout=10).status_code == 200
    bad = httpx.post(url + "/resume_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and "tags" in bad.json()["error"]["message"]
    r = httpx.post(url + "/resume_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["success"] is True
    assert len(output_ids(url, small)) == 2

    # refused while a request runs (SGLang needs an idle server too); on a loaded machine
    # the request can end between seeing it run and the release: then resume, try again
    sp = {"max_new_tokens": 200, "ignore_eos": True}
    for _ in range(5):
        busy = release_while_running(url, {"input_ids": [20], "sampling_params": sp, "rid": "slow"})
        if busy.status_code == 400:
            break
        r = httpx.post(url + "/resume_memory_occupation", json={})
        assert r.status_code == 200, r.text
    assert busy.status_code == 400 and busy.json()["success"] is False, busy.text
    assert "in flight" in busy.json()["message"]


def test_the_client_releases_and_resumes_memory(url: str) -> None:
    """`InferenceClient`'s colocated calls (what the controller's colocate.py sends): a
    released server refuses generation until resumed; a bad tag is refused."""
    import asyncio

    from areal_hex.api import SamplingParams
    from rollout_service.client import GenerationError, InferenceClient

    async def go() -> None:
        async with InferenceClient(url) as c:
            assert "released" in await c.release_memory_occupation()
            with pytest.raises(GenerationError, match="resume_memory_occupation"):
                await c.generate([20, 21], SamplingParams(max_new_tokens=2))
            with pytest.raises(GenerationError, match="tags"):
                await c.resume_memory_occupation(["gpu"])
            assert "resumed" in await c.resume_memory_occupation()
            out = await c.generate([20, 21], SamplingParams(max_new_tokens=2))
            assert len(out.output_ids) == 2

    asyncio.run(go())


def release_while_running(url: str, slow: dict) -> httpx.Response:
    """The answer to a release sent once `slow` is seen running (its rid aborted after)."""
    running = threading.Thread(target=lambda: gen(url, slow))
    running.start()
    try:
        deadline = time.monotonic() + 10
        while httpx.get(url + "/get_load").json()[0]["num_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return httpx.post(url + "/release_memory_occupation", json={})
    finally:
        httpx.post(url + "/abort_request", json={"rid": slow["rid"]})
        running.join()


@pytest.mark.gpu
def test_release_moves_the_weights_off_the_gpu(weights: Path) -> None:
    import torch
    from safetensors import safe_open

    inf = InferenceConfig(device="cuda", context_length=CONTEXT)
    app = build_server_app(ModelConfig(path=str(weights / "v0"), dtype="float32"), inf)
    sp = {"max_new_tokens": 3, "temperature": 0.0}  # greedy: the same weights, the same tokens
    small = {"input_ids": [20, 21], "sampling_params": sp}
    with safe_open(str(weights / "v0" / "model.safetensors"), "pt") as f:
        weight_bytes = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())
    with ServerThread(app) as u:
        before = output_ids(u, small)
        held = torch.cuda.memory_allocated()
        assert httpx.post(u + "/release_memory_occupation", json={}).json()["success"]
        released = torch.cuda.memory_allocated()
        assert held - released >= weight_bytes  # the weights left the device
        assert httpx.post(u + "/resume_memory_occupation", json={}).json()["success"]
        # the weights are back (the last request's small buffers need not be)
        assert torch.cuda.memory_allocated() - released >= weight_bytes
        assert output_ids(u, small) == before


# ---------------------------------------------------------------------- SGLang details
def test_sglang_details(url: str, weights: Path) -> None:
    one = {"input_ids": [40, 41], "sampling_params": {"max_new_tokens": 2}}
    out = gen(url, one, method="PUT")
    assert len(out["output_ids"]) == 2
    meta = out["meta_info"]
    assert meta["reasoning_tokens"] == 0 and meta["total_retractions"] == 0

    batch = {"input_ids": [[40], [41], [42]], "rid": "b", "sampling_params": {"max_new_tokens": 1}}
    assert [o["meta_info"]["id"] for o in gen(url, batch)] == ["b_0", "b_1", "b_2"]

    tok = load_tokenizer(weights / "v0")
    text_batch = {"text": ["hi", "there"], "sampling_params": {"max_new_tokens": 1}}
    outs = gen(url, text_batch)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [
        len(tok.encode(t, add_special_tokens=False)) for t in ("hi", "there")
    ]


def test_openai_details(client: openai.OpenAI, name: str, url: str) -> None:
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.type == "not_found_error" and err.value.param == "model"
    r = httpx.get(url + "/v1/models/no-such-model")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
