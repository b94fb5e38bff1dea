"""The inference server's HTTP app: SGLang's native API subset over the built-in engine.

`create_app(engine, settings)` only wires routes; the engine is built elsewhere
(`rollout_service.server`) and started/stopped in the lifespan. All state lives on
`app.state`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from rollout_service import wire
from rollout_service.engine import Engine
from rollout_service.metrics import build_registry
from rollout_service.requests import EngineError, GenRequest

M = TypeVar("M", bound=BaseModel)
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
SERVER_VERSION = "areal-hex-builtin"


@dataclass
class ServerSettings:
    api_key: str | None = None
    weights_dir: str | None = None  # reloads must name a directory inside it
    tokenizer_path: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)  # shown by /get_server_info
    health_generate_timeout_s: float = 20.0


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(wire.error_body(message), status_code=status)


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = engine
        app.state.settings = settings
        app.state.registry = build_registry(engine)
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="areal-hex inference server", lifespan=lifespan)
    app.middleware("http")(_auth_middleware)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _engine_error)  # type: ignore[arg-type]
    _generation_routes(app)
    _weight_routes(app)
    _info_routes(app)
    return app


# ---------------------------------------------------------------------- middleware, errors
async def _auth_middleware(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    key = request.app.state.settings.api_key
    if key and request.url.path not in OPEN_PATHS:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
            return error("missing or invalid API key (expected 'Authorization: Bearer ...')", 401)
    return await call_next(request)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in wire.UNION_TAGS)
        parts.append(f"{where}: {err.get('msg')}")
    body = wire.error_body("invalid request: " + "; ".join(parts))
    body["detail"] = jsonable_encoder(exc.errors(), custom_encoder={Exception: str})
    return JSONResponse(body, status_code=422)


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    return error(str(exc), exc.status)


# ---------------------------------------------------------------------- /generate
@dataclass
class _Item:
    prompt: list[int]
    params: wire.SamplingParamsIn
    logprob: bool
    rid: str


def _items(engine: Engine, body: wire.GenerateReqInput) -> list[_Item]:
    items: list[_Item] = []
    for i in range(body.batch_size()):
        try:
            prompt, params, logprob, rid = body.item(i)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise EngineError("text: this server has no tokenizer; send input_ids")
            prompt = list(engine.tokenizer.encode(prompt, add_special_tokens=False))
        engine.validate(prompt, params)
        items.append(_Item(prompt, params, logprob, rid or uuid.uuid4().hex))
    rids = [it.rid for it in items]
    if len(set(rids)) != len(rids):
        raise EngineError("rid: the batch repeats a request id")
    return items


def _output(
    engine: Engine, item: _Item, req: GenRequest, upto: int | None = None
) -> dict[str, Any]:
    """The response object of a finished request, or (`upto` = n) of its first n output
    tokens while it still runs (a streaming chunk: no finish reason yet)."""
    final = upto is None
    ids = list(req.output_ids if final else req.output_ids[:upto])
    tok = engine.tokenizer
    skip = item.params.skip_special_tokens
    text = tok.decode(ids, skip_special_tokens=skip) if tok is not None else ""
    assert req.finish is not None or not final
    meta = wire.MetaInfo(
        id=req.rid,
        finish_reason=req.finish.to_wire() if final and req.finish else None,
        prompt_tokens=len(req.prompt),
        completion_tokens=len(ids),
        cached_tokens=0,
        weight_version=req.weight_version if final else engine.weight_version,
        e2e_latency=req.latency(),
    )
    if item.logprob:
        lps = req.logprobs[: len(ids)]
        meta.output_token_logprobs = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        meta.input_token_logprobs = []
        meta.output_token_versions = list(req.versions[: len(ids)])
    return wire.GenerateOutput(text=text, output_ids=ids, meta_info=meta).to_wire()


def _open_all(engine: Engine, items: list[_Item]) -> list[tuple[GenRequest, Any]]:
    """Register every request of a call, or none (a refused one releases the others)."""
    opened: list[tuple[GenRequest, Any]] = []
    try:
        for it in items:
            opened.append(engine.open(it.prompt, it.params, it.rid))
    except EngineError:
        for req, _ in opened:
            engine.finish(req, wire.FinishReason(type="abort", message="batch refused"))
        raise
    return opened


def _generation_routes(app: FastAPI) -> None:
    @app.post("/generate")
    async def generate(body: wire.GenerateReqInput, request: Request) -> Response:
        engine: Engine = request.app.state.engine
        items = _items(engine, body)
        if body.stream:
            if body.is_batch:
                raise EngineError("stream: streaming takes one request per call")
            return _stream(engine, items[0])
        tasks = [asyncio.ensure_future(engine.run(r, f)) for r, f in _open_all(engine, items)]
        work = asyncio.gather(*tasks)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client left (e.g. its timeout): free the batch slots
            for t in tasks:
                t.cancel()
            return Response(status_code=499)
        outs = [_output(engine, it, req) for it, req in zip(items, work.result(), strict=True)]
        return JSONResponse(outs if body.is_batch else outs[0])


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body is already read, so the
    next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _stream(engine: Engine, item: _Item) -> StreamingResponse:
    """Server-sent events: one cumulative response object per new token (coalesced when
    the client reads slower), the final one with its finish reason, then [DONE]."""
    progress: asyncio.Queue[int] = asyncio.Queue()
    req, fut = engine.open(item.prompt, item.params, item.rid, on_token=progress.put_nowait)
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
            yield _sse(_output(engine, item, req, upto=n))
        try:
            yield _sse(_output(engine, item, task.result()))
        except EngineError as exc:
            yield _sse(wire.error_body(str(exc)))
        yield b"data: [DONE]\n\n"
    finally:
        if not task.done():  # the client went away: abort the request
            task.cancel()


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


# ---------------------------------------------------------------------- weights, control
def _check_weights_path(settings: ServerSettings, model_path: str) -> Path:
    path = Path(model_path).expanduser().resolve()
    if settings.weights_dir is not None:
        root = Path(settings.weights_dir).expanduser().resolve()
        if path == root or not path.is_relative_to(root):
            raise EngineError(
                f"model_path {model_path!r} resolves to {path}, outside the weights directory "
                f"{root}",
                403,
            )
    if not (path / "config.json").is_file():
        raise EngineError(f"model_path {model_path!r}: no config.json in {path}")
    return path


def _weight_routes(app: FastAPI) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(
        body: wire.UpdateWeightsFromDiskReq, request: Request
    ) -> JSONResponse:
        state = request.app.state
        path = _check_weights_path(state.settings, body.model_path)
        engine: Engine = state.engine
        try:
            n = await engine.update_weights(str(path), body.weight_version, body.abort_all_requests)
        except EngineError as exc:
            resp = wire.UpdateWeightsResp(success=False, message=str(exc))
            return JSONResponse(resp.model_dump(), status_code=400)
        msg = f"loaded {path} as weight version {engine.weight_version}"
        return JSONResponse(
            wire.UpdateWeightsResp(success=True, message=msg, num_paused_requests=n).model_dump()
        )

    @app.post("/update_weight_version")
    async def update_weight_version(body: wire.UpdateWeightVersionReq, request: Request) -> dict:
        await request.app.state.engine.set_weight_version(body.new_version, body.abort_all_requests)
        return {"success": True, "message": f"weight version is {body.new_version}"}

    @app.post("/init_weights_update_group")
    @app.post("/update_weights_from_distributed")
    async def distributed_unsupported() -> JSONResponse:
        msg = "the built-in engine reloads weights from disk only (/update_weights_from_disk)"
        return JSONResponse({"success": False, "message": msg}, status_code=400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        body = await _optional_body(wire.PauseReq, request)
        n = await request.app.state.engine.pause(body.mode)
        return {"success": True, "message": f"paused ({body.mode})", "num_aborted_requests": n}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        await request.app.state.engine.resume()
        return {"success": True, "message": "generation continues"}

    @app.post("/abort_request")
    async def abort_request(body: wire.AbortReq, request: Request) -> dict:
        engine: Engine = request.app.state.engine
        if not body.abort_all and body.rid is None:
            raise EngineError("abort_request: give rid or abort_all: true")
        n = await engine.abort(None if body.abort_all else body.rid)
        return {"success": True, "num_aborted_requests": n}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> JSONResponse:
        if not request.app.state.engine.can_flush():
            return error("cannot flush the cache while requests are running; retry", 400)
        return JSONResponse({"success": True, "message": "cache flushed"})


async def _optional_body(model: type[M], request: Request) -> M:
    """Parse a body that may be empty (SGLang clients send `{}` or nothing)."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise EngineError(f"request body is not JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from None


