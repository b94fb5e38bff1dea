"""The built-in inference server over real HTTP: shapes, finish reasons, behaviour
log-probs against a full forward pass, continuous batching, interruptible weight reload,
pause/continue, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import load_model, materialize
from rollout_service.client import GenerationError, InferenceClient
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """weights/v0 and weights/v1: two tiny models with different random weights."""
    root = tmp_path_factory.mktemp("weights")
    for version in (0, 1):
        materialize(ModelConfig(tiny=TinyModelConfig(), seed=version), root / f"v{version}")
    return root


@pytest.fixture(scope="module")
def models(weights: Path) -> dict[str, Any]:
    return {v: load_model(weights / f"v{v}", "cpu", "float32") for v in ("0", "1")}


def start(weights: Path, **overrides: Any) -> ServerThread:
    inf = InferenceConfig(weights_dir=str(weights), **overrides)
    return ServerThread(build_server_app(ModelConfig(path=str(weights / "v0")), inf))


def recompute(model: Any, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log p(output_t | prompt, output_<t) from one forward pass over the whole sequence,
    under log_softmax(logits / T) (raw logits for T = 0)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T_out, V)
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


async def tokens_generated(client: InferenceClient) -> float:
    for line in (await client.metrics_text()).splitlines():
        if line.startswith("sglang:generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("generation_tokens_total missing from /metrics")


async def running_requests(client: InferenceClient) -> float:
    for line in (await client.metrics_text()).splitlines():
        if line.startswith("sglang:num_running_reqs"):
            return float(line.split()[-1])
    raise AssertionError("num_running_reqs missing from /metrics")


async def test_generate_shapes_and_finish_reasons(weights: Path) -> None:
    with start(weights) as url:
        async with InferenceClient(url) as c:
            one = await c.generate_raw(
                {
                    "input_ids": [10, 11, 12],
                    "sampling_params": {"max_new_tokens": 7, "ignore_eos": True},
                    "return_logprob": True,
                    "rid": "a",
                    "unknown_top_level_key": True,
                }
            )
            meta = one["meta_info"]
            assert meta["id"] == "a" and meta["finish_reason"] == {"type": "length", "length": 7}
            assert len(one["output_ids"]) == 7 and meta["completion_tokens"] == 7
            assert meta["prompt_tokens"] == 3 and meta["weight_version"] == "0"
            assert meta["e2e_latency"] > 0 and isinstance(one["text"], str)
            pairs = meta["output_token_logprobs"]
            assert [p[1] for p in pairs] == one["output_ids"]
            assert all(p[0] <= 0 and p[2] is None for p in pairs)

            # greedy is deterministic: stop on the third greedy token
            greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
            ref = await c.generate_raw({"input_ids": [20, 21], "sampling_params": greedy})
            third = ref["output_ids"][2]
            first = ref["output_ids"].index(third)
            stop = {**greedy, "stop_token_ids": [third]}
            got = await c.generate_raw({"input_ids": [20, 21], "sampling_params": stop})
            assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
            assert got["output_ids"] == ref["output_ids"][: first + 1]
            assert "output_token_logprobs" not in got["meta_info"]

            batch = await c.generate_raw(
                {
                    "input_ids": [[5, 6], [7, 8, 9], [10]],
                    "sampling_params": [
                        {"max_new_tokens": n, "ignore_eos": True} for n in (1, 4, 2)
                    ],
                    "return_logprob": True,
                }
            )
            assert [len(o["output_ids"]) for o in batch] == [1, 4, 2]
            assert [o["meta_info"]["prompt_tokens"] for o in batch] == [2, 3, 1]

            text = await c.generate_raw(
                {"text": "1+1=", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            )
            assert text["meta_info"]["prompt_tokens"] == 4 and len(text["output_ids"]) == 3

            # a stop string (the model dir has a tokenizer): generation ends once the
            # decoded output contains it, and `text` ends before it (SGLang's trim)
            free = await c.generate_raw({"text": "7*8=", "sampling_params": greedy})
            target = free["text"][3]
            cut = free["text"].index(target)
            stopped = await c.generate_raw(
                {"text": "7*8=", "sampling_params": {**greedy, "stop": [target]}}
            )
            assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
            assert stopped["text"] == free["text"][:cut]

            zero = await c.generate_raw(
                {"input_ids": [5], "sampling_params": {"max_new_tokens": 0}}
            )
            assert (
                zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"
            )


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_match_full_forward(
    weights: Path, models: dict[str, Any], temperature: float
) -> None:
    """Requests of different lengths arrive while others run (prefill + merge into the
    running batch, rows leaving): every behaviour log-prob equals the one recomputed by a
    full forward pass of the same weights."""
    prompts = [[10 + i] * (3 + 5 * i) for i in range(6)]
    lengths = [40, 9, 25, 3, 33, 17]
    with start(weights, max_running_requests=4) as url:
        async with InferenceClient(url) as c:

            async def one(i: int) -> Any:
                await asyncio.sleep(0.05 * i)  # staggered arrival
                sp = SamplingParams(max_new_tokens=lengths[i], temperature=temperature, top_k=-1)
                sp.ignore_eos = True
                return await c.generate(prompts[i], sp)

            results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    for prompt, n, res in zip(prompts, lengths, results, strict=True):
        assert res.finish_reason == "length" and len(res.output_ids) == n
        want = recompute(models["0"], prompt, res.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
    if temperature == 0:  # greedy: every token of every request is the full forward's argmax
        for prompt, res in zip(prompts, results, strict=True):
            ids = torch.tensor([prompt + res.output_ids])
            with torch.no_grad():
                logits = models["0"](ids).logits[0, len(prompt) - 1 : -1]
            assert logits.argmax(-1).tolist() == res.output_ids


async def test_short_request_overtakes_long_one(weights: Path) -> None:
    """Continuous batching: a short request sent after a long one joins the running batch
    and finishes first, while the long one is still generating."""
    with start(weights) as url:
        async with InferenceClient(url) as c:
            long_sp = SamplingParams(max_new_tokens=400, ignore_eos=True)
            long = asyncio.create_task(c.generate([10, 11], long_sp, rid="long"))
            while await tokens_generated(c) < 20:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            short = await c.generate([12] * 30, SamplingParams(max_new_tokens=5, ignore_eos=True))
            short_s = time.monotonic() - t0
            assert not long.done(), "the long request should still be running"
            assert len(short.output_ids) == 5
            t1 = time.monotonic()
            res = await long
            assert len(res.output_ids) == 400 and res.finish_reason == "length"
            assert time.monotonic() - t1 > short_s  # the long one needed more time still


async def test_reload_during_generation_aborts_with_partial_output(
    weights: Path, models: dict[str, Any]
) -> None:
    with start(weights) as url:
        async with InferenceClient(url) as c:
            sp = SamplingParams(max_new_tokens=450, ignore_eos=True)
            prompts = [[30 + i] * (2 + i) for i in range(3)]
            tasks = [
                asyncio.create_task(c.generate(p, sp, rid=f"r{i}")) for i, p in enumerate(prompts)
            ]
            while await tokens_generated(c) < 30:
                await asyncio.sleep(0.02)
            await c.update_weights_from_disk(str(weights / "v1"), 1, abort_all_requests=True)
            results = await asyncio.gather(*tasks)
            for prompt, res in zip(prompts, results, strict=True):
                assert res.finish_reason == "abort" and res.weight_version == 0
                assert 0 < len(res.output_ids) < 450
                want = recompute(models["0"], prompt, res.output_ids, 1.0)  # old weights
                torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
            assert await c.weight_version() == 1
            info = await c.model_info()
            assert info["model_path"] == str((weights / "v1").resolve())

            # resumed as the controller does: prompt + partial output, fewer tokens left
            prompt = prompts[0] + results[0].output_ids
            rest = SamplingParams(max_new_tokens=10, ignore_eos=True)
            after = await c.generate(prompt, rest)
            assert after.weight_version == 1 and len(after.output_ids) == 10
            want = recompute(models["1"], prompt, after.output_ids, 1.0)  # new weights
            torch.testing.assert_close(torch.tensor(after.logprobs), want, atol=1e-4, rtol=0)


async def test_reload_without_abort_waits_for_in_flight(weights: Path) -> None:
    with start(weights) as url:
        async with InferenceClient(url) as c:
            sp = SamplingParams(max_new_tokens=120, ignore_eos=True)
            task = asyncio.create_task(c.generate([40, 41], sp))
            while await tokens_generated(c) < 5:
                await asyncio.sleep(0.02)
            await c.update_weights_from_disk(str(weights / "v1"), 5, abort_all_requests=False)
            # the reload returned only after the request ended on the server: all of its
            # 120 tokens generated, nothing running (the client task may not have read
            # its response yet: two connections, no order between their replies)
            assert await tokens_generated(c) >= 120
            assert await running_requests(c) == 0
            res = await asyncio.wait_for(task, timeout=30)
            assert res.finish_reason == "length" and len(res.output_ids) == 120
            assert res.weight_version == 0 and await c.weight_version() == 5


async def test_pause_continue(weights: Path) -> None:
    """Pause (abort mode) ends in-flight requests; while paused new requests wait and a
    reload with abort_all does not touch them; they run after continue."""
    with start(weights) as url:
        async with InferenceClient(url) as c:
            sp = SamplingParams(max_new_tokens=450, ignore_eos=True)
            running = asyncio.create_task(c.generate([50, 51], sp))
            while await tokens_generated(c) < 10:
                await asyncio.sleep(0.02)
            await c.pause()
            res = await asyncio.wait_for(running, 5)
            assert res.finish_reason == "abort" and len(res.output_ids) > 0
            three = SamplingParams(max_new_tokens=3, ignore_eos=True)
            waiting = asyncio.create_task(c.generate_batch([[52], [54]], three, ["w0", "w1"]))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await c.update_weights_from_disk(str(weights / "v1"), 1, abort_all_requests=True)
            assert not waiting.done()
            await c.resume()
            for late in await asyncio.wait_for(waiting, 10):
                assert late.finish_reason == "length" and late.weight_version == 1

            # in-place pause keeps the request and its progress
            task = asyncio.create_task(
                c.generate([53], SamplingParams(max_new_tokens=200, ignore_eos=True))
            )
            while await tokens_generated(c) < 30:
                await asyncio.sleep(0.02)
            await c.pause(mode="in_place")
            held = await tokens_generated(c)
            await asyncio.sleep(0.3)
            assert await tokens_generated(c) == held and not task.done()
            # a reload while paused in place does not wait for the held request
            await asyncio.wait_for(
                c.update_weights_from_disk(str(weights / "v0"), 2, abort_all_requests=False), 10
            )
            assert not task.done()
            await c.resume()
            res = await asyncio.wait_for(task, 30)
            assert res.finish_reason == "length" and len(res.output_ids) == 200
            assert res.weight_version == 2


async def test_abort_by_rid_and_all(weights: Path) -> None:
    with start(weights) as url:
        async with InferenceClient(url) as c:
            sp = SamplingParams(max_new_tokens=450, ignore_eos=True)
            a = asyncio.create_task(c.generate([60], sp, rid="a"))
            b = asyncio.create_task(c.generate([61], sp, rid="b"))
            while await tokens_generated(c) < 20:
                await asyncio.sleep(0.02)
            await c.abort("a")
            ra = await asyncio.wait_for(a, 5)
            assert ra.finish_reason == "abort" and not b.done()
            await c.abort("no-such-rid")  # a no-op
            await c.abort()
            rb = await asyncio.wait_for(b, 5)
            assert rb.finish_reason == "abort" and len(rb.output_ids) > len(ra.output_ids) // 2


async def test_metrics_health_and_info(weights: Path) -> None:
    with start(weights, max_running_requests=8) as url:
        async with InferenceClient(url) as c:
            assert await c.health() and await c.health_generate()
            await c.generate([5, 6], SamplingParams(max_new_tokens=9, ignore_eos=True))
            text = await c.metrics_text()
            for name in (
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "sglang:gen_throughput",
                "sglang:generation_tokens_total",
                'sglang:weight_version{version="0"}',
            ):
                assert name in text, name
            assert await tokens_generated(c) >= 9 + 1  # + the /health_generate probe
            info = await c.server_info()
            assert info["max_running_requests"] == 8 and info["weight_version"] == "0"
            assert "api_key" not in info
            await c.flush_cache()
            await c.update_weight_version("7")
            assert await c.weight_version() == 7
            with pytest.raises(GenerationError) as err:
                await c._json("POST", "/update_weights_from_distributed", {"names": []})
            assert err.value.status == 400


async def test_client_that_leaves_frees_its_request(weights: Path) -> None:
    """A client that times out disconnects; the server aborts its requests (a batch of
    two), so the same rid can be sent again at once (no 'already in flight'). 500 tokens
    take well over the client's 0.05 s (about 0.5 ms a decode step here)."""
    with start(weights) as url:
        async with InferenceClient(url, timeout_s=0.05) as impatient, InferenceClient(url) as c:
            sp = SamplingParams(max_new_tokens=500, ignore_eos=True)
            with pytest.raises(GenerationError) as err:
                await impatient.generate_batch([[70], [71]], sp, ["retry-me", "other"])
            assert err.value.status is None  # a transport timeout, not an HTTP answer
            # the server may still be reading the request when the client gives up: wait
            # for its aborts, not merely for an empty batch
            aborted = "sglang:num_aborted_requests_total 2.0"
            deadline = time.monotonic() + 10
            while aborted not in await c.metrics_text():
                assert time.monotonic() < deadline, "the abandoned request was not aborted"
                await asyncio.sleep(0.05)
            assert (await c.server_info())["num_running_reqs"] == 0
            res = await c.generate([70], SamplingParams(max_new_tokens=3), rid="retry-me")
            assert len(res.output_ids) <= 3
            assert aborted in await c.metrics_text()


async def test_streaming_sends_cumulative_chunks(weights: Path) -> None:
    import httpx

    with start(weights) as url:
        body = {
            "input_ids": [5, 6],
            "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
            "return_logprob": True,
            "stream": True,
        }
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", url + "/generate", json=body) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert len(final["output_ids"]) == 12 and len(chunks) >= 2
    for chunk in chunks[:-1]:  # each a prefix of the final answer, not yet finished
        n = len(chunk["output_ids"])
        assert chunk["meta_info"]["finish_reason"] is None
        assert chunk["output_ids"] == final["output_ids"][:n]
        assert (
            chunk["meta_info"]["output_token_logprobs"]
            == (final["meta_info"]["output_token_logprobs"][:n])
        )
