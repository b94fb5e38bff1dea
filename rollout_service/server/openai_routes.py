"""The OpenAI-compatible routes of the inference server, over the same engine as
`/generate`: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(shapes in openai_wire.py, contract in docs/api.md).

Each choice is one engine request (a prompt asked for `n` times is `n` requests; the
engine prefills identical prompts once). Streaming sends `data: <chunk>` events and
`data: [DONE]`; text that might still become part of a stop string, or an incomplete
UTF-8 character, is held back until it is known.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from rollout_service import openai_wire as ow
from rollout_service.server import prompts
from rollout_service.server.engine import Engine
from rollout_service.server.http_common import SSE_DONE, run_all, sse
from rollout_service.server.requests import (
    NO_EXTRA_LOGPROBS,
    EngineError,
    GenRequest,
    LogprobSpec,
    TopEntry,
    trimmed_text,
)
from rollout_service.wire import LOGPROB_FLOOR, FinishReason, SamplingParamsIn, error_body


@dataclass
class _Job:
    """One choice: one engine request."""

    index: int
    prompt: list[int]
    params: SamplingParamsIn
    want: LogprobSpec
    rid: str
    echo: str = ""  # completions with echo: the prompt text, put before the output


def add_openai_routes(app: FastAPI) -> None:
    started = int(time.time())

    def card(request: Request) -> ow.ModelCard:
        engine: Engine = request.app.state.engine
        return ow.ModelCard(
            id=_model_id(request),
            created=started,
            root=engine.model_path,
            max_model_len=engine.opts.context_length,
        )

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return ow.ModelList(data=[card(request)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        one = card(request)
        if model_id != one.id:
            msg = f"model: {model_id!r} is not served here (this server: {one.id!r})"
            raise EngineError(msg, 404)
        return one.model_dump()

    @app.post("/v1/completions")
    async def completions(body: ow.CompletionRequest, request: Request) -> Response:
        engine: Engine = request.app.state.engine
        jobs = await _completion_jobs(engine, body, _max_chars(request))
        head = _Head(f"cmpl-{uuid.uuid4().hex}", int(time.time()), _model_id(request))
        if body.stream and body.echo:
            raise EngineError("echo: not supported with stream")
        kind = (_stream_completion, _completion_choice, ow.CompletionResponse)
        return await _respond(engine, request, head, jobs, body, *kind)

    @app.post("/v1/chat/completions")
    async def chat(body: ow.ChatRequest, request: Request) -> Response:
        engine: Engine = request.app.state.engine
        jobs = await _chat_jobs(engine, body, _max_chars(request))
        head = _Head(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), _model_id(request))
        return await _respond(
            engine, request, head, jobs, body, _stream_chat, _chat_choice, ow.ChatResponse
        )


@dataclass
class _Head:
    id: str
    created: int
    model: str


def _model_id(request: Request) -> str:
    settings = request.app.state.settings
    return str(settings.served_model_name or request.app.state.engine.model_path)


# ---------------------------------------------------------------------- requests -> jobs
def _sampling(
    engine: Engine,
    body: ow.CompletionRequest | ow.ChatRequest,
    limit: int | None,
    prompt: list[int],
) -> SamplingParamsIn:
    """SamplingParamsIn of one choice; no token limit: up to the context length."""
    if limit is None:
        limit = max(engine.opts.context_length - len(prompt), 0)
    try:
        return ow.to_sampling(body.sampling(limit))
    except ValueError as exc:
        if not isinstance(exc, ValidationError):
            raise EngineError(str(exc)) from None
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise EngineError(f"{where}: {err['msg']}") from None


def _max_chars(request: Request) -> int:
    engine: Engine = request.app.state.engine
    return int(request.app.state.settings.prompt_chars(engine.opts.context_length))


async def _completion_jobs(
    engine: Engine, body: ow.CompletionRequest, max_chars: int
) -> list[_Job]:
    texts_or_ids = body.prompts()
    if not texts_or_ids:
        raise EngineError("prompt: empty")
    want = NO_EXTRA_LOGPROBS
    if body.logprobs is not None:
        want = LogprobSpec(0 if body.echo else -1, body.logprobs)
    texts = [p for p in texts_or_ids if isinstance(p, str)]
    encoded = iter(await prompts.encode(engine.tokenizer, texts, "prompt", max_chars))
    jobs: list[_Job] = []
    for p in texts_or_ids:
        if isinstance(p, str):
            ids, echo = next(encoded), p
        else:
            ids = list(p)
            echo = (
                engine.tokenizer.decode(ids) if engine.tokenizer is not None and body.echo else ""
            )
        params = _sampling(engine, body, body.max_tokens, ids)
        engine.validate(ids, params, want)
        for j in range(body.n):
            rid = f"cmpl-{uuid.uuid4().hex}"
            jobs.append(
                _Job(len(jobs), ids, params.for_sample(j), want, rid, echo if body.echo else "")
            )
    return jobs


async def _chat_jobs(engine: Engine, body: ow.ChatRequest, max_chars: int) -> list[_Job]:
    messages = [m.for_template() for m in body.messages]
    kwargs = dict(body.chat_template_kwargs or {})
    ids = await prompts.encode_chat(engine.tokenizer, messages, kwargs, max_chars)
    want = LogprobSpec(-1, body.top_logprobs or 0) if body.logprobs else NO_EXTRA_LOGPROBS
    if body.top_logprobs and not body.logprobs:
        raise EngineError("top_logprobs: needs logprobs: true")
    params = _sampling(engine, body, body.token_limit, ids)
    engine.validate(ids, params, want)
    return [
        _Job(j, ids, params.for_sample(j), want, f"chatcmpl-{uuid.uuid4().hex}")
        for j in range(body.n)
    ]


def _open(
    engine: Engine, jobs: list[_Job], streams: _Streams | None = None
) -> list[tuple[GenRequest, Any]]:
    """Register every job's request, or none (EngineError: refused)."""
    opened: list[tuple[GenRequest, Any]] = []
    try:
        for job in jobs:
            hook = streams.hook(job.index) if streams is not None else None
            opened.append(engine.open(job.prompt, job.params, job.rid, hook, job.want))
    except EngineError:
        for req, _ in opened:
            engine.finish(req, FinishReason(type="abort", message="request refused"))
        raise
    return opened


