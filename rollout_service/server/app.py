"""The inference server's HTTP app: SGLang's native API and the OpenAI-compatible one
over the built-in engine (contract: docs/api.md).

`create_app(engine, settings)` only wires routes; the engine is built elsewhere
(`rollout_service.server.main`) and started/stopped in the lifespan. All state lives on
`app.state`. No client input gets a 5xx: bad values are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from areal_hex.gc_freeze import freeze_startup
from rollout_service import wire
from rollout_service.server.engine import Engine
from rollout_service.server.http_common import (
    SSE_DONE,
    BodyLimit,
    error,
    run_all,
    sse,
    token_matches,
)
from rollout_service.server.metrics import build_registry
from rollout_service.server.openai_routes import add_openai_routes
from rollout_service.server.requests import (
    NO_EXTRA_LOGPROBS,
    EngineError,
    GenRequest,
    LogprobSpec,
    trimmed_text,
)

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
    max_body_bytes: int = 64 * 2**20
    served_model_name: str | None = None  # the OpenAI `model` id; default: the model path


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = engine
        app.state.settings = settings
        app.state.registry = build_registry(engine)
        engine.start()
        freeze_startup()  # the model and the imports: out of every later collection
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="areal-hex inference server", lifespan=lifespan)
    app.middleware("http")(_auth_middleware)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    _generation_routes(app)
    _weight_routes(app)
    _info_routes(app)
    add_openai_routes(app)
    return app


# ---------------------------------------------------------------------- middleware, errors
async def _auth_middleware(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    key = request.app.state.settings.api_key
    if key and request.url.path not in OPEN_PATHS:
        if not token_matches(request.headers.get("authorization", ""), key):
            return error("missing or invalid API key (expected 'Authorization: Bearer ...')", 401)
    return await call_next(request)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts, detail = [], []
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if p not in wire.UNION_TAGS]
        msg = str(err.get("msg"))
        parts.append(f"{'.'.join(str(p) for p in loc)}: {msg}")
        detail.append({"loc": [str(p) for p in loc], "msg": msg, "type": err.get("type")})
    body = wire.error_body("invalid request: " + "; ".join(parts))
    body["detail"] = json.loads(json.dumps(detail).encode("utf-8", "backslashreplace"))
    return JSONResponse(body, status_code=400)


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    return error(str(exc), exc.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown route, wrong method, unreadable body) in the
    same error shape as ours."""
    return JSONResponse(
        wire.error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers
    )


# ---------------------------------------------------------------------- /generate
@dataclass
class _Item:
    prompt: list[int]
    params: wire.SamplingParamsIn
    logprob: bool
    rid: str
    want: LogprobSpec = NO_EXTRA_LOGPROBS
    text_in_logprobs: bool = False


def _items(engine: Engine, body: wire.GenerateReqInput) -> list[_Item]:
    """The engine requests of one call: each prompt `n` times (SGLang's parallel
    sampling: rid `r` becomes `r_0` .. `r_{n-1}`), in prompt-major order."""
    items: list[_Item] = []
    counts = set()
    for i in range(body.batch_size()):
        try:
            prompt, params, logprob, rid = body.item(i)
            start, top = body.logprob_options(i)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise EngineError("text: this server has no tokenizer; send input_ids")
            prompt = list(engine.tokenizer.encode(prompt, add_special_tokens=False))
        want = LogprobSpec(start, top) if logprob else NO_EXTRA_LOGPROBS
        engine.validate(prompt, params, want)
        counts.add(params.n)
        rids = [rid] if params.n == 1 else [rid and f"{rid}_{j}" for j in range(params.n)]
        texts = body.return_text_in_logprobs
        items += [_Item(prompt, params, logprob, r or uuid.uuid4().hex, want, texts) for r in rids]
    if len(counts) > 1:
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
    tokens while it still runs (a streaming chunk: no finish reason yet)."""
    final = upto is None
    n = len(req.output_ids) if final else min(upto or 0, len(req.output_ids))
    ids = list(req.output_ids[:n])
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
        text = item.text_in_logprobs
        start = item.want.start
        meta.output_token_logprobs = _entries(engine, list(req.logprobs[:n]), ids, text)
        prompt_ids = req.prompt[start:] if start >= 0 else []
        inputs = req.input_logprobs if len(req.input_logprobs) == len(prompt_ids) else []
        meta.input_token_logprobs = _entries(
            engine, list(inputs), prompt_ids if inputs else [], text
        )
        if item.want.top:
            meta.output_top_logprobs = _tops(engine, req.output_top[:n], text)
            meta.input_top_logprobs = _tops(engine, req.input_top, text)
        meta.output_token_versions = list(req.versions[:n])
    body = wire.GenerateOutput(
        text=trimmed_text(engine.tokenizer, req, n) if final else _partial(engine, item, ids),
        output_ids=ids,
        meta_info=meta,
    )
    return body.to_wire()


def _partial(engine: Engine, item: _Item, ids: list[int]) -> str:
    tok = engine.tokenizer
    return tok.decode(ids, skip_special_tokens=item.params.skip_special_tokens) if tok else ""


def _open_all(engine: Engine, items: list[_Item]) -> list[tuple[GenRequest, Any]]:
    """Register every request of a call, or none (a refused one releases the others)."""
    opened: list[tuple[GenRequest, Any]] = []
    try:
        for it in items:
            opened.append(engine.open(it.prompt, it.params, it.rid, want=it.want))
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
        many = body.is_batch or len(items) > 1
        if body.stream:
            if many:
                raise EngineError("stream: streaming takes one request (n = 1) per call")
            return _stream(engine, items[0])
        done = await run_all(engine, _open_all(engine, items), request)
        if done is None:
            return Response(status_code=499)
        outs = [_output(engine, it, req) for it, req in zip(items, done, strict=True)]
        return JSONResponse(outs if many else outs[0])


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
            yield sse(wire.error_body(str(exc)))
        yield SSE_DONE
    finally:
        if not task.done():  # the client went away: abort the request
            task.cancel()


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
        """A refusal answers SGLang's `{success: false, message}` (400, 403 for a path
        outside the weights directory)."""
        state = request.app.state
        engine: Engine = state.engine
        try:
            path = _check_weights_path(state.settings, body.model_path)
            n = await engine.update_weights(str(path), body.weight_version, body.abort_all_requests)
        except EngineError as exc:
            resp = wire.UpdateWeightsResp(success=False, message=str(exc))
            return JSONResponse(resp.model_dump(), status_code=exc.status)
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
    except (ValueError, RecursionError) as exc:
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
    @app.get("/model_info")
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

    @app.get("/get_load")
    async def get_load(request: Request) -> list[dict]:
        engine: Engine = request.app.state.engine
        s = engine.stats()
        return [
            wire.LoadInfo(
                num_reqs=s.running + s.waiting,
                num_waiting_reqs=s.waiting,
                num_tokens=engine.running_tokens(),
            ).model_dump()
        ]

    @app.get("/get_server_info")
    @app.get("/server_info")
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
