"""The client's group request: one prompt n times goes as one `/generate` call with
`sampling_params.n` (SGLang's parallel sampling) to a server that takes it, and as the
batch form to one that refuses `n` (an older server, here a recording stand-in)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import materialize
from rollout_service.client import InferenceClient
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(120)
SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


async def test_group_uses_n_on_the_built_in_server(tmp_path: Path) -> None:
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


def recording_server(refuse_n: bool) -> tuple[FastAPI, list[dict[str, Any]]]:
    """A /generate that records each body, answers the batch form, and refuses `n`
    with 422 as servers without parallel sampling do."""
    seen: list[dict[str, Any]] = []
    app = FastAPI()

    def one(rid: str) -> dict[str, Any]:
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, 9, None]],
        }
        return {"text": "", "output_ids": [9], "meta_info": meta}

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        n = body["sampling_params"].get("n", 1)
        if n > 1:
            if refuse_n:
                return JSONResponse({"detail": "n: Input should be less than 1"}, 422)
            return JSONResponse([one(f"{body['rid']}_{i}") for i in range(n)])
        return JSONResponse([one(r) for r in body["rid"]])

    return app, seen


@pytest.mark.parametrize("refuse_n", [False, True])
async def test_group_falls_back_to_the_batch_form(refuse_n: bool) -> None:
    app, seen = recording_server(refuse_n)
    with ServerThread(app) as url:
        async with InferenceClient(url) as c:
            for g in range(2):
                rids = [f"q.g{g}_{i}" for i in range(3)]
                res = await c.generate_batch([[1, 2]] * 3, SP, rids)
                assert [r.output_ids for r in res] == [[9]] * 3
            # not a group (different prompts): always the batch form
            await c.generate_batch([[1], [2]], SP, ["a_0", "a_1"])
    kinds = [("n" if "n" in b["sampling_params"] else "batch") for b in seen]
    if refuse_n:  # tried once, then the batch form only
        assert kinds == ["n", "batch", "batch", "batch"]
    else:
        assert kinds == ["n", "n", "batch"]
        assert seen[0]["rid"] == "q.g0" and seen[0]["sampling_params"]["n"] == 3