def _open_streams(engine: Engine, jobs: list[_Job]) -> _Streams:
    streams = _Streams(len(jobs))
    streams.start(engine, _open(engine, jobs, streams))
    return streams


# ---------------------------------------------------------------------- whole responses
def _finish(req: GenRequest) -> tuple[str, int | str | None]:
    f = req.finish
    assert f is not None
    return f.type, f.matched if f.type == "stop" else None


async def _respond(
    engine: Engine,
    request: Request,
    head: _Head,
    jobs: list,
    body: Any,
    stream_events: Callable[..., Any],
    choice: Callable[..., Any],
    response_type: type,
) -> Response:
    """The one path of both OpenAI routes: a stream of events, or every job run to its
    end and answered as `response_type` with one choice per job (499: the client left)."""
    if body.stream:
        streams = _open_streams(engine, jobs)
        events = stream_events(engine, head, jobs, streams, body)
        return StreamingResponse(events, media_type="text/event-stream")
    done = await run_all(engine, _open(engine, jobs), request)
    if done is None:
        return Response(status_code=499)
    choices = [choice(engine, job, req, body) for job, req in zip(jobs, done, strict=True)]
    resp = response_type(
        id=head.id,
        created=head.created,
        model=head.model,
        choices=choices,
        usage=_usage(jobs, done),
    )
    return JSONResponse(resp.model_dump())


def _usage(jobs: Sequence[_Job], reqs: Sequence[GenRequest]) -> ow.Usage:
    seen: set[int] = set()
    prompt = 0
    for job in jobs:  # a prompt asked for n times counts once
        if id(job.prompt) not in seen:
            seen.add(id(job.prompt))
            prompt += len(job.prompt)
    completion = sum(len(r.output_ids) for r in reqs)
    return ow.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _token_texts(engine: Engine, ids: Sequence[int]) -> list[str]:
    tok = engine.tokenizer
    return [str(tok.decode([t])) if tok is not None else str(t) for t in ids]


def _special_ids(engine: Engine) -> frozenset[int]:
    ids = getattr(engine.tokenizer, "all_special_ids", None) if engine.tokenizer else None
    return frozenset(ids or ())


def _floor(lp: float | None) -> float | None:
    return None if lp is None else max(lp, LOGPROB_FLOOR)


