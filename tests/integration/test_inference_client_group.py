"""A group (one prompt n times) goes as SGLang's batch form with one rid per sample, so
the controller's timeout aborts reach every sample on a real SGLang server, which names
the samples of an `n` > 1 request randomly (`regenerate_rid()` in its tokenizer
manager) and aborts only a rid it holds exactly. Checked against the built-in server and
an SGLang-shaped stand-in that holds its requests until they are aborted."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import materialize
from rollout_service.client import InferenceClient
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.sampler import Sampler
from rollout_service.controller.weight_sync import UpdateGate
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(120)
SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


async def test_group_on_the_built_in_server(tmp_path: Path) -> None:
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=0), tmp_path / "v0")
    app = build_server_app(ModelConfig(path=str(tmp_path / "v0")), InferenceConfig())
    with ServerThread(app) as url:
        async with InferenceClient(url) as c:
            rids = ["p7.g1_0", "p7.g1_1", "p7.g1_2"]
            res = await c.generate_batch([[5, 6, 7]] * 3, SP, rids)
            assert [len(r.output_ids) for r in res] == [4, 4, 4]
            assert all(len(r.logprobs) == 4 and r.finish_reason == "length" for r in res)
            metrics = await c.metrics_text()
            assert "sglang:num_requests_total 3.0" in metrics


@dataclass
class SGLangLike:
    """SGLang 0.5.10's request naming and abort rule over requests that never finish on
    their own (a stuck server) until `hold` is cleared: samples of an `n` > 1 request get
    random ids, a batch keeps its rids, and `/abort_request` stops only a rid in flight
    exactly (`rid not in self.rid_to_state: return`)."""

    hold: bool = True
    inflight: dict[str, asyncio.Event] = field(default_factory=dict)
    seen: list[list[str]] = field(default_factory=list)  # the ids of each /generate call
    aborted: list[str] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()
        app.post("/generate")(self.generate)
        app.post("/abort_request")(self.abort)
        return app

    def rids(self, body: dict[str, Any]) -> list[str]:
        n = int(body["sampling_params"].get("n", 1))
        batch = isinstance(body["input_ids"][0], list)
        if n > 1:  # parallel sampling: one random id per sample
            prompts = len(body["input_ids"]) if batch else 1
            return [uuid.uuid4().hex for _ in range(prompts * n)]
        rid = body.get("rid")
        if not batch:
            return [rid or uuid.uuid4().hex]
        size = len(body["input_ids"])
        if isinstance(rid, str):
            return [f"{rid}_{i}" for i in range(size)]
        return list(rid) if rid else [uuid.uuid4().hex for _ in range(size)]

    async def one(self, rid: str) -> dict[str, Any]:
        stop = self.inflight[rid] = asyncio.Event()
        if self.hold:
            await stop.wait()
        del self.inflight[rid]
        finish = {"type": "abort", "message": "aborted"} if stop.is_set() else None
        out = [] if stop.is_set() else [9] * 4
        meta = {
            "id": rid,
            "finish_reason": finish or {"type": "length", "length": 4},
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in out],
        }
        return {"text": "", "output_ids": out, "meta_info": meta}

    async def generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        rids = self.rids(body)
        self.seen.append(rids)
        outs = await asyncio.gather(*(self.one(r) for r in rids))
        return JSONResponse(outs if len(outs) > 1 else outs[0])

    async def abort(self, request: Request) -> dict[str, Any]:
        rid = (await request.json()).get("rid")
        if rid in self.inflight:
            self.aborted.append(rid)
            self.inflight[rid].set()
            self.hold = False  # the stuck spell is over: later requests finish
        return {}


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_the_timeout_abort_stops_every_sample_of_a_group() -> None:
    fake = SGLangLike()
    with ServerThread(fake.app()) as url:
        async with InferenceClient(url) as client:
            dispatcher = Dispatcher([client])
            dispatcher.servers[0].healthy = True
            sampler = Sampler(dispatcher, UpdateGate(), SP, request_timeout_s=0.5, max_retries=2)
            samples = await sampler.sample_group([1, 2, 3], 3, "p0")
            group = fake.seen[0]
            assert len(group) == 3
            # every sample of the stuck call was aborted by the id the server holds it by
            await until(lambda: sorted(fake.aborted) == sorted(group))
            await until(lambda: not fake.inflight)
            # ... and each sample then finished one by one
            assert [s.token_ids for s in samples] == [[9] * 4] * 3
            assert [s.finish_reason for s in samples] == ["length"] * 3


async def test_aborting_base_j_misses_parallel_samples() -> None:
    """Why the client no longer sends `n`: the old `<base>_j` aborts stop nothing."""
    fake = SGLangLike()
    with ServerThread(fake.app()) as url:
        async with InferenceClient(url) as client:
            call = asyncio.ensure_future(
                client.generate_raw({"input_ids": [1, 2], "sampling_params": {"n": 3}, "rid": "g"})
            )
            await until(lambda: len(fake.inflight) == 3)
            for j in range(3):
                await client.abort(f"g_{j}")
            assert fake.aborted == [] and len(fake.inflight) == 3
            for rid in list(fake.inflight):  # the ids the server reports do work
                await client.abort(rid)
            outs = await call
            assert sorted(o["meta_info"]["id"] for o in outs) == sorted(fake.aborted)


def test_the_client_drops_idle_connections_before_the_server_closes_them() -> None:
    """uvicorn closes a keep-alive connection after `timeout_keep_alive` s idle; a client
    that keeps it longer can send a request on a connection being closed
    (ServerDisconnectedError: a weight update's pause failed this way after a 5 s lull)."""
    import uvicorn

    from rollout_service.client import KEEPALIVE_S

    assert KEEPALIVE_S < uvicorn.Config(app=None).timeout_keep_alive
