"""`POST /generate` (and `PUT`), SGLang's native generation route, over the built-in
engine (contract: docs/api.md): a call's prompts become engine requests (`_items`), run
to their end or streamed as server-sent events, and are written back in SGLang's
response shape (`_output`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from rollout_service import wire
from rollout_service.server import prompts
from rollout_service.server.engine import Engine
from rollout_service.server.http_common import SSE_DONE, FastJSON, run_all, sse
from rollout_service.server.requests import (
    NO_EXTRA_LOGPROBS,
    EngineError,
    GenRequest,
    LogprobSpec,
    trimmed_text,
)


@dataclass
class _Item:
    prompt: list[int]
    params: wire.SamplingParamsIn
    logprob: bool
    rid: str
    want: LogprobSpec = NO_EXTRA_LOGPROBS
    text_in_logprobs: bool = False


async def _items(engine: Engine, max_chars: int, body: wire.GenerateReqInput) -> list[_Item]:
    """The engine requests of one call: each prompt `n` times, in prompt-major order.
    Naming: a batch given one string rid `r` names its prompts `r_0`, `r_1` ... (as
    SGLang); a prompt asked for n > 1 times with rid `r` names its samples `r_0` ..
    `r_{n-1}` (SGLang gives them random ids instead: read `meta_info.id`)."""
    try:
        parts = [(*body.item(i), *body.logprob_options(i)) for i in range(body.batch_size())]
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    texts = [p[0] for p in parts if isinstance(p[0], str)]
    encoded = iter(await prompts.encode(engine.tokenizer, texts, "text", max_chars))
    items: list[_Item] = []
    for i, (prompt, params, logprob, rid, start, top) in enumerate(parts):
        ids = next(encoded) if isinstance(prompt, str) else prompt
        want = LogprobSpec(start, top) if logprob else NO_EXTRA_LOGPROBS
        engine.validate(ids, params, want)
        if body.is_batch and isinstance(body.rid, str):
            rid = f"{rid}_{i}"
        rids = [rid] if params.n == 1 else [rid and f"{rid}_{j}" for j in range(params.n)]
        texts_in = body.return_text_in_logprobs
        items += [
            _Item(ids, params.for_sample(j), logprob, r or uuid.uuid4().hex, want, texts_in)
            for j, r in enumerate(rids)
        ]
    if len({p[1].n for p in parts}) > 1:
        raise EngineError("sampling_params.n: must be the same for every prompt of a batch")
    rids = [it.rid for it in items]
    if len(set(rids)) != len(rids):
        raise EngineError("rid: the batch repeats a request id")
    return items


def _entries(
    engine: Engine, lps: list[float | None], ids: list[int], with_text: bool
) -> list[wire.LogprobEntry]:
    tok = engine.tokenizer if with_text else None
    return [
        [
            None if lp is None else max(lp, wire.LOGPROB_FLOOR),
            t,
            tok.decode([t]) if tok is not None else None,
        ]
        for lp, t in zip(lps, ids, strict=True)
    ]


def _tops(engine: Engine, tops: list[Any], with_text: bool) -> list[list[wire.LogprobEntry] | None]:
    out: list[list[wire.LogprobEntry] | None] = []
    for entry in tops:
        if entry is None:
            out.append(None)
            continue
        lps, ids = [lp for lp, _ in entry], [t for _, t in entry]
        out.append(_entries(engine, lps, ids, with_text))
    return out


def _output(
    engine: Engine, item: _Item, req: GenRequest, upto: int | None = None
) -> dict[str, Any]:
    """The response object of a finished request, or (`upto` = n) of its first n output
    tokens while it still runs (a streaming chunk: no finish reason yet).

    `wire.GenerateOutput(...).to_wire()` of the same fields, built as the dict itself:
    the fields are ours and of the right types, and a group's sixteen validations and
    dumps were a tenth of the server's HTTP time (tests/unit/test_generate_output.py
    holds the two equal)."""
    final = upto is None
    n = len(req.output_ids) if final else min(upto or 0, len(req.output_ids))
    ids = req.output_ids[:n]
    assert req.finish is not None or not final
    meta: dict[str, Any] = {  # wire.MetaInfo's fields, in its order
        "id": req.rid,
        "finish_reason": req.finish.to_wire() if final and req.finish else None,
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": req.weight_version if final else engine.weight_version,
        "e2e_latency": req.latency(),
    }
    if item.logprob:
        meta.update(_logprob_fields(engine, item, req, ids))
    meta["reasoning_tokens"] = 0
    meta["total_retractions"] = req.retractions
    text = trimmed_text(engine.tokenizer, req, n) if final else _partial(engine, item, ids)
    return {"text": text, "output_ids": ids, "meta_info": meta}


def _logprob_fields(engine: Engine, item: _Item, req: GenRequest, ids: list[int]) -> dict[str, Any]:
    """The log-prob fields of `meta_info` for the first len(ids) output tokens."""
    n, text, start = len(ids), item.text_in_logprobs, item.want.start
    out: dict[str, Any] = {"output_token_logprobs": _entries(engine, req.logprobs[:n], ids, text)}
    prompt_ids = req.prompt[start:] if start >= 0 else []
    inputs = req.input_logprobs if len(req.input_logprobs) == len(prompt_ids) else []
    scored = _entries(engine, list(inputs), prompt_ids if inputs else [], text)
    out["input_token_logprobs"] = scored
    if item.want.top:
        out["output_top_logprobs"] = _tops(engine, req.output_top[:n], text)
        out["input_top_logprobs"] = _tops(engine, req.input_top, text)
    if start > 0 and scored:
        # SGLang gives the first scored position no log-prob, whatever its start
        scored[0][0] = None
        if out.get("input_top_logprobs"):
            out["input_top_logprobs"][0] = None
    out["output_token_versions"] = req.versions[:n]
    return out


def _partial(engine: Engine, item: _Item, ids: list[int]) -> str:
    tok = engine.tokenizer
    return tok.decode(ids, skip_special_tokens=item.params.skip_special_tokens) if tok else ""


def _open_all(engine: Engine, items: list[_Item]) -> list[tuple[GenRequest, Any]]:
    """Register every request of a call (`_items` validated them), or none (a refused one
    releases the others)."""
    opened: list[tuple[GenRequest, Any]] = []
    try:
        for it in items:
            opened.append(engine.open(it.prompt, it.params, it.rid, want=it.want, checked=True))
    except EngineError:
        for req, _ in opened:
            engine.finish(req, wire.FinishReason(type="abort", message="batch refused"))
        raise
    return opened


def add_generate_routes(app: FastAPI) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])  # SGLang takes both
    async def generate(body: wire.GenerateReqInput, request: Request) -> Response:
        engine: Engine = request.app.state.engine
        max_chars = request.app.state.settings.prompt_chars(engine.opts.context_length)
        items = await _items(engine, max_chars, body)
        many = body.is_batch or len(items) > 1
        if body.stream:
            if many:
                raise EngineError("stream: streaming takes one request (n = 1) per call")
            return _stream(engine, items[0])
        done = await run_all(engine, _open_all(engine, items), request)
        if done is None:
            return Response(status_code=499)
        outs = [_output(engine, it, req) for it, req in zip(items, done, strict=True)]
        return FastJSON(outs if many else outs[0])


def _stream(engine: Engine, item: _Item) -> StreamingResponse:
    """Server-sent events: one cumulative response object per `stream_interval` new
    tokens (coalesced when the client reads slower), the final one with its finish
    reason, then [DONE]."""
    progress: asyncio.Queue[int] = asyncio.Queue()
    req, fut = engine.open(
        item.prompt, item.params, item.rid, on_token=progress.put_nowait, want=item.want
    )
    task = asyncio.ensure_future(engine.run(req, fut))
    return StreamingResponse(
        _events(engine, item, req, task, progress), media_type="text/event-stream"
    )


async def _events(
    engine: Engine,
    item: _Item,
    req: GenRequest,
    task: asyncio.Future[GenRequest],
    progress: asyncio.Queue[int],
) -> AsyncIterator[bytes]:
    sent = 0
    try:
        while not task.done():
            nxt = asyncio.ensure_future(progress.get())
            await asyncio.wait({nxt, task}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                break
            n = nxt.result()
            while not progress.empty():
                n = progress.get_nowait()
            if n - sent >= item.params.stream_interval:
                sent = n
                yield sse(_output(engine, item, req, upto=n))
        try:
            yield sse(_output(engine, item, task.result()))
        except EngineError as exc:
            yield sse(wire.error_body(str(exc), exc.status))
        yield SSE_DONE
    finally:
        if not task.done():  # the client went away: abort the request
            task.cancel()