def _top_dict(engine: Engine, entry: TopEntry | None) -> dict[str, float] | None:
    if entry is None:
        return None
    texts = _token_texts(engine, [t for _, t in entry])
    return {s: max(lp, LOGPROB_FLOOR) for s, (lp, _) in zip(texts, entry, strict=True)}


def _completion_logprobs(
    engine: Engine, job: _Job, req: GenRequest, lo: int, hi: int, text_start: int
) -> ow.CompletionLogprobs:
    """Legacy logprobs of output tokens lo..hi (with echo and lo = 0, the prompt's first)."""
    ids: list[int] = []
    lps: list[float | None] = []
    tops: list[TopEntry | None] = []
    if job.echo and lo == 0:
        ids += job.prompt
        lps += list(req.input_logprobs)
        tops += list(req.input_top) if req.input_top else [[] for _ in job.prompt]
    ids += req.output_ids[lo:hi]
    lps += req.logprobs[lo:hi]
    tops += req.output_top[lo:hi] if req.output_top else [[] for _ in range(hi - lo)]
    texts = _token_texts(engine, ids)
    # A special token that `text` leaves out (skip_special_tokens) takes no room in it.
    hidden = _special_ids(engine) if job.params.skip_special_tokens else frozenset()
    first_output = len(job.prompt) if job.echo and lo == 0 else 0
    offsets, at = [], text_start
    for k, (s, t) in enumerate(zip(texts, ids, strict=True)):
        offsets.append(at)
        at += 0 if k >= first_output and t in hidden else len(s)
    return ow.CompletionLogprobs(
        tokens=texts,
        token_logprobs=[_floor(lp) for lp in lps],
        top_logprobs=[_top_dict(engine, e) for e in tops],
        text_offset=offsets,
    )


def _completion_choice(
    engine: Engine, job: _Job, req: GenRequest, body: ow.CompletionRequest
) -> ow.CompletionChoice:
    reason, matched = _finish(req)
    logprobs = None
    if body.logprobs is not None:
        logprobs = _completion_logprobs(engine, job, req, 0, len(req.output_ids), 0)
    return ow.CompletionChoice(
        index=job.index,
        text=job.echo + trimmed_text(engine.tokenizer, req, len(req.output_ids)),
        logprobs=logprobs,
        finish_reason=reason,
        matched_stop=matched,
    )


def _chat_logprobs(engine: Engine, req: GenRequest, lo: int, hi: int) -> ow.ChatLogprobs:
    ids = req.output_ids[lo:hi]
    content = []
    for k, (s, lp) in enumerate(zip(_token_texts(engine, ids), req.logprobs[lo:hi], strict=True)):
        entry = req.output_top[lo + k] if req.output_top else []
        alts = _token_texts(engine, [t for _, t in entry])
        top = [
            ow.TopLogprob(token=a, logprob=max(alp, LOGPROB_FLOOR), bytes=list(a.encode()))
            for a, (alp, _) in zip(alts, entry, strict=True)
        ]
        content.append(
            ow.TokenLogprob(
                token=s, logprob=max(lp, LOGPROB_FLOOR), bytes=list(s.encode()), top_logprobs=top
            )
        )
    return ow.ChatLogprobs(content=content)


def _chat_choice(engine: Engine, job: _Job, req: GenRequest, body: ow.ChatRequest) -> ow.ChatChoice:
    reason, matched = _finish(req)
    return ow.ChatChoice(
        index=job.index,
        message=ow.AssistantMessage(
            content=trimmed_text(engine.tokenizer, req, len(req.output_ids))
        ),
        logprobs=_chat_logprobs(engine, req, 0, len(req.output_ids)) if body.logprobs else None,
        finish_reason=reason,
        matched_stop=matched,
    )


# ---------------------------------------------------------------------- streaming
class _Streams:
    """Progress of several engine requests, as (choice index, finished) events."""

    def __init__(self, n: int) -> None:
        self.queue: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        self.reqs: list[GenRequest] = []
        self.tasks: list[asyncio.Future[GenRequest]] = []
        self.n = n

    def hook(self, index: int) -> Any:
        return lambda _n: self.queue.put_nowait((index, False))

    def start(self, engine: Engine, opened: list[tuple[GenRequest, Any]]) -> None:
        for i, (req, fut) in enumerate(opened):
            task = asyncio.ensure_future(engine.run(req, fut))
            task.add_done_callback(lambda _t, i=i: self.queue.put_nowait((i, True)))
            self.reqs.append(req)
            self.tasks.append(task)

    async def events(self) -> AsyncIterator[tuple[int, bool]]:
        left = self.n
        try:
            while left:
                index, finished = await self.queue.get()
                if finished:
                    left -= 1
                    self.tasks[index].result()  # EngineError: the stream ends with it
                yield index, finished
        finally:
            for t in self.tasks:
                if not t.done():  # the client went away: abort what still runs
                    t.cancel()