# ---------------------------------------------------------------------- health, info, metrics
def _info_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        ok = request.app.state.engine.alive()
        return Response(status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        engine: Engine = request.app.state.engine
        if not engine.alive():
            return Response(status_code=503)
        if engine.paused:  # a weight update is in progress: healthy, not generating
            return Response(status_code=200)
        probe = wire.SamplingParamsIn(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        rid = f"health-{uuid.uuid4().hex}"
        timeout = request.app.state.settings.health_generate_timeout_s
        try:
            await asyncio.wait_for(engine.generate([0], probe, rid), timeout)
        except (TimeoutError, EngineError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict:
        engine: Engine = request.app.state.engine
        cfg = engine.model.config
        archs = getattr(cfg, "architectures", None) or [type(engine.model).__name__]
        return wire.ModelInfo(
            model_path=engine.model_path,
            tokenizer_path=request.app.state.settings.tokenizer_path,
            weight_version=engine.weight_version,
            architectures=list(archs),
            context_length=engine.opts.context_length,
        ).model_dump()

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict:
        engine: Engine = request.app.state.engine
        s = engine.stats()
        return {
            **request.app.state.settings.server_args,
            "version": SERVER_VERSION,
            "weight_version": s.weight_version,
            "model_path": engine.model_path,
            "max_running_requests": engine.opts.max_running_requests,
            "context_length": engine.opts.context_length,
            "num_running_reqs": s.running,
            "num_queue_reqs": s.waiting,
            "paused": s.paused,
            "last_error": s.last_error,
            # responses carry meta_info.output_token_versions (SGLang's do not)
            "output_token_versions": True,
            "time": time.time(),
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        data = generate_latest(request.app.state.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)
