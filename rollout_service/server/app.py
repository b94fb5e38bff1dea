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
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from areal_hex.gc_freeze import freeze_startup
from areal_hex.weight_net import GroupSpec
from rollout_service import control_wire, wire
from rollout_service.server import prompts
from rollout_service.server.engine import Engine
from rollout_service.server.generate_routes import add_generate_routes
from rollout_service.server.http_common import ApiKeyGate, BodyLimit, error
from rollout_service.server.metrics import build_registry
from rollout_service.server.openai_routes import add_openai_routes
from rollout_service.server.requests import EngineError

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
    # characters of one text prompt, checked before tokenizing (None: 32 per context token)
    max_prompt_chars: int | None = None
    served_model_name: str | None = None  # the OpenAI `model` id; default: the model path
    weights_group_timeout_s: float = 300.0  # receiving a bucket
    weights_join_timeout_s: float = 30.0  # joining a weight group: every rank meets in it

    def prompt_chars(self, context_length: int) -> int:
        return self.max_prompt_chars or prompts.default_max_chars(context_length)


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

    app = guarded(FastAPI(title="areal-hex inference server", lifespan=lifespan), settings)
    add_generate_routes(app)
    _weight_routes(app)
    _memory_routes(app)
    _info_routes(app)
    add_openai_routes(app)
    return app


def guarded(app: FastAPI, settings: ServerSettings) -> FastAPI:
    """The token check, body limit and error shapes every app of this server has (the
    reward-model one too: rollout_service/server/classify_routes.py)."""
    app.add_middleware(ApiKeyGate, open_paths=OPEN_PATHS)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    return app


# ---------------------------------------------------------------------- errors
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts, detail = [], []
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if p not in wire.UNION_TAGS]
        msg = str(err.get("msg"))
        parts.append(f"{'.'.join(str(p) for p in loc)}: {msg}")
        detail.append({"loc": [str(p) for p in loc], "msg": msg, "type": err.get("type")})
    first = detail[0]["loc"] if detail else []
    param = ".".join(first[1:] if first[:1] == ["body"] else first) or None
    body = wire.error_body("invalid request: " + "; ".join(parts), 400, param)
    body["detail"] = json.loads(json.dumps(detail).encode("utf-8", "backslashreplace"))
    return JSONResponse(body, status_code=400)


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    return error(str(exc), exc.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown route, wrong method, unreadable body) in the
    same error shape as ours."""
    return JSONResponse(
        wire.error_body(str(exc.detail), exc.status_code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


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
        body: control_wire.UpdateWeightsFromDiskReq, request: Request
    ) -> JSONResponse:
        """A refusal answers SGLang's `{success: false, message}` (400, 403 for a path
        outside the weights directory)."""
        state = request.app.state
        engine: Engine = state.engine
        try:
            path = _check_weights_path(state.settings, body.model_path)
            n = await engine.update_weights(str(path), body.weight_version, body.abort_all_requests)
        except EngineError as exc:
            resp = control_wire.UpdateWeightsResp(success=False, message=str(exc))
            return JSONResponse(resp.model_dump(), status_code=exc.status)
        msg = f"loaded {path} as weight version {engine.weight_version}"
        return JSONResponse(
            control_wire.UpdateWeightsResp(
                success=True, message=msg, num_paused_requests=n
            ).model_dump()
        )

    @app.post("/update_weight_version")
    async def update_weight_version(
        body: control_wire.UpdateWeightVersionReq, request: Request
    ) -> dict:
        await request.app.state.engine.set_weight_version(body.new_version, body.abort_all_requests)
        return {"success": True, "message": f"weight version is {body.new_version}"}

    _network_weight_routes(app)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        body = await _optional_body(control_wire.PauseReq, request)
        n = await request.app.state.engine.pause(body.mode)
        return {"success": True, "message": f"paused ({body.mode})", "num_aborted_requests": n}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        await request.app.state.engine.resume()
        return {"success": True, "message": "generation continues"}

    @app.post("/abort_request")
    async def abort_request(body: control_wire.AbortReq, request: Request) -> dict:
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


def _network_weight_routes(app: FastAPI) -> None:
    """SGLang's weights over the network: join a group whose rank 0 is the trainer,
    receive buckets by broadcast (rollout_service/controller/weight_sync.py has the
    sequence). Any refusal or failure is SGLang's `{success: false, message}` with 400."""

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(
        body: control_wire.InitWeightsUpdateGroupReq, request: Request
    ) -> JSONResponse:
        spec = GroupSpec(
            master_address=body.master_address,
            master_port=body.master_port,
            world_size=body.world_size,
            group_name=body.group_name,
            backend=body.backend,
        )
        settings = request.app.state.settings
        engine: Engine = request.app.state.engine
        return await _answer(
            engine.init_weights_group(
                spec,
                body.rank_offset,
                settings.weights_group_timeout_s,
                settings.weights_join_timeout_s,
            ),
            f"joined {body.group_name!r} as rank {body.rank_offset} of {body.world_size}",
        )

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
        body: control_wire.UpdateWeightsFromDistributedReq, request: Request
    ) -> JSONResponse:
        engine: Engine = request.app.state.engine
        call = engine.update_weights_from_group(
            body.group_name,
            body.names,
            body.dtypes,
            body.shapes,
            body.weight_version,
            body.abort_all_requests,
        )
        return await _answer(call, f"received {len(body.names)} tensor(s)")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await _optional_body(control_wire.DestroyWeightsUpdateGroupReq, request)
        engine: Engine = request.app.state.engine
        return await _answer(
            engine.destroy_weights_group(body.group_name), f"left {body.group_name!r}"
        )


async def _answer(call: Awaitable[Any], done: str) -> JSONResponse:
    try:
        await call
    except EngineError as exc:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=exc.status)
    return JSONResponse({"success": True, "message": done})


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


# ---------------------------------------------------------------------- colocated mode
def _memory_routes(app: FastAPI) -> None:
    """SGLang's `/release_memory_occupation` and `/resume_memory_occupation` (AReaL's
    colocated mode: the trainer takes the GPU between rollouts). Refused (400) while
    requests are in flight; while memory is released, generation requests get 503."""

    async def change(request: Request, release: bool) -> JSONResponse:
        body = await _optional_body(control_wire.MemoryOccupationReq, request)
        engine: Engine = request.app.state.engine
        try:
            moved = await engine.set_memory(release, body.chosen())
        except EngineError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, exc.status)
        verb = "released" if release else "resumed"
        return JSONResponse({"success": True, "message": f"{verb}: {moved}"})

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> JSONResponse:
        return await change(request, True)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        return await change(request, False)


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
        if engine.paused or engine.released:  # a weight update or colocated training:
            return Response(status_code=200)  # healthy, not generating
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
        return control_wire.ModelInfo(
            model_path=engine.model_path,
            tokenizer_path=request.app.state.settings.tokenizer_path,
            weight_version=engine.weight_version,
            model_type=getattr(cfg, "model_type", None),
            architectures=list(archs),
            context_length=engine.opts.context_length,
        ).model_dump()

    @app.get("/get_load")
    async def get_load(request: Request) -> list[dict]:
        engine: Engine = request.app.state.engine
        s = engine.stats()
        return [
            control_wire.LoadInfo(
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