@dataclass
class _Sent:
    text: str = ""
    tokens: int = 0


def _delta(engine: Engine, req: GenRequest, sent: _Sent, finished: bool) -> tuple[str, int, int]:
    """(new text, first token, end token) of a choice since the last chunk. While it
    runs, text that could still turn out to be a stop string (or an incomplete UTF-8
    character) is held back; the final text is trimmed like a whole response."""
    upto = len(req.output_ids)
    if finished:
        text = trimmed_text(engine.tokenizer, req, upto)
    else:
        text = trimmed_text(engine.tokenizer, req, upto).rstrip("\ufffd")
        hold = max((len(s) for s in req.sampling.stop_texts), default=0)
        text = text[: max(len(text) - hold, len(sent.text))]
    new = text[len(sent.text) :] if text.startswith(sent.text) else ""
    lo = sent.tokens
    if new or finished:
        # Tokens whose text is held back (or that make no text) stay unsent: their
        # log-probs go out with the next chunk that carries text, or the final one.
        sent.text += new
        sent.tokens = upto
    return new, lo, upto


async def _stream_completion(
    engine: Engine,
    head: _Head,
    jobs: list[_Job],
    streams: _Streams,
    body: ow.CompletionRequest,
) -> AsyncIterator[bytes]:
    sent = [_Sent() for _ in jobs]
    try:
        async for index, finished in streams.events():
            req = streams.reqs[index]
            at = len(sent[index].text)
            new, lo, hi = _delta(engine, req, sent[index], finished)
            if not new and not finished:
                continue
            reason, matched = _finish(req) if finished else (None, None)
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(engine, jobs[index], req, lo, hi, at)
            choice = ow.CompletionChoice(
                index=index, text=new, logprobs=logprobs, finish_reason=reason, matched_stop=matched
            )
            chunk = ow.CompletionResponse(
                id=head.id, created=head.created, model=head.model, choices=[choice]
            )
            yield sse(chunk.model_dump(exclude_none=True))
        if body.include_usage:
            usage = ow.CompletionResponse(
                id=head.id,
                created=head.created,
                model=head.model,
                choices=[],
                usage=_usage(jobs, streams.reqs),
            )
            yield sse(usage.model_dump(exclude_none=True))
    except EngineError as exc:
        yield sse(error_body(str(exc), exc.status))
    yield SSE_DONE


async def _stream_chat(
    engine: Engine,
    head: _Head,
    jobs: list[_Job],
    streams: _Streams,
    body: ow.ChatRequest,
) -> AsyncIterator[bytes]:
    def chunk(choices: list[ow.ChatChunkChoice], usage: ow.Usage | None = None) -> bytes:
        c = ow.ChatChunk(
            id=head.id, created=head.created, model=head.model, choices=choices, usage=usage
        )
        return sse(c.model_dump(exclude_none=True))

    sent = [_Sent() for _ in jobs]
    try:
        for job in jobs:
            first = ow.ChatChunkChoice(
                index=job.index, delta=ow.Delta(role="assistant", content="")
            )
            yield chunk([first])
        async for index, finished in streams.events():
            req = streams.reqs[index]
            new, lo, hi = _delta(engine, req, sent[index], finished)
            if not new and not finished:
                continue
            reason, matched = _finish(req) if finished else (None, None)
            choice = ow.ChatChunkChoice(
                index=index,
                delta=ow.Delta(content=new) if new else ow.Delta(),
                logprobs=_chat_logprobs(engine, req, lo, hi) if body.logprobs else None,
                finish_reason=reason,
                matched_stop=matched,
            )
            yield chunk([choice])
        if body.include_usage:
            yield chunk([], _usage(jobs, streams.reqs))
    except EngineError as exc:
        yield sse(error_body(str(exc), exc.status))
    yield SSE_DONE
