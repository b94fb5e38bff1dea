"""HTTP pieces both APIs of the inference server share (SGLang native in app.py, OpenAI
in openai_routes.py): error responses, server-sent events, client-disconnect detection,
the request body limit and the bearer-token check."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import pydantic_core
from fastapi import Request
from fastapi.responses import JSONResponse

from rollout_service import wire
from rollout_service.server.engine import Engine
from rollout_service.server.requests import GenRequest

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class FastJSON(JSONResponse):
    """JSONResponse encoded by pydantic-core's serializer: the same JSON as the standard
    library's, a fifth of its CPU time on a group's outputs (a float, like a NaN or an
    infinity that has no JSON form, is written as SGLang's orjson responses write it:
    shortest round-trip digits, null)."""

    def render(self, content: Any) -> bytes:
        return pydantic_core.to_json(content, inf_nan_mode="null")


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(wire.error_body(message, status), status_code=status)


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


async def disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body is already read, so the
    next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_all(
    engine: Engine, opened: list[tuple[GenRequest, Any]], request: Request
) -> list[GenRequest] | None:
    """Run the opened requests to their end (sent to the engine together); None if the
    client went away first (the requests are then aborted, which frees their batch
    slots)."""
    work = asyncio.ensure_future(engine.run_many(opened))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    return work.result()


def token_matches(header: str, key: str) -> bool:
    """Whether an Authorization header value is `Bearer <key>`. Header values arrive
    latin-1 decoded; the comparison is on bytes and in constant time, so a non-ASCII
    token is a mismatch, not an error."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = token.strip().encode("latin-1", errors="replace")
    return secrets.compare_digest(given, key.encode("utf-8"))


class ApiKeyGate:
    """ASGI middleware: with `app.state.settings.api_key` set, every path but `open_paths`
    needs `Authorization: Bearer <key>` (401 otherwise). Plain ASGI rather than
    `@app.middleware("http")`, which costs a task and a memory stream per request."""

    def __init__(self, app: ASGIApp, open_paths: frozenset[str]) -> None:
        self.app = app
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            key = scope["app"].state.settings.api_key
            request = Request(scope)
            if key and request.url.path not in self.open_paths:
                if not token_matches(request.headers.get("authorization", ""), key):
                    msg = "missing or invalid API key (expected 'Authorization: Bearer ...')"
                    await error(msg, 401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is refused with 413 when its
    Content-Length says so; a chunked one is cut off when it passes the limit (FastAPI
    then answers 400, as for any body it cannot read)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            msg = f"request body over {self.max_bytes} bytes (Content-Length: {declared.decode()})"
            await error(msg, 413)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise ValueError(f"request body over {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)
